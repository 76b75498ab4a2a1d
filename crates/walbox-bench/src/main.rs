//! `make bench`: how fast walbox drains a backlog and one huge transaction, next to
//! how fast PostgreSQL can hand the same changes out at all, and next to the
//! polling relay it replaces.
//!
//! One machine. Rows like a real service writes them (uuid id, aggregate type, one
//! of 1,000 aggregate ids, event type, a ~300-byte jsonb payload, a headers jsonb
//! with a traceparent). The slot scenarios have four contenders
//! (`contenders.rs`):
//!
//! - `pg_recvlogical` (pgoutput, protocol 1) to /dev/null: the ceiling;
//! - `walbox run --sink stdout` to /dev/null: walbox without a broker;
//! - `walbox run` to the broker;
//! - `walbox run` to the broker with `--metrics-listen`, its `/metrics` scraped
//!   every 100 ms: what the metrics cost, beside the line above.
//!
//! Each runs `--repeat` times (default 3) in rounds, the order rotating from round
//! to round, each run on its own slot created before the one load, so every run
//! drains the same WAL (`scenarios.rs`). A run is timed from its start until its
//! slot's `confirmed_flush_lsn` reaches the last commit; peak RSS (VmHWM) and CPU
//! seconds come from /proc. The report (`report.rs`) gives each contender's median
//! and the spread (min–max) across rounds, and its ratio to the ceiling from the
//! medians, with the range of the per-round ratios. Scenarios:
//!
//! 1. Backlog drain: `--events` (default 1,000,000) in transactions of 10; then the
//!    polling relay (`polling.rs`), both variants, publishes the same rows once,
//!    with the extra WAL its UPDATEs write per event.
//! 2. One transaction of `--big-txn` rows (default 1,000,000).
//! 3. Steady load (`steady.rs`): four writers commit single-row transactions at
//!    1,000, 5,000 and 20,000 events/s for `--steady-seconds` (default 60) while
//!    walbox streams to the broker; walbox reports commit-to-acknowledgement
//!    latency (the server's commit time to the broker's acknowledgement,
//!    p50/p95/p99/max) and, of it, the commit-to-read latency (to walbox reading
//!    the transaction); the bench samples the slot's lag every second.
//!
//! `--only backlog,polling,big-txn,steady` runs some of them and `--rates` picks
//! the steady rates; only a full run writes the charts. Figures are printed with
//! the setup they came from.

#![allow(clippy::print_stdout)] // the report is the output

mod cli;
mod contenders;
mod polling;
mod report;
mod scenarios;
mod steady;
mod svg;

use walbox_testkit::{Broker, OUTBOX_DDL, PgCluster, PgOptions};

use crate::cli::Scenario;
use crate::contenders::{Contender, lsn};
use crate::scenarios::{Bench, INSERT, ROW_SELECT};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let Some(a) = cli::args()? else {
        return Ok(());
    };
    // A slot per contender and round, and one for the steady load.
    let slots = (a.repeat * Contender::ALL.len() + 1).max(20);
    let pg = PgCluster::start_with(
        PgOptions::default()
            .setting("timezone", "UTC")
            .setting("max_wal_size", "8GB")
            .setting("shared_buffers", "256MB")
            .setting("max_replication_slots", &slots.to_string()),
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
        let drained = bench.drain_slots(&backlog_load).await?;
        with_polling = drained.contenders;
        backlog_wal = drained.wal_bytes;
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
        let drained = bench
            .drain_slots(&format!(
                "{INSERT} {ROW_SELECT} FROM generate_series(0, {last}) n",
                last = big - 1
            ))
            .await?;
        one_txn = drained.contenders;
        one_txn_wal = drained.wal_bytes;
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
         aggregate ids, ~300-byte jsonb payload, traceparent header){}{}",
        if bench.broker.is_external() {
            "external Kafka"
        } else {
            "tansu 0.6.0 (memory storage)"
        },
        bench.a.walbox.display(),
        if runs(Scenario::Backlog) || runs(Scenario::BigTxn) {
            format!("; slot contenders: {}", report::method(bench.a.repeat))
        } else {
            String::new()
        },
        if runs(Scenario::Polling) {
            "; the polling relay: one run per variant"
        } else {
            ""
        }
    );
    let rounds = |s: Scenario| runs(s).then_some(bench.a.repeat);
    if !with_polling.is_empty() {
        report::print_table(
            &format!("Backlog drain: {events} events in transactions of 10"),
            events,
            backlog_wal,
            rounds(Scenario::Backlog),
            &with_polling,
        );
    }
    if !one_txn.is_empty() {
        report::print_table(
            &format!("One transaction of {big} events"),
            big,
            one_txn_wal,
            rounds(Scenario::BigTxn),
            &one_txn,
        );
    }
    if !steady.is_empty() {
        report::print_steady(bench.a.steady_seconds, &steady);
    }
    // The charts compare all contenders: only a full run writes them.
    if let Some(dir) = &bench.a.svg_dir
        && bench.a.only.len() == Scenario::ALL.len()
    {
        report::write_charts(dir, events, &with_polling, &steady)?;
    }
    Ok(())
}
