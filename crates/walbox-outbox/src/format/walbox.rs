//! Format `walbox`: headers `event_id`, `event_type`, `schema_version`,
//! `aggregate_type`, the source's headers and the position; the value is walbox's
//! envelope `{event_id, event_type, schema_version, occurred_at, producer,
//! payload}` with the payload embedded as JSON, or a ready-made value as it is.

use bytes::{BufMut, Bytes, BytesMut};

use super::{EventFields, Formatter, Text, json_str, push_id, push_position};
use crate::event::{Event, HeaderName, header};
use crate::mapper::RowError;
use crate::mapper::rfc3339;

impl Formatter {
    pub(super) fn walbox(&self, f: EventFields) -> Result<Event, RowError> {
        let mut headers: Vec<(HeaderName, Bytes)> = Vec::with_capacity(10 + f.headers.len());
        push_id(&mut headers, header::EVENT_ID, &f.event_id);
        for (name, value) in [
            (header::EVENT_TYPE, &f.event_type),
            (header::SCHEMA_VERSION, &f.schema_version),
            (header::AGGREGATE_TYPE, &f.aggregate_type),
        ] {
            if let Some(v) = value {
                headers.push((name.into(), v.bytes().clone()));
            }
        }
        headers.extend(f.headers);
        push_position(&mut headers, f.position);

        let (value, json_value) = match (f.value, f.payload) {
            (Some(v), _) => (v, false),
            (None, Some(payload)) => {
                let payload = self.payload_json(payload)?;
                let value = envelope(
                    &f.event_id,
                    f.event_type.as_ref(),
                    f.schema_version.as_ref(),
                    f.occurred_at.as_ref(),
                    &self.producer_json,
                    &payload,
                );
                (value, true)
            }
            (None, None) => (Bytes::new(), false),
        };
        Ok(Event {
            event_id: f.event_id.as_str().to_owned(),
            topic: f.topic,
            key: f.aggregate_id,
            value,
            json_value,
            headers,
            position: f.position,
            origin: crate::Origin::Stream,
        })
    }
}

fn envelope(
    event_id: &Text,
    event_type: Option<&Text>,
    schema_version: Option<&Text>,
    occurred_at: Option<&Text>,
    producer_json: &str,
    payload: &[u8],
) -> Bytes {
    let mut out = BytesMut::with_capacity(payload.len() + 192);
    out.put_slice(b"{\"event_id\":");
    json_str(&mut out, event_id.as_str());
    out.put_slice(b",\"event_type\":");
    match event_type {
        Some(t) => json_str(&mut out, t.as_str()),
        None => out.put_slice(b"null"),
    }
    out.put_slice(b",\"schema_version\":");
    match schema_version.map(Text::as_str) {
        Some(v) if v.parse::<i64>().is_ok() => out.put_slice(v.as_bytes()),
        Some(v) => json_str(&mut out, v),
        None => out.put_slice(b"null"),
    }
    out.put_slice(b",\"occurred_at\":");
    match occurred_at {
        Some(t) => json_str(&mut out, &rfc3339(t.as_str())),
        None => out.put_slice(b"null"),
    }
    out.put_slice(b",\"producer\":");
    out.put_slice(producer_json.as_bytes());
    out.put_slice(b",\"payload\":");
    out.put_slice(payload);
    out.put_slice(b"}");
    out.freeze()
}
