//! Compiling a [`TableConfig`] against a table's shape and mapping its rows.

use std::borrow::Cow;

use bytes::{BufMut, Bytes, BytesMut};
use walbox_pgoutput::{Oid, Relation, TupleValue};

use crate::config::{TableConfig, ValueFormat};
use crate::event::{Event, HeaderName, Position, header};
use crate::template::{TemplateError, TopicTemplate, validate_topic};

const BYTEA: Oid = 17;
const TEXT: Oid = 25;
const JSON: Oid = 114;
const BPCHAR: Oid = 1042;
const VARCHAR: Oid = 1043;
const JSONB: Oid = 3802;

/// The configuration does not fit the table: found once per Relation message, it
/// stops walbox before any row is taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MappingError {
    /// A column the mapping needs is not in the table (or not published).
    #[error("outbox table {table}: no column {column:?} for the {role} (columns: {available})")]
    MissingColumn {
        /// The table.
        table: String,
        /// What the column is for.
        role: &'static str,
        /// The configured name.
        column: String,
        /// The table's published columns.
        available: String,
    },
    /// A column has a type the role cannot use.
    #[error(
        "outbox table {table}: column {column:?} ({role}) has type oid {type_oid}; expected {expected}"
    )]
    WrongType {
        /// The table.
        table: String,
        /// What the column is for.
        role: &'static str,
        /// The column.
        column: String,
        /// Its type.
        type_oid: Oid,
        /// What would work.
        expected: &'static str,
    },
    /// The topic template is malformed.
    #[error("outbox table {table}: {source}")]
    Template {
        /// The table.
        table: String,
        /// The problem.
        #[source]
        source: TemplateError,
    },
    /// A fixed topic name is not a valid Kafka topic.
    #[error("outbox table {table}: topic {topic:?} is invalid: {reason}")]
    InvalidTopic {
        /// The table.
        table: String,
        /// The topic.
        topic: String,
        /// Why.
        reason: &'static str,
    },
}

/// A row that cannot become an event. Names columns and roles, never values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RowError {
    /// A required column is NULL.
    #[error("column {column:?} ({role}) is NULL")]
    Null {
        /// What the column is for.
        role: &'static str,
        /// The column.
        column: String,
    },
    /// A column's value was not sent (unchanged TOAST), which an insert never does.
    #[error("column {column:?} ({role}) has no value in the change")]
    Missing {
        /// What the column is for.
        role: &'static str,
        /// The column.
        column: String,
    },
    /// A text value is not valid UTF-8.
    #[error("column {column:?} ({role}) is not valid UTF-8")]
    NotUtf8 {
        /// What the column is for.
        role: &'static str,
        /// The column.
        column: String,
    },
    /// The payload is not JSON.
    #[error("payload column {column:?} is not valid JSON: {reason}")]
    PayloadNotJson {
        /// The column.
        column: String,
        /// The parser's complaint (position and kind, no content).
        reason: String,
    },
    /// The headers column is not a JSON object.
    #[error("headers column {column:?} is not a JSON object")]
    HeadersNotObject {
        /// The column.
        column: String,
    },
    /// The topic the row names is not a valid topic.
    #[error("topic {topic:?} is invalid: {reason}")]
    InvalidTopic {
        /// The topic the row produced.
        topic: String,
        /// Why.
        reason: &'static str,
    },
    /// The change has a different number of columns than its Relation announced.
    #[error("row has {got} columns, the table has {expected}")]
    Shape {
        /// Columns in the Relation.
        expected: usize,
        /// Columns in the row.
        got: usize,
    },
}

impl RowError {
    /// A short, stable name of the error's class (for dead-letter headers and metrics).
    #[must_use]
    pub fn class(&self) -> &'static str {
        match self {
            Self::Null { .. } => "null_column",
            Self::Missing { .. } => "missing_value",
            Self::NotUtf8 { .. } => "not_utf8",
            Self::PayloadNotJson { .. } => "payload_not_json",
            Self::HeadersNotObject { .. } => "headers_not_object",
            Self::InvalidTopic { .. } => "invalid_topic",
            Self::Shape { .. } => "row_shape",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PayloadKind {
    /// json / jsonb: the server checked it on input and renders it as JSON, so
    /// it is embedded as it comes.
    Json,
    /// text types that must hold JSON.
    Text,
    /// bytea (hex or escape text form) that must hold JSON.
    Bytea,
}

#[derive(Debug, Clone)]
struct Col {
    index: usize,
    name: String,
}

#[derive(Debug, Clone)]
enum TopicSource {
    Fixed(String),
    Template(TopicTemplate, Vec<Col>),
    Column(Col),
}

/// A [`TableConfig`] resolved against one table shape: column indexes, payload
/// kind, topic source. Recompile when a new Relation message arrives for the table.
#[derive(Debug, Clone)]
pub struct Mapper {
    table: String,
    columns: usize,
    producer_json: String,
    id: Col,
    key: Option<Col>,
    aggregate_type: Option<Col>,
    event_type: Option<Col>,
    payload: Option<(Col, PayloadKind)>,
    headers: Option<Col>,
    occurred_at: Option<Col>,
    schema_version: Option<Col>,
    topic: TopicSource,
    value_column: Option<Col>,
    column_names: Vec<String>,
}

/// Header names of dead-letter records.
pub mod dead_letter_header {
    /// Short class of the reason ([`RowError::class`](super::RowError::class)).
    pub const ERROR_CLASS: &str = "walbox_error_class";
    /// The reason, naming the column (never its value).
    pub const ERROR: &str = "walbox_error";
    /// `schema.table` the row came from.
    pub const SOURCE_TABLE: &str = "walbox_source_table";
    /// The topic the event was meant for, when it could be named.
    pub const SOURCE_TOPIC: &str = "walbox_source_topic";
    /// How many times walbox tried to publish the row.
    pub const ATTEMPTS: &str = "walbox_attempts";
}

impl Mapper {
    /// Resolves `config` against `relation`; `producer` names this relay in envelopes.
    pub fn compile(
        config: &TableConfig,
        producer: &str,
        relation: &Relation,
    ) -> Result<Self, MappingError> {
        let table = format!("{}.{}", relation.namespace, relation.name);
        let available = || {
            relation
                .columns
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let find = |name: &str| relation.columns.iter().position(|c| c.name == name);
        let required = |role: &'static str, configured: &Option<String>, default: &str| {
            let name = configured.as_deref().unwrap_or(default);
            find(name)
                .map(|index| Col {
                    index,
                    name: name.to_owned(),
                })
                .ok_or_else(|| MappingError::MissingColumn {
                    table: table.clone(),
                    role,
                    column: name.to_owned(),
                    available: available(),
                })
        };
        let optional =
            |role: &'static str, configured: &Option<String>, default: &str| match configured {
                Some(_) => required(role, configured, default).map(Some),
                None => Ok(find(default).map(|index| Col {
                    index,
                    name: default.to_owned(),
                })),
            };
        let type_of = |c: &Col| relation.columns.get(c.index).map_or(0, |c| c.type_oid);
        let c = &config.columns;

        let id = required("event id", &c.id, "id")?;
        let envelope = matches!(config.value, ValueFormat::Envelope);
        let (key, event_type, payload) = if envelope {
            let payload = required("payload", &c.payload, "payload")?;
            let kind = match type_of(&payload) {
                JSON | JSONB => PayloadKind::Json,
                TEXT | VARCHAR | BPCHAR => PayloadKind::Text,
                BYTEA => PayloadKind::Bytea,
                other => {
                    return Err(MappingError::WrongType {
                        table,
                        role: "payload",
                        column: payload.name,
                        type_oid: other,
                        expected: "json, jsonb, text, varchar or bytea",
                    });
                }
            };
            (
                Some(required(
                    "aggregate id (key)",
                    &c.aggregate_id,
                    "aggregate_id",
                )?),
                Some(required("event type", &c.event_type, "event_type")?),
                Some((payload, kind)),
            )
        } else {
            (
                optional("aggregate id (key)", &c.aggregate_id, "aggregate_id")?,
                optional("event type", &c.event_type, "event_type")?,
                None,
            )
        };
        let headers = optional("headers", &c.headers, "headers")?;
        if let Some(h) = &headers
            && !matches!(type_of(h), JSON | JSONB)
        {
            return Err(MappingError::WrongType {
                table,
                role: "headers",
                column: h.name.clone(),
                type_oid: type_of(h),
                expected: "json or jsonb",
            });
        }
        let aggregate_type = optional("aggregate type", &c.aggregate_type, "aggregate_type")?;
        let occurred_at = optional("occurrence time", &c.occurred_at, "occurred_at")?;
        let schema_version = optional("schema version", &c.schema_version, "schema_version")?;
        let value_column = match &config.value {
            ValueFormat::Envelope => None,
            ValueFormat::Column(name) => Some(required("value", &Some(name.clone()), name)?),
        };

        let topic = if let Some(col) = &config.topic_column {
            TopicSource::Column(required("topic", &Some(col.clone()), col)?)
        } else {
            let template =
                TopicTemplate::parse(&config.topic).map_err(|source| MappingError::Template {
                    table: table.clone(),
                    source,
                })?;
            if template.is_fixed() {
                validate_topic(&config.topic).map_err(|reason| MappingError::InvalidTopic {
                    table: table.clone(),
                    topic: config.topic.clone(),
                    reason,
                })?;
                TopicSource::Fixed(config.topic.clone())
            } else {
                let mut cols = Vec::new();
                for field in template.fields() {
                    // A placeholder names a role (using its configured column) or a column.
                    let configured = match field {
                        "id" | "event_id" => c.id.clone(),
                        "aggregate_type" => c.aggregate_type.clone(),
                        "aggregate_id" => c.aggregate_id.clone(),
                        "event_type" => c.event_type.clone(),
                        _ => None,
                    };
                    let default = if field == "event_id" { "id" } else { field };
                    cols.push(required("topic template field", &configured, default)?);
                }
                TopicSource::Template(template, cols)
            }
        };

        Ok(Mapper {
            table,
            columns: relation.columns.len(),
            producer_json: serde_json::Value::from(producer).to_string(),
            id,
            key,
            aggregate_type,
            event_type,
            payload,
            headers,
            occurred_at,
            schema_version,
            topic,
            value_column,
            column_names: relation.columns.iter().map(|c| c.name.clone()).collect(),
        })
    }

    /// The table this mapper belongs to, `schema.name`.
    #[must_use]
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The columns this mapping reads, each once: what a publication's column
    /// list must include.
    #[must_use]
    pub fn columns_used(&self) -> Vec<&str> {
        let roles = [
            Some(&self.id),
            self.key.as_ref(),
            self.aggregate_type.as_ref(),
            self.event_type.as_ref(),
            self.payload.as_ref().map(|(c, _)| c),
            self.headers.as_ref(),
            self.occurred_at.as_ref(),
            self.schema_version.as_ref(),
            self.value_column.as_ref(),
        ];
        let topic: Vec<&Col> = match &self.topic {
            TopicSource::Fixed(_) => Vec::new(),
            TopicSource::Template(_, cols) => cols.iter().collect(),
            TopicSource::Column(c) => vec![c],
        };
        let mut used: Vec<&str> = Vec::new();
        for c in roles.into_iter().flatten().chain(topic) {
            if !used.contains(&c.name.as_str()) {
                used.push(&c.name);
            }
        }
        used
    }

    /// The topic `row` names, validated.
    fn topic(&self, row: &[TupleValue]) -> Result<String, RowError> {
        let topic = match &self.topic {
            // Validated when the mapping was compiled.
            TopicSource::Fixed(t) => return Ok(t.clone()),
            TopicSource::Column(c) => text(row, c, "topic")?.to_owned(),
            TopicSource::Template(t, cols) => t.render(|i, _| match cols.get(i) {
                Some(c) => text(row, c, "topic template field"),
                None => Err(RowError::Shape {
                    expected: cols.len(),
                    got: i,
                }),
            })?,
        };
        if let Err(reason) = validate_topic(&topic) {
            return Err(RowError::InvalidTopic { topic, reason });
        }
        Ok(topic)
    }

    /// A dead-letter record for a row that cannot be published because of `error`.
    ///
    /// Topic: `template` with `{topic}` replaced by the topic the event was meant for
    /// or, when the row cannot name one, `walbox.<schema>.<table>` (`walbox.dlq` if
    /// that is still not a valid topic). Key: the aggregate id when the row has one.
    /// Value: `{"table", "columns": {name: text or null}}` with every column as the
    /// server sent it. Headers: the event id when readable, the error class and
    /// reason, the source table and topic, the position, the attempt count.
    #[must_use]
    pub fn dead_letter(
        &self,
        row: &[TupleValue],
        position: Position,
        error: &RowError,
        template: &TopicTemplate,
    ) -> Event {
        let intended = self.topic(row).ok();
        let topic = match &intended {
            Some(t) => template.dead_letter_topic(t),
            None => template.fallback_dead_letter_topic(&self.table),
        };
        let event_id = text(row, &self.id, "event id")
            .map(str::to_owned)
            .unwrap_or_else(|_| format!("{}#{}", position.commit_lsn, position.index));
        let key = self
            .key
            .as_ref()
            .and_then(|c| row.get(c.index))
            .and_then(|v| v.bytes().cloned());
        let columns: serde_json::Map<String, serde_json::Value> = self
            .column_names
            .iter()
            .zip(row)
            .map(|(name, v)| {
                let value = match v {
                    TupleValue::Null => serde_json::Value::Null,
                    TupleValue::UnchangedToast => {
                        serde_json::Value::String("(unchanged TOAST value, not sent)".into())
                    }
                    TupleValue::Text(b) | TupleValue::Binary(b) => {
                        serde_json::Value::String(String::from_utf8_lossy(b).into_owned())
                    }
                };
                (name.clone(), value)
            })
            .collect();
        let value = serde_json::json!({ "table": self.table, "columns": columns }).to_string();
        let mut headers = vec![
            (header::EVENT_ID.into(), Bytes::from(event_id.clone())),
            (
                dead_letter_header::ERROR_CLASS.into(),
                Bytes::from_static(error.class().as_bytes()),
            ),
            (
                dead_letter_header::ERROR.into(),
                Bytes::from(error.to_string()),
            ),
            (
                dead_letter_header::SOURCE_TABLE.into(),
                Bytes::from(self.table.clone()),
            ),
        ];
        if let Some(t) = intended {
            headers.push((dead_letter_header::SOURCE_TOPIC.into(), Bytes::from(t)));
        }
        push_position(&mut headers, position);
        headers.push((
            dead_letter_header::ATTEMPTS.into(),
            Bytes::from_static(b"1"),
        ));
        Event {
            event_id,
            topic,
            key,
            value: Bytes::from(value),
            json_value: true,
            headers,
            position,
        }
    }

    /// Maps an inserted row.
    pub fn map(&self, row: &[TupleValue], position: Position) -> Result<Event, RowError> {
        if row.len() != self.columns {
            return Err(RowError::Shape {
                expected: self.columns,
                got: row.len(),
            });
        }
        let event_id = text(row, &self.id, "event id")?;
        let key = match &self.key {
            Some(c) => Some(bytes(row, c, "aggregate id (key)")?.clone()),
            None => None,
        };
        let event_type = opt_text(row, self.event_type.as_ref(), "event type")?;
        let aggregate_type = opt_text(row, self.aggregate_type.as_ref(), "aggregate type")?;
        let schema_version = opt_text(row, self.schema_version.as_ref(), "schema version")?;

        let topic = self.topic(row)?;

        // Header values share the row's buffer: no copy per event.
        let mut headers: Vec<(HeaderName, Bytes)> = Vec::with_capacity(10);
        headers.push((header::EVENT_ID.into(), shared(row, &self.id)));
        for (name, present, col) in [
            (header::EVENT_TYPE, event_type.is_some(), &self.event_type),
            (
                header::SCHEMA_VERSION,
                schema_version.is_some(),
                &self.schema_version,
            ),
            (
                header::AGGREGATE_TYPE,
                aggregate_type.is_some(),
                &self.aggregate_type,
            ),
        ] {
            if let (true, Some(c)) = (present, col) {
                headers.push((name.into(), shared(row, c)));
            }
        }
        if let Some(c) = &self.headers {
            match row.get(c.index) {
                Some(TupleValue::Null) | None => {}
                Some(_) => {
                    let raw = bytes(row, c, "headers")?;
                    json_headers(raw, &mut headers).map_err(|_| RowError::HeadersNotObject {
                        column: c.name.clone(),
                    })?;
                }
            }
        }
        push_position(&mut headers, position);

        let (value, json_value) = match (&self.value_column, &self.payload) {
            (Some(c), _) => (bytes(row, c, "value")?.clone(), false),
            (None, Some((c, kind))) => {
                let payload = payload_json(row, c, *kind)?;
                let occurred_at = opt_text(row, self.occurred_at.as_ref(), "occurrence time")?;
                let value = envelope(
                    event_id,
                    event_type,
                    schema_version,
                    occurred_at,
                    &self.producer_json,
                    &payload,
                );
                (value, true)
            }
            (None, None) => (Bytes::new(), false),
        };

        Ok(Event {
            event_id: event_id.to_owned(),
            topic,
            key,
            value,
            json_value,
            headers,
            position,
        })
    }
}

/// The source position headers: commit LSN, index, xid (one buffer for the three).
fn push_position(headers: &mut Vec<(HeaderName, Bytes)>, position: Position) {
    use std::fmt::Write as _;
    let mut buf = BytesMut::with_capacity(48);
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

/// The value of column `c` (already read and checked), sharing the row's buffer.
fn shared(row: &[TupleValue], c: &Col) -> Bytes {
    match row.get(c.index) {
        Some(TupleValue::Text(b) | TupleValue::Binary(b)) => b.clone(),
        _ => Bytes::new(),
    }
}

/// Appends the string members of the JSON object `raw` as headers, ordered by
/// name (the last of duplicate names wins); other members are skipped. Names and
/// values without escapes are not copied: values share `raw`'s buffer.
fn json_headers(raw: &Bytes, out: &mut Vec<(HeaderName, Bytes)>) -> Result<(), serde_json::Error> {
    let Members(mut members) = serde_json::from_slice(raw)?;
    members.sort_by(|a, b| a.0.cmp(&b.0));
    let mut members = members.into_iter().peekable();
    while let Some((name, value)) = members.next() {
        if members.peek().is_some_and(|(next, _)| *next == name) {
            continue; // a later duplicate wins
        }
        let Some(value) = value else { continue };
        let value = match value {
            Cow::Borrowed(v) => raw.slice_ref(v.as_bytes()),
            Cow::Owned(v) => Bytes::from(v),
        };
        out.push((Cow::Owned(name.into_owned()), value));
    }
    Ok(())
}

/// The members of a JSON object in document order: name, and the value when it
/// is a string.
struct Members<'a>(Vec<(Cow<'a, str>, Option<Cow<'a, str>>)>);

/// A JSON value kept only when it is a string (borrowed from the input when it
/// has no escapes).
struct IfString<'a>(Option<Cow<'a, str>>);

impl<'de> serde::Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(IfString(name)) = m.next_key()? {
                    // JSON object keys are strings.
                    let name =
                        name.ok_or_else(|| serde::de::Error::custom("a key that is not a string"))?;
                    let IfString(value) = m.next_value()?;
                    out.push((name, value));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(V)
    }
}

impl<'de> serde::Deserialize<'de> for IfString<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = IfString<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(IfString(Some(Cow::Borrowed(v))))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(IfString(Some(Cow::Owned(v.to_owned()))))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(IfString(Some(Cow::Owned(v))))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(IfString(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(IfString(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(IfString(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(IfString(None))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(IfString(None))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut s: A,
            ) -> Result<Self::Value, A::Error> {
                while s.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(IfString(None))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<Self::Value, A::Error> {
                while m
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(IfString(None))
            }
        }
        d.deserialize_any(V)
    }
}

fn bytes<'a>(row: &'a [TupleValue], c: &Col, role: &'static str) -> Result<&'a Bytes, RowError> {
    match row.get(c.index) {
        Some(TupleValue::Text(b) | TupleValue::Binary(b)) => Ok(b),
        Some(TupleValue::Null) => Err(RowError::Null {
            role,
            column: c.name.clone(),
        }),
        Some(TupleValue::UnchangedToast) | None => Err(RowError::Missing {
            role,
            column: c.name.clone(),
        }),
    }
}

fn text<'a>(row: &'a [TupleValue], c: &Col, role: &'static str) -> Result<&'a str, RowError> {
    std::str::from_utf8(bytes(row, c, role)?).map_err(|_| RowError::NotUtf8 {
        role,
        column: c.name.clone(),
    })
}

/// An optional role: absent column or NULL value give `None`.
fn opt_text<'a>(
    row: &'a [TupleValue],
    c: Option<&Col>,
    role: &'static str,
) -> Result<Option<&'a str>, RowError> {
    match c {
        None => Ok(None),
        Some(c) if matches!(row.get(c.index), Some(TupleValue::Null)) => Ok(None),
        Some(c) => text(row, c, role).map(Some),
    }
}

/// The payload as JSON bytes; text and bytea are checked to hold JSON.
fn payload_json(row: &[TupleValue], c: &Col, kind: PayloadKind) -> Result<Bytes, RowError> {
    let raw = bytes(row, c, "payload")?;
    let json = match kind {
        PayloadKind::Json => return Ok(raw.clone()),
        PayloadKind::Text => raw.clone(),
        PayloadKind::Bytea => {
            let decoded = match raw.strip_prefix(b"\\x") {
                Some(hex) => decode_hex(hex).ok_or("bytea value is not valid hex"),
                // `bytea_output = escape`: a hex value starts with `\x`, an escaped
                // one never does (a backslash is written `\\`).
                None => decode_bytea_escape(raw).ok_or("bytea value is not valid escape format"),
            };
            Bytes::from(decoded.map_err(|reason| RowError::PayloadNotJson {
                column: c.name.clone(),
                reason: reason.into(),
            })?)
        }
    };
    serde_json::from_slice::<serde::de::IgnoredAny>(&json).map_err(|e| {
        RowError::PayloadNotJson {
            column: c.name.clone(),
            reason: format!(
                "{} at line {} column {}",
                classify(&e),
                e.line(),
                e.column()
            ),
        }
    })?;
    Ok(json)
}

fn classify(e: &serde_json::Error) -> &'static str {
    match e.classify() {
        serde_json::error::Category::Io => "I/O error",
        serde_json::error::Category::Syntax => "syntax error",
        serde_json::error::Category::Data => "unexpected data",
        serde_json::error::Category::Eof => "unexpected end",
    }
}

fn decode_hex(hex: &[u8]) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let nibble = |b: u8| match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    };
    hex.chunks_exact(2)
        .map(|pair| match pair {
            [hi, lo] => Some(nibble(*hi)? << 4 | nibble(*lo)?),
            _ => None,
        })
        .collect()
}

/// bytea in escape output format: `\\` for a backslash, `\ooo` (octal) for a
/// byte, any other byte as itself.
fn decode_bytea_escape(text: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while let Some(&b) = text.get(i) {
        if b != b'\\' {
            out.push(b);
            i += 1;
            continue;
        }
        match (text.get(i + 1), text.get(i + 1..i + 4)) {
            (Some(b'\\'), _) => {
                out.push(b'\\');
                i += 2;
            }
            (_, Some(&[d0 @ b'0'..=b'3', d1 @ b'0'..=b'7', d2 @ b'0'..=b'7'])) => {
                out.push((d0 - b'0') << 6 | (d1 - b'0') << 3 | (d2 - b'0'));
                i += 4;
            }
            _ => return None,
        }
    }
    Some(out)
}

/// `2026-11-29 19:40:00.123456+00` (PostgreSQL ISO output) to RFC 3339
/// (`2026-11-29T19:40:00.123456+00:00`); other forms pass through unchanged.
fn rfc3339(pg: &str) -> String {
    let b = pg.as_bytes();
    if b.len() < 19 || b.get(10) != Some(&b' ') {
        return pg.to_owned();
    }
    let mut s = String::with_capacity(pg.len() + 3);
    s.push_str(&pg[..10]);
    s.push('T');
    s.push_str(&pg[11..]);
    // A zone offset of hours only (+00, -05) gets its minutes.
    let n = s.len();
    if n >= 3 && matches!(s.as_bytes()[n - 3], b'+' | b'-') {
        s.push_str(":00");
    }
    s
}

fn json_str(out: &mut BytesMut, s: &str) {
    // serde_json's string escaping, written straight into the buffer.
    let _ = serde_json::to_writer(out.writer(), s);
}

fn envelope(
    event_id: &str,
    event_type: Option<&str>,
    schema_version: Option<&str>,
    occurred_at: Option<&str>,
    producer_json: &str,
    payload: &[u8],
) -> Bytes {
    let mut out = BytesMut::with_capacity(payload.len() + 192);
    out.put_slice(b"{\"event_id\":");
    json_str(&mut out, event_id);
    out.put_slice(b",\"event_type\":");
    match event_type {
        Some(t) => json_str(&mut out, t),
        None => out.put_slice(b"null"),
    }
    out.put_slice(b",\"schema_version\":");
    match schema_version {
        Some(v) if v.parse::<i64>().is_ok() => out.put_slice(v.as_bytes()),
        Some(v) => json_str(&mut out, v),
        None => out.put_slice(b"null"),
    }
    out.put_slice(b",\"occurred_at\":");
    match occurred_at {
        Some(t) => json_str(&mut out, &rfc3339(t)),
        None => out.put_slice(b"null"),
    }
    out.put_slice(b",\"producer\":");
    out.put_slice(producer_json.as_bytes());
    out.put_slice(b",\"payload\":");
    out.put_slice(payload);
    out.put_slice(b"}");
    out.freeze()
}

#[cfg(test)]
mod tests;
