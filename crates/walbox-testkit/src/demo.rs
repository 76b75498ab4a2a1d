//! The demo's parts, shared by `make demo` (`src/bin/walbox-demo.rs`) and the
//! tests that start from `walbox init`: a destination of each kind prepared
//! as the demo prepares it, the configuration `walbox init` wrote with the
//! destination's address filled in, four concurrent writers of outbox rows,
//! the events read back, and the checks of the summary.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::kafka::Record;
use crate::{
    Broker, Kinesalite, LocalStack, NatsServer, PgCluster, PubSubEmulator, RabbitMq, Receiver,
    RedisServer, wait_until_async,
};

/// Concurrent writers.
pub const WRITERS: usize = 4;
/// Events each writer commits.
pub const EVENTS_PER_WRITER: usize = 75;
/// Keys (orders), each written by one writer.
pub const KEYS: usize = 20;
/// Where the events go: the topic template `outbox.{aggregate_type}` of an
/// `order`.
pub const TOPIC: &str = "outbox.order";
/// The RabbitMQ queue the demo binds to the exchange (`#`) and reads back.
pub const QUEUE: &str = "outbox.demo";
/// The sink types the demo runs (`make demo SINK=...`).
/// `rabbitmq-stream` is the rabbitmq sink type in stream mode.
pub const SINKS: &[&str] = &[
    "kafka",
    "nats",
    "rabbitmq",
    "rabbitmq-stream",
    "redis",
    "webhook",
    "pubsub",
    "kinesis",
    "sqs",
    "sns",
    "stdout",
];

/// The subscription the demo reads a Pub/Sub topic back through, made
/// before walbox publishes (a subscription holds what comes after it).
pub const PUBSUB_SUBSCRIPTION: &str = "outbox.order.demo";

/// The SQS queue walbox's events go to with the sqs sink (the topic's name
/// made a FIFO queue's).
pub const SQS_QUEUE: &str = "outbox-order.fifo";
/// The SNS topic walbox's events go to with the sns sink.
pub const SNS_TOPIC: &str = "outbox-order.fifo";
/// The SQS queue the demo subscribes to [`SNS_TOPIC`] (raw delivery) before
/// walbox publishes, and reads back: SNS keeps nothing of its own.
pub const SNS_QUEUE: &str = "outbox-order-demo.fifo";

type Error = Box<dyn std::error::Error + Send + Sync>;

/// A server the demo publishes to, kept running until dropped.
#[derive(Debug)]
enum Server {
    Kafka(Broker),
    Nats(NatsServer),
    RabbitMq(RabbitMq),
    /// RabbitMQ's stream mode: a stream per topic, declared by walbox.
    RabbitStream(RabbitMq),
    Redis(RedisServer),
    Webhook(Receiver),
    /// The file walbox's standard output goes to.
    Stdout(tempfile::TempDir),
    /// Google's Pub/Sub emulator, with the demo's subscription.
    PubSub(PubSubEmulator),
    /// kinesalite, a Kinesis stand-in.
    Kinesis(Kinesalite),
    /// LocalStack's SQS, and the records drained from the queue so far
    /// (reading a queue takes its messages).
    Sqs(LocalStack, tokio::sync::Mutex<Vec<Record>>),
    /// LocalStack's SNS, with [`SNS_QUEUE`] subscribed to the demo's topic,
    /// and the records drained from that queue so far.
    Sns(LocalStack, tokio::sync::Mutex<Vec<Record>>),
}

/// The demo's destination of one sink type.
#[derive(Debug)]
pub struct Destination {
    server: Server,
}

impl Destination {
    /// Starts the destination for `sink` (one of [`SINKS`]), prepared as the
    /// demo prepares it: RabbitMQ gets exchange `outbox` and the durable queue
    /// [`QUEUE`] bound to it for every routing key; the others need nothing.
    pub async fn start(sink: &str) -> Result<Destination, Error> {
        let server = match sink {
            "kafka" => Server::Kafka(Broker::start()?),
            "nats" => Server::Nats(NatsServer::start()?),
            "rabbitmq" => {
                let node = RabbitMq::start()?;
                // Gone with this process even when it is killed.
                node.removed_when_this_process_ends()?;
                node.declare_exchange("outbox", "topic").await?;
                node.bind_queue(QUEUE, "outbox", "#").await?;
                Server::RabbitMq(node)
            }
            "rabbitmq-stream" => {
                let node = RabbitMq::start()?;
                node.removed_when_this_process_ends()?;
                Server::RabbitStream(node)
            }
            "redis" => Server::Redis(RedisServer::start()?),
            "webhook" => Server::Webhook(Receiver::start()?),
            "stdout" => Server::Stdout(tempfile::tempdir()?),
            "pubsub" => {
                let emulator = PubSubEmulator::start()?;
                emulator.removed_when_this_process_ends()?;
                emulator.create_subscription(PUBSUB_SUBSCRIPTION, TOPIC, true)?;
                Server::PubSub(emulator)
            }
            "kinesis" => Server::Kinesis(Kinesalite::start()?),
            "sqs" => Server::Sqs(LocalStack::start()?, tokio::sync::Mutex::new(Vec::new())),
            "sns" => {
                let localstack = LocalStack::start()?;
                crate::localstack::subscribe_queue(&localstack.endpoint(), SNS_TOPIC, SNS_QUEUE)
                    .await?;
                Server::Sns(localstack, tokio::sync::Mutex::new(Vec::new()))
            }
            other => {
                return Err(format!("--sink {other}: use one of {}", SINKS.join(", ")).into());
            }
        };
        Ok(Destination { server })
    }

    /// What was started, for the demo's first line.
    #[must_use]
    pub fn describe(&self) -> &'static str {
        match &self.server {
            Server::Kafka(_) => "a Kafka-protocol broker",
            Server::Nats(_) => "a JetStream server",
            Server::RabbitMq(_) => "a RabbitMQ node",
            Server::RabbitStream(_) => "a RabbitMQ node with the stream plugin",
            Server::Redis(_) => "a Redis server (an fsynced append-only file)",
            Server::Webhook(_) => "an HTTP receiver",
            Server::Stdout(_) => "a file for walbox's standard output",
            Server::PubSub(_) => {
                "Google's Pub/Sub emulator and a subscription with message ordering"
            }
            Server::Kinesis(_) => "kinesalite (a Kinesis stand-in, records kept on disk)",
            Server::Sqs(..) => "LocalStack's SQS (FIFO queues)",
            Server::Sns(..) => "LocalStack's SNS (a FIFO topic) and an SQS queue subscribed to it",
        }
    }

    /// The server's address.
    #[must_use]
    pub fn address(&self) -> String {
        match &self.server {
            Server::Kafka(b) => b.bootstrap(),
            Server::Nats(n) => n.url(),
            Server::RabbitMq(r) => format!("amqp://127.0.0.1:{}", r.amqp_port()),
            Server::RabbitStream(r) => format!("rabbitmq-stream://127.0.0.1:{}", r.stream_port()),
            Server::Redis(r) => r.url(),
            Server::Webhook(r) => r.base_url(),
            Server::Stdout(_) => self.stdout_path().display().to_string(),
            Server::Kinesis(k) => k.endpoint(),
            Server::Sqs(l, _) | Server::Sns(l, _) => l.endpoint(),
            Server::PubSub(e) => e.host(),
        }
    }

    /// Variables walbox needs besides its configuration: the AWS stand-ins'
    /// region and credentials (they check none), which walbox takes from the
    /// AWS chain as it would AWS's.
    #[must_use]
    pub fn env(&self) -> Vec<(&'static str, String)> {
        match &self.server {
            Server::Kinesis(_) | Server::Sqs(..) | Server::Sns(..) => Kinesalite::client_env(),
            _ => Vec::new(),
        }
    }

    /// The file walbox's standard output goes to with the stdout sink.
    #[must_use]
    pub fn stdout_path(&self) -> PathBuf {
        match &self.server {
            Server::Stdout(dir) => dir.path().join("events.jsonl"),
            _ => PathBuf::new(),
        }
    }

    /// The RabbitMQ node, for a destination of that kind.
    #[must_use]
    pub fn rabbitmq(&self) -> Option<&RabbitMq> {
        match &self.server {
            Server::RabbitMq(node) | Server::RabbitStream(node) => Some(node),
            _ => None,
        }
    }

    /// Whether the destination keeps events in partitions (Kafka's).
    #[must_use]
    pub fn has_partitions(&self) -> bool {
        matches!(self.server, Server::Kafka(_))
    }

    /// Whether walbox writes its events to standard output.
    #[must_use]
    pub fn is_stdout(&self) -> bool {
        matches!(self.server, Server::Stdout(_))
    }

    /// The configuration `walbox init` wrote, with walbox's default address
    /// of the destination replaced by this server's: the one edit a newcomer
    /// makes. An error when the default is not where it was.
    pub fn fill_in(&self, config: &str) -> Result<String, Error> {
        let (default, ours) = match &self.server {
            Server::Kafka(b) => (
                "\"bootstrap.servers\" = \"127.0.0.1:9092\"".to_owned(),
                format!("\"bootstrap.servers\" = \"{}\"", b.bootstrap()),
            ),
            Server::Nats(n) => (
                "servers = [\"nats://127.0.0.1:4222\"]".to_owned(),
                format!("servers = [\"{}\"]", n.url()),
            ),
            Server::RabbitMq(r) => (
                "\nport = 5672\n".to_owned(),
                format!("\nport = {}\n", r.amqp_port()),
            ),
            Server::Redis(r) => (
                "url = \"redis://127.0.0.1:6379\"".to_owned(),
                format!("url = \"{}\"", r.url()),
            ),
            Server::Webhook(r) => (
                "url = \"http://127.0.0.1:8080/".to_owned(),
                format!("url = \"{}/", r.base_url()),
            ),
            Server::RabbitStream(r) => {
                // Stream mode, its port, and the streams declared: the demo
                // shows the mode, not an operator's stream setup.
                let mut out = config.to_owned();
                for (default, ours) in [
                    (
                        "\nport = 5672\n".to_owned(),
                        format!("\nport = {}\n", r.amqp_port()),
                    ),
                    (
                        "# mode = \"exchange\"".to_owned(),
                        "mode = \"stream\"".to_owned(),
                    ),
                    (
                        "# stream_port = 5552   # example".to_owned(),
                        format!("stream_port = {}", r.stream_port()),
                    ),
                    ("# declare = false".to_owned(), "declare = true".to_owned()),
                ] {
                    if out.matches(default.as_str()).count() != 1 {
                        return Err(format!("the configuration holds no {default:?}").into());
                    }
                    out = out.replace(&default, &ours);
                }
                return Ok(out);
            }
            Server::Stdout(_) => return Ok(config.to_owned()),
            Server::PubSub(e) => {
                let mut out = config.to_owned();
                for (default, ours) in [
                    (
                        "project = \"my-project\"".to_owned(),
                        format!("project = \"{}\"", PubSubEmulator::PROJECT),
                    ),
                    (
                        "# emulator_host = \"127.0.0.1:8085\"   # example".to_owned(),
                        format!("emulator_host = \"{}\"", e.host()),
                    ),
                ] {
                    if out.matches(default.as_str()).count() != 1 {
                        return Err(format!("the configuration holds no {default:?}").into());
                    }
                    out = out.replace(&default, &ours);
                }
                return Ok(out);
            }
            Server::Kinesis(k) => (
                "# endpoint_url = \"https://kinesis.us-east-1.amazonaws.com\"   # example"
                    .to_owned(),
                format!("endpoint_url = \"{}\"", k.endpoint()),
            ),
            Server::Sqs(l, _) => (
                "# endpoint_url = \"https://sqs.us-east-1.amazonaws.com\"   # example".to_owned(),
                format!("endpoint_url = \"{}\"", l.endpoint()),
            ),
            Server::Sns(l, _) => (
                "# endpoint_url = \"https://sns.us-east-1.amazonaws.com\"   # example".to_owned(),
                format!("endpoint_url = \"{}\"", l.endpoint()),
            ),
        };
        if config.matches(default.as_str()).count() != 1 {
            return Err(format!("the configuration holds no {default:?} to fill in").into());
        }
        Ok(config.replace(&default, &ours))
    }

    /// Where the events are read back, in the destination's words.
    #[must_use]
    pub fn place(&self) -> String {
        match &self.server {
            Server::Kafka(_) => format!("topic {TOPIC}"),
            Server::Nats(_) => format!("subject {TOPIC} (stream OUTBOX)"),
            Server::RabbitMq(_) => format!("queue {QUEUE} (bound to exchange outbox)"),
            Server::RabbitStream(_) => format!("stream {TOPIC}"),
            Server::Redis(_) => format!("stream {TOPIC}"),
            Server::Webhook(r) => format!("endpoint {}/hooks/{TOPIC}", r.base_url()),
            Server::Stdout(_) => "standard output".to_owned(),
            Server::PubSub(_) => {
                format!("topic {TOPIC} (read through subscription {PUBSUB_SUBSCRIPTION})")
            }
            Server::Kinesis(_) => format!("Kinesis stream {TOPIC}"),
            Server::Sqs(..) => format!("SQS queue {SQS_QUEUE}"),
            Server::Sns(..) => {
                format!("SNS topic {SNS_TOPIC} (read through SQS queue {SNS_QUEUE})")
            }
        }
    }

    /// The summary's "events ...:" in the destination's words.
    #[must_use]
    pub fn events_where(&self) -> &'static str {
        match &self.server {
            Server::Kafka(_) => "in the topic",
            Server::Nats(_) => "in the subject",
            Server::RabbitMq(_) => "in the queue",
            Server::RabbitStream(_) => "in the stream",
            Server::Redis(_) => "in the stream",
            Server::Webhook(_) => "at the endpoint (2xx)",
            Server::Stdout(_) => "on standard output",
            Server::PubSub(_) => "in the topic",
            Server::Kinesis(_) => "in the stream",
            Server::Sqs(..) => "in the queue",
            Server::Sns(..) => "in the topic's subscribed queue",
        }
    }

    /// How a key's events are kept, for the summary.
    #[must_use]
    pub fn key_order(&self) -> &'static str {
        match &self.server {
            Server::Kafka(_) => "each on one partition, in commit order",
            Server::Webhook(_) => "each one request at a time, in commit order",
            Server::PubSub(_) => "each one ordering key, in commit order",
            Server::Kinesis(_) => "each in one shard, in commit order",
            Server::Sqs(..) | Server::Sns(..) => "each one message group, in commit order",
            _ => "each in commit order",
        }
    }

    /// Every event the destination holds, once at least `wanted` are there
    /// (up to two minutes), as records: a Kafka record, or partition 0 and
    /// the stored order as the offset.
    pub async fn read_back(&self, wanted: usize) -> Result<Vec<Record>, Error> {
        let limit = Duration::from_secs(120);
        match &self.server {
            Server::Kafka(b) => {
                let bootstrap = b.bootstrap();
                Ok(tokio::task::spawn_blocking(move || {
                    crate::kafka::read_at_least(&bootstrap, TOPIC, wanted, limit)
                })
                .await??)
            }
            Server::Nats(n) => crate::nats::read_at_least(&n.url(), TOPIC, wanted, limit)
                .await
                .map_err(|e| e.to_string().into()),
            Server::Redis(r) => {
                Ok(crate::redis::read_at_least(&r.url(), TOPIC, wanted, limit).await?)
            }
            Server::RabbitStream(node) => {
                wait_until_async("the stream's messages", limit, || async {
                    let got = node
                        .read_stream(TOPIC, wanted, Duration::from_secs(5))
                        .await
                        .ok()?;
                    (got.len() >= wanted).then_some(got)
                })
                .await
                .map_err(Into::into)
            }
            Server::RabbitMq(node) => wait_until_async("the queue's messages", limit, || async {
                let got = node.read_queue(QUEUE).await.ok()?;
                (got.len() >= wanted).then_some(got)
            })
            .await
            .map_err(Into::into),
            Server::Webhook(r) => {
                wait_until_async("the receiver's 2xx arrivals", limit, || async {
                    (r.delivered().len() >= wanted).then_some(())
                })
                .await?;
                Ok(r.delivered()
                    .into_iter()
                    .enumerate()
                    .map(|(i, a)| Record {
                        topic: a.path.clone(),
                        partition: 0,
                        offset: i64::try_from(i).unwrap_or(i64::MAX),
                        key: a.key.clone().map(String::into_bytes),
                        headers: a
                            .headers
                            .iter()
                            .map(|(k, v)| (k.clone(), Some(v.clone().into_bytes())))
                            .collect(),
                        value: Some(a.body.to_vec()),
                    })
                    .collect())
            }
            Server::PubSub(e) => Ok(tokio::task::block_in_place(|| {
                e.read_at_least(PUBSUB_SUBSCRIPTION, TOPIC, wanted, limit)
            })?),
            Server::Kinesis(k) => wait_until_async("the stream's records", limit, || async {
                let got = crate::kinesis::read_stream(&k.endpoint(), TOPIC)
                    .await
                    .ok()?;
                (got.len() >= wanted).then_some(got)
            })
            .await
            .map_err(Into::into),
            Server::Sqs(l, drained) => drain_at_least(l, SQS_QUEUE, drained, wanted, limit).await,
            Server::Sns(l, drained) => drain_at_least(l, SNS_QUEUE, drained, wanted, limit).await,
            Server::Stdout(_) => {
                let path = self.stdout_path();
                wait_until_async("walbox's lines", limit, || async {
                    let lines = stdout_records(&path);
                    (lines.len() >= wanted).then_some(lines)
                })
                .await
                .map_err(Into::into)
            }
        }
    }

    /// The server's log so far, for a failed run.
    #[must_use]
    pub fn log_tail(&self) -> String {
        match &self.server {
            Server::Kafka(b) => b.log_tail(),
            Server::Nats(n) => n.log_tail(),
            Server::RabbitMq(r) | Server::RabbitStream(r) => r.log_tail(),
            Server::Redis(r) => r.log_tail(),
            Server::Webhook(r) => format!(
                "{} requests, {} answered 2xx",
                r.count(),
                r.delivered().len()
            ),
            Server::Stdout(_) => std::fs::read_to_string(self.stdout_path()).unwrap_or_default(),
            Server::PubSub(e) => e.log_tail(),
            Server::Kinesis(k) => k.log_tail(),
            Server::Sqs(l, _) | Server::Sns(l, _) => l.log_tail(),
        }
    }
}

/// Every message of SQS queue `queue` drained so far, once at least `wanted`
/// are (up to `limit`): reading a queue takes its messages, so they are
/// kept in `drained`.
async fn drain_at_least(
    localstack: &LocalStack,
    queue: &str,
    drained: &tokio::sync::Mutex<Vec<Record>>,
    wanted: usize,
    limit: Duration,
) -> Result<Vec<Record>, Error> {
    let mut drained = drained.lock().await;
    let deadline = tokio::time::Instant::now() + limit;
    while drained.len() < wanted {
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "{} of {wanted} messages in queue {queue} after {limit:?}",
                drained.len()
            )
            .into());
        }
        let more = crate::localstack::drain(&localstack.endpoint(), queue).await?;
        if more.is_empty() {
            // The queue is not made yet, or walbox is behind.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        drained.extend(more);
    }
    Ok(drained.clone())
}

/// The whole lines the stdout sink wrote to `path` (`{"topic", "key",
/// "headers", "value"}`), as records in their order.
fn stdout_records(path: &Path) -> Vec<Record> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.split_inclusive('\n')
        .filter(|l| l.ends_with('\n'))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .enumerate()
        .map(|(i, v)| Record {
            topic: v["topic"].as_str().unwrap_or_default().to_owned(),
            partition: 0,
            offset: i64::try_from(i).unwrap_or(i64::MAX),
            key: v["key"].as_str().map(|k| k.as_bytes().to_vec()),
            headers: v["headers"]
                .as_object()
                .map(|h| {
                    h.iter()
                        .map(|(k, v)| (k.clone(), v.as_str().map(|s| s.as_bytes().to_vec())))
                        .collect()
                })
                .unwrap_or_default(),
            value: Some(v["value"].to_string().into_bytes()),
        })
        .collect()
}

/// Runs [`WRITERS`] writers at once, each committing [`EVENTS_PER_WRITER`]
/// outbox rows of its own keys (writer `w` owns the orders `k` with `k %
/// WRITERS == w`, so each key's commit order is its writer's order, numbered
/// by the payload's `step`). The table is [`crate::OUTBOX_DDL`]'s.
pub async fn write_events(pg: &PgCluster) -> Result<(), Error> {
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let client = pg.connect("postgres").await?;
        writers.push(tokio::spawn(async move {
            for n in 0..EVENTS_PER_WRITER {
                let key = w + WRITERS * (n % (KEYS / WRITERS));
                let step = n / (KEYS / WRITERS);
                let payload = format!(
                    r#"{{"order": "order-{key}", "step": {step}, "total_cents": {}}}"#,
                    1000 + n * 17
                );
                client
                    .execute(
                        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, schema_version)
                         VALUES ('order', $1, $2, $3::text::jsonb,
                                 jsonb_build_object('traceparent', '00-' || md5($1 || $2) || '-00f067aa0ba902b7-01'), 1)",
                        &[&format!("order-{key}"), &if step == 0 { "OrderPlaced" } else { "OrderUpdated" }, &payload],
                    )
                    .await?;
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    for w in writers {
        w.await??;
    }
    Ok(())
}

/// What the summary checks of the events read back.
#[derive(Debug)]
pub struct Checked {
    /// Distinct event ids.
    pub ids: usize,
    /// Each key's payload steps in stored order.
    pub per_key: BTreeMap<String, Vec<i64>>,
    /// Whether every key's steps are 0, 1, 2, ...: commit order.
    pub in_order: bool,
}

/// The event ids, keys and per-key order of `records` (walbox envelopes).
pub fn check(records: &[Record]) -> Result<Checked, Error> {
    let mut sorted: Vec<&Record> = records.iter().collect();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    let mut per_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in &sorted {
        let v = envelope(r)?;
        per_key
            .entry(r.key_str().unwrap_or("-").to_owned())
            .or_default()
            .push(v["payload"]["step"].as_i64().unwrap_or(-1));
    }
    let ids: HashSet<&str> = records
        .iter()
        .filter_map(|r| r.header("event_id"))
        .collect();
    let in_order = per_key.values().all(|steps| {
        steps
            .iter()
            .enumerate()
            .all(|(i, s)| i64::try_from(i) == Ok(*s))
    });
    Ok(Checked {
        ids: ids.len(),
        per_key,
        in_order,
    })
}

/// A record's value: the walbox envelope.
pub fn envelope(r: &Record) -> Result<serde_json::Value, Error> {
    Ok(serde_json::from_slice(
        r.value.as_deref().unwrap_or_default(),
    )?)
}
