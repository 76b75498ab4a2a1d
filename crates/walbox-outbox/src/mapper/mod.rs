//! Compiling a [`TableConfig`](crate::TableConfig) against a table's shape and
//! mapping its rows, by concern:
//!
//! - `compile`: the configuration resolved against a Relation message, once
//!   ([`Mapper::compile`]).
//! - `map`: an inserted row to its event fields, shaped by the table's format
//!   ([`Mapper::map`], [`Mapper::fields`]).
//! - `dead_letter`: the record for a row that cannot be published
//!   ([`Mapper::dead_letter`], [`dead_letter_header`]).
//! - `value`: reading column values: text, JSON payloads (json, text, bytea),
//!   the JSON headers object, timestamps.
//! - `error`: what can be wrong with a configuration ([`MappingError`]) or a row
//!   ([`RowError`]).

mod compile;
mod dead_letter;
mod error;
mod map;
pub(crate) mod value;

use crate::format::{ExtraKind, Formatter};
use crate::template::TopicTemplate;

pub(crate) use dead_letter::Letter;
pub use dead_letter::dead_letter_header;
pub use error::{MappingError, RowError};
pub(crate) use value::rfc3339;

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

/// A [`TableConfig`](crate::TableConfig) resolved against one table shape:
/// column indexes, payload kind, topic source. Recompile when a new Relation
/// message arrives for the table.
#[derive(Debug, Clone)]
pub struct Mapper {
    table: String,
    columns: usize,
    formatter: Formatter,
    placements: Vec<(Col, ExtraKind)>,
    key_nullable: bool,
    id: Col,
    key: Option<Col>,
    /// What the key's column holds (a number or text).
    key_kind: ExtraKind,
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

impl Mapper {
    /// The format step this mapper ends with.
    #[must_use]
    pub fn formatter(&self) -> &Formatter {
        &self.formatter
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
        let placed = self.placements.iter().map(|(c, _)| c);
        let topic: Vec<&Col> = match &self.topic {
            TopicSource::Fixed(_) => Vec::new(),
            TopicSource::Template(_, cols) => cols.iter().collect(),
            TopicSource::Column(c) => vec![c],
        };
        let mut used: Vec<&str> = Vec::new();
        for c in roles.into_iter().flatten().chain(topic).chain(placed) {
            if !used.contains(&c.name.as_str()) {
                used.push(&c.name);
            }
        }
        used
    }
}

#[cfg(test)]
mod tests;
