//! Real pgoutput bytes for every protocol version the server speaks, captured
//! through the SQL interface (`pg_logical_slot_peek_binary_changes`), decoded and
//! checked: binary columns, Type and Origin messages, streamed in-progress
//! transactions (protocol 2) with commit and abort, and two-phase transactions
//! (protocol 3).

mod common;

use bytes::Bytes;
use common::Relations;
use walbox_pgoutput::{Decoder, LogicalMessage, Lsn, TupleValue};
use walbox_testkit::{PgCluster, PgOptions};

/// Peeks every pending message of `slot` with the given pgoutput options.
async fn capture(db: &tokio_postgres::Client, slot: &str, options: &[&str]) -> Vec<(Lsn, Bytes)> {
    let mut args = vec![format!("'{slot}'"), "NULL".into(), "NULL".into()];
    args.extend(options.iter().map(|o| format!("'{o}'")));
    db.query(
        &format!(
            "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes({})",
            args.join(", ")
        ),
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| {
        (
            r.get::<_, String>(0).parse().unwrap(),
            Bytes::from(r.get::<_, Vec<u8>>(1)),
        )
    })
    .collect()
}

fn decode_all(raw: &[(Lsn, Bytes)]) -> Vec<LogicalMessage> {
    let mut d = Decoder::new();
    raw.iter()
        .map(|(lsn, b)| {
            d.decode(b)
                .unwrap_or_else(|e| panic!("message at {lsn}: {e}"))
        })
        .collect()
}

async fn cluster() -> (PgCluster, tokio_postgres::Client) {
    // The smallest decoding memory makes large transactions stream early.
    let pg = PgCluster::start_with(
        PgOptions::default()
            .setting("logical_decoding_work_mem", "64kB")
            .setting("timezone", "UTC"),
    )
    .unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(
        "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
         CREATE TABLE t (id int PRIMARY KEY, m mood, n bigint, s text);
         CREATE PUBLICATION p FOR TABLE t;",
    )
    .await
    .unwrap();
    (pg, db)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_1_binary_columns_type_and_origin() {
    let (_pg, db) = cluster().await;
    db.execute(
        "SELECT pg_create_logical_replication_slot('s1', 'pgoutput')",
        &[],
    )
    .await
    .unwrap();
    db.batch_execute(
        "INSERT INTO t VALUES (1, 'happy', 1234567890123, 'plain');
         SELECT pg_replication_origin_create('node_a');",
    )
    .await
    .unwrap();
    // A transaction replayed from another node carries an Origin message.
    db.batch_execute(
        "SELECT pg_replication_origin_session_setup('node_a');
         BEGIN;
         SELECT pg_replication_origin_xact_setup('0/ABCDEF', now());
         INSERT INTO t VALUES (2, 'ok', -5, NULL);
         COMMIT;
         SELECT pg_replication_origin_session_reset();",
    )
    .await
    .unwrap();

    let raw = capture(
        &db,
        "s1",
        &[
            "proto_version",
            "1",
            "publication_names",
            "p",
            "binary",
            "true",
            "messages",
            "true",
        ],
    )
    .await;
    let msgs = decode_all(&raw);
    let mood_oid: u32 = db
        .query_one("SELECT 'mood'::regtype::oid", &[])
        .await
        .unwrap()
        .get(0);

    let mut rel = Relations::default();
    let mut inserts = Vec::new();
    let mut saw_type = false;
    let mut origins = Vec::new();
    for m in &msgs {
        rel.observe(m);
        match m {
            LogicalMessage::Type(ty) => {
                assert_eq!(
                    (ty.oid, ty.namespace.as_str(), ty.name.as_str()),
                    (mood_oid, "public", "mood")
                );
                saw_type = true;
            }
            LogicalMessage::Origin(o) => origins.push(o.clone()),
            LogicalMessage::Insert(i) => inserts.push(i.new.clone()),
            _ => {}
        }
    }
    assert!(saw_type, "a Type message announces the enum");
    assert_eq!(origins.len(), 1);
    assert_eq!(origins[0].name, "node_a");
    assert_eq!(origins[0].commit_lsn, "0/ABCDEF".parse().unwrap());
    assert_eq!(inserts.len(), 2);
    // Binary send formats: int4 and int8 big-endian, enum and text as bytes.
    assert_eq!(
        inserts[0][0],
        TupleValue::Binary(Bytes::copy_from_slice(&1i32.to_be_bytes()))
    );
    assert_eq!(
        inserts[0][1],
        TupleValue::Binary(Bytes::from_static(b"happy"))
    );
    assert_eq!(
        inserts[0][2],
        TupleValue::Binary(Bytes::copy_from_slice(&1_234_567_890_123i64.to_be_bytes()))
    );
    assert_eq!(
        inserts[0][3],
        TupleValue::Binary(Bytes::from_static(b"plain"))
    );
    assert_eq!(
        inserts[1][2],
        TupleValue::Binary(Bytes::copy_from_slice(&(-5i64).to_be_bytes()))
    );
    assert_eq!(inserts[1][3], TupleValue::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_2_streams_large_transactions() {
    let (pg, db) = cluster().await;
    if pg.major().unwrap() >= 18 {
        // 18 looks up a large transaction's status before streaming it and drops
        // it when it already aborted, so the rolled back one would never reach
        // the stream here (it aborted before the decoding starts). The developer
        // setting `immediate` streams every change and skips that look-up.
        db.batch_execute("SET debug_logical_replication_streaming = immediate")
            .await
            .unwrap();
    }
    db.execute(
        "SELECT pg_create_logical_replication_slot('s2', 'pgoutput')",
        &[],
    )
    .await
    .unwrap();
    // Larger than logical_decoding_work_mem: streamed before it commits. One
    // statement string per transaction (in a multi-statement string, a BEGIN would
    // absorb the statements before it).
    for tx in [
        "INSERT INTO t SELECT g, 'ok', g, repeat('x', 100) FROM generate_series(1, 5000) g",
        "BEGIN;
         INSERT INTO t SELECT g, 'sad', g, repeat('y', 100) FROM generate_series(10001, 15000) g;
         ROLLBACK;",
        "BEGIN;
         SELECT pg_logical_emit_message(true, 'walbox', 'streamed');
         INSERT INTO t SELECT g, 'happy', g, repeat('z', 100) FROM generate_series(20001, 25000) g;
         COMMIT;",
    ] {
        db.batch_execute(tx).await.unwrap();
    }

    let raw = capture(
        &db,
        "s2",
        &[
            "proto_version",
            "2",
            "publication_names",
            "p",
            "streaming",
            "on",
            "messages",
            "true",
        ],
    )
    .await;
    let msgs = decode_all(&raw);

    let mut starts = 0;
    let mut stops = 0;
    let mut streamed_inserts = 0;
    let mut commits = Vec::new();
    let mut aborts = Vec::new();
    let mut streamed_messages = 0;
    let mut depth = 0;
    for m in &msgs {
        match m {
            LogicalMessage::StreamStart(s) => {
                assert_eq!(depth, 0, "stream blocks do not nest");
                depth += 1;
                starts += 1;
                assert!(s.xid != 0);
            }
            LogicalMessage::StreamStop => {
                depth -= 1;
                stops += 1;
            }
            LogicalMessage::Insert(i) => {
                assert_eq!(
                    i.xid.is_some(),
                    depth == 1,
                    "xid present exactly inside blocks"
                );
                if depth == 1 {
                    streamed_inserts += 1;
                }
            }
            LogicalMessage::Message(msg) if msg.xid.is_some() => {
                assert_eq!(&msg.content[..], b"streamed");
                streamed_messages += 1;
            }
            LogicalMessage::StreamCommit(c) => commits.push(*c),
            LogicalMessage::StreamAbort(a) => aborts.push(*a),
            _ => {}
        }
    }
    assert!(
        starts >= 3 && starts == stops,
        "{starts} starts, {stops} stops"
    );
    assert_eq!(commits.len(), 2, "two streamed transactions committed");
    assert!(commits.iter().all(|c| c.end_lsn > c.commit_lsn));
    assert_eq!(aborts.len(), 1, "the rolled back one is aborted");
    assert_eq!(aborts[0].xid, aborts[0].subxid);
    assert_eq!(aborts[0].abort, None, "protocol 2 sends no abort position");
    assert_eq!(streamed_messages, 1);
    // Rows of the committed and the aborted transactions were streamed (some of the
    // last rows of a transaction can also arrive in its final block).
    assert!(streamed_inserts >= 10_000, "{streamed_inserts}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_3_two_phase_transactions() {
    let (_pg, db) = cluster().await;
    // The fourth argument enables two-phase decoding for the slot.
    db.execute(
        "SELECT pg_create_logical_replication_slot('s3', 'pgoutput', false, true)",
        &[],
    )
    .await
    .unwrap();
    for statement in [
        "BEGIN; INSERT INTO t VALUES (1, 'ok', 1, 'a'); PREPARE TRANSACTION 'walbox-gid-1';",
        "COMMIT PREPARED 'walbox-gid-1'",
        "BEGIN; INSERT INTO t VALUES (2, 'ok', 2, 'b'); PREPARE TRANSACTION 'walbox-gid-2';",
        "ROLLBACK PREPARED 'walbox-gid-2'",
    ] {
        db.batch_execute(statement).await.unwrap();
    }

    let raw = capture(
        &db,
        "s3",
        &[
            "proto_version",
            "3",
            "publication_names",
            "p",
            "two_phase",
            "on",
        ],
    )
    .await;
    let msgs = decode_all(&raw);
    let tags: String = msgs.iter().map(|m| m.tag() as char).collect();
    // Type (the enum) and Relation appear before the first insert; each prepared
    // transaction is Begin Prepare, its changes, Prepare; then Commit / Rollback
    // Prepared.
    assert_eq!(tags, "bYRIPKbIPr", "{msgs:#?}");
    let (
        LogicalMessage::BeginPrepare(b1),
        LogicalMessage::Prepare(p1),
        LogicalMessage::CommitPrepared(c1),
    ) = (&msgs[0], &msgs[4], &msgs[5])
    else {
        panic!("{msgs:#?}")
    };
    assert_eq!(b1.gid, "walbox-gid-1");
    assert_eq!((p1.gid.as_str(), p1.xid), ("walbox-gid-1", b1.xid));
    assert_eq!(p1.prepare_lsn, b1.prepare_lsn);
    assert_eq!((c1.gid.as_str(), c1.xid), ("walbox-gid-1", b1.xid));
    assert!(c1.commit_lsn > p1.prepare_lsn);
    let LogicalMessage::RollbackPrepared(r2) = &msgs[9] else {
        panic!("{msgs:#?}")
    };
    assert_eq!(r2.gid, "walbox-gid-2");
    assert!(r2.rollback_end_lsn > r2.prepare_end_lsn);
}
