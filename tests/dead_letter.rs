//! Poison rows: dead-lettered with the reason while the stream goes on, or, with
//! `dead_letter.policy = "stop"`, a stop naming the row.

mod common;

use std::time::Duration;

use common::*;
use walbox_testkit::{Broker, PgCluster};

/// An outbox whose payload is text, so a row can hold something that is not JSON.
const LOOSE_OUTBOX: &str = "
    CREATE TABLE outbox (
        id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
        aggregate_type text,
        aggregate_id text,
        event_type text NOT NULL,
        payload text NOT NULL
    )";

/// A cluster with the loose outbox set up for walbox, a broker, and walbox's env.
async fn start() -> (
    PgCluster,
    Broker,
    tokio_postgres::Client,
    Vec<(&'static str, String)>,
) {
    let pg = PgCluster::start().unwrap();
    let broker = Broker::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(LOOSE_OUTBOX).await.unwrap();
    let env = walbox_env(&pg, &broker);
    setup(&env);
    (pg, broker, db, env)
}

/// The `seq` of each record's payload, in the records' order.
fn seqs_of(records: &[walbox_testkit::kafka::Record]) -> Vec<i64> {
    records
        .iter()
        .map(|r| {
            let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
            v["payload"]["seq"].as_i64().or(v["seq"].as_i64()).unwrap()
        })
        .collect()
}

fn insert(aggregate_type: &str, aggregate_id: Option<&str>, payload: &str) -> String {
    let id = aggregate_id.map_or("NULL".to_owned(), |a| format!("'{a}'"));
    format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('{aggregate_type}', {id}, 'E', '{payload}');"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_rows_go_to_dead_letter_topics_and_the_stream_goes_on() {
    let (_pg, broker, db, env) = start().await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        &[
            insert("order", Some("k1"), r#"{"seq": 0}"#),
            insert("order", Some("k1"), "this is not json"),
            insert("order", Some("k1"), r#"{"seq": 1}"#),
            insert("order", None, r#"{"seq": 0}"#),
            insert("bad topic!", Some("k3"), r#"{"seq": 0}"#),
            insert("order", Some("k2"), r#"{"seq": 0}"#),
        ]
        .concat(),
    )
    .await
    .unwrap();
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;

    let good = read_topic(&broker.bootstrap(), "outbox.order", 3).await;
    assert_eq!(good.len(), 3);
    assert_per_key_order(&good, false);

    let dlq = read_topic(&broker.bootstrap(), "outbox.order.dlq", 2).await;
    assert_eq!(dlq.len(), 2);
    let classes: Vec<&str> = dlq
        .iter()
        .map(|r| r.header("walbox_error_class").unwrap())
        .collect();
    assert!(classes.contains(&"payload_not_json"), "{classes:?}");
    assert!(classes.contains(&"null_column"), "{classes:?}");
    for r in &dlq {
        assert_eq!(r.header("walbox_source_table"), Some("public.outbox"));
        assert_eq!(r.header("walbox_source_topic"), Some("outbox.order"));
        assert_eq!(r.header("walbox_attempts"), Some("1"));
        assert!(r.header("walbox_commit_lsn").unwrap().contains('/'));
        assert!(r.header("event_id").unwrap().len() == 36, "the row's uuid");
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
        assert_eq!(v["table"], "public.outbox");
        assert!(v["columns"]["id"].is_string());
    }
    let bad_topic = read_topic(&broker.bootstrap(), "walbox.public.outbox.dlq", 1).await;
    assert_eq!(bad_topic.len(), 1);
    assert_eq!(
        bad_topic[0].header("walbox_error_class"),
        Some("invalid_topic")
    );
    assert_eq!(bad_topic[0].key_str(), Some("k3"));

    walbox.stop();
    let log = walbox.log();
    assert!(log.contains("dead_lettered=3"), "{log}");
    assert!(
        !log.contains("this is not json"),
        "no row values in logs: {log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_stop_policy_a_poison_row_stops_walbox_naming_it() {
    let (pg, _broker, db, env) = start().await;
    let cfg = config_file(&pg, "stop.toml", "[dead_letter]\npolicy = \"stop\"\n");
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    db.batch_execute(&insert("order", Some("k1"), "not json"))
        .await
        .unwrap();
    let id: String = db
        .query_one("SELECT id::text FROM outbox", &[])
        .await
        .unwrap()
        .get(0);
    let status = walbox.wait(Duration::from_secs(60));
    assert_eq!(status.code(), Some(1));
    let log = walbox.log();
    assert!(log.contains(&format!("event id {id}")), "{log}");
    assert!(log.contains("payload_not_json"), "{log}");
    assert!(confirmed_lsn(&db, "walbox").await < current_lsn(&db).await);
}

/// A configuration whose producer refuses records over 20,000 bytes.
fn small_messages(pg: &PgCluster) -> String {
    config_file(
        pg,
        "small.toml",
        "[sink.kafka]\n\"message.max.bytes\" = 20000\n",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_larger_than_the_broker_accepts_is_dead_lettered_and_the_stream_goes_on() {
    let (pg, broker, db, env) = start().await;
    let cfg = small_messages(&pg);
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    let big = format!(r#"{{"seq": 1, "blob": "{}"}}"#, "x".repeat(50_000));
    db.batch_execute(
        &[
            insert("order", Some("k1"), r#"{"seq": 0}"#),
            insert("order", Some("k1"), &big),
            insert("order", Some("k1"), r#"{"seq": 2}"#),
        ]
        .concat(),
    )
    .await
    .unwrap();
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    let good = read_topic(&broker.bootstrap(), "outbox.order", 2).await;
    assert_eq!(good.len(), 2, "the rows around it went out");
    let dlq = read_topic(&broker.bootstrap(), "outbox.order.dlq", 1).await;
    assert_eq!(dlq.len(), 1);
    let d = &dlq[0];
    let big_id: String = db
        .query_one(
            "SELECT id::text FROM outbox WHERE length(payload) > 40000",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(d.header("event_id"), Some(big_id.as_str()));
    assert_eq!(d.header("walbox_error_class"), Some("message_too_large"));
    assert_eq!(d.header("walbox_source_topic"), Some("outbox.order"));
    assert_eq!(d.header("walbox_attempts"), Some("1"));
    assert_eq!(d.header("walbox_index"), Some("1"));
    assert_eq!(d.key_str(), Some("k1"));
    let v: serde_json::Value = serde_json::from_slice(d.value.as_deref().unwrap()).unwrap();
    assert!(v["value_bytes"].as_u64().unwrap() > 50_000, "{v}");
    walbox.stop();
    assert!(walbox.log().contains("dead_lettered=1"), "{}", walbox.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_replayed_to_their_topic_after_a_fix_and_kept() {
    let (pg, broker, db, env) = start().await;
    let cfg = small_messages(&pg);
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    let big = format!(r#"{{"seq": 2, "blob": "{}"}}"#, "x".repeat(50_000));
    db.batch_execute(
        &[
            insert("order", Some("k1"), r#"{"seq": 0}"#),
            insert("order", Some("k1"), "not json yet"),
            insert("order", Some("k1"), &big),
        ]
        .concat(),
    )
    .await
    .unwrap();
    wait_caught_up(&db).await;
    walbox.stop();
    let dlq = read_topic(&broker.bootstrap(), "outbox.order.dlq", 2).await;
    assert_eq!(dlq.len(), 2);

    // Unfixed, the poison row still fails and stays; the large one of the
    // same key (read from the table, default size limit) would go out, but
    // not before it: it is held back.
    let (code, out, err) = walbox_cmd(&["dlq", "replay", "--dry-run"], &env);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(
        out.contains("still failing") && out.contains("payload_not_json"),
        "{out}"
    );
    assert!(out.contains("held back"), "{out}");
    assert!(out.contains("would replay 0 dead letters"), "{out}");
    let (code, out, err) = walbox_cmd(&["dlq", "replay", "--from-table"], &env);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(
        out.contains("replayed 0 dead letters; 2 still failing"),
        "{out}"
    );

    db.batch_execute("UPDATE outbox SET payload = '{\"seq\": 1}' WHERE payload = 'not json yet'")
        .await
        .unwrap();
    let (code, out, err) = walbox_cmd(&["dlq", "replay", "--from-table"], &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("replayed 2 dead letters; 0 still failing"),
        "{out}"
    );
    let records = read_topic(&broker.bootstrap(), "outbox.order", 3).await;
    assert_eq!(records.len(), 3);
    // k1's events in their order: the replayed ones after the first, the
    // fixed row before the large one.
    let seqs = seqs_of(&records);
    assert_eq!(seqs, [0, 1, 2]);
    let ids: Vec<&str> = dlq.iter().map(|d| d.header("event_id").unwrap()).collect();
    for d in &dlq {
        let id = d.header("event_id").unwrap();
        let r = records
            .iter()
            .find(|r| r.header("event_id") == Some(id))
            .unwrap_or_else(|| panic!("{id} not replayed"));
        assert_eq!(r.header("walbox_commit_lsn"), d.header("walbox_commit_lsn"));
        assert_eq!(r.header("walbox_index"), d.header("walbox_index"));
        assert_eq!(r.key_str(), Some("k1"));
    }
    assert_eq!(ids.len(), 2);
    // Kept in the dead-letter topic; a second replay has nothing left to do.
    assert_eq!(
        read_topic(&broker.bootstrap(), "outbox.order.dlq", 2)
            .await
            .len(),
        2
    );
    let (code, out, _) = walbox_cmd(&["dlq", "replay", "--from-table"], &env);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("replayed 0 dead letters"), "{out}");
}

/// A row whose topic cannot be formed (NULL or invalid `aggregate_type` under the
/// `outbox.{aggregate_type}` template) goes to the table's fallback dead-letter
/// topic; `verify` counts it there, and `dlq replay` reads it from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_that_cannot_name_their_topic_are_audited_and_replayed_from_the_fallback_topic() {
    let (_pg, broker, db, env) = start().await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        &[
            insert("order", Some("k1"), r#"{"seq": 0}"#),
            insert("order", Some("k1"), "not json yet"),
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES (NULL, 'k2', 'E', '{\"seq\": 0}');"
                .to_owned(),
            insert("bad topic!", Some("k3"), r#"{"seq": 0}"#),
        ]
        .concat(),
    )
    .await
    .unwrap();
    wait_caught_up(&db).await;
    walbox.stop();
    let fallback = read_topic(&broker.bootstrap(), "walbox.public.outbox.dlq", 2).await;
    assert_eq!(fallback.len(), 2);

    // The audit counts every row: one published, three dead-lettered, two of
    // them in the fallback topic. The ends of partitions are no errors.
    let audit = |env: &[(&str, String)]| {
        let (code, out, err) = walbox_cmd(&["verify", "--json"], env);
        assert_eq!(code, Some(0), "{out}\n{err}");
        assert!(
            !err.lines().any(|l| l.contains("ERROR")),
            "no error logged: {err}"
        );
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let r = audit(&env);
    assert_eq!(r["rows"], 4, "{r}");
    assert_eq!(r["records"], 1, "{r}");
    assert_eq!(r["dead_lettered"], 3, "{r}");
    assert_eq!(r["missing"], 0, "{r}");
    assert_eq!(r["topics"], serde_json::json!(["outbox.order"]));

    // Fixed in the table: every dead letter goes out, the fallback topic's too.
    db.batch_execute(
        "UPDATE outbox SET payload = '{\"seq\": 1}' WHERE payload = 'not json yet';
         UPDATE outbox SET aggregate_type = 'order'
          WHERE aggregate_type IS NULL OR aggregate_type = 'bad topic!';",
    )
    .await
    .unwrap();
    let (code, out, err) = walbox_cmd(&["dlq", "replay", "--from-table"], &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("replayed 3 dead letters; 0 still failing"),
        "{out}"
    );
    let records = read_topic(&broker.bootstrap(), "outbox.order", 4).await;
    assert_eq!(records.len(), 4);
    for d in &fallback {
        let id = d.header("event_id").unwrap();
        let r = records
            .iter()
            .find(|r| r.header("event_id") == Some(id))
            .unwrap_or_else(|| panic!("{id} not replayed"));
        assert_eq!(r.header("walbox_commit_lsn"), d.header("walbox_commit_lsn"));
        assert_eq!(r.header("walbox_index"), d.header("walbox_index"));
    }
    let r = audit(&env);
    assert_eq!(r["records"], 4, "{r}");
    assert_eq!(r["missing"], 0, "{r}");
    assert_eq!(r["dead_lettered"], 0, "{r}");
    assert_eq!(r["duplicated"], 0, "{r}");
}

/// A letter the destination still refuses on replay (too large for the
/// producer) keeps the later letters of its key from being stored past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_letter_refused_again_on_replay_holds_back_the_later_letters_of_its_key() {
    let (pg, broker, db, env) = start().await;
    let cfg = small_messages(&pg);
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    let big = format!(r#"{{"seq": 1, "blob": "{}"}}"#, "x".repeat(50_000));
    db.batch_execute(
        &[
            insert("order", Some("k1"), r#"{"seq": 0}"#),
            insert("order", Some("k1"), &big),
            insert("order", Some("k1"), "not json yet"),
        ]
        .concat(),
    )
    .await
    .unwrap();
    wait_caught_up(&db).await;
    walbox.stop();
    assert_eq!(
        read_topic(&broker.bootstrap(), "outbox.order.dlq", 2)
            .await
            .len(),
        2
    );
    db.batch_execute("UPDATE outbox SET payload = '{\"seq\": 2}' WHERE payload = 'not json yet'")
        .await
        .unwrap();
    // The large row is still too large for this producer: refused again,
    // and k1's fixed row, later, is not stored before it.
    let (code, out, err) = walbox_cmd(&["dlq", "replay", "--from-table", "--config", &cfg], &env);
    assert_ne!(code, Some(0), "{out}\n{err}");
    let records = read_topic(&broker.bootstrap(), "outbox.order", 1).await;
    let seqs = seqs_of(&records);
    assert_eq!(seqs, [0], "{out}\n{err}");
    // With the default size limit both go, in their order.
    let (code, out, err) = walbox_cmd(&["dlq", "replay", "--from-table"], &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    let records = read_topic(&broker.bootstrap(), "outbox.order", 3).await;
    let seqs = seqs_of(&records);
    assert_eq!(seqs, [0, 1, 2], "{out}\n{err}");
}
