//! Format `cloudevents`: CloudEvents 1.0 in the Kafka protocol binding.
//!
//! - binary content mode (default): headers `ce_specversion` (`1.0`), `ce_id`,
//!   `ce_source`, `ce_type`, `ce_time`, `ce_subject` and `content-type`
//!   (`application/json`); the value is the payload;
//! - structured content mode: header `content-type` =
//!   `application/cloudevents+json`; the value is the event as one JSON object with
//!   `datacontenttype` and `data`.
//!
//! The key is the aggregate id in both. `source` and `subject` come from
//! templates over the event's fields; `time` is the occurrence time, else the
//! commit time, in RFC 3339 (left out when neither is known). The source's
//! headers and the position headers follow.

use bytes::{BufMut, Bytes, BytesMut};

use super::{
    CeField, CeTemplate, CloudEventsSettings, EventFields, Formatter, Text, json_str, push_position,
};
use crate::config::CloudEventsMode;
use crate::event::{Event, HeaderName};
use crate::mapper::{RowError, rfc3339};

/// The CloudEvents version walbox emits.
pub const SPEC_VERSION: &str = "1.0";
/// Header carrying the event id in binary content mode.
pub const ID_HEADER: &str = "ce_id";
/// The header that marks a binary-mode CloudEvent.
pub const SPEC_VERSION_HEADER: &str = "ce_specversion";
/// The content type header.
pub const CONTENT_TYPE_HEADER: &str = "content-type";
/// `datacontenttype` of the payload.
pub const DATA_CONTENT_TYPE: &str = "application/json";
/// `content-type` of a structured-mode record.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";

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
            (Some(t), _) => Some(with_zone(rfc3339(t.as_str()))),
            (None, Some(micros)) => Some(pg_micros_rfc3339(micros)),
            (None, None) => None,
        };
        let payload = self.require_payload(f.payload)?;
        let data = self.payload_json(payload)?;

        let mut headers: Vec<(HeaderName, Bytes)> = Vec::with_capacity(10 + f.headers.len());
        let value = match ce.mode {
            CloudEventsMode::Binary => {
                headers.push((
                    SPEC_VERSION_HEADER.into(),
                    Bytes::from_static(SPEC_VERSION.as_bytes()),
                ));
                headers.push((ID_HEADER.into(), f.event_id.bytes().clone()));
                headers.push(("ce_source".into(), Bytes::from(source)));
                headers.push(("ce_type".into(), event_type.bytes().clone()));
                if let Some(t) = time {
                    headers.push(("ce_time".into(), Bytes::from(t)));
                }
                if let Some(s) = subject {
                    headers.push(("ce_subject".into(), Bytes::from(s)));
                }
                headers.push((
                    CONTENT_TYPE_HEADER.into(),
                    Bytes::from_static(DATA_CONTENT_TYPE.as_bytes()),
                ));
                data
            }
            CloudEventsMode::Structured => {
                headers.push((
                    CONTENT_TYPE_HEADER.into(),
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
