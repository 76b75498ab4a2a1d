//! The HTTP side of the webhook tests: a cluster with the outbox table, a
//! scripted receiver and walbox's configuration pointing at both; the
//! arrivals checked for per-key order, and their signatures checked by the
//! official Standard Webhooks library.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use walbox_testkit::webhook::Arrival;
use walbox_testkit::{OUTBOX_DDL, PgCluster, Receiver};

use super::{checkpoint_path, config_file};

/// The signing secret in the configuration file.
pub const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// The signing secret given through the environment (rotation: both sign).
pub const SECRET_ENV: &str = "whsec_c2Vjb25kIHNlY3JldCBmb3Igcm90YXRpb24=";

/// Where walbox's dead letters go in these tests.
pub fn dead_letter_path(pg: &PgCluster) -> PathBuf {
    pg.client_dir().join("dead-letters.jsonl")
}

/// A cluster with the outbox table and walbox's environment for `receiver`,
/// with `extra` lines in `[sink.webhook]`.
pub async fn servers_webhook(
    receiver: &Receiver,
    extra: &str,
) -> (
    PgCluster,
    tokio_postgres::Client,
    Vec<(&'static str, String)>,
) {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let url = format!("{}/hooks/{{aggregate_type}}", receiver.base_url());
    let env = webhook_env(&pg, &url, extra);
    (pg, db, env)
}

/// Environment for `walbox` against `pg` and a receiver at the URL template
/// `url`.
pub fn webhook_env(pg: &PgCluster, url: &str, extra: &str) -> Vec<(&'static str, String)> {
    let toml = format!(
        "[sink]\ntype = \"webhook\"\n\n[sink.webhook]\nurl = \"{url}\"\n\
         secrets = [\"{SECRET}\"]\nsecret_env = [\"WALBOX_TEST_WEBHOOK_SECRET\"]\n\
         retry_initial_ms = 50\nretry_max_ms = 1000\nrequest_timeout_ms = 3000\n\
         dead_letter_file = \"{}\"\n{extra}\n",
        dead_letter_path(pg).display()
    );
    vec![
        ("WALBOX_DSN", pg.conninfo("postgres")),
        ("WALBOX_SLOT", "walbox".into()),
        ("WALBOX_PUBLICATION", "walbox_outbox".into()),
        (
            "WALBOX_CHECKPOINT",
            checkpoint_path(pg).display().to_string(),
        ),
        ("WALBOX_TEST_WEBHOOK_SECRET", SECRET_ENV.into()),
        (
            "WALBOX_CONFIG",
            config_file(pg, "walbox-webhook.toml", &toml),
        ),
    ]
}

/// The payload's `seq` of an arrival.
pub fn seq_of(a: &Arrival) -> i64 {
    let v: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    v["payload"]["seq"].as_i64().unwrap()
}

/// Per key, the 2xx arrivals in arrival order follow commit order (`seq`
/// from 0 up by one); a repeat is allowed only as a resend from an earlier
/// event with the same `webhook-id` (at least once). Returns the ids
/// delivered.
pub fn assert_arrival_order(arrivals: &[Arrival]) -> HashSet<String> {
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut ids_by_seq: HashMap<(String, i64), String> = HashMap::new();
    let mut delivered = HashSet::new();
    for a in arrivals.iter().filter(|a| a.delivered()) {
        let key = a.key.clone().expect("a key");
        let seq = seq_of(a);
        assert_eq!(
            a.header("event_id"),
            Some(a.id.as_str()),
            "webhook-id = event id"
        );
        let id = ids_by_seq.entry((key.clone(), seq)).or_insert(a.id.clone());
        assert_eq!(
            id, &a.id,
            "key {key} seq {seq}: a duplicate with another webhook-id"
        );
        let expected = next.entry(key.clone()).or_insert(0);
        if seq == *expected {
            *expected += 1;
        } else if seq < *expected {
            // A resend after a restart starts again from an earlier event.
            *expected = seq + 1;
        } else {
            panic!("key {key}: seq {seq} arrived where {expected} was expected");
        }
        delivered.insert(a.id.clone());
    }
    delivered
}

/// A virtual environment with the official `standardwebhooks` package; its
/// python.
pub fn standardwebhooks_python() -> PathBuf {
    super::python_with("standardwebhooks", "standardwebhooks==1.1.0")
}

/// Verifies every arrival's signature under `secret` with the official
/// library; returns its report (one `ok <id>` or `bad <id> <why>` a line).
pub fn verify_with_library(arrivals: &[Arrival], secret: &str) -> (bool, String) {
    use base64::Engine as _;
    let requests: Vec<serde_json::Value> = arrivals
        .iter()
        .map(|a| {
            let headers: serde_json::Map<String, serde_json::Value> = a
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::from(v.clone())))
                .collect();
            serde_json::json!({
                "headers": headers,
                "body_b64": base64::engine::general_purpose::STANDARD.encode(&a.body),
            })
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("requests.json");
    std::fs::write(
        &file,
        serde_json::to_vec(&serde_json::json!({"secret": secret, "requests": requests})).unwrap(),
    )
    .unwrap();
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/webhook/verify_signatures.py");
    let out = Command::new(standardwebhooks_python())
        .arg(script)
        .arg(&file)
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Writer `w` of `writers` commits transactions of 3 events on its own keys
/// (`w{w}-k{0..5}`) until stopped, each payload's `seq` its key's commit
/// order; yields how many events it committed.
pub async fn keyed_writer(
    pg: &PgCluster,
    w: usize,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<usize> {
    let db = pg.connect("postgres").await.unwrap();
    tokio::spawn(async move {
        let mut seq = [0i64; 5];
        let mut n = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let mut sql = String::from("BEGIN;");
            for _ in 0..3 {
                let k = n % 5;
                sql.push_str(&format!(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('order', 'w{w}-k{k}', 'OrderPlaced', '{{\"seq\": {}}}');",
                    seq[k]
                ));
                seq[k] += 1;
                n += 1;
            }
            sql.push_str("COMMIT;");
            db.batch_execute(&sql).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        n
    })
}
