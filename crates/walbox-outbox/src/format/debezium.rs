//! Format `debezium-outbox`: the record Debezium's Outbox Event Router emits with
//! its defaults and `table.expand.json.payload = true`.
//!
//! - key: the aggregate id (no key when it is NULL), as its text
//!   (`key_encoding = "string"`, the StringConverter) or as JSON
//!   (`key_encoding = "json"`, the JsonConverter without schemas: `"1"` for
//!   text, `1` for an integer);
//! - value: the payload. JSON (json, jsonb, or text holding JSON) is emitted as
//!   that JSON; text that is not JSON is kept as it is, which the router's JSON
//!   converter writes as a JSON string; bytea is emitted as its bytes, as the
//!   router's binary converter passes a payload on;
//! - with envelope placements the value is `{"payload": <payload>, <field>: <value>,
//!   ...}`;
//! - headers: `id` = the event id, then the header placements (alias, else
//!   column name; a NULL value places no header), the source's headers and the
//!   position.

use bytes::{BufMut, Bytes, BytesMut};

use super::{
    EventFields, Extra, ExtraKind, Formatter, PayloadKind, Text, json_str, push_id, push_position,
};
use crate::config::{KeyEncoding, Place};
use crate::event::{Event, HeaderName};
use crate::mapper::RowError;

/// Header carrying the event id.
pub const ID_HEADER: &str = "id";

impl Formatter {
    pub(super) fn debezium(&self, f: EventFields) -> Result<Event, RowError> {
        let payload = self.require_payload(f.payload)?;
        // table.expand.json.payload: a string holding JSON becomes that JSON; one
        // that does not is kept as the string it is.
        let (payload, json_value) = match payload.kind {
            PayloadKind::Json => (payload.bytes, true),
            PayloadKind::Binary => (payload.bytes, false),
            PayloadKind::Text => {
                if serde_json::from_slice::<serde::de::IgnoredAny>(&payload.bytes).is_ok() {
                    (payload.bytes, true)
                } else {
                    let text =
                        std::str::from_utf8(&payload.bytes).map_err(|_| RowError::NotUtf8 {
                            role: "payload",
                            column: self.names.payload.clone(),
                        })?;
                    let mut out = BytesMut::with_capacity(text.len() + 2);
                    json_str(&mut out, text);
                    (out.freeze(), true)
                }
            }
        };

        let mut headers: Vec<(HeaderName, Bytes)> =
            Vec::with_capacity(4 + self.placements.len() + f.headers.len());
        push_id(&mut headers, ID_HEADER, &f.event_id);
        let mut envelope = Vec::new();
        for (p, value) in self.placements.iter().zip(&f.extra) {
            match p.place {
                Place::Header => {
                    if let Some(v) = value {
                        headers.push((p.name.clone().into(), v.value.bytes().clone()));
                    }
                }
                Place::Envelope => envelope.push((p.name.as_str(), value.as_ref())),
            }
        }
        headers.extend(f.headers);
        push_position(&mut headers, f.position);

        let value = if envelope.is_empty() {
            payload
        } else {
            if !json_value {
                // A table's mapping refuses this when it is compiled; another
                // source of events meets it here.
                return Err(RowError::PayloadNotJson {
                    column: self.names.payload.clone(),
                    reason: "a binary payload cannot sit in a JSON envelope".into(),
                });
            }
            let mut out = BytesMut::with_capacity(payload.len() + 64 * envelope.len() + 16);
            out.put_slice(b"{\"payload\":");
            out.put_slice(&payload);
            for (name, value) in envelope {
                out.put_u8(b',');
                json_str(&mut out, name);
                out.put_u8(b':');
                extra_json(&mut out, value);
            }
            out.put_u8(b'}');
            out.freeze()
        };
        let key = match (self.key_encoding, f.aggregate_id) {
            (KeyEncoding::Json, Some(id)) => Some(self.json_key(&id, f.key_kind)?),
            (_, id) => id,
        };
        Ok(Event {
            event_id: f.event_id.as_str().to_owned(),
            topic: f.topic,
            key,
            value,
            json_value,
            headers,
            position: f.position,
            origin: crate::Origin::Stream,
        })
    }
}

impl Formatter {
    /// The aggregate id as Kafka Connect's JsonConverter (`schemas.enable =
    /// false`) writes a key: a number as the number, text as a JSON string
    /// (escaped as Jackson escapes it: `"`, `\\` and control characters).
    fn json_key(&self, id: &Bytes, kind: ExtraKind) -> Result<Bytes, RowError> {
        std::str::from_utf8(id).map_err(|_| RowError::NotUtf8 {
            role: "aggregate id (key)",
            column: self.names.aggregate_id.clone(),
        })?;
        let mut out = BytesMut::with_capacity(id.len() + 2);
        extra_json(
            &mut out,
            Some(&Extra {
                value: Text(id.clone()),
                kind,
            }),
        );
        Ok(out.freeze())
    }
}

/// An extra field's value as JSON: numbers and booleans as such, the rest as
/// strings, NULL as null.
fn extra_json(out: &mut BytesMut, value: Option<&Extra>) {
    let Some(v) = value else {
        out.put_slice(b"null");
        return;
    };
    let text = v.value.as_str();
    match v.kind {
        ExtraKind::Number if serde_json::from_str::<serde_json::Number>(text).is_ok() => {
            out.put_slice(text.as_bytes());
        }
        ExtraKind::Bool if matches!(text, "t" | "true") => out.put_slice(b"true"),
        ExtraKind::Bool if matches!(text, "f" | "false") => out.put_slice(b"false"),
        ExtraKind::Number | ExtraKind::Bool | ExtraKind::Text => json_str(out, text),
    }
}
