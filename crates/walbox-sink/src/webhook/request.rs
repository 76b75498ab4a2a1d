//! What one POST carries: the URL rendered from the template, the record's
//! headers made valid HTTP headers, the key, the content type, and the
//! Standard Webhooks signature (`webhook-id`, `webhook-timestamp`,
//! `webhook-signature`), made again for every attempt.
//!
//! A value put into the URL is percent-encoded as a path segment, `/` and `%`
//! included, so it stays within its segment and `%2e` arrives as written.
//! A value that makes a whole path segment `.` or `..` (a topic or key `..`,
//! or `.` after a literal `.`) cannot be sent: the URL standard drops such a
//! segment or climbs to the parent, and takes `%2e` for a dot as well, so no
//! encoding keeps it; the POST would go to another path, where a 2xx would
//! count as delivered. Such an event is refused as about the event (the
//! class of a template field it lacks, `invalid_record`): it is
//! dead-lettered with the reason. Dot segments the template itself writes
//! are the same for every event and are left to the URL library.

use base64::Engine as _;
use bytes::Bytes;
use hmac::{Hmac, Mac};
use percent_encoding::{AsciiSet, CONTROLS, NON_ALPHANUMERIC, utf8_percent_encode};
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use sha2::Sha256;
use walbox_outbox::{Event, TopicTemplate};

/// The header that carries the record key.
pub const KEY_HEADER: &str = "walbox-key";
/// `base64` when the key is not printable ASCII (it is then base64).
pub const KEY_ENCODING_HEADER: &str = "walbox-key-encoding";
/// The record headers an HTTP request cannot carry as they are named (those
/// HTTP or the signature reserve): their names, separated by `,`.
pub const DROPPED_HEADERS_HEADER: &str = "walbox-dropped-headers";

/// What a URL path segment keeps unencoded: the unreserved characters.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// The CloudEvents HTTP binding's percent-encoding set: space, `"`, `%`, the
/// control characters, and every byte outside ASCII.
const ENCODED: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

fn percent_encode(v: &str) -> String {
    utf8_percent_encode(v, ENCODED).to_string()
}

/// An event made ready to POST, unsigned.
#[derive(Debug, Clone)]
pub(super) struct Prepared {
    pub url: reqwest::Url,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The `webhook-id` as its header carries it: the event id.
    pub id: String,
}

/// Names a record header may not take: HTTP's own (hop-by-hop, framing,
/// routing) and the signature's.
fn reserved(name: &str) -> bool {
    matches!(
        name,
        "host"
            | "content-length"
            | "transfer-encoding"
            | "connection"
            | "keep-alive"
            | "te"
            | "trailer"
            | "upgrade"
            | "expect"
            | "webhook-id"
            | "webhook-timestamp"
            | "webhook-signature"
            | KEY_HEADER
            | KEY_ENCODING_HEADER
            | DROPPED_HEADERS_HEADER
    ) || name.starts_with("proxy-")
        || name.starts_with(':')
}

/// A header name made valid: ASCII letters, digits and `!#$%&'*+-.^_`|~`
/// kept (lower case), anything else `-`.
fn header_name(name: &str) -> Option<HeaderName> {
    let valid: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c) {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    HeaderName::from_bytes(valid.as_bytes()).ok()
}

/// Whether `v` goes into a header as it is: printable ASCII (spaces inside).
fn printable(v: &[u8]) -> bool {
    v.iter().all(|b| (0x20..0x7f).contains(b))
        && v.first() != Some(&b' ')
        && v.last() != Some(&b' ')
}

/// A header value: as it is when printable ASCII (CloudEvents `ce-` values are
/// percent-encoded already), else percent-encoded as the CloudEvents HTTP
/// binding encodes (UTF-8, `%XY`).
fn header_value(v: &[u8]) -> HeaderValue {
    if printable(v)
        && let Ok(h) = HeaderValue::from_bytes(v)
    {
        return h;
    }
    let text = String::from_utf8_lossy(v);
    let encoded = percent_encode(&text);
    HeaderValue::from_str(&encoded).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// The `webhook-id` of `event`: its event id, or in a replay named `replay`
/// (`walbox replay`: its start position) `{event id}_replay_{name}`, so that a
/// receiver deduplicating by `webhook-id` takes the replay (Standard Webhooks
/// ids hold no `.`).
pub(super) fn webhook_id(event: &Event, replay: Option<&str>) -> String {
    match replay {
        Some(name) => format!("{}_replay_{name}", event.event_id),
        None => event.event_id.clone(),
    }
}

/// The event as a request under `webhook-id` `id`, or why it cannot be one
/// (about the event: a field of the URL template it lacks, a URL that does
/// not parse).
pub(super) fn prepare(
    event: &Event,
    id: String,
    template: &TopicTemplate,
) -> Result<Prepared, String> {
    let url = render_owned(template, event)?;
    let url =
        // Not the URL itself: it may hold a password (basic authentication).
        reqwest::Url::parse(&url).map_err(|e| format!("the URL the template renders is not valid: {e}"))?;
    let mut headers = HeaderMap::new();
    let mut dropped = Vec::new();
    let mut content_type = None;
    for (name, value) in &event.headers {
        let lower = name.to_ascii_lowercase();
        if lower == "content-type" {
            content_type = Some(header_value(value));
            continue;
        }
        match header_name(name) {
            Some(n) if !reserved(n.as_str()) => {
                headers.append(n, header_value(value));
            }
            _ => dropped.push(percent_encode(name)),
        }
    }
    if !dropped.is_empty() {
        headers.insert(
            HeaderName::from_static(DROPPED_HEADERS_HEADER),
            header_value(dropped.join(",").as_bytes()),
        );
    }
    if let Some(key) = &event.key {
        if printable(key) {
            headers.insert(HeaderName::from_static(KEY_HEADER), header_value(key));
        } else {
            let b64 = base64::engine::general_purpose::STANDARD.encode(key);
            headers.insert(
                HeaderName::from_static(KEY_HEADER),
                header_value(b64.as_bytes()),
            );
            headers.insert(
                HeaderName::from_static(KEY_ENCODING_HEADER),
                HeaderValue::from_static("base64"),
            );
        }
    }
    let content_type = content_type.unwrap_or_else(|| {
        if event.json_value || serde_json::from_slice::<serde::de::IgnoredAny>(&event.value).is_ok()
        {
            HeaderValue::from_static("application/json")
        } else {
            HeaderValue::from_static("application/octet-stream")
        }
    });
    headers.insert(CONTENT_TYPE, content_type);
    // Signed as the header carries it (percent-encoded when it is not
    // printable ASCII): a receiver verifies the id it receives.
    let id_header = header_value(id.as_bytes());
    let id = id_header.to_str().map_or(id.clone(), str::to_owned);
    headers.insert(HeaderName::from_static("webhook-id"), id_header);
    Ok(Prepared {
        url,
        headers,
        body: event.value.clone(),
        id,
    })
}

/// Whether `segment` is one the URL standard drops or climbs with: `.` or
/// `..`, any of the dots written `%2e` (either case).
fn dot_segment(segment: &str) -> bool {
    let dots = segment.to_ascii_lowercase().replace("%2e", ".");
    dots == "." || dots == ".."
}

/// The path segments of `url` as written: after the authority, up to `?` or
/// `#`, split at `/` (and `\`, which http and https URLs take for it).
fn path_segments(url: &str) -> impl Iterator<Item = &str> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let path = rest.find(['/', '\\', '?', '#']).map_or("", |i| &rest[i..]);
    let path = &path[..path.find(['?', '#']).unwrap_or(path.len())];
    path.split(['/', '\\'])
}

/// The URL template rendered for `event`, each field's value percent-encoded
/// as a path segment; refused when a value makes a path segment `.` or `..`.
fn render_owned(template: &TopicTemplate, event: &Event) -> Result<String, String> {
    let mut values = Vec::new();
    for field in template.fields() {
        let raw = match field {
            "topic" => event.topic.clone(),
            "key" => event
                .key
                .as_ref()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .ok_or("the URL template names {key} and the event has no key")?,
            name => event
                .headers
                .iter()
                .find(|(k, _)| k.as_ref() == name)
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
                .ok_or_else(|| {
                    format!("the URL template names {{{name}}} and the event has no header {name}")
                })?,
        };
        values.push(utf8_percent_encode(&raw, SEGMENT).to_string());
    }
    let url = template.render(|i, _| {
        values
            .get(i)
            .map(String::as_str)
            .ok_or_else(|| "the URL template changed".to_owned())
    })?;
    // The same URL with a plain value for each field: the segments line up,
    // as no value holds `/`, `\`, `?` or `#` (they are encoded).
    let plain = template
        .render(|_, _| Ok::<_, std::convert::Infallible>("x"))
        .unwrap_or_else(|never| match never {});
    if path_segments(&url)
        .zip(path_segments(&plain))
        .any(|(segment, own)| dot_segment(segment) && !dot_segment(own))
    {
        return Err(
            "a value the URL template takes from the event makes a path segment '.' or '..' \
             (a dot segment), which the URL would drop or climb out of, sending the event to \
             another path"
                .to_owned(),
        );
    }
    Ok(url)
}

/// The `webhook-signature` value for `id`, `timestamp` and `body`: `v1,` and
/// the base64 HMAC-SHA256 of `id.timestamp.body` under each key, separated by
/// spaces.
pub(super) fn signature(keys: &[Vec<u8>], id: &str, timestamp: u64, body: &[u8]) -> String {
    let ts = timestamp.to_string();
    keys.iter()
        .map(|key| {
            // HMAC takes a key of any length.
            let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
            mac.update(id.as_bytes());
            mac.update(b".");
            mac.update(ts.as_bytes());
            mac.update(b".");
            mac.update(body);
            format!(
                "v1,{}",
                base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The headers of one attempt: the prepared ones, with this attempt's
/// `webhook-timestamp` and signature.
pub(super) fn signed_headers(prepared: &Prepared, keys: &[Vec<u8>], timestamp: u64) -> HeaderMap {
    let mut headers = prepared.headers.clone();
    headers.insert(
        HeaderName::from_static("webhook-timestamp"),
        HeaderValue::from(timestamp),
    );
    let sig = signature(keys, &prepared.id, timestamp, &prepared.body);
    if let Ok(v) = HeaderValue::from_str(&sig) {
        headers.insert(HeaderName::from_static("webhook-signature"), v);
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;
    use walbox_outbox::Position;

    fn event() -> Event {
        Event {
            event_id: "msg_p5jXN8AQM9LWM0D4loKWxJek".into(),
            topic: "outbox.Order".into(),
            key: Some(Bytes::from_static(b"order 1/\xff")),
            value: Bytes::from_static(br#"{"test": 2432232314}"#),
            json_value: false,
            headers: vec![
                ("aggregate_type".into(), Bytes::from_static(b"Order/x")),
                ("ce-source".into(), Bytes::from_static(b"a%20b")),
                ("note".into(), "caf\u{e9}".into()),
                ("Host".into(), Bytes::from_static(b"evil")),
                ("bad name".into(), Bytes::from_static(b"v")),
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
    fn the_signature_is_the_standard_webhooks_example() {
        // The example of the Standard Webhooks specification and its libraries.
        let key = base64::engine::general_purpose::STANDARD
            .decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            .unwrap();
        let sig = signature(
            &[key.clone(), key],
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        let one = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
        assert_eq!(sig, format!("{one} {one}"));
    }

    #[test]
    fn urls_headers_and_keys_are_made_valid() {
        let t = TopicTemplate::parse("https://h.example/in/{aggregate_type}/{topic}").unwrap();
        let p = prepare(&event(), webhook_id(&event(), None), &t).unwrap();
        assert_eq!(
            p.url.as_str(),
            "https://h.example/in/Order%2Fx/outbox.Order"
        );
        let h = |n: &str| p.headers.get(n).map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(h("ce-source").as_deref(), Some("a%20b"));
        assert_eq!(h("note").as_deref(), Some("caf%C3%A9"));
        assert_eq!(h("bad-name").as_deref(), Some("v"));
        assert_eq!(h("host"), None);
        assert_eq!(h(DROPPED_HEADERS_HEADER).as_deref(), Some("Host"));
        assert_eq!(h(KEY_ENCODING_HEADER).as_deref(), Some("base64"));
        assert_eq!(h("content-type").as_deref(), Some("application/json"));
        assert_eq!(
            h("webhook-id").as_deref(),
            Some("msg_p5jXN8AQM9LWM0D4loKWxJek")
        );
        assert_eq!(
            webhook_id(&event(), Some("0/16B3D28")),
            "msg_p5jXN8AQM9LWM0D4loKWxJek_replay_0/16B3D28"
        );
        let missing = TopicTemplate::parse("https://h.example/{tenant}").unwrap();
        assert!(
            prepare(&event(), webhook_id(&event(), Some("0/16B3D28")), &missing)
                .unwrap_err()
                .contains("tenant")
        );
    }

    #[test]
    fn the_signature_covers_the_webhook_id_as_the_header_carries_it() {
        let mut e = event();
        e.event_id = "order 1 caf\u{e9}".into();
        let t = TopicTemplate::parse("https://h.example/in").unwrap();
        let p = prepare(&e, webhook_id(&e, None), &t).unwrap();
        let keys = vec![b"key".to_vec()];
        let h = signed_headers(&p, &keys, 1_614_265_330);
        // A receiver verifies what it receives: the header's id.
        let id = h.get("webhook-id").unwrap().to_str().unwrap();
        assert_eq!(
            h.get("webhook-signature").unwrap().to_str().unwrap(),
            signature(&keys, id, 1_614_265_330, &p.body)
        );
    }

    #[test]
    fn a_value_that_is_a_dot_segment_never_changes_the_path() {
        // The URL standard takes `%2e` for a dot too: encoding the dots of a
        // `..` segment would not keep it.
        let parsed = reqwest::Url::parse("https://h.example/in/%2E%2e/k").unwrap();
        assert_eq!(parsed.path(), "/k");
        let t = TopicTemplate::parse("https://h.example/in/{topic}/{key}").unwrap();
        let with = |topic: &str, key: &str| {
            let mut e = event();
            e.topic = topic.into();
            e.key = Some(Bytes::from(key.to_owned()));
            e
        };
        for (topic, key) in [("..", "k"), (".", "k"), ("t", ".."), ("t", ".")] {
            let e = with(topic, key);
            match prepare(&e, webhook_id(&e, None), &t) {
                Ok(p) => panic!("{topic:?}/{key:?} goes to {}", p.url),
                Err(why) => assert!(why.contains("dot segment"), "{why}"),
            }
        }
        // A literal dot beside the value makes the segment `..`.
        let dotted = TopicTemplate::parse("https://h.example/in/.{topic}/x").unwrap();
        let e = with(".", "k");
        assert!(prepare(&e, webhook_id(&e, None), &dotted).is_err());
        // Part of a segment, in the query, or a percent sign (encoded): the
        // path is as the template says.
        for (template, topic, url) in [
            (
                "https://h.example/in/{topic}",
                "..x",
                "https://h.example/in/..x",
            ),
            (
                "https://h.example/in/{topic}",
                "%2e",
                "https://h.example/in/%252e",
            ),
            (
                "https://h.example/in/{topic}",
                "%2E%2e",
                "https://h.example/in/%252E%252e",
            ),
            (
                "https://h.example/in?t={topic}",
                "..",
                "https://h.example/in?t=..",
            ),
            (
                "https://h.example/a/../in/{topic}",
                "t",
                "https://h.example/in/t",
            ),
        ] {
            let t = TopicTemplate::parse(template).unwrap();
            let e = with(topic, "k");
            let p = prepare(&e, webhook_id(&e, None), &t).unwrap();
            assert_eq!(p.url.as_str(), url, "{template} {topic:?}");
        }
    }
}
