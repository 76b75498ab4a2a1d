//! `make demo`: walbox end to end on throwaway infrastructure.
//!
//! Starts a PostgreSQL cluster (`wal_level=logical`) and the destination of
//! `--sink` (default kafka: a Kafka-protocol broker; nats: a JetStream server;
//! rabbitmq: a RabbitMQ node with an exchange and a durable queue bound to it;
//! rabbitmq-stream: a RabbitMQ node, walbox in stream mode;
//! redis: a Redis server with an fsynced append-only file; webhook: an HTTP
//! receiver that records each signed POST; stdout: a file for walbox's
//! standard output), creates an outbox table, writes walbox's configuration
//! with `walbox init` and fills in the destination's address, runs `walbox
//! setup` and `walbox run`, lets four concurrent writers commit a few hundred
//! outbox events, reads them back from the destination and prints them with a
//! summary in the destination's words: events, keys, per-key order, and the
//! slot's confirmed position against the last commit. Everything is removed
//! on exit.

#![allow(clippy::print_stdout)] // this program's output is its purpose

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use walbox_testkit::demo::{self, Destination, WRITERS};
use walbox_testkit::{OUTBOX_DDL, PgCluster, PgOptions, wait_until_async};

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
    // walbox's paths (the configuration's) are made absolute, since walbox
    // runs in the demo's own directory.
    let walbox = std::path::absolute(walbox_binary())?;
    let sink = arg("--sink").unwrap_or_else(|| "kafka".into());
    let pg = PgCluster::start_with(PgOptions::default().setting("timezone", "UTC"))?;
    let destination = Destination::start(&sink).await?;
    println!(
        "== started a throwaway PostgreSQL (wal_level=logical) and {}",
        destination.describe()
    );
    println!(
        "   postgres {}:{}   {sink} {}",
        pg.host(),
        pg.port(),
        destination.address()
    );
    let db = pg.connect("postgres").await?;
    db.batch_execute(OUTBOX_DDL).await?;

    // walbox runs in a directory of the cluster's: its checkpoint (and the
    // webhook sink's dead-letter file) go there and are removed with it.
    let dir = pg.client_dir();
    let config = dir.join("walbox.toml");
    // rabbitmq-stream: the rabbitmq sink type in stream mode.
    let sink_type = sink.strip_suffix("-stream").unwrap_or(&sink);
    println!("== walbox init --sink {sink_type}, then its address filled in");
    let out = Command::new(&walbox)
        .current_dir(&dir)
        .args(["init", "--sink", sink_type, "--output"])
        .arg(&config)
        .arg("--dsn")
        .arg(pg.conninfo("postgres"))
        .output()?;
    if !out.status.success() {
        return Err(format!(
            "walbox init failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let written = std::fs::read_to_string(&config)?;
    std::fs::write(&config, destination.fill_in(&written)?)?;
    let mut env = vec![
        ("WALBOX_CONFIG", config.display().to_string()),
        ("WALBOX_PRODUCER", "walbox-demo".into()),
    ];
    // The AWS stand-ins' region and credentials, from the AWS chain.
    env.extend(destination.env());

    println!("== walbox setup");
    let out = Command::new(&walbox)
        .current_dir(&dir)
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
    let stdout = if destination.is_stdout() {
        Stdio::from(std::fs::File::create(destination.stdout_path())?)
    } else {
        Stdio::from(log.try_clone()?)
    };
    let mut relay = Command::new(&walbox)
        .current_dir(&dir)
        .arg("run")
        .envs(env.clone())
        .stdout(stdout)
        .stderr(Stdio::from(log))
        .spawn()?;

    demo::write_events(&pg).await?;
    let rows: i64 = db
        .query_one("SELECT count(*) FROM outbox", &[])
        .await?
        .get(0);
    let last_commit = lsn(&db, "SELECT pg_current_wal_lsn()::text").await?;
    println!(
        "== {WRITERS} concurrent writers committed {rows} outbox events (WAL now at {last_commit})"
    );

    let wanted = usize::try_from(rows)?;
    let records = destination.read_back(wanted).await?;
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

    let partitions = destination.has_partitions();
    println!(
        "== the events, read back from {} ({}@position key event payload)",
        destination.place(),
        if partitions { "partition " } else { "" }
    );
    let mut sorted: Vec<&walbox_testkit::kafka::Record> = records.iter().collect();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    for r in &sorted {
        println!(
            "  {}@{:<4} {:<9} {:<13} {}",
            if partitions {
                format!("p{} ", r.partition)
            } else {
                String::new()
            },
            r.offset,
            r.key_str().unwrap_or("-"),
            r.header("event_type").unwrap_or("-"),
            demo::envelope(r)?["payload"]
        );
    }
    let checked = demo::check(&records)?;

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
    let events = format!("events {}:", destination.events_where());
    println!(
        "  {events:<30}{} ({} distinct event ids) of {rows} committed",
        records.len(),
        checked.ids
    );
    println!(
        "  {:<30}{} ({}: {})",
        "keys:",
        checked.per_key.len(),
        destination.key_order(),
        if checked.in_order { "yes" } else { "NO" }
    );
    println!(
        "  {:<30}{confirmed} (last commit at or before {last_commit})",
        "slot confirmed_flush_lsn:"
    );
    println!("  {:<30}{status}", "walbox stopped on SIGTERM:");
    if records.len() != wanted || checked.ids != wanted || !checked.in_order || !status.success() {
        println!("== {sink} log\n{}", destination.log_tail());
        return Err("the demo's checks failed".into());
    }
    Ok(())
}
