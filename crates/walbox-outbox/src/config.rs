//! An outbox table's configuration: which table, which column plays which role,
//! how the topic is named, how the value is built and in which format
//! (walbox, Debezium outbox, CloudEvents).

use serde::Deserialize;

use crate::format::Binding;

/// One outbox table and how its rows become events.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "RawTableConfig")]
pub struct TableConfig {
    /// The table, `schema.name` or `name` (schema `public`).
    pub table: String,
    /// Topic template over row fields, e.g. `outbox.{aggregate_type}`, or a fixed
    /// name. Ignored when `topic_column` is set.
    #[serde(default = "default_topic")]
    pub topic: String,
    /// Take the topic from this column instead of the template.
    #[serde(default)]
    pub topic_column: Option<String>,
    /// How the record value is built.
    #[serde(default)]
    pub value: ValueFormat,
    /// Which column plays which role.
    pub columns: ColumnNames,
    /// The record shape and its settings (`format`, `additional_placement`,
    /// `cloudevents_*` in the table's section).
    pub formatting: FormatSettings,
}

/// Which format shapes the records, with its settings; any source of events can
/// carry these (an outbox table's are keys of its `[[outbox]]` section).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct FormatSettings {
    /// The record shape: walbox's envelope, Debezium's outbox event router, or
    /// CloudEvents.
    pub format: Format,
    /// Extra fields placed as headers or envelope fields (`debezium-outbox`):
    /// `column:header[:alias]`, `column:envelope[:alias]`.
    pub additional_placement: Vec<Placement>,
    /// CloudEvents content mode (`cloudevents`); unset: the binding's default
    /// (binary on Kafka, structured on NATS).
    pub cloudevents_mode: Option<CloudEventsMode>,
    /// Template of the CloudEvents `source` (`cloudevents`).
    pub cloudevents_source: String,
    /// Template of the CloudEvents `subject` (`cloudevents`; empty: none).
    pub cloudevents_subject: String,
    /// How the key's bytes are written (`debezium-outbox`): as the text (Kafka
    /// Connect's StringConverter) or as JSON (its JsonConverter without schemas).
    pub key_encoding: KeyEncoding,
    /// The CloudEvents protocol binding of the sink the records go to; not a
    /// key of the file: set from the sink's type when the configuration is
    /// loaded.
    #[serde(skip)]
    pub binding: Binding,
}

impl Default for FormatSettings {
    fn default() -> Self {
        FormatSettings {
            format: Format::Walbox,
            additional_placement: Vec::new(),
            cloudevents_mode: None,
            cloudevents_source: DEFAULT_CLOUDEVENTS_SOURCE.to_owned(),
            cloudevents_subject: DEFAULT_CLOUDEVENTS_SUBJECT.to_owned(),
            key_encoding: KeyEncoding::default(),
            binding: Binding::default(),
        }
    }
}

/// [`TableConfig`] as written: the topic's default depends on the format.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTableConfig {
    table: String,
    #[serde(default)]
    topic: Option<String>,
    #[serde(default)]
    topic_column: Option<String>,
    #[serde(default)]
    value: ValueFormat,
    #[serde(default)]
    columns: ColumnNames,
    #[serde(default)]
    format: Format,
    #[serde(default)]
    additional_placement: Vec<Placement>,
    #[serde(default)]
    cloudevents_mode: Option<CloudEventsMode>,
    #[serde(default)]
    cloudevents_source: Option<String>,
    #[serde(default)]
    cloudevents_subject: Option<String>,
    #[serde(default)]
    key_encoding: KeyEncoding,
}

impl From<RawTableConfig> for TableConfig {
    fn from(raw: RawTableConfig) -> Self {
        TableConfig {
            topic: raw
                .topic
                .unwrap_or_else(|| raw.format.default_topic().to_owned()),
            table: raw.table,
            topic_column: raw.topic_column,
            value: raw.value,
            columns: raw.columns,
            formatting: FormatSettings {
                format: raw.format,
                additional_placement: raw.additional_placement,
                cloudevents_mode: raw.cloudevents_mode,
                cloudevents_source: raw
                    .cloudevents_source
                    .unwrap_or_else(|| DEFAULT_CLOUDEVENTS_SOURCE.to_owned()),
                cloudevents_subject: raw
                    .cloudevents_subject
                    .unwrap_or_else(|| DEFAULT_CLOUDEVENTS_SUBJECT.to_owned()),
                key_encoding: raw.key_encoding,
                binding: Binding::default(),
            },
        }
    }
}

/// Default template of the CloudEvents `source`.
pub const DEFAULT_CLOUDEVENTS_SOURCE: &str = "/walbox/{table}";
/// Default template of the CloudEvents `subject`.
pub const DEFAULT_CLOUDEVENTS_SUBJECT: &str = "{aggregate_id}";

fn default_topic() -> String {
    Format::Walbox.default_topic().to_owned()
}

/// The shape of the records an outbox table's events become.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum Format {
    /// walbox's envelope (see [`ValueFormat`]) with walbox's headers.
    #[default]
    #[serde(rename = "walbox")]
    Walbox,
    /// Debezium's Outbox Event Router with its defaults and
    /// `table.expand.json.payload = true`: key = aggregate id, value = the
    /// payload, header `id` = event id, topic `outbox.event.{aggregatetype}`.
    #[serde(rename = "debezium-outbox")]
    DebeziumOutbox,
    /// CloudEvents 1.0 in the sink's protocol binding (Kafka, NATS).
    #[serde(rename = "cloudevents")]
    CloudEvents,
}

impl Format {
    /// The configuration spelling.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Format::Walbox => "walbox",
            Format::DebeziumOutbox => "debezium-outbox",
            Format::CloudEvents => "cloudevents",
        }
    }

    /// The default column names of a role (`aggregate_type`, `aggregate_id`,
    /// `event_type`) in this format, in order of preference: the first the table
    /// has plays the role. Other roles and fields: none.
    #[must_use]
    pub fn default_columns(self, role: &str) -> &'static [&'static str] {
        match (self, role) {
            (Format::Walbox, "aggregate_type") => &["aggregate_type"],
            (Format::Walbox, "aggregate_id") => &["aggregate_id"],
            (Format::Walbox, "event_type") => &["event_type"],
            // The Outbox Event Router's names first.
            (Format::DebeziumOutbox, "aggregate_type") => &["aggregatetype", "aggregate_type"],
            (Format::DebeziumOutbox, "aggregate_id") => &["aggregateid", "aggregate_id"],
            (Format::DebeziumOutbox, "event_type") => &["type", "event_type"],
            (Format::CloudEvents, "aggregate_type") => &["aggregate_type", "aggregatetype"],
            (Format::CloudEvents, "aggregate_id") => &["aggregate_id", "aggregateid"],
            (Format::CloudEvents, "event_type") => &["event_type", "type"],
            _ => &[],
        }
    }

    /// The topic template used when none is configured.
    #[must_use]
    pub fn default_topic(self) -> &'static str {
        match self {
            Format::DebeziumOutbox => "outbox.event.{aggregate_type}",
            Format::Walbox | Format::CloudEvents => "outbox.{aggregate_type}",
        }
    }
}

/// How the record key's bytes are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyEncoding {
    /// The aggregate id's text as it is (Kafka Connect's StringConverter).
    #[default]
    String,
    /// The aggregate id as a JSON value (Kafka Connect's JsonConverter with
    /// `schemas.enable = false`): a string as a JSON string (`"1"`), an
    /// integer as a JSON number.
    Json,
}

impl KeyEncoding {
    /// The configuration spelling.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            KeyEncoding::String => "string",
            KeyEncoding::Json => "json",
        }
    }
}

/// CloudEvents content mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CloudEventsMode {
    /// Attributes in headers (`ce_` on Kafka, `ce-` on NATS), the payload as
    /// the value.
    #[default]
    Binary,
    /// The whole event as one JSON value (`application/cloudevents+json`).
    Structured,
}

/// Where an extra column goes (Debezium's `table.fields.additional.placement`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct Placement {
    /// The column (or event field) whose value is placed.
    pub column: String,
    /// Header or envelope field.
    pub place: Place,
    /// The header or field name: the alias, else the column name.
    pub name: String,
}

/// Where a [`Placement`] puts its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// A record header.
    Header,
    /// A field of the value, which then becomes `{"payload": ..., field: ...}`.
    Envelope,
}

impl TryFrom<String> for Placement {
    type Error = String;

    fn try_from(spec: String) -> Result<Self, Self::Error> {
        let mut parts = spec.split(':');
        let (column, place, alias) = (parts.next(), parts.next(), parts.next());
        let column = column.map(str::trim).filter(|c| !c.is_empty());
        let (Some(column), Some(place), None) = (column, place, parts.next()) else {
            return Err(format!(
                "additional_placement {spec:?}: expected column:header[:alias] or column:envelope[:alias]"
            ));
        };
        let place = match place.trim() {
            "header" => Place::Header,
            "envelope" => Place::Envelope,
            "partition" => {
                return Err(format!(
                    "additional_placement {spec:?}: placement \"partition\" is not supported; \
                     the record key (the aggregate id) decides the partition"
                ));
            }
            other => {
                return Err(format!(
                    "additional_placement {spec:?}: unknown placement {other:?}; use header or envelope"
                ));
            }
        };
        let name = alias
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .unwrap_or(column);
        Ok(Placement {
            column: column.to_owned(),
            place,
            name: name.to_owned(),
        })
    }
}

impl TableConfig {
    /// A table with every default: columns named after their roles, topic
    /// `outbox.{aggregate_type}`, envelope values.
    #[must_use]
    pub fn new(table: &str) -> Self {
        TableConfig {
            table: table.to_owned(),
            topic: default_topic(),
            topic_column: None,
            value: ValueFormat::default(),
            columns: ColumnNames::default(),
            formatting: FormatSettings::default(),
        }
    }

    /// `(schema, name)` of the table.
    #[must_use]
    pub fn qualified(&self) -> (&str, &str) {
        match self.table.split_once('.') {
            Some((schema, name)) => (schema, name),
            None => ("public", self.table.as_str()),
        }
    }
}

/// How the record value is built.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ValueFormat {
    /// walbox's envelope: `{event_id, event_type, schema_version, occurred_at,
    /// producer, payload}` with the payload embedded as JSON.
    #[default]
    Envelope,
    /// The bytes of this column as they are (a table that stores ready-made
    /// envelopes).
    Column(String),
}

/// Column names per role. Unset optional roles use the role's name when the table
/// has such a column and are left out when it has not; a name set explicitly must
/// exist.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ColumnNames {
    /// Event id (default `id`). Required.
    pub id: Option<String>,
    /// Aggregate type (default `aggregate_type`). Required when the topic template
    /// uses it.
    pub aggregate_type: Option<String>,
    /// Aggregate id, the record key (default `aggregate_id`). Required for envelope
    /// values.
    pub aggregate_id: Option<String>,
    /// Event type (default `event_type`). Required for envelope values.
    pub event_type: Option<String>,
    /// Payload: json, jsonb, text or bytea holding JSON (default `payload`). Required
    /// for envelope values.
    pub payload: Option<String>,
    /// jsonb object whose string entries become headers (default `headers`).
    pub headers: Option<String>,
    /// When the event happened (default `occurred_at`).
    pub occurred_at: Option<String>,
    /// Schema version of the payload (default `schema_version`).
    pub schema_version: Option<String>,
}
