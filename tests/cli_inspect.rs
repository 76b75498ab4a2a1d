//! `walbox inspect` summarises what a slot holds without consuming it, and never
//! prints row values.

use std::process::Command;

use walbox_testkit::PgCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_counts_pending_changes_without_consuming_them() {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(
        "CREATE TABLE outbox (id uuid PRIMARY KEY, payload jsonb);
         CREATE TABLE other (k int PRIMARY KEY);
         CREATE PUBLICATION walbox FOR TABLE outbox;",
    )
    .await
    .unwrap();
    db.batch_execute("SELECT pg_create_logical_replication_slot('walbox', 'pgoutput')")
        .await
        .unwrap();
    for _ in 0..3 {
        db.batch_execute(
            "INSERT INTO outbox SELECT gen_random_uuid(), '{\"secret\": \"do-not-print\"}' FROM generate_series(1, 4);
             INSERT INTO other SELECT coalesce(max(k), 0) + 1 FROM other;",
        )
        .await
        .unwrap();
    }
    db.batch_execute(
        "UPDATE outbox SET payload = '{}' WHERE id = (SELECT id FROM outbox LIMIT 1);
         DELETE FROM outbox WHERE id = (SELECT id FROM outbox LIMIT 1);
         SELECT pg_logical_emit_message(true, 'walbox', 'm');",
    )
    .await
    .unwrap();

    let run = || {
        Command::new(env!("CARGO_BIN_EXE_walbox"))
            .args([
                "inspect",
                "--slot",
                "walbox",
                "--publication",
                "walbox",
                "--json",
            ])
            .env("WALBOX_DSN", pg.conninfo("postgres"))
            .output()
            .unwrap()
    };
    let out = run();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(!stdout.contains("do-not-print"), "values are never printed");
    let summary: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(summary["transactions"], 4);
    assert_eq!(summary["logical_messages"], 1);
    assert_eq!(
        summary["tables"]["public.outbox"],
        serde_json::json!({"inserts": 12, "updates": 1, "deletes": 1, "truncates": 0})
    );
    assert!(
        summary["tables"].get("public.other").is_none(),
        "not in the publication"
    );
    let end: String = db
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let last: walbox_pgoutput::Lsn = summary["last_commit_end_lsn"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(last <= end.parse().unwrap());

    // Peeking consumed nothing: a second look sees the same.
    let again: serde_json::Value = serde_json::from_slice(&run().stdout).unwrap();
    assert_eq!(again, summary);

    // A wrong slot is a clear error naming it.
    let out = Command::new(env!("CARGO_BIN_EXE_walbox"))
        .args(["inspect", "--slot", "nope", "--publication", "walbox"])
        .env("WALBOX_DSN", pg.conninfo("postgres"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("reading slot nope"), "{err}");
}
