//! walbox into Kinesis Data Streams (kinesalite) from a real PostgreSQL:
//! records that AWS would throttle out of a `PutRecords` batch (played by
//! the test kit's fault proxy, which answers chosen records as failed and
//! never stores them) are sent again before anything later of their key, so
//! every key's first copies stay in commit order and nothing is missing;
//! `walbox verify` agrees; no credentials, or a missing stream, stop walbox
//! saying so; the credentials never reach the log, even at trace.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use walbox_testkit::{FaultProxy, Kinesalite};

const STREAM: &str = "outbox.order";

/// Every event of the table there, and each key's first copies in commit
/// order (seq 0, 1, 2, ... with no gap).
fn assert_all_there_in_key_order(records: &[walbox_sink::OwnedRecord], ids: &HashSet<String>) {
    let mut next: HashMap<Vec<u8>, i64> = HashMap::new();
    let mut seen = HashSet::new();
    for r in records {
        let id = r.message_id.clone().expect("every record names its event");
        if !seen.insert(id) {
            continue;
        }
        let key = r.key.clone().expect("a key");
        let expected = next.entry(key.clone()).or_insert(0);
        if seq(r) != *expected {
            let of_key: Vec<(i32, i64, i64, Option<String>)> = records
                .iter()
                .filter(|x| x.key == r.key)
                .map(|x| (x.partition, x.offset, seq(x), x.message_id.clone()))
                .collect();
            panic!(
                "key {}: first copies out of commit order (seq {} where {expected} was \
                 expected); the key's records (shard, place, seq, id): {of_key:?}",
                String::from_utf8_lossy(&key),
                seq(r)
            );
        }
        *expected += 1;
    }
    assert_eq!(&seen, ids, "the stream holds every event of the table");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_failed_out_of_a_batch_go_again_before_anything_later_of_their_key() {
    let kinesis = Kinesalite::start().unwrap();
    let proxy =
        FaultProxy::start(format!("127.0.0.1:{}", kinesis.port()).parse().unwrap()).unwrap();
    // Every record of order-1 fails twice, and one record in five of the
    // others once: throttling that hits a hot key and a scatter of others.
    let attempts: Arc<std::sync::Mutex<HashMap<String, usize>>> = Arc::default();
    let scattered = Arc::new(AtomicUsize::new(0));
    {
        let attempts = Arc::clone(&attempts);
        let scattered = Arc::clone(&scattered);
        proxy.fail_when(move |e| {
            let data = e.json["Data"].as_str().unwrap_or_default().to_owned();
            let key = e.json["PartitionKey"].as_str().unwrap_or_default();
            let mut seen = attempts.lock().unwrap();
            let n = seen.entry(data).or_insert(0);
            *n += 1;
            if key == "order-1" {
                *n <= 2
            } else {
                *n == 1 && scattered.fetch_add(1, Ordering::SeqCst).is_multiple_of(5)
            }
        });
    }
    let (pg, db, env) = aws_servers(
        "kinesis",
        &proxy.endpoint(),
        "create_topics = true\ntopic_partitions = 2",
        "",
    )
    .await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 2, 20, 10, 6).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    assert!(
        proxy.failed() >= 2 * 400 / 6,
        "the proxy failed records ({} of {} calls)",
        proxy.failed(),
        proxy.calls()
    );
    let records = read_kinesis(&kinesis.endpoint(), STREAM).await;
    assert_all_there_in_key_order(&records, &outbox_ids(&db).await);
    // The same key is always in the same shard.
    let mut shard: HashMap<Vec<u8>, i32> = HashMap::new();
    for r in &records {
        let s = *shard.entry(r.key.clone().unwrap()).or_insert(r.partition);
        assert_eq!(s, r.partition);
    }
    let (code, out, err) = walbox_cmd(&["verify", "--table", "outbox"], &env);
    assert_eq!(
        code,
        Some(0),
        "verify finds nothing missing or out of order: {out}\n{err}"
    );
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_stream_stops_walbox_naming_it_and_credentials_never_reach_the_log() {
    let kinesis = Kinesalite::start().unwrap();
    let (pg, db, mut env) = aws_servers("kinesis", &kinesis.endpoint(), "", "").await;
    setup(&env);
    // No credentials anywhere in the chain: walbox stops and says so.
    let mut bare: Vec<(&str, String)> = env
        .iter()
        .filter(|(k, _)| !k.starts_with("AWS_ACCESS") && !k.starts_with("AWS_SECRET"))
        .cloned()
        .collect();
    let nowhere = pg.client_dir().join("no-such-aws-file");
    bare.push(("AWS_CONFIG_FILE", nowhere.display().to_string()));
    bare.push(("AWS_SHARED_CREDENTIALS_FILE", nowhere.display().to_string()));
    write_events(&pg, 1, 1, 1, 1).await;
    let mut walbox = Walbox::spawn(&["run"], &bare);
    let status = walbox.wait(std::time::Duration::from_secs(60));
    assert_ne!(code(status), Some(0));
    let log = walbox.log();
    assert!(log.contains("no credentials from the AWS chain"), "{log}");
    // No stream, and no create_topics: walbox stops and says what to do.
    write_events_from(&pg, 1, 1, 2, 2, 1).await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    let status = walbox.wait(std::time::Duration::from_secs(60));
    assert_ne!(code(status), Some(0));
    let log = walbox.log();
    assert!(log.contains("\"outbox.order\" does not exist"), "{log}");
    assert!(log.contains("create_topics"), "{log}");

    // With the stream made, at trace: the secret key and the session token
    // are never printed, by walbox or by the AWS libraries.
    const SECRET: &str = "kinesis-Secret-9f3a71";
    const TOKEN: &str = "kinesis-Session-Token-22c4";
    env.retain(|(k, _)| *k != "AWS_SECRET_ACCESS_KEY");
    env.push(("AWS_SECRET_ACCESS_KEY", SECRET.into()));
    env.push(("AWS_SESSION_TOKEN", TOKEN.into()));
    env.push(("WALBOX_LOG", "trace".into()));
    env.push(("WALBOX_CREATE_TOPICS", "true".into()));
    let mut walbox = Walbox::spawn(&["run"], &env);
    caught_up(&db, &walbox).await;
    walbox.stop();
    let log = walbox.log();
    assert!(log.contains("TRACE"), "trace logging is on");
    assert!(
        log.contains("aws_smithy") || log.contains("aws_sdk"),
        "the AWS libraries log at trace"
    );
    assert!(!log.contains(SECRET), "the secret key is in the log");
    assert!(!log.contains(TOKEN), "the session token is in the log");
    let records = read_kinesis(&kinesis.endpoint(), STREAM).await;
    assert_all_there_in_key_order(&records, &outbox_ids(&db).await);
    // The stream walbox made keeps its records a week, not Kinesis's day.
    assert_eq!(
        walbox_testkit::kinesis::retention_hours(&kinesis.endpoint(), STREAM).await,
        Ok(168)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_above_what_the_stream_takes_is_dead_lettered_and_the_stream_goes_on() {
    let kinesis = Kinesalite::start().unwrap();
    // walbox's own bound above the stream's 1 MiB.
    let (pg, db, env) = aws_servers(
        "kinesis",
        &kinesis.endpoint(),
        "create_topics = true\ntopic_partitions = 2",
        "max_record_bytes = 4194304",
    )
    .await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    let big = "x".repeat(1_500_000);
    db.batch_execute(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', 'order-0', 'OrderPlaced', '{{\"seq\": 0}}'),
           ('order', 'order-1', 'OrderPlaced', '{{\"seq\": 0, \"blob\": \"{big}\"}}'),
           ('order', 'order-0', 'OrderPlaced', '{{\"seq\": 1}}');"
    ))
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    walbox.stop();
    let stored = read_kinesis(&kinesis.endpoint(), STREAM).await;
    let keys: Vec<Option<&[u8]>> = stored.iter().map(|r| r.key.as_deref()).collect();
    assert_eq!(keys, [Some(&b"order-0"[..]), Some(&b"order-0"[..])]);
    let letters = walbox_testkit::kinesis::read_stream(&kinesis.endpoint(), "outbox.order.dlq")
        .await
        .unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(
        letters[0].header("walbox_error_class"),
        Some("message_too_large")
    );
    drop(pg);
}
