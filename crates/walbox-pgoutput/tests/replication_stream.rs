//! A real PostgreSQL streams pgoutput through pgwire-replication; the walbox decoder
//! must read every column of every row exactly as the server renders it.

mod common;

use std::time::Duration;

use common::Relations;
use pgwire_replication::{ReplicationClient, ReplicationConfig, ReplicationEvent};
use walbox_pgoutput::{Decoder, LogicalMessage, Lsn, OldTupleKind, TupleValue};
use walbox_testkit::PgCluster;

/// Columns of the sample table: one of each commonly used type.
const COLUMNS: &[(&str, &str)] = &[
    ("id", "bigint PRIMARY KEY"),
    ("i2", "smallint"),
    ("i4", "integer"),
    ("f4", "real"),
    ("f8", "double precision"),
    ("num", "numeric(14,4)"),
    ("flag", "boolean"),
    ("t", "text"),
    ("vc", "varchar(40)"),
    ("ch", "char(4)"),
    ("u", "uuid"),
    ("j", "jsonb"),
    ("js", "json"),
    ("ts", "timestamptz"),
    ("tsn", "timestamp"),
    ("d", "date"),
    ("tm", "time"),
    ("iv", "interval"),
    ("raw", "bytea"),
    ("arr", "integer[]"),
    ("addr", "inet"),
    ("money_col", "numeric"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_column_of_every_row_decodes_as_the_server_renders_it() {
    let pg = PgCluster::start_with(walbox_testkit::PgOptions::default().setting("timezone", "UTC"))
        .expect("postgres starts");
    let db = pg.connect("postgres").await.expect("connect");

    let ddl: Vec<String> = COLUMNS.iter().map(|(n, t)| format!("{n} {t}")).collect();
    db.batch_execute(&format!(
        "CREATE TABLE sample ({});
         CREATE TABLE audit (k int PRIMARY KEY, note text);
         ALTER TABLE audit REPLICA IDENTITY FULL;
         CREATE PUBLICATION walbox_pub FOR TABLE sample, audit;",
        ddl.join(", ")
    ))
    .await
    .unwrap();
    db.execute(
        "SELECT pg_create_logical_replication_slot('walbox_slot', 'pgoutput')",
        &[],
    )
    .await
    .unwrap();

    // 200 ordinary rows over several transactions, one row of NULLs, one of unicode,
    // one with a 1 MB jsonb value.
    for chunk in 0..4 {
        db.execute(
            "INSERT INTO sample
             SELECT g, (g % 3000)::smallint, (g * 7)::int, g / 3.0, g * 1.5e10, g * 1.2345, g % 2 = 0,
                    'row ' || g, 'v' || g, 'c' || (g % 10),
                    md5(g::text)::uuid,
                    jsonb_build_object('n', g, 'tags', jsonb_build_array('a', g), 'nested', jsonb_build_object('ok', true)),
                    json_build_object('n', g),
                    timestamptz '2026-01-02 03:04:05.678901+00' + g * interval '1 minute',
                    timestamp '2026-01-02 03:04:05' + g * interval '1 second',
                    date '2026-01-01' + g::int, time '12:00' + g * interval '1 second',
                    g * interval '1 hour 2 minutes', decode(md5(g::text), 'hex'),
                    ARRAY[g, g + 1, NULL], ('10.0.' || (g % 255) || '.1')::inet, g * 100.01
             FROM generate_series($1::bigint * 50 + 1, $1::bigint * 50 + 50) g",
            &[&i64::from(chunk)],
        )
        .await
        .unwrap();
    }
    db.batch_execute(
        "INSERT INTO sample (id) VALUES (1000);
         INSERT INTO sample (id, t, vc, j, js) VALUES
           (1001, 'Grüße, 世界, 🎉, ''quoted'' \"double\" \\ backslash', 'ñandú',
            '{\"emoji\": \"🚀\", \"text\": \"Zürich\"}', '{\"k\": \"日本\"}');
         INSERT INTO sample (id, j)
           SELECT 1002, jsonb_build_object('blob', repeat('x', 1024 * 1024));",
    )
    .await
    .unwrap();
    // Changes after the inserts: an update that leaves the TOASTed jsonb alone, a
    // delete by key, full-row identity on another table, a truncate, two messages.
    db.batch_execute(
        "UPDATE sample SET t = 'touched' WHERE id = 1002;
         DELETE FROM sample WHERE id = 1;
         INSERT INTO audit VALUES (1, 'before');
         UPDATE audit SET note = 'after' WHERE k = 1;
         DELETE FROM audit WHERE k = 1;
         BEGIN; SELECT pg_logical_emit_message(true, 'walbox', 'in-tx'); INSERT INTO audit VALUES (2, 'x'); COMMIT;
         SELECT pg_logical_emit_message(false, 'walbox', 'outside');
         TRUNCATE audit;",
    )
    .await
    .unwrap();
    let end: String = db
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let end: Lsn = end.parse().unwrap();

    // What the server says each column holds, in its text output format (the
    // simple query protocol returns exactly that).
    let names: Vec<&str> = COLUMNS.iter().map(|(n, _)| *n).collect();
    let expected: Vec<Vec<Option<String>>> = db
        .simple_query(&format!(
            "SELECT {} FROM sample ORDER BY id",
            names.join(", ")
        ))
        .await
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => Some(
                (0..COLUMNS.len())
                    .map(|i| row.get(i).map(str::to_owned))
                    .collect(),
            ),
            _ => None,
        })
        .collect();

    // Stream the slot.
    let mut cfg = ReplicationConfig::new(
        pg.host(),
        pg.user(),
        "",
        "postgres",
        "walbox_slot",
        "walbox_pub",
    )
    .with_port(pg.port())
    .with_stop_lsn(pgwire_replication::Lsn(end.as_u64()))
    .with_status_interval(Duration::from_secs(1));
    cfg.options = Some("-c timezone=UTC".into());
    let mut repl = ReplicationClient::connect(cfg)
        .await
        .expect("replication connects");

    let mut decoder = Decoder::new();
    let mut relations = Relations::default();
    let mut inserts: Vec<Vec<TupleValue>> = Vec::new();
    let mut other: Vec<LogicalMessage> = Vec::new();
    let mut messages: Vec<(bool, String, Vec<u8>)> = Vec::new();
    let mut commits = 0;
    while let Some(event) = tokio::time::timeout(Duration::from_secs(60), repl.recv())
        .await
        .expect("stream delivers within a minute")
        .expect("stream ok")
    {
        match event {
            ReplicationEvent::XLogData { data, .. } => {
                let msg = decoder.decode(&data).expect("real pgoutput decodes");
                relations.observe(&msg);
                match msg {
                    LogicalMessage::Insert(i)
                        if relations.name(i.relation_oid) == "public.sample" =>
                    {
                        inserts.push(i.new);
                    }
                    m => other.push(m),
                }
            }
            ReplicationEvent::Message {
                transactional,
                prefix,
                content,
                ..
            } => messages.push((transactional, prefix, content.to_vec())),
            ReplicationEvent::Commit { .. } => commits += 1,
            ReplicationEvent::StoppedAt { .. } => break,
            ReplicationEvent::Begin { .. } | ReplicationEvent::KeepAlive { .. } => {}
        }
    }

    // Relation: names and types match the catalog.
    let sample_oid: u32 = db
        .query_one("SELECT 'sample'::regclass::oid", &[])
        .await
        .unwrap()
        .get(0);
    let rel = relations.get(sample_oid);
    let names: Vec<&str> = rel.columns.iter().map(|c| c.name.as_str()).collect();
    let want: Vec<&str> = COLUMNS.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, want);
    for c in &rel.columns {
        let (oid, typmod): (u32, i32) = {
            let row = db
                .query_one(
                    "SELECT atttypid, atttypmod FROM pg_attribute WHERE attrelid = 'sample'::regclass AND attname = $1",
                    &[&c.name],
                )
                .await
                .unwrap();
            (row.get(0), row.get(1))
        };
        assert_eq!(
            (c.type_oid, c.type_modifier),
            (oid, typmod),
            "column {}",
            c.name
        );
        assert_eq!(c.is_key(), c.name == "id", "key flag of {}", c.name);
    }

    // Every inserted row, every column. Row 1 was deleted later, and row 1002's
    // text changed later: compare the stream's inserts with the rows as inserted.
    assert_eq!(inserts.len(), 203);
    let mut by_id: std::collections::BTreeMap<i64, Vec<TupleValue>> = Default::default();
    for row in inserts {
        let id: i64 = row[0].as_text().unwrap().parse().unwrap();
        assert!(by_id.insert(id, row).is_none(), "row {id} inserted twice");
    }
    assert!(by_id.contains_key(&1));
    let mut checked = 0;
    for want_row in &expected {
        let id: i64 = want_row[0].as_deref().unwrap().parse().unwrap();
        let got = &by_id[&id];
        assert_eq!(got.len(), COLUMNS.len());
        for (i, (name, _)) in COLUMNS.iter().enumerate() {
            let want = if id == 1002 && *name == "t" {
                None // inserted as NULL, updated afterwards
            } else {
                want_row[i].clone()
            };
            let got_text = match &got[i] {
                TupleValue::Null => None,
                TupleValue::Text(b) => Some(String::from_utf8(b.to_vec()).unwrap()),
                other => panic!("row {id} column {name}: unexpected {other:?}"),
            };
            assert_eq!(got_text, want, "row {id} column {name}");
            checked += 1;
        }
    }
    assert_eq!(checked, 202 * COLUMNS.len());
    assert!(by_id[&1002][11].bytes().unwrap().len() > 1024 * 1024);

    // The other changes, in order.
    let audit_oid: u32 = db
        .query_one("SELECT 'audit'::regclass::oid", &[])
        .await
        .unwrap()
        .get(0);
    let mut it = other
        .into_iter()
        .filter(|m| !matches!(m, LogicalMessage::Relation(_)));
    match it.next() {
        Some(LogicalMessage::Update(u)) => {
            assert_eq!(u.relation_oid, sample_oid);
            assert!(u.old.is_none());
            assert_eq!(u.new[7].as_text(), Some("touched"));
            assert_eq!(
                u.new[11],
                TupleValue::UnchangedToast,
                "1 MB jsonb not resent"
            );
        }
        m => panic!("expected the update, got {m:?}"),
    }
    match it.next() {
        Some(LogicalMessage::Delete(d)) => {
            assert_eq!(d.relation_oid, sample_oid);
            assert_eq!(d.old.kind, OldTupleKind::Key);
            assert_eq!(d.old.tuple[0].as_text(), Some("1"));
            assert!(d.old.tuple[1..].iter().all(|v| *v == TupleValue::Null));
        }
        m => panic!("expected the delete, got {m:?}"),
    }
    assert!(matches!(it.next(), Some(LogicalMessage::Insert(i)) if i.relation_oid == audit_oid));
    match it.next() {
        Some(LogicalMessage::Update(u)) => {
            let old = u.old.expect("replica identity full sends the old row");
            assert_eq!(old.kind, OldTupleKind::Full);
            assert_eq!(old.tuple[1].as_text(), Some("before"));
            assert_eq!(u.new[1].as_text(), Some("after"));
        }
        m => panic!("expected the full-identity update, got {m:?}"),
    }
    match it.next() {
        Some(LogicalMessage::Delete(d)) => {
            assert_eq!(d.old.kind, OldTupleKind::Full);
            assert_eq!(d.old.tuple[1].as_text(), Some("after"));
        }
        m => panic!("expected the full-identity delete, got {m:?}"),
    }
    assert!(
        matches!(it.next(), Some(LogicalMessage::Insert(i)) if i.new[0].as_text() == Some("2"))
    );
    match it.next() {
        Some(LogicalMessage::Truncate(t)) => assert_eq!(t.relation_oids, vec![audit_oid]),
        m => panic!("expected the truncate, got {m:?}"),
    }
    assert_eq!(it.next(), None);
    assert_eq!(
        messages,
        vec![
            (true, "walbox".to_owned(), b"in-tx".to_vec()),
            (false, "walbox".to_owned(), b"outside".to_vec())
        ]
    );
    // Four insert chunks, the three-insert batch, the changes up to the explicit
    // COMMIT (a BEGIN inside a multi-statement query takes over the implicit
    // transaction before it), and the truncate with the non-transactional message.
    assert_eq!(commits, 7);
}
