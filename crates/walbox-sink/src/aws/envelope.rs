//! The JSON record a Kinesis record's data holds: a Kinesis record has no
//! headers of its own, so the event's id, key, headers and value travel in
//! one object a consumer reads with any JSON parser:
//!
//! ```json
//! {"event_id": "...", "topic": "...", "key": "...",
//!  "headers": {"name": "text"}, "value": {...}}
//! ```
//!
//! - `value` is the event's value as it is when it is JSON; otherwise
//!   `value_base64` holds its bytes.
//! - `key` is null for an event without a key; a key that is no UTF-8 text
//!   is `key_base64` instead.
//! - A header whose value is no UTF-8 text goes in `headers_base64`.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
#[cfg(test)]
use serde_json::Value;
use walbox_outbox::Event;

use crate::OwnedRecord;

/// `event` as the JSON object of a record.
pub(crate) fn encode(event: &Event) -> Vec<u8> {
    let mut out = Vec::with_capacity(event.size() + 128);
    out.extend_from_slice(b"{\"event_id\":");
    push_string(&mut out, &event.event_id);
    out.extend_from_slice(b",\"topic\":");
    push_string(&mut out, &event.topic);
    match &event.key {
        None => out.extend_from_slice(b",\"key\":null"),
        Some(k) => match std::str::from_utf8(k) {
            Ok(text) => {
                out.extend_from_slice(b",\"key\":");
                push_string(&mut out, text);
            }
            Err(_) => {
                out.extend_from_slice(b",\"key_base64\":");
                push_string(&mut out, &STANDARD.encode(k));
            }
        },
    }
    let mut binary = Vec::new();
    out.extend_from_slice(b",\"headers\":{");
    let mut first = true;
    for (k, v) in &event.headers {
        match std::str::from_utf8(v) {
            Ok(text) => {
                if !first {
                    out.push(b',');
                }
                first = false;
                push_string(&mut out, k);
                out.push(b':');
                push_string(&mut out, text);
            }
            Err(_) => binary.push((k, v)),
        }
    }
    out.push(b'}');
    if !binary.is_empty() {
        out.extend_from_slice(b",\"headers_base64\":{");
        for (i, (k, v)) in binary.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            push_string(&mut out, k);
            out.push(b':');
            push_string(&mut out, &STANDARD.encode(v));
        }
        out.push(b'}');
    }
    if event.json_value || serde_json::from_slice::<serde::de::IgnoredAny>(&event.value).is_ok() {
        out.extend_from_slice(b",\"value\":");
        out.extend_from_slice(event.value.trim_ascii());
    } else {
        out.extend_from_slice(b",\"value_base64\":");
        push_string(&mut out, &STANDARD.encode(&event.value));
    }
    out.push(b'}');
    out
}

fn push_string(out: &mut Vec<u8>, s: &str) {
    // serde_json escapes exactly as JSON requires; writing to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// A record's JSON object as read back: the value kept as the text it was
/// written as (numbers beyond what a float holds stay as they are).
#[derive(serde::Deserialize)]
struct Wire<'a> {
    event_id: String,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    key_base64: Option<String>,
    #[serde(default, deserialize_with = "members")]
    headers: Vec<(String, String)>,
    #[serde(default, deserialize_with = "members")]
    headers_base64: Vec<(String, String)>,
    #[serde(default, borrow, deserialize_with = "raw")]
    value: Option<&'a serde_json::value::RawValue>,
    #[serde(default)]
    value_base64: Option<String>,
}

/// A member present as any JSON, `null` included (which an `Option` alone
/// would take for absent).
fn raw<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<&'de serde_json::value::RawValue>, D::Error> {
    <&serde_json::value::RawValue as serde::Deserialize>::deserialize(d).map(Some)
}

/// Reads a JSON object's members in order, duplicates kept.
fn members<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<(String, String)>, D::Error> {
    struct Members;
    impl<'de> serde::de::Visitor<'de> for Members {
        type Value = Vec<(String, String)>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an object of strings")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(pair) = map.next_entry::<String, String>()? {
                out.push(pair);
            }
            Ok(out)
        }
    }
    d.deserialize_map(Members)
}

/// A record's JSON object read back: `None` when it is not one walbox wrote.
pub(crate) fn decode(data: &[u8], partition: i32, offset: i64) -> Option<OwnedRecord> {
    let wire: Wire<'_> = serde_json::from_slice(data).ok()?;
    let key = match (wire.key, wire.key_base64) {
        (Some(k), _) => Some(k.into_bytes()),
        (None, Some(b)) => Some(STANDARD.decode(b).ok()?),
        (None, None) => None,
    };
    let mut headers: Vec<(String, Vec<u8>)> = wire
        .headers
        .into_iter()
        .map(|(k, v)| (k, v.into_bytes()))
        .collect();
    for (k, v) in wire.headers_base64 {
        headers.push((k, STANDARD.decode(v).ok()?));
    }
    let value = match (wire.value, wire.value_base64) {
        (Some(raw), _) => raw.get().as_bytes().to_vec(),
        (None, Some(b)) => STANDARD.decode(b).ok()?,
        (None, None) => return None,
    };
    Some(OwnedRecord {
        partition,
        offset,
        key,
        value,
        headers,
        message_id: Some(wire.event_id),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use walbox_outbox::Position;

    fn event(key: Option<&[u8]>, value: &[u8], json: bool) -> Event {
        Event {
            event_id: "e-1".into(),
            topic: "outbox.order".into(),
            key: key.map(Bytes::copy_from_slice),
            value: Bytes::copy_from_slice(value),
            json_value: json,
            headers: vec![
                ("event_id".into(), Bytes::from_static(b"e-1")),
                ("raw".into(), Bytes::from_static(&[0xff, 0x00])),
            ],
            position: Position {
                commit_lsn: walbox_pgoutput::Lsn(1),
                index: 0,
                xid: 7,
            },
            origin: walbox_outbox::Origin::Stream,
        }
    }

    #[test]
    fn a_record_reads_back_as_the_event_it_came_from() {
        for (key, value, json) in [
            (Some(&b"order-\"1\""[..]), &br#"{"a": [1, 2]}"#[..], true),
            (Some(&[0xfe, 0x01][..]), &b"not json \xff"[..], false),
            (None, &b"\"text\""[..], false),
        ] {
            let e = event(key, value, json);
            let data = encode(&e);
            let parsed: Value = serde_json::from_slice(&data).expect("valid JSON");
            assert_eq!(parsed["event_id"], "e-1");
            let back = decode(&data, 2, 9).expect("walbox's record");
            assert_eq!(back.message_id.as_deref(), Some("e-1"));
            assert_eq!((back.partition, back.offset), (2, 9));
            assert_eq!(back.key.as_deref(), key);
            assert!(back.headers.contains(&("raw".into(), vec![0xff, 0x00])));
            assert!(back.headers.contains(&("event_id".into(), b"e-1".to_vec())));
            if json {
                assert_eq!(
                    serde_json::from_slice::<Value>(&back.value).unwrap(),
                    serde_json::from_slice::<Value>(value).unwrap()
                );
            } else {
                assert_eq!(back.value, value);
            }
        }
        // A value beyond what a float holds reads back as written, and
        // headers of one name are all kept.
        let mut big = event(Some(b"k"), br#"{"n": 1e400}"#, true);
        big.headers
            .push(("event_id".into(), Bytes::from_static(b"again")));
        let back = decode(&encode(&big), 0, 0).expect("read back");
        assert_eq!(back.value, br#"{"n": 1e400}"#);
        assert_eq!(
            back.headers.iter().filter(|(k, _)| k == "event_id").count(),
            2
        );
        let null = event(None, b"null", true);
        assert_eq!(
            decode(&encode(&null), 0, 0).expect("read back").value,
            b"null"
        );
        assert!(decode(b"[1]", 0, 0).is_none());
        assert!(decode(b"{\"value\": 1}", 0, 0).is_none(), "no event id");
    }
}
