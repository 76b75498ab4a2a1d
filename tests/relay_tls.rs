//! The relay over TLS with SCRAM passwords, `sslmode=verify-full` on both the SQL
//! and the replication connection; secrets never reach the logs.

mod common;

use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;
use walbox_testkit::{Broker, OUTBOX_DDL, PgCluster, PgOptions};

const PASSWORD: &str = "correct horse battery staple";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_over_verify_full_tls_with_scram() {
    let pg = PgCluster::start_with(PgOptions {
        tls: true,
        password: Some(PASSWORD.into()),
        ..PgOptions::default()
    })
    .unwrap();
    let broker = Broker::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let env = walbox_env(&pg, &broker);
    let dsn = &env.iter().find(|(k, _)| *k == "WALBOX_DSN").unwrap().1;
    assert!(dsn.contains("sslmode=verify-full") && dsn.contains(PASSWORD));
    setup(&env);

    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 2, 10, 5, 10).await;
    let last = current_lsn(&db).await;
    let records = read_topic(&broker.bootstrap(), "outbox.order", 100).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    assert_eq!(records.len(), 100);
    assert_per_key_order(&records, false);
    let ssl: bool = db
        .query_one(
            "SELECT bool_and(ssl) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid)
             WHERE application_name = 'walbox'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ssl, "the replication connection is encrypted");
    walbox.signal(Signal::SIGTERM);
    assert_eq!(walbox.wait(Duration::from_secs(60)).code(), Some(0));
    assert!(!walbox.log().contains(PASSWORD));

    // A CA that did not sign the server's certificate: refused, and the error
    // names the server without the password.
    let other = tempfile::tempdir().unwrap();
    let foreign = walbox_testkit::TlsFiles::generate(other.path(), "postgres").unwrap();
    let bad_dsn = dsn.replace(
        &pg.tls().unwrap().ca_cert.display().to_string(),
        &foreign.ca_cert.display().to_string(),
    );
    let mut env_bad = env.clone();
    env_bad.retain(|(k, _)| *k != "WALBOX_DSN");
    env_bad.push(("WALBOX_DSN", bad_dsn));
    let mut refused = Walbox::spawn(&["run"], &env_bad);
    let status = refused.wait(Duration::from_secs(60));
    assert_ne!(status.code(), Some(0));
    let log = refused.log();
    assert!(log.contains("connecting to postgres@127.0.0.1"), "{log}");
    assert!(
        !log.contains("resuming"),
        "a certificate problem is not retried: {log}"
    );
    assert!(!log.contains(PASSWORD), "{log}");

    // A wrong password: refused at once, not retried, and not echoed.
    let mut env_bad = env.clone();
    env_bad.retain(|(k, _)| *k != "WALBOX_DSN");
    env_bad.push(("WALBOX_DSN", dsn.replace(PASSWORD, "wrong-horse")));
    let mut refused = Walbox::spawn(&["run"], &env_bad);
    assert_eq!(refused.wait(Duration::from_secs(60)).code(), Some(1));
    let log = refused.log();
    assert!(log.contains("password authentication failed"), "{log}");
    assert!(
        !log.contains("resuming") && !log.contains("wrong-horse"),
        "{log}"
    );
}
