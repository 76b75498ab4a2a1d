//! The RabbitMQ side of the RabbitMQ tests: one node for the whole test
//! binary (started on first use, gone when the binary ends), shared by the
//! tests under a lock that the test killing the node takes alone; each test
//! has its own exchange, queues and streams, its own PostgreSQL cluster, and
//! walbox's configuration pointing at both.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use walbox_testkit::kafka::Record;
use walbox_testkit::{OUTBOX_DDL, PgCluster, RabbitMq};

use super::{checkpoint_path, config_file};

/// The binary's node, behind a lock: tests read-lock it, the test that kills
/// it write-locks it.
pub fn node() -> &'static tokio::sync::RwLock<RabbitMq> {
    static NODE: OnceLock<tokio::sync::RwLock<RabbitMq>> = OnceLock::new();
    NODE.get_or_init(|| {
        let node = RabbitMq::start().expect("starting rabbitmq-server");
        node.removed_when_this_process_ends()
            .expect("watching the node");
        tokio::sync::RwLock::new(node)
    })
}

/// A cluster with the outbox table, and the environment pointing walbox at
/// it and at `node` with `[sink.rabbitmq]` holding `settings`.
pub async fn servers_rabbitmq(
    node: &RabbitMq,
    settings: &str,
) -> (
    PgCluster,
    tokio_postgres::Client,
    Vec<(&'static str, String)>,
) {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let toml = format!(
        "[sink]\ntype = \"rabbitmq\"\n\n[sink.rabbitmq]\nhost = \"127.0.0.1\"\nport = {}\n\
         stream_port = {}\n{settings}\n",
        node.amqp_port(),
        node.stream_port()
    );
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
            config_file(&pg, "walbox-rabbitmq.toml", &toml),
        ),
    ];
    (pg, db, env)
}

/// Four writers committing transactions of 5 events until stopped,
/// writer `w` on keys `w{w}-0`..`w{w}-4` (so each key's commit order is its
/// writer's); yields how many events they committed.
pub async fn four_writers(
    pg: &PgCluster,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<usize>> {
    let mut out = Vec::new();
    for w in 0..4 {
        let db = pg.connect("postgres").await.unwrap();
        let stop = Arc::clone(&stop);
        out.push(tokio::spawn(async move {
            let mut seq = [0i64; 5];
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let mut sql = String::from("BEGIN;");
                for _ in 0..5 {
                    let k = n % 5;
                    sql.push_str(&format!(
                        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                         VALUES ('order', 'w{w}-{k}', 'OrderPlaced', '{{\"seq\": {}}}');",
                        seq[k]
                    ));
                    seq[k] += 1;
                    n += 1;
                }
                sql.push_str("COMMIT;");
                db.batch_execute(&sql).await.unwrap();
                // Paced (about 1000 events a second in all), so that what
                // piles up while a node restarts is caught up in seconds.
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            n
        }));
    }
    out
}

/// Stops the writers and sums what they committed.
pub async fn stop_writers(
    stop: &AtomicBool,
    writers: Vec<tokio::task::JoinHandle<usize>>,
) -> usize {
    stop.store(true, Ordering::Relaxed);
    let mut n = 0;
    for w in writers {
        n += w.await.unwrap();
    }
    n
}

/// A record's header as text.
pub fn header<'a>(r: &'a Record, name: &str) -> Option<&'a str> {
    r.headers
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| v.as_deref())
        .and_then(|v| std::str::from_utf8(v).ok())
}

/// Every table event is in `records`, and every copy of an event carries its
/// event id as `message_id` and the same source position; returns how many
/// events were stored more than once.
pub fn assert_all_there_duplicates_same_message_id(
    records: &[Record],
    ids: &HashSet<String>,
) -> usize {
    let mut copies: HashMap<&str, Vec<(&str, &str)>> = HashMap::new();
    for r in records {
        let id = header(r, "event_id").expect("event_id header");
        assert_eq!(header(r, "message_id"), Some(id), "message_id of {id}");
        let position = (
            header(r, "walbox_commit_lsn").unwrap_or_default(),
            header(r, "walbox_index").unwrap_or_default(),
        );
        copies.entry(id).or_default().push(position);
    }
    let missing: Vec<&String> = ids
        .iter()
        .filter(|id| !copies.contains_key(id.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "{} missing, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    assert_eq!(
        copies.len(),
        ids.len(),
        "the queue holds exactly the table's events"
    );
    let mut twice = 0;
    for (id, positions) in &copies {
        assert!(
            positions.iter().all(|p| *p == positions[0]),
            "{id}: copies from other positions"
        );
        if positions.len() > 1 {
            twice += 1;
        }
    }
    twice
}
