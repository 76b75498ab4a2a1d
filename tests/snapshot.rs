//! The snapshot-to-stream handoff: rows that exist when the slot is created go
//! out through an exported snapshot, later inserts through the stream, none twice.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use walbox_testkit::kafka::Record;
use walbox_testkit::{Broker, OUTBOX_DDL, PgCluster};

const TOPIC: &str = "outbox.order";
const KEYS: i64 = 100;

async fn start() -> (PgCluster, Broker, tokio_postgres::Client) {
    let pg = PgCluster::start().unwrap();
    let broker = Broker::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    // The event ids are random uuids: the snapshot reads in insertion order.
    db.batch_execute("ALTER TABLE outbox ADD COLUMN seq bigserial")
        .await
        .unwrap();
    (pg, broker, db)
}

/// `rows` outbox rows over `KEYS` keys, each key's `seq` counting from 0.
async fn existing_rows(db: &tokio_postgres::Client, rows: i64) {
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'order-' || (g % $2::bigint), 'OrderPlaced',
                jsonb_build_object('seq', g / $2::bigint, 'existing', true)
         FROM generate_series(0::bigint, $1::bigint - 1) g ORDER BY g",
        &[&rows, &KEYS],
    )
    .await
    .unwrap();
}

/// Inserts one event per transaction, round robin over the keys, each key's
/// `seq` continuing from `first_seq`, until `stop`; returns how many.
async fn writer(
    pg: &PgCluster,
    first_seq: i64,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<i64> {
    let db = pg.connect("postgres").await.unwrap();
    tokio::spawn(async move {
        let mut n = 0i64;
        while !stop.load(Ordering::Relaxed) {
            db.execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', 'order-' || ($1::bigint % $2::bigint), 'OrderPlaced',
                         jsonb_build_object('seq', $3::bigint + $1::bigint / $2::bigint))",
                &[&n, &KEYS, &first_seq],
            )
            .await
            .unwrap();
            n += 1;
        }
        n
    })
}

fn snapshot_config(pg: &PgCluster, extra: &str) -> String {
    config_file(
        pg,
        "snapshot.toml",
        &format!("[snapshot]\norder_by = [\"seq\"]\n{extra}"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_snapshot_hands_over_to_the_stream_under_concurrent_writes() {
    let (pg, broker, db) = start().await;
    existing_rows(&db, 100_000).await;
    let env = walbox_env(&pg, &broker);
    let cfg = snapshot_config(&pg, "");
    let stop = Arc::new(AtomicBool::new(false));
    let writing = writer(&pg, 1_000, Arc::clone(&stop)).await;
    // Let the writer get going, so the slot is created between its commits.
    walbox_testkit::wait_until_async("the writer to start", Duration::from_secs(30), || async {
        let n: i64 = db
            .query_one("SELECT count(*) FROM outbox", &[])
            .await
            .unwrap()
            .get(0);
        (n > 100_050).then_some(())
    })
    .await
    .unwrap();
    let (code, out, err) = tokio::task::spawn_blocking({
        let env = env.clone();
        let cfg = cfg.clone();
        move || walbox_cmd(&["setup", "--snapshot", "--config", &cfg], &env)
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("created publication"), "{out}");
    let cp = checkpoint(&pg).unwrap();
    let snap = cp.snapshot.clone().unwrap();
    assert!(snap.complete, "{cp:?}");
    assert!(snap.rows >= 100_000, "{cp:?}");
    assert_eq!(Some(cp.lsn), snap.consistent_point);
    assert_eq!(
        confirmed_lsn(&db, "walbox").await,
        cp.lsn,
        "the slot waits at the consistent point"
    );
    assert!(err.contains("snapshot: reading"), "{err}");

    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    // The writer keeps going while walbox streams, then stops.
    walbox_testkit::wait_until_async("the stream to publish", Duration::from_secs(60), || async {
        (confirmed_lsn(&db, "walbox").await > cp.lsn).then_some(())
    })
    .await
    .unwrap();
    stop.store(true, Ordering::Relaxed);
    let written = writing.await.unwrap();
    let total = usize::try_from(100_000 + written).unwrap();
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, total, "handoff").await;
    walbox.stop();
    let ids = outbox_ids(&db).await;
    let (missing, dup) = audit(&ids, &records);
    assert!(missing.is_empty(), "{} missing", missing.len());
    assert!(dup.is_empty(), "{} published twice", dup.len());
    assert_eq!(records.len(), total);
    // Each key: its existing rows in order, then its streamed rows in order.
    assert_per_key_order(&records, false);
    let from_snapshot = records
        .iter()
        .filter(|r| r.header("walbox_xid") == Some("0"))
        .count();
    assert_eq!(u64::try_from(from_snapshot).unwrap(), snap.rows);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filtered_snapshot_cuts_over_from_a_polling_relay() {
    let (pg, broker, db) = start().await;
    db.batch_execute("ALTER TABLE outbox ADD COLUMN published_at timestamptz")
        .await
        .unwrap();
    existing_rows(&db, 1_000).await;
    // The polling relay published the first 600.
    db.batch_execute("UPDATE outbox SET published_at = now() WHERE seq <= 600")
        .await
        .unwrap();
    // The publication exists; `walbox run` with snapshot mode "initial" creates
    // the slot with the snapshot itself.
    db.batch_execute("CREATE PUBLICATION walbox_outbox FOR TABLE outbox")
        .await
        .unwrap();
    let env = walbox_env(&pg, &broker);
    let cfg = snapshot_config(&pg, "mode = \"initial\"\n");
    let mut walbox = Walbox::spawn(
        &[
            "run",
            "--config",
            &cfg,
            "--snapshot-where",
            "published_at IS NULL",
        ],
        &env,
    );
    walbox_testkit::wait_until("the snapshot to finish", Duration::from_secs(60), || {
        checkpoint(&pg)
            .and_then(|c| c.snapshot)
            .filter(|s| s.complete)
            .map(drop)
    })
    .unwrap();
    write_events_from(&pg, 1, 5, 10, 10, 500).await;
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    walbox.stop();
    let records = read_topic(&broker.bootstrap(), TOPIC, 450).await;
    assert_eq!(
        records.len(),
        450,
        "400 pending rows and 50 new ones, once each"
    );
    let pending: std::collections::HashSet<String> = db
        .query(
            "SELECT id::text FROM outbox WHERE published_at IS NULL",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (missing, dup) = audit(&pending, &records);
    assert!(missing.is_empty() && dup.is_empty(), "{missing:?} {dup:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_snapshot_is_never_taken_for_complete_and_is_taken_again() {
    let (pg, broker, db) = start().await;
    existing_rows(&db, 50_000).await;
    db.batch_execute("CREATE PUBLICATION walbox_outbox FOR TABLE outbox")
        .await
        .unwrap();
    let env = walbox_env(&pg, &broker);
    // Few events in flight: the snapshot takes long enough to be killed in it.
    let slow = snapshot_config(&pg, "mode = \"initial\"\n[sink]\nmax_in_flight = 5\n");
    let mut walbox = Walbox::spawn(&["run", "--config", &slow], &env);
    let bootstrap = broker.bootstrap();
    tokio::task::spawn_blocking(move || {
        walbox_testkit::kafka::read_at_least(&bootstrap, TOPIC, 2_000, Duration::from_secs(60))
    })
    .await
    .unwrap()
    .unwrap();
    walbox.kill9();
    let cp = checkpoint(&pg).unwrap();
    assert!(cp.snapshot_interrupted(), "killed mid-snapshot: {cp:?}");

    let fast = config_file(
        &pg,
        "fast.toml",
        "[snapshot]\nmode = \"initial\"\norder_by = [\"seq\"]\n",
    );
    let mut walbox = Walbox::spawn(&["run", "--config", &fast], &env);
    walbox_testkit::wait_until("the snapshot to finish", Duration::from_secs(120), || {
        checkpoint(&pg)
            .and_then(|c| c.snapshot)
            .filter(|s| s.complete)
            .map(drop)
    })
    .unwrap();
    write_events_from(&pg, 1, 10, 10, 10, 500).await;
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, 50_100, "redo").await;
    walbox.stop();
    let log = walbox.log();
    assert!(log.contains("did not finish; taking it again"), "{log}");
    assert!(
        log.contains("taking the snapshot again from a temporary slot"),
        "{log}"
    );
    let cp = checkpoint(&pg).unwrap();
    assert_eq!(cp.snapshot.unwrap().rows, 50_000);
    // Rows of the first attempt come again with the same ids; nothing is missing,
    // and each key's rows are in order within each attempt.
    assert!(
        records.len() > 50_100,
        "the first attempt's rows were published again"
    );
    assert_per_key_order(&records, true);
}

/// The stdout sink hands events to its writer in batches; a snapshot whose rows
/// are not a whole number of batches must still be written and acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_through_the_stdout_sink_writes_every_row_once() {
    let (pg, broker, db) = start().await;
    existing_rows(&db, 2_500).await;
    let mut env = walbox_env(&pg, &broker);
    env.push(("WALBOX_SINK", "stdout".into()));
    let cfg = snapshot_config(&pg, "");
    let (code, out, err) = tokio::task::spawn_blocking(move || {
        walbox_cmd(&["setup", "--snapshot", "--config", &cfg], &env)
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{err}");
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 2_500, "{err}");
    let ids = outbox_ids(&db).await;
    let written: std::collections::HashSet<&str> = lines
        .iter()
        .map(|l| l["headers"]["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(written.len(), 2_500, "each row once");
    assert!(written.iter().all(|id| ids.contains(*id)));
    assert!(lines.iter().all(|l| l["headers"]["walbox_xid"] == "0"));
    let cp = checkpoint(&pg).unwrap();
    assert!(cp.snapshot.is_some_and(|s| s.complete && s.rows == 2_500));
}

/// `setup --snapshot` stopped by SIGTERM has not published every row: it exits
/// non-zero, and the checkpoint says the snapshot is to be taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_snapshot_stopped_by_a_signal_fails_and_leaves_it_to_be_taken_again() {
    let (pg, broker, db) = start().await;
    existing_rows(&db, 200_000).await;
    let env = walbox_env(&pg, &broker);
    let cfg = snapshot_config(&pg, "");
    let mut walbox = Walbox::spawn(&["setup", "--snapshot", "--config", &cfg], &env);
    walbox_testkit::wait_until("the snapshot to start", Duration::from_secs(60), || {
        walbox
            .log()
            .contains("created slot with an exported snapshot")
            .then_some(())
    })
    .unwrap();
    walbox.signal(nix::sys::signal::Signal::SIGTERM);
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("stopped before the snapshot finished; the next start"),
        "{log}"
    );
    assert!(!log.contains("snapshot: published"), "{log}");
    assert!(checkpoint(&pg).unwrap().snapshot_interrupted());
}

/// Starts `walbox run` with a snapshot slowed down to `max_in_flight = 5`, waits
/// until `started` holds for its log and what the topic has, and kills it (-9).
/// Checks that the checkpoint says "unfinished" and that the slot is still at
/// the snapshot's consistent point (nothing is reported before the snapshot
/// completes); returns that point.
async fn interrupt_the_snapshot(
    pg: &PgCluster,
    broker: &Broker,
    db: &tokio_postgres::Client,
    published_before: usize,
) -> walbox_pgoutput::Lsn {
    let env = walbox_env(pg, broker);
    let slow = snapshot_config(pg, "mode = \"initial\"\n[sink]\nmax_in_flight = 5\n");
    let mut walbox = Walbox::spawn(&["run", "--config", &slow], &env);
    walbox_testkit::wait_until("the snapshot to start", Duration::from_secs(60), || {
        walbox.log().contains("snapshot: reading").then_some(())
    })
    .unwrap();
    if published_before > 0 {
        let bootstrap = broker.bootstrap();
        tokio::task::spawn_blocking(move || {
            walbox_testkit::kafka::read_at_least(
                &bootstrap,
                TOPIC,
                published_before,
                Duration::from_secs(60),
            )
        })
        .await
        .unwrap()
        .unwrap();
    }
    walbox.kill9();
    let cp = checkpoint(pg).unwrap();
    assert!(cp.snapshot_interrupted(), "killed mid-snapshot: {cp:?}");
    let point = cp.snapshot.as_ref().unwrap().consistent_point.unwrap();
    assert_eq!(cp.lsn, point, "{cp:?}");
    assert_eq!(
        confirmed_lsn(db, "walbox").await,
        point,
        "the slot stays at the consistent point while the snapshot is unfinished"
    );
    point
}

/// One transaction: inserts an outbox event for `key` with payload `seq`, with
/// a known id, and deletes it again (an outbox that is always empty). Returns
/// the id.
async fn insert_and_delete(db: &tokio_postgres::Client, n: u32, key: &str, seq: i64) -> String {
    let id = format!("00000000-0000-4000-8000-{n:012}");
    db.batch_execute(&format!(
        "BEGIN;
         INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         VALUES ('{id}', 'order', '{key}', 'OrderPlaced', '{{\"seq\": {seq}}}');
         DELETE FROM outbox WHERE id = '{id}';
         COMMIT;"
    ))
    .await
    .unwrap();
    id
}

/// Per key, the first appearance of each event id is in commit order: over
/// first appearances in partition order, the payload's `seq` counts 0, 1, 2, ...
/// Repeats of an id already seen are allowed anywhere.
fn assert_first_appearances_in_commit_order(records: &[Record]) {
    let mut sorted: Vec<&Record> = records.iter().collect();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    let mut seen = std::collections::HashSet::new();
    let mut next: std::collections::HashMap<String, i64> = std::collections::HashMap::new();
    for r in sorted {
        if !seen.insert(r.header("event_id").expect("event id").to_owned()) {
            continue;
        }
        let key = r.key_str().expect("key").to_owned();
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
        let seq = v["payload"]["seq"].as_i64().unwrap();
        let expected = next.entry(key.clone()).or_insert(0);
        assert_eq!(
            seq, *expected,
            "key {key}: first appearance of seq {seq} where {expected} was expected"
        );
        *expected += 1;
    }
}

/// Every id in `ids` is on the topic.
fn assert_on_topic(ids: &[String], records: &[Record], what: &str) {
    let on_topic: std::collections::HashSet<&str> = records
        .iter()
        .filter_map(|r| r.header("event_id"))
        .collect();
    let missing: Vec<&String> = ids
        .iter()
        .filter(|id| !on_topic.contains(id.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} {what} missing: {missing:?}",
        missing.len(),
        ids.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_inserted_and_deleted_after_an_interrupted_snapshot_are_published() {
    let (pg, broker, db) = start().await;
    existing_rows(&db, 20_000).await;
    db.batch_execute("CREATE PUBLICATION walbox_outbox FOR TABLE outbox")
        .await
        .unwrap();
    let point = interrupt_the_snapshot(&pg, &broker, &db, 0).await;
    // While walbox is down: 20 transactions each insert an event and delete it,
    // 5 per key on keys of their own; only the slot has them. Half of them come
    // before a second start that is killed while it takes the snapshot again.
    let mut gone = Vec::new();
    for n in 0..20u32 {
        if n == 10 {
            assert_eq!(interrupt_the_snapshot(&pg, &broker, &db, 0).await, point);
        }
        gone.push(insert_and_delete(&db, n, &format!("gone-{}", n % 4), i64::from(n / 4)).await);
    }
    let env = walbox_env(&pg, &broker);
    let fast = snapshot_config(&pg, "mode = \"initial\"\n");
    let mut walbox = Walbox::spawn(&["run", "--config", &fast], &env);
    walbox_testkit::wait_until("the snapshot to finish", Duration::from_secs(120), || {
        checkpoint(&pg)
            .and_then(|c| c.snapshot)
            .filter(|s| s.complete)
            .map(drop)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, 20_000, "retake").await;
    let log = walbox.log();
    walbox.stop();
    assert!(
        log.contains("taking the snapshot again from a temporary slot"),
        "{log}"
    );
    assert_on_topic(
        &gone,
        &records,
        "events inserted and deleted after the consistent point",
    );
    assert_first_appearances_in_commit_order(&records);
    let cp = checkpoint(&pg).unwrap();
    assert!(cp.lsn >= point, "{cp:?}");
    assert_eq!(cp.snapshot.unwrap().rows, 20_000);
    // The temporary slot went with its connection.
    walbox_testkit::wait_until_async(
        "the temporary slot to go",
        Duration::from_secs(30),
        || async {
            let slots: i64 = db
                .query_one("SELECT count(*) FROM pg_replication_slots", &[])
                .await
                .unwrap()
                .get(0);
            (slots == 1).then_some(())
        },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanup_of_published_rows_after_an_interrupted_snapshot_loses_nothing() {
    let (pg, broker, db) = start().await;
    existing_rows(&db, 20_000).await;
    db.batch_execute("CREATE PUBLICATION walbox_outbox FOR TABLE outbox")
        .await
        .unwrap();
    let all_before = outbox_ids(&db).await;
    interrupt_the_snapshot(&pg, &broker, &db, 2_000).await;
    // New events come in (they stay), and a cleanup job deletes the rows already
    // on the topic; events of other keys are inserted and deleted at once.
    let mut gone = Vec::new();
    for n in 0..20u32 {
        let key = format!("late-{}", n % 4);
        db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', $1, 'OrderPlaced', jsonb_build_object('seq', $2::bigint))",
            &[&key, &i64::from(n / 4)],
        )
        .await
        .unwrap();
        gone.push(insert_and_delete(&db, n, &format!("gone-{}", n % 4), i64::from(n / 4)).await);
    }
    let published = read_topic(&broker.bootstrap(), TOPIC, 2_000).await;
    let published_ids: Vec<String> = published
        .iter()
        .filter_map(|r| r.header("event_id").map(str::to_owned))
        .collect();
    let deleted = db
        .execute(
            "DELETE FROM outbox WHERE id::text = ANY($1)",
            &[&published_ids],
        )
        .await
        .unwrap();
    assert!(deleted >= 2_000, "{deleted}");
    let env = walbox_env(&pg, &broker);
    let fast = snapshot_config(&pg, "mode = \"initial\"\n");
    let mut walbox = Walbox::spawn(&["run", "--config", &fast], &env);
    walbox_testkit::wait_until("the snapshot to finish", Duration::from_secs(120), || {
        checkpoint(&pg)
            .and_then(|c| c.snapshot)
            .filter(|s| s.complete)
            .map(drop)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    let remaining = 20_000 - usize::try_from(deleted).unwrap() + 20;
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, remaining, "cleanup").await;
    walbox.stop();
    let before: Vec<String> = all_before.into_iter().collect();
    assert_on_topic(
        &before,
        &records,
        "rows of the outbox before the first start",
    );
    assert_on_topic(
        &gone,
        &records,
        "events inserted and deleted after the consistent point",
    );
    assert_first_appearances_in_commit_order(&records);
    let cp = checkpoint(&pg).unwrap();
    assert_eq!(
        cp.snapshot.unwrap().rows,
        u64::try_from(remaining).unwrap(),
        "the retaken snapshot read what the cleanup left, and the 20 kept new rows"
    );
}

/// The default order of a uuid-keyed outbox with an `occurred_at` column: by
/// occurrence time, so each key's existing events go out in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uuid_keyed_outbox_is_snapshotted_in_per_key_commit_order_by_default() {
    let pg = PgCluster::start().unwrap();
    let broker = Broker::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    // One event per transaction (occurred_at = now() of each), round robin over
    // 20 keys.
    for n in 0..1_000i64 {
        db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'order-' || ($1::bigint % 20), 'OrderPlaced',
                     jsonb_build_object('seq', $1::bigint / 20))",
            &[&n],
        )
        .await
        .unwrap();
    }
    let env = walbox_env(&pg, &broker);
    let (code, out, err) = tokio::task::spawn_blocking({
        let env = env.clone();
        move || walbox_cmd(&["setup", "--snapshot"], &env)
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(!err.contains("WARN"), "{err}");
    let records = read_topic(&broker.bootstrap(), TOPIC, 1_000).await;
    assert_eq!(records.len(), 1_000);
    assert_per_key_order(&records, false);

    // `walbox doctor` names the order, and warns once nothing orders the table.
    let (_, out, err) = walbox_cmd(&["doctor"], &env);
    assert!(
        out.contains("a snapshot reads public.outbox by occurred_at, id (occurrence time"),
        "{out}\n{err}"
    );
    db.batch_execute("ALTER TABLE outbox DROP COLUMN occurred_at")
        .await
        .unwrap();
    let (_, out, err) = walbox_cmd(&["doctor"], &env);
    assert!(
        out.contains("warn a snapshot reads public.outbox in primary key order (id)")
            && out.contains("snapshot.order_by = ["),
        "{out}\n{err}"
    );
}

/// One row for each key, with `seq`, in one transaction.
async fn round(db: &tokio_postgres::Client, seq: i64) {
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'order-' || k, 'OrderPlaced', jsonb_build_object('seq', $1::bigint)
         FROM generate_series(0::bigint, $2::bigint - 1) k",
        &[&seq, &KEYS],
    )
    .await
    .unwrap();
}

/// Per key, the first copies of the stdout sink's events carry `seq` 0, 1, ...
/// up to `rounds - 1`, and every row of the table was published.
async fn assert_every_row_in_key_order(
    db: &tokio_postgres::Client,
    lines: &[serde_json::Value],
    rounds: i64,
) {
    let mut next: std::collections::HashMap<String, i64> = std::collections::HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for l in lines {
        if !seen.insert(l["headers"]["event_id"].as_str().unwrap().to_owned()) {
            continue;
        }
        let key = l["key"].as_str().unwrap().to_owned();
        let seq = l["value"]["payload"]["seq"].as_i64().unwrap();
        let expected = next.entry(key.clone()).or_insert(0);
        assert_eq!(seq, *expected, "key {key}: first copies out of order");
        *expected += 1;
    }
    assert_eq!(next.len(), usize::try_from(KEYS).unwrap());
    assert!(next.values().all(|n| *n == rounds), "{next:?}");
    assert_eq!(seen, outbox_ids(db).await);
}

/// Waits until walbox has written `n` distinct events.
fn wait_distinct(walbox: &mut Walbox, n: usize) -> Vec<serde_json::Value> {
    walbox_testkit::wait_until(&format!("{n} events"), Duration::from_secs(90), || {
        assert!(walbox.running(), "walbox exited:\n{}", walbox.log());
        let lines = json_lines(&walbox.log());
        let distinct: std::collections::HashSet<&str> = lines
            .iter()
            .map(|l| l["headers"]["event_id"].as_str().unwrap())
            .collect();
        (distinct.len() >= n).then_some(lines)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()))
}

/// A new user whose configuration asks for an initial snapshot follows
/// walbox's own messages: `run` refuses (no publication) and says to run
/// `walbox setup`; setup creates the slot and says that `run` publishes the
/// rows already there first; rows go in meanwhile (the slot holds them); `run`
/// then publishes every row the table held, before the stream.
/// Another user had made the slot by hand (`walbox slot create`), before more
/// rows went in: `run` with the initial mode does not adopt it silently, it
/// takes the snapshot from a temporary slot first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_mode_initial_publishes_the_existing_rows_after_setup_or_a_slot_made_without_one()
{
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    db.batch_execute("ALTER TABLE outbox ADD COLUMN seq bigserial")
        .await
        .unwrap();
    existing_rows(&db, 5 * KEYS).await;
    let cfg = config_file(
        &pg,
        "initial.toml",
        "[snapshot]\nmode = \"initial\"\norder_by = [\"seq\"]\n",
    );
    let env_for = |slot: &str, checkpoint: &str| -> Vec<(&'static str, String)> {
        vec![
            ("WALBOX_DSN", pg.conninfo("postgres")),
            ("WALBOX_SINK", "stdout".into()),
            ("WALBOX_SLOT", slot.into()),
            ("WALBOX_PUBLICATION", "walbox_outbox".into()),
            (
                "WALBOX_CHECKPOINT",
                pg.client_dir().join(checkpoint).display().to_string(),
            ),
            ("WALBOX_CONFIG", cfg.clone()),
        ]
    };
    let env = env_for("walbox", "walbox.json");
    let cmd = |args: &'static [&'static str], env: Vec<(&'static str, String)>| {
        tokio::task::spawn_blocking(move || walbox_cmd(args, &env))
    };
    // 1. The first start refuses, naming the command.
    let (code, _, err) = cmd(&["run"], env.clone()).await.unwrap();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("walbox setup"), "{err}");
    // 2. The command it names.
    let (code, out, err) = cmd(&["setup"], env.clone()).await.unwrap();
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("created slot walbox")
            && out.contains("has no snapshot taken on it")
            && out.contains("publishes the rows already in the outbox first"),
        "setup says what run does about the rows already there:\n{out}"
    );
    // Something happens before the start.
    round(&db, 5).await;
    // 3. The start publishes every row, then streams.
    let mut walbox = Walbox::spawn(&["run"], &env);
    round(&db, 6).await;
    let lines = wait_distinct(&mut walbox, usize::try_from(7 * KEYS).unwrap());
    assert_every_row_in_key_order(&db, &lines, 7).await;
    walbox.stop();

    // A slot made without a snapshot, rows written after it, then `run`.
    let env_b = env_for("walbox_b", "walbox_b.json");
    let (code, out, err) = cmd(&["slot", "create"], env_b.clone()).await.unwrap();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("created slot walbox_b"), "{out}");
    round(&db, 7).await;
    let mut walbox = Walbox::spawn(&["run"], &env_b);
    round(&db, 8).await;
    let lines = wait_distinct(&mut walbox, usize::try_from(9 * KEYS).unwrap());
    assert_every_row_in_key_order(&db, &lines, 9).await;
    assert!(
        walbox.log().contains("no snapshot was taken on it"),
        "{}",
        walbox.log()
    );
    walbox.stop();
}
