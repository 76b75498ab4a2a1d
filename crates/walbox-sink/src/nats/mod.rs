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
//! Publications go out on the core NATS connection with a reply subject of
//! walbox's own, and one subscription receives every PubAck of the session
//! ([`publish`]): no request and no inbox per message. A PubAck that does not
//! come within `ack_timeout_ms` (of the publication's hand-over, or of the
//! PubAck of the one before it if that came later) leaves the outcome
//! unknown: the event fails
//! as a timeout and the relay publishes it again, under the same
//! `Nats-Msg-Id`, from its acknowledged position. Publications lost with a
//! connection (async-nats reconnects) are never answered: they time out, and
//! the chain refuses every later one the new connection carries. What is in
//! flight is bounded by the relay (`max_in_flight`, `max_in_flight_bytes`);
//! the reply subscription holds room for all of it.
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
use tokio::sync::{mpsc, oneshot};
use walbox_outbox::Event;

pub use config::{NatsSinkConfig, NatsStorage};
pub use headers::KEY_HEADER;
pub use headers::{DROPPED_HEADERS_HEADER, KEY_ENCODING_HEADER};
pub(crate) use headers::{base64_decode, is_dead_letter, percent_encode};
use headers::{headers_of, msg_id, sanitized_subject, valid_subject, wire_len};
use publish::{Pending, Probed, Published, State, classify, report};
use stream::{check_window, ensure_stream};

use crate::kit::{Close, FailRest, Lifecycle, Reports, SessionTask};
use crate::{Deliveries, DeliveryClass, Sink, SinkError};

/// A connected session.
struct Session {
    js: jetstream::Context,
    /// The core NATS connection publications go out on.
    client: async_nats::Client,
    /// The reply subjects' prefix: a publication's reply subject is this
    /// followed by its number in the session ([`publish`]).
    prefix: String,
    /// The server's largest message, read when the session started.
    max_payload: usize,
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
    /// The number the next event handed to the session gets.
    next_seq: u64,
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
                next_seq: 0,
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
                let ack_timeout = Duration::from_millis(config.ack_timeout_ms);
                let js = thread.within(|| {
                    jetstream::ContextBuilder::new()
                        .timeout(ack_timeout)
                        .build(client.clone())
                });
                ensure_stream(&js, config).await?;
                // One subscription for every PubAck of the session.
                let prefix = format!("{}.", client.new_inbox());
                let replies = {
                    let (client, subject) = (client.clone(), format!("{prefix}*"));
                    thread
                        .run(async move { client.subscribe(subject).await })
                        .await?
                        .map_err(|e| {
                            SinkError::Nats(format!("subscribing to the PubAcks' subject: {e}"))
                        })?
                };
                let max_payload = client.server_info().max_payload;
                let (acks, rx) = mpsc::unbounded_channel();
                let reporter = reports.spawn_on(
                    thread.handle(),
                    "PubAck reporter",
                    report(
                        js.clone(),
                        replies,
                        prefix.clone(),
                        ack_timeout,
                        rx,
                        reports.clone(),
                        Arc::clone(duplicates),
                    ),
                );
                Ok(Session {
                    js,
                    client,
                    prefix,
                    max_payload,
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

    /// Hands `p` to the session's reporter, numbered.
    fn queue(&mut self, mut p: Pending) {
        p.seq = self.next_seq;
        self.next_seq += 1;
        self.reports.sent();
        if let Some(s) = self.session.get()
            && s.acks.send(p).is_ok()
        {
            return;
        }
        self.reports.withdrawn();
    }

    /// `p` was not sent (`e`): it fails, and so does every later event of the
    /// session.
    fn not_sent(&mut self, mut p: Pending, e: &jetstream::context::PublishError) {
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
                p.event.event_id
            ),
        );
        p.state = State::Failed(class, text);
        self.queue(p);
    }

    /// A pending entry for `event` to `subject`, failed unless changed.
    fn pending(event: Event, subject: String, token: usize) -> Pending {
        Pending {
            token,
            seq: 0,
            event,
            subject,
            state: State::Failed(DeliveryClass::BrokerError, String::new()),
            published: None,
            probe: None,
        }
    }
}

/// The `Nats-Msg-Id` of a publication whose event's id is `id`: the id itself,
/// or in a replay the id followed by `.replay.` and the replay's name.
fn publication_id(id: String, replay: Option<&str>) -> String {
    match replay {
        Some(name) => format!("{id}.replay.{name}"),
        None => id,
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
        if let Some((class, reason)) = self.unsent.get() {
            self.session().await?;
            let mut p = Self::pending(event, subject, token);
            p.state = State::Failed(class, reason);
            self.queue(p);
            return Ok(());
        }
        if !valid_subject(&subject) {
            self.session().await?;
            let reason = format!(
                "{subject:?} is not a NATS subject (an empty token, a wildcard or white \
                 space); its dead letter goes to {:?}; fix the row or the topic template",
                sanitized_subject(&format!("{subject}.dlq"))
            );
            let mut p = Self::pending(event, subject, token);
            p.state = State::Failed(DeliveryClass::InvalidTopic, reason);
            self.queue(p);
            return Ok(());
        }
        let stream = self.stream_of(&subject).await?;
        let replay = event.origin.replay_name();
        let id = publication_id(msg_id(&event), replay.as_deref());
        let (headers, key) = match headers_of(&event, self.last_id.get(&stream).map(String::as_str))
        {
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
                        "dead letter published without the headers NATS cannot carry \
                             (named in walbox_dropped_headers)"
                    );
                }
                (h.map, h.key)
            }
            Err(reason) => {
                let mut p = Self::pending(event, subject, token);
                p.state = State::Failed(DeliveryClass::InvalidRecord, reason);
                self.queue(p);
                return Ok(());
            }
        };
        let size = wire_len(&headers) + event.value.len();
        let max_payload = self.session().await?.max_payload;
        let limit = match self.max_size.get(&stream) {
            Some(m) if *m >= 0 => max_payload.min(usize::try_from(*m).unwrap_or(usize::MAX)),
            _ => max_payload,
        };
        if size > limit {
            let reason = format!(
                "{size} bytes (headers and value) is more than stream {stream} or the server \
                 takes ({limit} bytes)"
            );
            let mut p = Self::pending(event, subject, token);
            p.state = State::Failed(DeliveryClass::MessageTooLarge, reason);
            self.queue(p);
            return Ok(());
        }
        // Published with the reply subject of its number in the session; the
        // client's queue full for longer than the PubAck timeout, it is not
        // sent at all.
        let seq = self.next_seq;
        let ack_timeout = Duration::from_millis(self.config.ack_timeout_ms);
        let session = self.session().await?;
        let reply = format!("{}{seq}", session.prefix);
        let sent = tokio::time::timeout(
            ack_timeout,
            session.client.publish_with_reply_and_headers(
                subject.clone(),
                reply,
                headers,
                event.value.clone(),
            ),
        )
        .await;
        let mut p = Self::pending(event, subject, token);
        p.published = Some(Published { key });
        match sent {
            Ok(Ok(())) if !self.probed.contains(&stream) => {
                // Probing: the PubAck is awaited before anything else goes out.
                let event_id = p.event.event_id.clone();
                let (tx, verdict) = oneshot::channel();
                p.state = State::Waiting;
                p.probe = Some(tx);
                self.queue(p);
                match verdict.await {
                    Ok(Probed::Stored) => {
                        self.probed.insert(stream.clone());
                        self.last_id.insert(stream, id);
                    }
                    Ok(Probed::Duplicate) => {
                        self.last_id.remove(&stream);
                    }
                    Ok(Probed::Failed(class, reason)) => self.unsent.after(
                        class,
                        format!(
                            "not sent: event {event_id} of this session was not stored \
                             ({reason}), and a later publication could be stored before it; \
                             walbox publishes again from its acknowledged position"
                        ),
                    ),
                    Err(_) => self.unsent.after(
                        DeliveryClass::BrokerError,
                        format!(
                            "not sent: the outcome of event {event_id} of this session is \
                             unknown (the session's PubAck reporter ended); walbox publishes \
                             again from its acknowledged position"
                        ),
                    ),
                }
            }
            Ok(Ok(())) => {
                p.state = State::Waiting;
                self.last_id.insert(stream, id);
                self.queue(p);
            }
            Ok(Err(e)) => self.not_sent(p, &publish::unsent(Ok(e))),
            Err(_elapsed) => self.not_sent(p, &publish::unsent(Err(()))),
        }
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
            let _ = tokio::time::timeout(timeout, s.client.flush()).await;
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        self.session.flush(&self.reports, left).await
    }
}
