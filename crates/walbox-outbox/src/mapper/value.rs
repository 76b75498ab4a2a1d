//! Reading column values: a role's text or bytes (NULL and missing values named
//! by column), a JSON payload from json, text or bytea, the string members of a
//! JSON headers object, and PostgreSQL timestamps as RFC 3339.

use std::borrow::Cow;

use bytes::Bytes;
use walbox_pgoutput::TupleValue;

use super::{Col, PayloadKind, RowError};
use crate::event::HeaderName;
use crate::format::{self, Payload};

pub(super) fn bytes<'a>(
    row: &'a [TupleValue],
    c: &Col,
    role: &'static str,
) -> Result<&'a Bytes, RowError> {
    match row.get(c.index) {
        Some(TupleValue::Text(b) | TupleValue::Binary(b)) => Ok(b),
        Some(TupleValue::Null) => Err(RowError::Null {
            role,
            column: c.name.clone(),
        }),
        Some(TupleValue::UnchangedToast) | None => Err(RowError::Missing {
            role,
            column: c.name.clone(),
        }),
    }
}

pub(super) fn text<'a>(
    row: &'a [TupleValue],
    c: &Col,
    role: &'static str,
) -> Result<&'a str, RowError> {
    std::str::from_utf8(bytes(row, c, role)?).map_err(|_| RowError::NotUtf8 {
        role,
        column: c.name.clone(),
    })
}

/// An optional role: absent column or NULL value give `None`.
pub(super) fn opt_text<'a>(
    row: &'a [TupleValue],
    c: Option<&Col>,
    role: &'static str,
) -> Result<Option<&'a str>, RowError> {
    match c {
        None => Ok(None),
        Some(c) if matches!(row.get(c.index), Some(TupleValue::Null)) => Ok(None),
        Some(c) => text(row, c, role).map(Some),
    }
}

/// The payload's bytes: json and jsonb as they come (the server checked them),
/// text as it is, bytea decoded; text and bytea are checked to hold JSON by the
/// format that needs it.
pub(super) fn payload(row: &[TupleValue], c: &Col, kind: PayloadKind) -> Result<Payload, RowError> {
    let raw = bytes(row, c, "payload")?;
    let (bytes, kind) = match kind {
        PayloadKind::Json => (raw.clone(), format::PayloadKind::Json),
        PayloadKind::Text => (raw.clone(), format::PayloadKind::Text),
        PayloadKind::Bytea => {
            let decoded = match raw.strip_prefix(b"\\x") {
                Some(hex) => decode_hex(hex).ok_or("bytea value is not valid hex"),
                // `bytea_output = escape`: a hex value starts with `\x`, an escaped
                // one never does (a backslash is written `\\`).
                None => decode_bytea_escape(raw).ok_or("bytea value is not valid escape format"),
            };
            let decoded = decoded.map_err(|reason| RowError::PayloadNotJson {
                column: c.name.clone(),
                reason: reason.into(),
            })?;
            (Bytes::from(decoded), format::PayloadKind::Binary)
        }
    };
    Ok(Payload { bytes, kind })
}

fn decode_hex(hex: &[u8]) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let nibble = |b: u8| match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    };
    hex.chunks_exact(2)
        .map(|pair| match pair {
            [hi, lo] => Some(nibble(*hi)? << 4 | nibble(*lo)?),
            _ => None,
        })
        .collect()
}

/// bytea in escape output format: `\\` for a backslash, `\ooo` (octal) for a
/// byte, any other byte as itself.
fn decode_bytea_escape(text: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while let Some(&b) = text.get(i) {
        if b != b'\\' {
            out.push(b);
            i += 1;
            continue;
        }
        match (text.get(i + 1), text.get(i + 1..i + 4)) {
            (Some(b'\\'), _) => {
                out.push(b'\\');
                i += 2;
            }
            (_, Some(&[d0 @ b'0'..=b'3', d1 @ b'0'..=b'7', d2 @ b'0'..=b'7'])) => {
                out.push((d0 - b'0') << 6 | (d1 - b'0') << 3 | (d2 - b'0'));
                i += 4;
            }
            _ => return None,
        }
    }
    Some(out)
}

/// `2026-11-29 19:40:00.123456+00` (PostgreSQL ISO output) to RFC 3339
/// (`2026-11-29T19:40:00.123456+00:00`); other forms pass through unchanged.
pub(crate) fn rfc3339(pg: &str) -> String {
    let b = pg.as_bytes();
    if b.len() < 19 || b.get(10) != Some(&b' ') {
        return pg.to_owned();
    }
    let mut s = String::with_capacity(pg.len() + 3);
    s.push_str(&pg[..10]);
    s.push('T');
    s.push_str(&pg[11..]);
    // A zone offset of hours only (+00, -05) gets its minutes.
    let n = s.len();
    if n >= 3 && matches!(s.as_bytes()[n - 3], b'+' | b'-') {
        s.push_str(":00");
    }
    s
}

/// Appends the string members of the JSON object `raw` as headers, ordered by
/// name (the last of duplicate names wins); other members are skipped. Names and
/// values without escapes are not copied: values share `raw`'s buffer.
pub(super) fn json_headers(
    raw: &Bytes,
    out: &mut Vec<(HeaderName, Bytes)>,
) -> Result<(), serde_json::Error> {
    headers_of(raw, out, false)
}

/// As [`json_headers`], but a member (the last of its name) whose value is not a
/// string is an error instead of skipped: a message's `headers` field.
pub(crate) fn json_string_headers(
    raw: &Bytes,
    out: &mut Vec<(HeaderName, Bytes)>,
) -> Result<(), serde_json::Error> {
    headers_of(raw, out, true)
}

fn headers_of(
    raw: &Bytes,
    out: &mut Vec<(HeaderName, Bytes)>,
    strings_only: bool,
) -> Result<(), serde_json::Error> {
    let Members(mut members) = serde_json::from_slice(raw)?;
    members.sort_by(|a, b| a.0.cmp(&b.0));
    let mut members = members.into_iter().peekable();
    while let Some((name, value)) = members.next() {
        if members.peek().is_some_and(|(next, _)| *next == name) {
            continue; // a later duplicate wins
        }
        let Some(value) = value else {
            if strings_only {
                return Err(serde::de::Error::custom(
                    "a header value that is not a string",
                ));
            }
            continue;
        };
        let value = match value {
            Cow::Borrowed(v) => raw.slice_ref(v.as_bytes()),
            Cow::Owned(v) => Bytes::from(v),
        };
        out.push((Cow::Owned(name.into_owned()), value));
    }
    Ok(())
}

/// The members of a JSON object in document order: name, and the value when it
/// is a string.
struct Members<'a>(Vec<(Cow<'a, str>, Option<Cow<'a, str>>)>);

/// A JSON value kept only when it is a string (borrowed from the input when it
/// has no escapes).
struct IfString<'a>(Option<Cow<'a, str>>);

impl<'de> serde::Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(IfString(name)) = m.next_key()? {
                    // JSON object keys are strings.
                    let name =
                        name.ok_or_else(|| serde::de::Error::custom("a key that is not a string"))?;
                    let IfString(value) = m.next_value()?;
                    out.push((name, value));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(V)
    }
}

impl<'de> serde::Deserialize<'de> for IfString<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = IfString<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(IfString(Some(Cow::Borrowed(v))))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(IfString(Some(Cow::Owned(v.to_owned()))))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(IfString(Some(Cow::Owned(v))))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(IfString(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(IfString(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(IfString(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(IfString(None))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(IfString(None))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut s: A,
            ) -> Result<Self::Value, A::Error> {
                while s.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(IfString(None))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<Self::Value, A::Error> {
                while m
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(IfString(None))
            }
        }
        d.deserialize_any(V)
    }
}
