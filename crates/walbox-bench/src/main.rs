//! `make bench`: how fast walbox drains a backlog and one huge transaction, next to
//! how fast PostgreSQL can hand the same changes out at all, and next to the
//! polling relay it replaces.
//!
//! One run, one machine. Rows like a real service writes them (uuid id, aggregate
//! type, one of 1,000 aggregate ids, event type, a ~300-byte jsonb payload, a
//! headers jsonb with a traceparent). For each slot scenario, one slot per
//! contender is created before the load, so each drains identical WAL:
//!
//! - `pg_recvlogical` (pgoutput, protocol 1) to /dev/null: the ceiling;
//! - `walbox run --sink stdout` to /dev/null: walbox without a broker;
//! - `walbox run` to the broker.
//!
//! Each is timed from its start until the slot's `confirmed_flush_lsn` reaches the
//! last commit; peak RSS (VmHWM) and CPU seconds come from /proc. Scenarios:
//!
//! 1. Backlog drain: `--events` (default 1,000,000) in transactions of 10; then the
//!    polling relay (`polling.rs`), both variants, publishes the same rows, with
//!    the extra WAL its UPDATEs write per event.
//! 2. One transaction of `--big-txn` rows (default 1,000,000).
//! 3. Steady load: four writers commit single-row transactions at 1,000, 5,000
//!    and 20,000 events/s for `--steady-seconds` (default 60) while walbox streams
//!    to the broker; walbox reports commit-to-acknowledgement latency (the
//!    server's commit time to the broker's acknowledgement, p50/p95/p99/max) and,
//!    of it, the commit-to-read latency (to walbox reading the transaction); the
//!    bench samples the slot's lag every second.
//!
//! `--only backlog,polling,big-txn,steady` runs some of them and `--rates` picks
//! the steady rates; only a full run writes the charts. Figures are printed with
//! the setup they came from.

#![allow(clippy::print_stdout)] // the report is the output

mod polling;
mod svg;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use walbox_testkit::{Broker, OUTBOX_DDL, PgCluster, PgOptions};

type Error = Box<dyn std::error::Error + Send + Sync>;

struct Args {
    events: u64,
    big_txn: u64,
    steady_seconds: u64,
    svg_dir: Option<PathBuf>,
    walbox: PathBuf,
    /// Scenarios to run (all by default).
    only: Vec<Scenario>,
    /// Rates of the steady-load scenario, events/s.
    rates: Vec<u64>,
}

/// A part of the run that `--only` can pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Backlog,
    Polling,
    BigTxn,
    Steady,
}

impl Scenario {
    const ALL: [Scenario; 4] = [
        Scenario::Backlog,
        Scenario::Polling,
        Scenario::BigTxn,
        Scenario::Steady,
    ];

    fn parse(s: &str) -> Result<Self, Error> {
        Ok(match s {
            "backlog" => Scenario::Backlog,
            "polling" => Scenario::Polling,
            "big-txn" => Scenario::BigTxn,
            "steady" => Scenario::Steady,
            other => {
                return Err(format!(
                    "--only: unknown scenario {other:?} (backlog, polling, big-txn, steady)"
                )
                .into());
            }
        })
    }
}

fn args() -> Result<Args, Error> {
    let mut a = Args {
        events: 500_000,
        big_txn: 1_000_000,
        steady_seconds: 60,
        svg_dir: None,
        walbox: std::env::current_exe()?
            .parent()
            .map(|d| d.join("walbox"))
            .unwrap_or_else(|| PathBuf::from("walbox")),
        only: Scenario::ALL.to_vec(),
        rates: vec![1_000, 5_000, 20_000],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--events" => a.events = it.next().ok_or("--events needs a number")?.parse()?,
            "--big-txn" => a.big_txn = it.next().ok_or("--big-txn needs a number")?.parse()?,
            "--svg-dir" => {
                a.svg_dir = Some(PathBuf::from(it.next().ok_or("--svg-dir needs a path")?));
            }
            "--steady-seconds" => {
                a.steady_seconds = it
                    .next()
                    .ok_or("--steady-seconds needs a number")?
                    .parse()?;
            }
            "--walbox" => a.walbox = PathBuf::from(it.next().ok_or("--walbox needs a path")?),
            "--rates" => {
                let list = it.next().ok_or("--rates needs a list such as 1000,5000")?;
                a.rates = comma_list(&list, |r| Ok(r.parse()?))?;
            }
            "--only" => {
                let list = it
                    .next()
                    .ok_or("--only needs a list such as backlog,steady")?;
                a.only = comma_list(&list, Scenario::parse)?;
            }
            other => {
                return Err(format!(
                    "unknown argument {other:?} (use --events N, --big-txn N, --steady-seconds N, --svg-dir DIR, --walbox PATH, --only LIST, --rates LIST)"
                )
                .into());
            }
        }
    }
    if a.events == 0 || !a.events.is_multiple_of(10) {
        return Err("--events must be a positive multiple of 10".into());
    }
    if a.big_txn == 0 || a.steady_seconds == 0 || a.rates.contains(&0) {
        return Err("--big-txn, --steady-seconds and --rates must be positive".into());
    }
    Ok(a)
}

/// The items of a comma-separated flag value.
fn comma_list<T>(list: &str, item: impl Fn(&str) -> Result<T, Error>) -> Result<Vec<T>, Error> {
    list.split(',').map(item).collect()
}

/// Peak RSS (kB) and CPU seconds of a running process.
fn usage(pid: u32) -> (u64, f64) {
    let hwm = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0);
    let ticks = nix_ticks();
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

fn nix_ticks() -> f64 {
    // Clock ticks per second; 100 on Linux unless configured otherwise.
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

struct Figures {
    name: &'static str,
    seconds: f64,
    /// `None` for a contender that runs inside the benchmark's own process.
    peak_rss_kb: Option<u64>,
    cpu_seconds: f64,
    /// WAL the contender itself writes per event (the polling relay's UPDATEs).
    extra_wal_per_event: Option<f64>,
}

async fn lsn(db: &tokio_postgres::Client, sql: &str) -> Result<String, Error> {
    Ok(db.query_one(sql, &[]).await?.get(0))
}

/// Whether `slot` has confirmed `target`.
/// Bytes of WAL between two LSNs (in text form).
async fn wal_between(db: &tokio_postgres::Client, from: &str, to: &str) -> Result<i64, Error> {
    Ok(db
        .query_one(
            "SELECT ($1::text::pg_lsn - $2::text::pg_lsn)::bigint",
            &[&to, &from],
        )
        .await?
        .get(0))
}

async fn slot_reached(
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

/// Runs `child` until `slot` has confirmed `target`, sampling its usage.
async fn drain(
    name: &'static str,
    db: &tokio_postgres::Client,
    slot: &str,
    target: &str,
    mut child: Child,
    started: Instant,
) -> Result<Figures, Error> {
    let pid = child.id();
    let mut last = (0u64, 0.0f64);
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
        let done = slot_reached(db, slot, target).await?;
        if done {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("{name} did not drain the backlog within an hour").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    if child.try_wait()?.is_none() {
        last = usage(pid);
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid)?),
            nix::sys::signal::Signal::SIGTERM,
        );
        child.wait()?;
    }
    Ok(Figures {
        name,
        seconds,
        peak_rss_kb: Some(last.0),
        cpu_seconds: last.1,
        extra_wal_per_event: None,
    })
}

/// One outbox row like a real service writes it, for row number `n` (an SQL
/// expression) of transaction `t`.
const ROW_SELECT: &str = "
    SELECT 'order', 'order-' || (n % 1000), 'OrderPlaced',
           jsonb_build_object(
             'order_id', 'ord-' || n, 'customer_id', 'cus-' || (n * 7 % 5000),
             'currency', 'EUR', 'total_cents', n * 13 % 100000,
             'lines', jsonb_build_array(
               jsonb_build_object('sku', 'SKU-' || (n % 977), 'qty', 2, 'unit_cents', 1299),
               jsonb_build_object('sku', 'SKU-' || (n * 3 % 977), 'qty', 1, 'unit_cents', 4550)),
             'shipping', jsonb_build_object('method', 'standard', 'country', 'DE'),
             'note', 'leave at the door'),
           jsonb_build_object('traceparent', '00-' || md5(n::text) || '-00f067aa0ba902b7-01'),
           1";

const INSERT: &str = "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, schema_version)";

/// What every scenario shares.
struct Bench {
    a: Args,
    pg: PgCluster,
    broker: Broker,
    db: tokio_postgres::Client,
}

const SLOTS: [&str; 3] = ["ceiling", "walbox_stdout", "walbox_kafka"];

impl Bench {
    /// Creates one slot per contender, runs `load`, then lets each contender
    /// drain its slot; returns the figures and the WAL the load wrote.
    async fn drain_slots(&self, load: &str) -> Result<(Vec<Figures>, i64), Error> {
        let db = &self.db;
        for slot in SLOTS {
            db.execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&slot],
            )
            .await?;
        }
        db.batch_execute("CHECKPOINT").await?;
        let start_lsn = lsn(db, "SELECT pg_current_wal_lsn()::text").await?;
        let loading = Instant::now();
        db.batch_execute(load).await?;
        let target = lsn(db, "SELECT pg_current_wal_lsn()::text").await?;
        let wal_bytes = wal_between(db, &start_lsn, &target).await?;
        println!(
            "loaded in {:.1} s: {:.1} MB of WAL",
            loading.elapsed().as_secs_f64(),
            wal_bytes as f64 / 1e6
        );
        let mut results = Vec::new();
        // The ceiling: pg_recvlogical, protocol 1, to /dev/null.
        let pg = &self.pg;
        let started = Instant::now();
        let child = Command::new(pg.bindir().join("pg_recvlogical"))
            .args([
                "-h",
                pg.host(),
                "-p",
                &pg.port().to_string(),
                "-U",
                pg.user(),
            ])
            .args([
                "-d",
                "postgres",
                "--slot",
                "ceiling",
                "--start",
                "--no-loop",
            ])
            .args(["-f", "/dev/null", "-o", "proto_version=1"])
            .args(["-o", "publication_names=walbox_outbox"])
            .args(["--endpos", &target, "-s", "1", "-F", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        results.push(
            drain(
                "pg_recvlogical (ceiling)",
                db,
                "ceiling",
                &target,
                child,
                started,
            )
            .await?,
        );
        for (name, slot, sink) in [
            (
                "walbox, stdout sink to /dev/null",
                "walbox_stdout",
                "stdout",
            ),
            ("walbox to the broker", "walbox_kafka", "kafka"),
        ] {
            let started = Instant::now();
            let child = Command::new(&self.a.walbox)
                .arg("run")
                .env("WALBOX_DSN", pg.conninfo("postgres"))
                .env("WALBOX_SLOT", slot)
                .env(
                    "WALBOX_CHECKPOINT",
                    pg.client_dir().join(format!("{slot}.checkpoint.json")),
                )
                .env("WALBOX_SINK", sink)
                .env("WALBOX_BOOTSTRAP_SERVERS", self.broker.bootstrap())
                .env("WALBOX_CREATE_TOPICS", "true")
                .env("WALBOX_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()?;
            results.push(drain(name, db, slot, &target, child, started).await?);
        }
        // Done: the slots go, so they hold no WAL for what follows.
        for slot in SLOTS {
            db.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await?;
            let _ = std::fs::remove_file(pg.client_dir().join(format!("{slot}.checkpoint.json")));
        }
        Ok((results, wal_bytes))
    }

    /// The polling relay, both variants, over the rows in the table.
    async fn polling(&self, events: u64) -> Result<Vec<Figures>, Error> {
        let db = &self.db;
        polling::prepare(db).await?;
        let mut poller = self.pg.connect("postgres").await?;
        let mut results = Vec::new();
        for (name, marking) in [
            ("polling relay, UPDATE per row", polling::Marking::PerRow),
            (
                "polling relay, UPDATE per batch",
                polling::Marking::PerBatch,
            ),
        ] {
            db.batch_execute(
                "UPDATE outbox SET published_at = NULL WHERE published_at IS NOT NULL",
            )
            .await?;
            db.batch_execute("VACUUM ANALYZE outbox").await?;
            let before = lsn(db, "SELECT pg_current_wal_lsn()::text").await?;
            let cpu_before = usage(std::process::id()).1;
            let started = Instant::now();
            let published = polling::drain(&mut poller, &self.broker.bootstrap(), marking).await?;
            let seconds = started.elapsed().as_secs_f64();
            if published != events {
                return Err(format!("{name} published {published} of {events} events").into());
            }
            let after = lsn(db, "SELECT pg_current_wal_lsn()::text").await?;
            let written = wal_between(db, &before, &after).await?;
            results.push(Figures {
                name,
                seconds,
                peak_rss_kb: None,
                cpu_seconds: usage(std::process::id()).1 - cpu_before,
                extra_wal_per_event: Some(written as f64 / published as f64),
            });
        }
        Ok(results)
    }
}

/// Figures of one steady-load run.
struct Steady {
    rate: u64,
    achieved: f64,
    /// `p50=.. p95=.. p99=.. max=.. n=..` in ms, as walbox reports it.
    latency: String,
    /// The same from the commit to walbox reading the transaction.
    read_latency: String,
    /// Slot lag (bytes behind the server's WAL) at the middle and the end of the
    /// writing, and its maximum.
    lag_mid: i64,
    lag_end: i64,
    lag_max: i64,
    drain_seconds: f64,
    peak_rss_kb: u64,
    cpu_seconds: f64,
}

impl Bench {
    /// walbox streams while writers commit `rate` single-row transactions per
    /// second for `seconds`; walbox measures commit-to-acknowledgement latency.
    async fn steady(&self, rate: u64, seconds: u64) -> Result<Steady, Error> {
        const WRITERS: u64 = 4;
        let db = &self.db;
        let pg = &self.pg;
        let slot = "walbox_steady";
        db.execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await?;
        let log_path = pg.client_dir().join(format!("steady-{rate}.log"));
        let log = std::fs::File::create(&log_path)?;
        let checkpoint = pg
            .client_dir()
            .join(format!("steady-{rate}.checkpoint.json"));
        let mut child = Command::new(&self.a.walbox)
            .arg("run")
            .env("WALBOX_DSN", pg.conninfo("postgres"))
            .env("WALBOX_SLOT", slot)
            .env("WALBOX_CHECKPOINT", &checkpoint)
            .env("WALBOX_BOOTSTRAP_SERVERS", self.broker.bootstrap())
            .env("WALBOX_CREATE_TOPICS", "true")
            .env("WALBOX_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()?;
        let pid = child.id();
        let ready = Instant::now();
        while !std::fs::read_to_string(&log_path)?.contains("streaming") {
            if ready.elapsed() > Duration::from_secs(60) {
                return Err("walbox did not start streaming".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let total = rate * seconds;
        let started = Instant::now();
        let insert = format!(
            "{INSERT} {} FROM (SELECT $1::bigint AS n) s",
            ROW_SELECT.replacen("'order'", "'steady'", 1)
        );
        let mut writers = Vec::new();
        for w in 0..WRITERS {
            let client = pg.connect("postgres").await?;
            let insert = insert.clone();
            writers.push(tokio::spawn(async move {
                let stmt = client.prepare(&insert).await?;
                let mut i = w;
                while i < total {
                    // Event i is due at i / rate seconds; a writer that falls
                    // behind writes at once (the achieved rate shows it).
                    #[allow(clippy::cast_precision_loss)]
                    let due = started + Duration::from_secs_f64(i as f64 / rate as f64);
                    tokio::time::sleep_until(due.into()).await;
                    let n = i64::try_from(i)?;
                    client.execute(&stmt, &[&n]).await?;
                    i += WRITERS;
                }
                Ok::<_, Error>(())
            }));
        }
        let mut lags = Vec::new();
        while !writers.iter().all(tokio::task::JoinHandle::is_finished) {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let lag: i64 = db
                .query_one(
                    "SELECT coalesce((pg_current_wal_lsn() - confirmed_flush_lsn)::bigint, 0)
                     FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await?
                .get(0);
            lags.push(lag);
        }
        for w in writers {
            w.await??;
        }
        let achieved = total as f64 / started.elapsed().as_secs_f64();
        let target = lsn(db, "SELECT pg_current_wal_lsn()::text").await?;
        let draining = Instant::now();
        loop {
            let done = slot_reached(db, slot, &target).await?;
            if done {
                break;
            }
            if draining.elapsed() > Duration::from_secs(600) {
                return Err(format!("walbox did not catch up after the {rate}/s run").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let drain_seconds = draining.elapsed().as_secs_f64();
        // VmHWM is the high-water mark: one reading at the end holds the peak.
        let peak = usage(pid);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid)?),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        child.wait()?;
        let text = std::fs::read_to_string(&log_path)?;
        let stop_line = text
            .lines()
            .rev()
            .find(|l| l.contains(" stopped"))
            .ok_or("walbox logged no stop line")?;
        let latency = stop_line
            .split("commit_to_ack_ms=")
            .nth(1)
            .map(|rest| rest.trim().trim_matches('"').to_owned())
            .ok_or("walbox's stop line has no latency")?;
        let read_latency = stop_line
            .split("commit_to_read_ms=")
            .nth(1)
            .and_then(|rest| rest.split(" commit_to_ack_ms=").next())
            .map(|v| v.trim().trim_matches('"').to_owned())
            .ok_or("walbox's stop line has no commit-to-read latency")?;
        db.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
            .await?;
        Ok(Steady {
            rate,
            achieved,
            latency,
            read_latency,
            lag_mid: lags.get(lags.len() / 2).copied().unwrap_or(0),
            lag_end: lags.last().copied().unwrap_or(0),
            lag_max: lags.iter().copied().max().unwrap_or(0),
            drain_seconds,
            peak_rss_kb: peak.0,
            cpu_seconds: peak.1,
        })
    }
}

/// A percentile out of walbox's `p50=.. p95=..` summary.
fn percentile(summary: &str, name: &str) -> f64 {
    summary
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

fn write_charts(
    dir: &std::path::Path,
    events: u64,
    backlog: &[Figures],
    steady: &[Steady],
) -> Result<(), Error> {
    let ceiling = backlog.first().map_or(1.0, |r| r.seconds);
    let throughput: Vec<svg::Bar> = backlog
        .iter()
        .map(|r| {
            let rate = events as f64 / r.seconds;
            svg::Bar {
                label: r.name.to_owned(),
                value: rate,
                note: format!("{rate:.0} events/s ({:.2} of ceiling)", ceiling / r.seconds),
            }
        })
        .collect();
    std::fs::write(
        dir.join("bench-throughput.svg"),
        svg::bars(
            &format!("Backlog drain, {events} events: events per second"),
            &throughput,
            false,
        ),
    )?;
    let mut latency = Vec::new();
    for r in steady {
        for q in ["p50", "p95", "p99"] {
            let ms = percentile(&r.latency, q);
            latency.push(svg::Bar {
                label: format!("walbox at {}/s, {q}", r.rate),
                value: ms,
                note: format!("{ms:.1} ms (achieved {:.0}/s)", r.achieved),
            });
        }
    }
    std::fs::write(
        dir.join("bench-latency.svg"),
        svg::bars(
            "Steady load: commit-to-acknowledgement latency, ms (log scale)",
            &latency,
            true,
        ),
    )?;
    println!();
    println!(
        "charts: {0}/bench-throughput.svg, {0}/bench-latency.svg",
        dir.display()
    );
    Ok(())
}

fn print_steady(seconds: u64, runs: &[Steady]) {
    println!();
    println!(
        "### Steady load: single-row transactions at fixed rates for {seconds} s each, walbox to the broker"
    );
    println!();
    println!(
        "| target events/s | achieved events/s | commit-to-ack latency, ms | of which commit-to-read p50 / p99, ms | slot lag mid / end / max, kB | catch-up after, s | peak RSS MB | CPU s |"
    );
    println!("|---:|---:|---|---|---|---:|---:|---:|");
    for r in runs {
        println!(
            "| {} | {:.0} | {} | {:.1} / {:.1} | {} / {} / {} | {:.2} | {:.1} | {:.1} |",
            r.rate,
            r.achieved,
            r.latency,
            percentile(&r.read_latency, "p50"),
            percentile(&r.read_latency, "p99"),
            r.lag_mid / 1024,
            r.lag_end / 1024,
            r.lag_max / 1024,
            r.drain_seconds,
            r.peak_rss_kb as f64 / 1024.0,
            r.cpu_seconds
        );
    }
}

fn print_table(title: &str, events: u64, wal_bytes: i64, results: &[Figures]) {
    println!();
    println!("### {title}");
    println!();
    println!(
        "| contender | seconds | events/s | WAL MB/s | of ceiling | peak RSS MB | CPU s | extra WAL per event |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    // The ceiling's row comes first when the slot scenario ran.
    let ceiling = results
        .first()
        .filter(|r| r.name.contains("ceiling"))
        .map(|r| r.seconds);
    for r in results {
        println!(
            "| {} | {:.2} | {:.0} | {} | {} | {} | {:.1} | {} |",
            r.name,
            r.seconds,
            events as f64 / r.seconds,
            // Unknown when the load was not measured (polling alone).
            if wal_bytes > 0 {
                format!("{:.1}", wal_bytes as f64 / 1e6 / r.seconds)
            } else {
                "-".to_owned()
            },
            ceiling.map_or_else(|| "-".to_owned(), |c| format!("{:.2}", c / r.seconds)),
            r.peak_rss_kb.map_or_else(
                || "(in the bench process)".to_owned(),
                |kb| format!("{:.1}", kb as f64 / 1024.0)
            ),
            r.cpu_seconds,
            r.extra_wal_per_event
                .map_or_else(|| "0".to_owned(), |b| format!("{b:.0} B"))
        );
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let a = args()?;
    let pg = PgCluster::start_with(
        PgOptions::default()
            .setting("timezone", "UTC")
            .setting("max_wal_size", "8GB")
            .setting("shared_buffers", "256MB"),
    )?;
    let broker = Broker::start()?;
    let db = pg.connect("postgres").await?;
    let version: String = lsn(&db, "SHOW server_version").await?;
    db.batch_execute(&format!(
        "{OUTBOX_DDL}; CREATE PUBLICATION walbox_outbox FOR TABLE outbox;"
    ))
    .await?;
    let bench = Bench { a, pg, broker, db };
    let events = bench.a.events;
    let big = bench.a.big_txn;

    let runs = |s: Scenario| bench.a.only.contains(&s);

    // 1. Backlog drain: transactions of 10 rows, committed before anyone reads;
    //    the polling relay then publishes the same rows.
    let backlog_load = format!(
        "DO $$
         BEGIN
           FOR t IN 0..{last} LOOP
             {INSERT} {ROW_SELECT} FROM generate_series(t * 10, t * 10 + 9) n;
             COMMIT;
           END LOOP;
         END $$;",
        last = events / 10 - 1
    );
    let mut with_polling = Vec::new();
    let mut backlog_wal = 0;
    if runs(Scenario::Backlog) {
        println!("scenario 1: backlog of {events} events in transactions of 10");
        let (backlog, wal) = bench.drain_slots(&backlog_load).await?;
        with_polling = backlog;
        backlog_wal = wal;
    }
    if runs(Scenario::Polling) {
        if !runs(Scenario::Backlog) {
            println!("loading {events} events in transactions of 10 for the polling relay");
            bench.db.batch_execute(&backlog_load).await?;
            // walbox creates the topic in a full run (6 partitions, its default).
            walbox_testkit::kafka::create_topic(&bench.broker.bootstrap(), "outbox.order", 6)
                .await?;
        }
        with_polling.extend(bench.polling(events).await?);
    }

    // 2. One transaction of `big` rows.
    let mut one_txn = Vec::new();
    let mut one_txn_wal = 0;
    if runs(Scenario::BigTxn) {
        bench.db.batch_execute("TRUNCATE outbox").await?;
        println!("scenario 2: one transaction of {big} events");
        (one_txn, one_txn_wal) = bench
            .drain_slots(&format!(
                "{INSERT} {ROW_SELECT} FROM generate_series(0, {last}) n",
                last = big - 1
            ))
            .await?;
    }

    // 3. Steady load at fixed rates.
    let mut steady = Vec::new();
    if runs(Scenario::Steady) {
        bench.db.batch_execute("TRUNCATE outbox").await?;
        for rate in bench.a.rates.clone() {
            // Each rate starts from a quiet server: the checkpoint of what earlier
            // scenarios wrote does not land in the middle of this one.
            bench.db.batch_execute("CHECKPOINT").await?;
            println!(
                "scenario 3: {rate} events/s for {} s",
                bench.a.steady_seconds
            );
            steady.push(bench.steady(rate, bench.a.steady_seconds).await?);
        }
    }

    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_gb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse::<f64>()
                .ok()
        })
        .map_or(0.0, |kb| kb / 1024.0 / 1024.0);
    println!();
    println!(
        "setup: {cores} cores, {mem_gb:.0} GiB RAM, PostgreSQL {version} (fsync off, one cluster), broker {}, \
         walbox {} (release); rows like a real service writes them (uuid id, one of 1,000 \
         aggregate ids, ~300-byte jsonb payload, traceparent header)",
        if bench.broker.is_external() {
            "external Kafka"
        } else {
            "tansu 0.6.0 (memory storage)"
        },
        bench.a.walbox.display()
    );
    if !with_polling.is_empty() {
        print_table(
            &format!("Backlog drain: {events} events in transactions of 10"),
            events,
            backlog_wal,
            &with_polling,
        );
    }
    if !one_txn.is_empty() {
        print_table(
            &format!("One transaction of {big} events"),
            big,
            one_txn_wal,
            &one_txn,
        );
    }
    if !steady.is_empty() {
        print_steady(bench.a.steady_seconds, &steady);
    }
    // The charts compare all contenders: only a full run writes them.
    if let Some(dir) = &bench.a.svg_dir
        && bench.a.only.len() == Scenario::ALL.len()
    {
        write_charts(dir, events, &with_polling, &steady)?;
    }
    Ok(())
}
