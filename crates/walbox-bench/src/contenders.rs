//! The slot contenders, and how one run of one is timed: from its start until its
//! slot's `confirmed_flush_lsn` reaches the last commit, with its peak RSS (VmHWM)
//! and CPU seconds read from /proc.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use walbox_testkit::{Broker, NatsServer, PgCluster, RabbitMq, RedisServer};

use crate::Error;

/// A contender that drains its own logical replication slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contender {
    /// walbox's replication client reading the slot and confirming each commit,
    /// nothing decoded (`walbox-ceiling`): the ceiling, what the server hands
    /// out at no cost above the socket.
    TrueCeiling,
    /// `pg_recvlogical` (pgoutput, protocol 1) to /dev/null: PostgreSQL's own
    /// client, shown beside the ceiling.
    Ceiling,
    /// `walbox run --sink stdout` to /dev/null: walbox without a broker.
    WalboxStdout,
    /// `walbox run` to the broker.
    WalboxKafka,
    /// `walbox run` to the broker with its metrics endpoint scraped every 100 ms.
    WalboxKafkaMetrics,
    /// `walbox run` to the broker on a runtime of [`WORKER_THREADS`] worker
    /// threads (`WALBOX_WORKER_THREADS`) instead of its one thread.
    WalboxKafkaWorkers,
    /// `walbox run` to NATS JetStream (a memory stream, created by walbox).
    WalboxNats,
    /// `walbox run` to Redis Streams (append-only file, fsync on every write),
    /// the run's own stream.
    WalboxRedis,
    /// `walbox run` to RabbitMQ streams (stream mode: named producers,
    /// deduplicated), a stream of the run's own, created by walbox.
    WalboxRabbitMq,
    /// `walbox run` to a RabbitMQ exchange (exchange mode: persistent
    /// messages, mandatory, publisher confirms) routed to a durable classic
    /// queue of the run's own.
    WalboxRabbitMqExchange,
    /// `walbox-ceiling` on the publication without tables: the ceiling of the
    /// messages scenario.
    TrueCeilingMessages,
    /// `pg_recvlogical` with `messages=true` on the publication without tables.
    CeilingMessages,
    /// `walbox run` to the broker with a `[[messages]]` section and no table.
    WalboxKafkaMessages,
    /// [`Contender::WalboxKafka`] with the `--baseline` build of walbox.
    BaselineKafka,
    /// [`Contender::WalboxNats`] with the `--baseline` build of walbox.
    BaselineNats,
    /// [`Contender::WalboxKafkaMessages`] with the `--baseline` build of walbox.
    BaselineKafkaMessages,
    /// [`Contender::WalboxRedis`] with the `--baseline` build of walbox.
    BaselineRedis,
}

/// How often walbox and the ceiling report their position to the server:
/// walbox's default is 1 s, which would leave a drain's end known only to a
/// second. `pg_recvlogical` reports its end position as it exits.
pub const STATUS_INTERVAL_MS: u64 = 100;

/// The worker threads of [`Contender::WalboxKafkaWorkers`]: one per core of
/// the machine the figures in docs/benchmarks.md come from.
pub const WORKER_THREADS: usize = 2;

/// How often the metrics contender's endpoint is scraped.
const SCRAPE_EVERY: Duration = Duration::from_millis(100);

impl Contender {
    /// The contenders of the table scenarios; the ceiling first (the report
    /// relies on it).
    pub const ALL: [Contender; 10] = [
        Contender::TrueCeiling,
        Contender::Ceiling,
        Contender::WalboxStdout,
        Contender::WalboxKafka,
        Contender::WalboxKafkaMetrics,
        Contender::WalboxKafkaWorkers,
        Contender::WalboxNats,
        Contender::WalboxRedis,
        Contender::WalboxRabbitMq,
        Contender::WalboxRabbitMqExchange,
    ];

    /// The contenders that run the `--baseline` build, beside their own in the
    /// backlog and messages scenarios.
    pub const BASELINE: [Contender; 3] = [
        Contender::BaselineKafka,
        Contender::BaselineNats,
        Contender::BaselineRedis,
    ];
    pub const BASELINE_MESSAGES: [Contender; 1] = [Contender::BaselineKafkaMessages];

    /// What the contender runs: a baseline contender runs as its own, with the
    /// other build.
    pub fn base(self) -> Contender {
        match self {
            Contender::BaselineKafka => Contender::WalboxKafka,
            Contender::BaselineNats => Contender::WalboxNats,
            Contender::BaselineKafkaMessages => Contender::WalboxKafkaMessages,
            Contender::BaselineRedis => Contender::WalboxRedis,
            c => c,
        }
    }

    /// Whether the contender runs the `--baseline` build.
    pub fn is_baseline(self) -> bool {
        self.base() != self
    }

    /// The contenders of the messages scenario; the ceiling first.
    pub const MESSAGES: [Contender; 3] = [
        Contender::TrueCeilingMessages,
        Contender::CeilingMessages,
        Contender::WalboxKafkaMessages,
    ];

    /// The name in the report's tables.
    pub fn name(self) -> &'static str {
        match self {
            Contender::TrueCeiling => "replication client, no decoding (ceiling)",
            Contender::Ceiling => "pg_recvlogical",
            Contender::WalboxStdout => "walbox, stdout sink to /dev/null",
            Contender::WalboxKafka => "walbox to the broker",
            Contender::WalboxKafkaMetrics => "walbox to the broker, metrics on",
            Contender::WalboxKafkaWorkers => "walbox to the broker, 2 runtime workers",
            Contender::WalboxNats => "walbox to JetStream",
            Contender::WalboxRedis => "walbox to Redis Streams",
            Contender::WalboxRabbitMq => "walbox to RabbitMQ streams",
            Contender::WalboxRabbitMqExchange => "walbox to a RabbitMQ exchange, confirmed",
            Contender::TrueCeilingMessages => "replication client, no decoding (ceiling)",
            Contender::CeilingMessages => "pg_recvlogical, messages=true",
            Contender::WalboxKafkaMessages => "walbox to the broker, [[messages]]",
            Contender::BaselineKafka => "baseline build to the broker",
            Contender::BaselineNats => "baseline build to JetStream",
            Contender::BaselineKafkaMessages => "baseline build to the broker, [[messages]]",
            Contender::BaselineRedis => "baseline build to Redis Streams",
        }
    }

    /// The short name in the lines that give the order of the rounds.
    pub fn short(self) -> &'static str {
        match self {
            Contender::TrueCeiling => "ceiling",
            Contender::Ceiling => "pg_recvlogical",
            Contender::WalboxStdout => "walbox-stdout",
            Contender::WalboxKafka => "walbox-broker",
            Contender::WalboxKafkaMetrics => "walbox-broker-metrics",
            Contender::WalboxKafkaWorkers => "walbox-broker-workers",
            Contender::WalboxNats => "walbox-jetstream",
            Contender::WalboxRedis => "walbox-redis",
            Contender::WalboxRabbitMq => "walbox-rabbitmq-stream",
            Contender::WalboxRabbitMqExchange => "walbox-rabbitmq-exchange",
            Contender::TrueCeilingMessages => "ceiling-messages",
            Contender::CeilingMessages => "pg_recvlogical-messages",
            Contender::WalboxKafkaMessages => "walbox-broker-messages",
            Contender::BaselineKafka => "baseline-broker",
            Contender::BaselineNats => "baseline-jetstream",
            Contender::BaselineKafkaMessages => "baseline-broker-messages",
            Contender::BaselineRedis => "baseline-redis",
        }
    }

    /// The contender's slot in `round` (0-based).
    pub fn slot(self, round: usize) -> String {
        let prefix = match self {
            Contender::TrueCeiling => "ceiling",
            Contender::Ceiling => "recvlogical",
            Contender::WalboxStdout => "walbox_stdout",
            Contender::WalboxKafka => "walbox_kafka",
            Contender::WalboxKafkaMetrics => "walbox_kafka_metrics",
            Contender::WalboxKafkaWorkers => "walbox_kafka_workers",
            Contender::WalboxNats => "walbox_nats",
            Contender::WalboxRedis => "walbox_redis",
            Contender::WalboxRabbitMq => "walbox_rabbitmq",
            Contender::WalboxRabbitMqExchange => "walbox_rabbitmq_exchange",
            Contender::TrueCeilingMessages => "ceiling_messages",
            Contender::CeilingMessages => "recvlogical_messages",
            Contender::WalboxKafkaMessages => "walbox_kafka_messages",
            Contender::BaselineKafka => "baseline_kafka",
            Contender::BaselineNats => "baseline_nats",
            Contender::BaselineKafkaMessages => "baseline_kafka_messages",
            Contender::BaselineRedis => "baseline_redis",
        };
        format!("{prefix}_r{}", round + 1)
    }

    /// Starts the contender on `slot`, to stop at or after `target`; a broker
    /// contender writes `topic`. Its stderr goes to `stderr` (the bench's own,
    /// or a pipe the allocations scenario reads).
    #[allow(clippy::too_many_arguments)] // the run's parts, each of its own kind
    pub fn spawn(
        self,
        pg: &PgCluster,
        broker: &Broker,
        nats: &NatsServer,
        redis: &RedisServer,
        rabbitmq: &RabbitMq,
        walbox: &Path,
        slot: &str,
        topic: Option<&str>,
        target: &str,
        stderr: Stdio,
        count_allocations: bool,
    ) -> Result<Child, Error> {
        // A baseline contender runs as its own, with the other build.
        let kind = self.base();
        let sink = match kind {
            Contender::TrueCeiling | Contender::TrueCeilingMessages => {
                let publication = if kind == Contender::TrueCeilingMessages {
                    MESSAGES_PUBLICATION
                } else {
                    "walbox_outbox"
                };
                // Built with the bench, next to it.
                let ceiling = std::env::current_exe()?.with_file_name("walbox-ceiling");
                return Ok(Command::new(ceiling)
                    .args([pg.host(), &pg.port().to_string(), pg.user(), "postgres"])
                    .args([slot, publication, &STATUS_INTERVAL_MS.to_string()])
                    .stdout(Stdio::null())
                    .stderr(stderr)
                    .spawn()?);
            }
            Contender::Ceiling | Contender::CeilingMessages => {
                let mut cmd = Command::new(pg.bindir().join("pg_recvlogical"));
                cmd.args(["-h", pg.host(), "-p", &pg.port().to_string()])
                    .args(["-U", pg.user(), "-d", "postgres"])
                    .args(["--slot", slot, "--start", "--no-loop"])
                    .args(["-f", "/dev/null", "-o", "proto_version=1"])
                    .args(["--endpos", target, "-s", "1", "-F", "1"]);
                if kind == Contender::CeilingMessages {
                    // Decodes the messages too, as walbox asks the server to.
                    cmd.args(["-o", &format!("publication_names={MESSAGES_PUBLICATION}")])
                        .args(["-o", "messages=true"]);
                } else {
                    cmd.args(["-o", "publication_names=walbox_outbox"]);
                }
                return Ok(cmd
                    .stdout(Stdio::null())
                    // Silent unless it fails (no --verbose).
                    .stderr(stderr)
                    .spawn()?);
            }
            Contender::WalboxStdout => "stdout",
            Contender::WalboxKafka
            | Contender::WalboxKafkaMetrics
            | Contender::WalboxKafkaWorkers
            | Contender::WalboxKafkaMessages => "kafka",
            Contender::WalboxNats => "nats",
            Contender::WalboxRedis => "redis",
            Contender::WalboxRabbitMq | Contender::WalboxRabbitMqExchange => "rabbitmq",
            Contender::BaselineKafka
            | Contender::BaselineNats
            | Contender::BaselineKafkaMessages
            | Contender::BaselineRedis => {
                return Err("base() maps a baseline contender to its own".into());
            }
        };
        let mut cmd = Command::new(walbox);
        if count_allocations {
            cmd.env("WALBOX_COUNT_ALLOCATIONS", "1");
        }
        // Every walbox contender reports positions every STATUS_INTERVAL_MS, so
        // that a drain's end is known to that.
        let mut config = format!("[source]\nstatus_interval_ms = {STATUS_INTERVAL_MS}\n\n");
        if kind == Contender::WalboxKafkaMessages {
            // Messages of prefix walbox and a publication without tables.
            let topic = topic.map_or_else(String::new, |t| format!("topic = \"{t}\"\n"));
            config += &format!("[[messages]]\nprefix = \"{MESSAGES_PREFIX}\"\n{topic}");
            cmd.env("WALBOX_PUBLICATION", MESSAGES_PUBLICATION);
        } else if let Some(topic) = topic {
            // The run's own topic, for the table of the command line.
            cmd.env("WALBOX_TOPIC", topic);
        }
        match kind {
            // The stream in memory, as the broker keeps its topics; deleted
            // after each run (reset_stream), so every run starts from an empty
            // stream without the ids of the one before.
            Contender::WalboxNats => {
                config += &format!(
                    "[sink]\ntype = \"nats\"\n\n[sink.nats]\nservers = [\"{}\"]\n\
                     stream = \"{NATS_STREAM}\"\ncreate_stream = true\n\
                     subjects = [\"outbox.>\"]\nstorage = \"memory\"\n",
                    nats.url()
                );
            }
            Contender::WalboxRedis => {
                config += &format!(
                    "[sink]\ntype = \"redis\"\n\n[sink.redis]\nurl = \"{}\"\n",
                    redis.url()
                );
            }
            // A stream of the run's own (the run's topic), created by walbox,
            // and producer names of the run's own.
            Contender::WalboxRabbitMq => {
                config += &format!(
                    "[sink]\ntype = \"rabbitmq\"\n\n[sink.rabbitmq]\nmode = \"stream\"\n\
                     port = {}\nstream_port = {}\ndeclare = true\nproducer = \"{slot}\"\n",
                    rabbitmq.amqp_port(),
                    rabbitmq.stream_port()
                );
            }
            // Exchange mode to the bench's exchange, the run's topic as the
            // routing key (a queue of the run's own is bound to it first).
            Contender::WalboxRabbitMqExchange => {
                config += &format!(
                    "[sink]\ntype = \"rabbitmq\"\n\n[sink.rabbitmq]\nmode = \"exchange\"\n\
                     port = {}\nexchange = \"{RABBITMQ_EXCHANGE}\"\n",
                    rabbitmq.amqp_port()
                );
            }
            _ => {}
        }
        let config_file = pg.client_dir().join(format!("{slot}.toml"));
        std::fs::write(&config_file, config)?;
        cmd.env("WALBOX_CONFIG", config_file);
        if kind == Contender::WalboxKafkaWorkers {
            cmd.env("WALBOX_WORKER_THREADS", WORKER_THREADS.to_string());
        }
        let metrics = if kind == Contender::WalboxKafkaMetrics {
            let addr = format!("127.0.0.1:{}", free_port()?);
            cmd.env("WALBOX_METRICS_LISTEN", &addr);
            Some(addr)
        } else {
            None
        };
        let child = cmd
            .arg("run")
            .env("WALBOX_DSN", pg.conninfo("postgres"))
            .env("WALBOX_SLOT", slot)
            .env("WALBOX_CHECKPOINT", checkpoint_file(pg, slot))
            .env("WALBOX_SINK", sink)
            .env("WALBOX_BOOTSTRAP_SERVERS", broker.bootstrap())
            .env("WALBOX_CREATE_TOPICS", "true")
            .env("WALBOX_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()?;
        if let Some(addr) = metrics {
            scrape_while_running(child.id(), format!("http://{addr}/metrics"));
        }
        Ok(child)
    }
}

/// The publication of the messages scenario: no tables (messages are not
/// filtered by a publication; pgoutput needs one named all the same).
pub const MESSAGES_PUBLICATION: &str = "walbox_messages";

/// The prefix the messages scenario emits and walbox relays.
pub const MESSAGES_PREFIX: &str = "walbox";

/// The exchange of the RabbitMQ exchange-mode contender (a durable topic
/// exchange, declared by the bench).
pub const RABBITMQ_EXCHANGE: &str = "bench";

/// The JetStream stream of the JetStream contender.
pub const NATS_STREAM: &str = "OUTBOX";

/// Deletes the JetStream contender's stream (and with it the message ids its
/// duplicate window holds), if it exists.
pub async fn reset_stream(nats: &NatsServer) -> Result<(), Error> {
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await?);
    match js.delete_stream(NATS_STREAM).await {
        Ok(_) => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                async_nats::jetstream::context::DeleteStreamErrorKind::JetStream(ref j)
                    if j.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// A port on 127.0.0.1 that was free a moment ago.
fn free_port() -> Result<u16, Error> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Scrapes `url` every [`SCRAPE_EVERY`] on a thread of its own, as Prometheus
/// would, for as long as process `pid` exists.
fn scrape_while_running(pid: u32, url: String) {
    std::thread::spawn(move || {
        let alive = format!("/proc/{pid}");
        while Path::new(&alive).exists() {
            let _ = walbox_testkit::prometheus::get(&url);
            std::thread::sleep(SCRAPE_EVERY);
        }
    });
}

/// Where walbox keeps its checkpoint for `slot`.
pub fn checkpoint_file(pg: &PgCluster, slot: &str) -> std::path::PathBuf {
    pg.client_dir().join(format!("{slot}.checkpoint.json"))
}

/// Figures of one run of one contender.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub seconds: f64,
    /// `None` for a contender that runs inside the benchmark's own process.
    pub peak_rss_kb: Option<u64>,
    pub cpu_seconds: f64,
    /// The context switches of the contender's threads (`None` for the
    /// bench's own).
    pub switches: Option<Switches>,
    /// What a counting build of walbox allocated (the allocations scenario).
    pub allocations: Option<Allocations>,
}

/// A counting build's `allocations: N reallocations: R bytes: B` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocations {
    pub allocations: u64,
    pub reallocations: u64,
    pub bytes: u64,
}

impl Allocations {
    /// The figures of `line`, if it is the counting build's summary.
    pub fn parse(line: &str) -> Option<Allocations> {
        let mut words = line.split_whitespace();
        let mut field = |name: &str| -> Option<u64> {
            (words.next()? == name).then_some(())?;
            words.next()?.parse().ok()
        };
        Some(Allocations {
            allocations: field("allocations:")?,
            reallocations: field("reallocations:")?,
            bytes: field("bytes:")?,
        })
    }
}

/// Context switches of a process, summed over its threads as they are at the
/// reading (a thread that ended takes its own with it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Switches {
    /// The thread gave up its core: waiting for I/O, a lock or a wake-up.
    pub voluntary: u64,
    /// The scheduler took the core from it for another runnable thread.
    pub involuntary: u64,
}

impl Switches {
    /// Of process `pid`, read from /proc/PID/task/*/status.
    pub fn of(pid: u32) -> Switches {
        let mut total = Switches::default();
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return total;
        };
        for task in tasks.flatten() {
            let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
                continue;
            };
            for line in status.lines() {
                let field = |name: &str| {
                    line.strip_prefix(name)
                        .and_then(|v| v.trim().parse::<u64>().ok())
                };
                if let Some(n) = field("voluntary_ctxt_switches:") {
                    total.voluntary += n;
                } else if let Some(n) = field("nonvoluntary_ctxt_switches:") {
                    total.involuntary += n;
                }
            }
        }
        total
    }

    /// The larger of each count.
    fn max(self, other: Switches) -> Switches {
        Switches {
            voluntary: self.voluntary.max(other.voluntary),
            involuntary: self.involuntary.max(other.involuntary),
        }
    }
}

/// Peak RSS (kB) and CPU seconds of a running process.
pub fn usage(pid: u32) -> (u64, f64) {
    let hwm = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0);
    let ticks = clock_ticks();
    let cpu = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let after = s.rsplit_once(')')?.1;
            let f: Vec<&str> = after.split_whitespace().collect();
            let utime: f64 = f.get(11)?.parse().ok()?;
            let stime: f64 = f.get(12)?.parse().ok()?;
            Some((utime + stime) / ticks)
        })
        .unwrap_or(0.0);
    (hwm, cpu)
}

/// Clock ticks per second; 100 on Linux unless configured otherwise.
fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// An LSN (or any text) the query returns.
pub async fn lsn(db: &tokio_postgres::Client, sql: &str) -> Result<String, Error> {
    Ok(db.query_one(sql, &[]).await?.get(0))
}

/// Bytes of WAL between two LSNs (in text form).
pub async fn wal_between(db: &tokio_postgres::Client, from: &str, to: &str) -> Result<i64, Error> {
    Ok(db
        .query_one(
            "SELECT ($1::text::pg_lsn - $2::text::pg_lsn)::bigint",
            &[&to, &from],
        )
        .await?
        .get(0))
}

/// Whether `slot` has confirmed `target`.
pub async fn slot_reached(
    db: &tokio_postgres::Client,
    slot: &str,
    target: &str,
) -> Result<bool, Error> {
    Ok(db
        .query_one(
            "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot, &target],
        )
        .await?
        .get(0))
}

/// Drops `slot` once its walsender is gone: a contender's exit ends its
/// connection, but the server notices a moment later.
pub async fn drop_slot(db: &tokio_postgres::Client, slot: &str) -> Result<(), Error> {
    let waiting = Instant::now();
    loop {
        let active: bool = db
            .query_one(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await?
            .get(0);
        if !active {
            break;
        }
        if waiting.elapsed() > Duration::from_secs(30) {
            return Err(format!(
                "slot {slot} is still in use 30 s after its contender stopped: \
                 see pg_stat_replication for the walsender holding it"
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    db.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await?;
    Ok(())
}

/// Runs `child` until `slot` has confirmed `target`, sampling its usage.
pub async fn drain(
    name: &str,
    db: &tokio_postgres::Client,
    slot: &str,
    target: &str,
    mut child: Child,
    started: Instant,
) -> Result<Run, Error> {
    let pid = child.id();
    let mut last = (0u64, 0.0f64);
    let mut switches = Switches::default();
    // Sample every 20 ms (the timing resolution) until the slot has it all.
    let deadline = started + Duration::from_secs(3600);
    loop {
        if child.try_wait()?.is_some() {
            // pg_recvlogical exits by itself at --endpos (after confirming it).
            break;
        }
        // A process that exits between the check above and this read leaves a
        // zombie without VmHWM: keep the highest reading.
        let now = usage(pid);
        last = (last.0.max(now.0), last.1.max(now.1));
        switches = switches.max(Switches::of(pid));
        if slot_reached(db, slot, target).await? {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("{name} did not drain the backlog within an hour").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    if let Some(status) = child.try_wait()? {
        // An exit is only a finish if the slot has it all: a contender that
        // failed must not pass for a fast one. The last confirmation can reach
        // the server just after the process exited.
        let settle = Instant::now();
        while !slot_reached(db, slot, target).await? {
            if settle.elapsed() > Duration::from_secs(10) {
                return Err(format!(
                    "{name} exited ({status}) before slot {slot} confirmed {target}: see its output above"
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    } else {
        last = usage(pid);
        switches = switches.max(Switches::of(pid));
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid)?),
            nix::sys::signal::Signal::SIGTERM,
        );
        child.wait()?;
    }
    Ok(Run {
        seconds,
        peak_rss_kb: Some(last.0),
        cpu_seconds: last.1,
        switches: Some(switches),
        allocations: None,
    })
}
