//! [`Mapper::map`]: an inserted row to an event: its topic, its headers (sharing
//! the row's buffers), and its value (walbox's envelope or a column as it is).

use bytes::{BufMut, Bytes, BytesMut};
use walbox_pgoutput::TupleValue;

use super::value::{bytes, json_headers, opt_text, payload_json, rfc3339, text};
use super::{Col, Mapper, RowError, TopicSource};
use crate::event::{Event, HeaderName, Position, header};
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
pub(super) fn push_position(headers: &mut Vec<(HeaderName, Bytes)>, position: Position) {
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
