//! The destinations of the suite: for each sink, its server, the part of
//! walbox's configuration that names it, what a broker restart is, and every
//! copy the destination holds read back in its own stored order.

use std::time::Duration;

use walbox_testkit::kafka::Record;
use walbox_testkit::{
    Broker, BrokerOptions, BrokerStorage, Kinesalite, LocalStack, NatsServer, PubSubEmulator,
    Receiver, RedisServer,
};

use crate::common::{SECRET, dead_letter_path, node};

/// A sink type (and mode) the suite runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sink {
    Kafka,
    Nats,
    RabbitExchange,
    RabbitStream,
    Redis,
    PubSub,
    Webhook,
    Stdout,
    Kinesis,
    Sqs,
    Sns,
}

/// What a destination promises for the events of a session that ended by a
/// kill: each stored once, or each at least once with the same id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Promise {
    /// The destination drops what it already holds under the id walbox
    /// derives from the position or the event id.
    ExactlyOnce,
    /// Every event at least once, every copy with the same event id.
    AtLeastOnce,
}

impl Sink {
    /// What `docs/guarantees.md` says of this sink after a crash.
    pub fn promise(self) -> Promise {
        match self {
            Sink::Nats | Sink::RabbitStream | Sink::Redis | Sink::Sqs | Sink::Sns => {
                Promise::ExactlyOnce
            }
            Sink::Kafka
            | Sink::RabbitExchange
            | Sink::PubSub
            | Sink::Webhook
            | Sink::Stdout
            | Sink::Kinesis => Promise::AtLeastOnce,
        }
    }

    /// Whether the destination keeps what it held across a restart of its
    /// server (a stdout file has no server; a webhook receiver's outage is
    /// played by refusing every request for a while).
    pub fn has_server(self) -> bool {
        !matches!(self, Sink::Stdout)
    }

    /// Whether the destination's server keeps what it acknowledged across
    /// its own restart (the Pub/Sub emulator and LocalStack keep everything
    /// in memory: a restart is an empty server).
    pub fn keeps_data_across_restart(self) -> bool {
        !matches!(self, Sink::PubSub | Sink::Sqs | Sink::Sns)
    }

    /// Whether the sink has one call per key out at a time against a
    /// server that answers a call in milliseconds, not microseconds (the
    /// AWS stand-ins): a key's events go at one round trip each, so the
    /// histories give it writers paced to that, and a smaller snapshot.
    pub fn one_round_trip_per_event_of_a_key(self) -> bool {
        matches!(self, Sink::Kinesis | Sink::Sqs | Sink::Sns)
    }

    /// Whether `walbox dlq replay --dlq-topic` picks one dead-letter topic's
    /// letters (SNS's letters of every topic reach one queue).
    pub fn dead_letters_by_topic(self) -> bool {
        !matches!(self, Sink::Sns)
    }

    /// How often each writer of a history commits, in ms: the AWS
    /// stand-ins move a key's events one round trip each, and LocalStack's
    /// SNS, delivering to a subscribed queue, the slowest of them on a
    /// loaded machine; writers they can keep up with.
    pub fn writer_pace_ms(self) -> u64 {
        match self {
            Sink::Sns => 250,
            Sink::Kinesis | Sink::Sqs => 100,
            _ => 10,
        }
    }

    /// Whether `walbox dlq replay` can read this sink's dead letters back.
    pub fn dead_letters_replayable(self) -> bool {
        !matches!(self, Sink::Stdout)
    }

    /// Its `[sink] type`, with the mode where one type has two.
    pub fn sink_type(self) -> (&'static str, Option<&'static str>) {
        match self {
            Sink::Kafka => ("kafka", None),
            Sink::Nats => ("nats", None),
            Sink::RabbitExchange => ("rabbitmq", None),
            Sink::RabbitStream => ("rabbitmq", Some("stream")),
            Sink::Redis => ("redis", None),
            Sink::Webhook => ("webhook", None),
            Sink::Stdout => ("stdout", None),
            Sink::Kinesis => ("kinesis", None),
            Sink::Sqs => ("sqs", None),
            Sink::Sns => ("sns", None),
            Sink::PubSub => ("pubsub", None),
        }
    }

    /// The time window its exactly-once holds within, where it has one.
    pub fn window(self) -> Option<&'static str> {
        match self {
            Sink::Nats => Some("duplicate window"),
            Sink::Sqs | Sink::Sns => Some("deduplication window"),
            _ => None,
        }
    }

    /// Its name for `make demo SINK=...` (`walbox_testkit::demo::SINKS`).
    pub fn demo(self) -> &'static str {
        match self {
            Sink::RabbitStream => "rabbitmq-stream",
            other => other.sink_type().0,
        }
    }
}

/// A server a cell has to itself, or the binary's RabbitMQ node (shared,
/// held for reading for the cell's whole life, so that a cell restarting the
/// node waits for the others and they for it).
enum Server {
    Kafka(Broker),
    Nats(NatsServer),
    Rabbit(Option<tokio::sync::RwLockReadGuard<'static, walbox_testkit::RabbitMq>>),
    Redis(RedisServer),
    /// The binary's emulator, or one of the cell's own (a cell that
    /// restarts it).
    PubSub(PubSubServer),
    Webhook(Receiver),
    Stdout,
    Kinesis(Kinesalite),
    /// The binary's LocalStack, or one of the cell's own (a cell that
    /// restarts it).
    Sqs(SqsServer),
    /// The binary's LocalStack, or one of the cell's own, with the cell's
    /// topics subscribed by queues.
    Sns(SqsServer),
}

enum SqsServer {
    Shared(&'static LocalStack),
    Own(LocalStack),
}

impl SqsServer {
    fn get(&self) -> &LocalStack {
        match self {
            SqsServer::Shared(l) => l,
            SqsServer::Own(l) => l,
        }
    }
}

/// The SNS topics of cell `name` (its events' and its letters') and the
/// queue subscribed to each, which the cell reads.
fn sns_queues(name: &str) -> [(String, String); 2] {
    [
        (format!("{name}-order.fifo"), format!("{name}-events.fifo")),
        (format!("{name}-dlq.fifo"), format!("{name}-letters.fifo")),
    ]
}

/// Makes the SNS topics of cell `name` and subscribes its queues to them.
async fn subscribe_sns_queues(localstack: &LocalStack, name: &str) {
    for (topic, queue) in sns_queues(name) {
        walbox_testkit::localstack::subscribe_queue(&localstack.endpoint(), &topic, &queue)
            .await
            .expect("subscribing the cell's queues");
    }
}

/// The binary's LocalStack, started on first use, gone when the binary
/// ends.
fn localstack() -> &'static LocalStack {
    static LOCALSTACK: std::sync::OnceLock<LocalStack> = std::sync::OnceLock::new();
    LOCALSTACK.get_or_init(|| {
        let l = LocalStack::start().expect("starting localstack");
        l.removed_when_this_process_ends().unwrap();
        l
    })
}

enum PubSubServer {
    Shared(&'static PubSubEmulator),
    Own(PubSubEmulator),
}

impl PubSubServer {
    fn get(&self) -> &PubSubEmulator {
        match self {
            PubSubServer::Shared(e) => e,
            PubSubServer::Own(e) => e,
        }
    }
}

/// The binary's Pub/Sub emulator, started on first use, gone when the
/// binary ends.
fn pubsub_emulator() -> &'static PubSubEmulator {
    static EMULATOR: std::sync::OnceLock<PubSubEmulator> = std::sync::OnceLock::new();
    EMULATOR.get_or_init(|| {
        let e = PubSubEmulator::start().expect("starting the pubsub emulator");
        e.removed_when_this_process_ends().unwrap();
        e
    })
}

/// The subscriptions a Pub/Sub cell reads its topics back through, made
/// before walbox publishes (a subscription holds only what comes after
/// it), with message ordering.
fn pubsub_subscriptions(emulator: &PubSubEmulator, name: &str) {
    for topic in [format!("{name}.order"), format!("{name}.dlq")] {
        emulator
            .create_subscription(&format!("{topic}.sub"), &topic, true)
            .expect("creating the cell's subscriptions");
    }
}

/// One cell's destination: its server and the names the cell uses there.
pub struct Destination {
    pub sink: Sink,
    /// The cell's name: every topic, stream, exchange, queue and path the
    /// cell uses starts with it, so cells can share a server.
    pub name: String,
    server: Server,
    /// What the stdout sink printed, run by run.
    printed: std::sync::Mutex<Vec<String>>,
    /// What was taken from each SQS queue so far (reading a queue takes
    /// its messages).
    drained: tokio::sync::Mutex<std::collections::HashMap<String, Vec<Copy>>>,
    /// What was read of each Pub/Sub topic so far (reading acknowledges).
    pulled: tokio::sync::Mutex<std::collections::HashMap<String, Vec<Copy>>>,
}

impl Destination {
    /// Starts the destination's server for the cell `name` (the RabbitMQ node
    /// is the binary's, started once); `restartable`: the cell kills it and
    /// starts it again.
    pub async fn start(sink: Sink, name: &str, restartable: bool) -> Destination {
        let server = match sink {
            Sink::Kafka => Server::Kafka(
                // SQLite storage where the broker is killed: it keeps what it
                // acknowledged. Memory storage otherwise, the lighter.
                Broker::start_with(BrokerOptions {
                    storage: if restartable {
                        BrokerStorage::Sqlite
                    } else {
                        BrokerStorage::Memory
                    },
                })
                .expect("starting the broker"),
            ),
            Sink::Nats => Server::Nats(NatsServer::start().expect("starting nats-server")),
            Sink::RabbitExchange | Sink::RabbitStream => {
                let node = node().read().await;
                if sink == Sink::RabbitExchange {
                    node.declare_exchange(name, "topic").await.unwrap();
                    node.bind_queue(&format!("{name}.events"), name, &format!("{name}.order"))
                        .await
                        .unwrap();
                    node.bind_queue(&format!("{name}.letters"), name, &format!("{name}.dlq"))
                        .await
                        .unwrap();
                }
                Server::Rabbit(Some(node))
            }
            Sink::Redis => Server::Redis(RedisServer::start().expect("starting redis-server")),
            Sink::PubSub => {
                let server = if restartable {
                    PubSubServer::Own(PubSubEmulator::start().expect("starting the emulator"))
                } else {
                    PubSubServer::Shared(
                        tokio::task::spawn_blocking(pubsub_emulator).await.unwrap(),
                    )
                };
                pubsub_subscriptions(server.get(), name);
                Server::PubSub(server)
            }
            Sink::Webhook => Server::Webhook(Receiver::start().expect("starting the receiver")),
            Sink::Stdout => Server::Stdout,
            Sink::Kinesis => Server::Kinesis(Kinesalite::start().expect("starting kinesalite")),
            Sink::Sns => {
                let server = if restartable {
                    SqsServer::Own(LocalStack::start().expect("starting localstack"))
                } else {
                    SqsServer::Shared(tokio::task::spawn_blocking(localstack).await.unwrap())
                };
                subscribe_sns_queues(server.get(), name).await;
                Server::Sns(server)
            }
            Sink::Sqs => Server::Sqs(if restartable {
                SqsServer::Own(LocalStack::start().expect("starting localstack"))
            } else {
                SqsServer::Shared(tokio::task::spawn_blocking(localstack).await.unwrap())
            }),
        };
        Destination {
            sink,
            name: name.to_owned(),
            server,
            printed: std::sync::Mutex::new(Vec::new()),
            drained: tokio::sync::Mutex::new(std::collections::HashMap::new()),
            pulled: tokio::sync::Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// The topic the cell's events go to.
    pub fn topic(&self) -> String {
        format!("{}.order", self.name)
    }

    /// The topic the cell's dead letters go to.
    pub fn dead_letter_topic(&self) -> String {
        format!("{}.dlq", self.name)
    }

    /// The `[sink]` part of walbox's configuration, and environment
    /// variables it needs besides.
    pub async fn config(
        &self,
        pg: &walbox_testkit::PgCluster,
    ) -> (String, Vec<(&'static str, String)>) {
        let name = &self.name;
        match &self.server {
            Server::Kafka(broker) => (
                "[sink]\ntype = \"kafka\"\n".to_owned(),
                vec![
                    ("WALBOX_BOOTSTRAP_SERVERS", broker.bootstrap()),
                    ("WALBOX_CREATE_TOPICS", "true".into()),
                ],
            ),
            Server::Nats(nats) => (
                format!(
                    "[sink]\ntype = \"nats\"\n\n[sink.nats]\nservers = [\"{}\"]\n\
                     stream = \"{}\"\ncreate_stream = true\nsubjects = [\"{name}.>\"]\n\
                     duplicate_window_s = 600\n",
                    nats.url(),
                    name.to_uppercase()
                ),
                Vec::new(),
            ),
            Server::Rabbit(node) => {
                let node = node.as_ref().expect("the node");
                let mode = if self.sink == Sink::RabbitStream {
                    format!("mode = \"stream\"\ndeclare = true\nproducer = \"{name}\"\n")
                } else {
                    format!(
                        "mode = \"exchange\"\nexchange = \"{name}\"\n\
                         dead_letter_queue = \"{name}.letters\"\n"
                    )
                };
                (
                    format!(
                        "[sink]\ntype = \"rabbitmq\"\n\n[sink.rabbitmq]\nhost = \"127.0.0.1\"\n\
                         port = {}\nstream_port = {}\n{mode}",
                        node.amqp_port(),
                        node.stream_port()
                    ),
                    Vec::new(),
                )
            }
            Server::Redis(redis) => (
                format!(
                    "[sink]\ntype = \"redis\"\n\n[sink.redis]\nurl = \"{}\"\n",
                    redis.url()
                ),
                Vec::new(),
            ),
            Server::PubSub(emulator) => (
                format!(
                    "[sink]\ntype = \"pubsub\"\ncreate_topics = true\n\n[sink.pubsub]\n\
                     project = \"{}\"\nemulator_host = \"{}\"\nretry_initial_ms = 50\n\
                     retry_max_ms = 1000\nrequest_timeout_ms = 5000\n",
                    PubSubEmulator::PROJECT,
                    emulator.get().host()
                ),
                Vec::new(),
            ),
            Server::Webhook(receiver) => (
                format!(
                    "[sink]\ntype = \"webhook\"\n\n[sink.webhook]\n\
                     url = \"{}/hooks/{{topic}}\"\nsecrets = [\"{SECRET}\"]\n\
                     retry_initial_ms = 50\nretry_max_ms = 1000\nrequest_timeout_ms = 3000\n\
                     dead_letter_file = \"{}\"\n",
                    receiver.base_url(),
                    dead_letter_path(pg).display()
                ),
                Vec::new(),
            ),
            Server::Stdout => ("[sink]\ntype = \"stdout\"\n".to_owned(), Vec::new()),
            Server::Kinesis(kinesis) => (
                format!(
                    "[sink]\ntype = \"kinesis\"\ncreate_topics = true\ntopic_partitions = 2\n\n\
                     [sink.kinesis]\nendpoint_url = \"{}\"\nregion = \"us-east-1\"\n\
                     retry_initial_ms = 50\nretry_max_ms = 1000\n",
                    kinesis.endpoint()
                ),
                Kinesalite::client_env(),
            ),
            Server::Sns(sns) => (
                format!(
                    "[sink]\ntype = \"sns\"\ncreate_topics = true\n\n[sink.sns]\n\
                     endpoint_url = \"{}\"\nregion = \"us-east-1\"\nretry_initial_ms = 50\n\
                     retry_max_ms = 1000\ndead_letter_queue = \"{}\"\n",
                    sns.get().endpoint(),
                    sns_queues(name)[1].1
                ),
                Kinesalite::client_env(),
            ),
            Server::Sqs(sqs) => (
                format!(
                    "[sink]\ntype = \"sqs\"\ncreate_topics = true\n\n[sink.sqs]\n\
                     endpoint_url = \"{}\"\nregion = \"us-east-1\"\nretry_initial_ms = 50\n\
                     retry_max_ms = 1000\n",
                    sqs.get().endpoint()
                ),
                Kinesalite::client_env(),
            ),
        }
    }

    /// Keeps what a walbox run printed (the stdout sink's destination).
    pub fn printed(&self, log: String) {
        if self.sink == Sink::Stdout {
            self.printed.lock().unwrap().push(log);
        }
    }

    /// The server dies (kill -9) and comes back on the same storage; for a
    /// webhook receiver, every request is dropped for `down`, then answered.
    /// Runs `while_down` while it is away.
    pub async fn restart_server<F: std::future::Future<Output = ()>>(
        &mut self,
        down: Duration,
        while_down: impl FnOnce() -> F,
    ) {
        match &mut self.server {
            Server::Kafka(broker) => {
                broker.kill9().unwrap();
                while_down().await;
                tokio::time::sleep(down).await;
                broker.start_again().unwrap();
            }
            Server::Nats(nats) => {
                nats.kill9().unwrap();
                while_down().await;
                tokio::time::sleep(down).await;
                nats.start_again().unwrap();
            }
            Server::Rabbit(guard) => {
                // Alone on the node while it restarts.
                drop(guard.take());
                let mut node = node().write().await;
                node.kill9().unwrap();
                while_down().await;
                tokio::time::sleep(down).await;
                node.start_again().unwrap();
                drop(node);
                *guard = Some(crate::common::node().read().await);
            }
            Server::Redis(redis) => {
                redis.kill9().unwrap();
                while_down().await;
                tokio::time::sleep(down).await;
                redis.start_again().unwrap();
            }
            Server::PubSub(PubSubServer::Own(emulator)) => {
                // Back empty: the cell's subscriptions are made again (what
                // walbox publishes before they are is kept nowhere).
                emulator.kill9().unwrap();
                while_down().await;
                tokio::time::sleep(down).await;
                emulator.start_again().unwrap();
                pubsub_subscriptions(emulator, &self.name);
            }
            Server::PubSub(PubSubServer::Shared(_)) => {
                panic!("the binary's emulator is shared: a cell that restarts it has its own")
            }
            Server::Webhook(receiver) => {
                receiver.set_script(|_| walbox_testkit::webhook::Reply::Reset);
                while_down().await;
                tokio::time::sleep(down).await;
                receiver.set_script(|_| walbox_testkit::webhook::Reply::Ok);
            }
            Server::Stdout => panic!("the stdout sink has no server to restart"),
            Server::Kinesis(kinesis) => {
                kinesis.kill9().unwrap();
                while_down().await;
                tokio::time::sleep(down).await;
                kinesis.start_again().unwrap();
            }
            Server::Sqs(SqsServer::Own(sqs)) => {
                sqs.kill9().unwrap();
                while_down().await;
                tokio::time::sleep(down).await;
                sqs.start_again().unwrap();
            }
            Server::Sns(SqsServer::Own(sns)) => {
                // Back empty, without the topics and their subscriptions:
                // the cell subscribes again when walbox says so
                // (`subscribe_again`).
                sns.kill9().unwrap();
                while_down().await;
                tokio::time::sleep(down).await;
                sns.start_again().unwrap();
            }
            Server::Sqs(SqsServer::Shared(_)) | Server::Sns(SqsServer::Shared(_)) => {
                panic!("a cell that restarts LocalStack has its own")
            }
        }
    }

    /// Subscribes the cell's queues to its SNS topics again (after a
    /// restart of the server, which keeps none): what walbox's message
    /// advises when it stops at a topic without a subscription.
    pub async fn subscribe_again(&self) {
        match &self.server {
            Server::Sns(server) => subscribe_sns_queues(server.get(), &self.name).await,
            _ => panic!("only SNS topics need subscriptions made again"),
        }
    }

    /// Every copy `topic` holds, in the destination's stored order.
    pub async fn read(&self, topic: &str) -> Vec<Copy> {
        // Reading ends at the end of what the destination holds; the limit
        // is room for a broker just restarted on a machine running other
        // test binaries beside this one.
        let timeout = Duration::from_secs(120);
        match &self.server {
            Server::Kafka(broker) => {
                let bootstrap = broker.bootstrap();
                let topic = topic.to_owned();
                let records = tokio::task::spawn_blocking(move || {
                    // A topic never created (a dead-letter topic with no
                    // letters) holds nothing.
                    if !kafka_topic_exists(&bootstrap, &topic) {
                        return Vec::new();
                    }
                    walbox_testkit::kafka::read_all(&bootstrap, &topic, timeout)
                        .unwrap_or_else(|e| panic!("reading {topic}: {e}"))
                })
                .await
                .unwrap();
                records.iter().map(|r| Copy::of_record(r, None)).collect()
            }
            Server::Nats(nats) => {
                let config = walbox_sink::NatsSinkConfig {
                    servers: vec![nats.url()],
                    stream: self.name.to_uppercase(),
                    ..Default::default()
                };
                let mut out = Vec::new();
                let read = walbox_sink::read_subject(&config, topic, timeout, |r| {
                    let own = r.header("Nats-Msg-Id").map(str::to_owned);
                    out.push(Copy::of_view(topic, &r, own));
                })
                .await;
                if let Err(e) = read {
                    assert!(out.is_empty(), "reading {topic}: {e}");
                }
                out
            }
            Server::Rabbit(node) if self.sink == Sink::RabbitExchange => {
                let node = node.as_ref().expect("the node");
                let queue = if topic.ends_with(".dlq") {
                    format!("{}.letters", self.name)
                } else {
                    format!("{}.events", self.name)
                };
                let records = node.read_queue(&queue).await.unwrap();
                records
                    .iter()
                    .map(|r| Copy::of_record(r, r.header("message_id").map(str::to_owned)))
                    .collect()
            }
            Server::Rabbit(node) => {
                let node = node.as_ref().expect("the node");
                let config = walbox_sink::RabbitMqSinkConfig {
                    mode: walbox_sink::RabbitMqMode::Stream,
                    port: Some(node.amqp_port()),
                    stream_port: Some(node.stream_port()),
                    ..Default::default()
                };
                let mut out = Vec::new();
                let read = walbox_sink::read_rabbit_stream(&config, topic, timeout, |r| {
                    out.push(Copy::of_view(topic, &r, r.event_id()));
                })
                .await;
                if let Err(e) = read {
                    assert!(out.is_empty(), "reading {topic}: {e}");
                }
                out
            }
            Server::Redis(redis) => {
                let config = walbox_sink::RedisSinkConfig {
                    url: redis.url(),
                    ..Default::default()
                };
                let mut out = Vec::new();
                walbox_sink::read_stream(&config, topic, timeout, |r| {
                    out.push(Copy::of_view(topic, &r, r.event_id()));
                })
                .await
                .unwrap();
                out
            }
            Server::PubSub(emulator) => {
                let config = walbox_sink::PubSubSinkConfig {
                    project: PubSubEmulator::PROJECT.into(),
                    emulator_host: Some(emulator.get().host()),
                    ..Default::default()
                };
                // Reading acknowledges: what was read before is kept here,
                // and what came since is added after it.
                let mut pulled = self.pulled.lock().await;
                let held = pulled.entry(topic.to_owned()).or_default();
                let before = held.len() as i64;
                let mut new = Vec::new();
                walbox_sink::read_subscription(
                    &config,
                    &format!("{topic}.sub"),
                    Duration::from_secs(5),
                    |r| {
                        let mut copy = Copy::of_view(topic, &r, r.event_id());
                        copy.offset += before;
                        new.push(copy);
                    },
                )
                .await
                .unwrap_or_else(|e| panic!("reading {topic}: {e}"));
                held.extend(new);
                held.clone()
            }
            Server::Webhook(receiver) => {
                let path = format!("/hooks/{topic}");
                receiver
                    .delivered()
                    .iter()
                    .filter(|a| a.path == path)
                    .enumerate()
                    .map(|(i, a)| Copy::of_arrival(topic, i, a))
                    .collect()
            }
            Server::Kinesis(kinesis) => {
                let config = walbox_sink::KinesisSinkConfig {
                    endpoint_url: Some(kinesis.endpoint()),
                    region: Some("us-east-1".into()),
                    credentials: Some(Kinesalite::credentials()),
                    ..Default::default()
                };
                let mut out = Vec::new();
                // A stream never created (a dead-letter stream with no
                // letters) holds nothing.
                walbox_sink::read_kinesis_stream(&config, topic, timeout, |r| {
                    out.push(Copy::of_view(topic, &r, r.event_id()));
                })
                .await
                .unwrap_or_else(|e| panic!("reading {topic}: {e}"));
                out
            }
            Server::Sns(sns) => {
                // Read through the queue subscribed to the topic.
                let [(_, events), (_, letters)] = sns_queues(&self.name);
                let queue = if topic.ends_with(".dlq") {
                    letters
                } else {
                    events
                };
                self.read_sqs(sns.get().endpoint(), topic, &queue, timeout)
                    .await
            }
            Server::Sqs(sqs) => {
                self.read_sqs(sqs.get().endpoint(), topic, topic, timeout)
                    .await
            }
            Server::Stdout => {
                let printed = self.printed.lock().unwrap();
                let mut out = Vec::new();
                for log in printed.iter() {
                    // A line cut short by a kill is no copy: its event was
                    // not acknowledged.
                    for line in log
                        .lines()
                        .filter(|l| l.starts_with("{\"topic\""))
                        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    {
                        if line["topic"] == topic {
                            let offset = out.len() as i64;
                            out.push(Copy::of_line(topic, offset, &line));
                        }
                    }
                }
                out
            }
        }
    }

    /// What the SQS queue `queue` names (an SQS sink's topic, or the queue
    /// subscribed to an SNS topic) holds, as copies of `topic`: taken from
    /// the queue and kept (reading takes a queue's messages), but a
    /// dead-letter queue's, looked at and left for `walbox dlq replay`.
    async fn read_sqs(
        &self,
        endpoint: String,
        topic: &str,
        queue: &str,
        timeout: Duration,
    ) -> Vec<Copy> {
        let config = walbox_sink::SqsSinkConfig {
            endpoint_url: Some(endpoint),
            region: Some("us-east-1".into()),
            credentials: Some(Kinesalite::credentials()),
            ..Default::default()
        };
        if topic.ends_with(".dlq") {
            let Some(mut letters) = walbox_sink::SqsLetters::open(&config, queue)
                .await
                .unwrap_or_else(|e| panic!("reading {topic}: {e}"))
            else {
                return Vec::new();
            };
            letters.next_round().await.unwrap();
            let mut out = Vec::new();
            letters.each(|r| out.push(Copy::of_view(topic, &r, r.event_id())));
            letters.settle(|_| false).await.unwrap();
            return out;
        }
        let mut drained = self.drained.lock().await;
        let held = drained.entry(topic.to_owned()).or_default();
        let before = held.len();
        walbox_sink::drain_sqs_queue(&config, queue, timeout, |r| {
            let mut copy = Copy::of_view(topic, &r, r.event_id());
            copy.offset += i64::try_from(before).unwrap();
            held.push(copy);
        })
        .await
        .unwrap_or_else(|e| panic!("reading {topic}: {e}"));
        held.clone()
    }

    /// The dead letters the cell's letters topic holds (for the webhook
    /// sink, its letters file).
    pub async fn letters(&self, pg: &walbox_testkit::PgCluster) -> Vec<Copy> {
        if self.sink == Sink::Webhook {
            let path = dead_letter_path(pg);
            if !path.exists() {
                return Vec::new();
            }
            return walbox_sink::read_letters(&path)
                .unwrap()
                .iter()
                .map(|(n, line)| {
                    let r = walbox_sink::RecordView::letter(line, *n);
                    Copy::of_view(&line.topic, &r, r.event_id())
                })
                .collect();
        }
        self.read(&self.dead_letter_topic()).await
    }
}

/// One copy of an event as the destination holds it.
#[derive(Debug, Clone)]
pub struct Copy {
    pub topic: String,
    /// The partition (Kafka); 0 elsewhere.
    pub lane: i64,
    /// Its place in its lane.
    pub offset: i64,
    pub key: Option<String>,
    /// The event id where the record's format puts it for consumers.
    pub id: Option<String>,
    /// The id in the sink's own field, where it writes one (`Nats-Msg-Id`,
    /// a Redis entry's `event_id`, RabbitMQ's `message-id`, `webhook-id`).
    pub sink_id: Option<String>,
    /// The value, parsed.
    pub value: serde_json::Value,
    /// Its source position headers (`walbox_commit_lsn`, `walbox_index`,
    /// `walbox_xid`).
    pub position: (Option<String>, Option<String>, Option<String>),
    /// Every header, as text.
    pub headers: Vec<(String, String)>,
}

impl Copy {
    fn of_record(r: &Record, sink_id: Option<String>) -> Copy {
        let headers: Vec<(String, String)> = r
            .headers
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), String::from_utf8(v.clone()?).ok()?)))
            .collect();
        Copy {
            topic: r.topic.clone(),
            lane: i64::from(r.partition),
            offset: r.offset,
            key: r.key_str().map(str::to_owned),
            id: walbox_outbox::record_event_id(|n| r.header(n), r.value.as_deref()),
            sink_id,
            value: parse(r.value.as_deref()),
            position: (
                r.header("walbox_commit_lsn").map(str::to_owned),
                r.header("walbox_index").map(str::to_owned),
                r.header("walbox_xid").map(str::to_owned),
            ),
            headers,
        }
    }

    fn of_view(topic: &str, r: &walbox_sink::RecordView<'_>, sink_id: Option<String>) -> Copy {
        let names = [
            "walbox_commit_lsn",
            "walbox_index",
            "walbox_xid",
            "walbox_origin",
            "walbox_replay",
            "walbox_producer",
            "walbox_error_class",
            "walbox_attempts",
        ];
        Copy {
            topic: topic.to_owned(),
            lane: i64::from(r.partition()),
            offset: r.offset(),
            key: r.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            id: walbox_outbox::record_event_id(|n| r.header(n), r.value()),
            sink_id,
            value: parse(r.value()),
            position: (
                r.header("walbox_commit_lsn").map(str::to_owned),
                r.header("walbox_index").map(str::to_owned),
                r.header("walbox_xid").map(str::to_owned),
            ),
            headers: names
                .iter()
                .filter_map(|n| Some(((*n).to_owned(), r.header(n)?.to_owned())))
                .collect(),
        }
    }

    fn of_arrival(topic: &str, place: usize, a: &walbox_testkit::webhook::Arrival) -> Copy {
        let header = |n: &str| a.header(n);
        let value = parse(Some(&a.body));
        Copy {
            topic: topic.to_owned(),
            lane: 0,
            offset: place as i64,
            key: a.key.clone(),
            id: walbox_outbox::record_event_id(header, Some(&a.body)),
            sink_id: Some(a.id.clone()),
            value,
            position: (
                header("walbox_commit_lsn").map(str::to_owned),
                header("walbox_index").map(str::to_owned),
                header("walbox_xid").map(str::to_owned),
            ),
            headers: a.headers.clone(),
        }
    }

    fn of_line(topic: &str, offset: i64, line: &serde_json::Value) -> Copy {
        let header = |n: &str| line["headers"][n].as_str();
        let value = line["value"].clone();
        let raw = value.to_string();
        Copy {
            topic: topic.to_owned(),
            lane: 0,
            offset,
            key: line["key"].as_str().map(str::to_owned),
            id: walbox_outbox::record_event_id(header, Some(raw.as_bytes())),
            sink_id: None,
            value,
            position: (
                header("walbox_commit_lsn").map(str::to_owned),
                header("walbox_index").map(str::to_owned),
                header("walbox_xid").map(str::to_owned),
            ),
            headers: line["headers"]
                .as_object()
                .map(|o| {
                    o.iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// A header's text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Whether the broker knows `topic` (with partitions).
fn kafka_topic_exists(bootstrap: &str, topic: &str) -> bool {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = walbox_testkit::kafka::client_config(bootstrap)
        .create()
        .expect("a metadata client");
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("the broker's metadata of {topic}: {e}"));
    metadata
        .topics()
        .iter()
        .any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
}

fn parse(value: Option<&[u8]>) -> serde_json::Value {
    value
        .and_then(|v| serde_json::from_slice(v).ok())
        .unwrap_or(serde_json::Value::Null)
}
