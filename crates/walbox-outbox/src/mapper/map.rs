//! [`Mapper::map`]: an inserted row to its [`EventFields`] (the topic, the
//! headers column, sharing the row's buffers), then to an event in the table's
//! format.

use bytes::Bytes;
use walbox_pgoutput::TupleValue;

use super::value::{bytes, json_headers, opt_text, payload, text};
use super::{Col, Mapper, RowError, TopicSource};
use crate::event::{Event, HeaderName, Position};
use crate::format::{EventFields, Extra, Text};
use crate::template::validate_topic;

impl Mapper {
    /// The topic `row` names, validated.
    pub(super) fn topic(&self, row: &[TupleValue]) -> Result<String, RowError> {
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

    /// Maps an inserted row (commit time unknown).
    pub fn map(&self, row: &[TupleValue], position: Position) -> Result<Event, RowError> {
        self.map_at(row, position, None)
    }

    /// Maps an inserted row of a transaction committed at `commit_time`
    /// (PostgreSQL microseconds since 2000-01-01 UTC), which a format can use as
    /// the event's time when the row has none.
    pub fn map_at(
        &self,
        row: &[TupleValue],
        position: Position,
        commit_time: Option<i64>,
    ) -> Result<Event, RowError> {
        let fields = self.fields(row, position, commit_time)?;
        self.formatter.render(fields)
    }

    /// The event fields of an inserted row, before its format shapes them.
    pub fn fields(
        &self,
        row: &[TupleValue],
        position: Position,
        commit_time: Option<i64>,
    ) -> Result<EventFields, RowError> {
        if row.len() != self.columns {
            return Err(RowError::Shape {
                expected: self.columns,
                got: row.len(),
            });
        }
        let event_id = shared_text(row, &self.id, "event id")?;
        let aggregate_id = match &self.key {
            Some(c) if self.key_nullable && matches!(row.get(c.index), Some(TupleValue::Null)) => {
                None
            }
            Some(c) => Some(bytes(row, c, "aggregate id (key)")?.clone()),
            None => None,
        };
        let event_type = opt_shared(row, self.event_type.as_ref(), "event type")?;
        let aggregate_type = opt_shared(row, self.aggregate_type.as_ref(), "aggregate type")?;
        let schema_version = opt_shared(row, self.schema_version.as_ref(), "schema version")?;

        let topic = self.topic(row)?;

        let mut headers: Vec<(HeaderName, Bytes)> = Vec::new();
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
        let extra = self
            .placements
            .iter()
            .map(|(c, kind)| {
                Ok(opt_shared(row, Some(c), "additional placement")?
                    .map(|value| Extra { value, kind: *kind }))
            })
            .collect::<Result<Vec<_>, RowError>>()?;

        let (value, payload) = match (&self.value_column, &self.payload) {
            (Some(c), _) => (Some(bytes(row, c, "value")?.clone()), None),
            (None, Some((c, kind))) => (None, Some(payload(row, c, *kind)?)),
            (None, None) => (None, None),
        };
        let occurred_at = opt_shared(row, self.occurred_at.as_ref(), "occurrence time")?;

        Ok(EventFields {
            key_kind: self.key_kind,
            event_id,
            topic,
            aggregate_type,
            aggregate_id,
            event_type,
            schema_version,
            occurred_at,
            commit_time,
            payload,
            value,
            headers,
            extra,
            position,
        })
    }
}

/// Column `c`'s text, sharing the row's buffer.
fn shared_text(row: &[TupleValue], c: &Col, role: &'static str) -> Result<Text, RowError> {
    Text::new(bytes(row, c, role)?.clone()).map_err(|_| RowError::NotUtf8 {
        role,
        column: c.name.clone(),
    })
}

/// An optional role's text (absent column or NULL: `None`), sharing the row's
/// buffer.
fn opt_shared(
    row: &[TupleValue],
    c: Option<&Col>,
    role: &'static str,
) -> Result<Option<Text>, RowError> {
    match c {
        Some(c) if opt_text(row, Some(c), role)?.is_some() => shared_text(row, c, role).map(Some),
        _ => Ok(None),
    }
}

pub(super) use crate::format::push_position;
