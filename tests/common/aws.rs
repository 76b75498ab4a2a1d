//! The AWS destinations' tests (Kinesis, SQS, SNS): a cluster with the
//! outbox table and walbox's environment for a stand-in, the records read
//! back, and their payloads' `seq`.

use std::collections::{HashMap, HashSet};

use walbox_testkit::{Kinesalite, OUTBOX_DDL, PgCluster};

use super::{checkpoint_path, config_file};

/// A cluster with the outbox table and the environment that points walbox
/// at a stand-in at `endpoint` with sink type `kind`: `[sink]` lines `sink`
/// and `[sink.KIND]` lines `own`, with short retry backoffs.
pub async fn aws_servers(
    kind: &str,
    endpoint: &str,
    sink: &str,
    own: &str,
) -> (
    PgCluster,
    tokio_postgres::Client,
    Vec<(&'static str, String)>,
) {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let toml = format!(
        "[sink]\ntype = \"{kind}\"\n{sink}\n\n[sink.{kind}]\nendpoint_url = \"{endpoint}\"\n\
         region = \"us-east-1\"\nretry_initial_ms = 20\nretry_max_ms = 200\n{own}\n"
    );
    let mut env = vec![
        ("WALBOX_DSN", pg.conninfo("postgres")),
        ("WALBOX_SLOT", "walbox".into()),
        ("WALBOX_PUBLICATION", "walbox_outbox".into()),
        (
            "WALBOX_CHECKPOINT",
            checkpoint_path(&pg).display().to_string(),
        ),
        (
            "WALBOX_CONFIG",
            config_file(&pg, &format!("walbox-{kind}.toml"), &toml),
        ),
    ];
    env.extend(Kinesalite::client_env());
    (pg, db, env)
}

/// `walbox run` with sink type `kind` (SQS or SNS) on standard, not FIFO,
/// queues or topics and nothing said of order stops at once, saying how to
/// give order up.
pub fn assert_standard_refused(
    kind: &str,
    pg: &PgCluster,
    env: &[(&'static str, String)],
    endpoint: &str,
) {
    let standard = config_file(
        pg,
        &format!("walbox-{kind}-standard.toml"),
        &format!(
            "[sink]\ntype = \"{kind}\"\n\n[sink.{kind}]\nendpoint_url = \"{endpoint}\"\n\
             region = \"us-east-1\"\nfifo = false\n"
        ),
    );
    let mut refused = env.to_vec();
    refused.retain(|(k, _)| *k != "WALBOX_CONFIG");
    refused.push(("WALBOX_CONFIG", standard));
    let (exit, out, err) = super::walbox_cmd(&["run"], &refused);
    assert_ne!(exit, Some(0));
    assert!(err.contains("ordered = false"), "{out}\n{err}");
}

/// A record as the readers hand it, with the headers `headers` kept.
fn owned(r: &walbox_sink::RecordView<'_>, headers: &[&str]) -> walbox_sink::OwnedRecord {
    walbox_sink::OwnedRecord {
        partition: r.partition(),
        offset: r.offset(),
        key: r.key().map(<[u8]>::to_vec),
        value: r.value().unwrap_or_default().to_vec(),
        headers: headers
            .iter()
            .filter_map(|n| Some(((*n).to_owned(), r.header(n)?.as_bytes().to_vec())))
            .collect(),
        message_id: r.event_id(),
    }
}

/// The headers the tests look at.
const HEADERS: &[&str] = &["event_id", "walbox_commit_lsn", "walbox_index", "tenant"];

/// Every message the SQS queue of `topic` holds, taken from it in the order
/// it hands them out.
pub async fn drain_queue(endpoint: &str, topic: &str) -> Vec<walbox_sink::OwnedRecord> {
    let config = walbox_sink::SqsSinkConfig {
        endpoint_url: Some(endpoint.to_owned()),
        region: Some("us-east-1".into()),
        credentials: Some(Kinesalite::credentials()),
        ..Default::default()
    };
    let mut out = Vec::new();
    walbox_sink::drain_sqs_queue(&config, topic, std::time::Duration::from_secs(120), |r| {
        out.push(owned(&r, HEADERS));
    })
    .await
    .unwrap()
    .expect("the queue exists");
    out
}

/// Everything Kinesis stream `stream` holds, in each shard's order.
pub async fn read_kinesis(endpoint: &str, stream: &str) -> Vec<walbox_sink::OwnedRecord> {
    let config = walbox_sink::KinesisSinkConfig {
        endpoint_url: Some(endpoint.to_owned()),
        region: Some("us-east-1".into()),
        credentials: Some(Kinesalite::credentials()),
        ..Default::default()
    };
    let mut out = Vec::new();
    walbox_sink::read_kinesis_stream(&config, stream, std::time::Duration::from_secs(60), |r| {
        out.push(owned(&r, HEADERS));
    })
    .await
    .unwrap()
    .expect("the stream exists");
    out
}

/// The `seq` of a record's payload.
pub fn seq(r: &walbox_sink::OwnedRecord) -> i64 {
    let v: serde_json::Value = serde_json::from_slice(&r.value).unwrap();
    v["payload"]["seq"].as_i64().unwrap()
}

/// Every event of the table there exactly once, each key's in commit order.
pub fn assert_all_once_in_key_order(records: &[walbox_sink::OwnedRecord], ids: &HashSet<String>) {
    let mut next: HashMap<Vec<u8>, i64> = HashMap::new();
    let mut seen = HashSet::new();
    for r in records {
        let id = r.message_id.clone().expect("every message names its event");
        assert!(seen.insert(id.clone()), "event {id} stored twice");
        let key = r.key.clone().expect("a group");
        let expected = next.entry(key.clone()).or_insert(0);
        assert_eq!(
            seq(r),
            *expected,
            "group {}: out of commit order",
            String::from_utf8_lossy(&key)
        );
        *expected += 1;
    }
    assert_eq!(&seen, ids, "the queue holds every event of the table");
}
