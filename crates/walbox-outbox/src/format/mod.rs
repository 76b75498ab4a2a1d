//! Envelope formats: the step from an event's fields to the record a sink sends.
//!
//! A source (an outbox table row, or any other carrier of the same fields) first
//! yields [`EventFields`]: event id, topic, aggregate type and id, event type,
//! payload, headers, occurrence and commit time, schema version, extra fields and
//! the source position. A [`Formatter`], built once from the configuration, then
//! shapes them as walbox's envelope, as Debezium's Outbox Event Router emits them,
//! or as a CloudEvent (binary or structured content mode) in the protocol binding
//! of the sink ([`Binding`]). Every format keeps
//! the source position headers (`walbox_commit_lsn`, `walbox_index`, `walbox_xid`).

mod binding;
mod cloudevents;
mod debezium;
mod walbox;

use binding::percent_decode;
pub use binding::{Binding, Protocol};

use bytes::Bytes;

use crate::config::{CloudEventsMode, Format, FormatSettings, KeyEncoding, Place, Placement};
use crate::event::{Event, HeaderName, Position, header};
use crate::mapper::{MappingError, RowError};
use crate::template::TopicTemplate;

/// Text known to be UTF-8, sharing its source's buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Text(Bytes);

impl Text {
    /// `bytes` when they are UTF-8.
    pub fn new(bytes: Bytes) -> Result<Self, std::str::Utf8Error> {
        std::str::from_utf8(&bytes)?;
        Ok(Text(bytes))
    }

    /// The text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        // Checked in `new`.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }

    /// The text's bytes.
    #[must_use]
    pub fn bytes(&self) -> &Bytes {
        &self.0
    }
}

impl From<String> for Text {
    fn from(s: String) -> Self {
        Text(Bytes::from(s))
    }
}

/// What a payload's bytes hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadKind {
    /// JSON checked by its source (a json or jsonb column).
    Json,
    /// Text that should hold JSON (not checked yet).
    Text,
    /// Bytes that should hold JSON (not checked yet; a format may pass them on as
    /// they are).
    Binary,
}

/// An event's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload {
    /// The payload's bytes.
    pub bytes: Bytes,
    /// What they hold.
    pub kind: PayloadKind,
}

/// How an extra field's value is written into JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtraKind {
    /// A number (written as a JSON number when it is one, else as a string).
    Number,
    /// A boolean (`t`/`true`, `f`/`false`).
    Bool,
    /// Anything else: a JSON string.
    Text,
}

/// The value of an extra field ([`Placement`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extra {
    /// The value's text.
    pub value: Text,
    /// How it is written into JSON.
    pub kind: ExtraKind,
}

/// An event's fields, before a format shapes them into a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventFields {
    /// The event id (stable across re-publication).
    pub event_id: Text,
    /// Destination topic, already validated.
    pub topic: String,
    /// Aggregate type, when the source has one.
    pub aggregate_type: Option<Text>,
    /// Aggregate id, the record key, when the source has one.
    pub aggregate_id: Option<Bytes>,
    /// What the aggregate id's source holds: a number (an integer column, a
    /// JSON number) or text; what `key_encoding = "json"` writes it as.
    pub key_kind: ExtraKind,
    /// Event type, when the source has one.
    pub event_type: Option<Text>,
    /// Schema version of the payload, when the source has one.
    pub schema_version: Option<Text>,
    /// When the event happened: PostgreSQL ISO output or RFC 3339.
    pub occurred_at: Option<Text>,
    /// Commit time of the source transaction (PostgreSQL microseconds since
    /// 2000-01-01 UTC), when known.
    pub commit_time: Option<i64>,
    /// The payload (absent when the value is taken as it is).
    pub payload: Option<Payload>,
    /// A ready-made value taken as it is (format `walbox` only).
    pub value: Option<Bytes>,
    /// Headers from the source, in order.
    pub headers: Vec<(HeaderName, Bytes)>,
    /// Extra fields, one per configured [`Placement`] in order (`None`: NULL).
    pub extra: Vec<Option<Extra>>,
    /// Source position.
    pub position: Position,
}

/// Names of the source's fields, for errors that name them (never their values).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FieldNames {
    /// The event id's field.
    pub id: String,
    /// The aggregate id's field.
    pub aggregate_id: String,
    /// The aggregate type's field.
    pub aggregate_type: String,
    /// The event type's field.
    pub event_type: String,
    /// The payload's field.
    pub payload: String,
    /// The occurrence time's field.
    pub occurred_at: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CeField {
    Source,
    Id,
    AggregateType,
    AggregateId,
    EventType,
}

#[derive(Debug, Clone)]
struct CeTemplate {
    template: TopicTemplate,
    fields: Vec<CeField>,
}

#[derive(Debug, Clone)]
struct CloudEventsSettings {
    mode: CloudEventsMode,
    binding: Binding,
    source: CeTemplate,
    subject: Option<CeTemplate>,
}

/// A [`Format`] ready to shape events: its templates parsed, its placements
/// checked.
#[derive(Debug, Clone)]
pub struct Formatter {
    shape: Shape,
    source: String,
    producer_json: String,
    names: FieldNames,
    placements: Vec<Placement>,
    key_encoding: KeyEncoding,
}

/// The format with what it needs to shape a record.
#[derive(Debug, Clone)]
enum Shape {
    Walbox,
    DebeziumOutbox,
    CloudEvents(CloudEventsSettings),
}

impl Formatter {
    /// The formatter of `config`'s format for events from `source` (`schema.table`,
    /// or another source name, `{table}` in templates), `producer` naming this
    /// relay in envelopes, `names` the source's field names for errors.
    ///
    /// # Errors
    /// A template that does not parse or names an unknown field, placements with
    /// a format other than `debezium-outbox`.
    pub fn new(
        config: &FormatSettings,
        source: &str,
        producer: &str,
        names: FieldNames,
    ) -> Result<Self, MappingError> {
        let problem = |problem: String| MappingError::Format {
            table: source.to_owned(),
            format: config.format.name(),
            problem,
        };
        if let Some(p) = settings_problem(config) {
            return Err(problem(p));
        }
        let shape = match config.format {
            Format::Walbox => Shape::Walbox,
            Format::DebeziumOutbox => Shape::DebeziumOutbox,
            Format::CloudEvents => {
                let parse = |key: &str, text: &str| -> Result<CeTemplate, MappingError> {
                    let template =
                        TopicTemplate::parse(text).map_err(|e| problem(format!("{key}: {e}")))?;
                    let fields = template
                        .fields()
                        .map(|f| match f {
                            "table" | "source" => Ok(CeField::Source),
                            "id" | "event_id" => Ok(CeField::Id),
                            "aggregate_type" => Ok(CeField::AggregateType),
                            "aggregate_id" => Ok(CeField::AggregateId),
                            "event_type" => Ok(CeField::EventType),
                            other => Err(problem(format!(
                                "{key}: unknown placeholder {{{other}}}; use {{table}}, {{id}}, \
                             {{aggregate_type}}, {{aggregate_id}} or {{event_type}}"
                            ))),
                        })
                        .collect::<Result<_, _>>()?;
                    Ok(CeTemplate { template, fields })
                };
                Shape::CloudEvents(CloudEventsSettings {
                    mode: config
                        .cloudevents_mode
                        .unwrap_or(config.binding.default_mode),
                    binding: config.binding,
                    source: parse("cloudevents_source", &config.cloudevents_source)?,
                    subject: if config.cloudevents_subject.is_empty() {
                        None
                    } else {
                        Some(parse("cloudevents_subject", &config.cloudevents_subject)?)
                    },
                })
            }
        };
        Ok(Formatter {
            shape,
            source: source.to_owned(),
            producer_json: serde_json::Value::from(producer).to_string(),
            names,
            placements: config.additional_placement.clone(),
            key_encoding: config.key_encoding,
        })
    }

    /// The format.
    #[must_use]
    pub fn format(&self) -> Format {
        match self.shape {
            Shape::Walbox => Format::Walbox,
            Shape::DebeziumOutbox => Format::DebeziumOutbox,
            Shape::CloudEvents(_) => Format::CloudEvents,
        }
    }

    /// The configured placements, in the order [`EventFields::extra`] follows.
    #[must_use]
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    /// Shapes `fields` into the record a sink sends.
    ///
    /// # Errors
    /// A payload that must be JSON and is not, a field the format needs that is
    /// absent (named, never its value).
    pub fn render(&self, fields: EventFields) -> Result<Event, RowError> {
        if let Some((name, _)) = fields
            .headers
            .iter()
            .find(|(name, value)| self.reserved_header(name, value))
        {
            return Err(RowError::ReservedHeader {
                name: name.to_string(),
            });
        }
        match &self.shape {
            Shape::Walbox => self.walbox(fields),
            Shape::DebeziumOutbox => self.debezium(fields),
            Shape::CloudEvents(ce) => self.cloudevents(ce, fields),
        }
    }

    /// Whether a source header named `name` (holding `value`) would stand beside
    /// one walbox writes: the position headers (`walbox_*`), the event id's
    /// header in any format (`event_id`, `ce_id`, and `ce_specversion`, which
    /// marks a CloudEvent), a structured CloudEvent's content type, and the
    /// names this format writes itself. A record with two values under one name
    /// lets readers (verify, dead letters, consumers) take the application's for
    /// walbox's, so such a row is refused. Names compare without case (NATS
    /// headers do).
    fn reserved_header(&self, name: &str, value: &[u8]) -> bool {
        let name = name.to_ascii_lowercase();
        let everywhere = name.starts_with("walbox_")
            || name == header::EVENT_ID
            || name == cloudevents::ID_HEADER
            || name == cloudevents::SPEC_VERSION_HEADER
            || name == cloudevents::DASH_ID_HEADER
            || name == cloudevents::DASH_SPEC_VERSION_HEADER
            || name == AMQP_ID_HEADER
            || name == AMQP_SPEC_VERSION_HEADER
            || (name == cloudevents::CONTENT_TYPE_HEADER
                && value == cloudevents::STRUCTURED_CONTENT_TYPE.as_bytes());
        everywhere
            || match &self.shape {
                Shape::Walbox => [
                    header::EVENT_TYPE,
                    header::SCHEMA_VERSION,
                    header::AGGREGATE_TYPE,
                ]
                .contains(&name.as_str()),
                Shape::DebeziumOutbox => {
                    name == debezium::ID_HEADER
                        || self
                            .placements
                            .iter()
                            .any(|p| p.place == Place::Header && p.name.eq_ignore_ascii_case(&name))
                }
                Shape::CloudEvents(ce) => {
                    name.starts_with("ce_")
                        || name.starts_with("ce-")
                        || name.starts_with(&ce.binding.prefix.to_ascii_lowercase())
                        || name == cloudevents::CONTENT_TYPE_HEADER
                }
            }
    }

    /// The payload as JSON: checked when its source did not.
    fn payload_json(&self, payload: Payload) -> Result<Bytes, RowError> {
        if payload.kind != PayloadKind::Json {
            serde_json::from_slice::<serde::de::IgnoredAny>(&payload.bytes).map_err(|e| {
                RowError::PayloadNotJson {
                    column: self.names.payload.clone(),
                    reason: format!(
                        "{} at line {} column {}",
                        classify(&e),
                        e.line(),
                        e.column()
                    ),
                }
            })?;
        }
        Ok(payload.bytes)
    }

    fn require_payload(&self, payload: Option<Payload>) -> Result<Payload, RowError> {
        payload.ok_or_else(|| RowError::Null {
            role: "payload",
            column: self.names.payload.clone(),
        })
    }
}

/// Why `config`'s placements or key encoding do not fit its format, if they
/// do not.
pub(crate) fn settings_problem(config: &FormatSettings) -> Option<String> {
    if config.format == Format::DebeziumOutbox {
        return None;
    }
    if !config.additional_placement.is_empty() {
        return Some(
            "additional_placement applies to format \"debezium-outbox\" only; remove it or \
             set format = \"debezium-outbox\""
                .to_owned(),
        );
    }
    (config.key_encoding != KeyEncoding::String).then(|| {
        format!(
            "key_encoding = {:?} applies to format \"debezium-outbox\" only; remove it or set \
             format = \"debezium-outbox\"",
            config.key_encoding.name()
        )
    })
}

fn classify(e: &serde_json::Error) -> &'static str {
    match e.classify() {
        serde_json::error::Category::Io => "I/O error",
        serde_json::error::Category::Syntax => "syntax error",
        serde_json::error::Category::Data => "unexpected data",
        serde_json::error::Category::Eof => "unexpected end",
    }
}

/// The event id a published record carries, whatever its format. `header`
/// gives a header's value by name (exactly as written). Source headers never
/// use the names looked at here for another meaning ([`Formatter::render`]
/// refuses them), so the first that applies is the record's: walbox's
/// `event_id` header (also on every dead letter), a binary CloudEvent's `ce_id`
/// (Kafka, marked by `ce_specversion`), `ce-id` (NATS, marked by
/// `ce-specversion`, percent-decoded) or `cloudEvents_id` (AMQP, marked by
/// `cloudEvents_specversion`), a structured CloudEvent's `id` in the
/// value (`content-type` on Kafka, `Content-Type` on NATS), Debezium's `id`
/// header.
pub fn record_event_id<'a>(
    header: impl Fn(&str) -> Option<&'a str>,
    value: Option<&[u8]>,
) -> Option<String> {
    if let Some(id) = header(header::EVENT_ID) {
        return Some(id.to_owned());
    }
    if header(cloudevents::SPEC_VERSION_HEADER).is_some() {
        return header(cloudevents::ID_HEADER).map(str::to_owned);
    }
    if header(cloudevents::DASH_SPEC_VERSION_HEADER).is_some() {
        return header(cloudevents::DASH_ID_HEADER)
            .and_then(percent_decode)
            .map(std::borrow::Cow::into_owned);
    }
    let amqp = Protocol::Amqp.cloudevents();
    if header(&amqp.attribute("specversion")).is_some() {
        return header(&amqp.attribute("id")).map(str::to_owned);
    }
    let structured = [
        Protocol::Kafka.cloudevents().structured_content_type,
        Protocol::Nats.cloudevents().structured_content_type,
    ]
    .into_iter()
    .any(|name| header(name) == Some(cloudevents::STRUCTURED_CONTENT_TYPE));
    if structured {
        #[derive(serde::Deserialize)]
        struct Id {
            id: String,
        }
        return serde_json::from_slice::<Id>(value?).ok().map(|e| e.id);
    }
    header(debezium::ID_HEADER).map(str::to_owned)
}

/// The AMQP binding's id and specversion attributes, lower-cased as
/// [`Formatter::reserved_header`] compares names.
const AMQP_ID_HEADER: &str = "cloudevents_id";
const AMQP_SPEC_VERSION_HEADER: &str = "cloudevents_specversion";

/// Appends the event id header under `name`.
fn push_id(headers: &mut Vec<(HeaderName, Bytes)>, name: &'static str, id: &Text) {
    headers.push((name.into(), id.bytes().clone()));
}

/// The source position headers: commit LSN, index, xid (one buffer for the three).
pub(crate) fn push_position(headers: &mut Vec<(HeaderName, Bytes)>, position: Position) {
    use std::fmt::Write as _;
    let mut buf = bytes::BytesMut::with_capacity(48);
    // Writing to a BytesMut cannot fail.
    let _ = write!(buf, "{}", position.commit_lsn);
    let lsn = buf.split().freeze();
    let _ = write!(buf, "{}", position.index);
    let index = buf.split().freeze();
    let _ = write!(buf, "{}", position.xid);
    headers.push((header::COMMIT_LSN.into(), lsn));
    headers.push((header::INDEX.into(), index));
    headers.push((header::XID.into(), buf.freeze()));
}

fn json_str(out: &mut bytes::BytesMut, s: &str) {
    use bytes::BufMut as _;
    // serde_json's string escaping, written straight into the buffer.
    let _ = serde_json::to_writer(out.writer(), s);
}

#[cfg(test)]
mod tests;
