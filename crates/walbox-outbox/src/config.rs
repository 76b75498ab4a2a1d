//! An outbox table's configuration: which table, which column plays which role,
//! how the topic is named and how the value is built.

use serde::Deserialize;

/// One outbox table and how its rows become events.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
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
    #[serde(default)]
    pub columns: ColumnNames,
}

fn default_topic() -> String {
    "outbox.{aggregate_type}".to_owned()
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
