//! `walbox run` end to end: real PostgreSQL, real broker, walbox as a process.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;
use walbox_testkit::{Broker, OUTBOX_DDL, PgCluster, PgOptions};

const TOPIC: &str = "outbox.order";

async fn start() -> (PgCluster, Broker, tokio_postgres::Client) {
    servers_with(
        PgOptions::default().setting("timezone", "UTC"),
        walbox_testkit::BrokerOptions::default(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_events_from_four_writers_arrive_once_in_key_order() {
    let (pg, broker, db) = start().await;
    let env = walbox_env(&pg, &broker);
    setup(&env);
    setup(&env); // idempotent
    let mut walbox = Walbox::spawn(&["run"], &env);

    write_events(&pg, 4, 500, 10, 200).await;
    let last = current_lsn(&db).await;
    let records = read_topic(&broker.bootstrap(), TOPIC, 20_000).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;

    let ids = outbox_ids(&db).await;
    assert_eq!(ids.len(), 20_000);
    let (missing, dup) = audit(&ids, &records);
    assert!(missing.is_empty(), "{} missing", missing.len());
    assert!(dup.is_empty(), "{} duplicated", dup.len());
    assert_eq!(records.len(), 20_000);
    assert_per_key_order(&records, false);

    // Envelope and headers of every record.
    let mut keys = HashMap::new();
    for r in &records {
        assert_eq!(
            r.partition,
            java_partition(r.key.as_deref().unwrap(), 6),
            "partitioned as the Java client would"
        );
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
        let id = r.header("event_id").unwrap();
        assert_eq!(v["event_id"], id);
        assert_eq!(v["event_type"], "OrderPlaced");
        assert_eq!(v["schema_version"], 1);
        assert_eq!(v["producer"], "walbox");
        assert!(v["occurred_at"].as_str().unwrap().ends_with("+00:00"));
        assert_eq!(v["payload"]["note"], "Grüße");
        assert_eq!(r.header("event_type"), Some("OrderPlaced"));
        assert_eq!(r.header("schema_version"), Some("1"));
        assert!(r.header("traceparent").unwrap().starts_with("00-"));
        assert!(r.header("walbox_commit_lsn").unwrap().contains('/'));
        assert!(r.header("walbox_xid").unwrap().parse::<u32>().is_ok());
        *keys.entry(r.key_str().unwrap().to_owned()).or_insert(0) += 1;
    }
    assert_eq!(keys.len(), 200);

    walbox.signal(Signal::SIGTERM);
    let status = walbox.wait(Duration::from_secs(60));
    assert_eq!(status.code(), Some(0), "{}", walbox.log());
    assert!(!walbox.log().contains("Grüße"), "no payload values in logs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollbacks_updates_and_insert_then_delete() {
    let (pg, broker, db) = start().await;
    let (_, mut walbox) = Walbox::set_up_and_run(&pg, &broker);
    let insert = |key: &str, seq: i64| {
        format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', '{key}', 'E', '{{\"seq\": {seq}}}')"
        )
    };
    // Rolled back: nothing.
    db.batch_execute(&format!("BEGIN; {}; ROLLBACK;", insert("rolled", 0)))
        .await
        .unwrap();
    // Inserted and deleted in one transaction (an always-empty outbox): published.
    db.batch_execute(&format!(
        "BEGIN; {}; DELETE FROM outbox WHERE aggregate_id = 'ephemeral'; COMMIT;",
        insert("ephemeral", 0)
    ))
    .await
    .unwrap();
    // Inserted, then updated: the insert only.
    db.batch_execute(&insert("kept", 0)).await.unwrap();
    db.batch_execute("UPDATE outbox SET event_type = 'Changed' WHERE aggregate_id = 'kept'")
        .await
        .unwrap();
    db.batch_execute(&insert("kept", 1)).await.unwrap();
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;

    let records = read_topic(&broker.bootstrap(), TOPIC, 3).await;
    let keys: Vec<&str> = {
        let mut sorted: Vec<_> = records.iter().collect();
        sorted.sort_by_key(|r| (r.partition, r.offset));
        sorted.iter().map(|r| r.key_str().unwrap()).collect()
    };
    assert_eq!(records.len(), 3, "{keys:?}");
    assert!(!keys.contains(&"rolled"));
    assert!(keys.contains(&"ephemeral"));
    assert_eq!(keys.iter().filter(|k| **k == "kept").count(), 2);
    assert!(records.iter().all(|r| r.header("event_type") == Some("E")));

    walbox.stop();
    let log = walbox.log();
    assert!(log.contains("ignored_updates=1"), "{log}");
    assert!(log.contains("ignored_deletes=1"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_outbox_does_not_hold_wal_while_other_tables_write() {
    let (pg, broker, db) = start().await;
    let (_, _walbox) = Walbox::set_up_and_run(&pg, &broker);
    db.batch_execute("CREATE TABLE busy (id bigserial PRIMARY KEY, filler text)")
        .await
        .unwrap();
    // About 50 MB of WAL on a table walbox does not publish.
    for _ in 0..10 {
        db.batch_execute(
            "INSERT INTO busy (filler) SELECT repeat(md5(g::text), 30) FROM generate_series(1, 5000) g",
        )
        .await
        .unwrap();
    }
    let written = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", written, Duration::from_secs(60)).await;
    let retained: i64 = db
        .query_one(
            "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = 'walbox'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(retained < 1024 * 1024, "{retained} bytes retained");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_stream_then_restart_loses_and_repeats_nothing() {
    let (pg, broker, db) = start().await;
    let (env, mut walbox) = Walbox::set_up_and_run(&pg, &broker);
    let created = confirmed_lsn(&db, "walbox").await;
    let writer = write_events(&pg, 2, 100, 10, 20);
    // Stop while the writers are still writing.
    let stop = async {
        walbox_testkit::wait_until_async(
            "some events to be published",
            Duration::from_secs(60),
            || async { (confirmed_lsn(&db, "walbox").await > created).then_some(()) },
        )
        .await
        .unwrap();
        walbox.signal(Signal::SIGTERM);
    };
    tokio::join!(writer, stop);
    assert_eq!(
        walbox.wait(Duration::from_secs(60)).code(),
        Some(0),
        "{}",
        walbox.log()
    );
    // A clean exit waits for the server to end the stream: the slot is free
    // and at the position walbox reported, with no wait for its walsender.
    let log = walbox.log();
    let reported = log_field(&log, "stopped", "reported")
        .unwrap_or_else(|| panic!("no reported position in the log: {log}"));
    let slot = db
        .query_one(
            "SELECT active, confirmed_flush_lsn::text FROM pg_replication_slots \
             WHERE slot_name = 'walbox'",
            &[],
        )
        .await
        .unwrap();
    assert!(
        !slot.get::<_, bool>(0),
        "slot still held after a clean exit"
    );
    assert_eq!(slot.get::<_, String>(1), reported, "{log}");

    // Writes while no walbox runs are published by the next one.
    write_events_from(&pg, 1, 10, 10, 10, 20).await;
    let mut again = Walbox::spawn(&["run"], &env);
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    let records = read_topic(&broker.bootstrap(), TOPIC, 2_100).await;
    let ids = outbox_ids(&db).await;
    let (missing, dup) = audit(&ids, &records);
    assert!(missing.is_empty(), "{} missing", missing.len());
    assert!(
        dup.is_empty(),
        "{} duplicated after a clean stop",
        dup.len()
    );
    assert_per_key_order(&records, false);
    again.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_several_points_loses_nothing() {
    let (pg, broker, db) = start().await;
    let env = walbox_env(&pg, &broker);
    setup(&env);
    let total = 3 * 1_000;
    for round in 0..3 {
        let mut walbox = Walbox::spawn(&["run"], &env);
        let before = confirmed_lsn(&db, "walbox").await;
        let write = write_events_from(&pg, 2, 50, 10, 20, round * 20);
        let kill = async {
            // Kill once the slot has moved: between an ack and the next status
            // update, or mid-transaction, wherever the writers happen to be.
            wait_slot_moves(&db, before).await;
            walbox.kill9();
        };
        tokio::join!(write, kill);
        assert!(!walbox.running(), "round {round}: killed");
        wait_slot_released(&db, "walbox").await;
    }
    let mut last_run = Walbox::spawn(&["run"], &env);
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, total, "kill -9").await;
    // Duplicates are replays of events after the last confirmed position: same
    // event id, same position headers, and per-key order restarts from them.
    let mut first_pos: std::collections::HashMap<String, (String, String)> = Default::default();
    for r in &records {
        let id = r.header("event_id").unwrap().to_owned();
        let pos = (
            r.header("walbox_commit_lsn").unwrap().to_owned(),
            r.header("walbox_index").unwrap().to_owned(),
        );
        let first = first_pos.entry(id).or_insert_with(|| pos.clone());
        assert_eq!(
            *first, pos,
            "a duplicate comes from the same source position"
        );
    }
    assert_per_key_order(&records, true);
    last_run.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outage_holds_the_position_and_memory_then_delivers_everything() {
    let pg = PgCluster::start_with(
        PgOptions {
            wal_sender_timeout: Some(Duration::from_secs(5)),
            ..PgOptions::default()
        }
        .setting("timezone", "UTC"),
    )
    .unwrap();
    let mut broker = Broker::start_with(walbox_testkit::BrokerOptions {
        storage: walbox_testkit::BrokerStorage::Sqlite,
    })
    .unwrap();
    if broker.is_external() {
        return; // needs a broker this test can stop
    }
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let mut env = walbox_env(&pg, &broker);
    env.push(("WALBOX_LOG", "info".into()));
    setup(&env);
    // A small in-flight bound, to see it hold.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("walbox.toml");
    std::fs::write(
        &cfg,
        "[sink]\nmax_in_flight = 200\nmax_in_flight_bytes = 1000000\n",
    )
    .unwrap();
    let mut walbox = Walbox::spawn(&["run", "--config", cfg.to_str().unwrap()], &env);
    write_events(&pg, 1, 10, 10, 10).await;
    let first = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", first, Duration::from_secs(60)).await;

    broker.stop().unwrap();
    // 2,000 more while the broker is down, on keys of their own.
    write_events_from(&pg, 2, 100, 10, 10, 100).await;
    let mut highest = confirmed_lsn(&db, "walbox").await;
    let rss_limit_kb = 150 * 1024;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut peak_kb = 0;
    // For 20 s: the process stays up and small, and the position (which may follow
    // WAL written before the outage's first commit) is sampled. (The outage's
    // length is the scenario; the loop samples the invariants during it.)
    while std::time::Instant::now() < deadline {
        assert!(
            walbox.running(),
            "walbox died during the outage: {}",
            walbox.log()
        );
        highest = highest.max(confirmed_lsn(&db, "walbox").await);
        peak_kb = peak_kb.max(rss_kb(walbox.pid()));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(peak_kb < rss_limit_kb, "RSS {peak_kb} kB during the outage");

    broker.start_again().unwrap();
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(120)).await;
    let records = read_topic(&broker.bootstrap(), TOPIC, 2_100).await;
    // The position never passed an event the broker had not acknowledged: it
    // stayed at or before the first commit of the outage.
    let first_unacked: walbox_pgoutput::Lsn = records
        .iter()
        .filter(|r| r.key_str().unwrap().len() == "order-100".len())
        .map(|r| r.header("walbox_commit_lsn").unwrap().parse().unwrap())
        .min()
        .unwrap();
    assert!(
        highest <= first_unacked,
        "confirmed {highest} during the outage, past the unacknowledged commit {first_unacked}"
    );
    let ids = outbox_ids(&db).await;
    let (missing, _) = audit(&ids, &records);
    assert!(
        missing.is_empty(),
        "{} missing after the outage",
        missing.len()
    );
    assert_per_key_order(&records, true);
    walbox.stop();
}

#[test]
fn java_murmur2_matches_the_java_clients_reference_values() {
    // From the Java client's UtilsTest.
    assert_eq!(java_murmur2(b"21"), -973_932_308);
    assert_eq!(java_murmur2(b"foobar"), -790_332_482);
    assert_eq!(java_murmur2(b"a-little-bit-long-string"), -985_981_536);
    assert_eq!(java_murmur2(b"a-little-bit-longer-string"), -1_486_304_829);
    assert_eq!(
        java_murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8"),
        -58_897_971
    );
    assert_eq!(java_murmur2(b"abc"), 479_470_107);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_stops_walbox_with_its_name_unless_creation_is_allowed() {
    let (pg, broker, db) = start().await;
    let mut env = walbox_env(&pg, &broker);
    env.retain(|(k, _)| *k != "WALBOX_CREATE_TOPICS");
    env.push(("WALBOX_CREATE_TOPICS", "false".into()));
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 1, 1, 1, 1).await;
    let status = walbox.wait(Duration::from_secs(60));
    assert_eq!(status.code(), Some(1));
    let log = walbox.log();
    assert!(
        log.contains("topic \"outbox.order\" does not exist"),
        "{log}"
    );
    // Nothing was confirmed past the unpublished event.
    let last = current_lsn(&db).await;
    assert!(confirmed_lsn(&db, "walbox").await < last);

    // `walbox slot drop` removes the slot; a second drop is a no-op.
    for _ in 0..2 {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_walbox"))
            .args(["slot", "drop"])
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let slots: i64 = db
        .query_one("SELECT count(*) FROM pg_replication_slots", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 0);
    // And `run` without a slot says how to get one.
    let mut no_slot = Walbox::spawn(&["run"], &env);
    assert_eq!(no_slot.wait(Duration::from_secs(60)).code(), Some(1));
    assert!(no_slot.log().contains("walbox setup"), "{}", no_slot.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_at_once_without_confirming() {
    let (pg, mut broker, db) = start().await;
    if broker.is_external() {
        return;
    }
    let mut env = walbox_env(&pg, &broker);
    env.push(("WALBOX_LOG", "info,walbox=debug".into()));
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 1, 1, 5, 5).await;
    let first = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", first, Duration::from_secs(60)).await;
    broker.kill9().unwrap();
    let before = outbox_ids(&db).await;
    write_events(&pg, 1, 1, 5, 5).await;
    let new: Vec<String> = outbox_ids(&db).await.difference(&before).cloned().collect();
    // Wait until walbox has handed the new events to the sink, where they stay.
    walbox_testkit::wait_until_async(
        "the new events in flight",
        Duration::from_secs(30),
        || async {
            let log = walbox.log();
            new.iter().all(|id| log.contains(id.as_str())).then_some(())
        },
    )
    .await
    .unwrap();
    let held = confirmed_lsn(&db, "walbox").await;
    walbox.signal(Signal::SIGTERM);
    // The first signal waits for the events the broker cannot acknowledge.
    walbox_testkit::wait_until_async(
        "walbox to log the stop",
        Duration::from_secs(30),
        || async { walbox.log().contains("stopping").then_some(()) },
    )
    .await
    .unwrap();
    assert!(walbox.running(), "still draining");
    walbox.signal(Signal::SIGTERM);
    let status = walbox.wait(Duration::from_secs(10));
    assert_eq!(status.code(), Some(130), "{}", walbox.log());
    assert_eq!(confirmed_lsn(&db, "walbox").await, held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_runs_as_a_role_that_is_not_a_superuser() {
    let (pg, broker, db) = start().await;
    // An administrator sets up once; walbox then runs with REPLICATION and SELECT.
    setup(&walbox_env(&pg, &broker));
    db.batch_execute(
        "CREATE ROLE walbox_relay LOGIN REPLICATION;
         GRANT SELECT ON outbox TO walbox_relay;",
    )
    .await
    .unwrap();
    let mut env = walbox_env(&pg, &broker);
    env.retain(|(k, _)| *k != "WALBOX_DSN");
    env.push((
        "WALBOX_DSN",
        format!(
            "host={} port={} user=walbox_relay dbname=postgres",
            pg.host(),
            pg.port()
        ),
    ));
    let doctor = std::process::Command::new(env!("CARGO_BIN_EXE_walbox"))
        .arg("doctor")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    assert!(
        doctor.status.success(),
        "{}",
        String::from_utf8_lossy(&doctor.stdout)
    );
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 2, 20, 5, 10).await;
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    let records = read_topic(&broker.bootstrap(), TOPIC, 200).await;
    let (missing, dup) = audit(&outbox_ids(&db).await, &records);
    assert!(missing.is_empty() && dup.is_empty());
    let superuser: bool = db
        .query_one(
            "SELECT rolsuper FROM pg_roles WHERE rolname = 'walbox_relay'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!superuser);
    walbox.stop();

    // The same role recreates the slot with a snapshot (the recovery path),
    // replays nothing twice afterwards, and streams on.
    let (code, _, err) = walbox_cmd(&["slot", "drop"], &env);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = walbox_cmd(&["setup", "--snapshot"], &env);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("published 200 rows"), "{out}");
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events_from(&pg, 1, 5, 10, 10, 10).await;
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    let records = read_topic(&broker.bootstrap(), TOPIC, 450).await;
    assert_eq!(
        records.len(),
        450,
        "200, the same 200 again from the snapshot, 50 new"
    );
    walbox.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_and_crash_mid_stream_lose_nothing() {
    let (mut pg, broker, db) = start().await;
    drop(db);
    let (_, mut walbox) = Walbox::set_up_and_run(&pg, &broker);
    let mut expected = 0;
    for (round, crash) in [false, true].into_iter().enumerate() {
        let db = pg.connect("postgres").await.unwrap();
        let before = confirmed_lsn(&db, "walbox").await;
        let write = write_events_from(&pg, 1, 40, 10, 10, round * 10);
        let moved = async {
            wait_slot_moves(&db, before).await;
        };
        tokio::join!(write, moved);
        expected += 400;
        drop(db);
        if crash {
            pg.kill9().unwrap();
            pg.start_again().unwrap();
        } else {
            pg.restart(walbox_testkit::StopMode::Fast).unwrap();
        }
        assert!(
            walbox.running(),
            "walbox survives the server going away: {}",
            walbox.log()
        );
    }
    // After the restarts walbox reconnects and carries on with new writes too.
    write_events_from(&pg, 1, 10, 10, 10, 20).await;
    expected += 100;
    let db = pg.connect("postgres").await.unwrap();
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, expected, "restarts").await;
    assert_per_key_order(&records, true);
    let log = walbox.log();
    assert!(log.contains("resuming from the checkpoint"), "{log}");
    walbox.signal(Signal::SIGTERM);
    assert_eq!(
        walbox.wait(Duration::from_secs(60)).code(),
        Some(0),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stdout_sink_writes_one_json_line_per_event() {
    let (pg, broker, db) = start().await;
    let mut env = walbox_env(&pg, &broker);
    env.push(("WALBOX_SINK", "stdout".into()));
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 2, 50, 10, 10).await;
    wait_caught_up(&db).await;
    walbox.stop();
    let log = walbox.log();
    let lines = json_lines(&log);
    assert_eq!(lines.len(), 1_000);
    let ids = outbox_ids(&db).await;
    for l in &lines {
        assert_eq!(l["topic"], TOPIC);
        assert!(ids.contains(l["headers"]["event_id"].as_str().unwrap()));
        assert_eq!(l["value"]["event_id"], l["headers"]["event_id"]);
        assert!(l["value"]["payload"]["seq"].is_i64());
    }
}

/// The stdout sink acknowledges a line once it is written and flushed to the
/// pipe; when the reader closes the pipe (EPIPE), walbox stops with an error
/// instead of retrying, and confirms nothing it could not write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_pipe_stops_walbox_without_confirming_what_was_not_written() {
    use std::io::BufRead;
    let (pg, broker, db) = start().await;
    let mut env = walbox_env(&pg, &broker);
    env.push(("WALBOX_SINK", "stdout".into()));
    setup(&env);
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("walbox.log");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_walbox"));
    cmd.arg("run")
        .env("WALBOX_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log_path).unwrap());
    for (k, v) in &env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let pipe = child.stdout.take().unwrap();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();

    // One transaction of ten events; the reader takes five lines and leaves.
    write_events(&pg, 1, 1, 10, 10).await;
    let written = current_lsn(&db).await;
    let (lines, pipe) = tokio::task::spawn_blocking(move || {
        let mut reader = std::io::BufReader::new(pipe);
        let lines: Vec<String> = (&mut reader).lines().take(5).map(Result::unwrap).collect();
        (lines, reader)
    })
    .await
    .unwrap();
    assert_eq!(json_lines(&lines.join("\n")).len(), 5);
    // Written and flushed to the pipe (the other five wait in its buffer):
    // acknowledged.
    wait_confirmed(&db, "walbox", written, Duration::from_secs(60)).await;
    drop(pipe); // the reader leaves

    // The next transaction cannot be written: walbox stops, non-zero.
    write_events_from(&pg, 1, 1, 10, 10, 100).await;
    let unwritten = current_lsn(&db).await;
    let status = walbox_testkit::wait_until("walbox to exit", Duration::from_secs(60), || {
        child.try_wait().ok().flatten()
    })
    .unwrap_or_else(|e| {
        let _ = child.kill();
        panic!("{e}; log:\n{}", log())
    });
    assert_eq!(status.code(), Some(1), "{}", log());
    assert!(
        log().contains("the reader of standard output closed it"),
        "{}",
        log()
    );
    let confirmed = confirmed_lsn(&db, "walbox").await;
    assert!(
        confirmed >= written && confirmed < unwritten,
        "confirmed {confirmed}, written up to {written}, not written up to {unwritten}"
    );
    assert!(checkpoint(&pg).unwrap().lsn < unwritten);
}
