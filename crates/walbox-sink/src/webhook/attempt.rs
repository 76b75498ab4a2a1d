//! One event's delivery: POST, signed anew for every attempt, until a 2xx, a
//! status that is final, or `max_retry_duration` runs out. What each answer
//! means:
//!
//! - 2xx: delivered.
//! - 408, 425, 429, 5xx, a timeout or a connection error: tried again after a
//!   backoff (doubling from `retry_initial_ms` up to `retry_max_ms`, with
//!   jitter), or after `Retry-After` when that is longer, the last try at
//!   `max_retry_duration` (a `Retry-After` past it holds the event until then,
//!   and it is given up there).
//! - 410: the endpoint is gone; 3xx (not followed): it moved. Both are about
//!   where events go, not about the event: final, walbox stops.
//! - any other 4xx: the receiver refuses the event; it is dead-lettered with
//!   the status and a short, sanitized excerpt of the answer.

use crate::kit::count_retry;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::Semaphore;
use walbox_outbox::{Event, TopicTemplate};

use super::request::{Prepared, prepare, signed_headers, webhook_id};
use crate::{DeliveryClass, DeliveryError};

/// What every delivery of a sink shares.
#[derive(Debug)]
pub(super) struct Shared {
    pub client: reqwest::Client,
    pub keys: Vec<Vec<u8>>,
    pub template: TopicTemplate,
    pub retry_initial: Duration,
    pub retry_max: Duration,
    pub max_retry: Duration,
    /// Requests open at once.
    pub connections: Arc<Semaphore>,
    /// Attempts that failed and were tried again.
    pub retries: Arc<AtomicU64>,
}

/// The most bytes of a refusal's answer a dead letter keeps.
const EXCERPT: usize = 256;

/// What one attempt's answer asks for.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    Delivered,
    Retry {
        why: String,
        after: Option<Duration>,
    },
    Refused {
        status: u16,
        excerpt: String,
    },
    Stop {
        class: DeliveryClass,
        why: String,
    },
}

fn classify(status: u16, retry_after: Option<Duration>, excerpt: String) -> Answer {
    match status {
        200..=299 => Answer::Delivered,
        408 | 425 | 429 | 500..=599 => Answer::Retry {
            why: format!("HTTP {status}"),
            after: retry_after,
        },
        410 => Answer::Stop {
            class: DeliveryClass::EndpointGone,
            why: "HTTP 410 Gone: the receiver says this endpoint is gone; fix sink.webhook.url"
                .into(),
        },
        300..=399 => Answer::Stop {
            class: DeliveryClass::EndpointMoved,
            why: format!(
                "HTTP {status}: the receiver redirects; point sink.webhook.url at the new \
                 location, or set follow_redirects = true"
            ),
        },
        400..=499 => Answer::Refused { status, excerpt },
        other => Answer::Retry {
            why: format!("HTTP {other}"),
            after: retry_after,
        },
    }
}

/// `Retry-After`: seconds, or an HTTP date.
pub(super) fn retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let v = value.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// A refusal's answer made safe for a header and a log line: at most
/// [`EXCERPT`] bytes, control characters as spaces, marked when cut.
pub(super) fn sanitized(body: &[u8]) -> String {
    let cut = body.len() > EXCERPT;
    let mut text: String = String::from_utf8_lossy(&body[..body.len().min(EXCERPT)])
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    text = text.trim().to_owned();
    if cut {
        text.push_str("...");
    }
    text
}

/// The delay before attempt `attempt + 1` (1 = the first retry): doubling from
/// `initial`, at most `max`, drawn uniformly from its upper half (jitter).
pub(crate) fn backoff(attempt: u32, initial: Duration, max: Duration) -> Duration {
    let full = initial
        .saturating_mul(1u32 << attempt.saturating_sub(1).min(20))
        .min(max);
    let half = full / 2;
    half + half.mul_f64(fastrand::f64())
}

/// What follows a failed attempt.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum NextTry {
    /// Try again after this delay.
    After(Duration),
    /// Wait this long (to the retry ceiling), then give up: the receiver's
    /// `Retry-After` reaches past the ceiling.
    GiveUpAfter(Duration),
}

/// After attempt `attempts` failed, `elapsed` since the first one: try again
/// after the backoff (or the receiver's `Retry-After`, when longer), never
/// past `max_retry` from the first attempt. The last try is at the ceiling;
/// when `Retry-After` asks for later than that, the event is given up at the
/// ceiling, never before it.
pub(super) fn next_try(
    shared: &Shared,
    elapsed: Duration,
    attempts: u32,
    after: Option<Duration>,
) -> NextTry {
    next_try_within(
        (shared.retry_initial, shared.retry_max, shared.max_retry),
        elapsed,
        attempts,
        after,
    )
}

/// [`next_try`] with the backoff's first and longest delay and the ceiling.
fn next_try_within(
    (initial, max, ceiling): (Duration, Duration, Duration),
    elapsed: Duration,
    attempts: u32,
    after: Option<Duration>,
) -> NextTry {
    let delay = backoff(attempts, initial, max).max(after.unwrap_or_default());
    let remaining = ceiling.saturating_sub(elapsed);
    if remaining.is_zero() || after.is_some_and(|a| a > remaining) {
        return NextTry::GiveUpAfter(remaining);
    }
    NextTry::After(delay.min(remaining))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One attempt: the answer, or why there was none.
async fn attempt(shared: &Shared, prepared: &Prepared) -> Answer {
    let _permit = shared.connections.acquire().await;
    let headers = signed_headers(prepared, &shared.keys, unix_now());
    let sent = shared
        .client
        .post(prepared.url.clone())
        .headers(headers)
        .body(prepared.body.clone())
        .send()
        .await;
    let mut response = match sent {
        Ok(r) => r,
        Err(e) => {
            return Answer::Retry {
                why: e.without_url().to_string(),
                after: None,
            };
        }
    };
    let status = response.status().as_u16();
    let after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| retry_after(v, SystemTime::now()));
    // The answer's start, for a refusal's dead letter; the rest is read and
    // dropped so the connection is reused.
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(c)) => {
                if body.len() <= EXCERPT {
                    body.extend_from_slice(&c[..c.len().min(EXCERPT + 1 - body.len())]);
                }
            }
            Ok(None) => break,
            Err(e) if (200..300).contains(&status) => {
                // The 2xx came: the receiver took the event.
                tracing::debug!(error = %e.without_url(), "reading a 2xx answer's body");
                break;
            }
            Err(e) => {
                return Answer::Retry {
                    why: format!("HTTP {status}, then {}", e.without_url()),
                    after,
                };
            }
        }
    }
    classify(status, after, sanitized(&body))
}

fn error(event: &Event, class: DeliveryClass, reason: String) -> DeliveryError {
    crate::kit::failure(event, class, reason)
}

/// Delivers `event`: `Ok` on a 2xx, else the failure (a refusal or retries
/// run out: about the event; a gone or moved endpoint: final). A refused
/// record carries the number of requests sent for it, its dead letter's
/// `walbox_attempts` (1 for one that could not become a request).
pub(super) async fn deliver(shared: &Shared, event: &Event) -> Result<(), DeliveryError> {
    let mut attempts = 0u32;
    let result = try_deliver(shared, event, &mut attempts).await;
    result.map_err(|mut e| {
        if let Some(r) = &mut e.rejected {
            r.attempts = attempts.max(1);
        }
        e
    })
}

/// [`deliver`], counting the requests sent in `attempts`.
async fn try_deliver(
    shared: &Shared,
    event: &Event,
    attempts: &mut u32,
) -> Result<(), DeliveryError> {
    let id = webhook_id(event, event.origin.replay_name().as_deref());
    let prepared = prepare(event, id, &shared.template)
        .map_err(|why| error(event, DeliveryClass::InvalidRecord, why))?;
    let started = Instant::now();
    loop {
        *attempts += 1;
        let attempts = *attempts;
        let (why, after) = match attempt(shared, &prepared).await {
            Answer::Delivered => return Ok(()),
            Answer::Refused { status, excerpt } => {
                return Err(error(
                    event,
                    DeliveryClass::HttpRefused,
                    format!("HTTP {status}: {excerpt}"),
                ));
            }
            Answer::Stop { class, why } => return Err(error(event, class, why)),
            Answer::Retry { why, after } => (why, after),
        };
        let delay = match next_try(shared, started.elapsed(), attempts, after) {
            NextTry::After(delay) => Some(delay),
            NextTry::GiveUpAfter(wait) => {
                tokio::time::sleep(wait).await;
                None
            }
        };
        let Some(delay) = delay else {
            return Err(error(
                event,
                DeliveryClass::RetriesExhausted,
                format!(
                    "no 2xx within max_retry_duration_s ({} s, {attempts} attempts); last: {why}",
                    shared.max_retry.as_secs()
                ),
            ));
        };
        shared.retries.fetch_add(1, Ordering::Relaxed);
        count_retry(&event.topic);
        tracing::warn!(
            event_id = %event.event_id,
            topic = %event.topic,
            attempt = attempts,
            retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            error = %why,
            "webhook delivery failed; retrying"
        );
        tokio::time::sleep(delay).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_status_means_what_standard_webhooks_says() {
        assert_eq!(classify(204, None, String::new()), Answer::Delivered);
        for s in [408, 425, 429, 500, 502, 503, 504] {
            assert!(
                matches!(classify(s, None, String::new()), Answer::Retry { .. }),
                "{s}"
            );
        }
        assert!(matches!(
            classify(410, None, String::new()),
            Answer::Stop {
                class: DeliveryClass::EndpointGone,
                ..
            }
        ));
        assert!(matches!(
            classify(301, None, String::new()),
            Answer::Stop {
                class: DeliveryClass::EndpointMoved,
                ..
            }
        ));
        assert_eq!(
            classify(422, None, "no".into()),
            Answer::Refused {
                status: 422,
                excerpt: "no".into()
            }
        );
    }

    #[test]
    fn retry_after_backoff_and_excerpts() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        assert_eq!(retry_after(" 7 ", now), Some(Duration::from_secs(7)));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(retry_after(&later, now), Some(Duration::from_secs(30)));
        assert_eq!(retry_after("soon", now), None);
        let (i, m) = (Duration::from_millis(100), Duration::from_secs(1));
        for attempt in 1..30 {
            let d = backoff(attempt, i, m);
            let full = (i * (1 << (attempt - 1).min(20))).min(m);
            assert!(d >= full / 2 && d <= full, "{attempt}: {d:?}");
        }
        assert_eq!(sanitized(b"bad\r\n\x00thing"), "bad   thing");
        let long = sanitized(&[b'x'; 1000]);
        assert_eq!(long.len(), EXCERPT + 3);
    }

    #[test]
    fn a_retry_after_past_the_ceiling_gives_up_at_the_ceiling_never_before() {
        let s = Duration::from_secs;
        let limits = (Duration::from_millis(100), s(60), s(3600));
        // The receiver asks for two hours (or for ever): the event waits until
        // the ceiling, then is given up; it is not dead-lettered at once.
        let ms = Duration::from_millis;
        for after in [s(7200), s(u64::MAX)] {
            assert_eq!(
                next_try_within(limits, ms(1), 1, Some(after)),
                NextTry::GiveUpAfter(s(3600) - ms(1))
            );
        }
        // A backoff that would pass the ceiling: the last try is at it.
        assert_eq!(
            next_try_within(limits, s(3590), 9, None),
            NextTry::After(s(10))
        );
        assert_eq!(
            next_try_within(limits, s(3000), 2, Some(s(30))),
            NextTry::After(s(30))
        );
        assert_eq!(
            next_try_within(limits, s(3600), 9, None),
            NextTry::GiveUpAfter(s(0))
        );
    }

    /// A receiver on a local port that answers every request 204 and keeps
    /// each request's path.
    async fn receiver() -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let paths = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = Arc::clone(&paths);
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let head_end = loop {
                    let n = s.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        break None;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break Some(i + 4);
                    }
                };
                let Some(head_end) = head_end else { continue };
                let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                let length: usize = head
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse().ok())?
                    })
                    .unwrap_or(0);
                while buf.len() < head_end + length {
                    let n = s.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                let path = head.split(' ').nth(1).unwrap_or_default().to_owned();
                seen.lock().unwrap().push(path);
                let _ = s
                    .write_all(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
            }
        });
        (base, paths)
    }

    #[tokio::test]
    async fn a_value_that_is_a_dot_segment_is_dead_lettered_never_posted_to_the_parent_path() {
        let (base, paths) = receiver().await;
        let shared = Shared {
            client: reqwest::Client::builder().no_proxy().build().unwrap(),
            keys: vec![b"key".to_vec()],
            template: TopicTemplate::parse(&format!("{base}/in/{{topic}}/{{key}}")).unwrap(),
            retry_initial: Duration::from_millis(10),
            retry_max: Duration::from_millis(10),
            max_retry: Duration::from_millis(200),
            connections: Arc::new(Semaphore::new(4)),
            retries: Arc::new(AtomicU64::new(0)),
        };
        let event = |topic: &str, key: &str| Event {
            event_id: "msg_1".into(),
            topic: topic.into(),
            key: Some(bytes::Bytes::from(key.to_owned())),
            value: bytes::Bytes::from_static(b"{}"),
            json_value: true,
            headers: Vec::new(),
            position: walbox_outbox::Position {
                commit_lsn: walbox_pgoutput::Lsn(1),
                index: 0,
                xid: 7,
            },
            origin: walbox_outbox::Origin::Stream,
        };
        for (topic, key) in [("..", "k"), (".", "k"), ("orders", ".."), ("orders", ".")] {
            match deliver(&shared, &event(topic, key)).await {
                Ok(()) => panic!(
                    "{topic:?}/{key:?} was delivered, at {:?}",
                    paths.lock().unwrap()
                ),
                Err(e) => {
                    assert_eq!(e.class, DeliveryClass::InvalidRecord, "{e:?}");
                    assert!(e.reason.contains("dot segment"), "{}", e.reason);
                }
            }
        }
        assert!(paths.lock().unwrap().is_empty());
        // Dots that are not the whole segment, and a percent sign (encoded),
        // arrive as they are, in their own segment.
        deliver(&shared, &event("..x", "%2e")).await.unwrap();
        assert_eq!(*paths.lock().unwrap(), ["/in/..x/%252e"]);
    }
}
