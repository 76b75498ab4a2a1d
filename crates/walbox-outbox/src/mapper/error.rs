//! What can be wrong: a configuration that does not fit the table
//! ([`MappingError`], once per Relation message), or a row that cannot become an
//! event ([`RowError`], naming the column, never the value).

use walbox_pgoutput::Oid;

use crate::template::TemplateError;

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
    /// The format cannot be applied as configured.
    #[error("outbox table {table}: format {format:?}: {problem}")]
    Format {
        /// The table (or other source of events).
        table: String,
        /// The format's configuration name.
        format: &'static str,
        /// What is wrong and how to fix it.
        problem: String,
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
    /// The headers hold a name walbox writes itself (the position headers, the
    /// event id's header of any format, a name the format writes).
    #[error(
        "the headers hold {name:?}, a header name walbox writes itself (walbox_*, event_id, \
         ce_id, ce_specversion, or one of this format's headers); rename it in the application"
    )]
    ReservedHeader {
        /// The header's name.
        name: String,
    },
    /// The occurrence time cannot be a CloudEvents `time` (RFC 3339): a date
    /// alone, `infinity`, a year before 1 or after 9999, other text.
    #[error(
        "{column:?} (occurrence time) is not an RFC 3339 date-time, which the CloudEvents time \
         attribute must be (a date alone, an infinite timestamp or a year outside 0001-9999 cannot be one)"
    )]
    InvalidTime {
        /// The column (or field).
        column: String,
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
            Self::ReservedHeader { .. } => "reserved_header",
            Self::InvalidTime { .. } => "invalid_time",
            Self::Shape { .. } => "row_shape",
        }
    }
}
