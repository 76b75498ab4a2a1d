//! Envelope formats end to end: records walbox publishes to a real broker in the
//! `debezium-outbox` and `cloudevents` formats, read back and checked field by
//! field; the CloudEvents records are parsed by the official Python SDK
//! (`cloudevents` from PyPI, in a virtual environment the test creates once).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use walbox_testkit::kafka::Record;
use walbox_testkit::{Broker, PgCluster, PgOptions};

/// The CloudEvents SDK version the test parses with.
const CLOUDEVENTS_SDK: &str = "cloudevents==2.2.0";

/// Starts a cluster and a broker, creates `ddl`, runs `walbox setup` and `walbox
/// run` with the configuration `toml`, and returns what a test needs.
/// The servers, the walbox process and its environment.
type Started = (
    PgCluster,
    Broker,
    tokio_postgres::Client,
    Walbox,
    Vec<(&'static str, String)>,
);

async fn start(ddl: &str, toml: &str) -> Started {
    let (pg, broker, db) = servers_with(PgOptions::default(), Default::default()).await;
    db.batch_execute(ddl).await.unwrap();
    let env = walbox_env(&pg, &broker);
    let cfg = config_file(&pg, "formats.toml", toml);
    let (code, _, err) = walbox_cmd(&["setup", "--config", &cfg], &env);
    assert_eq!(code, Some(0), "walbox setup: {err}");
    let walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    (pg, broker, db, walbox, env)
}

/// `walbox verify --json` with the configuration `toml`: every row of its one
/// table found by event id, in order.
fn assert_verified(pg: &PgCluster, env: &[(&str, String)], toml: &str, rows: u64) {
    let cfg = config_file(pg, "verify.toml", toml);
    let (code, out, err) = walbox_cmd(&["verify", "--json", "--config", &cfg], env);
    let report: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    assert_eq!(code, Some(0), "{report}\n{err}");
    assert_eq!(report["rows"], rows, "{report}");
    assert_eq!(report["missing"], 0, "{report}");
    assert_eq!(report["not_in_table"], 0, "{report}");
}

fn position_headers_present(r: &Record) {
    for name in ["walbox_commit_lsn", "walbox_index", "walbox_xid"] {
        assert!(r.header(name).is_some(), "{name} on {:?}", r.headers);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_outbox_records_are_what_the_outbox_event_router_emits() {
    // The router's basic outbox table, the payload as text holding JSON.
    let (pg, broker, db, mut walbox, env) = start(
        "CREATE TABLE outboxevent (
            id uuid PRIMARY KEY,
            aggregatetype varchar(255) NOT NULL,
            aggregateid varchar(255) NOT NULL,
            type varchar(255) NOT NULL,
            payload text
        )",
        "[[outbox]]\n\
         table = \"public.outboxevent\"\n\
         format = \"debezium-outbox\"\n\
         additional_placement = [\"type:header:eventType\"]\n",
    )
    .await;
    db.batch_execute(
        r#"BEGIN;
        INSERT INTO outboxevent VALUES
          ('406c07f3-26f0-4eea-a50c-109940064b8f', 'Order', '1', 'OrderCreated',
           '{"id": 1, "lineItems": [{"id": 1, "item": "Debezium in Action", "quantity": 2}], "customerId": 123}'),
          ('5a1f2b3c-0000-4000-8000-000000000002', 'Order', '1', 'OrderNote', 'plain text, not JSON');
        COMMIT;"#,
    )
    .await
    .unwrap();
    let records = read_topic(&broker.bootstrap(), "outbox.event.Order", 2).await;
    assert_eq!(records.len(), 2, "{records:?}");
    let (created, note) = (&records[0], &records[1]);

    assert_eq!(created.key_str(), Some("1"));
    assert_eq!(
        created.header("id"),
        Some("406c07f3-26f0-4eea-a50c-109940064b8f")
    );
    assert_eq!(created.header("eventType"), Some("OrderCreated"));
    assert_eq!(
        created.header("event_id"),
        None,
        "no walbox headers but the position"
    );
    position_headers_present(created);
    let value: serde_json::Value = serde_json::from_str(created.value_str().unwrap()).unwrap();
    assert_eq!(
        value,
        serde_json::json!({"id": 1, "lineItems": [{"id": 1, "item": "Debezium in Action", "quantity": 2}], "customerId": 123}),
        "the payload alone, expanded"
    );

    assert_eq!(
        note.header("id"),
        Some("5a1f2b3c-0000-4000-8000-000000000002")
    );
    assert_eq!(note.header("walbox_index"), Some("1"));
    let value: serde_json::Value = serde_json::from_str(note.value_str().unwrap()).unwrap();
    assert_eq!(value, serde_json::json!("plain text, not JSON"));
    walbox.stop();
    // verify finds the topic from the router's column names and the ids in `id`.
    assert_verified(
        &pg,
        &env,
        "[[outbox]]\ntable = \"public.outboxevent\"\nformat = \"debezium-outbox\"\n",
        2,
    );
}

/// A virtual environment with the CloudEvents SDK, made once per target
/// directory; its python.
fn cloudevents_python() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cloudevents-sdk");
    let python = dir.join("bin").join("python");
    let ready = dir.join("installed");
    if ready.exists() {
        return python;
    }
    let run = |cmd: &mut Command| {
        let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        assert!(
            out.status.success(),
            "{cmd:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(Command::new("python3").args(["-m", "venv"]).arg(&dir));
    run(Command::new(dir.join("bin").join("pip")).args([
        "install",
        "--quiet",
        "--disable-pip-version-check",
        CLOUDEVENTS_SDK,
    ]));
    std::fs::write(&ready, CLOUDEVENTS_SDK).unwrap();
    python
}

/// Parses `records` with the SDK, each in its content mode.
fn parse_with_sdk(records: &[(&str, &Record)]) -> Vec<serde_json::Value> {
    let input: Vec<serde_json::Value> = records
        .iter()
        .map(|(mode, r)| {
            serde_json::json!({
                "mode": mode,
                "key": r.key_str(),
                "headers": r.headers.iter().map(|(n, v)| {
                    (n.clone(), String::from_utf8(v.clone().unwrap_or_default()).unwrap())
                }).collect::<Vec<_>>(),
                "value": r.value_str().unwrap(),
            })
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("records.json");
    std::fs::write(&file, serde_json::to_vec(&input).unwrap()).unwrap();
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/formats/read_cloudevents.py");
    let out = Command::new(cloudevents_python())
        .arg(script)
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the SDK refused the records: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_records_parse_with_the_official_sdk_in_both_modes() {
    let (pg, broker, db, mut walbox, env) = start(
        "CREATE TABLE outbox_structured (LIKE outbox INCLUDING ALL)",
        "[[outbox]]\n\
         table = \"public.outbox\"\n\
         format = \"cloudevents\"\n\
         topic = \"ce.binary\"\n\
         cloudevents_source = \"urn:walbox:{table}\"\n\
         \n\
         [[outbox]]\n\
         table = \"public.outbox_structured\"\n\
         format = \"cloudevents\"\n\
         cloudevents_mode = \"structured\"\n\
         topic = \"ce.structured\"\n\
         cloudevents_subject = \"{aggregate_type}/{aggregate_id}\"\n",
    )
    .await;
    let rows = r#"
          ('a0000000-0000-4000-8000-0000000000#1', 'order', 'o-1', 'OrderPlaced',
           '{"total": 12, "note": "Grüße"}', '{"traceparent": "00-abc-def-01"}',
           '2026-11-29 19:40:00.123456+00', 2),
          ('a0000000-0000-4000-8000-0000000000#2', 'order', 'o-2', 'OrderShipped',
           '{"items": [1, 2]}', NULL, '2026-11-30 08:00:00+00', NULL)"#;
    db.batch_execute(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at, schema_version) VALUES {};
         INSERT INTO outbox_structured (id, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at, schema_version) VALUES {};",
        rows.replace('#', "1"),
        rows.replace('#', "2"),
    ))
    .await
    .unwrap();
    // In commit order (the keys differ, so the partitions may).
    let by_index = |mut records: Vec<Record>| {
        records.sort_by_key(|r| r.header("walbox_index").map(|i| i.parse::<u32>().unwrap()));
        records
    };
    let binary = by_index(read_topic(&broker.bootstrap(), "ce.binary", 2).await);
    let structured = by_index(read_topic(&broker.bootstrap(), "ce.structured", 2).await);
    assert_eq!((binary.len(), structured.len()), (2, 2));

    // What the transport carries beside the event.
    for r in &binary {
        assert_eq!(r.header("content-type"), Some("application/json"));
        position_headers_present(r);
    }
    assert_eq!(binary[0].header("traceparent"), Some("00-abc-def-01"));
    for r in &structured {
        assert_eq!(
            r.header("content-type"),
            Some("application/cloudevents+json")
        );
        assert_eq!(
            r.header("ce_id"),
            None,
            "structured: attributes in the value"
        );
        position_headers_present(r);
    }

    let mut input: Vec<(&str, &Record)> = binary.iter().map(|r| ("binary", r)).collect();
    input.extend(structured.iter().map(|r| ("structured", r)));
    let events = parse_with_sdk(&input);
    let expected = |n: u32, i: u32, source: &str, subject: &str| {
        let (key, event_type, time, data) = match i {
            1 => (
                "o-1",
                "OrderPlaced",
                "2026-11-29T19:40:00.123456+00:00",
                serde_json::json!({"total": 12, "note": "Grüße"}),
            ),
            _ => (
                "o-2",
                "OrderShipped",
                "2026-11-30T08:00:00+00:00",
                serde_json::json!({"items": [1, 2]}),
            ),
        };
        serde_json::json!({
            "specversion": "1.0",
            "id": format!("a0000000-0000-4000-8000-0000000000{n}{i}"),
            "source": source,
            "type": event_type,
            "subject": subject.replace("KEY", key),
            "time": time,
            "datacontenttype": "application/json",
            "partitionkey": key,
            "data": data,
        })
    };
    assert_eq!(
        events,
        vec![
            expected(1, 1, "urn:walbox:public.outbox", "KEY"),
            expected(1, 2, "urn:walbox:public.outbox", "KEY"),
            expected(2, 1, "/walbox/public.outbox_structured", "order/KEY"),
            expected(2, 2, "/walbox/public.outbox_structured", "order/KEY"),
        ]
    );
    walbox.stop();
    // verify finds the ids in ce_id headers and in structured values.
    assert_verified(
        &pg,
        &env,
        "[[outbox]]\ntable = \"public.outbox\"\nformat = \"cloudevents\"\ntopic = \"ce.binary\"\n",
        2,
    );
    assert_verified(
        &pg,
        &env,
        "[[outbox]]\ntable = \"public.outbox_structured\"\nformat = \"cloudevents\"\n\
         cloudevents_mode = \"structured\"\ntopic = \"ce.structured\"\n",
        2,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn format_settings_that_cannot_work_are_refused_naming_the_key() {
    let (pg, broker, db) = servers().await;
    db.batch_execute(
        "CREATE TABLE typeless (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregate_id text, payload jsonb)",
    )
    .await
    .unwrap();
    let env = walbox_env(&pg, &broker);

    // Settings that need no table: refused when the configuration is read.
    let bad = config_file(
        &pg,
        "bad.toml",
        "[[outbox]]\ntable = \"public.typeless\"\nformat = \"cloudevents\"\n\
         cloudevents_source = \"/x/{tenant}\"\n",
    );
    let (code, _, err) = walbox_cmd(&["run", "--config", &bad], &env);
    assert_ne!(code, Some(0));
    assert!(
        err.contains("cloudevents_source") && err.contains("{tenant}"),
        "{err}"
    );

    // No event type column for the CloudEvents type: walbox stops at the table's
    // first change, before publishing anything of it, naming the key to set.
    let cfg = config_file(
        &pg,
        "typeless.toml",
        "[[outbox]]\ntable = \"public.typeless\"\nformat = \"cloudevents\"\ntopic = \"t\"\n",
    );
    let (code, _, err) = walbox_cmd(&["setup", "--config", &cfg], &env);
    assert_eq!(code, Some(0), "{err}");
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    db.batch_execute("INSERT INTO typeless (aggregate_id, payload) VALUES ('k', '{}')")
        .await
        .unwrap();
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_ne!(status.code(), Some(0), "{log}");
    assert!(log.contains("columns.event_type"), "{log}");
    assert!(confirmed_lsn(&db, "walbox").await < current_lsn(&db).await);
}
