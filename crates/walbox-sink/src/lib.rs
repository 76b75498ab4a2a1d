//! Where events go.
//!
//! A [`Sink`] takes [`Event`]s with an opaque token and later reports, once per
//! event, whether it was durably accepted ([`Delivery`]). The relay uses the tokens
//! to move its confirmed WAL position only over acknowledged events. Sinks never
//! buffer without bound: the relay limits what is in flight, and a sink's own queue
//! is sized above that limit.
//!
//! - [`KafkaSink`]: an idempotent rdkafka producer (`acks=all`), keys partitioned
//!   with murmur2 as the Java client does, topics checked or created on first use.
//! - [`NatsSink`]: NATS JetStream, each event with `Nats-Msg-Id` = its event id,
//!   acknowledged on the server's PubAck; the stream checked or created.
//! - [`WebhookSink`]: HTTP POSTs signed as Standard Webhooks say, per-key
//!   order with many keys in flight, retried inside the sink until a 2xx or
//!   the retry ceiling; dead letters in a local file.
//! - [`RedisSink`]: Redis Streams, each event an entry at the id its source
//!   position gives (`<commit LSN>-<index>`), written in batches by a script
//!   that stops at the first entry it cannot write; a resend is checked to be
//!   the entry already there.
//! - [`RabbitMqSink`]: RabbitMQ, to an exchange with publisher confirms and
//!   `mandatory`, or to streams with deduplicating named producers.
//! - [`PubSubSink`]: Google Cloud Pub/Sub over its REST API, the aggregate
//!   key as ordering key, one request in flight per key (a key pauses while a
//!   failed request is sent again), acknowledged on the message ids.
//! - [`StdoutSink`]: JSON lines (topic, key, headers, value), acknowledged once
//!   written and flushed to the pipe or file (not once read); a closed pipe
//!   fails deliveries for good.
//!
//! [`read_topic`] reads back what a topic holds, [`read_subject`] what a
//! JetStream stream holds of a subject, [`read_stream`] what a Redis stream
//! holds, for audits.
//!
//! # Who an event is
//!
//! An [`Event`] carries its id as a field of its own and its origin
//! ([`walbox_outbox::Origin`]: streamed, a snapshot row and which snapshot, a
//! non-transactional message, a replay and from where, a dead-letter replay
//! and which letter). A sink writes the id into an id field of its own and
//! reads it back from there, and names copies from the origin; it never reads
//! either from a transaction id or from the record's headers, where each
//! envelope format puts the id somewhere else. What every sink does the same
//! way (the session's lifecycle, the reports and in-flight count with a flush
//! woken by the last report, a session task that died failing the session,
//! failing the rest of a session after one failure, the rejected record) is
//! written once, in the crate's `kit` module.
//!
//! # Destinations that deduplicate
//!
//! A sink whose destination drops a record it already holds under the same id
//! (JetStream's `Nats-Msg-Id` within the stream's duplicate window) follows
//! these rules, so that a replay is never a silent no-op:
//!
//! 1. Streaming (`walbox run`) and a dead-letter replay publish each event
//!    under an id derived from the event id alone, so a resend after a crash,
//!    or a dead-letter replay run again after a kill, is dropped.
//! 2. A replay of a range (`walbox replay`: events of origin
//!    [`walbox_outbox::Origin::Replay`]) publishes each
//!    event under an id of its own, derived from the event id and the
//!    replay's name (its start position): the destination stores it again,
//!    and drops only what an earlier run of the same replay stored. The
//!    record's own event id (the `event_id` header) never changes.
//! 3. A drop is delivered only once the record the destination holds under
//!    the id is checked to be the same event (subject, key, source position);
//!    another one fails the delivery ([`DeliveryClass::DuplicateId`]).
//! 4. A drop is counted apart ([`Sink::duplicates`]), never as stored: the
//!    replays report it as "already stored".
//! 5. A dropped record is not the destination's last one: records chained on
//!    the last id (JetStream's `Nats-Expected-Last-Msg-Id`) are sent one at a
//!    time until one is stored, the one after a drop unchained (everything
//!    before it is then known to be stored); a refusal after a drop later in
//!    a session ends it, and the next session probes again.
//!
//! Redis Streams deduplicate by entry id rather than by event id: the
//! [`RedisSink`] writes each event at the id its position gives, so rule 1
//! holds through the position; a replay appends after the stream's top and
//! keeps its own progress per stream, counting an event as stored by an
//! earlier run only when the stream holds that run's copy of it (rule 2); a
//! refused id counts as a
//! duplicate only once the entry there holds the event id and key (rules 3
//! and 4);
//! batches are written by a script that stops at the first refusal, so
//! nothing is stored after a gap (rule 5's aim).

mod aws;
mod batched;
mod crypto;
mod delivery;
mod kafka;
mod kit;
mod lanes;
mod nats;
mod nats_reader;
pub mod probe;
mod pubsub;
mod rabbitmq;
mod reader;
mod redis_streams;
mod secrets;
mod stdout;
mod webhook;

use tokio::sync::mpsc;
use walbox_outbox::Event;

pub use aws::AwsConnection;
pub use aws::kinesis::{KinesisSink, KinesisSinkConfig};
pub use aws::kinesis_read::{KinesisLetters, read_kinesis_stream};
pub use aws::sns::{SnsSink, SnsSinkConfig};
pub use aws::sqs::{SqsSink, SqsSinkConfig};
pub use aws::sqs_read::{SqsLetters, drain_sqs_queue};
pub use crypto::install_crypto_provider;
pub use delivery::{Delivery, DeliveryClass, DeliveryError, RejectedRecord};
pub use kafka::{KafkaSink, KafkaSinkConfig};
pub use kit::retries_by_topic;
pub use nats::{
    DROPPED_HEADERS_HEADER, KEY_ENCODING_HEADER, KEY_HEADER, NatsSink, NatsSinkConfig, NatsStorage,
};
pub use nats_reader::{DurableLetters, read_subject};
pub use pubsub::{
    DROPPED_HEADERS_ATTRIBUTE as PUBSUB_DROPPED_HEADERS_ATTRIBUTE, EMULATOR_HOST_ENV, PubSubSink,
    PubSubSinkConfig, SubscriptionLetters, create_subscription, describe as describe_pubsub,
    read_subscription,
};
pub use rabbitmq::{
    PASSWORD_ENV as RABBITMQ_PASSWORD_ENV, QueueLetters, RabbitMqMode, RabbitMqSink,
    RabbitMqSinkConfig, StreamLetters as RabbitStreamLetters, USER_ENV as RABBITMQ_USER_ENV,
    read_queue, read_stream as read_rabbit_stream,
};
pub use reader::{OwnedRecord, RecordView, commit_group, read_topic, read_topic_from_group};
pub use redis_streams::{
    Durability, RedisSink, RedisSinkConfig, StreamEntry, StreamLetters, entry_id, event_entry_id,
    position_of, read_stream, server_durability, shown_url,
};
pub use secrets::{Hidden, Redacted, is_secret_property};
pub use stdout::StdoutSink;
pub use webhook::{
    DROPPED_HEADERS_HEADER as WEBHOOK_DROPPED_HEADERS_HEADER, DeadLetterFile,
    KEY_ENCODING_HEADER as WEBHOOK_KEY_ENCODING_HEADER, KEY_HEADER as WEBHOOK_KEY_HEADER,
    LetterLine, ReplayStart, WebhookSink, WebhookSinkConfig, read_letters, replayed_path,
};

/// Receives one [`Delivery`] per event sent.
pub type Deliveries = mpsc::UnboundedReceiver<Delivery>;

/// A failure of the sink itself, not of one event.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SinkError {
    /// A topic does not exist and may not be created.
    #[error("topic {0:?} does not exist (set create_topics = true to create it)")]
    MissingTopic(String),
    /// Creating a topic failed.
    #[error("creating topic {topic:?}: {reason}")]
    CreateTopic {
        /// The topic.
        topic: String,
        /// Why.
        reason: String,
    },
    /// The producer or admin client could not be set up or reached.
    #[error("kafka: {0}")]
    Kafka(rdkafka::error::KafkaError),
    /// The broker refused the client's credentials. Trying again would only
    /// repeat it.
    #[error(
        "kafka: authentication failed for user {user:?} with {mechanism}: {reason}; check \
         sasl.username, sasl.password and sasl.mechanism in [sink.kafka] (and that the \
         user exists on the broker)"
    )]
    Authentication {
        /// `sasl.username`, or `(none)`.
        user: String,
        /// `sasl.mechanism`, or `(none)`.
        mechanism: String,
        /// What the client reported (it never holds the password).
        reason: String,
    },
    /// An AWS service could not be reached, or answered with an error that
    /// may pass (throttling, an internal error); a new session may succeed.
    #[error("aws: {0}")]
    Aws(String),
    /// An AWS service refused what walbox asked (access denied, a
    /// parameter it does not take); trying again would only repeat it.
    #[error("aws: {0}")]
    AwsRefused(String),
    /// An AWS service refused walbox's credentials. Trying again would only
    /// repeat it.
    #[error(
        "aws: {service} refused walbox's credentials: {reason}; check the credentials the \
         standard chain finds (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, web \
         identity, instance metadata) and the region"
    )]
    AwsAuthentication {
        /// The service.
        service: String,
        /// What it said (never a secret).
        reason: String,
    },
    /// The NATS server could not be reached or did not answer; a new session
    /// may succeed.
    #[error("nats: {0}")]
    Nats(String),
    /// The NATS server refused the credentials. Trying again would only
    /// repeat it.
    #[error(
        "nats: the server refused walbox's credentials ({who}): {reason}; check user, \
         password, token, nkey_seed or creds_file in [sink.nats]"
    )]
    NatsAuthentication {
        /// Which credentials (never their secret part).
        who: String,
        /// What the server said.
        reason: String,
    },
    /// The Redis server could not be reached or did not answer; a new
    /// session may succeed.
    #[error("redis: {0}")]
    Redis(String),
    /// The Redis server refused the credentials. Trying again would only
    /// repeat it.
    #[error(
        "redis: the server refused walbox's credentials (user {user:?}): {reason}; check the \
         URL, username and password in [sink.redis] (or WALBOX_REDIS_PASSWORD)"
    )]
    RedisAuthentication {
        /// The ACL user (never the password).
        user: String,
        /// What the server said.
        reason: String,
    },
    /// No JetStream stream holds a subject walbox publishes to.
    #[error(
        "no JetStream stream holds subject {subject:?}: add it to the subjects of stream \
         {stream:?} (nats stream edit), or set create_stream = true in [sink.nats] with \
         subjects covering it"
    )]
    MissingStream {
        /// The subject (or the configured subjects).
        subject: String,
        /// The configured stream.
        stream: String,
    },
    /// The RabbitMQ broker could not be reached or did not answer; a new
    /// session may succeed.
    #[error("rabbitmq: {0}")]
    RabbitMq(String),
    /// The RabbitMQ broker refused walbox's credentials. Trying again would
    /// only repeat it.
    #[error(
        "rabbitmq: the broker refused walbox's credentials (user {user:?}): {reason}; check \
         user and password in [sink.rabbitmq] (or WALBOX_RABBITMQ_USER and \
         WALBOX_RABBITMQ_PASSWORD), and the user's permissions on the virtual host"
    )]
    RabbitMqAuthentication {
        /// The user name.
        user: String,
        /// What the broker said.
        reason: String,
    },
    /// The exchange does not exist and may not be declared.
    #[error(
        "rabbitmq: exchange {0:?} does not exist (declare it, or set declare = true in \
         [sink.rabbitmq])"
    )]
    MissingExchange(String),
    /// A RabbitMQ stream does not exist and may not be declared.
    #[error(
        "rabbitmq: stream {0:?} does not exist (declare it, or set declare = true in \
         [sink.rabbitmq])"
    )]
    MissingRabbitStream(String),
    /// A task of the sink's session (a writer, a confirm reporter) died: the
    /// session ends, and the next one sends again whatever was not
    /// acknowledged.
    #[error("{0}; the session ends, and the next one sends again what was not acknowledged")]
    TaskDied(String),
    /// Pub/Sub could not be reached or did not answer; a new session may
    /// succeed.
    #[error("pubsub: {0}")]
    PubSub(String),
    /// Pub/Sub refused a request for good (not for one event): permissions,
    /// a project that does not exist. Trying again would only repeat it.
    #[error("pubsub: {0}")]
    PubSubRefused(String),
    /// No credentials for Pub/Sub, or Pub/Sub refused them. Trying again
    /// would only repeat it.
    #[error(
        "pubsub: no usable credentials: {0}; walbox uses Application Default Credentials \
         (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login, or the \
         metadata server), or none with PUBSUB_EMULATOR_HOST"
    )]
    PubSubAuthentication(String),
    /// A dead-letter topic has no subscription to keep its letters.
    #[error(
        "pubsub: dead-letter topic {topic:?} has no subscription {subscription:?}, so letters \
         published there would be kept nowhere; create it (gcloud pubsub subscriptions create \
         {subscription} --topic {topic} --expiration-period never), or set create_topics = true"
    )]
    PubSubMissingSubscription {
        /// The dead-letter topic.
        topic: String,
        /// The subscription walbox expects (`letters_subscription`).
        subscription: String,
    },
    /// Writing to standard output failed.
    #[error("writing to stdout: {0}")]
    Io(#[from] std::io::Error),
    /// A configuration value is wrong.
    #[error("sink configuration: {0}")]
    Config(String),
    /// Reading a topic back failed.
    #[error("reading topic {topic:?}: {reason}")]
    Read {
        /// The topic.
        topic: String,
        /// Why.
        reason: String,
    },
}

impl From<rdkafka::error::KafkaError> for SinkError {
    fn from(e: rdkafka::error::KafkaError) -> Self {
        match e {
            rdkafka::error::KafkaError::ClientConfig(_, desc, key, value) => {
                SinkError::Config(secrets::config_error(&desc, &key, &value))
            }
            other => SinkError::Kafka(other),
        }
    }
}

/// A destination for events.
#[allow(async_fn_in_trait)] // used with concrete types only
pub trait Sink {
    /// Hands `event` to the sink. Returns once the sink has taken it; the outcome
    /// arrives later as a [`Delivery`] carrying `token`.
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError>;

    /// The caller has sent everything it has for now and is about to wait for
    /// deliveries: a sink that gathers events to hand them on in batches hands
    /// on what it holds. Called before every wait, so nothing sent is held back.
    fn end_batch(&mut self) {}

    /// A delivery failed: nothing more of this session may reach the
    /// destination, so that no later event of a partition lands after an earlier
    /// one that failed. Events still queued are dropped (their reports may come
    /// as failures or not at all); the session ends after this.
    fn abort(&mut self) {}

    /// Waits up to `timeout` for everything sent to be delivered or failed.
    async fn flush(&mut self, timeout: std::time::Duration) -> Result<(), SinkError>;

    /// How many of the deliveries reported so far were records the
    /// destination dropped as duplicates of a copy it already held (checked
    /// to be the same event): acknowledged, not stored again. 0 for a
    /// destination that does not deduplicate.
    fn duplicates(&self) -> u64 {
        0
    }
}

/// The version of the librdkafka walbox runs with (`2.10.0`).
#[must_use]
pub fn librdkafka_version() -> String {
    rdkafka::util::get_rdkafka_version().1
}
