//! walbox into NATS JetStream on a real `nats-server -js`: every event stored
//! once in per-key order with `Nats-Msg-Id` = its event id; kill -9 rounds under
//! load leave no duplicate message in the stream; a record the stream refuses
//! goes to `{subject}.dlq`; `walbox verify` audits the stream; a missing stream
//! stops walbox with what to do, and so do refused credentials.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use walbox_sink::NatsSinkConfig;
use walbox_testkit::{NatsOptions, NatsServer, OUTBOX_DDL, PgCluster};

const SUBJECT: &str = "outbox.order";

/// One stored message, as read back.
#[derive(Debug)]
struct Stored {
    sequence: i64,
    headers: HashMap<String, String>,
    value: serde_json::Value,
}

impl Stored {
    fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or_else(
            || panic!("no header {name} in {:?}", self.headers),
            String::as_str,
        )
    }
}

fn reader_config(nats: &NatsServer) -> NatsSinkConfig {
    NatsSinkConfig {
        servers: vec![nats.url()],
        ..NatsSinkConfig::default()
    }
}

/// Everything the stream holds of `subject`, in stream order.
async fn read_subject(nats: &NatsServer, subject: &str) -> Vec<Stored> {
    let mut out = Vec::new();
    let names = [
        "event_id",
        "event_type",
        "walbox_commit_lsn",
        "walbox_index",
        "walbox_xid",
        "walbox_key",
        "Nats-Msg-Id",
    ];
    walbox_sink::read_subject(
        &reader_config(nats),
        subject,
        Duration::from_secs(30),
        |r| {
            let headers = names
                .iter()
                .filter_map(|n| r.header(n).map(|v| ((*n).to_owned(), v.to_owned())))
                .collect();
            out.push(Stored {
                sequence: r.offset(),
                headers,
                value: serde_json::from_slice(r.value().unwrap_or_default())
                    .unwrap_or(serde_json::Value::Null),
            });
        },
    )
    .await
    .unwrap();
    out
}

/// A cluster with the outbox table, a JetStream server, and the environment
/// and configuration that point walbox at both.
async fn servers_nats(
    nats_table: &str,
) -> (
    PgCluster,
    NatsServer,
    tokio_postgres::Client,
    Vec<(&'static str, String)>,
) {
    let pg = PgCluster::start().unwrap();
    let nats = NatsServer::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let toml = format!(
        "[sink]\ntype = \"nats\"\n\n[sink.nats]\nservers = [\"{}\"]\n{nats_table}\n",
        nats.url()
    );
    let config = config_file(&pg, "walbox-nats.toml", &toml);
    let env = vec![
        ("WALBOX_DSN", pg.conninfo("postgres")),
        ("WALBOX_SLOT", "walbox".into()),
        ("WALBOX_PUBLICATION", "walbox_outbox".into()),
        (
            "WALBOX_CHECKPOINT",
            checkpoint_path(&pg).display().to_string(),
        ),
        ("WALBOX_CONFIG", config),
    ];
    (pg, nats, db, env)
}

/// Waits until the slot has confirmed everything committed so far; fails with
/// walbox's log.
async fn caught_up(db: &tokio_postgres::Client, walbox: &Walbox) {
    let last = current_lsn(db).await;
    walbox_testkit::wait_until_async(
        "the slot to confirm the last commit",
        Duration::from_secs(60),
        || async { (confirmed_lsn(db, "walbox").await >= last).then_some(()) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}; log:\n{}", walbox.log()));
}

const CREATE: &str = "create_stream = true\nsubjects = [\"outbox.>\"]\nduplicate_window_s = 600";

/// Each key's `seq` grows by one from 0 in stream order: no gap, no repeat.
fn assert_per_key_order_once(messages: &[Stored]) {
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut last_sequence = 0;
    for m in messages {
        assert!(m.sequence > last_sequence, "stream order");
        last_sequence = m.sequence;
        let key = m.header("walbox_key").to_owned();
        let seq = m.value["payload"]["seq"].as_i64().unwrap();
        let expected = next.entry(key.clone()).or_insert(0);
        assert_eq!(
            seq, *expected,
            "key {key}: seq {seq} where {expected} was expected"
        );
        *expected += 1;
    }
}

/// No two messages with one event id, and each carries it as `Nats-Msg-Id`.
fn assert_each_event_once(messages: &[Stored], ids: &HashSet<String>) {
    let mut seen = HashSet::new();
    for m in messages {
        let id = m.header("event_id");
        assert_eq!(m.header("Nats-Msg-Id"), id);
        assert!(seen.insert(id.to_owned()), "event {id} stored twice");
    }
    assert_eq!(&seen, ids, "the stream holds exactly the table's events");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_stored_once_in_per_key_order_with_their_headers_and_verify_agrees() {
    let (pg, nats, db, env) = servers_nats(CREATE).await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 2, 10, 10, 10).await;
    caught_up(&db, &walbox).await;
    let messages = read_subject(&nats, SUBJECT).await;
    assert_eq!(messages.len(), 200, "{}", walbox.log());
    assert_each_event_once(&messages, &outbox_ids(&db).await);
    assert_per_key_order_once(&messages);
    for m in &messages {
        assert_eq!(m.header("event_type"), "OrderPlaced");
        assert!(m.header("walbox_commit_lsn").contains('/'));
        m.header("walbox_index").parse::<u32>().unwrap();
        m.header("walbox_xid").parse::<u32>().unwrap();
        assert!(m.header("walbox_key").starts_with("order-"));
    }
    walbox.stop();
    let (status, out, err) = walbox_cmd(&["verify"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("missing          0"), "{out}");
    assert!(out.contains("(200 records)"), "{out}");
    // An event gone from the stream is reported missing.
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'order-x', 'OrderPlaced', '{}')",
    )
    .await
    .unwrap();
    let (status, out, _) = walbox_cmd(&["verify"], &env);
    assert_ne!(status, Some(0), "{out}");
    assert!(out.contains("missing          1"), "{out}");
    drop(pg);
}

/// One writer committing transactions of 5 events over 10 keys until stopped.
async fn steady_writer(pg: &PgCluster, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<usize> {
    let db = pg.connect("postgres").await.unwrap();
    tokio::spawn(async move {
        let mut seq = [0i64; 10];
        let mut n = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let mut sql = String::from("BEGIN;");
            for _ in 0..5 {
                let k = n % 10;
                sql.push_str(&format!(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('order', 'order-{k}', 'OrderPlaced', '{{\"seq\": {}}}');",
                    seq[k]
                ));
                seq[k] += 1;
                n += 1;
            }
            sql.push_str("COMMIT;");
            db.batch_execute(&sql).await.unwrap();
        }
        n
    })
}

/// A pseudo-random number below `n` (fault timing, not synchronisation).
fn random_below(n: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
        % n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_rounds_under_load_leave_no_duplicate_message_in_the_stream() {
    let (pg, nats, db, env) = servers_nats(CREATE).await;
    setup(&env);
    let stop_writing = Arc::new(AtomicBool::new(false));
    let writer = steady_writer(&pg, Arc::clone(&stop_writing)).await;
    let mut previous = confirmed_lsn(&db, "walbox").await;
    for round in 0..12 {
        let mut walbox = Walbox::spawn(&["run"], &env);
        walbox_testkit::wait_until("the checkpoint to move", Duration::from_secs(60), || {
            checkpoint(&pg).filter(|c| c.lsn > previous).map(|c| c.lsn)
        })
        .map(|lsn| previous = lsn)
        .unwrap_or_else(|e| panic!("round {round}: {e}\n{}", walbox.log()));
        std::thread::sleep(Duration::from_millis(random_below(400)));
        walbox.kill9();
    }
    let mut walbox = Walbox::spawn(&["run"], &env);
    stop_writing.store(true, Ordering::Relaxed);
    let written = writer.await.unwrap();
    caught_up(&db, &walbox).await;
    let log = walbox.log();
    walbox.stop();
    let messages = read_subject(&nats, SUBJECT).await;
    let ids = outbox_ids(&db).await;
    assert_eq!(ids.len(), written);
    assert_eq!(messages.len(), written, "exactly once: {log}");
    assert_each_event_once(&messages, &ids);
    assert_per_key_order_once(&messages);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_stream_refuses_goes_to_the_dead_letter_subject() {
    let (pg, nats, db, env) = servers_nats("stream = \"EVENTS\"").await;
    // A stream of the operator's, with a message size limit.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "EVENTS".into(),
        subjects: vec!["outbox.>".into()],
        max_message_size: 4096,
        duplicate_window: Duration::from_secs(300),
        ..Default::default()
    })
    .await
    .unwrap();
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', 'k', 'Small', '{\"seq\": 0}');
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', 'k', 'Large', jsonb_build_object('blob', repeat('x', 8000)));
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', 'k', 'Small', '{\"seq\": 1}');",
    )
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    let log = walbox.log();
    walbox.stop();
    let stored = read_subject(&nats, SUBJECT).await;
    let types: Vec<&str> = stored.iter().map(|m| m.header("event_type")).collect();
    assert_eq!(types, ["Small", "Small"], "{log}");
    let dead = read_subject(&nats, "outbox.order.dlq").await;
    assert_eq!(dead.len(), 1, "{log}");
    let large = db
        .query_one(
            "SELECT id::text FROM outbox WHERE event_type = 'Large'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, String>(0);
    assert_eq!(dead[0].header("event_id"), large);
    assert!(log.contains("message_too_large"), "{log}");
    let (status, out, err) = walbox_cmd(&["verify"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("dead-lettered    1"), "{out}");
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_stream_stops_walbox_with_what_to_do() {
    let (pg, _nats, db, env) = servers_nats("stream = \"NOPE\"").await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'k', 'E', '{}')",
    )
    .await
    .unwrap();
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_ne!(status.code(), Some(0), "{log}");
    assert!(log.contains("no JetStream stream holds"), "{log}");
    assert!(log.contains("create_stream = true"), "{log}");
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_stop_walbox_without_printing_the_password() {
    let pg = PgCluster::start().unwrap();
    let nats = NatsServer::start_with(NatsOptions {
        user: Some(("walbox".into(), "right-7c1e".into())),
        token: None,
    })
    .unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let toml = format!(
        "[sink]\ntype = \"nats\"\n\n[sink.nats]\nservers = [\"{}\"]\n{CREATE}\nuser = \"walbox\"\npassword = \"wrong-93d2\"\n",
        nats.url()
    );
    let env = vec![
        ("WALBOX_DSN", pg.conninfo("postgres")),
        ("WALBOX_SLOT", "walbox".into()),
        ("WALBOX_PUBLICATION", "walbox_outbox".into()),
        (
            "WALBOX_CHECKPOINT",
            checkpoint_path(&pg).display().to_string(),
        ),
        ("WALBOX_CONFIG", config_file(&pg, "walbox-nats.toml", &toml)),
    ];
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'k', 'E', '{}')",
    )
    .await
    .unwrap();
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_ne!(status.code(), Some(0), "{log}");
    assert!(log.contains("refused walbox's credentials"), "{log}");
    assert!(log.contains("user \"walbox\""), "{log}");
    assert!(
        !log.contains("wrong-93d2") && !log.contains("right-7c1e"),
        "{log}"
    );
}
