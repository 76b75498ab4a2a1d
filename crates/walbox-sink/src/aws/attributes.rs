//! How an event's headers become SQS or SNS message attributes, and the ids
//! those services take: what both services share.
//!
//! A message carries at most 10 attributes. The first is always `event_id`
//! (the sink's own id field). The record's headers follow in order, as
//! many as fit. When there are more than fit, or a header's name is not a
//! valid attribute name, or repeats one, the last slot becomes
//! `walbox_headers`: a JSON object holding every header that did not get
//! an attribute of its own (a value that is no UTF-8 text as `{"base64":
//! "..."}`). No header is dropped. A header value that is no text becomes
//! a `Binary` attribute.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use std::sync::Arc;

use sha2::Digest as _;
use walbox_outbox::Event;

use crate::DeliveryClass;
use crate::batched::Answer;

/// The most attributes a message carries.
pub(crate) const MAX_ATTRIBUTES: usize = 10;
/// The attribute holding the headers without one of their own.
pub(crate) const MORE_HEADERS: &str = "walbox_headers";
/// The attribute holding the event id.
pub(crate) const EVENT_ID: &str = "event_id";

/// An attribute's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Value {
    /// `String`.
    Text(String),
    /// `Binary`.
    Binary(Vec<u8>),
}

impl Value {
    fn len(&self) -> usize {
        match self {
            Value::Text(t) => t.len(),
            Value::Binary(b) => b.len(),
        }
    }
}

/// An event's attributes, in order.
pub(crate) type Attributes = Vec<(String, Value)>;

/// Whether `name` is an attribute name SQS and SNS take: 1 to 256 of
/// `A-Z a-z 0-9 _ - .`, no `.` first or last or twice in a row, not
/// starting with `AWS.` or `Amazon.` (any case).
pub(crate) fn valid_name(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    (1..=256).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && !lower.starts_with("aws.")
        && !lower.starts_with("amazon.")
}

/// Whether `text` holds only the characters SQS takes in a message body
/// or a text attribute (XML's: tab, newline, carriage return, and from
/// U+0020 on, but for surrogates and U+FFFE, U+FFFF).
pub(crate) fn valid_text(text: &str) -> bool {
    text.chars().all(|c| {
        matches!(c, '\u{9}' | '\u{a}' | '\u{d}' | '\u{20}'..='\u{d7ff}' | '\u{e000}'..='\u{fffd}')
            || c >= '\u{10000}'
    })
}

/// A header value as an attribute value: text when it is valid text,
/// else binary; `None` for an empty value, which SQS and SNS take in
/// neither form.
fn value_of(bytes: &[u8]) -> Option<Value> {
    if bytes.is_empty() {
        return None;
    }
    Some(match std::str::from_utf8(bytes) {
        Ok(text) if valid_text(text) => Value::Text(text.to_owned()),
        _ => Value::Binary(bytes.to_vec()),
    })
}

/// A value as the JSON of `walbox_headers`: text, or `{"base64": ...}`.
fn json_of(bytes: &[u8]) -> serde_json::Value {
    match std::str::from_utf8(bytes) {
        Ok(text) => serde_json::Value::String(text.to_owned()),
        Err(_) => serde_json::json!({"base64": STANDARD.encode(bytes)}),
    }
}

/// The attributes of `event`.
pub(crate) fn attributes(event: &Event) -> Attributes {
    let mut out: Attributes = Vec::new();
    let mut own: Vec<(String, Value)> = Vec::new();
    let mut rest: Vec<(&str, &[u8])> = Vec::new();
    match value_of(event.event_id.as_bytes()) {
        Some(id) => out.push((EVENT_ID.to_owned(), id)),
        None => rest.push((EVENT_ID, event.event_id.as_bytes())),
    }
    for (name, value) in &event.headers {
        let taken = out
            .iter()
            .chain(own.iter())
            .any(|(n, _)| n == name.as_ref());
        let same_id = name.as_ref() == EVENT_ID && value.as_ref() == event.event_id.as_bytes();
        match value_of(value) {
            Some(v) if valid_name(name) && !taken && name.as_ref() != MORE_HEADERS => {
                own.push((name.to_string(), v));
            }
            // The format's own `event_id` header holds the id already there.
            _ if same_id && !out.is_empty() => {}
            _ => rest.push((name, value)),
        }
    }
    let room = MAX_ATTRIBUTES - out.len();
    if own.len() > room || !rest.is_empty() {
        // The last slot holds what has no attribute of its own.
        let keep = if own.len() >= room {
            room - 1
        } else {
            own.len()
        };
        let moved: Vec<(String, Value)> = own.split_off(keep);
        let mut object = serde_json::Map::new();
        for (name, json) in moved
            .iter()
            .map(|(n, v)| {
                let bytes = match v {
                    Value::Text(t) => t.as_bytes(),
                    Value::Binary(b) => b.as_slice(),
                };
                (n.as_str(), json_of(bytes))
            })
            .chain(rest.iter().map(|(n, v)| (*n, json_of(v))))
        {
            // A name seen twice keeps every value, in an array.
            match object.get_mut(name) {
                Some(serde_json::Value::Array(all)) => all.push(json),
                Some(first) => *first = serde_json::Value::Array(vec![first.take(), json]),
                None => {
                    object.insert(name.to_owned(), json);
                }
            }
        }
        out.extend(own);
        out.push((
            MORE_HEADERS.to_owned(),
            Value::Text(serde_json::Value::Object(object).to_string()),
        ));
    } else {
        out.extend(own);
    }
    out
}

/// The bytes attributes count toward a message's size: names, types and
/// values.
pub(crate) fn size(attributes: &Attributes) -> usize {
    attributes
        .iter()
        .map(|(n, v)| n.len() + v.len() + "String".len())
        .sum()
}

/// An id as SQS and SNS take it for `MessageGroupId` and
/// `MessageDeduplicationId` (1 to 128 of the printable ASCII characters):
/// `text` itself when it is one, else the SHA-256 of it in hex (the same
/// text always gives the same id).
pub(crate) fn fifo_id(text: &[u8]) -> String {
    let valid = (1..=128).contains(&text.len()) && text.iter().all(|b| (0x21..=0x7e).contains(b));
    if valid {
        return String::from_utf8_lossy(text).into_owned();
    }
    sha2::Sha256::digest(text)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The deduplication id of `event`: the SHA-256 of its event id and its
/// source position (commit LSN and index), and for a replay's copy the
/// replay's name too (the crate's rule 2 for destinations that
/// deduplicate). A resend of the event (after a crash, a lost answer, a
/// dead-letter replay run again) has the same id and is dropped; another
/// event that happens to carry the same event id (two tables' `bigserial`
/// ids, an id handed out again) has another position, so it is never taken
/// for a duplicate of it. A snapshot taken again gives its rows positions
/// of its own: they are stored again (at least once, same `event_id`). A
/// position outside commit order (a snapshot row's, a non-transactional
/// message's) is marked so, since it can share its LSN and index with a
/// transaction's event.
pub(crate) fn dedup_id(event: &Event) -> String {
    let mut text = format!(
        "{}\n{}\n{}",
        event.event_id, event.position.commit_lsn, event.position.index
    );
    if event.origin.outside_commit_order() {
        text.push_str("\noutside commit order");
    }
    if let Some(name) = event.origin.replay_name() {
        text.push_str("\nreplay ");
        text.push_str(&name);
    }
    sha2::Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The group id of `event`: from its key, or for an event without a key
/// from its event id (no order is promised for it).
pub(crate) fn group_id(event: &Event) -> String {
    match &event.key {
        Some(k) => fifo_id(k),
        None => fifo_id(event.event_id.as_bytes()),
    }
}

/// The name an SQS queue or SNS topic gets from `topic`: every character
/// but `A-Z a-z 0-9 _ -` made `-`, `.fifo` added for FIFO (a topic ending
/// in `.fifo` keeps one), and a name longer than `max` cut, with 16 hex
/// digits of the topic's SHA-256 so that it stays its own.
pub(crate) fn aws_name(topic: &str, fifo: bool, max: usize) -> String {
    let stem = if fifo {
        topic.strip_suffix(".fifo").unwrap_or(topic)
    } else {
        topic
    };
    let mut name: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let suffix = if fifo { ".fifo" } else { "" };
    if name.len() + suffix.len() > max {
        let hash: String = sha2::Sha256::digest(topic.as_bytes())[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        name.truncate(max - suffix.len() - hash.len() - 1);
        name.push('-');
        name.push_str(&hash);
    }
    name.push_str(suffix);
    name
}

/// A message as SQS's `SendMessageBatch` and SNS's `PublishBatch` take it.
#[derive(Debug, Clone)]
pub(crate) struct Message {
    pub(crate) body: Arc<str>,
    pub(crate) attributes: Arc<Attributes>,
    pub(crate) group: Option<String>,
    pub(crate) dedup: Option<String>,
}

/// The message `event` becomes (FIFO ids when `fifo`), or why it cannot be
/// one: a body that is no text SQS and SNS take, or a message above
/// `max_bytes` (`table`'s `max_message_bytes`).
pub(crate) fn message(
    event: &Event,
    fifo: bool,
    max_bytes: usize,
    table: &str,
) -> Result<(Message, usize), (DeliveryClass, String)> {
    let body = std::str::from_utf8(&event.value).map_err(|_| {
        (
            DeliveryClass::InvalidRecord,
            "the value is no UTF-8 text, which a message body must be".to_owned(),
        )
    })?;
    if body.is_empty() || !valid_text(body) {
        return Err((
            DeliveryClass::InvalidRecord,
            "the value is empty or holds characters a message body cannot (control \
             characters other than tab, newline and carriage return)"
                .to_owned(),
        ));
    }
    let attributes = attributes(event);
    let size = body.len() + self::size(&attributes);
    if size > max_bytes {
        return Err((
            DeliveryClass::MessageTooLarge,
            format!(
                "the message is {size} bytes (body and attributes), above \
                 {table}.max_message_bytes = {max_bytes}"
            ),
        ));
    }
    let (group, dedup) = if fifo {
        (Some(group_id(event)), Some(dedup_id(event)))
    } else {
        (None, None)
    };
    Ok((
        Message {
            body: Arc::from(body),
            attributes: Arc::new(attributes),
            group,
            dedup,
        },
        size,
    ))
}

/// A failed entry of a batch call's answer: its id, the service's code,
/// whether it is the sender's fault, and the service's message.
pub(crate) struct Failed<'a> {
    pub id: &'a str,
    pub code: &'a str,
    pub sender_fault: bool,
    pub message: Option<&'a str>,
}

/// The answer of each of the `sent` entries of a batch call to `dest`
/// (their ids: their places, as text), from the entries the service listed
/// as stored (with whether it gave a message id) and as failed. An entry
/// listed as both counts as failed; one listed as neither, or stored
/// without a message id, is sent again.
pub(crate) fn batch_answers<'a>(
    service: &str,
    dest: &str,
    sent: usize,
    stored: impl IntoIterator<Item = (&'a str, bool)>,
    failed: impl IntoIterator<Item = Failed<'a>>,
) -> Vec<Answer> {
    let mut answers: Vec<Option<Answer>> = vec![None; sent];
    let place = |id: &str| id.parse::<usize>().ok().filter(|i| *i < sent);
    for (id, with_message_id) in stored {
        if let Some(i) = place(id)
            && with_message_id
        {
            answers[i] = Some(Answer::Stored);
        }
    }
    for f in failed {
        let Some(i) = place(f.id) else { continue };
        let said = format!(
            "{service} answered {} for a message of {dest:?}: {}",
            f.code,
            f.message.unwrap_or("").lines().next().unwrap_or("")
        );
        answers[i] = Some(entry_answer(f.code, f.sender_fault, said));
    }
    answers
        .into_iter()
        .map(|a| {
            a.unwrap_or_else(|| {
                Answer::Retry(format!(
                    "{service}'s answer for {dest:?} named the message neither stored nor failed"
                ))
            })
        })
        .collect()
}

/// What a failed batch entry's answer means (SQS and SNS answer alike): a
/// fault of the sender (`SenderFault`, or a code that says the message is
/// refused) is the message's, refused for good (its dead letter takes its
/// place); anything else (throttled, an internal error) is sent again.
pub(crate) fn entry_answer(code: &str, sender_fault: bool, said: String) -> Answer {
    let code = code.strip_suffix("Exception").unwrap_or(code);
    let class = match code {
        "MessageTooLong" | "BatchRequestTooLong" => DeliveryClass::MessageTooLarge,
        "InvalidMessageContents"
        | "InvalidParameterValue"
        | "InvalidParameter"
        | "InvalidAttributeName"
        | "InvalidAttributeValue"
        | "MissingParameter"
        | "InvalidBatchEntryId"
        | "ValidationError" => DeliveryClass::InvalidRecord,
        // SQS's and SNS's spellings of a throttle, KMS's included: sent
        // again whatever the sender-fault flag says.
        "RequestThrottled" | "Throttling" | "Throttled" | "KmsThrottled" | "KMSThrottling" => {
            return Answer::Retry(said);
        }
        _ if sender_fault => DeliveryClass::InvalidRecord,
        _ => return Answer::Retry(said),
    };
    Answer::Refused(class, said)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn event(headers: &[(&str, &[u8])]) -> Event {
        let mut e = crate::batched::tests_event("e-1", "k");
        e.headers = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned().into(), Bytes::copy_from_slice(v)))
            .collect();
        e
    }

    #[test]
    fn every_header_is_carried_in_ten_attributes_at_most() {
        // Few headers: each its own, the format's event_id not repeated.
        let few = attributes(&event(&[("event_id", b"e-1"), ("event_type", b"Placed")]));
        assert_eq!(
            few,
            vec![
                ("event_id".into(), Value::Text("e-1".into())),
                ("event_type".into(), Value::Text("Placed".into())),
            ]
        );
        // Many, a bad name, a binary value: 10 attributes, the rest in JSON.
        let names: Vec<String> = (0..12).map(|i| format!("h{i}")).collect();
        let mut headers: Vec<(&str, &[u8])> =
            names.iter().map(|n| (n.as_str(), &b"v"[..])).collect();
        headers.push(("AWS.reserved", b"x"));
        headers.push(("raw", &[0xff]));
        let many = attributes(&event(&headers));
        assert_eq!(many.len(), MAX_ATTRIBUTES);
        assert_eq!(many[0].0, "event_id");
        let (last, Value::Text(json)) = &many[9] else {
            panic!("{many:?}")
        };
        assert_eq!(last, MORE_HEADERS);
        let rest: serde_json::Value = serde_json::from_str(json).unwrap();
        for n in &names[8..] {
            assert_eq!(rest[n], "v", "{rest}");
        }
        assert_eq!(rest["AWS.reserved"], "x");
        assert_eq!(rest["raw"]["base64"], "/w==");
        // Every header is somewhere.
        for n in &names[..8] {
            assert!(many.iter().any(|(k, _)| k == n));
        }
        // A binary value with room to spare is a Binary attribute.
        let binary = attributes(&event(&[("raw", &[0xff])]));
        assert_eq!(binary[1].1, Value::Binary(vec![0xff]));
        // An empty value, which SQS refuses as an attribute, goes in the JSON.
        let empty = attributes(&event(&[("trace", b""), ("type", b"Placed")]));
        assert!(
            !empty
                .iter()
                .any(|(_, v)| *v == Value::Text(String::new()) || *v == Value::Binary(vec![])),
            "{empty:?}"
        );
        let (_, Value::Text(json)) = empty.last().unwrap() else {
            panic!("{empty:?}")
        };
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(json).unwrap()["trace"],
            ""
        );
    }

    #[test]
    fn ids_are_what_fifo_takes_and_stable() {
        assert_eq!(fifo_id(b"order-17"), "order-17");
        let long = fifo_id(&[b'x'; 200]);
        assert_eq!(long.len(), 64);
        assert_eq!(long, fifo_id(&[b'x'; 200]));
        assert_eq!(fifo_id("ordre-é".as_bytes()).len(), 64);
        assert_eq!(fifo_id(b"a b").len(), 64, "a space is not taken");
        // The same event sent again: the same id; another event with the
        // same event id at another position, or a replay's copy: another.
        let e = event(&[]);
        assert_eq!(dedup_id(&e), dedup_id(&e.clone()));
        assert_eq!(dedup_id(&e).len(), 64);
        let mut other = e.clone();
        other.position.index += 1;
        assert_ne!(dedup_id(&other), dedup_id(&e));
        let mut replayed = e.clone();
        replayed.origin = walbox_outbox::Origin::Replay {
            from: walbox_pgoutput::Lsn(0x10),
        };
        assert_ne!(dedup_id(&replayed), dedup_id(&e));
        assert!(valid_text("a\tb\n"));
        assert!(!valid_text("a\u{1}b"));
        assert!(!valid_name(".a") && !valid_name("a..b") && !valid_name("amazon.x"));
    }

    #[test]
    fn a_snapshot_row_and_a_streamed_event_at_one_position_have_their_own_dedup_ids() {
        // Two tables' bigserial ids: the snapshot row of one and the first
        // streamed event of the other, at the same LSN and index.
        let streamed = crate::batched::tests_event("1", "k");
        let mut snapshot = streamed.clone();
        snapshot.origin = walbox_outbox::Origin::Snapshot {
            point: streamed.position.commit_lsn,
        };
        assert_ne!(dedup_id(&streamed), dedup_id(&snapshot));
        assert_eq!(dedup_id(&streamed), dedup_id(&streamed.clone()));
    }

    #[test]
    fn throttles_in_either_services_spelling_are_sent_again_whatever_the_fault_flag() {
        for code in [
            "KMSThrottling",
            "KmsThrottled",
            "Throttling",
            "RequestThrottled",
        ] {
            for sender_fault in [false, true] {
                assert!(
                    matches!(
                        entry_answer(code, sender_fault, String::new()),
                        Answer::Retry(_)
                    ),
                    "{code} (sender fault {sender_fault})"
                );
            }
        }
    }

    #[test]
    fn a_batch_answer_settles_each_entry_by_its_id() {
        let answers = batch_answers(
            "sqs",
            "q",
            4,
            [("0", true), ("1", false), ("2", true), ("9", true)],
            [Failed {
                id: "2",
                code: "InvalidMessageContents",
                sender_fault: true,
                message: Some("bad\nsecond line"),
            }],
        );
        assert_eq!(answers[0], Answer::Stored);
        assert!(matches!(&answers[1], Answer::Retry(_)), "no message id");
        assert!(
            matches!(&answers[2], Answer::Refused(DeliveryClass::InvalidRecord, why) if why.ends_with("bad")),
            "{:?}",
            answers[2]
        );
        assert!(matches!(&answers[3], Answer::Retry(_)), "named neither");
    }
}
