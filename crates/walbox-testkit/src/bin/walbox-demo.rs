//! `make demo`: walbox end to end on throwaway infrastructure.
//!
//! Starts a PostgreSQL cluster (`wal_level=logical`) and a Kafka-protocol broker
//! (or, with `--sink nats`, a JetStream server; with `--sink redis`, a Redis
//! server with an fsynced append-only file; with `--sink rabbitmq`, a RabbitMQ
//! node, an exchange and a durable queue bound to it; with `--sink webhook`, an
//! HTTP receiver that records each signed POST; with `--sink pubsub`, Google's
//! Pub/Sub emulator and a subscription with message ordering),
//! creates an outbox table, runs `walbox setup` and `walbox run`, lets four
//! concurrent writers commit a few hundred outbox events, reads them back from the
//! topic and prints them with a summary: events, keys, per-key order, and the slot's
//! confirmed position against the last commit. Everything is removed on exit.

#![allow(clippy::print_stdout)] // this program's output is its purpose

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use walbox_testkit::{
    Broker, NatsServer, OUTBOX_DDL, PgCluster, PgOptions, PubSubEmulator, RabbitMq, Receiver,
    RedisServer, kafka, wait_until_async,
};

const WRITERS: usize = 4;
const EVENTS_PER_WRITER: usize = 75;
const KEYS: usize = 20;
const TOPIC: &str = "outbox.order";

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The value of `--name` on the command line.
fn arg(name: &str) -> Option<String> {
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == name {
            return args.next();
        }
    }
    None
}

/// The broker the demo publishes to, kept running until the end.
#[derive(Debug)]
enum Destination {
    Kafka(Broker),
    Nats(NatsServer),
    Webhook(Receiver),
    Redis(RedisServer),
    RabbitMq(RabbitMq),
    PubSub(PubSubEmulator),
}

impl Destination {
    fn is_nats(&self) -> bool {
        matches!(self, Destination::Nats(_))
    }

    /// The receiver's 2xx arrivals as records (partition 0, arrival order as
    /// offset), once at least `wanted` came.
    async fn delivered(&self, wanted: usize) -> Result<Option<Vec<kafka::Record>>, Error> {
        let Destination::Webhook(r) = self else {
            return Ok(None);
        };
        wait_until_async(
            "the receiver's 2xx arrivals",
            Duration::from_secs(120),
            || async { (r.delivered().len() >= wanted).then_some(()) },
        )
        .await?;
        Ok(Some(
            r.delivered()
                .into_iter()
                .enumerate()
                .map(|(i, a)| kafka::Record {
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
                .collect(),
        ))
    }

    /// The broker's log so far, for a failed demo.
    fn log_tail(&self) -> String {
        match self {
            Destination::Kafka(b) => b.log_tail(),
            Destination::Nats(n) => n.log_tail(),
            Destination::Webhook(r) => format!(
                "{} requests, {} answered 2xx",
                r.count(),
                r.delivered().len()
            ),
            Destination::Redis(r) => r.log_tail(),
            Destination::RabbitMq(r) => r.log_tail(),
            Destination::PubSub(e) => e.log_tail(),
        }
    }
}

fn walbox_binary() -> PathBuf {
    if let Some(p) = arg("--walbox") {
        return PathBuf::from(p);
    }
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("walbox")))
        .unwrap_or_else(|| PathBuf::from("walbox"))
}

async fn lsn(db: &tokio_postgres::Client, sql: &str) -> Result<String, Error> {
    Ok(db.query_one(sql, &[]).await?.get(0))
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let walbox = walbox_binary();
    let sink = arg("--sink").unwrap_or_else(|| "kafka".into());
    let nats = match sink.as_str() {
        "kafka" | "rabbitmq" | "redis" | "webhook" | "pubsub" => false,
        "nats" => true,
        other => {
            return Err(format!(
                "--sink {other}: use kafka, nats, rabbitmq, redis, pubsub or webhook"
            )
            .into());
        }
    };
    let redis = sink == "redis";
    let pg = PgCluster::start_with(PgOptions::default().setting("timezone", "UTC"))?;
    let (destination, address) = if sink == "webhook" {
        println!("== starting a throwaway PostgreSQL (wal_level=logical) and an HTTP receiver");
        let receiver = Receiver::start()?;
        let url = receiver.base_url();
        (Destination::Webhook(receiver), url)
    } else if redis {
        println!("== starting a throwaway PostgreSQL (wal_level=logical) and a Redis server");
        let server = RedisServer::start()?;
        let url = server.url();
        (Destination::Redis(server), url)
    } else if sink == "pubsub" {
        println!("== starting a throwaway PostgreSQL (wal_level=logical) and the Pub/Sub emulator");
        let emulator = PubSubEmulator::start()?;
        // Made before walbox publishes: a subscription holds what comes after.
        emulator.create_subscription("outbox.order.demo", TOPIC, true)?;
        let host = emulator.host();
        (Destination::PubSub(emulator), host)
    } else if sink == "rabbitmq" {
        println!("== starting a throwaway PostgreSQL (wal_level=logical) and a RabbitMQ node");
        let node = RabbitMq::start()?;
        node.declare_exchange("outbox", "topic").await?;
        node.bind_queue("outbox.demo", "outbox", "#").await?;
        let url = format!("amqp://127.0.0.1:{}", node.amqp_port());
        (Destination::RabbitMq(node), url)
    } else if nats {
        println!("== starting a throwaway PostgreSQL (wal_level=logical) and a JetStream server");
        let server = NatsServer::start()?;
        let url = server.url();
        (Destination::Nats(server), url)
    } else {
        println!(
            "== starting a throwaway PostgreSQL (wal_level=logical) and a Kafka-protocol broker"
        );
        let broker = Broker::start()?;
        let bootstrap = broker.bootstrap();
        (Destination::Kafka(broker), bootstrap)
    };
    println!("   postgres {}:{}   broker {address}", pg.host(), pg.port());
    let db = pg.connect("postgres").await?;
    db.batch_execute(OUTBOX_DDL).await?;
    let config = pg.client_dir().join("walbox-demo.toml");
    std::fs::write(
        &config,
        if redis {
            format!("[sink]\ntype = \"redis\"\n\n[sink.redis]\nurl = \"{address}\"\n")
        } else if sink == "pubsub" {
            format!(
                "[sink]\ntype = \"pubsub\"\n\n[sink.pubsub]\nproject = \"{}\"\n\
                 emulator_host = \"{address}\"\nverify_subscription = \"{{topic}}.demo\"\n",
                PubSubEmulator::PROJECT
            )
        } else if sink == "rabbitmq" {
            format!(
                "[sink]\ntype = \"rabbitmq\"\n\n[sink.rabbitmq]\nport = {}\n\
                 exchange = \"outbox\"\nverify_queue = \"outbox.demo\"\n",
                address.rsplit(':').next().unwrap_or_default()
            )
        } else if nats {
            format!(
                "[sink]\ntype = \"nats\"\n\n[sink.nats]\nservers = [\"{address}\"]\n\
                 create_stream = true\nsubjects = [\"outbox.>\"]\n"
            )
        } else if sink == "webhook" {
            format!(
                "[sink]\ntype = \"webhook\"\n\n[sink.webhook]\nurl = \"{address}/hooks/{{topic}}\"\n\
                 secrets = [\"whsec_ZGVtbyBzZWNyZXQgb25seSBmb3IgdGhlIGRlbW8=\"]\n\
                 dead_letter_file = \"{}\"\n",
                pg.client_dir().join("dead-letters.jsonl").display()
            )
        } else {
            String::new()
        },
    )?;
    let env = [
        ("WALBOX_DSN", pg.conninfo("postgres")),
        ("WALBOX_CONFIG", config.display().to_string()),
        ("WALBOX_BOOTSTRAP_SERVERS", address.clone()),
        ("WALBOX_CREATE_TOPICS", "true".into()),
        ("WALBOX_PRODUCER", "walbox-demo".into()),
        (
            "WALBOX_CHECKPOINT",
            pg.client_dir()
                .join("walbox.checkpoint.json")
                .display()
                .to_string(),
        ),
    ];

    println!("== walbox setup");
    let out = Command::new(&walbox)
        .arg("setup")
        .envs(env.clone())
        .output()?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        return Err(format!(
            "walbox setup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }

    println!("== walbox run (its log: below, after the events)");
    let log_dir = tempfile::tempdir()?;
    let log_path = log_dir.path().join("walbox.log");
    let log = std::fs::File::create(&log_path)?;
    let mut relay = Command::new(&walbox)
        .arg("run")
        .envs(env.clone())
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .spawn()?;

    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let client = pg.connect("postgres").await?;
        writers.push(tokio::spawn(async move {
            for n in 0..EVENTS_PER_WRITER {
                // Writer w owns the keys k with k % WRITERS == w, so each key's
                // commit order is this loop's order, numbered by `step`.
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
    let rows: i64 = db
        .query_one("SELECT count(*) FROM outbox", &[])
        .await?
        .get(0);
    let last_commit = lsn(&db, "SELECT pg_current_wal_lsn()::text").await?;
    println!(
        "== {WRITERS} concurrent writers committed {rows} outbox events (WAL now at {last_commit})"
    );

    let wanted = usize::try_from(rows)?;
    let records = if let Some(records) = destination.delivered(wanted).await? {
        records
    } else if redis {
        walbox_testkit::redis::read_at_least(&address, TOPIC, wanted, Duration::from_secs(120))
            .await?
    } else if let Destination::PubSub(emulator) = &destination {
        emulator.read_at_least("outbox.order.demo", TOPIC, wanted, Duration::from_secs(120))?
    } else if let Destination::RabbitMq(node) = &destination {
        let mut got = Vec::new();
        for _ in 0..240 {
            got = node.read_queue("outbox.demo").await?;
            if got.len() >= wanted {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        got
    } else if destination.is_nats() {
        walbox_testkit::nats::read_at_least(&address, TOPIC, wanted, Duration::from_secs(120))
            .await
            .map_err(|e| e.to_string())?
    } else {
        let bootstrap = address.clone();
        tokio::task::spawn_blocking(move || {
            kafka::read_at_least(&bootstrap, TOPIC, wanted, Duration::from_secs(120))
        })
        .await??
    };
    wait_until_async("the slot to confirm the last commit", Duration::from_secs(60), || async {
        let row = db
            .query_one(
                "SELECT confirmed_flush_lsn >= $1::text::pg_lsn FROM pg_replication_slots WHERE slot_name = 'walbox'",
                &[&last_commit],
            )
            .await
            .ok()?;
        row.get::<_, bool>(0).then_some(())
    })
    .await?;
    let confirmed = lsn(
        &db,
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'walbox'",
    )
    .await?;

    let place = if sink == "webhook" {
        format!("as the receiver took them (2xx) at {address}/hooks/{TOPIC}")
    } else {
        format!("read back from topic {TOPIC}")
    };
    println!("== the events, {place} (partition @offset key event payload)");
    let mut sorted: Vec<&kafka::Record> = records.iter().collect();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    let mut per_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in &sorted {
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap_or_default())?;
        let key = r.key_str().unwrap_or("-").to_owned();
        println!(
            "  p{} @{:<4} {:<9} {:<13} {}",
            r.partition,
            r.offset,
            key,
            r.header("event_type").unwrap_or("-"),
            v["payload"]
        );
        per_key
            .entry(key)
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

    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(relay.id())?),
        nix::sys::signal::Signal::SIGTERM,
    );
    let status = relay.wait()?;
    println!("== walbox log");
    for line in std::fs::read_to_string(&log_path)?.lines() {
        println!("  {line}");
    }
    println!("== summary");
    println!(
        "  events {:<19}{} ({} distinct event ids) of {rows} committed",
        if sink == "webhook" {
            "received (2xx):"
        } else {
            "in the topic:"
        },
        records.len(),
        ids.len()
    );
    println!(
        "  keys:                     {} (each on one partition, in commit order: {})",
        per_key.len(),
        if in_order { "yes" } else { "NO" }
    );
    println!("  slot confirmed_flush_lsn: {confirmed} (last commit at or before {last_commit})");
    println!("  walbox stopped on SIGTERM: {status}");
    if records.len() != wanted || ids.len() != wanted || !in_order || !status.success() {
        println!("== broker log\n{}", destination.log_tail());
        return Err("the demo's checks failed".into());
    }
    Ok(())
}
