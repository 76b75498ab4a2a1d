//! The NATS JetStream sink: each event is published to the subject its topic
//! names (topics are `.`-separated, as subjects are) with `Nats-Msg-Id` = the
//! event id (a dead letter's: the event id followed by `.dlq`), so that the
//! stream drops a resend after a crash within its duplicate window (a
//! `walbox replay` publishes under ids of its own, below); an
//! event counts as delivered only on the server's PubAck (a duplicate PubAck
//! once the message the stream holds under that id is the one walbox
//! published: see [`duplicate`]).
//!
//! Publications are chained: each one carries `Nats-Expected-Last-Msg-Id`, the
//! id of the one published before it to the same stream in this session, so
//! that when one is lost (a connection dropped under it) no later one is
//! stored before it; the session fails and the relay publishes again from its
//! acknowledged position. The server checks duplicates before the chain, so a
//! replay passes.
//!
//! Until a publication of the session is stored in a stream (not dropped as a
//! duplicate), the session probes that stream: each publication waits for
//! its PubAck before the next is sent, and one that follows a duplicate
//! carries no expectation, since the stream's last message is then not the
//! duplicate (a resend after a crash, a replay run again after a kill, with
//! other messages stored since). Every publication before it is then known to
//! be stored, so it cannot land after a gap; from the first stored one on,
//! publications are pipelined and chained.
//!
//! The first publication of a session carries no expectation, on purpose. A
//! session starts at the acknowledged position, so every event walbox
//! published before it is in the stream; a publication of an earlier session
//! still in flight is chained to its predecessor, or is that session's first,
//! whose predecessors were all stored before it: either way it lands only
//! where the replay puts the same event, or is dropped as a duplicate. An
//! expectation read from the stream at session start (its last sequence)
//! would include whatever another publisher wrote before it, so it would not
//! keep that publisher out, only narrow the moment it could write. walbox must
//! be the only publisher on its stream; another one is noticed within a
//! session (the next publication is refused, the session restarts), not
//! across sessions. A message
//! larger than the stream's `max_msg_size` or the server's `max_payload` is
//! refused here, before it is sent (it goes to a dead letter), so that no
//! message the stream refuses ever stands in the chain. A publication that
//! fails before it is sent (the client's queue full for longer than the PubAck
//! timeout) ends what the session sends: every later event fails at once,
//! unsent, with the same class, since one sent after it would be chained to
//! the one before it and could be stored before it.
//!
//! A replay (`walbox replay`, whose events carry [`walbox_outbox::Origin::Replay`]) publishes each
//! event under an id of its own, `{id}.replay.{name}` (the event id, or a dead
//! letter's, then the replay's name): the stream stores it again beside the
//! first copy, and drops only what an earlier run of the same replay stored
//! (the same start position). Such a drop is verified as any duplicate and
//! counted apart ([`Sink::duplicates`]), never as stored. The `event_id`
//! header stays the event's.
//!
//! A session's client runs on a thread of its own ([`client`]): an aborted or
//! dropped session closes it there and then, with its reconnects and the
//! PubAcks it still awaited.

mod client;
mod config;
mod duplicate;
mod headers;
mod publish;
mod stream;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use tokio::sync::mpsc;
use walbox_outbox::Event;

pub use config::{NatsSinkConfig, NatsStorage};
pub use headers::KEY_HEADER;
pub use headers::{DROPPED_HEADERS_HEADER, KEY_ENCODING_HEADER};
pub(crate) use headers::{base64_decode, is_dead_letter, percent_encode};
use headers::{headers_of, msg_id, sanitized_subject, valid_subject, wire_len};
use publish::{Outcome, Pending, classify, failure, report};
use stream::{check_window, ensure_stream};

use crate::kit::{self, Close, FailRest, Lifecycle, Reports, SessionTask};
use crate::{Deliveries, DeliveryClass, Sink, SinkError};

/// A connected session.
struct Session {
    js: jetstream::Context,
    acks: mpsc::UnboundedSender<Pending>,
    /// The task reporting PubAcks in publishing order.
    _reporter: SessionTask,
    /// Runs the client and the reporter; dropped last, it ends them.
    _thread: client::ClientThread,
}

// Closed at once, by dropping: nothing more of the session goes out.
impl Close for Session {}

/// Publishes events to JetStream, one subject per topic.
pub struct NatsSink {
    config: NatsSinkConfig,
    session: Lifecycle<Session>,
    reports: Reports,
    /// The stream of each subject checked so far.
    subjects: HashMap<String, String>,
    /// The largest message each stream takes (negative: no limit).
    max_size: HashMap<String, i32>,
    /// Per stream, the id of the last event published to it in this session.
    last_id: HashMap<String, String>,
    /// A publication of this session failed before it was sent: the class
    /// and reason every later event fails with, unsent.
    unsent: FailRest,
    /// Deliveries acknowledged as duplicates of a copy the stream held.
    duplicates: Arc<AtomicU64>,
    /// The streams a publication of this session was stored in (not dropped
    /// as a duplicate); until then a stream is probed.
    probed: HashSet<String>,
}

impl std::fmt::Debug for NatsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSink")
            .field("stream", &self.config.stream)
            .field("subjects", &self.subjects)
            .finish_non_exhaustive()
    }
}

impl NatsSink {
    /// A sink with these settings; it connects on its first event. Returns the
    /// sink and the receiver of its deliveries.
    pub fn new(config: NatsSinkConfig) -> Result<(Self, Deliveries), SinkError> {
        config.validate()?;
        let (reports, rx) = Reports::new();
        Ok((
            NatsSink {
                config,
                session: Lifecycle::default(),
                reports,
                subjects: HashMap::new(),
                max_size: HashMap::new(),
                last_id: HashMap::new(),
                unsent: FailRest::default(),
                duplicates: Arc::new(AtomicU64::new(0)),
                probed: HashSet::new(),
            },
            rx,
        ))
    }

    async fn session(&mut self) -> Result<&Session, SinkError> {
        self.reports.check()?;
        let config = &self.config;
        let reports = &self.reports;
        let duplicates = &self.duplicates;
        let session = self
            .session
            .open_with(|| async {
                let thread = client::ClientThread::start()?;
                let settings = config.clone();
                let client = thread
                    .run(async move { settings.connect().await })
                    .await??;
                let js = thread.within(|| {
                    jetstream::ContextBuilder::new()
                        .timeout(Duration::from_millis(config.ack_timeout_ms))
                        .max_ack_inflight(config.max_in_flight.max(1))
                        .build(client)
                });
                ensure_stream(&js, config).await?;
                let (acks, rx) = mpsc::unbounded_channel();
                let reporter = reports.spawn_on(
                    thread.handle(),
                    "PubAck reporter",
                    report(js.clone(), rx, reports.clone(), Arc::clone(duplicates)),
                );
                Ok(Session {
                    js,
                    acks,
                    _reporter: reporter,
                    _thread: thread,
                })
            })
            .await?;
        Ok(session)
    }

    /// The stream that holds `subject`, checked once.
    async fn stream_of(&mut self, subject: &str) -> Result<String, SinkError> {
        if let Some(s) = self.subjects.get(subject) {
            return Ok(s.clone());
        }
        let config = self.config.clone();
        let js = self.session().await?.js.clone();
        let name = js.stream_by_subject(subject).await.map_err(|e| {
            use jetstream::context::GetStreamByNameErrorKind as K;
            match e.kind() {
                K::NotFound => SinkError::MissingStream {
                    subject: subject.to_owned(),
                    stream: config.stream.clone(),
                },
                _ => SinkError::Nats(format!("looking up the stream of {subject}: {e}")),
            }
        })?;
        if !self.max_size.contains_key(&name) {
            let max = check_window(&js, &name, &config).await?;
            self.max_size.insert(name.clone(), max);
        }
        self.subjects.insert(subject.to_owned(), name.clone());
        Ok(name)
    }

    /// Waits for the PubAck of a publication to `stream` made while that
    /// stream is probed: a stored one ends the probe (the chain goes on from
    /// it), a duplicate checked to be the same event leaves the stream's last
    /// message unknown (the next publication carries no expectation).
    async fn probe(
        &mut self,
        js: &jetstream::Context,
        fut: jetstream::context::PublishAckFuture,
        event_id: &str,
        sent: &duplicate::Sent,
        stream: &str,
    ) -> Result<(), (DeliveryClass, String)> {
        let ack = fut.await.map_err(|e| failure(&e, false))?;
        if ack.duplicate {
            duplicate::check(js, &ack, event_id, sent).await?;
            self.duplicates.fetch_add(1, Ordering::SeqCst);
            self.last_id.remove(stream);
        } else {
            self.probed.insert(stream.to_owned());
            self.last_id.insert(stream.to_owned(), sent.msg_id.clone());
        }
        Ok(())
    }

    fn queue(&self, p: Pending) {
        self.reports.sent();
        if let Some(s) = self.session.get()
            && s.acks.send(p).is_ok()
        {
            return;
        }
        self.reports.withdrawn();
    }
}

/// The `Nats-Msg-Id` of a publication whose event's id is `id`: the id itself,
/// or in a replay the id followed by `.replay.` and the replay's name.
fn publication_id(id: &str, replay: Option<&str>) -> String {
    match replay {
        Some(name) => format!("{id}.replay.{name}"),
        None => id.to_owned(),
    }
}

impl Sink for NatsSink {
    fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::SeqCst)
    }

    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        if self.session.aborted() {
            return Ok(());
        }
        let dead_letter = is_dead_letter(&event);
        let subject = if dead_letter && !valid_subject(&event.topic) {
            sanitized_subject(&event.topic)
        } else {
            event.topic.clone()
        };
        let mut pending = Pending {
            token,
            event_id: event.event_id.clone(),
            subject: subject.clone(),
            outcome: Outcome::Failed(DeliveryClass::BrokerError, String::new()),
            rejected: kit::rejected(&event),
            sent: None,
        };
        if let Some((class, reason)) = self.unsent.get() {
            self.session().await?;
            pending.outcome = Outcome::Failed(class, reason);
            self.queue(pending);
            return Ok(());
        }
        if !valid_subject(&subject) {
            self.session().await?;
            pending.outcome = Outcome::Failed(
                DeliveryClass::InvalidTopic,
                format!(
                    "{subject:?} is not a NATS subject (an empty token, a wildcard or white \
                     space); its dead letter goes to {:?}; fix the row or the topic template",
                    sanitized_subject(&format!("{subject}.dlq"))
                ),
            );
            self.queue(pending);
            return Ok(());
        }
        let stream = self.stream_of(&subject).await?;
        let replay = event.origin.replay_name();
        let id = publication_id(&msg_id(&event), replay.as_deref());
        let key_text;
        let headers = match headers_of(&event, self.last_id.get(&stream).map(String::as_str)) {
            Ok(mut h) => {
                if replay.is_some() {
                    h.map.insert("Nats-Msg-Id", id.as_str());
                }
                if !h.dropped.is_empty() {
                    let names: Vec<String> = h.dropped.iter().map(|n| percent_encode(n)).collect();
                    tracing::warn!(
                        event_id = event.event_id,
                        subject,
                        dropped = names.join(","),
                        "dead letter published without the headers NATS cannot carry (named in \
                         walbox_dropped_headers)"
                    );
                }
                key_text = h.key;
                h.map
            }
            Err(reason) => {
                pending.outcome = Outcome::Failed(DeliveryClass::InvalidRecord, reason);
                self.queue(pending);
                return Ok(());
            }
        };
        let size = wire_len(&headers) + event.value.len();
        let max_payload = self.session().await?.js.client().server_info().max_payload;
        let limit = match self.max_size.get(&stream) {
            Some(m) if *m >= 0 => max_payload.min(usize::try_from(*m).unwrap_or(usize::MAX)),
            _ => max_payload,
        };
        if size > limit {
            pending.outcome = Outcome::Failed(
                DeliveryClass::MessageTooLarge,
                format!(
                    "{size} bytes (headers and value) is more than stream {stream} or the server \
                     takes ({limit} bytes)"
                ),
            );
            self.queue(pending);
            return Ok(());
        }
        let js = self.session().await?.js.clone();
        pending.sent = Some(duplicate::Sent::of_event(&subject, &id, key_text, &event));
        let publish = jetstream::message::PublishMessage::build()
            .payload(event.value.clone())
            .headers(headers);
        pending.outcome = match js.send_publish(subject, publish).await {
            Ok(fut) if !self.probed.contains(&stream) => {
                let sent = pending.sent.as_ref().expect("set above");
                match self.probe(&js, fut, &event.event_id, sent, &stream).await {
                    Ok(()) => Outcome::Delivered,
                    Err((class, reason)) => {
                        self.unsent.after(
                            class,
                            format!(
                                "not sent: event {} of this session was not stored ({reason}), \
                                 and a later publication could be stored before it; walbox \
                                 publishes again from its acknowledged position",
                                event.event_id
                            ),
                        );
                        Outcome::Failed(class, reason)
                    }
                }
            }
            Ok(fut) => {
                self.last_id.insert(stream, id);
                Outcome::Wait(fut)
            }
            Err(e) => {
                let text = e.to_string();
                let class = classify(e.kind(), &text);
                // A later publication would be chained to the one before this
                // unsent one, which the server may still store: it would land
                // after a gap. Nothing more goes out in this session.
                self.unsent.after(
                    class,
                    format!(
                        "not sent: event {} of this session was not sent ({text}), and a later \
                         publication could be stored before it; walbox publishes again from \
                         its acknowledged position",
                        event.event_id
                    ),
                );
                Outcome::Failed(class, text)
            }
        };
        self.queue(pending);
        Ok(())
    }

    fn abort(&mut self) {
        // Nothing more is published in this session, and what was sent is
        // not reported: the client closes with its queue and the PubAcks it
        // awaited.
        self.session.abort();
    }

    async fn flush(&mut self, timeout: Duration) -> Result<(), SinkError> {
        if self.session.aborted() {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + timeout;
        if let Some(s) = self.session.get() {
            let client = s.js.client();
            let _ = tokio::time::timeout(timeout, client.flush()).await;
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        self.session.flush(&self.reports, left).await
    }
}
