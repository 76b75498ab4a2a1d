//! walbox into Redis Streams on a real `redis-server` (append-only file,
//! fsync on every write) and a real PostgreSQL: every event stored once, at
//! the entry id its position gives, in per-key order, and `walbox verify`
//! agrees; kill -9 rounds of walbox under four writers leave no event missing
//! and none stored twice; redis-server killed -9 and restarted on its data
//! directory under load loses nothing it acknowledged; events below a
//! retaken snapshot's rows are appended after them, not taken for stored; a
//! replay stores its range again; a second walbox on the same stream is
//! refused naming both; the password never reaches the log, even at trace;
//! a pending dead letter whose entry is gone is reported, never skipped.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use walbox_testkit::{OUTBOX_DDL, PgCluster, RedisOptions, RedisServer};

const STREAM: &str = "outbox.order";

/// One entry as read back.
#[derive(Debug)]
struct Entry {
    id: String,
    fields: HashMap<String, String>,
}

impl Entry {
    fn field(&self, name: &str) -> &str {
        self.fields
            .get(name)
            .unwrap_or_else(|| panic!("no field {name} in {:?}", self.fields))
    }
    fn header(&self, name: &str) -> &str {
        self.field(&format!("header:{name}"))
    }
    fn seq(&self) -> i64 {
        let v: serde_json::Value = serde_json::from_str(self.field("value")).unwrap();
        v["payload"]["seq"].as_i64().unwrap()
    }
    /// The position the entry's headers name, as its natural entry id (the
    /// tests' rows with transaction id 0 are snapshot rows).
    fn natural_id(&self) -> String {
        let position = walbox_outbox::Position {
            commit_lsn: self.header("walbox_commit_lsn").parse().unwrap(),
            index: self.header("walbox_index").parse().unwrap(),
            xid: self.header("walbox_xid").parse().unwrap(),
        };
        let origin = if position.xid == 0 {
            walbox_outbox::Origin::Snapshot {
                point: position.commit_lsn,
            }
        } else {
            walbox_outbox::Origin::Stream
        };
        walbox_sink::event_entry_id(&position, &origin)
    }
}

async fn connection(
    redis: &RedisServer,
    password: Option<&str>,
) -> redis::aio::MultiplexedConnection {
    let url = match password {
        Some(p) => format!("redis://:{p}@127.0.0.1:{}", redis.port()),
        None => redis.url(),
    };
    // The client's default of 1 s to connect is short for a machine busy
    // with other tests: each attempt gets 10 s, and a failed one is tried
    // again until a minute has passed.
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(10)))
        .set_response_timeout(Some(Duration::from_secs(60)));
    let client = redis::Client::open(url).unwrap();
    let last = std::sync::Mutex::new(None);
    let connected = walbox_testkit::wait_until_async(
        "a connection to redis-server",
        Duration::from_secs(60),
        || async {
            match client
                .get_multiplexed_async_connection_with_config(&config)
                .await
            {
                Ok(con) => Some(con),
                Err(e) => {
                    *last.lock().unwrap() = Some(e.to_string());
                    None
                }
            }
        },
    )
    .await;
    connected.unwrap_or_else(|e| panic!("{e}; the last attempt: {:?}", last.lock().unwrap()))
}

/// Everything stream `key` holds, in id order.
async fn read_entries(redis: &RedisServer, key: &str) -> Vec<Entry> {
    let mut con = connection(redis, None).await;
    let v: redis::Value = redis::cmd("XRANGE")
        .arg(key)
        .arg("-")
        .arg("+")
        .query_async(&mut con)
        .await
        .unwrap();
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        other => panic!("{other:?}"),
    };
    let redis::Value::Array(items) = v else {
        panic!("{v:?}")
    };
    items
        .iter()
        .map(|i| {
            let redis::Value::Array(parts) = i else {
                panic!("{i:?}")
            };
            let redis::Value::Array(kv) = &parts[1] else {
                panic!("{parts:?}")
            };
            Entry {
                id: text(&parts[0]),
                fields: kv.chunks(2).map(|c| (text(&c[0]), text(&c[1]))).collect(),
            }
        })
        .collect()
}

/// A cluster with the outbox table, a redis-server, and the environment
/// that points walbox at both with `[sink.redis]` settings `extra`.
async fn servers_redis(
    options: RedisOptions,
    extra: &str,
) -> (
    PgCluster,
    RedisServer,
    tokio_postgres::Client,
    Vec<(&'static str, String)>,
) {
    let pg = PgCluster::start().unwrap();
    let redis = RedisServer::start_with(options).unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let toml = redis_toml(&redis, "", extra, "");
    let env = vec![
        ("WALBOX_DSN", pg.conninfo("postgres")),
        ("WALBOX_SLOT", "walbox".into()),
        ("WALBOX_PUBLICATION", "walbox_outbox".into()),
        (
            "WALBOX_CHECKPOINT",
            checkpoint_path(&pg).display().to_string(),
        ),
        (
            "WALBOX_CONFIG",
            config_file(&pg, "walbox-redis.toml", &toml),
        ),
    ];
    (pg, redis, db, env)
}

/// A configuration for `redis`: `sink` lines in `[sink]`, `redis` lines in
/// `[sink.redis]`, then `rest` (whole sections).
fn redis_toml(redis: &RedisServer, sink: &str, redis_lines: &str, rest: &str) -> String {
    format!(
        "[sink]\ntype = \"redis\"\n{sink}\n\n[sink.redis]\nurl = \"{}\"\n{redis_lines}\n\n{rest}\n",
        redis.url()
    )
}

/// Each key's `seq` grows by one from 0 in stream order: no gap, no repeat.
fn assert_per_key_order_once(entries: &[Entry]) {
    let mut next: HashMap<String, i64> = HashMap::new();
    for e in entries {
        let key = e.field("key").to_owned();
        let seq = e.seq();
        let expected = next.entry(key.clone()).or_insert(0);
        assert_eq!(
            seq, *expected,
            "key {key}: seq {seq} where {expected} was expected"
        );
        *expected += 1;
    }
}

/// No two entries with one event id; the stream holds exactly `ids`; each
/// entry sits at the id its position gives.
fn assert_each_event_once_at_its_position(entries: &[Entry], ids: &HashSet<String>) {
    let mut seen = HashSet::new();
    for e in entries {
        let id = e.field("event_id");
        assert_eq!(e.header("event_id"), id);
        assert_eq!(e.id, e.natural_id(), "event {id}");
        assert_eq!(e.field("walbox_writer"), "walbox");
        assert!(seen.insert(id.to_owned()), "event {id} stored twice");
    }
    assert_eq!(&seen, ids, "the stream holds exactly the table's events");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_stored_once_at_their_positions_in_per_key_order_and_verify_agrees() {
    let (pg, redis, db, env) = servers_redis(RedisOptions::default(), "").await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 2, 10, 10, 10).await;
    caught_up(&db, &walbox).await;
    let entries = read_entries(&redis, STREAM).await;
    assert_eq!(entries.len(), 200, "{}", walbox.log());
    assert_each_event_once_at_its_position(&entries, &outbox_ids(&db).await);
    assert_per_key_order_once(&entries);
    assert!(
        entries
            .iter()
            .all(|e| e.header("event_type") == "OrderPlaced")
    );
    walbox.stop();
    // doctor reads the server's durability.
    let (_, out, err) = walbox_cmd(&["doctor"], &env);
    assert!(
        out.contains("appendonly yes and appendfsync always"),
        "{out}{err}"
    );
    let (status, out, err) = walbox_cmd(&["verify"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("missing          0"), "{out}");
    assert!(out.contains("(200 records)"), "{out}");
    // An entry gone from the stream is reported missing.
    let mut con = connection(&redis, None).await;
    let _: i64 = redis::cmd("XDEL")
        .arg(STREAM)
        .arg(&entries[7].id)
        .query_async(&mut con)
        .await
        .unwrap();
    let (status, out, _) = walbox_cmd(&["verify"], &env);
    assert_ne!(status, Some(0), "{out}");
    assert!(out.contains("missing          1"), "{out}");
    drop(pg);
}

/// Four writers, each committing transactions of 5 events over 3 keys of its
/// own until stopped; yields how many events they committed.
async fn four_writers(
    pg: &PgCluster,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<usize>> {
    let mut out = Vec::new();
    for w in 0..4 {
        let db = pg.connect("postgres").await.unwrap();
        let stop = Arc::clone(&stop);
        out.push(tokio::spawn(async move {
            let mut seq = [0i64; 3];
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let mut sql = String::from("BEGIN;");
                for _ in 0..5 {
                    let k = n % 3;
                    sql.push_str(&outbox_insert(&format!("w{w}-order-{k}"), seq[k]));
                    seq[k] += 1;
                    n += 1;
                }
                sql.push_str("COMMIT;");
                db.batch_execute(&sql).await.unwrap();
            }
            n
        }));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_rounds_under_four_writers_store_every_event_once_in_per_key_order() {
    let (pg, redis, db, env) = servers_redis(RedisOptions::default(), "").await;
    setup(&env);
    let stop_writing = Arc::new(AtomicBool::new(false));
    let writers = four_writers(&pg, Arc::clone(&stop_writing)).await;
    kill_9_rounds(&pg, &db, &env, 10).await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    stop_writing.store(true, Ordering::Relaxed);
    let mut written = 0;
    for w in writers {
        written += w.await.unwrap();
    }
    caught_up(&db, &walbox).await;
    let log = walbox.log();
    walbox.stop();
    let entries = read_entries(&redis, STREAM).await;
    let ids = outbox_ids(&db).await;
    assert_eq!(ids.len(), written);
    assert_eq!(entries.len(), written, "exactly once: {log}");
    assert_each_event_once_at_its_position(&entries, &ids);
    assert_per_key_order_once(&entries);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_under_load_loses_nothing_it_acknowledged() {
    let (pg, mut redis, db, env) =
        servers_redis(RedisOptions::default(), "ack_timeout_ms = 2000").await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    let stop_writing = Arc::new(AtomicBool::new(false));
    let writers = four_writers(&pg, Arc::clone(&stop_writing)).await;
    for _ in 0..2 {
        wait_slot_moves(&db, confirmed_lsn(&db, "walbox").await).await;
        redis.kill9().unwrap();
        // Writers go on while the server is down.
        let rows: i64 = db
            .query_one("SELECT count(*) FROM outbox", &[])
            .await
            .unwrap()
            .get(0);
        walbox_testkit::wait_until_async("commits while down", Duration::from_secs(60), || async {
            let n: i64 = db
                .query_one("SELECT count(*) FROM outbox", &[])
                .await
                .unwrap()
                .get(0);
            (n >= rows + 200).then_some(())
        })
        .await
        .unwrap();
        redis.start_again().unwrap();
        // walbox goes on with a new session. An entry Redis acknowledged
        // and lost would be missing at the end: the slot moved past it.
        assert!(walbox.running(), "{}", walbox.log());
    }
    wait_slot_moves(&db, confirmed_lsn(&db, "walbox").await).await;
    stop_writing.store(true, Ordering::Relaxed);
    let mut written = 0;
    for w in writers {
        written += w.await.unwrap();
    }
    caught_up(&db, &walbox).await;
    let log = walbox.log();
    walbox.stop();
    let entries = read_entries(&redis, STREAM).await;
    let ids = outbox_ids(&db).await;
    assert_eq!(ids.len(), written);
    assert_eq!(entries.len(), written, "nothing lost, nothing twice: {log}");
    assert_each_event_once_at_its_position(&entries, &ids);
    assert_per_key_order_once(&entries);
}

/// One transaction: inserts an outbox event for `key` with payload `seq`, with
/// an id of its own, and deletes it again: only the slot has it.
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_below_a_retaken_snapshot_are_appended_after_its_rows_not_taken_for_stored() {
    let (pg, redis, db, env) = servers_redis(RedisOptions::default(), "").await;
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'order-' || (g % 10), 'OrderPlaced', jsonb_build_object('seq', g / 10)
         FROM generate_series(0, 4999) g ORDER BY g",
        &[],
    )
    .await
    .unwrap();
    db.batch_execute("CREATE PUBLICATION walbox_outbox FOR TABLE outbox")
        .await
        .unwrap();
    let snapshot = "[snapshot]\nmode = \"initial\"\n";
    let slow = config_file(
        &pg,
        "slow.toml",
        &redis_toml(&redis, "max_in_flight = 5", "", snapshot),
    );
    // The first snapshot (consistent point P1) is killed part-way.
    let mut walbox = Walbox::spawn(&["run", "--config", &slow], &env);
    walbox_testkit::wait_until_async(
        "part of the snapshot stored",
        Duration::from_secs(60),
        || async { (read_entries(&redis, STREAM).await.len() >= 300).then_some(()) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    walbox.kill9();
    let p1 = checkpoint(&pg).unwrap().lsn;
    wait_slot_released(&db, "walbox").await;
    // Events between P1 and the retaken snapshot's point P2: inserted and
    // deleted at once (only the slot has them), and kept ones.
    let mut gone = Vec::new();
    for n in 0..8u32 {
        gone.push(insert_and_delete(&db, n, &format!("gone-{}", n % 2), i64::from(n / 2)).await);
    }
    for n in 0..4 {
        db.batch_execute(&outbox_insert(&format!("late-{n}"), 0))
            .await
            .unwrap();
    }
    let fast = config_file(&pg, "fast.toml", &redis_toml(&redis, "", "", snapshot));
    let mut walbox = Walbox::spawn(&["run", "--config", &fast], &env);
    walbox_testkit::wait_until("the snapshot to finish", Duration::from_secs(120), || {
        checkpoint(&pg)
            .and_then(|c| c.snapshot)
            .filter(|s| s.complete)
            .map(drop)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    caught_up(&db, &walbox).await;
    let log = walbox.log();
    walbox.stop();
    assert!(log.contains("taking the snapshot again"), "{log}");
    let entries = read_entries(&redis, STREAM).await;
    let stored: HashSet<&str> = entries.iter().map(|e| e.field("event_id")).collect();
    for id in outbox_ids(&db).await {
        assert!(stored.contains(id.as_str()), "event {id} missing: {log}");
    }
    // The deleted events came from the stream, below the retaken snapshot's
    // rows: each is stored once, after them, not at its own id.
    let top_of_snapshot = entries
        .iter()
        .filter(|e| e.header("walbox_xid") == "0")
        .map(|e| walbox_sink::position_of(&e.id).unwrap())
        .max()
        .unwrap();
    for id in &gone {
        let copies: Vec<&Entry> = entries
            .iter()
            .filter(|e| e.field("event_id") == id)
            .collect();
        assert_eq!(copies.len(), 1, "event {id}: {log}");
        let e = copies[0];
        let lsn: walbox_pgoutput::Lsn = e.header("walbox_commit_lsn").parse().unwrap();
        assert!(lsn > p1, "{lsn} after {p1}");
        assert_ne!(e.id, e.natural_id(), "event {id} appended after the top");
        assert!(walbox_sink::position_of(&e.id).unwrap() > top_of_snapshot);
    }
    // Per key, the deleted events keep their order.
    let gone_entries: Vec<Entry> = entries
        .into_iter()
        .filter(|e| e.field("key").starts_with("gone-"))
        .collect();
    assert_eq!(gone_entries.len(), 8);
    assert_per_key_order_once(&gone_entries);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_stores_its_range_again_once_even_when_killed_and_run_again() {
    let (pg, redis, db, env) = servers_redis(RedisOptions::default(), "").await;
    let window = "[source]\nreplay_window = \"1h\"\n";
    let cfg = config_file(&pg, "replay.toml", &redis_toml(&redis, "", "", window));
    let slow = config_file(
        &pg,
        "slow.toml",
        &redis_toml(&redis, "max_in_flight = 1", "", window),
    );
    setup(&env);
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    write_events(&pg, 2, 5, 10, 10).await; // 100 events
    let from = current_lsn(&db).await;
    write_events_from(&pg, 2, 50, 10, 10, 10).await; // 1000 more, keys 10..19
    wait_checkpoint(&pg, current_lsn(&db).await, Duration::from_secs(60)).await;
    walbox.stop();
    assert_eq!(
        read_entries(&redis, STREAM).await.len(),
        1100,
        "{}",
        walbox.log()
    );
    let (from, to) = (from.to_string(), checkpoint(&pg).unwrap().lsn.to_string());
    let args = ["replay", "--from", from.as_str(), "--to", to.as_str()];
    // A replay killed part-way.
    let mut replay = Walbox::spawn(&[&args[..], &["--config", &slow]].concat(), &env);
    walbox_testkit::wait_until_async(
        "part of the replay stored",
        Duration::from_secs(60),
        || async { (read_entries(&redis, STREAM).await.len() >= 1100 + 100).then_some(()) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", replay.log()));
    replay.kill9();
    let partial = read_entries(&redis, STREAM).await.len() - 1100;
    assert!(
        partial < 1000,
        "the kill came after the replay ended: {}",
        replay.log()
    );
    wait_slot_released(&db, "walbox").await;
    // Run again with the same --from: what the killed run stored is counted,
    // not stored twice.
    let (code, out, err) = walbox_cmd(&[&args[..], &["--config", &cfg]].concat(), &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("events already stored by an earlier run of this replay"),
        "{out}"
    );
    let entries = read_entries(&redis, STREAM).await;
    assert_eq!(entries.len(), 2100, "{out}\n{err}");
    let originals: HashSet<&str> = entries[100..1100]
        .iter()
        .map(|e| e.field("event_id"))
        .collect();
    let mut copies = HashSet::new();
    for c in &entries[1100..] {
        assert!(originals.contains(c.field("event_id")));
        assert!(copies.insert(c.field("event_id")), "copied twice");
        assert_eq!(c.field("walbox_replay"), from);
        assert_ne!(c.id, c.natural_id());
    }
    let replayed: Vec<Entry> = entries.into_iter().skip(1100).collect();
    assert_per_key_order_once(&replayed);
    // walbox goes on, its new events at their own ids, after the copies.
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    write_events_from(&pg, 1, 5, 10, 5, 20).await;
    wait_checkpoint(&pg, current_lsn(&db).await, Duration::from_secs(60)).await;
    walbox.stop();
    let entries = read_entries(&redis, STREAM).await;
    assert_eq!(entries.len(), 2150, "{}", walbox.log());
    for e in &entries[2100..] {
        assert_eq!(e.id, e.natural_id());
    }
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_walbox_on_the_same_stream_is_refused_naming_both() {
    let (pg, redis, db, env) = servers_redis(RedisOptions::default(), "").await;
    setup(&env);
    let mut first = Walbox::spawn(&["run"], &env);
    write_events(&pg, 1, 2, 10, 10).await;
    caught_up(&db, &first).await;
    first.stop();
    // Another walbox (its own slot and checkpoint) on the same outbox and stream.
    let mut other: Vec<(&str, String)> = env
        .iter()
        .filter(|(k, _)| *k != "WALBOX_SLOT" && *k != "WALBOX_CHECKPOINT")
        .cloned()
        .collect();
    other.push(("WALBOX_SLOT", "walbox_two".into()));
    other.push((
        "WALBOX_CHECKPOINT",
        pg.client_dir()
            .join("two.checkpoint.json")
            .display()
            .to_string(),
    ));
    setup(&other);
    write_events_from(&pg, 1, 1, 10, 10, 10).await;
    let (code, out, err) = walbox_cmd(&["run"], &other);
    assert_ne!(code, Some(0), "{out}\n{err}");
    assert!(
        err.contains("\"walbox\"")
            && err.contains("\"walbox_two\"")
            && err.contains("another writer"),
        "{err}"
    );
    let entries = read_entries(&redis, STREAM).await;
    assert_eq!(entries.len(), 20, "nothing of the second walbox stored");
    assert!(entries.iter().all(|e| e.field("walbox_writer") == "walbox"));
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_never_reaches_the_log_even_at_trace_and_a_wrong_one_stops_walbox() {
    const PASSWORD: &str = "redis-Pw-5e81c";
    let options = RedisOptions {
        password: Some(PASSWORD.into()),
        ..RedisOptions::default()
    };
    let (pg, redis, db, env) = servers_redis(options, "").await;
    setup(&env);
    let mut with_password = env.clone();
    with_password.push(("WALBOX_REDIS_PASSWORD", PASSWORD.into()));
    with_password.push(("WALBOX_LOG", "trace,tokio_postgres=trace".into()));
    let mut walbox = Walbox::spawn(&["run"], &with_password);
    write_events(&pg, 1, 1, 10, 10).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    let log = walbox.log();
    assert_eq!(read_entries_with(&redis, PASSWORD).await, 10, "{log}");
    assert!(log.contains("TRACE"), "trace logging is on");
    assert!(!log.contains(PASSWORD), "password in the log");
    // In the URL, at trace, through verify too.
    let url_cfg = config_file(
        &pg,
        "url.toml",
        &format!(
            "[sink]\ntype = \"redis\"\n[sink.redis]\nurl = \"redis://:{PASSWORD}@127.0.0.1:{}\"\n",
            redis.port()
        ),
    );
    let mut trace = env.clone();
    trace.push(("WALBOX_LOG", "trace".into()));
    let (code, out, err) = walbox_cmd(&["verify", "--config", &url_cfg], &trace);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        !out.contains(PASSWORD) && !err.contains(PASSWORD),
        "{out}{err}"
    );
    // A wrong password stops walbox at its first event, saying so, without
    // printing either.
    write_events(&pg, 1, 1, 1, 1).await;
    let mut wrong = env.clone();
    wrong.push(("WALBOX_REDIS_PASSWORD", "not-the-Pw-77".into()));
    wrong.push(("WALBOX_LOG", "trace".into()));
    let (code, out, err) = walbox_cmd(&["run"], &wrong);
    assert_ne!(code, Some(0), "{out}{err}");
    assert!(err.contains("refused walbox's credentials"), "{err}");
    assert!(
        !err.contains("not-the-Pw-77") && !err.contains(PASSWORD),
        "{err}"
    );
    drop(pg);
}

async fn read_entries_with(redis: &RedisServer, password: &str) -> usize {
    let mut con = connection(redis, Some(password)).await;
    redis::cmd("XLEN")
        .arg(STREAM)
        .query_async(&mut con)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_replayed_to_their_stream_after_a_fix_once_and_kept() {
    let (pg, redis, db, env) = servers_redis(RedisOptions::default(), "").await;
    // A key of another type where events of aggregate type "bad" go.
    let mut con = connection(&redis, None).await;
    let _: () = redis::cmd("SET")
        .arg("outbox.bad")
        .arg("not a stream")
        .query_async(&mut con)
        .await
        .unwrap();
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('bad', 'k', 'Poisoned', '{\"seq\": 0}');
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', 'k', 'Fine', '{\"seq\": 0}');",
    )
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    walbox.stop();
    let dead = read_entries(&redis, "outbox.bad.dlq").await;
    assert_eq!(dead.len(), 1, "{}", walbox.log());
    assert_eq!(read_entries(&redis, STREAM).await.len(), 1);

    // Unfixed, the letter still fails.
    let (code, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(
        err.contains("invalid_topic") || out.contains("1 still failing"),
        "{out}\n{err}"
    );
    // Fixed (the key removed): the event is stored in its stream at its
    // position, once; the letter stays on the dead-letter stream.
    let _: i64 = redis::cmd("DEL")
        .arg("outbox.bad")
        .query_async(&mut con)
        .await
        .unwrap();
    let (code, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("replayed 1 dead letters; 0 still failing"),
        "{out}"
    );
    let stored = read_entries(&redis, "outbox.bad").await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].field("event_id"), dead[0].header("event_id"));
    assert_eq!(stored[0].id, stored[0].natural_id());
    assert_eq!(read_entries(&redis, "outbox.bad.dlq").await.len(), 1);
    let (code, out, _) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("replayed 0 dead letters"), "{out}");
    assert_eq!(read_entries(&redis, "outbox.bad").await.len(), 1);
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_dead_letter_whose_entry_is_gone_is_reported_not_skipped() {
    let (pg, redis, db, env) = servers_redis(RedisOptions::default(), "").await;
    let mut con = connection(&redis, None).await;
    let _: () = redis::cmd("SET")
        .arg("outbox.bad")
        .arg("not a stream")
        .query_async(&mut con)
        .await
        .unwrap();
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('bad', 'k', 'Poisoned', '{\"seq\": 0}');
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('bad', 'k', 'Poisoned', '{\"seq\": 1}');",
    )
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    walbox.stop();
    let dead = read_entries(&redis, "outbox.bad.dlq").await;
    assert_eq!(dead.len(), 2, "{}", walbox.log());
    // Unfixed, both letters still fail and stay pending in the group.
    let (code, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(code, Some(1), "{out}\n{err}");
    // The first letter's entry is deleted (or trimmed) while it is pending;
    // the key is fixed.
    let _: i64 = redis::cmd("XDEL")
        .arg("outbox.bad.dlq")
        .arg(&dead[0].id)
        .query_async(&mut con)
        .await
        .unwrap();
    let _: i64 = redis::cmd("DEL")
        .arg("outbox.bad")
        .query_async(&mut con)
        .await
        .unwrap();
    // The letter still there is replayed; the gone one is reported, never
    // passed over in silence.
    let (code, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(out.contains("replayed 1 dead letters"), "{out}\n{err}");
    let both = format!("{out}\n{err}");
    assert!(
        both.contains(&dead[0].id) && both.contains("outbox.bad.dlq") && both.contains("gone"),
        "{both}"
    );
    let stored = read_entries(&redis, "outbox.bad").await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].field("event_id"), dead[1].header("event_id"));
    // Every run again says so, until the letter is acknowledged by hand.
    let (code, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(
        format!("{out}\n{err}").contains(&dead[0].id),
        "{out}\n{err}"
    );
    drop(pg);
}
