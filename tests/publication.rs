//! What reaches walbox is what the publication selects: a partitioned outbox
//! (published as its root while partitions come and go), a published table no
//! `[[outbox]]` maps, publications that leave inserts, columns or rows out, the
//! outbox table swapped for a new one while streaming, and value formats set by
//! the database (`bytea_output = escape`). Each either reaches the sink in full
//! or stops walbox with the fix before the slot passes it.
//!
//! These tests use the stdout sink: what walbox publishes is read from its
//! output, one JSON line per event.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use walbox_testkit::{OUTBOX_DDL, PgCluster};

const TOPIC: &str = "outbox.order";

/// Environment for `walbox` with the stdout sink.
fn env(pg: &PgCluster) -> Vec<(&'static str, String)> {
    vec![
        ("WALBOX_DSN", pg.conninfo("postgres")),
        ("WALBOX_SINK", "stdout".into()),
        ("WALBOX_SLOT", "walbox".into()),
        ("WALBOX_PUBLICATION", "walbox_outbox".into()),
        (
            "WALBOX_CHECKPOINT",
            checkpoint_path(pg).display().to_string(),
        ),
    ]
}

/// Inserts `n` events for each of `keys` keys (`seq` counting on from `from`),
/// one transaction per round over the keys, with `occurred_at` set to `at`
/// (a timestamptz expression) through `table`; returns their event ids.
async fn insert(
    db: &tokio_postgres::Client,
    table: &str,
    keys: usize,
    from: usize,
    n: usize,
    at: &str,
) -> Vec<String> {
    let mut ids = Vec::new();
    for seq in from..from + n {
        let mut sql = String::from("BEGIN;");
        for k in 0..keys {
            sql.push_str(&format!(
                "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, occurred_at)
                 VALUES ('order', 'order-{k}', 'OrderPlaced', '{{\"seq\": {seq}}}', {at});"
            ));
        }
        sql.push_str("COMMIT;");
        db.batch_execute(&sql).await.unwrap();
        ids.extend(
            db.query(
                &format!("SELECT id::text FROM {table} WHERE (payload->>'seq')::int = $1"),
                &[&(seq as i32)],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<_, String>(0)),
        );
    }
    ids
}

/// The events walbox wrote to `topic`, in output order.
fn events(walbox: &Walbox, topic: &str) -> Vec<serde_json::Value> {
    json_lines(&walbox.log())
        .into_iter()
        .filter(|l| l["topic"] == topic)
        .collect()
}

/// Waits until walbox has written `n` events to `topic` (failing early when it exits).
fn wait_events(walbox: &mut Walbox, topic: &str, n: usize) -> Vec<serde_json::Value> {
    walbox_testkit::wait_until(&format!("{n} events"), Duration::from_secs(90), || {
        assert!(walbox.running(), "walbox exited:\n{}", walbox.log());
        let e = events(walbox, topic);
        (e.len() >= n).then_some(e)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()))
}

/// Every id once, and per key `seq` in order from 0.
fn assert_complete_in_order(lines: &[serde_json::Value], ids: &[String]) {
    let got: Vec<&str> = lines
        .iter()
        .map(|l| l["headers"]["event_id"].as_str().unwrap())
        .collect();
    let unique: HashSet<&str> = got.iter().copied().collect();
    assert_eq!(unique.len(), got.len(), "duplicates");
    let want: HashSet<&str> = ids.iter().map(String::as_str).collect();
    assert_eq!(
        unique, want,
        "published events differ from the inserted ones"
    );
    let mut next: HashMap<String, i64> = HashMap::new();
    for l in lines {
        let key = l["key"].as_str().unwrap().to_owned();
        let seq = l["value"]["payload"]["seq"].as_i64().unwrap();
        let expected = next.entry(key.clone()).or_insert(0);
        assert_eq!(seq, *expected, "key {key} out of order");
        *expected += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_outbox_is_published_as_its_root_while_partitions_come_and_go() {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(
        "CREATE TABLE outbox (
             id uuid NOT NULL DEFAULT gen_random_uuid(),
             aggregate_type text NOT NULL,
             aggregate_id text NOT NULL,
             event_type text NOT NULL,
             payload jsonb NOT NULL,
             headers jsonb,
             occurred_at timestamptz NOT NULL DEFAULT now(),
             schema_version int,
             PRIMARY KEY (id, occurred_at)
         ) PARTITION BY RANGE (occurred_at);
         CREATE TABLE outbox_old PARTITION OF outbox
             FOR VALUES FROM ('2000-01-01') TO ('2020-01-01');
         CREATE TABLE outbox_now PARTITION OF outbox
             FOR VALUES FROM ('2020-01-01') TO ('2100-01-01');",
    )
    .await
    .unwrap();
    let env = env(&pg);
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    // Through the parent, into both partitions.
    let mut ids = insert(&db, "outbox", 10, 0, 20, "'2010-06-01'").await;
    ids.extend(insert(&db, "outbox", 10, 20, 20, "now()").await);
    wait_events(&mut walbox, TOPIC, ids.len());
    // While streaming: the old partition goes, a new one is created, another
    // is attached; rows go into the new ones (also straight into a partition).
    db.batch_execute(
        "ALTER TABLE outbox DETACH PARTITION outbox_old;
         DROP TABLE outbox_old;
         CREATE TABLE outbox_next PARTITION OF outbox
             FOR VALUES FROM ('2100-01-01') TO ('2200-01-01');
         CREATE TABLE outbox_older (LIKE outbox INCLUDING DEFAULTS);
         ALTER TABLE outbox ATTACH PARTITION outbox_older
             FOR VALUES FROM ('1990-01-01') TO ('2000-01-01');",
    )
    .await
    .unwrap();
    ids.extend(insert(&db, "outbox", 10, 40, 20, "'2150-01-01'").await);
    ids.extend(insert(&db, "outbox_older", 10, 60, 20, "'1995-01-01'").await);
    ids.extend(insert(&db, "outbox", 10, 80, 20, "now()").await);
    assert_eq!(ids.len(), 1_000);
    wait_caught_up(&db).await;
    walbox.stop();
    let lines = events(&walbox, TOPIC);
    assert_complete_in_order(&lines, &ids);
    // And doctor agrees with the publication setup made.
    let (code, out, err) = walbox_cmd(&["doctor"], &env);
    assert!(
        out.contains("ok   public.outbox is in publication walbox_outbox: its inserts"),
        "{code:?}\n{out}\n{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_into_a_published_table_no_outbox_maps_stops_walbox_naming_it() {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    db.batch_execute(
        "CREATE TABLE audit (id int PRIMARY KEY, note text);
         INSERT INTO audit VALUES (1, 'a'), (2, 'b');",
    )
    .await
    .unwrap();
    let env = env(&pg);
    setup(&env);
    // Someone adds another table to walbox's publication.
    db.batch_execute("ALTER PUBLICATION walbox_outbox ADD TABLE audit")
        .await
        .unwrap();
    let audit_oid: u32 = db
        .query_one("SELECT 'audit'::regclass::oid", &[])
        .await
        .unwrap()
        .get(0);
    let mut walbox = Walbox::spawn(&["run"], &env);
    let ids = insert(&db, "outbox", 5, 0, 10, "now()").await;
    // Updates and deletes of it are counted and named once, and the stream goes on.
    db.batch_execute("UPDATE audit SET note = 'c'; DELETE FROM audit WHERE id = 2;")
        .await
        .unwrap();
    let ids2 = insert(&db, "outbox", 5, 10, 10, "now()").await;
    wait_events(&mut walbox, TOPIC, ids.len() + ids2.len());
    wait_caught_up(&db).await;
    let before = current_lsn(&db).await;
    db.batch_execute("INSERT INTO audit VALUES (3, 'd')")
        .await
        .unwrap();
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains(&format!(
            "an insert into public.audit (oid {audit_oid}) came through publication walbox_outbox"
        )) && log.contains("ALTER PUBLICATION walbox_outbox DROP TABLE public.audit"),
        "{log}"
    );
    assert_eq!(
        log.matches("changes of a published table that no [[outbox]] maps")
            .count(),
        1,
        "{log}"
    );
    // The position stays before it, so a restart meets it again.
    assert!(confirmed_lsn(&db, "walbox").await <= before);
    assert!(checkpoint(&pg).unwrap().lsn <= before);
    let mut again = Walbox::spawn(&["run"], &env);
    assert_eq!(again.wait(Duration::from_secs(60)).code(), Some(1));
    assert!(again.log().contains("an insert into public.audit"));
    let mut all = ids;
    all.extend(ids2);
    assert_complete_in_order(&events(&walbox, TOPIC), &all);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publications_that_leave_events_out_are_refused_by_setup_doctor_and_run() {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let env = env(&pg);
    let (code, _, err) = walbox_cmd(&["slot", "create"], &env);
    assert_eq!(code, Some(0), "{err}");
    let cases = [
        (
            "CREATE PUBLICATION walbox_outbox FOR TABLE outbox
                 (id, aggregate_type, aggregate_id, event_type, payload)",
            "without headers, occurred_at, schema_version that the mapping reads",
        ),
        (
            "CREATE PUBLICATION walbox_outbox FOR TABLE outbox WITH (publish = 'update, delete')",
            "does not publish inserts (publish = 'update, delete')",
        ),
        (
            "CREATE PUBLICATION walbox_outbox FOR TABLE outbox WHERE (aggregate_type <> 'audit')",
            "has a row filter on public.outbox",
        ),
    ];
    for (create, problem) in cases {
        db.batch_execute(&format!(
            "DROP PUBLICATION IF EXISTS walbox_outbox; {create}"
        ))
        .await
        .unwrap();
        let (code, out, err) = walbox_cmd(&["setup"], &env);
        assert_eq!(code, Some(1), "setup accepted {create}:\n{out}");
        assert!(
            err.contains(problem) && err.contains("ALTER PUBLICATION"),
            "{err}"
        );
        let (code, out, _) = walbox_cmd(&["doctor"], &env);
        assert_ne!(code, Some(0), "doctor accepted {create}:\n{out}");
        assert!(out.contains(problem), "{out}");
        let mut run = Walbox::spawn(&["run"], &env);
        let status = run.wait(Duration::from_secs(60));
        let log = run.log();
        assert_eq!(status.code(), Some(1), "run accepted {create}:\n{log}");
        assert!(log.contains(problem), "{log}");
    }
    // A publication setup made, then changed: setup puts it right.
    db.batch_execute("DROP PUBLICATION walbox_outbox")
        .await
        .unwrap();
    setup(&env);
    db.batch_execute("ALTER PUBLICATION walbox_outbox SET (publish = 'delete')")
        .await
        .unwrap();
    let (code, out, err) = walbox_cmd(&["setup"], &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("publication walbox_outbox now publishes inserts"),
        "{out}"
    );
    let (code, out, _) = walbox_cmd(&["doctor"], &env);
    assert!(
        out.contains("ok   public.outbox is in publication walbox_outbox: its inserts"),
        "{code:?}\n{out}"
    );
}

/// Waits until every event of `ids` is in `earlier` (what an earlier walbox
/// wrote) or in what `walbox` wrote to the topic (failing early when it exits).
fn wait_all(walbox: &mut Walbox, earlier: &[serde_json::Value], ids: &[String]) {
    let want: HashSet<&str> = ids.iter().map(String::as_str).collect();
    walbox_testkit::wait_until("every event", Duration::from_secs(90), || {
        assert!(walbox.running(), "walbox exited:\n{}", walbox.log());
        let now = events(walbox, TOPIC);
        let got: HashSet<&str> = earlier
            .iter()
            .chain(now.iter())
            .filter_map(|l| l["headers"]["event_id"].as_str())
            .filter(|id| want.contains(id))
            .collect();
        (got.len() == want.len()).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
}

/// Every id once at least; duplicates are copies of the same event; per key,
/// the first copies carry `seq` in order from 0.
fn assert_first_copies_complete_in_order(lines: &[serde_json::Value], ids: &[String]) {
    let mut first: HashMap<&str, &serde_json::Value> = HashMap::new();
    let mut next: HashMap<String, i64> = HashMap::new();
    for l in lines {
        let id = l["headers"]["event_id"].as_str().unwrap();
        if let Some(earlier) = first.get(id) {
            assert_eq!(
                earlier["value"]["payload"], l["value"]["payload"],
                "a duplicate of {id} differs"
            );
            continue;
        }
        first.insert(id, l);
        let key = l["key"].as_str().unwrap().to_owned();
        let seq = l["value"]["payload"]["seq"].as_i64().unwrap();
        let expected = next.entry(key.clone()).or_insert(0);
        assert_eq!(seq, *expected, "key {key}: first copies out of order");
        *expected += 1;
    }
    let got: HashSet<&str> = first.keys().copied().collect();
    let want: HashSet<&str> = ids.iter().map(String::as_str).collect();
    let missing: Vec<&&str> = want.difference(&got).collect();
    assert!(
        missing.is_empty(),
        "{} events never published",
        missing.len()
    );
    assert_eq!(
        got.len(),
        want.len(),
        "published events that were never inserted"
    );
}

/// The user's whole sequence: the outbox table is swapped for a new one while
/// walbox streams and the application writes to the new one; walbox stops
/// before the slot passes the swap and names the fix; a restart refuses with it;
/// the user applies it (`walbox setup`) and writes more while walbox is down;
/// walbox starts again. The new table's rows written before the fix are in no
/// slot (pgoutput decoded them against the publication of that moment): the
/// new start takes a snapshot of the new table first, and every event of the
/// window reaches the sink, each key's first copies in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_swapped_while_streaming_is_caught_up_by_a_snapshot_after_the_advised_fix() {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let env = env(&pg);
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    let mut ids = insert(&db, "outbox", 10, 0, 10, "now()").await;
    wait_events(&mut walbox, TOPIC, ids.len());
    wait_caught_up(&db).await;
    // The swap; the WAL position read inside it, just before its commit.
    db.batch_execute(
        "BEGIN;
         ALTER TABLE outbox RENAME TO outbox_old;
         CREATE TABLE outbox (LIKE outbox_old INCLUDING ALL);",
    )
    .await
    .unwrap();
    let before_commit = current_lsn(&db).await;
    db.batch_execute("COMMIT").await.unwrap();
    // The new table's events never reach walbox.
    ids.extend(insert(&db, "outbox", 10, 10, 10, "now()").await);
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("outbox table public.outbox is not in publication walbox_outbox"),
        "{log}"
    );
    assert!(
        log.contains("rows inserted and deleted again in that window"),
        "the stop says what a snapshot cannot bring back:\n{log}"
    );
    // The swap's commit record starts at or after `before_commit`: a position
    // up to there has not passed it (transactions that end after the position
    // are streamed again).
    let confirmed = confirmed_lsn(&db, "walbox").await;
    assert!(
        confirmed <= before_commit,
        "slot at {confirmed}, the swap commits after {before_commit}"
    );
    assert!(checkpoint(&pg).unwrap().lsn <= before_commit);
    let mut published = events(&walbox, TOPIC);
    // A restart refuses, with the fix.
    let mut again = Walbox::spawn(&["run"], &env);
    assert_eq!(again.wait(Duration::from_secs(60)).code(), Some(1));
    assert!(
        again
            .log()
            .contains(r#"ALTER PUBLICATION "walbox_outbox" ADD TABLE "public"."outbox""#),
        "{}",
        again.log()
    );
    // The fix walbox names; the application goes on writing meanwhile.
    setup(&env);
    ids.extend(insert(&db, "outbox", 10, 20, 10, "now()").await);
    let mut last = Walbox::spawn(&["run"], &env);
    ids.extend(insert(&db, "outbox", 10, 30, 5, "now()").await);
    wait_all(&mut last, &published, &ids);
    let log = last.log();
    assert!(
        log.contains("outbox table has a new identity"),
        "the start names the table and the snapshot:\n{log}"
    );
    published.extend(events(&last, TOPIC));
    assert_first_copies_complete_in_order(&published, &ids);
    // Once the snapshot is acknowledged the slot moves on, and a restart
    // streams without another one.
    wait_caught_up(&db).await;
    last.stop();
    let cp = checkpoint(&pg).unwrap();
    assert!(!cp.snapshot_interrupted(), "{cp:?}");
    let mut fourth = Walbox::spawn(&["run"], &env);
    let more = insert(&db, "outbox", 10, 35, 1, "now()").await;
    let lines = wait_events(&mut fourth, TOPIC, more.len());
    assert_eq!(
        lines.len(),
        more.len(),
        "only the new events:\n{}",
        fourth.log()
    );
    assert!(!fourth.log().contains("new identity"), "{}", fourth.log());
    fourth.stop();
}

/// A publication `FOR ALL TABLES` takes a swapped-in table at once, so the
/// publication check finds no problem; it finds the table's new identity,
/// ends the session, and the next session (at once, without an operator)
/// takes the new table's snapshot before it streams past its first insert.
/// Every event reaches the sink, each key's first copies in commit order, and
/// the checkpoint then records the new table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_swapped_under_a_publication_for_all_tables_is_caught_up_without_a_stop() {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    db.batch_execute("CREATE PUBLICATION walbox_outbox FOR ALL TABLES")
        .await
        .unwrap();
    let env = env(&pg);
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    let mut ids = insert(&db, "outbox", 10, 0, 5, "now()").await;
    wait_events(&mut walbox, TOPIC, ids.len());
    db.batch_execute(
        "BEGIN;
         ALTER TABLE outbox RENAME TO outbox_old;
         CREATE TABLE outbox (LIKE outbox_old INCLUDING ALL);
         COMMIT;",
    )
    .await
    .unwrap();
    ids.extend(insert(&db, "outbox", 10, 5, 5, "now()").await);
    walbox_testkit::wait_until("the new identity found", Duration::from_secs(60), || {
        assert!(walbox.running(), "walbox exited:\n{}", walbox.log());
        walbox
            .log()
            .contains("outbox table public.outbox changed identity while streaming")
            .then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    ids.extend(insert(&db, "outbox", 10, 10, 2, "now()").await);
    wait_all(&mut walbox, &[], &ids);
    assert_first_copies_complete_in_order(&events(&walbox, TOPIC), &ids);
    let log = walbox.log();
    assert!(log.contains("outbox table has a new identity"), "{log}");
    let oid: u32 = db
        .query_one("SELECT 'public.outbox'::regclass::oid", &[])
        .await
        .unwrap()
        .get(0);
    walbox_testkit::wait_until("the new table recorded", Duration::from_secs(30), || {
        checkpoint(&pg).filter(|_| oid > 0).map(drop)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    walbox.stop();
}

/// `n` rounds of one `public.outbox_b` event for each of ten keys (`b-{k}`,
/// `seq` counting on from `from`), one transaction per round; their ids.
async fn insert_b(db: &tokio_postgres::Client, from: i64, n: i64) -> Vec<String> {
    let mut ids = Vec::new();
    for seq in from..from + n {
        let rows = db
            .query(
                "INSERT INTO outbox_b (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'order', 'b-' || k, 'OrderPlaced', jsonb_build_object('seq', $1::bigint)
                 FROM generate_series(0, 9) k RETURNING id::text",
                &[&seq],
            )
            .await
            .unwrap();
        ids.extend(rows.iter().map(|r| r.get::<_, String>(0)));
    }
    ids
}

/// A second outbox table on a busy database: its rows are written before walbox
/// relays it; the user stops walbox, adds the table to the configuration, runs
/// `walbox setup` (which adds it to the publication), the application goes on
/// writing, and walbox starts again. The slot has none of the rows written
/// before the table joined the publication: the start takes the table's
/// snapshot first, so every one of its events is published, in key order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_table_configured_on_a_busy_database_is_published_from_its_first_row() {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    db.batch_execute("CREATE TABLE outbox_b (LIKE outbox INCLUDING ALL)")
        .await
        .unwrap();
    let one = "[[outbox]]\ntable = \"public.outbox\"\n";
    let mut env = env(&pg);
    env.push(("WALBOX_CONFIG", config_file(&pg, "one.toml", one)));
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    let mut ids = insert(&db, "outbox", 10, 0, 3, "now()").await;
    // The other table is written to already.
    let mut ids_b = insert_b(&db, 0, 5).await;
    wait_events(&mut walbox, TOPIC, ids.len());
    walbox.stop();
    let mut published = events(&walbox, TOPIC);
    // The new configuration and the setup it needs; writes go on.
    env.pop();
    let both = format!("{one}[[outbox]]\ntable = \"public.outbox_b\"\n");
    env.push(("WALBOX_CONFIG", config_file(&pg, "both.toml", &both)));
    let (code, out, err) = walbox_cmd(&["setup"], &env);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("added public.outbox_b to publication"),
        "{out}"
    );
    ids_b.extend(insert_b(&db, 5, 3).await);
    let mut walbox = Walbox::spawn(&["run"], &env);
    ids_b.extend(insert_b(&db, 8, 2).await);
    ids.extend(insert(&db, "outbox", 10, 3, 2, "now()").await);
    ids.extend(ids_b);
    wait_all(&mut walbox, &published, &ids);
    assert!(
        walbox.log().contains("outbox table is new to this slot"),
        "{}",
        walbox.log()
    );
    published.extend(events(&walbox, TOPIC));
    assert_first_copies_complete_in_order(&published, &ids);
    walbox.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytea_payloads_are_published_whatever_the_databases_bytea_output() {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(
        "ALTER DATABASE postgres SET bytea_output = 'escape';
         CREATE TABLE outbox (
             id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
             aggregate_type text NOT NULL,
             aggregate_id text NOT NULL,
             event_type text NOT NULL,
             payload bytea NOT NULL,
             occurred_at timestamptz NOT NULL DEFAULT now()
         );",
    )
    .await
    .unwrap();
    let db = pg.connect("postgres").await.unwrap();
    let shown: String = db
        .query_one("SELECT current_setting('bytea_output')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(shown, "escape");
    let write = |from: i32, to: i32| {
        format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'order-' || (s % 5), 'OrderPlaced',
                    convert_to(json_build_object('seq', s / 5, 'note', 'Grüße \\ \"x\"')::text, 'UTF8')
             FROM generate_series({from}, {to}) s"
        )
    };
    // Rows before the slot come through the snapshot (the SQL connection),
    // later ones through the stream; one row does not hold JSON.
    db.batch_execute(&write(0, 49)).await.unwrap();
    let env = env(&pg);
    let (code, out, err) = walbox_cmd(&["setup", "--snapshot"], &env);
    assert_eq!(code, Some(0), "{err}");
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(&write(50, 99)).await.unwrap();
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'poison', 'OrderPlaced', 'not json')",
    )
    .await
    .unwrap();
    wait_caught_up(&db).await;
    walbox.stop();
    let mut lines = json_lines(&out);
    lines.extend(json_lines(&walbox.log()));
    let published: Vec<_> = lines.iter().filter(|l| l["topic"] == TOPIC).collect();
    assert_eq!(published.len(), 100);
    for l in &published {
        assert_eq!(l["value"]["payload"]["note"], "Grüße \\ \"x\"");
    }
    let dead: Vec<_> = lines.iter().filter(|l| l["topic"] != TOPIC).collect();
    assert_eq!(
        dead.len(),
        1,
        "only the row that does not hold JSON: {dead:?}"
    );
    assert_eq!(dead[0]["key"], "poison");
    // Its columns as text, in the pinned (hex) form.
    assert_eq!(
        dead[0]["value"]["columns"]["payload"],
        "\\x6e6f74206a736f6e"
    );
}
