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

/// A virtual environment with the CloudEvents SDK; its python.
fn cloudevents_python() -> PathBuf {
    python_with("cloudevents-sdk", CLOUDEVENTS_SDK)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn occurrence_times_that_cannot_be_rfc3339_are_dead_lettered_from_rows_and_messages() {
    let (pg, broker, db, mut walbox, _env) = start(
        "CREATE TABLE outbox_dates (
            id uuid PRIMARY KEY,
            aggregate_type text NOT NULL,
            aggregate_id text NOT NULL,
            event_type text NOT NULL,
            payload jsonb NOT NULL,
            occurred_at date NOT NULL
        )",
        "[[outbox]]\ntable = \"public.outbox\"\nformat = \"cloudevents\"\ntopic = \"ce.times\"\n\n\
         [[outbox]]\ntable = \"public.outbox_dates\"\nformat = \"cloudevents\"\ntopic = \"ce.times\"\n\n\
         [[messages]]\nprefix = \"walbox\"\nformat = \"cloudevents\"\ntopic = \"ce.times\"\n",
    )
    .await;
    let message = |id: &str, key: &str, at: &str| {
        format!(
            "SELECT pg_logical_emit_message(true, 'walbox', '{{\"id\": \"{id}\", \
             \"aggregate_id\": \"{key}\", \"event_type\": \"Placed\", \"payload\": {{}}, \
             \"occurred_at\": \"{at}\"}}');"
        )
    };
    let row = |id: u32, key: &str, at: &str| {
        format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, occurred_at) \
             VALUES ('b0000000-0000-4000-8000-00000000000{id}', 'order', '{key}', 'Placed', '{{}}', '{at}');"
        )
    };
    // Valid and invalid times interleaved in one transaction: a timestamptz
    // row, `infinity`, a date column, a message, a message with a date alone,
    // a row after them.
    db.batch_execute(&format!(
        "BEGIN;\n{}\n{}\n\
         INSERT INTO outbox_dates VALUES ('b0000000-0000-4000-8000-000000000003', 'order', 'k-3', 'Placed', '{{}}', '2024-05-01');\n\
         {}\n{}\n{}\nCOMMIT;",
        row(1, "k-1", "2026-11-29 19:40:00+00"),
        row(2, "k-2", "infinity"),
        message("m-4", "k-4", "2026-11-30T08:00:00Z"),
        message("m-5", "k-5", "2024-05-01"),
        row(6, "k-6", "2026-12-01 10:00:00+00"),
    ))
    .await
    .unwrap();

    let dead = read_topic(&broker.bootstrap(), "ce.times.dlq", 3).await;
    let mut dead: Vec<(String, String, String)> = dead
        .iter()
        .map(|r| {
            (
                r.header("event_id").unwrap().to_owned(),
                r.header("walbox_error_class").unwrap().to_owned(),
                r.header("walbox_error").unwrap().to_owned(),
            )
        })
        .collect();
    dead.sort();
    let ids: Vec<&str> = dead.iter().map(|(id, _, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "b0000000-0000-4000-8000-000000000002",
            "b0000000-0000-4000-8000-000000000003",
            "m-5"
        ]
    );
    for (id, class, reason) in &dead {
        assert_eq!(class, "invalid_time", "{id}");
        assert!(
            reason.contains("\"occurred_at\"") && reason.contains("RFC 3339"),
            "{id}: {reason}"
        );
        assert!(!reason.contains("2024-05-01"), "no value: {reason}");
    }

    // The others are published, and the SDK reads every one of them.
    let mut records = read_topic(&broker.bootstrap(), "ce.times", 3).await;
    records.sort_by_key(|r| r.header("walbox_index").map(|i| i.parse::<u32>().unwrap()));
    assert_eq!(records.len(), 3, "{records:?}");
    let input: Vec<(&str, &Record)> = records.iter().map(|r| ("binary", r)).collect();
    let events = parse_with_sdk(&input);
    let read: Vec<(&str, &str)> = events
        .iter()
        .map(|e| (e["id"].as_str().unwrap(), e["time"].as_str().unwrap()))
        .collect();
    assert_eq!(
        read,
        [
            (
                "b0000000-0000-4000-8000-000000000001",
                "2026-11-29T19:40:00+00:00"
            ),
            ("m-4", "2026-11-30T08:00:00+00:00"),
            (
                "b0000000-0000-4000-8000-000000000006",
                "2026-12-01T10:00:00+00:00"
            ),
        ]
    );
    walbox.stop();
    drop(pg);
}

/// Runs the Java transcription of the Kafka client's default partitioner
/// (`tests/formats/KafkaPartition.java`) over `keys`: per key, its murmur2
/// and the partition of `partitions` it picks.
fn java_partitions(keys: &[Vec<u8>], partitions: i32) -> Vec<(i32, i32)> {
    use std::io::Write as _;
    let source =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/formats/KafkaPartition.java");
    let mut child = Command::new("java")
        .arg(source)
        .arg(partitions.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("java (17 or later) on PATH");
    let input: String = keys
        .iter()
        .map(|k| {
            if k.is_empty() {
                "-\n".to_owned()
            } else {
                k.iter().map(|b| format!("{b:02x}")).collect::<String>() + "\n"
            }
        })
        .collect();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "java: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (hash, partition) = l.split_once(' ').unwrap();
            (hash.parse().unwrap(), partition.parse().unwrap())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_keys_land_on_the_partitions_the_java_client_picks_in_both_encodings() {
    const PARTITIONS: i32 = 12;
    const KEYS: usize = 300;
    let (pg, broker, db) = servers().await;
    // One table per key encoding and key type, each to its own topic.
    db.batch_execute(
        "CREATE TABLE keys_string (id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
            aggregatetype text NOT NULL, aggregateid varchar(255) NOT NULL,
            type text NOT NULL, payload jsonb NOT NULL);
         CREATE TABLE keys_json (LIKE keys_string INCLUDING ALL);
         CREATE TABLE keys_json_int (LIKE keys_string INCLUDING ALL);
         ALTER TABLE keys_json_int ALTER aggregateid TYPE bigint USING aggregateid::bigint;",
    )
    .await
    .unwrap();
    for topic in ["cut.string", "cut.json", "cut.json_int"] {
        walbox_testkit::kafka::create_topic(&broker.bootstrap(), topic, PARTITIONS)
            .await
            .unwrap();
    }
    let env = walbox_env(&pg, &broker);
    let cfg = config_file(
        &pg,
        "keys.toml",
        "[[outbox]]\ntable = \"public.keys_string\"\nformat = \"debezium-outbox\"\ntopic = \"cut.string\"\n\n\
         [[outbox]]\ntable = \"public.keys_json\"\nformat = \"debezium-outbox\"\ntopic = \"cut.json\"\n\
         key_encoding = \"json\"\n\n\
         [[outbox]]\ntable = \"public.keys_json_int\"\nformat = \"debezium-outbox\"\ntopic = \"cut.json_int\"\n\
         key_encoding = \"json\"\n",
    );
    let (code, _, err) = walbox_cmd(&["setup", "--config", &cfg], &env);
    assert_eq!(code, Some(0), "walbox setup: {err}");
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);

    // Keys of many shapes: numbers as text, words, non-ASCII, quotes.
    let text_key = |i: usize| match i % 4 {
        0 => i.to_string(),
        1 => format!("order-{i}"),
        2 => format!("Straße {i} \"ü\""),
        _ => format!("{:08x}-aggregate", i * 7919),
    };
    let int_key = |i: usize| i64::try_from(i * 104_729).unwrap() - 1_000_000;
    let mut sql = String::from("BEGIN;");
    for i in 0..KEYS {
        let k = text_key(i).replace('\'', "''");
        for table in ["keys_string", "keys_json"] {
            sql.push_str(&format!(
                "INSERT INTO {table} (aggregatetype, aggregateid, type, payload) \
                 VALUES ('Order', '{k}', 'Placed', '{{\"i\": {i}}}');"
            ));
        }
        sql.push_str(&format!(
            "INSERT INTO keys_json_int (aggregatetype, aggregateid, type, payload) \
             VALUES ('Order', {}, 'Placed', '{{\"i\": {i}}}');",
            int_key(i)
        ));
    }
    sql.push_str("COMMIT;");
    db.batch_execute(&sql).await.unwrap();

    // The key bytes Debezium's converters write: StringConverter the text,
    // JsonConverter (schemas.enable = false) a JSON string, or a number for
    // an integer column.
    let expected_key = |topic: &str, i: usize| -> Vec<u8> {
        match topic {
            "cut.string" => text_key(i).into_bytes(),
            "cut.json" => serde_json::to_vec(&text_key(i)).unwrap(),
            _ => int_key(i).to_string().into_bytes(),
        }
    };
    for topic in ["cut.string", "cut.json", "cut.json_int"] {
        let records = read_topic(&broker.bootstrap(), topic, KEYS).await;
        assert_eq!(records.len(), KEYS, "{topic}");
        let mut by_i: Vec<(usize, Vec<u8>, i32)> = records
            .iter()
            .map(|r| {
                let v: serde_json::Value =
                    serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
                let i = usize::try_from(v["i"].as_u64().unwrap()).unwrap();
                (i, r.key.clone().unwrap(), r.partition)
            })
            .collect();
        by_i.sort();
        let keys: Vec<Vec<u8>> = by_i.iter().map(|(_, k, _)| k.clone()).collect();
        for (i, key, _) in &by_i {
            assert_eq!(
                key,
                &expected_key(topic, *i),
                "{topic}: key of event {i}: {}",
                String::from_utf8_lossy(key)
            );
        }
        let java = java_partitions(&keys, PARTITIONS);
        let landed: Vec<i32> = by_i.iter().map(|(_, _, p)| *p).collect();
        let picked: Vec<i32> = java.iter().map(|(_, p)| *p).collect();
        assert_eq!(
            landed, picked,
            "{topic}: partitions walbox's records landed on vs the Java client's"
        );
        let used: std::collections::BTreeSet<i32> = landed.iter().copied().collect();
        assert_eq!(used.len(), 12, "{topic}: every partition used: {used:?}");
    }
    // The Java program is Kafka's murmur2: its reference values
    // (Kafka's UtilsTest.testMurmur2).
    let reference = java_partitions(
        &[
            b"21".to_vec(),
            b"foobar".to_vec(),
            b"a-little-bit-long-string".to_vec(),
        ],
        PARTITIONS,
    );
    let hashes: Vec<i32> = reference.iter().map(|(h, _)| *h).collect();
    assert_eq!(hashes, [-973_932_308, -790_332_482, -985_981_536]);
    walbox.stop();
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_on_nats_follow_the_nats_binding_structured_by_default_binary_when_set() {
    let (pg, nats, db, env) = servers_nats(&format!(
        "{CREATE}\n\n[[outbox]]\ntable = \"public.outbox\"\nformat = \"cloudevents\"\n\
         topic = \"outbox.ce.structured\"\ncloudevents_subject = \"{{aggregate_type}} {{aggregate_id}}\"\n\n\
         [[outbox]]\ntable = \"public.outbox_binary\"\nformat = \"cloudevents\"\n\
         cloudevents_mode = \"binary\"\ntopic = \"outbox.ce.binary\"\n\
         cloudevents_subject = \"{{aggregate_type}} {{aggregate_id}}\"\n"
    ))
    .await;
    db.batch_execute("CREATE TABLE outbox_binary (LIKE outbox INCLUDING ALL)")
        .await
        .unwrap();
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    // A subject with space, double quote, percent and non-ASCII: values the
    // binding percent-encodes.
    for (table, id) in [
        ("outbox", "c0000000-0000-4000-8000-000000000001"),
        ("outbox_binary", "c0000000-0000-4000-8000-000000000002"),
    ] {
        db.batch_execute(&format!(
            "INSERT INTO {table} (id, aggregate_type, aggregate_id, event_type, payload, occurred_at) \
             VALUES ('{id}', 'Bestellung', 'groß \"1\" 100%', 'OrderPlaced', '{{\"total\": 12}}', \
             '2026-11-29 19:40:00.123456+00')"
        ))
        .await
        .unwrap();
    }
    let read = |subject: &'static str| {
        let url = nats.url();
        async move {
            walbox_testkit::nats::read_at_least(&url, subject, 1, Duration::from_secs(60))
                .await
                .unwrap()
                .remove(0)
        }
    };
    let structured = read("outbox.ce.structured").await;
    let binary = read("outbox.ce.binary").await;
    let header_names = |r: &Record| -> Vec<(String, String)> {
        let mut h: Vec<(String, String)> = r
            .headers
            .iter()
            .map(|(n, v)| (n.clone(), String::from_utf8(v.clone().unwrap()).unwrap()))
            .filter(|(n, _)| {
                n.to_ascii_lowercase().starts_with("ce") || n.eq_ignore_ascii_case("content-type")
            })
            .collect();
        h.sort();
        h
    };

    // Structured (the default on NATS): Content-Type application/cloudevents+json,
    // no attribute headers, the payload the JSON event format.
    assert_eq!(
        header_names(&structured),
        [(
            "Content-Type".to_owned(),
            "application/cloudevents+json".to_owned()
        )]
    );
    // Binary: every attribute as a ce- header, percent-encoded,
    // datacontenttype as ce-datacontenttype, no Content-Type; the payload is
    // the data.
    let expected: Vec<(String, String)> = [
        ("ce-datacontenttype", "application/json"),
        ("ce-id", "c0000000-0000-4000-8000-000000000002"),
        ("ce-source", "/walbox/public.outbox_binary"),
        ("ce-specversion", "1.0"),
        ("ce-subject", "Bestellung%20gro%C3%9F%20%221%22%20100%25"),
        ("ce-time", "2026-11-29T19:40:00.123456+00:00"),
        ("ce-type", "OrderPlaced"),
    ]
    .iter()
    .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
    .collect();
    assert_eq!(header_names(&binary), expected);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(binary.value.as_deref().unwrap()).unwrap(),
        serde_json::json!({"total": 12})
    );

    // The SDK reads both as the same event.
    let events = parse_with_sdk(&[("nats-structured", &structured), ("nats-binary", &binary)]);
    let expected = |n: u32, table: &str| {
        serde_json::json!({
            "specversion": "1.0",
            "id": format!("c0000000-0000-4000-8000-00000000000{n}"),
            "source": format!("/walbox/public.{table}"),
            "type": "OrderPlaced",
            "subject": "Bestellung groß \"1\" 100%",
            "time": "2026-11-29T19:40:00.123456+00:00",
            "datacontenttype": "application/json",
            "data": {"total": 12},
        })
    };
    assert_eq!(
        events,
        vec![expected(1, "outbox"), expected(2, "outbox_binary")]
    );
    walbox.stop();
    // verify finds the ids in a structured event's value (Content-Type) and in
    // ce-id (marked by ce-specversion).
    for (table, extra) in [
        ("outbox", "topic = \"outbox.ce.structured\""),
        (
            "outbox_binary",
            "topic = \"outbox.ce.binary\"\ncloudevents_mode = \"binary\"",
        ),
    ] {
        let cfg = config_file(
            &pg,
            "verify-nats.toml",
            &format!(
                "[sink]\ntype = \"nats\"\n[sink.nats]\nservers = [\"{}\"]\n\
                 [[outbox]]\ntable = \"public.{table}\"\nformat = \"cloudevents\"\n{extra}\n",
                nats.url()
            ),
        );
        let (code, out, err) = walbox_cmd(&["verify", "--json", "--config", &cfg], &env);
        let report: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
        assert_eq!(code, Some(0), "{table}: {report}\n{err}");
        assert_eq!(
            (&report["rows"], &report["missing"], &report["not_in_table"]),
            (&1.into(), &0.into(), &0.into()),
            "{table}: {report}"
        );
    }
    drop(pg);
}
