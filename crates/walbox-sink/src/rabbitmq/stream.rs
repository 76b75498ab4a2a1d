//! Stream mode: RabbitMQ Streams over the stream protocol
//! (`rabbitmq-stream-client`, pinned at 0.4.4: later versions send a 3.11
//! command on connect that 3.10 answers by closing the connection). Each
//! topic is a stream; each event is published by a named producer under a
//! publishing id taken from its position ([`super::publishing_id`]), with
//! the record's headers, the key (`walbox_key`), and the producer name and
//! publishing id it went under (`walbox_producer`, `walbox_publishing_id`)
//! as application properties, and its event id as the AMQP `message-id`
//! property whatever the record's format (the first-use check below reads it
//! back from there).
//!
//! On its first event for a (stream, name) a session asks the broker for
//! the name's sequence (the highest id stored under it). A sequence above 0
//! is checked first: the stream must hold a message that walbox published
//! under that name with that id; else another producer uses the name, and
//! walbox stops naming the stream, the name and the id. The same read (the
//! stream's tail, and further back until it reaches the session's first id
//! under the name) gathers the event ids walbox's
//! messages hold under the name from that first id to the sequence. An
//! event whose id is at or below the sequence is not sent (the broker would
//! drop it); it counts as already stored, apart ([`Sink::duplicates`]),
//! only if the stream holds that very event under its id. Anything else
//! there, or nothing, means another history published under the name (a
//! restored database, another one with the same producer base): walbox
//! stops before the event rather than lose it.
//!
//! A replay (`walbox replay`, [`Sink::replay_as`]) publishes under names of
//! its own, `{base}.replay.{name}`, so the stream stores the range again and
//! drops only what an earlier run of the same replay stored.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use rabbitmq_stream_client::error::{ProducerCreateError, StreamCreateError};
use rabbitmq_stream_client::types::{Message, OffsetSpecification, ResponseCode, SimpleValue};
use rabbitmq_stream_client::{Client, ClientOptions, Dedup, Environment, Producer};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use walbox_outbox::{Event, Origin};

use super::RabbitMqSinkConfig;
use super::confirms::{Answer, Confirms, Outcome};
use super::publishing_id::{Slot, message_slot, slot};
use crate::kit::{self, AnswerTimer, Close, FailRest, Lifecycle, Reports, SessionTask};
use crate::nats::KEY_HEADER;
use crate::{Deliveries, DeliveryClass, RejectedRecord, Sink, SinkError};

/// The application property naming the producer a message went under.
pub(super) const PRODUCER_PROPERTY: &str = "walbox_producer";
/// The application property holding its publishing id.
pub(super) const ID_PROPERTY: &str = "walbox_publishing_id";

/// What the reporter learns.
enum Report {
    /// A publication (or an event settled without one), in publish order.
    Queued {
        seq: u64,
        token: usize,
        event_id: String,
        topic: String,
        dropped: bool,
        answer: Option<Answer>,
        rejected: RejectedRecord,
    },
    /// The broker's answer for publication `seq`.
    Answered(u64, Answer),
}

struct Item {
    seq: u64,
    token: usize,
    event_id: String,
    topic: String,
    dropped: bool,
    rejected: RejectedRecord,
    queued_at: Instant,
}

/// A producer of this session and what the broker held under its name.
struct Named {
    producer: Producer<Dedup>,
    /// The highest id stored under the name when the session began.
    sequence: u64,
    /// The event ids walbox's messages under the name hold, by publishing
    /// id, from the session's first id under the name to `sequence`.
    stored: BTreeMap<u64, String>,
    /// The highest id sent under the name in this session.
    sent: u64,
}

struct Session {
    environment: Environment,
    client: Client,
    producers: HashMap<(String, String), Named>,
    /// The task reporting confirms in publish order.
    _reporter: SessionTask,
    reports: mpsc::UnboundedSender<Report>,
    /// How many publications handed to a producer await the broker's answer.
    unanswered: Arc<watch::Sender<usize>>,
    /// Whether the broker failed one of them (or it could not be sent).
    refused: Arc<AtomicBool>,
    /// The name each stream was last published under.
    last_name: HashMap<String, String>,
}

impl Close for Session {
    async fn close(self) {
        drop(self._reporter);
        for (_, named) in self.producers {
            let _ = named.producer.close().await;
        }
        let _ = self.client.close().await;
    }
}

/// Publishes events to streams.
pub(super) struct StreamSink {
    config: RabbitMqSinkConfig,
    session: Lifecycle<Session>,
    reports: Reports,
    duplicates: Arc<AtomicU64>,
    next_seq: u64,
    /// A failure of this session that every later event shares, unsent.
    unsent: FailRest,
}

impl std::fmt::Debug for StreamSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSink")
            .field("producer", &self.config.producer)
            .finish_non_exhaustive()
    }
}

fn stream_error(what: &str, e: &dyn std::fmt::Display) -> SinkError {
    SinkError::RabbitMq(format!("{what}: {e}"))
}

/// The client options of these settings.
fn client_options(config: &RabbitMqSinkConfig) -> ClientOptions {
    let mut b = ClientOptions::builder()
        .host(&config.host)
        .port(config.stream_port())
        .user(config.user())
        .password(config.password())
        .v_host(&config.vhost);
    if config.tls {
        b = b.tls(tls(config));
    }
    b.build()
}

fn tls(config: &RabbitMqSinkConfig) -> rabbitmq_stream_client::TlsConfiguration {
    let mut t = rabbitmq_stream_client::TlsConfiguration::builder()
        .enable(true)
        .trust_certificates(false);
    if let Some(ca) = &config.ca_file {
        t = t.add_root_certificates(ca.display().to_string());
    }
    if let (Some(cert), Some(key)) = (&config.client_cert, &config.client_key) {
        t = t.add_client_certificates_keys(cert.display().to_string(), key.display().to_string());
    }
    t.build()
}

/// Connects an environment (producers, consumers) and a client (queries).
pub(crate) async fn connect(
    config: &RabbitMqSinkConfig,
) -> Result<(Environment, Client), SinkError> {
    let refused = |e: &dyn std::fmt::Display| {
        let text = e.to_string();
        if text.contains("AuthenticationFailure") || text.contains("SaslAuthenticationFailure") {
            SinkError::RabbitMqAuthentication {
                user: config.user().to_owned(),
                reason: "authentication failed".into(),
            }
        } else {
            stream_error(&format!("connecting to {}", config.describe()), &text)
        }
    };
    let timeout = Duration::from_millis(config.connect_timeout_ms.saturating_add(1_000));
    let mut builder = Environment::builder()
        .host(&config.host)
        .port(config.stream_port())
        .username(config.user())
        .password(config.password())
        .virtual_host(&config.vhost);
    if config.tls {
        builder = builder.tls(tls(config));
    }
    let late = || {
        SinkError::RabbitMq(format!(
            "connecting to {}: no answer in time",
            config.describe()
        ))
    };
    let environment = tokio::time::timeout(timeout, builder.build())
        .await
        .map_err(|_| late())?
        .map_err(|e| refused(&e))?;
    let client = tokio::time::timeout(timeout, Client::connect(client_options(config)))
        .await
        .map_err(|_| late())?
        .map_err(|e| refused(&e))?;
    Ok((environment, client))
}

/// The text of an application property.
pub(super) fn property(m: &Message, name: &str) -> Option<String> {
    match m.application_properties()?.get(name)? {
        SimpleValue::String(s) => Some(s.clone()),
        SimpleValue::Binary(b) => String::from_utf8(b.clone()).ok(),
        SimpleValue::Ulong(v) => Some(v.to_string()),
        SimpleValue::Long(v) => Some(v.to_string()),
        _ => None,
    }
}

/// The event id walbox wrote into `m`: the AMQP `message-id` property, which
/// walbox sets to the event id whatever the record's format. A message
/// published before walbox set it holds the id only where its format put it
/// (the walbox format's `event_id` property, Debezium's `id`, CloudEvents'
/// `cloudEvents_id` or a structured event's body), which is read then.
pub(super) fn stored_event_id(m: &Message) -> Option<String> {
    if let Some(id) = m.properties().and_then(|p| p.message_id.clone()) {
        return String::try_from(id).ok();
    }
    let properties: Vec<(String, String)> = m
        .application_properties()
        .map(|p| {
            p.keys()
                .filter_map(|k| property(m, k).map(|v| (k.clone(), v)))
                .collect()
        })
        .unwrap_or_default();
    walbox_outbox::record_event_id(
        |name| {
            properties
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        },
        m.data(),
    )
}

/// What walbox stored in `stream` under `name` with publishing ids from
/// `from` to `to`: each id's event id. Reads the tail (the last chunk on),
/// then from further back each time (a thousand messages before the lowest
/// offset read, then eight times as many each time, then the whole stream)
/// until it has read `to` and an id at or below `from` under the name: ids
/// grow with the offset under a name, so everything from there on was read.
/// Each read ends once nothing came for a moment.
async fn stored_under(
    environment: &Environment,
    stream: &str,
    name: &str,
    from: u64,
    to: u64,
) -> Result<BTreeMap<u64, String>, SinkError> {
    let mut found = BTreeMap::new();
    let mut start = OffsetSpecification::Last;
    let mut back = 1_024u64;
    loop {
        let whole = matches!(start, OffsetSpecification::First);
        let mut consumer = environment
            .consumer()
            .offset(start)
            .build(stream)
            .await
            .map_err(|e| stream_error(&format!("reading stream {stream}"), &e))?;
        let mut reached = false;
        let mut lowest: Option<u64> = None;
        while let Ok(Some(delivery)) =
            tokio::time::timeout(Duration::from_millis(500), consumer.next()).await
        {
            let Ok(delivery) = delivery else { break };
            lowest = Some(lowest.map_or(delivery.offset(), |l| l.min(delivery.offset())));
            let m = delivery.message();
            if property(m, PRODUCER_PROPERTY).as_deref() != Some(name) {
                continue;
            }
            let Some(id) = property(m, ID_PROPERTY).and_then(|v| v.parse::<u64>().ok()) else {
                continue;
            };
            reached |= id <= from;
            if (from..=to).contains(&id)
                && let Some(event) = stored_event_id(m)
            {
                found.insert(id, event);
            }
        }
        let _ = consumer.handle().close().await;
        if whole || (found.contains_key(&to) && reached) {
            return Ok(found);
        }
        start = match lowest {
            Some(low) if low > back => OffsetSpecification::Offset(low - back),
            _ => OffsetSpecification::First,
        };
        back = back.saturating_mul(8);
    }
}

impl StreamSink {
    pub(super) fn new(config: RabbitMqSinkConfig) -> (Self, Deliveries) {
        let (reports, rx) = Reports::new();
        (
            StreamSink {
                config,
                session: Lifecycle::default(),
                reports,
                duplicates: Arc::new(AtomicU64::new(0)),
                next_seq: 0,
                unsent: FailRest::default(),
            },
            rx,
        )
    }

    async fn session(&mut self) -> Result<&mut Session, SinkError> {
        self.reports.check()?;
        let config = &self.config;
        let reports = &self.reports;
        let duplicates = &self.duplicates;
        self.session
            .open_with(|| async {
                let (environment, client) = connect(config).await?;
                let (to_reporter, rx) = mpsc::unbounded_channel();
                let reporter = reports.spawn(
                    "confirm reporter",
                    report(
                        rx,
                        reports.clone(),
                        Arc::clone(duplicates),
                        Duration::from_millis(config.confirm_timeout_ms),
                    ),
                );
                tracing::info!(
                    server = config.describe(),
                    "publishing to streams with named producers"
                );
                Ok(Session {
                    environment,
                    client,
                    producers: HashMap::new(),
                    _reporter: reporter,
                    reports: to_reporter,
                    unanswered: Arc::new(watch::channel(0).0),
                    refused: Arc::new(AtomicBool::new(false)),
                    last_name: HashMap::new(),
                })
            })
            .await
    }

    /// The producer of `slot.name` on `stream`, declared (and the stream
    /// created, with `declare`) on first use, with the name's sequence
    /// checked to be walbox's.
    async fn producer(
        &mut self,
        stream: &str,
        name: &str,
        first_id: u64,
    ) -> Result<(), ProducerFailure> {
        let declare = self.config.declare;
        let wait = Duration::from_millis(self.config.connect_timeout_ms.max(1_000));
        let batch = self.config.max_in_flight.clamp(1, 1_000);
        let session = self.session().await.map_err(ProducerFailure::Sink)?;
        let key = (stream.to_owned(), name.to_owned());
        if session.producers.contains_key(&key) {
            return Ok(());
        }
        if declare {
            let created =
                tokio::time::timeout(wait, session.environment.stream_creator().create(stream))
                    .await
                    .map_err(|_| {
                        ProducerFailure::Sink(SinkError::RabbitMq(format!(
                            "creating stream {stream}: no answer within {} ms",
                            wait.as_millis()
                        )))
                    })?;
            match created {
                Ok(()) => tracing::info!(stream, "created the stream"),
                Err(StreamCreateError::Create {
                    status: ResponseCode::StreamAlreadyExists,
                    ..
                }) => {}
                Err(e) => {
                    return Err(ProducerFailure::Sink(stream_error(
                        &format!("creating stream {stream}"),
                        &e,
                    )));
                }
            }
        }
        let late = |what: &str| {
            ProducerFailure::Sink(SinkError::RabbitMq(format!(
                "{what} producer {name} on stream {stream}: no answer within {} ms",
                wait.as_millis()
            )))
        };
        let producer = tokio::time::timeout(
            wait,
            session
                .environment
                .producer()
                .name(name)
                .batch_size(batch)
                .batch_delay(Duration::from_millis(5))
                .build(stream),
        )
        .await
        .map_err(|_| late("declaring"))?
        .map_err(|e| match e {
            ProducerCreateError::StreamDoesNotExist { .. } => {
                ProducerFailure::Sink(SinkError::MissingRabbitStream(stream.to_owned()))
            }
            other => ProducerFailure::Sink(stream_error(
                &format!("declaring producer {name} on stream {stream}"),
                &other,
            )),
        })?;
        let sequence =
            tokio::time::timeout(wait, session.client.query_publisher_sequence(name, stream))
                .await
                .map_err(|_| late("asking the sequence of"))?
                .map_err(|e| {
                    ProducerFailure::Sink(stream_error(
                        &format!("asking the sequence of producer {name} on stream {stream}"),
                        &e,
                    ))
                })?;
        let mut stored = BTreeMap::new();
        if sequence > 0 {
            stored = tokio::time::timeout(
                wait * 10,
                stored_under(
                    &session.environment,
                    stream,
                    name,
                    first_id.min(sequence),
                    sequence,
                ),
            )
            .await
            .map_err(|_| late("reading the stream's last messages of"))?
            .map_err(ProducerFailure::Sink)?;
            if !stored.contains_key(&sequence) {
                let _ = producer.close().await;
                return Err(ProducerFailure::Taken(format!(
                    "stream {stream}: the broker holds sequence {sequence} for producer name \
                     {name}, but the stream holds no message walbox published under that name \
                     with that id: another producer uses the name {name} (or retention removed \
                     what walbox published); walbox's names must be its own: give walbox \
                     another producer base (sink.rabbitmq.producer) or the other producer \
                     another name; walbox stops before this event"
                )));
            }
            tracing::info!(
                stream,
                producer = name,
                sequence,
                "the stream holds walbox's events up to this publishing id; those are not sent again"
            );
        }
        session.producers.insert(
            key,
            Named {
                producer,
                sequence,
                stored,
                sent: 0,
            },
        );
        Ok(())
    }

    /// Before the first publication to `stream` under `name` after others
    /// under another name: waits until the broker has answered every
    /// publication of the session. Each name's producer has a connection of
    /// its own, and the broker orders only what one connection sends, so
    /// without this a later event could land before an earlier one of
    /// another name (snapshot rows then the stream, an epoch's last events
    /// then the next's, a transaction past 2^23 events then the next). Errs
    /// (the event must not go) when one failed or no answer came in time.
    async fn after_other_names(&mut self, stream: &str, name: &str) -> Result<(), String> {
        let wait = Duration::from_millis(self.config.confirm_timeout_ms);
        let session = self.session.get_mut().expect("connected above");
        let previous = session.last_name.insert(stream.to_owned(), name.to_owned());
        if previous.is_none_or(|p| p == name) {
            return Ok(());
        }
        let mut rx = session.unanswered.subscribe();
        let answered = tokio::time::timeout(wait, rx.wait_for(|n| *n == 0))
            .await
            .is_ok_and(|r| r.is_ok());
        if !answered {
            return Err(format!(
                "an earlier publication of this session had no answer within {} ms; the \
                 next one, to stream {stream} under producer {name}, waits for it (another \
                 name's producer has a connection of its own, which would not keep their \
                 order)",
                wait.as_millis()
            ));
        }
        if session.refused.load(Ordering::SeqCst) {
            return Err(format!(
                "an earlier publication of this session failed; the next one, to stream \
                 {stream} under producer {name}, would land after it out of order"
            ));
        }
        Ok(())
    }

    fn queue(&mut self, token: usize, event: &Event, dropped: bool, answer: Option<Answer>) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.reports.sent();
        let report = Report::Queued {
            seq,
            token,
            event_id: event.event_id.clone(),
            topic: event.topic.clone(),
            dropped,
            answer,
            rejected: kit::rejected(event),
        };
        let queued = self
            .session
            .get()
            .is_some_and(|s| s.reports.send(report).is_ok());
        if !queued {
            self.reports.withdrawn();
        }
        seq
    }

    /// The producer name and publishing id of `event`.
    fn slot_of(&self, event: &Event) -> Slot {
        slot_of(self.config.producer.as_deref().unwrap_or("walbox"), event)
    }
}

/// The producer name and publishing id of `event` for producers named from
/// `base`, by its position and origin: a copy (`walbox replay`'s, a
/// dead-letter replay's) under a base of its own (`{base}.replay.{name}`),
/// so it never takes the ids the stream's events took; a snapshot row (also
/// as a dead letter replayed) under its snapshot's name; a streamed event
/// under the epoch's name, and so a non-transactional message's dead letter,
/// at 2 below its LSN ([`super::publishing_id::message_slot`]): the commit of
/// a transaction right after the message can share its LSN.
fn slot_of(base: &str, event: &Event) -> Slot {
    let base = match &event.origin {
        Origin::Replay { from } | Origin::Message { replay: Some(from) } => {
            std::borrow::Cow::Owned(format!("{base}.replay.{from}"))
        }
        Origin::DeadLetterReplay { letter, .. } => {
            std::borrow::Cow::Owned(format!("{base}.replay.{letter}"))
        }
        Origin::Stream | Origin::Snapshot { .. } | Origin::Message { replay: None } => {
            std::borrow::Cow::Borrowed(base)
        }
    };
    let (lsn, index) = (event.position.commit_lsn.0, event.position.index);
    match event.origin {
        Origin::Message { .. } => message_slot(&base, lsn),
        _ => slot(&base, lsn, index, event.origin.snapshot_row()),
    }
}

/// Why a producer could not be had.
enum ProducerFailure {
    /// The session's failure.
    Sink(SinkError),
    /// Another producer uses the name.
    Taken(String),
}

/// The message of `event` under `slot`.
fn message_of(event: &Event, slot: &Slot) -> Message {
    let mut props = Message::builder()
        .body(event.value.to_vec())
        .publising_id(slot.id)
        .properties()
        .message_id(event.event_id.clone())
        .message_builder()
        .application_properties();
    for (name, value) in &event.headers {
        let v = match std::str::from_utf8(value) {
            Ok(s) => SimpleValue::String(s.to_owned()),
            Err(_) => SimpleValue::Binary(value.to_vec()),
        };
        props = props.insert(name.as_ref(), v);
    }
    if let Some(key) = &event.key {
        let v = match std::str::from_utf8(key) {
            Ok(s) => SimpleValue::String(s.to_owned()),
            Err(_) => SimpleValue::Binary(key.to_vec()),
        };
        props = props.insert(KEY_HEADER, v);
    }
    props
        .insert(PRODUCER_PROPERTY, SimpleValue::String(slot.name.clone()))
        .insert(ID_PROPERTY, SimpleValue::Ulong(slot.id))
        .message_builder()
        .build()
}

impl Sink for StreamSink {
    fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::SeqCst)
    }

    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        if self.session.aborted() {
            return Ok(());
        }
        self.session().await?;
        if let Some((class, reason)) = self.unsent.get() {
            self.queue(token, &event, false, Some(Answer::Failed(class, reason)));
            return Ok(());
        }
        let slot = self.slot_of(&event);
        let stream = event.topic.clone();
        match self.producer(&stream, &slot.name, slot.id).await {
            Ok(()) => {}
            Err(ProducerFailure::Sink(e)) => return Err(e),
            Err(ProducerFailure::Taken(reason)) => {
                self.unsent.after(
                    DeliveryClass::BrokerError,
                    format!("not sent: an earlier event of this session failed ({reason})"),
                );
                self.queue(
                    token,
                    &event,
                    false,
                    Some(Answer::Failed(DeliveryClass::DuplicateId, reason)),
                );
                return Ok(());
            }
        }
        let key = (stream.clone(), slot.name.clone());
        let named = &self.session.get().expect("connected above").producers[&key];
        if slot.id <= named.sequence {
            // At or below the name's sequence: the broker would drop it. It
            // is already stored only if the stream holds this very event
            // under that id; anything else (another event there, or none: an
            // earlier history under the name, such as a restored cluster or
            // another database with the same producer base) would be lost.
            let held = named.stored.get(&slot.id);
            let answer = if held.map(String::as_str) == Some(event.event_id.as_str()) {
                Answer::Ack
            } else {
                let reason = format!(
                    "stream {stream} holds, under producer {} with publishing id {} (commit LSN \
                     {}, index {}), {} where walbox has event {}, and the broker keeps id {} as \
                     the name's last: sent, it would be dropped unseen; another history \
                     published under this name (a restored or replaced database, another \
                     database with the same producer base): give walbox another producer base \
                     (sink.rabbitmq.producer); walbox stops before this event",
                    slot.name,
                    slot.id,
                    event.position.commit_lsn,
                    event.position.index,
                    held.map_or_else(|| "no message".to_owned(), |e| format!("event {e}")),
                    event.event_id,
                    named.sequence,
                );
                self.unsent
                    .after(DeliveryClass::BrokerError, format!("not sent: {reason}"));
                Answer::Failed(DeliveryClass::DuplicateId, reason)
            };
            let dropped = matches!(answer, Answer::Ack);
            self.queue(token, &event, dropped, Some(answer));
            return Ok(());
        }
        if slot.id <= named.sent {
            // The broker would drop it as a duplicate of what this session
            // sent under the name: a position that went backwards. Stopping
            // keeps it from being lost.
            let reason = format!(
                "event {} (commit LSN {}, index {}) would go to stream {stream} under producer \
                 {} with publishing id {}, at or below the id {} this session already sent under \
                 that name: the broker would drop it unseen; positions must grow under a name; \
                 walbox stops before this event",
                event.event_id,
                event.position.commit_lsn,
                event.position.index,
                slot.name,
                slot.id,
                named.sent
            );
            self.unsent
                .after(DeliveryClass::BrokerError, format!("not sent: {reason}"));
            self.queue(
                token,
                &event,
                false,
                Some(Answer::Failed(DeliveryClass::DuplicateId, reason)),
            );
            return Ok(());
        }
        if let Err(reason) = self.after_other_names(&stream, &slot.name).await {
            self.unsent
                .after(DeliveryClass::BrokerError, format!("not sent: {reason}"));
            self.queue(
                token,
                &event,
                false,
                Some(Answer::Failed(DeliveryClass::BrokerError, reason)),
            );
            return Ok(());
        }
        let message = message_of(&event, &slot);
        let seq = self.queue(token, &event, false, None);
        let session = self.session.get().expect("connected above");
        let reports = session.reports.clone();
        let unanswered = Arc::clone(&session.unanswered);
        let refused = Arc::clone(&session.refused);
        unanswered.send_modify(|n| *n += 1);
        let named = self
            .session
            .get_mut()
            .expect("connected above")
            .producers
            .get_mut(&key)
            .expect("declared above");
        named.sent = slot.id;
        let sent = named
            .producer
            .send(message, {
                let unanswered = Arc::clone(&unanswered);
                let refused = Arc::clone(&refused);
                move |status| {
                    let reports = reports.clone();
                    let unanswered = Arc::clone(&unanswered);
                    let refused = Arc::clone(&refused);
                    async move {
                        let answer = match status {
                            Ok(s) if s.confirmed() => Answer::Ack,
                            Ok(s) => Answer::Failed(
                                DeliveryClass::BrokerError,
                                format!("the broker did not confirm it ({:?})", s.status()),
                            ),
                            Err(e) => Answer::Failed(DeliveryClass::BrokerError, e.to_string()),
                        };
                        if !matches!(answer, Answer::Ack) {
                            refused.store(true, Ordering::SeqCst);
                        }
                        let _ = reports.send(Report::Answered(seq, answer));
                        unanswered.send_modify(|n| *n = n.saturating_sub(1));
                    }
                }
            })
            .await;
        if let Err(e) = sent {
            refused.store(true, Ordering::SeqCst);
            unanswered.send_modify(|n| *n = n.saturating_sub(1));
            let reason = format!("publishing to stream {stream}: {e}");
            self.unsent.after(
                DeliveryClass::BrokerError,
                format!("not sent: an earlier event of this session was not ({reason})"),
            );
            if let Some(s) = self.session.get() {
                let _ = s.reports.send(Report::Answered(
                    seq,
                    Answer::Failed(DeliveryClass::BrokerError, reason),
                ));
            }
        }
        Ok(())
    }

    fn abort(&mut self) {
        self.session.abort();
    }

    async fn flush(&mut self, timeout: Duration) -> Result<(), SinkError> {
        self.session.flush(&self.reports, timeout).await
    }
}

/// Reports events in publish order as their confirms come.
async fn report(
    mut rx: mpsc::UnboundedReceiver<Report>,
    reports: Reports,
    duplicates: Arc<AtomicU64>,
    timeout: Duration,
) {
    let mut confirms: Confirms<Item> = Confirms::default();
    let mut timer = AnswerTimer::new(timeout);
    loop {
        // The oldest publication waiting, timed from its queueing or the
        // confirm of the oldest one before it, whichever is later.
        let oldest = confirms
            .first_waiting()
            .map(|(_, e)| timer.due(e.item.queued_at));
        let sleep = tokio::time::sleep_until(oldest.unwrap_or_else(Instant::now));
        tokio::select! {
            r = rx.recv() => match r {
                None => return,
                Some(Report::Queued { seq, token, event_id, topic, dropped, answer, rejected }) => {
                    let item = Item { seq, token, event_id: event_id.clone(), topic, dropped, rejected, queued_at: Instant::now() };
                    confirms.push(item, event_id, answer);
                }
                Some(Report::Answered(seq, answer)) => {
                    // An answer to the oldest publication waiting: the
                    // broker has reached it (answers to later ones, from
                    // other streams, say nothing of it).
                    if let Some(i) = confirms.find(|item| item.seq.cmp(&seq))
                        && confirms.answer(i, answer)
                    {
                        timer.answered();
                    }
                }
            },
            () = sleep, if oldest.is_some() => {
                confirms.fail_waiting(
                    DeliveryClass::Timeout,
                    &format!("no confirm within {} ms", timeout.as_millis()),
                );
            }
        }
        for (item, outcome) in confirms.ready() {
            let result = match outcome {
                Outcome::Stored => {
                    if item.dropped {
                        duplicates.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(())
                }
                Outcome::Failed(class, reason) => Err(kit::refused(
                    item.event_id,
                    item.topic,
                    class,
                    reason,
                    item.rejected,
                )),
            };
            reports.report(item.token, result);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use tokio::time::Instant;
    use walbox_outbox::{Event, Origin, Position};
    use walbox_pgoutput::Lsn;

    use super::{Answer, Report, report, slot_of};
    use crate::DeliveryClass;

    fn at(lsn: u64, index: u32, xid: u32, origin: Origin) -> Event {
        Event {
            event_id: format!("e-{lsn}-{index}"),
            topic: "s".into(),
            key: Some(Bytes::from_static(b"k")),
            value: Bytes::from_static(b"{}"),
            json_value: true,
            headers: Vec::new(),
            position: Position {
                commit_lsn: Lsn(lsn),
                index,
                xid,
            },
            origin,
        }
    }

    /// A reporter with a `timeout`: its reports, deliveries, channel, task.
    #[allow(clippy::type_complexity)]
    fn reporter(
        timeout: Duration,
    ) -> (
        crate::kit::Reports,
        crate::Deliveries,
        tokio::sync::mpsc::UnboundedSender<Report>,
        tokio::task::JoinHandle<()>,
    ) {
        let (reports, deliveries) = crate::kit::Reports::new();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(report(rx, reports.clone(), Default::default(), timeout));
        (reports, deliveries, tx, task)
    }

    /// Publication `seq` of a session, queued unanswered (token `seq`).
    fn queued(seq: u64) -> Report {
        let event = at(0x1000 + seq * 8, 0, 7, Origin::Stream);
        Report::Queued {
            seq,
            token: seq as usize,
            event_id: event.event_id.clone(),
            topic: "s".into(),
            dropped: false,
            answer: None,
            rejected: crate::kit::rejected(&event),
        }
    }

    /// A broker that confirms one publication per 100 ms works through a
    /// window of 20 under a confirm timeout of 200 ms: none of the first 15
    /// times out, though each waits longer than the timeout in all. The
    /// last 5 are never confirmed: they time out 200 ms after the last
    /// confirm.
    #[tokio::test(start_paused = true)]
    async fn a_broker_slower_than_the_window_but_answering_gets_no_timeout() {
        let (reports, mut deliveries, tx, task) = reporter(Duration::from_millis(200));
        let start = Instant::now();
        let (n, answered) = (20u64, 15u64);
        for seq in 0..n {
            reports.sent();
            tx.send(queued(seq)).unwrap();
        }
        let broker = {
            let tx = tx.clone();
            tokio::spawn(async move {
                for seq in 0..answered {
                    tokio::time::sleep_until(start + Duration::from_millis(100) * (seq as u32 + 1))
                        .await;
                    tx.send(Report::Answered(seq, Answer::Ack)).unwrap();
                }
            })
        };
        let mut got = vec![None; n as usize];
        for _ in 0..n {
            let d = deliveries.recv().await.expect("the reporter is alive");
            got[d.token] = Some(d.result.err().map(|e| e.class));
        }
        let took = start.elapsed();
        assert!(
            got[..answered as usize].iter().all(|o| *o == Some(None)),
            "{got:?}"
        );
        assert!(
            got[answered as usize..]
                .iter()
                .all(|o| *o == Some(Some(DeliveryClass::Timeout))),
            "{got:?}"
        );
        assert!(
            took >= Duration::from_millis(1700) && took < Duration::from_millis(1800),
            "{took:?}"
        );
        broker.await.unwrap();
        drop(tx);
        task.await.unwrap();
    }

    /// The oldest publication is never confirmed (its stream lost its
    /// leader) while a slow source hands over one event every 150 ms to a
    /// healthy stream that confirms each at once. Those confirms say nothing
    /// of the oldest one: it times out 200 ms after its queueing, not when
    /// the window is full.
    #[tokio::test(start_paused = true)]
    async fn confirms_of_later_publications_do_not_hold_back_the_oldest_ones_timeout() {
        let (reports, mut deliveries, tx, task) = reporter(Duration::from_millis(200));
        let start = Instant::now();
        let source = {
            let (tx, reports) = (tx.clone(), reports.clone());
            tokio::spawn(async move {
                for seq in 0..40u64 {
                    reports.sent();
                    let _ = tx.send(queued(seq));
                    if seq > 0 {
                        let _ = tx.send(Report::Answered(seq, Answer::Ack));
                    }
                    tokio::time::sleep(Duration::from_millis(150)).await;
                }
            })
        };
        crate::kit::expect_the_oldest_timed_out(&mut deliveries, start).await;
        source.abort();
        drop(tx);
        task.abort();
    }

    /// Dead letters of non-transactional messages (transaction id 0) go
    /// under the epoch's one name, in WAL order with the commits around
    /// them: a name of their own each would hold a connection per message
    /// and push older names out of the broker's 255 per stream.
    #[test]
    fn message_dead_letters_share_the_epochs_name_and_only_snapshot_rows_get_one_of_their_own() {
        let message = |lsn: u64| slot_of("w", &at(lsn, 0, 0, Origin::Message { replay: None }));
        let before = slot_of("w", &at(0x1000, 0, 7, Origin::Stream));
        let messages: Vec<_> = (1..=300u64).map(|i| message(0x1000 + i * 8)).collect();
        let after = slot_of("w", &at(0x1000 + 301 * 8, 0, 9, Origin::Stream));
        assert!(
            messages.iter().all(|s| s.name == "w.0"),
            "{:?}",
            &messages[..2]
        );
        assert!(before.id < messages[0].id);
        assert!(messages.windows(2).all(|w| w[0].id < w[1].id));
        assert!(messages[299].id < after.id);
        let row = slot_of(
            "w",
            &at(0x1000, 3, 0, Origin::Snapshot { point: Lsn(0x1000) }),
        );
        assert_eq!((row.name.as_str(), row.id), ("w.s1000", 4));
    }

    /// A transaction that commits right after a non-transactional message
    /// can have its commit record start where the message ends: the same
    /// LSN. The message's dead letter and the transaction's first event must
    /// not share a name and id (the second would be refused as taken, and
    /// walbox would stop for good), and must keep their WAL order.
    #[test]
    fn a_message_and_the_commit_right_after_it_at_the_same_lsn_never_share_an_id() {
        let l = 0x2000u64;
        let earlier = slot_of("w", &at(l - 8, (1 << 23) - 1, 5, Origin::Stream));
        let message = slot_of("w", &at(l, 0, 0, Origin::Message { replay: None }));
        let commit = slot_of("w", &at(l, 0, 9, Origin::Stream));
        assert_eq!(message.name, commit.name);
        assert_ne!(message.id, commit.id);
        assert!(earlier.id < message.id && message.id < commit.id);
    }

    /// Copies go under names of their own; a snapshot row's letter, replayed,
    /// keeps the snapshot's naming within its letter's name (as it was
    /// named before origins existed), a message read by a replay the
    /// replay's name.
    #[test]
    fn copies_go_under_names_of_their_own() {
        let replayed = slot_of("w", &at(0x1000, 0, 7, Origin::Replay { from: Lsn(0x800) }));
        assert_eq!(replayed.name, "w.replay.0/800.0");
        let message = slot_of(
            "w",
            &at(
                0x1000,
                0,
                0,
                Origin::Message {
                    replay: Some(Lsn(0x800)),
                },
            ),
        );
        assert_eq!(message.name, "w.replay.0/800.0");
        let letter = |snapshot: Option<Lsn>, xid: u32| {
            slot_of(
                "w",
                &at(
                    0x1000,
                    3,
                    xid,
                    Origin::DeadLetterReplay {
                        letter: "dlq.s.dlq.4".into(),
                        snapshot,
                    },
                ),
            )
        };
        assert_eq!(letter(None, 7).name, "w.replay.dlq.s.dlq.4.0");
        let row = letter(Some(Lsn(0x1000)), 0);
        assert_eq!(
            (row.name.as_str(), row.id),
            ("w.replay.dlq.s.dlq.4.s1000", 4)
        );
    }
}
