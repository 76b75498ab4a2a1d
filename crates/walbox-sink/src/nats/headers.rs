//! What a NATS message carries besides its payload: the subject checks (and a
//! dead letter's subject made valid), the headers (the event's, those a dead
//! letter leaves out, its key, its `Nats-Msg-Id` and the chain's expectation)
//! and their size on the wire.

use std::str::FromStr;

use async_nats::{HeaderMap, HeaderName, HeaderValue};
use walbox_outbox::Event;

/// The header that carries the record key (NATS messages have no key).
pub const KEY_HEADER: &str = "walbox_key";

/// Marks a key carried in base64: `walbox_key_encoding: base64`, for a key
/// that is not UTF-8 text or holds a line break.
pub const KEY_ENCODING_HEADER: &str = "walbox_key_encoding";

/// On a dead letter: the headers of the record it replaces that NATS cannot
/// carry, left out: their number, then their names percent-encoded and
/// separated by `,` (`2 note,Nats-Msg-Id`).
pub const DROPPED_HEADERS_HEADER: &str = "walbox_dropped_headers";

/// The origin of an event that was not streamed ([`walbox_outbox::Origin::kind`]:
/// `snapshot`, `message`, `replay`, `dlq_replay`); a streamed event has none.
/// The duplicate check reads it back, never a transaction id.
pub const ORIGIN_HEADER: &str = "walbox_origin";

/// Whether a message of origin `kind` (the text of [`ORIGIN_HEADER`]) has a
/// position that every read of the WAL gives it.
pub(super) fn stable_origin(kind: &str) -> bool {
    !matches!(kind, "snapshot" | "message" | "dlq_replay_snapshot")
}

/// Whether `subject` is a subject one can publish to: non-empty tokens
/// separated by `.`, without wildcards or white space.
pub(super) fn valid_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|t| {
            !t.is_empty() && t != "*" && t != ">" && !t.contains(|c: char| c.is_whitespace())
        })
}

/// A subject NATS takes, for a dead letter whose own is not one: an empty
/// token becomes `_`, and so does each wildcard or white-space character
/// (`outbox..dlq` -> `outbox._.dlq`), so it stays under the stream's
/// `outbox.>`.
pub(super) fn sanitized_subject(subject: &str) -> String {
    subject
        .split('.')
        .map(|t| {
            if t.is_empty() {
                "_".to_owned()
            } else {
                t.chars()
                    .map(|c| {
                        if c == '*' || c == '>' || c.is_whitespace() {
                            '_'
                        } else {
                            c
                        }
                    })
                    .collect()
            }
        })
        .collect::<Vec<String>>()
        .join(".")
}

/// Whether `event` is a dead letter (it carries the error class).
pub(crate) fn is_dead_letter(event: &Event) -> bool {
    event
        .headers
        .iter()
        .any(|(k, _)| k.as_ref() == walbox_outbox::dead_letter_header::ERROR_CLASS)
}

/// Whether a header is named like the server's own (`Nats-*`, any case),
/// which the server would act on (`Nats-Msg-Id`, `Nats-Expected-*`).
fn server_header(name: &str) -> bool {
    name.get(..5)
        .is_some_and(|p| p.eq_ignore_ascii_case("nats-"))
}

/// A name NATS takes as it is: letters, digits, `_`, `-` and `.`.
fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// A header name as NATS carries it: walbox's own names (static) without a
/// copy, the row's own checked and copied.
fn nats_name(name: &walbox_outbox::HeaderName) -> Result<HeaderName, String> {
    match name {
        std::borrow::Cow::Borrowed(s) if plain_name(s) => Ok(HeaderName::from_static(s)),
        _ => HeaderName::from_str(name).map_err(|_| {
            format!(
                "header name {name:?} is not a NATS header name (it holds white space, ':' or a \
                 control character); rename it in the row's headers"
            )
        }),
    }
}

/// One header as NATS carries it; `Err` says why it cannot (never its value).
fn nats_header(
    name: &walbox_outbox::HeaderName,
    value: &[u8],
) -> Result<(HeaderName, HeaderValue), String> {
    let n = nats_name(name)?;
    nats_value(name, n, value)
}

/// `value` as the value of header `n` (named `name` in messages).
fn nats_value(
    name: &str,
    n: HeaderName,
    value: &[u8],
) -> Result<(HeaderName, HeaderValue), String> {
    let text = std::str::from_utf8(value).map_err(|_| {
        format!("header {name:?} is not UTF-8 text, which a NATS header needs; store it as text")
    })?;
    let v = HeaderValue::from_str(text).map_err(|_| {
        format!(
            "header {name:?} holds a line break, which a NATS header cannot carry; remove it \
             from the value in the row's headers"
        )
    })?;
    Ok((n, v))
}

/// The headers of one message and those of the event's left out.
pub(super) struct Headers {
    /// What is sent.
    pub(super) map: HeaderMap,
    /// The names of the event's headers a dead letter leaves out.
    pub(super) dropped: Vec<String>,
    /// The text of [`KEY_HEADER`], when the event has a key.
    pub(super) key: Option<String>,
}

/// The event's headers, its key and its id as NATS headers. An event's header
/// NATS cannot carry, or one named `Nats-*`, refuses the event (`Err` says
/// why; it goes to a dead letter); a dead letter leaves such headers out and
/// names them in [`DROPPED_HEADERS_HEADER`]. A key that is not UTF-8 text or
/// holds a line break is carried in base64, marked by [`KEY_ENCODING_HEADER`].
pub(super) fn headers_of(event: &Event, expected_last: Option<&str>) -> Result<Headers, String> {
    let dead_letter = is_dead_letter(event);
    let mut map = HeaderMap::new();
    let mut dropped = Vec::new();
    for (k, v) in &event.headers {
        let name: &str = k.as_ref();
        let header = if server_header(name) {
            Err(format!(
                "header {name:?} is named like the NATS server's own headers (Nats-*), which the \
                 server would act on; rename it in the row's headers"
            ))
        } else {
            nats_header(k, v)
        };
        match header {
            Ok((n, v)) => map.append(n, v),
            Err(_) if dead_letter => dropped.push(name.to_owned()),
            Err(reason) => return Err(reason),
        }
    }
    let mut key_text = None;
    if let Some(key) = &event.key {
        let key_name = HeaderName::from_static(KEY_HEADER);
        match std::str::from_utf8(key)
            .ok()
            .and_then(|t| Some((t, HeaderValue::from_str(t).ok()?)))
        {
            Some((t, v)) => {
                key_text = Some(t.to_owned());
                map.append(key_name, v);
            }
            None => {
                let encoded = base64_encode(key);
                map.append(key_name, encoded.as_str());
                map.append(HeaderName::from_static(KEY_ENCODING_HEADER), "base64");
                key_text = Some(encoded);
            }
        }
    }
    if event.origin != walbox_outbox::Origin::Stream {
        map.append(HeaderName::from_static(ORIGIN_HEADER), event.origin.kind());
    }
    if !dropped.is_empty() {
        let names: Vec<String> = dropped.iter().map(|n| percent_encode(n)).collect();
        map.append(
            DROPPED_HEADERS_HEADER,
            format!("{} {}", dropped.len(), names.join(",")).as_str(),
        );
    }
    let id = msg_id(event);
    let (n, v) = nats_value(
        "Nats-Msg-Id",
        HeaderName::from_static("Nats-Msg-Id"),
        id.as_bytes(),
    )
    .map_err(|_| "the event id holds a line break, which Nats-Msg-Id cannot carry".to_owned())?;
    map.append(n, v);
    if let Some(last) = expected_last {
        map.append("Nats-Expected-Last-Msg-Id", last);
    }
    Ok(Headers {
        map,
        dropped,
        key: key_text,
    })
}

/// `name` with every byte but `A-Z a-z 0-9 - _ .` as `%XX`.
pub(crate) fn percent_encode(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(BASE64[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes standard base64 with padding; `None` when it is not.
pub(crate) fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let text = text.as_bytes();
    if !text.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    for chunk in text.chunks(4) {
        let pad = chunk.iter().rev().take_while(|c| **c == b'=').count();
        if pad > 2 {
            return None;
        }
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            let v = if i >= 4 - pad {
                0
            } else {
                u32::try_from(BASE64.iter().position(|b| b == c)?).ok()?
            };
            n |= v << (18 - 6 * i);
        }
        for i in 0..3 - pad {
            out.push(((n >> (16 - 8 * i)) & 0xff) as u8);
        }
    }
    Some(out)
}

/// The `Nats-Msg-Id` of an event: its event id, and for a dead letter its
/// event id followed by `.dlq`. The stream drops a message whose id it holds
/// within its duplicate window, so a dead letter must not hold the event's own
/// id: `walbox dlq replay` publishes the event under that id once the cause is
/// fixed. A replay after a crash republishes either under the same id as
/// before, and the stream drops it.
pub(super) fn msg_id(event: &Event) -> String {
    if is_dead_letter(event) {
        format!("{}.dlq", event.event_id)
    } else {
        event.event_id.clone()
    }
}

/// The size of the header block NATS sends for `h`: `NATS/1.0`, a line per
/// value, an empty line.
pub(super) fn wire_len(h: &HeaderMap) -> usize {
    let mut n = "NATS/1.0\r\n".len() + 2;
    for (name, values) in h.iter() {
        for v in values {
            n += AsRef::<str>::as_ref(name).len() + 2 + v.as_str().len() + 2;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(
        key: Option<&[u8]>,
        headers: &[(&'static str, &str)],
        owned: &[(&str, &str)],
    ) -> Event {
        let mut h: Vec<(walbox_outbox::HeaderName, bytes::Bytes)> = headers
            .iter()
            .map(|(k, v)| {
                (
                    std::borrow::Cow::Borrowed(*k),
                    bytes::Bytes::from(v.to_string()),
                )
            })
            .collect();
        h.extend(owned.iter().map(|(k, v)| {
            (
                std::borrow::Cow::Owned((*k).to_owned()),
                bytes::Bytes::from(v.to_string()),
            )
        }));
        Event {
            event_id: "e-1".into(),
            topic: "outbox.order".into(),
            key: key.map(bytes::Bytes::copy_from_slice),
            value: bytes::Bytes::from_static(b"{}"),
            json_value: true,
            headers: h,
            position: walbox_outbox::Position {
                commit_lsn: walbox_pgoutput::Lsn(0x16_B374_D848),
                index: 3,
                xid: 991,
            },
            origin: walbox_outbox::Origin::Stream,
        }
    }

    /// What walbox keeps of a sent message to compare a duplicate with
    /// (taken from the event: its position, and whether its origin makes that
    /// position the same on every copy) is what the message's own headers say
    /// when the stream hands it back.
    #[test]
    fn what_is_kept_of_a_publication_is_what_its_headers_say() {
        use walbox_outbox::Origin;
        use walbox_outbox::header::{COMMIT_LSN, EVENT_ID, INDEX, XID};
        let streamed = [
            (EVENT_ID, "e-1"),
            (COMMIT_LSN, "16/B374D848"),
            (INDEX, "3"),
            (XID, "991"),
        ];
        let with = |mut e: Event, origin: Origin| {
            e.origin = origin;
            e
        };
        let cases = [
            event(Some(b"order-17"), &streamed, &[]),
            event(Some(b"\xff\x00"), &streamed, &[]),
            event(None, &streamed, &[("tenant", "acme")]),
            // A snapshot row: no position that stays the same, whatever its
            // transaction id says.
            with(
                event(Some(b"k"), &streamed, &[]),
                Origin::Snapshot {
                    point: walbox_pgoutput::Lsn(0x16_B374_D848),
                },
            ),
            // A non-transactional message's dead letter: neither.
            with(
                event(Some(b"k"), &streamed, &[]),
                Origin::Message { replay: None },
            ),
            // A snapshot row's dead letter replayed: its position is the
            // snapshot's, not one every copy shares.
            with(
                event(Some(b"k"), &streamed, &[]),
                Origin::DeadLetterReplay {
                    letter: "dlq.x.1".into(),
                    snapshot: Some(walbox_pgoutput::Lsn(0x16_B374_D848)),
                },
            ),
            // A streamed event's dead letter replayed keeps its position.
            with(
                event(Some(b"k"), &streamed, &[]),
                Origin::DeadLetterReplay {
                    letter: "dlq.x.2".into(),
                    snapshot: None,
                },
            ),
            // A replay's copy keeps the position it had.
            with(
                event(Some(b"k"), &streamed, &[]),
                Origin::Replay {
                    from: walbox_pgoutput::Lsn(0x16_0000_0000),
                },
            ),
        ];
        for e in cases {
            let Ok(h) = headers_of(&e, Some("prev")) else {
                continue;
            };
            let from_map = super::super::duplicate::Sent::of("s", "id", &h.map);
            let kept = super::super::duplicate::Sent::of_event("s", "id", h.key, &e);
            assert_eq!(
                format!("{kept:?}"),
                format!("{from_map:?}"),
                "{:?} {:?}",
                e.origin,
                e.headers
            );
        }
    }

    #[test]
    fn walbox_names_are_taken_as_they_are_and_the_rows_names_are_checked() {
        let (n, _) = nats_header(&std::borrow::Cow::Borrowed("walbox_commit_lsn"), b"1/0").unwrap();
        assert_eq!(n, HeaderName::from_str("walbox_commit_lsn").unwrap());
        assert!(nats_header(&std::borrow::Cow::Owned("a b".into()), b"v").is_err());
        assert!(nats_header(&std::borrow::Cow::Borrowed("a:b"), b"v").is_err());
        assert!(nats_header(&std::borrow::Cow::Borrowed("ok"), b"a\nb").is_err());
    }

    #[test]
    fn the_header_size_is_what_nats_sends() {
        let mut h = HeaderMap::new();
        h.append("event_id", "e1");
        h.append("Nats-Msg-Id", "e1");
        // NATS/1.0\r\n event_id: e1\r\n Nats-Msg-Id: e1\r\n \r\n
        assert_eq!(wire_len(&h), 10 + 14 + 17 + 2);
    }

    #[test]
    fn keys_round_trip_through_base64_and_names_are_percent_encoded() {
        for key in [&b""[..], b"a", b"ab", b"abc", b"\xff\x00k\n", b"order-17"] {
            let text = base64_encode(key);
            assert_eq!(base64_decode(&text).as_deref(), Some(key), "{text}");
        }
        assert_eq!(base64_encode(b"\xff\x00ab"), "/wBhYg==");
        assert_eq!(base64_decode("not base64"), None);
        assert_eq!(percent_encode("a b:c\nd"), "a%20b%3Ac%0Ad");
        assert_eq!(percent_encode("Nats-Msg-Id"), "Nats-Msg-Id");
    }

    #[test]
    fn dead_letter_subjects_are_sanitized_into_the_stream() {
        assert_eq!(sanitized_subject("outbox..dlq"), "outbox._.dlq");
        assert_eq!(
            sanitized_subject("outbox.a b.*.>.dlq"),
            "outbox.a_b._._.dlq"
        );
        assert!(valid_subject(&sanitized_subject("outbox..dlq")));
    }

    #[test]
    fn subjects_are_checked() {
        assert!(valid_subject("outbox.order"));
        assert!(valid_subject("outbox.order.dlq"));
        for s in ["", "a..b", ".a", "a.", "a.*", "a.>", "a b"] {
            assert!(!valid_subject(s), "{s}");
        }
    }
}
