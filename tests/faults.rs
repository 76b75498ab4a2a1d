//! Faults of the catalogue injected into real processes, each checked against
//! the outbox table by the independent audit in `common` (missing events,
//! duplicates and whether they share the event id and source position, per-key
//! order).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;
use walbox_testkit::{
    Broker, BrokerOptions, BrokerStorage, OUTBOX_DDL, PgCluster, PgOptions, StopMode,
};

const TOPIC: &str = "outbox.order";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_kill_9_rounds_under_steady_writes_lose_nothing() {
    let (pg, broker, db) = servers().await;
    let env = walbox_env(&pg, &broker);
    setup(&env);
    let stop_writing = Arc::new(AtomicBool::new(false));
    let writer = steady_writer(&pg, Arc::clone(&stop_writing)).await;
    kill_9_rounds(&pg, &db, &env, 20).await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    stop_writing.store(true, Ordering::Relaxed);
    let written = writer.await.unwrap();
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, written, "20 kills").await;
    walbox.stop();
    assert_duplicates_are_replays(&records);
    assert_per_key_order(&records, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_open_across_a_restart_is_published_when_it_commits() {
    let (pg, broker, db) = servers().await;
    let (env, mut walbox) = Walbox::set_up_and_run(&pg, &broker);
    let long = pg.connect("postgres").await.unwrap();
    long.batch_execute(
        "BEGIN;
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'long-1', 'OrderPlaced', '{\"seq\": 0}');",
    )
    .await
    .unwrap();
    write_events(&pg, 2, 10, 10, 10).await;
    wait_caught_up(&db).await;
    walbox.kill9();
    wait_slot_released(&db, "walbox").await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events_from(&pg, 1, 10, 10, 10, 10).await;
    long.batch_execute("COMMIT").await.unwrap();
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, 301, "restart").await;
    walbox.stop();
    // Published in commit order: after everything that committed before it.
    let mut by_offset: Vec<_> = records.iter().collect();
    by_offset.sort_by_key(|r| {
        r.header("walbox_commit_lsn")
            .unwrap()
            .parse::<walbox_pgoutput::Lsn>()
            .unwrap()
    });
    assert_eq!(by_offset.last().unwrap().key_str(), Some("long-1"));
    assert_per_key_order(&records, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_sharing_an_event_id_are_both_published_with_it() {
    let pg = PgCluster::start().unwrap();
    let broker = Broker::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(
        &OUTBOX_DDL.replace("id uuid PRIMARY KEY DEFAULT", "id uuid NOT NULL DEFAULT"),
    )
    .await
    .unwrap();
    let (_, mut walbox) = Walbox::set_up_and_run(&pg, &broker);
    db.batch_execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES
           ('00000000-0000-0000-0000-000000000001', 'order', 'k', 'E', '{\"seq\": 0}'),
           ('00000000-0000-0000-0000-000000000001', 'order', 'k', 'E', '{\"seq\": 1}')",
    )
    .await
    .unwrap();
    wait_caught_up(&db).await;
    walbox.stop();
    let records = read_topic(&broker.bootstrap(), TOPIC, 2).await;
    assert_eq!(records.len(), 2);
    for r in &records {
        assert_eq!(
            r.header("event_id"),
            Some("00000000-0000-0000-0000-000000000001")
        );
    }
    assert_per_key_order(&records, false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alter_table_while_streaming_loses_nothing() {
    let (pg, broker, db) = servers().await;
    let (_, mut walbox) = Walbox::set_up_and_run(&pg, &broker);
    write_events(&pg, 1, 5, 10, 10).await;
    // New columns (one with a default that rewrites nothing, one NULL) and a
    // dropped column that walbox does not map, mid-stream.
    db.batch_execute(
        "ALTER TABLE outbox ADD COLUMN tenant text DEFAULT 'acme';
         ALTER TABLE outbox ADD COLUMN note text;",
    )
    .await
    .unwrap();
    write_events_from(&pg, 1, 5, 10, 10, 0).await;
    db.batch_execute("ALTER TABLE outbox DROP COLUMN note")
        .await
        .unwrap();
    write_events_from(&pg, 1, 5, 10, 10, 10).await;
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, 150, "ALTER TABLE").await;
    let log = walbox.log();
    walbox.stop();
    assert_eq!(records.len(), 150, "{log}");
    assert!(
        log.matches("outbox table").count() >= 3,
        "each new shape announced: {log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarts_during_the_snapshot_and_the_snapshot_is_taken_again() {
    let (mut pg, broker, db) = servers().await;
    db.batch_execute(
        "ALTER TABLE outbox ADD COLUMN seq bigserial;
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'order-' || (g % 10), 'OrderPlaced', jsonb_build_object('seq', g / 10)
         FROM generate_series(0, 19999) g ORDER BY g;
         CREATE PUBLICATION walbox_outbox FOR TABLE outbox;",
    )
    .await
    .unwrap();
    drop(db);
    let env = walbox_env(&pg, &broker);
    let cfg = config_file(
        &pg,
        "snap.toml",
        "[snapshot]\nmode = \"initial\"\norder_by = [\"seq\"]\n[sink]\nmax_in_flight = 5\n",
    );
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    let bootstrap = broker.bootstrap();
    tokio::task::spawn_blocking(move || {
        walbox_testkit::kafka::read_at_least(&bootstrap, TOPIC, 1_000, Duration::from_secs(60))
    })
    .await
    .unwrap()
    .unwrap();
    pg.restart(StopMode::Fast).unwrap();
    walbox_testkit::wait_until("the snapshot to finish", Duration::from_secs(180), || {
        checkpoint(&pg)
            .and_then(|c| c.snapshot)
            .filter(|s| s.complete)
            .map(drop)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    let db = pg.connect("postgres").await.unwrap();
    write_events_from(&pg, 1, 5, 10, 10, 100).await;
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, 20_050, "restart").await;
    let log = walbox.log();
    walbox.stop();
    assert!(log.contains("did not finish; taking it again"), "{log}");
    assert_duplicates_are_replays_or_snapshot(&records);
    assert_per_key_order(&records, true);
}

/// Snapshot rows taken twice carry different consistent points (two slots), so
/// only the event id must match: it does by construction of the audit.
fn assert_duplicates_are_replays_or_snapshot(records: &[walbox_testkit::kafka::Record]) {
    let streamed: Vec<_> = records
        .iter()
        .filter(|r| r.header("walbox_xid") != Some("0"))
        .cloned()
        .collect();
    assert_duplicates_are_replays(&streamed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_longer_than_the_delivery_timeout_resumes_from_the_checkpoint() {
    let (pg, mut broker, db) = servers_with(
        PgOptions::default(),
        BrokerOptions {
            storage: BrokerStorage::Sqlite,
        },
    )
    .await;
    if broker.is_external() {
        return; // needs a broker this test can stop
    }
    let env = walbox_env(&pg, &broker);
    setup(&env);
    let cfg = config_file(
        &pg,
        "timeout.toml",
        "[sink.kafka]\n\"message.timeout.ms\" = 3000\n",
    );
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    write_events(&pg, 1, 5, 10, 10).await;
    wait_caught_up(&db).await;
    let before = checkpoint(&pg).unwrap().lsn;

    broker.stop().unwrap();
    write_events_from(&pg, 1, 10, 10, 10, 10).await;
    // Deliveries time out: the session ends and walbox retries from the checkpoint,
    // which has not moved past the undelivered events.
    walbox_testkit::wait_until("a delivery timeout", Duration::from_secs(60), || {
        walbox.log().contains("session ended").then_some(())
    })
    .unwrap();
    assert_eq!(
        checkpoint(&pg).unwrap().lsn,
        before,
        "no position past undelivered events"
    );
    broker.start_again().unwrap();
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, 150, "outage").await;
    walbox.stop();
    assert_duplicates_are_replays(&records);
    assert_per_key_order(&records, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_stalled_connection_is_detected_and_replaced() {
    let (pg, broker, db) = servers().await;
    let env = walbox_env(&pg, &broker);
    setup(&env);
    let cfg = config_file(&pg, "stall.toml", "[source]\nstall_timeout_ms = 3000\n");
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    write_events(&pg, 1, 5, 10, 10).await;
    wait_caught_up(&db).await;
    let pid: i32 = db
        .query_one(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = 'walbox'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // The walsender freezes: the connection stays open, nothing comes through.
    let walsender = nix::unistd::Pid::from_raw(pid);
    nix::sys::signal::kill(walsender, Signal::SIGSTOP).unwrap();
    write_events_from(&pg, 1, 5, 10, 10, 10).await;
    walbox_testkit::wait_until("the stall to be detected", Duration::from_secs(60), || {
        walbox
            .log()
            .contains("replication connection stalled")
            .then_some(())
    })
    .unwrap();
    // It was told to terminate; once it runs again it does, and the slot is free.
    nix::sys::signal::kill(walsender, Signal::SIGCONT).unwrap();
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, 100, "stall").await;
    let log = walbox.log();
    walbox.stop();
    assert!(log.contains("has not processed a status update"), "{log}");
    assert_duplicates_are_replays(&records);
    assert_per_key_order(&records, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::print_stderr)] // prints its memory figures
async fn one_transaction_of_300_000_rows_goes_out_in_order_in_bounded_memory() {
    let (pg, broker, db) = servers().await;
    let env = walbox_env(&pg, &broker);
    setup(&env);
    let cfg = config_file(
        &pg,
        "bounded.toml",
        "[sink]\nmax_in_flight = 5000\nmax_in_flight_bytes = 4000000\n",
    );
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    wait_checkpoint(&pg, current_lsn(&db).await, Duration::from_secs(60)).await;
    let idle_kb = rss_kb(walbox.pid());
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'order-' || (g % 100), 'OrderPlaced',
                jsonb_build_object('seq', g / 100, 'note', repeat('x', 200))
         FROM generate_series(0, 299999) g ORDER BY g",
        &[],
    )
    .await
    .unwrap();
    let last = current_lsn(&db).await;
    // Sample memory until the whole transaction is confirmed.
    let mut peak_kb = 0;
    walbox_testkit::wait_until_async(
        "the transaction to be confirmed",
        Duration::from_secs(600),
        || {
            peak_kb = peak_kb.max(rss_kb(walbox.pid()));
            let db = &db;
            async move { (confirmed_lsn(db, "walbox").await >= last).then_some(()) }
        },
    )
    .await
    .unwrap();
    let records = read_topic(&broker.bootstrap(), TOPIC, 300_000).await;
    walbox.stop();
    assert_eq!(records.len(), 300_000);
    let ids = outbox_ids(&db).await;
    let (missing, dup) = audit(&ids, &records);
    assert!(
        missing.is_empty() && dup.is_empty(),
        "{} missing, {} dup",
        missing.len(),
        dup.len()
    );
    assert_per_key_order(&records, false);
    eprintln!(
        "walbox RSS: {idle_kb} kB idle, {peak_kb} kB peak over 300,000 events in one transaction"
    );
    // Bounded by the in-flight limits, not by the transaction: the growth over the
    // idle process stays within a few times max_in_flight_bytes.
    assert!(
        peak_kb < idle_kb + 60 * 1024,
        "RSS grew from {idle_kb} kB to {peak_kb} kB"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::print_stderr)] // prints its memory figures
async fn large_rows_stay_within_the_byte_bound_while_the_broker_is_away() {
    let (pg, mut broker, db) = servers_with(
        PgOptions::default(),
        BrokerOptions {
            storage: BrokerStorage::Sqlite,
        },
    )
    .await;
    if broker.is_external() {
        return; // needs a broker this test can stop
    }
    let env = walbox_env(&pg, &broker);
    setup(&env);
    let cfg = config_file(
        &pg,
        "big-rows.toml",
        "[sink]\nmax_in_flight = 1000\nmax_in_flight_bytes = 4000000\n",
    );
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    write_events(&pg, 1, 2, 5, 5).await;
    wait_caught_up(&db).await;
    let idle_kb = rss_kb(walbox.pid());

    // The broker goes away: walbox fills its in-flight bound and stops taking
    // rows; the server goes on sending until walbox's read-ahead is full.
    broker.stop().unwrap();
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'order-' || (g % 10), 'Big',
                jsonb_build_object('seq', g, 'blob', repeat(md5(g::text), 15000))
         FROM generate_series(1, 120) g",
        &[],
    )
    .await
    .unwrap(); // 120 rows of about 480 kB each
    let last = current_lsn(&db).await;
    let mut peak_kb = 0;
    // Until the walsender waits on walbox (everything walbox will take is
    // taken) or has sent everything (walbox took it all).
    let last_text = last.to_string();
    walbox_testkit::wait_until_async(
        "the walsender to wait for walbox to read, or to have sent everything",
        Duration::from_secs(120),
        || {
            peak_kb = peak_kb.max(rss_kb(walbox.pid()));
            let (db, last_text) = (&db, &last_text);
            async move {
                let done: bool = db
                    .query_one(
                        "SELECT coalesce(bool_or(a.wait_event = 'WalSenderWriteData'
                                                 OR r.sent_lsn >= $1::text::pg_lsn), false)
                         FROM pg_stat_replication r JOIN pg_stat_activity a USING (pid)",
                        &[last_text],
                    )
                    .await
                    .unwrap()
                    .get(0);
                done.then_some(())
            }
        },
    )
    .await
    .unwrap();
    peak_kb = peak_kb.max(rss_kb(walbox.pid()));
    eprintln!("walbox RSS: {idle_kb} kB idle, {peak_kb} kB with the broker away");
    // In flight (4 MB, held twice: walbox and the producer's queue) and the
    // read-ahead (1 MB) are bounded; 120 rows of 480 kB are 56 MB.
    assert!(
        peak_kb < idle_kb + 24 * 1024,
        "RSS grew from {idle_kb} kB to {peak_kb} kB with large rows waiting"
    );

    broker.start_again().unwrap();
    wait_confirmed(&db, "walbox", last, Duration::from_secs(300)).await;
    walbox.stop();
}
