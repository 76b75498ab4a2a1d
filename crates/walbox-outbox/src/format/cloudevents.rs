//! Format `cloudevents`: CloudEvents 1.0 in the protocol binding of the sink
//! ([`Binding`]: Kafka, NATS).
//!
//! - binary content mode (the Kafka default): attributes `specversion` (`1.0`),
//!   `id`, `source`, `type`, `time`, `subject` and `datacontenttype`
//!   (`application/json`) as headers named and encoded as the binding says
//!   (Kafka: `ce_id`, ..., `content-type`; NATS: `ce-id`, ...,
//!   `ce-datacontenttype`, values percent-encoded); the value is the payload;
//! - structured content mode (the NATS default): the binding's content type
//!   header (`content-type` on Kafka, `Content-Type` on NATS) =
//!   `application/cloudevents+json`; the value is the event as one JSON object
//!   with `datacontenttype` and `data`.
//!
//! The key is the aggregate id in both. `source` and `subject` come from
//! templates over the event's fields; `time` is the occurrence time, else the
//! commit time, in RFC 3339 (left out when neither is known). An occurrence
//! time that cannot be an RFC 3339 date-time (a date alone, `infinity`, a year
//! outside 0001-9999) refuses the event ([`RowError::InvalidTime`]: it is
//! dead-lettered). The source's headers and the position headers follow.

use std::borrow::Cow;

use bytes::{BufMut, Bytes, BytesMut};

use super::{
    Binding, CeField, CeTemplate, CloudEventsSettings, EventFields, Formatter, Text, json_str,
    push_position,
};
use crate::config::CloudEventsMode;
use crate::event::{Event, HeaderName};
use crate::mapper::{RowError, rfc3339};

/// The CloudEvents version walbox emits.
pub const SPEC_VERSION: &str = "1.0";
/// Header carrying the event id in binary content mode (Kafka).
pub const ID_HEADER: &str = "ce_id";
/// The header that marks a binary-mode CloudEvent (Kafka).
pub const SPEC_VERSION_HEADER: &str = "ce_specversion";
/// Header carrying the event id in binary content mode (NATS, HTTP).
pub const DASH_ID_HEADER: &str = "ce-id";
/// The header that marks a binary-mode CloudEvent (NATS, HTTP).
pub const DASH_SPEC_VERSION_HEADER: &str = "ce-specversion";
/// The content type header (Kafka).
pub const CONTENT_TYPE_HEADER: &str = "content-type";
/// `datacontenttype` of the payload.
pub const DATA_CONTENT_TYPE: &str = "application/json";
/// `content-type` of a structured-mode record.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";

/// The attributes written in binary mode, and their header names under each
/// prefix (so that headers of the usual bindings need no allocation).
const ATTRIBUTES: [&str; 6] = ["specversion", "id", "source", "type", "time", "subject"];
const UNDERSCORE: [&str; 6] = [
    "ce_specversion",
    "ce_id",
    "ce_source",
    "ce_type",
    "ce_time",
    "ce_subject",
];
const DASH: [&str; 6] = [
    "ce-specversion",
    "ce-id",
    "ce-source",
    "ce-type",
    "ce-time",
    "ce-subject",
];

impl Binding {
    /// The header of attribute `name` in binary mode.
    fn header_name(&self, name: &'static str) -> HeaderName {
        let i = ATTRIBUTES.iter().position(|a| *a == name);
        match (self.prefix, i) {
            ("ce_", Some(i)) => Cow::Borrowed(UNDERSCORE[i]),
            ("ce-", Some(i)) => Cow::Borrowed(DASH[i]),
            _ => Cow::Owned(self.attribute(name)),
        }
    }

    /// A header of attribute `name` holding `value`, encoded as the binding
    /// says; `shared` is `value`'s buffer, taken as it is when nothing needs
    /// encoding.
    fn header(
        &self,
        name: &'static str,
        value: &str,
        shared: Option<&Bytes>,
    ) -> (HeaderName, Bytes) {
        let bytes = match (self.value(value), shared) {
            (Cow::Borrowed(_), Some(b)) => b.clone(),
            (Cow::Borrowed(v), None) => Bytes::copy_from_slice(v.as_bytes()),
            (Cow::Owned(v), _) => Bytes::from(v),
        };
        (self.header_name(name), bytes)
    }
}

impl Formatter {
    pub(super) fn cloudevents(
        &self,
        ce: &CloudEventsSettings,
        f: EventFields,
    ) -> Result<Event, RowError> {
        let event_type = f.event_type.as_ref().ok_or_else(|| RowError::Null {
            role: "event type",
            column: self.names.event_type.clone(),
        })?;
        let source = self.render_ce(&ce.source, &f, "cloudevents_source")?;
        let subject = match &ce.subject {
            Some(t) => Some(self.render_ce(t, &f, "cloudevents_subject")?),
            None => None,
        };
        let time = match (&f.occurred_at, f.commit_time) {
            (Some(t), _) => Some(event_time(t.as_str()).ok_or_else(|| RowError::InvalidTime {
                column: self.names.occurred_at.clone(),
            })?),
            (None, Some(micros)) => Some(pg_micros_rfc3339(micros)),
            (None, None) => None,
        };
        let payload = self.require_payload(f.payload)?;
        let data = self.payload_json(payload)?;

        let mut headers: Vec<(HeaderName, Bytes)> = Vec::with_capacity(10 + f.headers.len());
        let value = match ce.mode {
            CloudEventsMode::Binary => {
                let b = &ce.binding;
                headers.push(b.header("specversion", SPEC_VERSION, None));
                headers.push(b.header("id", f.event_id.as_str(), Some(f.event_id.bytes())));
                headers.push(b.header("source", &source, None));
                headers.push(b.header("type", event_type.as_str(), Some(event_type.bytes())));
                if let Some(t) = &time {
                    headers.push(b.header("time", t, None));
                }
                if let Some(s) = &subject {
                    headers.push(b.header("subject", s, None));
                }
                headers.push((
                    b.data_content_type.into(),
                    Bytes::from_static(DATA_CONTENT_TYPE.as_bytes()),
                ));
                data
            }
            CloudEventsMode::Structured => {
                headers.push((
                    ce.binding.structured_content_type.into(),
                    Bytes::from_static(STRUCTURED_CONTENT_TYPE.as_bytes()),
                ));
                let mut out = BytesMut::with_capacity(data.len() + 256);
                out.put_slice(b"{\"specversion\":");
                json_str(&mut out, SPEC_VERSION);
                out.put_slice(b",\"id\":");
                json_str(&mut out, f.event_id.as_str());
                out.put_slice(b",\"source\":");
                json_str(&mut out, &source);
                out.put_slice(b",\"type\":");
                json_str(&mut out, event_type.as_str());
                if let Some(s) = &subject {
                    out.put_slice(b",\"subject\":");
                    json_str(&mut out, s);
                }
                if let Some(t) = &time {
                    out.put_slice(b",\"time\":");
                    json_str(&mut out, t);
                }
                out.put_slice(b",\"datacontenttype\":");
                json_str(&mut out, DATA_CONTENT_TYPE);
                out.put_slice(b",\"data\":");
                out.put_slice(&data);
                out.put_u8(b'}');
                out.freeze()
            }
        };
        headers.extend(f.headers);
        push_position(&mut headers, f.position);
        Ok(Event {
            event_id: f.event_id.as_str().to_owned(),
            topic: f.topic,
            key: f.aggregate_id,
            value,
            json_value: true,
            headers,
            position: f.position,
            origin: crate::Origin::Stream,
        })
    }

    fn render_ce(
        &self,
        t: &CeTemplate,
        f: &EventFields,
        key: &'static str,
    ) -> Result<String, RowError> {
        t.template.render(|i, _| {
            let field = t.fields.get(i).copied().unwrap_or(CeField::Source);
            let missing = |column: &str| RowError::Null {
                role: key,
                column: column.to_owned(),
            };
            match field {
                CeField::Source => Ok(self.source.as_str()),
                CeField::Id => Ok(f.event_id.as_str()),
                CeField::AggregateType => f
                    .aggregate_type
                    .as_ref()
                    .map(Text::as_str)
                    .ok_or_else(|| missing(&self.names.aggregate_type)),
                CeField::EventType => f
                    .event_type
                    .as_ref()
                    .map(Text::as_str)
                    .ok_or_else(|| missing(&self.names.event_type)),
                CeField::AggregateId => match &f.aggregate_id {
                    Some(b) => std::str::from_utf8(b).map_err(|_| RowError::NotUtf8 {
                        role: key,
                        column: self.names.aggregate_id.clone(),
                    }),
                    None => Err(missing(&self.names.aggregate_id)),
                },
            }
        })
    }
}

/// The CloudEvents `time` of an occurrence time (PostgreSQL ISO output or RFC
/// 3339; without a zone offset taken as UTC), `None` when it cannot be an RFC
/// 3339 date-time. `t` and `z` are written upper case.
pub(crate) fn event_time(occurred_at: &str) -> Option<String> {
    let mut t = with_zone(rfc3339(occurred_at));
    if !is_rfc3339(&t) {
        return None;
    }
    t.make_ascii_uppercase();
    Some(t)
}

/// An RFC 3339 time without a zone offset is taken as UTC.
fn with_zone(mut t: String) -> String {
    let zoned = t
        .get(19..)
        .is_some_and(|rest| rest.contains(['+', '-', 'Z', 'z']));
    if !zoned {
        t.push('Z');
    }
    t
}

/// Whether `t` is an RFC 3339 `date-time` (section 5.6) with a year from 0001
/// (year 0 is refused by common SDKs): `YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)`,
/// each field in its range (the day within its month, second 60 for a leap
/// second).
pub(crate) fn is_rfc3339(t: &str) -> bool {
    let b = t.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<u32> {
        let digits = b.get(r)?;
        digits.iter().try_fold(0u32, |n, d| {
            d.is_ascii_digit().then(|| n * 10 + u32::from(d - b'0'))
        })
    };
    let at = |i: usize, c: u8| b.get(i).is_some_and(|x| x.eq_ignore_ascii_case(&c));
    let (Some(year), Some(month), Some(day), Some(hour), Some(minute), Some(second)) = (
        num(0..4),
        num(5..7),
        num(8..10),
        num(11..13),
        num(14..16),
        num(17..19),
    ) else {
        return false;
    };
    if !(at(4, b'-') && at(7, b'-') && at(10, b'T') && at(13, b':') && at(16, b':')) {
        return false;
    }
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return false,
    };
    if year == 0 || day == 0 || day > days || hour > 23 || minute > 59 || second > 60 {
        return false;
    }
    let mut i = 19;
    if at(i, b'.') {
        let digits = b[i + 1..].iter().take_while(|d| d.is_ascii_digit()).count();
        if digits == 0 {
            return false;
        }
        i += 1 + digits;
    }
    match b.get(i..) {
        Some(rest) if rest.eq_ignore_ascii_case(b"Z") => true,
        Some([sign, ..]) if matches!(sign, b'+' | b'-') && b.len() == i + 6 => {
            at(i + 3, b':')
                && num(i + 1..i + 3).is_some_and(|h| h <= 23)
                && num(i + 4..i + 6).is_some_and(|m| m <= 59)
        }
        _ => false,
    }
}

/// PostgreSQL microseconds since 2000-01-01 UTC as RFC 3339 (UTC, microseconds).
#[must_use]
pub fn pg_micros_rfc3339(micros: i64) -> String {
    const UNIX_TO_PG_SECS: i64 = 946_684_800;
    let secs = micros.div_euclid(1_000_000) + UNIX_TO_PG_SECS;
    let frac = micros.rem_euclid(1_000_000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{frac:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}
