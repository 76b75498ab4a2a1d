//! `walbox doctor` and `walbox slot create | status | list` against a real server.

use std::process::{Command, Output};

use walbox_testkit::{OUTBOX_DDL, PgCluster, PgOptions};

fn walbox(args: &[&str], dsn: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_walbox"))
        .args(args)
        .env("WALBOX_DSN", dsn)
        .env("WALBOX_LOG", "warn")
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_says_what_to_fix() {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let dsn = pg.conninfo("postgres");

    // Before setup: no publication.
    let out = walbox(&["doctor"], &dsn);
    let text = stdout(&out);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("ok   wal_level = logical"), "{text}");
    assert!(
        text.contains("FAIL publication walbox_outbox does not exist: run `walbox setup`"),
        "{text}"
    );
    assert!(text.contains("warn max_slot_wal_keep_size = -1"), "{text}");
    assert!(
        text.contains("ok   public.outbox columns fit the mapping"),
        "{text}"
    );

    // After setup: everything passes (the warning stays).
    assert!(walbox(&["setup"], &dsn).status.success());
    let out = walbox(&["doctor"], &dsn);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("ok   slot walbox exists"), "{text}");
    assert!(
        text.contains("ok   public.outbox is in publication walbox_outbox"),
        "{text}"
    );

    // A role without REPLICATION or SELECT, and a column the mapping cannot find.
    db.batch_execute(
        "CREATE ROLE app LOGIN;
         ALTER TABLE outbox RENAME COLUMN payload TO body;",
    )
    .await
    .unwrap();
    let app_dsn = format!(
        "host={} port={} user=app dbname=postgres",
        pg.host(),
        pg.port()
    );
    let out = walbox(&["doctor"], &app_dsn);
    let text = stdout(&out);
    assert!(!out.status.success());
    assert!(
        text.contains("FAIL role app lacks REPLICATION: ALTER ROLE app REPLICATION"),
        "{text}"
    );
    assert!(
        text.contains(
            "FAIL app cannot SELECT from public.outbox: GRANT SELECT ON public.outbox TO app"
        ),
        "{text}"
    );
    assert!(
        text.contains("no column \"payload\" for the payload"),
        "{text}"
    );

    // With a limit on retained WAL, no warning.
    let limited = PgCluster::start_with(PgOptions {
        max_slot_wal_keep_size: Some("1GB".into()),
        ..PgOptions::default()
    })
    .unwrap();
    let l = limited.connect("postgres").await.unwrap();
    l.batch_execute(OUTBOX_DDL).await.unwrap();
    let ldsn = limited.conninfo("postgres");
    assert!(walbox(&["setup"], &ldsn).status.success());
    let text = stdout(&walbox(&["doctor"], &ldsn));
    assert!(text.contains("ok   max_slot_wal_keep_size = 1GB"), "{text}");
    // The only warning about the server left is the superuser the test
    // connects as (no destination is configured: doctor says it did not
    // check one).
    assert!(
        text.contains(
            "warn sink.kafka \"bootstrap.servers\" is not set, so the destination was not checked"
        ),
        "{text}"
    );
    let warnings: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("warn") && !l.contains("the destination was not checked"))
        .collect();
    assert!(
        warnings.len() == 1 && warnings[0].contains("is a superuser"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_create_status_and_list() {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let dsn = pg.conninfo("postgres");

    let out = walbox(&["slot", "status"], &dsn);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));

    assert!(walbox(&["setup"], &dsn).status.success());
    let again = walbox(&["slot", "create"], &dsn);
    assert!(again.status.success());
    assert!(stdout(&again).contains("slot walbox exists"));
    assert!(
        walbox(&["slot", "create", "--slot", "second"], &dsn)
            .status
            .success()
    );

    // Some WAL after the slot's position.
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'o' || g, 'E', '{}' FROM generate_series(1, 1000) g",
    )
    .await
    .unwrap();

    let out = walbox(&["slot", "status", "--json"], &dsn);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let s = &status[0];
    assert_eq!(s["slot"], "walbox");
    assert_eq!(s["plugin"], "pgoutput");
    assert_eq!(s["database"], "postgres");
    assert_eq!(s["active_pid"], serde_json::Value::Null);
    assert_eq!(s["wal_status"], "reserved");
    assert!(s["retained_wal_bytes"].as_i64().unwrap() > 0);
    assert!(s["lag_bytes"].as_i64().unwrap() > 0);
    assert!(s["confirmed_flush_lsn"].as_str().unwrap().contains('/'));
    assert_eq!(
        s["publication_tables"],
        serde_json::json!(["public.outbox"])
    );

    let text = stdout(&walbox(&["slot", "status"], &dsn));
    assert!(text.contains("WAL retained"), "{text}");

    let out = walbox(&["slot", "list", "--json"], &dsn);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["slot"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["second", "walbox"]);
}

/// `walbox --help` names every destination walbox publishes to, and what
/// `setup` leaves to `run` with the initial snapshot mode.
#[test]
fn help_names_the_destinations_and_what_setup_leaves_to_run() {
    let out = walbox(&["--help"], "host=unused");
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    for destination in [
        "Kafka",
        "NATS JetStream",
        "RabbitMQ",
        "Redis Streams",
        "HTTP webhooks",
        "standard output",
    ] {
        assert!(text.contains(destination), "{text}");
    }
    let out = walbox(&["--help"], "host=unused");
    assert!(
        stdout(&out).contains("publishes the rows already in the"),
        "{}",
        stdout(&out)
    );
}
