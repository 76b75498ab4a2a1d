//! Reading back what a topic holds, for audits (`walbox verify`): every
//! partition from its start to its end, without a consumer group's offsets.
//! [`RecordView`] is also what the JetStream reader hands over.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};

use crate::SinkError;
use crate::secrets::{AuthFailure, authentication_error};

/// One record as a reader hands it over: a Kafka record, or a JetStream
/// message (partition 0, its stream sequence as offset, its key from the
/// `walbox_key` header, decoded when `walbox_key_encoding` says base64), or
/// a Redis stream entry (partition 0, its place in the stream as offset).
#[derive(Debug)]
pub struct RecordView<'a> {
    inner: Inner<'a>,
}

#[derive(Debug)]
enum Inner<'a> {
    Kafka(&'a BorrowedMessage<'a>),
    Nats {
        msg: &'a async_nats::Message,
        sequence: u64,
        /// The key, decoded when it came in base64.
        key: Option<Vec<u8>>,
    },
    /// A line of the webhook sink's dead-letter file (partition 0, its line
    /// number as offset).
    Letter {
        line: &'a crate::LetterLine,
        number: u64,
        key: Option<Vec<u8>>,
    },
    Redis(&'a crate::redis_streams::StreamEntry),
    /// A record read whole into memory (a RabbitMQ message).
    Owned(&'a OwnedRecord),
}

/// A record a reader holds whole (RabbitMQ): partition 0, its place in the
/// queue or stream as offset, its key from the `walbox_key` header.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnedRecord {
    /// Its partition (a Kinesis stream's shard, in the order the stream
    /// lists them); 0 for a RabbitMQ queue or stream and a Pub/Sub
    /// subscription.
    pub partition: i32,
    /// Its place in the queue (from 0) or its stream offset.
    pub offset: i64,
    /// Its key.
    pub key: Option<Vec<u8>>,
    /// Its value.
    pub value: Vec<u8>,
    /// Its headers, as text where they are.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Its AMQP `message-id`: the event id walbox wrote there.
    pub message_id: Option<String>,
}

impl<'a> RecordView<'a> {
    pub(crate) fn nats(msg: &'a async_nats::Message, sequence: u64) -> Self {
        let header = |name: &str| {
            msg.headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str())
        };
        let key = header(crate::KEY_HEADER).map(|k| match header(crate::KEY_ENCODING_HEADER) {
            Some("base64") => crate::nats::base64_decode(k).unwrap_or_else(|| k.into()),
            _ => k.as_bytes().to_vec(),
        });
        RecordView {
            inner: Inner::Nats { msg, sequence, key },
        }
    }

    /// A line of the webhook sink's dead-letter file, numbered `number`.
    #[must_use]
    pub fn letter(line: &'a crate::LetterLine, number: u64) -> Self {
        RecordView {
            inner: Inner::Letter {
                line,
                number,
                key: line.key_bytes(),
            },
        }
    }

    pub(crate) fn redis(entry: &'a crate::redis_streams::StreamEntry) -> Self {
        RecordView {
            inner: Inner::Redis(entry),
        }
    }

    pub(crate) fn owned(record: &'a OwnedRecord) -> Self {
        RecordView {
            inner: Inner::Owned(record),
        }
    }

    /// Partition (0 for a JetStream message).
    #[must_use]
    pub fn partition(&self) -> i32 {
        match &self.inner {
            Inner::Kafka(m) => m.partition(),
            Inner::Owned(r) => r.partition,
            Inner::Nats { .. } | Inner::Letter { .. } | Inner::Redis(_) => 0,
        }
    }

    /// Offset (a JetStream message's stream sequence).
    #[must_use]
    pub fn offset(&self) -> i64 {
        match &self.inner {
            Inner::Kafka(m) => m.offset(),
            Inner::Nats { sequence, .. } => i64::try_from(*sequence).unwrap_or(i64::MAX),
            Inner::Letter { number, .. } => i64::try_from(*number).unwrap_or(i64::MAX),
            Inner::Redis(e) => e.offset,
            Inner::Owned(r) => r.offset,
        }
    }

    /// Key bytes.
    #[must_use]
    pub fn key(&self) -> Option<&[u8]> {
        match &self.inner {
            Inner::Kafka(m) => m.key(),
            Inner::Nats { key, .. } | Inner::Letter { key, .. } => key.as_deref(),
            Inner::Redis(e) => e.field(crate::redis_streams::entry::KEY_FIELD),
            Inner::Owned(r) => r.key.as_deref(),
        }
    }

    /// Value bytes.
    #[must_use]
    pub fn value(&self) -> Option<&[u8]> {
        match &self.inner {
            Inner::Kafka(m) => m.payload(),
            Inner::Nats { msg, .. } => Some(msg.payload.as_ref()),
            Inner::Letter { line, .. } => Some(line.value.as_bytes()),
            Inner::Redis(e) => e.field(crate::redis_streams::entry::VALUE_FIELD),
            Inner::Owned(r) => Some(&r.value),
        }
    }

    /// The event id the record carries: from the sink's own id field where
    /// the sink writes one (a Redis entry's `event_id` field, a RabbitMQ
    /// message's `message-id`), else where the record's format puts it
    /// ([`walbox_outbox::record_event_id`]: a header or a structured
    /// CloudEvent's body).
    #[must_use]
    pub fn event_id(&self) -> Option<String> {
        let own = match &self.inner {
            Inner::Redis(e) => e
                .field(crate::redis_streams::entry::EVENT_ID_FIELD)
                .and_then(|v| std::str::from_utf8(v).ok())
                .map(str::to_owned),
            Inner::Owned(r) => r.message_id.clone(),
            Inner::Kafka(_) | Inner::Nats { .. } | Inner::Letter { .. } => None,
        };
        own.or_else(|| walbox_outbox::record_event_id(|n| self.header(n), self.value()))
    }

    /// The first header called `name`, as UTF-8 text.
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&str> {
        match &self.inner {
            Inner::Kafka(m) => m
                .headers()?
                .iter()
                .find(|h| h.key == name)
                .and_then(|h| h.value)
                .and_then(|v| std::str::from_utf8(v).ok()),
            Inner::Nats { msg, .. } => msg.headers.as_ref()?.get(name).map(|v| v.as_str()),
            Inner::Letter { line, .. } => line.header(name),
            Inner::Redis(e) => e
                .field(&format!(
                    "{}{name}",
                    crate::redis_streams::entry::HEADER_PREFIX
                ))
                .and_then(|v| std::str::from_utf8(v).ok()),
            Inner::Owned(r) => r
                .headers
                .iter()
                .find(|(k, _)| k == name)
                .and_then(|(_, v)| std::str::from_utf8(v).ok()),
        }
    }
}

/// Reads `topic` from the start of each partition until every partition is at
/// its end, calling `each` for every record; returns how many were read.
/// `properties` are librdkafka properties (`bootstrap.servers`, security).
pub fn read_topic(
    properties: &[(String, String)],
    topic: &str,
    timeout: Duration,
    each: impl FnMut(RecordView<'_>),
) -> Result<u64, SinkError> {
    read(properties, topic, None, timeout, each)
}

/// Reads `topic` like [`read_topic`], but from where consumer group `group`
/// committed (the start where it has not); returns how many records were read.
/// [`commit_group`] records progress.
pub fn read_topic_from_group(
    properties: &[(String, String)],
    topic: &str,
    group: &str,
    timeout: Duration,
    each: impl FnMut(RecordView<'_>),
) -> Result<u64, SinkError> {
    read(properties, topic, Some(group), timeout, each)
}

/// Commits, for consumer group `group`, that records of `topic` before
/// `next[partition]` are done.
pub fn commit_group(
    properties: &[(String, String)],
    topic: &str,
    group: &str,
    next: &[(i32, i64)],
) -> Result<(), SinkError> {
    if next.is_empty() {
        return Ok(());
    }
    let auth = AuthFailure::default();
    let consumer = consumer(properties, group, auth.clone())?;
    let mut offsets = TopicPartitionList::new();
    for (p, o) in next {
        offsets.add_partition_offset(topic, *p, Offset::Offset(*o))?;
    }
    consumer
        .commit(&offsets, rdkafka::consumer::CommitMode::Sync)
        .map_err(|e| {
            auth.get().map_or_else(
                || e.into(),
                |reason| authentication_error(properties, reason),
            )
        })
}

/// The reader's client context: librdkafka reports the end of a partition as an
/// error event, and rdkafka's default context logs every such event as an
/// error. For the reader it is the normal end of a partition (the poll loop
/// receives it as [`KafkaError::PartitionEOF`]); refused credentials are
/// recorded, so that the read stops with them instead of waiting out its
/// timeout; anything else is logged.
struct ReaderContext {
    auth: AuthFailure,
}

impl ClientContext for ReaderContext {
    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(error, KafkaError::PartitionEOF(_))
            || error.rdkafka_error_code() == Some(RDKafkaErrorCode::PartitionEOF)
        {
            return;
        }
        if self.auth.observe(&error, reason) {
            tracing::error!(%error, reason, "kafka: the broker refused the reader's credentials");
            return;
        }
        tracing::error!(%error, reason, "kafka client error while reading a topic");
    }
}

impl ConsumerContext for ReaderContext {}

fn consumer(
    properties: &[(String, String)],
    group: &str,
    auth: AuthFailure,
) -> Result<BaseConsumer<ReaderContext>, SinkError> {
    let mut config = ClientConfig::new();
    for (k, v) in properties {
        // Producer-only settings do not apply to a reader.
        if !is_producer_property(k) {
            config.set(k, v);
        }
    }
    Ok(config
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "true")
        .set("log_level", "3")
        .create_with_context(ReaderContext { auth })?)
}

/// How long one metadata request of the reader may take.
const METADATA_TURN: Duration = Duration::from_secs(1);

fn read(
    properties: &[(String, String)],
    topic: &str,
    group: Option<&str>,
    timeout: Duration,
    mut each: impl FnMut(RecordView<'_>),
) -> Result<u64, SinkError> {
    let own_group = format!("walbox-reader-{}", std::process::id());
    let auth = AuthFailure::default();
    let consumer = consumer(properties, group.unwrap_or(&own_group), auth.clone())?;
    // Refused credentials, once the client reported them, explain any failure.
    let refused = || {
        auth.get()
            .map(|reason| authentication_error(properties, reason))
    };
    // Asked in short turns with the client's events served between them: a
    // refused login reaches the context only through a poll.
    let asked = Instant::now();
    let md = loop {
        match consumer.fetch_metadata(Some(topic), METADATA_TURN) {
            Ok(md) => break md,
            Err(e) => {
                // Serves queued events (errors) only: nothing is assigned yet.
                if let Some(Err(polled)) = consumer.poll(Duration::ZERO) {
                    tracing::debug!(error = %polled, "while asking for metadata");
                }
                if let Some(refused) = refused() {
                    return Err(refused);
                }
                if asked.elapsed() >= timeout {
                    return Err(e.into());
                }
            }
        }
    };
    let t = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .ok_or_else(|| SinkError::Read {
            topic: topic.to_owned(),
            reason: "not in the broker's metadata".into(),
        })?;
    if let Some(e) = t.error() {
        return Err(SinkError::Read {
            topic: topic.to_owned(),
            reason: format!("{:?}", rdkafka::types::RDKafkaErrorCode::from(e)),
        });
    }
    // Every partition from its start until the broker says it is at its end
    // (partition EOF). Watermarks are not used: some Kafka-protocol brokers
    // report them loosely.
    let partitions: Vec<i32> = t.partitions().iter().map(|p| p.id()).collect();
    let mut assignment = TopicPartitionList::new();
    let start = if group.is_some() {
        Offset::Stored
    } else {
        Offset::Beginning
    };
    for p in &partitions {
        assignment.add_partition_offset(topic, *p, start)?;
    }
    consumer.assign(&assignment)?;
    let mut at_end: HashSet<i32> = HashSet::new();
    let mut read = 0u64;
    let mut last_progress = Instant::now();
    while at_end.len() < partitions.len() {
        match consumer.poll(Duration::from_millis(200)) {
            None => {
                if let Some(e) = refused() {
                    return Err(e);
                }
                if last_progress.elapsed() > timeout {
                    return Err(SinkError::Read {
                        topic: topic.to_owned(),
                        reason: format!(
                            "nothing for {} s with {} of {} partitions read to their end",
                            timeout.as_secs(),
                            at_end.len(),
                            partitions.len()
                        ),
                    });
                }
            }
            Some(Ok(m)) => {
                last_progress = Instant::now();
                at_end.remove(&m.partition());
                read += 1;
                each(RecordView {
                    inner: Inner::Kafka(&m),
                });
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                last_progress = Instant::now();
                at_end.insert(p);
            }
            Some(Err(e)) => return Err(refused().unwrap_or_else(|| e.into())),
        }
    }
    Ok(read)
}

fn is_producer_property(key: &str) -> bool {
    matches!(
        key,
        "enable.idempotence"
            | "acks"
            | "request.required.acks"
            | "linger.ms"
            | "queue.buffering.max.ms"
            | "queue.buffering.max.messages"
            | "queue.buffering.max.kbytes"
            | "batch.num.messages"
            | "batch.size"
            | "compression.type"
            | "compression.codec"
            | "compression.level"
            | "message.timeout.ms"
            | "delivery.timeout.ms"
            | "retries"
            | "message.send.max.retries"
            | "max.in.flight"
            | "max.in.flight.requests.per.connection"
            | "partitioner"
            | "transactional.id"
            | "transaction.timeout.ms"
    )
}
