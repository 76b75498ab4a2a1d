//! An event as a Pub/Sub message: its value as `data`, its headers as
//! attributes with `event_id` always among them, its aggregate key as the
//! ordering key; and Pub/Sub's limits checked before anything is sent.
//!
//! What Pub/Sub cannot carry refuses the event (it goes to a dead letter,
//! with the reason): a header whose name is empty, longer than 256 bytes or
//! starts with `goog`, whose value is not UTF-8 text or longer than 1,024
//! bytes, a name twice, more than 100 attributes, a key longer than 1,024
//! bytes, a message over 10 MB. A dead letter itself is never refused for
//! its headers: it leaves those out and names them in
//! `walbox_dropped_headers` (their number, then their percent-encoded
//! names).

use std::collections::HashSet;

use base64::Engine as _;
use serde_json::{Map, Value};
use walbox_outbox::Event;

use crate::DeliveryClass;
use crate::kit::is_dead_letter;
use crate::nats::percent_encode;

/// The most attributes a message may have.
pub const MAX_ATTRIBUTES: usize = 100;
/// The longest attribute name, in bytes.
pub const MAX_ATTRIBUTE_KEY: usize = 256;
/// The longest attribute value, in bytes.
pub const MAX_ATTRIBUTE_VALUE: usize = 1024;
/// The longest ordering key, in bytes.
pub const MAX_ORDERING_KEY: usize = 1024;
/// The largest message (data, attributes, ordering key), in bytes.
pub const MAX_MESSAGE: usize = 10_000_000;
/// The largest Publish request as sent (JSON, data in base64).
pub const MAX_REQUEST: usize = 10 * 1024 * 1024;

/// The attribute that carries the event id.
pub const EVENT_ID_ATTRIBUTE: &str = walbox_outbox::header::EVENT_ID;
/// Marks an ordering key carried in base64 (a key that is not UTF-8 text).
pub const KEY_ENCODING_ATTRIBUTE: &str = "walbox_key_encoding";
/// On a dead letter: the headers (and `orderingKey`) of the record it
/// replaces that Pub/Sub cannot carry, left out: their number, then their
/// names percent-encoded and separated by `,`.
pub const DROPPED_HEADERS_ATTRIBUTE: &str = "walbox_dropped_headers";

/// One message, ready to send.
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
    /// The message as JSON (a `PubsubMessage`).
    pub json: String,
    /// Its size as Pub/Sub counts it: data, attributes, ordering key.
    pub size: usize,
}

/// Whether `topic` is a name Pub/Sub takes: 3 to 255 characters, starting
/// with a letter, of letters, digits and `-_.~+%`, not starting with `goog`.
pub(crate) fn valid_topic(topic: &str) -> bool {
    (3..=255).contains(&topic.len())
        && topic.starts_with(|c: char| c.is_ascii_alphabetic())
        && !topic
            .get(..4)
            .is_some_and(|p| p.eq_ignore_ascii_case("goog"))
        && topic
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.~+%".contains(&b))
}

/// A name Pub/Sub takes for a dead letter whose topic is not one: every
/// other character becomes `_`, `walbox-` goes in front of a name that does
/// not start with a letter or starts with `goog`, and it is cut at 255.
pub(crate) fn sanitized_topic(topic: &str) -> String {
    let mut name: String = topic
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.~+%".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if !name.starts_with(|c: char| c.is_ascii_alphabetic())
        || name
            .get(..4)
            .is_some_and(|p| p.eq_ignore_ascii_case("goog"))
        || name.len() < 3
    {
        name.insert_str(0, "walbox-");
    }
    name.truncate(255);
    name
}

/// Why header `name` (with `value`) cannot be an attribute; never shows
/// the value.
fn attribute_problem(name: &str, value: &[u8]) -> Option<String> {
    if name.is_empty() {
        return Some("a header with an empty name cannot be a Pub/Sub attribute".into());
    }
    if name.len() > MAX_ATTRIBUTE_KEY {
        return Some(format!(
            "header name {:?}... is {} bytes, over Pub/Sub's {MAX_ATTRIBUTE_KEY}-byte attribute \
             name",
            name.chars().take(40).collect::<String>(),
            name.len()
        ));
    }
    if name
        .get(..4)
        .is_some_and(|p| p.eq_ignore_ascii_case("goog"))
    {
        return Some(format!(
            "header {name:?} starts with \"goog\", which Pub/Sub keeps for itself; rename it in \
             the row's headers"
        ));
    }
    if std::str::from_utf8(value).is_err() {
        return Some(format!(
            "header {name:?} is not UTF-8 text, which a Pub/Sub attribute needs; store it as text"
        ));
    }
    if value.len() > MAX_ATTRIBUTE_VALUE {
        return Some(format!(
            "header {name:?} is {} bytes, over Pub/Sub's {MAX_ATTRIBUTE_VALUE}-byte attribute \
             value; move it into the payload",
            value.len()
        ));
    }
    None
}

/// `event` as a Pub/Sub message, or why it cannot be one (the class and
/// reason of its refusal; never a header's or the payload's content).
pub(crate) fn prepare(event: &Event) -> Result<Prepared, (DeliveryClass, String)> {
    let letter = is_dead_letter(event);
    let mut attributes = Map::new();
    let mut seen = HashSet::new();
    let mut dropped: Vec<String> = Vec::new();
    let mut size = event.value.len();
    for (k, v) in &event.headers {
        let name: &str = k.as_ref();
        let problem = attribute_problem(name, v).or_else(|| {
            if !seen.insert(name) {
                Some(format!(
                    "header {name:?} appears twice; a Pub/Sub message has one attribute per name"
                ))
            } else if name == EVENT_ID_ATTRIBUTE && v.as_ref() != event.event_id.as_bytes() {
                Some(format!(
                    "header {EVENT_ID_ATTRIBUTE:?} holds another value than the event id, which \
                     walbox writes there; rename it in the row's headers"
                ))
            } else {
                None
            }
        });
        match problem {
            None => {
                let text = String::from_utf8_lossy(v).into_owned();
                size += name.len() + text.len();
                attributes.insert(name.to_owned(), Value::String(text));
            }
            Some(_) if letter => dropped.push(name.to_owned()),
            Some(reason) => return Err((DeliveryClass::InvalidRecord, reason)),
        }
    }
    if !attributes.contains_key(EVENT_ID_ATTRIBUTE) {
        size += EVENT_ID_ATTRIBUTE.len() + event.event_id.len();
        attributes.insert(
            EVENT_ID_ATTRIBUTE.into(),
            Value::String(event.event_id.clone()),
        );
    }
    let mut ordering_key = None;
    if let Some(key) = &event.key {
        let (text, encoded) = match std::str::from_utf8(key) {
            Ok(t) => (t.to_owned(), false),
            Err(_) => (base64::engine::general_purpose::STANDARD.encode(key), true),
        };
        if text.len() > MAX_ORDERING_KEY {
            if !letter {
                return Err((
                    DeliveryClass::InvalidRecord,
                    format!(
                        "the key is {} bytes{}, over Pub/Sub's {MAX_ORDERING_KEY}-byte ordering key",
                        text.len(),
                        if encoded { " in base64" } else { "" }
                    ),
                ));
            }
            dropped.push("orderingKey".into());
        } else {
            if encoded {
                size += KEY_ENCODING_ATTRIBUTE.len() + 6;
                attributes.insert(
                    KEY_ENCODING_ATTRIBUTE.into(),
                    Value::String("base64".into()),
                );
            }
            size += text.len();
            ordering_key = Some(text);
        }
    }
    // Attributes past the limit: an event is refused; a dead letter leaves
    // out the row's own (walbox's come first in its headers, and stay).
    let room = |dropped: &[String]| MAX_ATTRIBUTES - usize::from(!dropped.is_empty());
    if attributes.len() > MAX_ATTRIBUTES {
        if !letter {
            return Err((
                DeliveryClass::InvalidRecord,
                format!(
                    "{} attributes (the headers and event_id), over Pub/Sub's {MAX_ATTRIBUTES}; \
                     carry fewer headers",
                    attributes.len()
                ),
            ));
        }
        let names: Vec<String> = attributes.keys().cloned().collect();
        for name in names.iter().rev() {
            if attributes.len() <= room(&dropped) {
                break;
            }
            if name.starts_with("walbox_") || name == EVENT_ID_ATTRIBUTE {
                continue;
            }
            if let Some(Value::String(v)) = attributes.remove(name) {
                size -= name.len() + v.len();
            }
            dropped.push(name.clone());
        }
    }
    if !dropped.is_empty() {
        let names: Vec<String> = dropped.iter().map(|n| percent_encode(n)).collect();
        let text = format!("{} {}", dropped.len(), names.join(","));
        let text = if text.len() > MAX_ATTRIBUTE_VALUE {
            format!("{} (names too long to list)", dropped.len())
        } else {
            text
        };
        size += DROPPED_HEADERS_ATTRIBUTE.len() + text.len();
        attributes.insert(DROPPED_HEADERS_ATTRIBUTE.into(), Value::String(text));
    }
    if size > MAX_MESSAGE {
        return Err((
            DeliveryClass::MessageTooLarge,
            format!("the message is {size} bytes, over Pub/Sub's {MAX_MESSAGE}"),
        ));
    }
    let mut message = Map::new();
    message.insert(
        "data".into(),
        Value::String(base64::engine::general_purpose::STANDARD.encode(&event.value)),
    );
    message.insert("attributes".into(), Value::Object(attributes));
    if let Some(k) = ordering_key {
        message.insert("orderingKey".into(), Value::String(k));
    }
    let json = Value::Object(message).to_string();
    if json.len() + 20 > MAX_REQUEST {
        return Err((
            DeliveryClass::MessageTooLarge,
            format!(
                "the message is {} bytes as sent (its data in base64, in JSON), over the \
                 {MAX_REQUEST}-byte Publish request",
                json.len()
            ),
        ));
    }
    Ok(Prepared { json, size })
}

/// The body of a Publish request of `messages`.
pub(crate) fn publish_body<'a>(messages: impl Iterator<Item = &'a Prepared>) -> String {
    let mut body = String::from("{\"messages\":[");
    for (i, m) in messages.enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&m.json);
    }
    body.push_str("]}");
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::borrow::Cow;
    use walbox_outbox::Position;

    fn event(headers: Vec<(&str, Vec<u8>)>) -> Event {
        Event {
            event_id: "e1".into(),
            topic: "orders".into(),
            key: Some(Bytes::from_static(b"k1")),
            value: Bytes::from_static(b"{}"),
            json_value: true,
            headers: headers
                .into_iter()
                .map(|(k, v)| (Cow::Owned(k.to_owned()), Bytes::from(v)))
                .collect(),
            position: Position {
                commit_lsn: walbox_pgoutput::Lsn(1),
                index: 0,
                xid: 1,
            },
            origin: walbox_outbox::Origin::Stream,
        }
    }

    fn parsed(p: &Prepared) -> Value {
        serde_json::from_str(&p.json).unwrap()
    }

    #[test]
    fn headers_become_attributes_with_the_event_id_and_the_key_orders() {
        let p = prepare(&event(vec![("event_type", b"Placed".to_vec())])).unwrap();
        let m = parsed(&p);
        assert_eq!(m["attributes"]["event_type"], "Placed");
        assert_eq!(m["attributes"]["event_id"], "e1");
        assert_eq!(m["orderingKey"], "k1");
        assert_eq!(m["data"], "e30=");
        assert_eq!(p.size, 2 + 10 + 6 + 8 + 2 + 2);
        // A key that is not UTF-8 orders in base64, and says so.
        let mut e = event(vec![]);
        e.key = Some(Bytes::from_static(&[0xff, 0x00]));
        let m = parsed(&prepare(&e).unwrap());
        assert_eq!(m["orderingKey"], "/wA=");
        assert_eq!(m["attributes"][KEY_ENCODING_ATTRIBUTE], "base64");
    }

    #[test]
    fn what_pubsub_cannot_carry_refuses_an_event_with_the_reason_and_a_dead_letter_leaves_it_out() {
        let over = |headers: Vec<(&str, Vec<u8>)>| prepare(&event(headers)).unwrap_err();
        let long_name = "n".repeat(257);
        for (headers, says) in [
            (vec![("goog_x", b"v".to_vec())], "goog"),
            (vec![("bin", vec![0xff])], "UTF-8"),
            (vec![("big", vec![b'v'; 1025])], "1024-byte"),
            (vec![(long_name.as_str(), b"v".to_vec())], "256-byte"),
            (vec![("a", b"1".to_vec()), ("a", b"2".to_vec())], "twice"),
            (vec![("event_id", b"other".to_vec())], "event id"),
        ] {
            let (class, reason) = over(headers);
            assert_eq!(class, DeliveryClass::InvalidRecord);
            assert!(reason.contains(says), "{reason}");
            assert!(!reason.contains("vvvv"), "never the value: {reason}");
        }
        let many: Vec<(String, Vec<u8>)> =
            (0..100).map(|i| (format!("h{i}"), vec![b'v'])).collect();
        let (_, reason) = prepare(&event(
            many.iter().map(|(k, v)| (k.as_str(), v.clone())).collect(),
        ))
        .unwrap_err();
        assert!(reason.contains("101 attributes"), "{reason}");
        let mut e = event(vec![]);
        e.value = Bytes::from(vec![b'x'; MAX_MESSAGE]);
        assert_eq!(prepare(&e).unwrap_err().0, DeliveryClass::MessageTooLarge);
        let mut e = event(vec![]);
        e.value = Bytes::from(vec![b'x'; 8 * 1024 * 1024]);
        let (class, reason) = prepare(&e).unwrap_err();
        assert_eq!(class, DeliveryClass::MessageTooLarge);
        assert!(reason.contains("base64"), "{reason}");

        // A dead letter keeps walbox's headers and names what it left out.
        let mut headers: Vec<(String, Vec<u8>)> = vec![
            ("walbox_error_class".into(), b"invalid_record".to_vec()),
            ("goog_x".into(), b"v".to_vec()),
        ];
        headers.extend((0..105).map(|i| (format!("h{i:03}"), vec![b'v'])));
        let letter = event(
            headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.clone()))
                .collect(),
        );
        let m = parsed(&prepare(&letter).unwrap());
        let attributes = m["attributes"].as_object().unwrap();
        assert_eq!(attributes.len(), MAX_ATTRIBUTES);
        assert_eq!(attributes["walbox_error_class"], "invalid_record");
        assert_eq!(attributes["event_id"], "e1");
        let dropped = attributes[DROPPED_HEADERS_ATTRIBUTE].as_str().unwrap();
        assert!(dropped.starts_with("9 goog_x,h104,h103,"), "{dropped}");
    }

    #[test]
    fn topic_names_are_checked_and_a_dead_letters_made_valid() {
        assert!(valid_topic("orders.order"));
        for bad in ["or", "1orders", "goog-orders", "orders order", "ordérs"] {
            assert!(!valid_topic(bad), "{bad}");
        }
        assert_eq!(sanitized_topic("1x y.dlq"), "walbox-1x_y.dlq");
        assert!(valid_topic(&sanitized_topic("goog.dlq")));
        assert!(valid_topic(&sanitized_topic(".")));
    }
}
