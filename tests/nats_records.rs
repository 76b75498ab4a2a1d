//! Records JetStream cannot take as they are, on a real `nats-server -js`: an
//! event whose id another event of the stream already holds stops walbox
//! before the slot passes it (the stream would drop it as a duplicate); a
//! header NATS cannot carry, a source header named `Nats-*` or a key that is
//! not UTF-8 is dead-lettered with what NATS can carry; a subject NATS refuses
//! is dead-lettered to a subject it takes. In each case the events after it
//! are published.

mod common;

use std::time::Duration;

use common::*;

/// Two outbox tables with `bigserial` ids, each with its own sequence: their
/// first rows both get id 1.
const SERIAL_TABLES: &str = "
    CREATE TABLE outbox_a (
        id bigserial PRIMARY KEY,
        aggregate_type text NOT NULL,
        aggregate_id text NOT NULL,
        event_type text NOT NULL,
        payload jsonb NOT NULL,
        headers jsonb,
        occurred_at timestamptz NOT NULL DEFAULT now(),
        schema_version int
    );
    CREATE TABLE outbox_b (
        id bigserial PRIMARY KEY,
        aggregate_type text NOT NULL,
        aggregate_id text NOT NULL,
        event_type text NOT NULL,
        payload jsonb NOT NULL,
        headers jsonb,
        occurred_at timestamptz NOT NULL DEFAULT now(),
        schema_version int
    );
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_whose_id_the_stream_holds_for_another_stops_walbox_before_the_slot_passes_it() {
    let (pg, nats, db, env) = servers_nats(&format!(
        "{CREATE}\n\n[[outbox]]\ntable = \"public.outbox_a\"\ntopic = \"outbox.a.{{aggregate_type}}\"\n\n\
         [[outbox]]\ntable = \"public.outbox_b\"\ntopic = \"outbox.b.{{aggregate_type}}\"\n"
    ))
    .await;
    db.batch_execute(SERIAL_TABLES).await.unwrap();
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox_a (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'a-1', 'Placed', '{\"table\": \"a\"}')",
    )
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    let before = current_lsn(&db).await;
    // B's first row: id 1 as well, on another subject, with another payload.
    db.batch_execute(
        "INSERT INTO outbox_b (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'b-1', 'Placed', '{\"table\": \"b\"}')",
    )
    .await
    .unwrap();
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_ne!(status.code(), Some(0), "{log}");
    for part in [
        "duplicate_id",
        "event 1 on subject outbox.b.order",
        "on subject outbox.a.order",
        "duplicate window of 600 s",
        "uuid ids",
        "its own stream",
    ] {
        assert!(log.contains(part), "{part}: {log}");
    }
    let slot = confirmed_lsn(&db, "walbox").await;
    assert!(
        slot <= before,
        "the slot at {slot} passed B's row after {before}"
    );
    // A restart meets the same event and stops again.
    let mut again = Walbox::spawn(&["run"], &env);
    assert_ne!(again.wait(Duration::from_secs(60)).code(), Some(0));
    assert!(again.log().contains("duplicate_id"), "{}", again.log());
    assert!(confirmed_lsn(&db, "walbox").await <= before);
    let stored = read_subject(&nats, "outbox.a.order").await;
    assert_eq!(stored.len(), 1);
    assert!(read_subject(&nats, "outbox.b.order").await.is_empty());
    drop(pg);
}

/// One stored message: its event type, key, and the headers a test asks for.
#[derive(Debug)]
struct Message {
    event_type: String,
    key: Option<Vec<u8>>,
    headers: Vec<(String, Option<String>)>,
}

impl Message {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_deref())
    }
}

/// What the stream holds of `subject`, with the headers `names`.
async fn messages(
    nats: &walbox_testkit::NatsServer,
    subject: &str,
    names: &[&str],
) -> Vec<Message> {
    let mut out = Vec::new();
    walbox_sink::read_subject(
        &reader_config(nats),
        subject,
        Duration::from_secs(30),
        |r| {
            out.push(Message {
                event_type: r.header("event_type").unwrap_or_default().to_owned(),
                key: r.key().map(<[u8]>::to_vec),
                headers: names
                    .iter()
                    .map(|n| ((*n).to_owned(), r.header(n).map(str::to_owned)))
                    .collect(),
            });
        },
    )
    .await
    .unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_nats_cannot_carry_are_dead_lettered_without_them_and_later_rows_are_published() {
    let (pg, nats, db, env) = servers_nats(CREATE).await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) VALUES
           ('order', 'k', 'LineBreak', '{}', '{\"note\": \"a\\nb\", \"trace\": \"t-1\"}');
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) VALUES
           ('order', 'k', 'BadNames', '{}', '{\"a b\": \"1\", \"Nats-Expected-Stream\": \"X\"}');
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', E'k\\n1', 'KeyBreak', '{}');
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', 'k', 'Normal', '{}');",
    )
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    let log = walbox.log();
    walbox.stop();
    // The key with a line break is carried in base64, and read back as it was.
    let stored = messages(&nats, SUBJECT, &["walbox_key_encoding"]).await;
    let types: Vec<&str> = stored.iter().map(|m| m.event_type.as_str()).collect();
    assert_eq!(types, ["KeyBreak", "Normal"], "{log}");
    assert_eq!(stored[0].key.as_deref(), Some(&b"k\n1"[..]));
    assert_eq!(stored[0].header("walbox_key_encoding"), Some("base64"));
    assert_eq!(stored[1].key.as_deref(), Some(&b"k"[..]));
    assert_eq!(stored[1].header("walbox_key_encoding"), None);
    // The others are dead-lettered with the reason, without what NATS cannot
    // carry, naming it.
    let names = [
        "walbox_error_class",
        "walbox_error",
        "walbox_dropped_headers",
        "trace",
        "note",
    ];
    let dead = messages(&nats, "outbox.order.dlq", &names).await;
    assert_eq!(dead.len(), 2, "{log}");
    for d in &dead {
        assert_eq!(d.header("walbox_error_class"), Some("invalid_record"));
        assert_eq!(d.key.as_deref(), Some(&b"k"[..]));
        assert_eq!(d.header("note"), None);
    }
    assert!(
        dead[0]
            .header("walbox_error")
            .unwrap()
            .contains("line break"),
        "{dead:?}"
    );
    assert_eq!(dead[0].header("walbox_dropped_headers"), Some("1 note"));
    assert_eq!(dead[0].header("trace"), Some("t-1"));
    let reason = dead[1].header("walbox_error").unwrap();
    assert!(
        reason.contains("\"Nats-Expected-Stream\" is named like the NATS server's own")
            || reason.contains("\"a b\" is not a NATS header name"),
        "{reason}"
    );
    let dropped = dead[1].header("walbox_dropped_headers").unwrap();
    let (count, names) = dropped.split_once(' ').unwrap();
    assert_eq!(count, "2", "{dropped}");
    let mut names: Vec<&str> = names.split(',').collect();
    names.sort_unstable();
    assert_eq!(names, ["Nats-Expected-Stream", "a%20b"]);
    assert!(log.contains("dead letter published without the headers NATS cannot carry"));
    assert!(!log.contains("t-1"), "a header value in the log: {log}");
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_nats_refuses_is_dead_lettered_to_a_sanitized_subject_and_later_rows_are_published()
 {
    let (pg, nats, db, env) = servers_nats(CREATE).await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    // `outbox.{aggregate_type}` with an empty aggregate type: `outbox.`.
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('', 'k', 'NoType', '{}');
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', 'k', 'Normal', '{}');",
    )
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    let log = walbox.log();
    walbox.stop();
    let stored = messages(&nats, SUBJECT, &[]).await;
    let types: Vec<&str> = stored.iter().map(|m| m.event_type.as_str()).collect();
    assert_eq!(types, ["Normal"], "{log}");
    let names = ["walbox_error_class", "walbox_error", "walbox_source_topic"];
    let dead = messages(&nats, "outbox._.dlq", &names).await;
    assert_eq!(dead.len(), 1, "{log}");
    assert_eq!(dead[0].event_type, "NoType");
    assert_eq!(dead[0].header("walbox_error_class"), Some("invalid_topic"));
    assert_eq!(dead[0].header("walbox_source_topic"), Some("outbox."));
    let reason = dead[0].header("walbox_error").unwrap();
    assert!(
        reason.contains("\"outbox.\" is not a NATS subject") && reason.contains("outbox._.dlq"),
        "{reason}"
    );
    drop(pg);
}
