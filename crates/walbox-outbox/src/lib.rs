//! The outbox mapping: from a decoded outbox row to an event ready for a sink.
//!
//! A [`TableConfig`] says which table is an outbox and which columns play which role
//! (event id, aggregate type, aggregate id = key, event type, payload, headers,
//! occurrence time, schema version), how the topic is named (a template over row
//! fields, or a column) and whether the value is built as walbox's envelope or taken
//! as-is from a column, and in which format the record is shaped: walbox's own,
//! Debezium's outbox event router, or CloudEvents (module `format`, a step over
//! [`EventFields`] that any source of events can use). [`Mapper::compile`] checks that against a table's shape from
//! a pgoutput Relation message once; [`Mapper::map`] then turns each inserted row into
//! an [`Event`] or a [`RowError`] that names the column and what is wrong with it
//! (never the value: rows can hold personal data). The table-less outbox,
//! logical decoding messages whose content is a JSON object of the same fields,
//! has its own [`MessageConfig`] and [`MessageMapper`] ending in the same format
//! step (module `message`).
//!
//! No I/O: the crate is pure data transformation.

mod config;
mod event;
mod format;
mod mapper;
mod message;
mod template;
#[cfg(test)]
mod test_rows;

pub use config::{
    CloudEventsMode, ColumnNames, DEFAULT_CLOUDEVENTS_SOURCE, DEFAULT_CLOUDEVENTS_SUBJECT, Format,
    FormatSettings, KeyEncoding, Place, Placement, TableConfig, ValueFormat,
};
pub use event::{Event, HeaderName, Origin, Position, header};
pub use format::{
    Binding, EventFields, Extra, ExtraKind, FieldNames, Formatter, Payload, PayloadKind, Protocol,
    Text, record_event_id,
};
pub use mapper::{Mapper, MappingError, RowError, dead_letter_header};
pub use message::{
    MessageConfig, MessageError, MessageMapper, SOURCE_MESSAGE_PREFIX, check_prefixes,
};
pub use template::{TemplateError, TopicTemplate, validate_topic};
