//! The `[sink]` table: which destination, the in-flight bounds, and each
//! sink's own settings, completed with what they take from the rest of the
//! configuration (the slot, the bound, credentials from the environment).

use std::collections::BTreeMap;

use anyhow::{Result, bail};
use serde::Deserialize;

/// Sink kinds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SinkKind {
    /// Kafka (or any Kafka-protocol broker).
    #[default]
    Kafka,
    /// JSON lines on standard output.
    Stdout,
    /// NATS JetStream (`[sink.nats]`).
    Nats,
    /// HTTP webhooks (`[sink.webhook]`).
    Webhook,
    /// Redis Streams (`[sink.redis]`).
    Redis,
    /// RabbitMQ, to an exchange or to streams (`[sink.rabbitmq]`).
    #[value(name = "rabbitmq")]
    #[serde(rename = "rabbitmq")]
    RabbitMq,
    /// Google Cloud Pub/Sub (`[sink.pubsub]`).
    #[value(name = "pubsub")]
    #[serde(rename = "pubsub")]
    PubSub,
    /// Amazon Kinesis Data Streams (`[sink.kinesis]`).
    Kinesis,
    /// Amazon SQS, FIFO queues by default (`[sink.sqs]`).
    Sqs,
    /// Amazon SNS, FIFO topics by default (`[sink.sns]`).
    Sns,
}

impl SinkKind {
    /// Every sink type the configuration accepts (`[sink] type`, `--sink`).
    #[must_use]
    pub fn all() -> &'static [SinkKind] {
        <SinkKind as clap::ValueEnum>::value_variants()
    }

    /// The name `type` takes (`kafka`, `rabbitmq`, ...).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            SinkKind::Kafka => "kafka",
            SinkKind::Stdout => "stdout",
            SinkKind::Nats => "nats",
            SinkKind::Webhook => "webhook",
            SinkKind::Redis => "redis",
            SinkKind::RabbitMq => "rabbitmq",
            SinkKind::Kinesis => "kinesis",
            SinkKind::Sqs => "sqs",
            SinkKind::Sns => "sns",
            SinkKind::PubSub => "pubsub",
        }
    }

    /// The destination in words, as help texts and `walbox init` name it.
    #[must_use]
    pub fn destination(self) -> &'static str {
        match self {
            SinkKind::Kafka => "Kafka",
            SinkKind::Stdout => "standard output (stdout)",
            SinkKind::Nats => "NATS JetStream",
            SinkKind::Webhook => "HTTP webhooks",
            SinkKind::Redis => "Redis Streams",
            SinkKind::RabbitMq => "RabbitMQ (an exchange or streams)",
            SinkKind::Kinesis => "Amazon Kinesis Data Streams",
            SinkKind::Sqs => "Amazon SQS (FIFO queues)",
            SinkKind::Sns => "Amazon SNS (FIFO topics)",
            SinkKind::PubSub => "Google Cloud Pub/Sub (pubsub)",
        }
    }

    /// What the topic template names at this destination.
    #[must_use]
    pub fn topic_names(self) -> &'static str {
        match self {
            SinkKind::Kafka => "the Kafka topic",
            SinkKind::Stdout => "the line's topic field",
            SinkKind::Nats => "the NATS subject",
            SinkKind::Webhook => "the webhook URL's {topic}",
            SinkKind::Redis => "the Redis stream key",
            SinkKind::RabbitMq => {
                "the RabbitMQ routing key (exchange mode) or stream (stream mode)"
            }
            SinkKind::Kinesis => "the Kinesis stream",
            SinkKind::Sqs => {
                "the SQS queue (each character but A-Z a-z 0-9 _ - made -, and .fifo added)"
            }
            SinkKind::PubSub => "the Pub/Sub topic",
            SinkKind::Sns => {
                "the SNS topic (each character but A-Z a-z 0-9 _ - made -, and .fifo added)"
            }
        }
    }

    /// The protocol whose CloudEvents binding this sink's records follow (the
    /// stdout sink prints records as Kafka carries them). A new sink names its
    /// protocol here; [`walbox_outbox::Protocol::cloudevents`] says the rest.
    #[must_use]
    pub fn protocol(self) -> walbox_outbox::Protocol {
        match self {
            // A stream entry's fields carry headers as Kafka's do (unencoded).
            // A Kinesis record's JSON object carries headers as text, as
            // Kafka's do.
            SinkKind::Kafka | SinkKind::Stdout | SinkKind::Redis | SinkKind::Kinesis => {
                walbox_outbox::Protocol::Kafka
            }
            SinkKind::Nats => walbox_outbox::Protocol::Nats,
            // Message attributes carry headers as text, as Kafka's do.
            SinkKind::Sqs | SinkKind::Sns => walbox_outbox::Protocol::Kafka,
            SinkKind::Webhook => walbox_outbox::Protocol::Http,
            SinkKind::RabbitMq => walbox_outbox::Protocol::Amqp,
            SinkKind::PubSub => walbox_outbox::Protocol::PubSub,
        }
    }
}

/// The destination. Its `Debug` form hides secret Kafka properties.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkConfig {
    /// `kafka`, `nats`, `rabbitmq`, `redis`, `pubsub`, `webhook`, `kinesis`, `sqs`
    /// or `stdout`.
    #[serde(rename = "type", default)]
    pub kind: SinkKind,
    /// Create missing topics instead of stopping.
    #[serde(default)]
    pub create_topics: bool,
    /// Partitions of created topics.
    #[serde(default = "default_partitions")]
    pub topic_partitions: i32,
    /// Replication factor of created topics.
    #[serde(default = "default_replication")]
    pub topic_replication: i32,
    /// Most events in flight (sent, not yet acknowledged) before WAL reading
    /// pauses; unset, the sink's default ([`SinkConfig::max_in_flight`]).
    #[serde(default)]
    pub max_in_flight: Option<usize>,
    /// Most bytes in flight before WAL reading pauses.
    #[serde(default = "default_max_in_flight_bytes")]
    pub max_in_flight_bytes: usize,
    /// librdkafka properties, passed through (`"bootstrap.servers" = "..."`).
    #[serde(default)]
    pub kafka: BTreeMap<String, toml::Value>,
    /// The NATS JetStream sink's settings (`type = "nats"`).
    #[serde(default)]
    pub nats: walbox_sink::NatsSinkConfig,
    /// The webhook sink's settings (`type = "webhook"`).
    #[serde(default)]
    pub webhook: walbox_sink::WebhookSinkConfig,
    /// The Redis Streams sink's settings (`type = "redis"`).
    #[serde(default)]
    pub redis: walbox_sink::RedisSinkConfig,
    /// The RabbitMQ sink's settings (`type = "rabbitmq"`).
    #[serde(default)]
    pub rabbitmq: walbox_sink::RabbitMqSinkConfig,
    /// The Google Cloud Pub/Sub sink's settings (`type = "pubsub"`).
    #[serde(default)]
    pub pubsub: walbox_sink::PubSubSinkConfig,
    /// The Kinesis sink's settings (`type = "kinesis"`).
    #[serde(default)]
    pub kinesis: walbox_sink::KinesisSinkConfig,
    /// The SQS sink's settings (`type = "sqs"`).
    #[serde(default)]
    pub sqs: walbox_sink::SqsSinkConfig,
    /// The SNS sink's settings (`type = "sns"`).
    #[serde(default)]
    pub sns: walbox_sink::SnsSinkConfig,
}

fn default_partitions() -> i32 {
    6
}
fn default_replication() -> i32 {
    1
}
/// The in-flight bound of every sink that sets none of its own.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 10_000;
/// RabbitMQ exchange mode's: each publication awaiting its confirm holds
/// about 5 KB, and one node confirms as fast with 1,000 in flight as with
/// 10,000 (docs/benchmarks.md), so a larger window would only hold memory.
/// (Pub/Sub holds as much per event, but its rate falls with a smaller
/// window, so it keeps the common default.)
pub const EXCHANGE_MAX_IN_FLIGHT: usize = 2_000;
fn default_max_in_flight_bytes() -> usize {
    64 * 1024 * 1024
}

impl Default for SinkConfig {
    fn default() -> Self {
        SinkConfig {
            kind: SinkKind::default(),
            create_topics: false,
            topic_partitions: default_partitions(),
            topic_replication: default_replication(),
            max_in_flight: None,
            max_in_flight_bytes: default_max_in_flight_bytes(),
            kafka: BTreeMap::new(),
            nats: walbox_sink::NatsSinkConfig::default(),
            webhook: walbox_sink::WebhookSinkConfig::default(),
            redis: walbox_sink::RedisSinkConfig::default(),
            rabbitmq: walbox_sink::RabbitMqSinkConfig::default(),
            pubsub: walbox_sink::PubSubSinkConfig::default(),
            kinesis: walbox_sink::KinesisSinkConfig::default(),
            sqs: walbox_sink::SqsSinkConfig::default(),
            sns: walbox_sink::SnsSinkConfig::default(),
        }
    }
}

impl std::fmt::Debug for SinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kafka: BTreeMap<&str, &dyn std::fmt::Debug> = self
            .kafka
            .iter()
            .map(|(k, v)| {
                let shown: &dyn std::fmt::Debug = if walbox_sink::is_secret_property(k) {
                    &walbox_sink::Hidden
                } else {
                    v
                };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("SinkConfig")
            .field("kind", &self.kind)
            .field("create_topics", &self.create_topics)
            .field("topic_partitions", &self.topic_partitions)
            .field("topic_replication", &self.topic_replication)
            .field("max_in_flight", &self.max_in_flight())
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .field("kafka", &kafka)
            .field("nats", &self.nats)
            .field("webhook", &self.webhook)
            .field("redis", &self.redis)
            .field("rabbitmq", &self.rabbitmq)
            .field("pubsub", &self.pubsub)
            .field("kinesis", &self.kinesis)
            .field("sqs", &self.sqs)
            .field("sns", &self.sns)
            .finish()
    }
}

impl SinkConfig {
    /// The librdkafka properties as strings; tables and arrays are refused.
    pub fn kafka_properties(&self) -> Result<Vec<(String, String)>> {
        self.kafka
            .iter()
            .map(|(k, v)| {
                let s = match v {
                    toml::Value::String(s) => s.clone(),
                    toml::Value::Integer(i) => i.to_string(),
                    toml::Value::Float(f) => f.to_string(),
                    toml::Value::Boolean(b) => b.to_string(),
                    _ => bail!("sink.kafka.{k}: must be a string, number or boolean"),
                };
                Ok((k.clone(), s))
            })
            .collect()
    }

    /// The in-flight bound: `max_in_flight` when set, else the sink's
    /// default (2,000 for RabbitMQ exchange mode, 10,000 for the others).
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight.unwrap_or(
            if self.kind == SinkKind::RabbitMq
                && self.rabbitmq.mode == walbox_sink::RabbitMqMode::Exchange
            {
                EXCHANGE_MAX_IN_FLIGHT
            } else {
                DEFAULT_MAX_IN_FLIGHT
            },
        )
    }

    /// The Kafka sink's settings: the librdkafka properties, topic creation and
    /// the in-flight bound. Every command that produces to Kafka builds them here.
    pub fn kafka_sink(&self) -> Result<walbox_sink::KafkaSinkConfig> {
        Ok(walbox_sink::KafkaSinkConfig {
            properties: self.kafka_properties()?,
            create_topics: self.create_topics,
            topic_partitions: self.topic_partitions,
            topic_replication: self.topic_replication,
            max_in_flight: self.max_in_flight(),
        })
    }

    /// The NATS sink's settings, with the in-flight bound.
    pub fn nats_sink(&self) -> Result<walbox_sink::NatsSinkConfig> {
        let mut c = self.nats.clone();
        c.max_in_flight = self.max_in_flight();
        c.validate()?;
        Ok(c)
    }

    /// The Redis sink's settings, with the in-flight bound, the writer name
    /// (default: the slot) and the password from `WALBOX_REDIS_PASSWORD`
    /// when the file gives none.
    pub fn redis_sink(&self, slot: &str) -> Result<walbox_sink::RedisSinkConfig> {
        let mut c = self.redis.clone();
        c.max_in_flight = self.max_in_flight();
        if c.writer.is_none() {
            c.writer = Some(slot.to_owned());
        }
        if c.password.is_none()
            && let Ok(p) = std::env::var("WALBOX_REDIS_PASSWORD")
            && !p.is_empty()
        {
            c.password = Some(p);
        }
        c.validate()?;
        Ok(c)
    }

    /// The Kinesis sink's settings, with stream creation from
    /// `create_topics` and `topic_partitions` (shards).
    pub fn kinesis_sink(&self) -> Result<walbox_sink::KinesisSinkConfig> {
        let mut c = self.kinesis.clone();
        c.create_streams = self.create_topics;
        c.shards = self.topic_partitions;
        c.validate()?;
        Ok(c)
    }

    /// The SQS sink's settings, with queue creation from `create_topics`.
    pub fn sqs_sink(&self) -> Result<walbox_sink::SqsSinkConfig> {
        let mut c = self.sqs.clone();
        c.create_queues = self.create_topics;
        c.validate()?;
        Ok(c)
    }

    /// The SNS sink's settings, with topic creation from `create_topics`.
    pub fn sns_sink(&self) -> Result<walbox_sink::SnsSinkConfig> {
        let mut c = self.sns.clone();
        c.create_topics = self.create_topics;
        c.validate()?;
        Ok(c)
    }

    /// The RabbitMQ sink's settings, with the in-flight bound and the
    /// producer name's default (`walbox.{slot}`).
    pub fn rabbitmq_sink(&self, slot: &str) -> Result<walbox_sink::RabbitMqSinkConfig> {
        let mut c = self.rabbitmq.clone();
        c.max_in_flight = self.max_in_flight();
        if c.producer.is_none() {
            c.producer = Some(format!("walbox.{slot}"));
        }
        c.validate()?;
        Ok(c)
    }

    /// The Pub/Sub sink's settings, with the in-flight bound, topic
    /// creation, the project from `GOOGLE_CLOUD_PROJECT` and the emulator
    /// from `PUBSUB_EMULATOR_HOST` when the file gives neither.
    pub fn pubsub_sink(&self) -> Result<walbox_sink::PubSubSinkConfig> {
        let mut c = self.pubsub.clone();
        c.max_in_flight = self.max_in_flight();
        c.create_topics = self.create_topics;
        if c.project.is_empty()
            && let Ok(p) = std::env::var("GOOGLE_CLOUD_PROJECT")
        {
            c.project = p;
        }
        if c.emulator_host.is_none()
            && let Ok(h) = std::env::var(walbox_sink::EMULATOR_HOST_ENV)
            && !h.is_empty()
        {
            c.emulator_host = Some(h);
        }
        c.validate()?;
        Ok(c)
    }
}
