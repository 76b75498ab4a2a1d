//! The table-less outbox: events written with `pg_logical_emit_message` into the
//! WAL alone, published like outbox rows (same positions, same order, same
//! dead letters, same acknowledgement-gated position).

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use walbox_pgoutput::Lsn;
use walbox_testkit::kafka::Record;
use walbox_testkit::{BrokerOptions, BrokerStorage, PgOptions};

const TOPIC: &str = "outbox.order";

fn json(r: &Record) -> serde_json::Value {
    serde_json::from_slice(r.value.as_deref().unwrap()).unwrap()
}

fn index(r: &Record) -> u32 {
    r.header("walbox_index").unwrap().parse().unwrap()
}

/// The environment with a configuration file of the outbox table (or not) and
/// prefix `walbox`, set up.
fn env_with(
    pg: &walbox_testkit::PgCluster,
    broker: &walbox_testkit::Broker,
    table: bool,
    extra: &str,
) -> Vec<(&'static str, String)> {
    let mut env = walbox_env(pg, broker);
    env.push(("WALBOX_CONFIG", messages_config(pg, table, extra)));
    setup(&env);
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_of_inserts_and_messages_publishes_them_all_in_wal_order() {
    let (pg, broker, db) = servers().await;
    let env = env_with(&pg, &broker, true, "");
    let mut walbox = Walbox::spawn(&["run"], &env);
    // A number beyond 64 bits in the payload, which must arrive as written.
    let m1 = r#"{"id":"m-1","aggregate_type":"order","aggregate_id":"k2","event_type":"OrderPaid",
        "payload":{"seq":0,"big":12345678901234567890123},"headers":{"tenant":"acme"},
        "schema_version":3}"#;
    db.batch_execute(
        &[
            "BEGIN;".to_owned(),
            outbox_insert("k1", 0),
            emit(true, "walbox", m1),
            outbox_insert("k2", 1),
            emit(true, "walbox", &event_content("m-3", "k1", 1)),
            emit(
                true,
                "walbox",
                &event_content("m-4", "k3", 0).replace("\"order\"", "\"invoice\""),
            ),
            "COMMIT;".to_owned(),
        ]
        .concat(),
    )
    .await
    .unwrap();
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    let mut records = read_topic(&broker.bootstrap(), TOPIC, 4).await;
    records.extend(read_topic(&broker.bootstrap(), "outbox.invoice", 1).await);
    walbox.stop();
    records.sort_by_key(index);
    let commit: HashSet<&str> = records
        .iter()
        .map(|r| r.header("walbox_commit_lsn").unwrap())
        .collect();
    assert_eq!(commit.len(), 1, "one transaction, one commit LSN");
    let xids: HashSet<&str> = records
        .iter()
        .map(|r| r.header("walbox_xid").unwrap())
        .collect();
    assert_eq!(xids.len(), 1);
    let got: Vec<(u32, &str, Option<&str>, &str)> = records
        .iter()
        .map(|r| {
            (
                index(r),
                r.topic.as_str(),
                r.key_str(),
                r.header("event_type").unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (0, TOPIC, Some("k1"), "OrderPlaced"),
            (1, TOPIC, Some("k2"), "OrderPaid"),
            (2, TOPIC, Some("k2"), "OrderPlaced"),
            (3, TOPIC, Some("k1"), "OrderPlaced"),
            (4, "outbox.invoice", Some("k3"), "OrderPlaced"),
        ]
    );
    let m1 = &records[1];
    assert_eq!(m1.header("event_id"), Some("m-1"));
    assert_eq!(m1.header("tenant"), Some("acme"));
    assert_eq!(m1.header("schema_version"), Some("3"));
    assert_eq!(m1.header("aggregate_type"), Some("order"));
    let raw = std::str::from_utf8(m1.value.as_deref().unwrap()).unwrap();
    assert!(raw.contains("12345678901234567890123"), "{raw}");
    let v = json(m1);
    assert_eq!(v["event_id"], "m-1");
    assert_eq!(v["event_type"], "OrderPaid");
    assert_eq!(v["schema_version"], 3);
    assert_eq!(v["payload"]["seq"], 0);
    assert_eq!(v["producer"], "walbox");
    assert_eq!(json(&records[3])["event_id"], "m-3");
    // The rows' envelopes are the same shape.
    let row = json(&records[0]);
    assert_eq!(row["payload"]["seq"], 0);
    assert_eq!(row["producer"], "walbox");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolled_back_messages_and_other_prefixes_never_appear_and_walbox_goes_on() {
    let (pg, broker, db) = servers().await;
    // Only [[messages]]: the publication holds no table.
    let env = env_with(&pg, &broker, false, "");
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        &[
            "BEGIN;".to_owned(),
            emit(true, "walbox", &event_content("gone-1", "k1", 0)),
            emit(true, "walbox", &event_content("gone-2", "k1", 1)),
            "ROLLBACK;".to_owned(),
            emit(true, "other", "whatever another reader wants"),
            emit(false, "other", "not walbox's either"),
            "BEGIN;".to_owned(),
            emit(true, "elsewhere", &event_content("not-ours", "k1", 0)),
            emit(true, "walbox", &event_content("marker", "k1", 0)),
            "COMMIT;".to_owned(),
        ]
        .concat(),
    )
    .await
    .unwrap();
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    let records = read_topic(&broker.bootstrap(), TOPIC, 1).await;
    assert!(walbox.running(), "{}", walbox.log());
    walbox.stop();
    let ids: Vec<&str> = records
        .iter()
        .map(|r| r.header("event_id").unwrap())
        .collect();
    assert_eq!(ids, ["marker"]);
    // The ignored message took no index.
    assert_eq!(index(&records[0]), 0);
    let log = walbox.log();
    for prefix in ["other", "elsewhere"] {
        assert_eq!(
            log.matches(&format!("prefix={prefix}")).count(),
            1,
            "each ignored prefix named once:\n{log}"
        );
    }
    assert!(
        !log.contains("whatever another reader"),
        "content logged:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_transactional_message_is_dead_lettered_and_the_slot_passes_it_only_after() {
    let (pg, mut broker, db) = servers_with(
        PgOptions::default(),
        BrokerOptions {
            storage: BrokerStorage::Sqlite,
        },
    )
    .await;
    if broker.is_external() {
        return; // needs a broker this test can stop
    }
    let env = env_with(&pg, &broker, true, "");
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(&format!("BEGIN;{}COMMIT;", outbox_insert("k1", 0)))
        .await
        .unwrap();
    // The dead-letter topic exists before the broker goes away.
    db.batch_execute(&emit(false, "walbox", &event_content("warm-up", "k0", 0)))
        .await
        .unwrap();
    wait_caught_up(&db).await;
    read_topic(&broker.bootstrap(), "outbox.order.dlq", 1).await;

    broker.stop().unwrap();
    let emitted = emit(false, "walbox", &event_content("n-1", "k2", 0));
    let at: String = db
        .query_one(&format!("{}::text", emitted.trim_end_matches(';')), &[])
        .await
        .unwrap()
        .get(0);
    let at: Lsn = at.parse().unwrap();
    walbox_testkit::wait_until("the dead letter", Duration::from_secs(60), || {
        walbox.log().contains("event_id=n-1").then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    assert!(
        confirmed_lsn(&db, "walbox").await < at,
        "the slot passed a message whose dead letter is not acknowledged"
    );
    assert!(checkpoint(&pg).unwrap().lsn < at);
    broker.start_again().unwrap();
    wait_confirmed(&db, "walbox", at, Duration::from_secs(120)).await;
    let dead = read_topic(&broker.bootstrap(), "outbox.order.dlq", 2).await;
    walbox.stop();
    let d = dead
        .iter()
        .find(|r| r.header("event_id") == Some("n-1"))
        .expect("the dead letter");
    assert_eq!(d.key_str(), Some("k2"));
    assert_eq!(
        d.header("walbox_error_class"),
        Some("non_transactional_message")
    );
    assert!(
        d.header("walbox_error")
            .unwrap()
            .contains("emit it with transactional = true")
    );
    assert_eq!(d.header("walbox_source_message_prefix"), Some("walbox"));
    assert_eq!(d.header("walbox_commit_lsn"), Some(at.to_string().as_str()));
    assert_eq!(json(d)["prefix"], "walbox");
    assert_eq!(
        json(d)["content"],
        event_content("n-1", "k2", 0).as_str(),
        "the content as it was"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_contents_are_dead_lettered_naming_the_field_and_later_events_flow() {
    let (pg, broker, db) = servers().await;
    let env = env_with(&pg, &broker, true, "");
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        &[
            "BEGIN;".to_owned(),
            emit(true, "walbox", "this is not json"),
            emit(
                true,
                "walbox",
                r#"{"aggregate_type":"order","aggregate_id":"k1","event_type":"E","payload":{}}"#,
            ),
            emit(
                true,
                "walbox",
                r#"{"id":"no-key","aggregate_type":"order","event_type":"E","payload":{}}"#,
            ),
            "COMMIT;".to_owned(),
            "BEGIN;".to_owned(),
            emit(true, "walbox", &event_content("after", "k1", 0)),
            outbox_insert("k1", 1),
            "COMMIT;".to_owned(),
        ]
        .concat(),
    )
    .await
    .unwrap();
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    let good = read_topic(&broker.bootstrap(), TOPIC, 2).await;
    let named = read_topic(&broker.bootstrap(), "outbox.order.dlq", 2).await;
    let fallback = read_topic(&broker.bootstrap(), "walbox.message.walbox.dlq", 1).await;
    assert!(walbox.running(), "{}", walbox.log());
    walbox.stop();
    assert_eq!(good.len(), 2);
    assert_eq!(good[0].header("event_id"), Some("after"));
    let errors: Vec<(u32, &str, &str)> = named
        .iter()
        .chain(&fallback)
        .map(|r| {
            (
                index(r),
                r.header("walbox_error_class").unwrap(),
                r.header("walbox_error").unwrap(),
            )
        })
        .collect();
    let find = |i: u32| *errors.iter().find(|e| e.0 == i).unwrap();
    let (_, class, reason) = find(0);
    assert_eq!(class, "content_not_json");
    assert!(reason.contains("not valid JSON"), "{reason}");
    let (_, class, reason) = find(1);
    assert_eq!(class, "missing_field");
    assert!(reason.contains(r#""id" (event id)"#), "{reason}");
    let (_, class, reason) = find(2);
    assert_eq!(class, "missing_field");
    assert!(
        reason.contains(r#""aggregate_id" (aggregate id (key))"#),
        "{reason}"
    );
    assert_eq!(
        json(&fallback[0])["content"],
        "this is not json",
        "the dead letter carries the content"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_rebuilds_a_message_from_its_dead_letter_and_never_a_non_transactional_one() {
    let (pg, broker, db) = servers().await;
    let env = env_with(&pg, &broker, true, "");
    let mut walbox = Walbox::spawn(&["run"], &env);
    // A row and a message under the same id; the message names its key in a
    // field the mapping does not know yet, so it is dead-lettered.
    let id = "6f1c1a8e-1f38-4c55-9a3a-0d7f3c2b9a11";
    let content = serde_json::json!({
        "id": id,
        "aggregate_type": "order",
        "key": "msg-key",
        "event_type": "E",
        "payload": {"from": "message"},
    });
    db.batch_execute(
        &[
            "BEGIN;".to_owned(),
            format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('{id}', 'order', 'row-key', 'E', '{{\"from\": \"row\"}}');"
            ),
            emit(true, "walbox", &content.to_string()),
            "COMMIT;".to_owned(),
            // A non-transactional message of a transaction that rolls back: a
            // well-formed event, dead-lettered for having no commit order.
            "BEGIN;".to_owned(),
            emit(false, "walbox", &event_content("nt-1", "nt-key", 0)),
            "ROLLBACK;".to_owned(),
        ]
        .concat(),
    )
    .await
    .unwrap();
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    let dead = read_topic(&broker.bootstrap(), "outbox.order.dlq", 2).await;
    walbox.stop();
    let classes: HashSet<&str> = dead
        .iter()
        .map(|r| r.header("walbox_error_class").unwrap())
        .collect();
    assert_eq!(
        classes,
        HashSet::from(["missing_field", "non_transactional_message"])
    );
    assert!(
        dead.iter()
            .all(|r| r.header("walbox_source_message_prefix") == Some("walbox"))
    );

    // The mapping fixed, the default replay (the table's dead-letter topics,
    // this one among them) rebuilds the message from the content its letter
    // holds, not the row that has its id.
    let mut fixed = walbox_env(&pg, &broker);
    fixed.push((
        "WALBOX_CONFIG",
        messages_config(&pg, true, "[messages.fields]\naggregate_id = \"key\""),
    ));
    let (code, out, err) = walbox_cmd(&["dlq", "replay"], &fixed);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("replayed 1 dead letters; 0 still failing (left in place); 1 not replayable"),
        "{out}"
    );
    assert!(
        out.contains("not replayable, left in place: event nt-1"),
        "{out}"
    );
    // Both letters are done: a second run has nothing left.
    let (code, again, err) = walbox_cmd(&["dlq", "replay"], &fixed);
    assert_eq!(code, Some(0), "{again}{err}");
    assert!(
        again
            .contains("replayed 0 dead letters; 0 still failing (left in place); 0 not replayable"),
        "{again}"
    );
    let records = read_topic(&broker.bootstrap(), TOPIC, 2).await;
    assert_eq!(records.len(), 2);
    let keyed = |k: &[u8]| {
        let of_key: Vec<&Record> = records
            .iter()
            .filter(|r| r.key.as_deref() == Some(k))
            .collect();
        assert_eq!(of_key.len(), 1, "one record of key {k:?}");
        of_key[0]
    };
    let replayed = keyed(b"msg-key");
    assert_eq!(replayed.header("event_id"), Some(id));
    assert_eq!(index(replayed), 1, "the message's own position");
    assert_eq!(json(replayed)["payload"]["from"], "message");
    assert_eq!(json(keyed(b"row-key"))["payload"]["from"], "row");
    assert!(
        records.iter().all(|r| r.header("event_id") != Some("nt-1")),
        "a non-transactional message is never published"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cloudevents_prefix_gets_ce_headers() {
    let (pg, broker, db) = servers().await;
    let env = env_with(
        &pg,
        &broker,
        false,
        "format = \"cloudevents\"\ntopic = \"ce.{aggregate_type}\"",
    );
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(&format!(
        "BEGIN;{}COMMIT;",
        emit(true, "walbox", &event_content("ce-1", "k7", 0))
    ))
    .await
    .unwrap();
    let records = read_topic(&broker.bootstrap(), "ce.order", 1).await;
    walbox.stop();
    let r = &records[0];
    assert_eq!(r.header("ce_specversion"), Some("1.0"));
    assert_eq!(r.header("ce_id"), Some("ce-1"));
    assert_eq!(r.header("ce_type"), Some("OrderPlaced"));
    assert_eq!(r.header("ce_source"), Some("/walbox/walbox"));
    assert_eq!(r.header("ce_subject"), Some("k7"));
    assert!(r.header("ce_time").is_some_and(|t| t.ends_with('Z')));
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.key_str(), Some("k7"));
    assert_eq!(json(r), serde_json::json!({"seq": 0}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_rounds_under_messages_and_rows_lose_nothing_and_keep_each_keys_order() {
    let (pg, broker, db) = servers().await;
    let env = env_with(&pg, &broker, true, "");
    let stop_writing = Arc::new(AtomicBool::new(false));
    let writer = steady_writer_with(&pg, Arc::clone(&stop_writing), row_or_message).await;
    kill_9_rounds(&pg, &db, &env, 10).await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    stop_writing.store(true, Ordering::Relaxed);
    let written = writer.await.unwrap();
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(120)).await;
    let records = read_topic(&broker.bootstrap(), TOPIC, written).await;
    walbox.stop();
    let mut expected = outbox_ids(&db).await;
    expected.extend(message_ids_written(written));
    assert_eq!(expected.len(), written);
    let (missing, _) = audit(&expected, &records);
    assert!(
        missing.is_empty(),
        "{} missing after 10 kills",
        missing.len()
    );
    assert_duplicates_are_replays(&records);
    assert_per_key_order(&records, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_in_an_exception_block_comes_before_the_insert_written_after_it() {
    // The message's record ends where the next insert's starts, in another
    // subtransaction: the server may send the insert first (a tie at one LSN).
    let (pg, broker, db) = servers().await;
    let env = env_with(&pg, &broker, true, "");
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(&format!(
        "CREATE FUNCTION place() RETURNS void LANGUAGE plpgsql AS $$
         BEGIN
           BEGIN
             PERFORM pg_logical_emit_message(true, 'walbox', '{}');
           EXCEPTION WHEN others THEN RAISE;
           END;
           {}
         END $$;
         SELECT place();",
        event_content("m-0", "k", 0),
        outbox_insert("k", 1),
    ))
    .await
    .unwrap();
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    let mut records = read_topic(&broker.bootstrap(), TOPIC, 2).await;
    walbox.stop();
    records.sort_by_key(index);
    let got: Vec<(u32, &str)> = records
        .iter()
        .map(|r| (index(r), r.header("event_id").unwrap_or_default()))
        .collect();
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0], (0, "m-0"), "the message was written first: {got:?}");
}
