//! What a contender's destination received: the records of the run's own topic on
//! the broker, the messages of the JetStream stream and the entries of the run's
//! own Redis stream, counted after the run, so
//! that a run that relayed less (or nothing) fails instead of reporting a speed.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use walbox_testkit::{NatsServer, RabbitMq, RedisServer};

use crate::Error;
use crate::contenders::{Contender, NATS_STREAM, RABBITMQ_EXCHANGE};

/// How long the records of a confirmed run may take to be read back.
const READ_BACK: Duration = Duration::from_secs(300);

/// Where a run's events can be counted.
pub enum Destination {
    /// A topic of the broker that only this run writes.
    Topic(String),
    /// The JetStream stream, deleted before each run.
    Stream,
    /// A Redis stream that only this run writes.
    RedisStream(String),
    /// A RabbitMQ stream that only this run writes (named by its topic).
    RabbitStream(String),
    /// A durable classic queue of RabbitMQ that only this run's messages
    /// reach, bound to the bench's exchange by its name (the run's topic,
    /// walbox's routing key).
    RabbitQueue(String),
}

/// Numbers the runs' topics, so that no two runs share one.
static RUNS: AtomicU32 = AtomicU32::new(0);

impl Contender {
    /// Where a run of the contender on `slot` puts its events, if anywhere they
    /// can be counted (the ceiling and the stdout sink write to /dev/null).
    pub fn destination(self, slot: &str) -> Option<Destination> {
        match self.base() {
            Contender::WalboxKafka
            | Contender::WalboxKafkaMetrics
            | Contender::WalboxKafkaWorkers
            | Contender::WalboxKafkaMessages => Some(Destination::Topic(format!(
                "bench.{slot}.{}",
                RUNS.fetch_add(1, Ordering::Relaxed) + 1
            ))),
            Contender::WalboxNats => Some(Destination::Stream),
            Contender::WalboxRedis => Some(Destination::RedisStream(format!(
                "bench.{slot}.{}",
                RUNS.fetch_add(1, Ordering::Relaxed) + 1
            ))),
            Contender::WalboxRabbitMq => Some(Destination::RabbitStream(format!(
                "bench.{slot}.{}",
                RUNS.fetch_add(1, Ordering::Relaxed) + 1
            ))),
            Contender::WalboxRabbitMqExchange => Some(Destination::RabbitQueue(format!(
                "bench.{slot}.{}",
                RUNS.fetch_add(1, Ordering::Relaxed) + 1
            ))),
            Contender::TrueCeiling
            | Contender::TrueCeilingMessages
            | Contender::Ceiling
            | Contender::CeilingMessages
            | Contender::WalboxStdout => None,
            // base() maps these to their own.
            Contender::BaselineKafka
            | Contender::BaselineNats
            | Contender::BaselineKafkaMessages
            | Contender::BaselineRedis => None,
        }
    }
}

impl Destination {
    /// The topic a broker contender is to write, if this is one.
    pub fn topic(&self) -> Option<&str> {
        match self {
            Destination::Topic(t)
            | Destination::RedisStream(t)
            | Destination::RabbitStream(t)
            | Destination::RabbitQueue(t) => Some(t),
            Destination::Stream => None,
        }
    }

    /// Makes what the run needs before it starts: a queue bound to the
    /// exchange, so that walbox's mandatory messages are routed.
    pub async fn prepare(&self, rabbitmq: &RabbitMq) -> Result<(), Error> {
        if let Destination::RabbitQueue(queue) = self {
            rabbitmq
                .declare_exchange(RABBITMQ_EXCHANGE, "topic")
                .await?;
            rabbitmq.bind_queue(queue, RABBITMQ_EXCHANGE, queue).await?;
        }
        Ok(())
    }

    /// Fails unless it holds `events` events; a topic is deleted once counted
    /// (the broker keeps its topics in memory).
    pub async fn check(
        &self,
        bootstrap: &str,
        nats: &NatsServer,
        redis: &RedisServer,
        rabbitmq: &RabbitMq,
        events: u64,
    ) -> Result<(), Error> {
        let (what, held) = match self {
            Destination::Topic(topic) => {
                let (b, t) = (bootstrap.to_owned(), topic.clone());
                let held =
                    tokio::task::spawn_blocking(move || topic_records(&b, &t, events)).await??;
                if held.is_some() {
                    delete_topic(bootstrap, topic).await?;
                }
                (format!("topic {topic}"), held.unwrap_or(0))
            }
            Destination::RabbitStream(stream) => {
                let held = rabbitmq.stream_messages(stream).await?;
                // Its messages go, so they take no disk from what follows.
                rabbitmq.delete_stream(stream).await?;
                (format!("RabbitMQ stream {stream}"), held)
            }
            Destination::RabbitQueue(queue) => {
                let held = rabbitmq.queue_messages(queue).await?;
                rabbitmq.delete_queue(queue).await?;
                (format!("RabbitMQ queue {queue}"), u64::from(held))
            }
            Destination::Stream => (
                format!("JetStream stream {NATS_STREAM}"),
                stream_messages(nats).await?,
            ),
            Destination::RedisStream(key) => (
                format!("Redis stream {key}"),
                redis_entries(redis, key).await?,
            ),
        };
        if held != events {
            return Err(format!(
                "the run confirmed the last commit but {what} holds {held} of its {events} \
                 events: see walbox's output above"
            )
            .into());
        }
        Ok(())
    }
}

/// Records in `topic` (`None` when walbox never created it), read from its start until `expected` arrived (or
/// [`READ_BACK`] passed), then until every partition is at its end (5 s at
/// most, for records beyond those expected). Counted by
/// reading: tansu's high watermarks can lag behind the records it serves.
fn topic_records(bootstrap: &str, topic: &str, expected: u64) -> Result<Option<u64>, Error> {
    let consumer: BaseConsumer = walbox_testkit::kafka::client_config(bootstrap)
        .set("group.id", format!("walbox-bench-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .create()?;
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(30))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    if partitions.is_empty() {
        return Ok(None);
    }
    let mut assignment = TopicPartitionList::new();
    for &p in &partitions {
        assignment.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    let mut deadline = Instant::now() + READ_BACK;
    let mut records = 0u64;
    let mut at_end = std::collections::HashSet::new();
    while Instant::now() < deadline && (records < expected || at_end.len() < partitions.len()) {
        if records == expected {
            // All there: a few seconds more for any beyond them.
            deadline = deadline.min(Instant::now() + Duration::from_secs(5));
        }
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Ok(m)) => {
                at_end.remove(&m.partition());
                records += 1;
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                at_end.insert(p);
            }
            Some(Err(e)) => return Err(e.into()),
        }
    }
    Ok(Some(records))
}

/// Deletes `topic`.
async fn delete_topic(bootstrap: &str, topic: &str) -> Result<(), Error> {
    let admin: AdminClient<DefaultClientContext> =
        walbox_testkit::kafka::client_config(bootstrap).create()?;
    for r in admin.delete_topics(&[topic], &AdminOptions::new()).await? {
        r.map_err(|(t, code)| format!("deleting topic {t}: {code}"))?;
    }
    Ok(())
}

/// Messages in the JetStream contender's stream; 0 when it does not exist.
async fn stream_messages(nats: &NatsServer) -> Result<u64, Error> {
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await?);
    match js.get_stream(NATS_STREAM).await {
        Ok(mut stream) => Ok(stream.info().await?.state.messages),
        Err(e)
            if matches!(
                e.kind(),
                async_nats::jetstream::context::GetStreamErrorKind::JetStream(ref j)
                    if j.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            Ok(0)
        }
        Err(e) => Err(e.into()),
    }
}

/// Entries in the Redis stream `key`, which is deleted once counted (the
/// server keeps it in memory).
async fn redis_entries(redis: &RedisServer, key: &str) -> Result<u64, Error> {
    let mut con = redis::Client::open(redis.url())?
        .get_multiplexed_async_connection()
        .await?;
    let n: u64 = redis::cmd("XLEN").arg(key).query_async(&mut con).await?;
    let _: i64 = redis::cmd("DEL").arg(key).query_async(&mut con).await?;
    Ok(n)
}
