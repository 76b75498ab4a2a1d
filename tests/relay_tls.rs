//! The relay over TLS: SCRAM passwords and `sslmode=verify-full` against an IP
//! address on both the SQL and the replication connection, the walsender
//! encrypted under `prefer` and `require` and not under `disable`, `prefer`'s
//! fallback, client certificates and `sslrootcert=system`; secrets never reach
//! the logs.

mod common;

use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;
use walbox_testkit::{Broker, BrokerOptions, OUTBOX_DDL, PgCluster, PgOptions};

const PASSWORD: &str = "correct horse battery staple";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_over_verify_full_tls_with_scram() {
    // A certificate for the address only: verify-full checks 127.0.0.1 against
    // its IP addresses.
    let pg = PgCluster::start_with(PgOptions {
        tls: true,
        password: Some(PASSWORD.into()),
        server_cert_names: vec!["127.0.0.1".into()],
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

/// The test environment with `dsn` as the connection string, and `extra`.
fn env_with(
    pg: &PgCluster,
    broker: &Broker,
    dsn: String,
    extra: &[(&'static str, String)],
) -> Vec<(&'static str, String)> {
    let mut env = walbox_env(pg, broker);
    env.retain(|(k, _)| *k != "WALBOX_DSN");
    env.push(("WALBOX_DSN", dsn));
    env.extend_from_slice(extra);
    env
}

fn tcp_dsn(pg: &PgCluster, host: &str, tail: &str) -> String {
    format!(
        "host={host} port={} user=postgres dbname=postgres {tail}",
        pg.port()
    )
}

/// Whether the walsender serving walbox runs over TLS (`pg_stat_ssl` of the
/// backend `pg_stat_replication` names), once it is there.
async fn walsender_ssl(db: &tokio_postgres::Client) -> bool {
    walbox_testkit::wait_until_async("walbox's walsender", Duration::from_secs(60), || async {
        db.query_opt(
            "SELECT s.ssl FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid)
             WHERE r.application_name = 'walbox'",
            &[],
        )
        .await
        .unwrap()
        .map(|row| row.get::<_, bool>(0))
    })
    .await
    .unwrap()
}

/// `walbox run` with `env` until `total` records are on the topic; returns
/// whether its walsender was encrypted, after a clean stop.
async fn stream(
    pg: &PgCluster,
    broker: &Broker,
    db: &tokio_postgres::Client,
    env: &[(&'static str, String)],
    total: usize,
) -> bool {
    let mut walbox = Walbox::spawn(&["run"], env);
    write_events(pg, 1, 2, 5, 5).await;
    let records = read_topic(&broker.bootstrap(), "outbox.order", total).await;
    assert_eq!(records.len(), total, "{}", walbox.log());
    let ssl = walsender_ssl(db).await;
    walbox.signal(Signal::SIGTERM);
    assert_eq!(walbox.wait(Duration::from_secs(60)).code(), Some(0));
    walbox_testkit::wait_until_async("the walsender to end", Duration::from_secs(60), || async {
        db.query_opt(
            "SELECT 1 FROM pg_stat_replication WHERE application_name = 'walbox'",
            &[],
        )
        .await
        .unwrap()
        .is_none()
        .then_some(())
    })
    .await
    .unwrap();
    ssl
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walsender_encrypted_under_prefer_and_require_not_under_disable() {
    let (pg, broker, db) = servers_with(
        PgOptions {
            tls: true,
            plaintext_too: true,
            ..PgOptions::default()
        },
        BrokerOptions::default(),
    )
    .await;
    let env = env_with(&pg, &broker, tcp_dsn(&pg, "127.0.0.1", ""), &[]);
    setup(&env);
    // No sslmode: libpq's default, prefer.
    assert!(
        stream(&pg, &broker, &db, &env, 10).await,
        "default (prefer)"
    );
    for (i, (mode, encrypted)) in [("require", true), ("disable", false)]
        .into_iter()
        .enumerate()
    {
        let dsn = tcp_dsn(&pg, "127.0.0.1", &format!("sslmode={mode}"));
        let env = env_with(&pg, &broker, dsn, &[]);
        assert_eq!(
            stream(&pg, &broker, &db, &env, 20 + 10 * i).await,
            encrypted,
            "{mode}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefer_streams_in_plaintext_from_a_server_without_tls() {
    let (pg, broker, db) = servers().await;
    let env = env_with(
        &pg,
        &broker,
        tcp_dsn(&pg, "127.0.0.1", "sslmode=prefer"),
        &[],
    );
    setup(&env);
    assert!(!stream(&pg, &broker, &db, &env, 10).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_refuses_a_certificate_for_another_name_and_trusts_the_system_store() {
    let (pg, broker, db) = servers_with(
        PgOptions {
            tls: true,
            server_cert_names: vec!["localhost".into()],
            ..PgOptions::default()
        },
        BrokerOptions::default(),
    )
    .await;
    let ca = pg.tls().unwrap().ca_cert.display().to_string();
    let wrong = tcp_dsn(
        &pg,
        "127.0.0.1",
        &format!("sslmode=verify-full sslrootcert={ca}"),
    );
    let env = env_with(&pg, &broker, wrong, &[]);
    let (code, _, err) = walbox_cmd(&["setup"], &env);
    assert_ne!(code, Some(0));
    assert!(err.contains("not valid for name"), "{err}");
    let mut refused = Walbox::spawn(&["run"], &env);
    assert_ne!(refused.wait(Duration::from_secs(60)).code(), Some(0));
    let log = refused.log();
    assert!(log.contains("not valid for name"), "{log}");
    assert!(!log.contains("resuming"), "not retried: {log}");

    // sslrootcert=system without sslmode: verify-full against the system's
    // trust store, here the test CA through SSL_CERT_FILE; the name the
    // certificate was issued for passes.
    let system = tcp_dsn(&pg, "localhost", "sslrootcert=system");
    let env = env_with(&pg, &broker, system, &[("SSL_CERT_FILE", ca)]);
    setup(&env);
    assert!(stream(&pg, &broker, &db, &env, 10).await);
    // And a weaker sslmode with it is refused before connecting.
    let weak = tcp_dsn(&pg, "localhost", "sslmode=require sslrootcert=system");
    let (code, _, err) = walbox_cmd(&["setup"], &env_with(&pg, &broker, weak, &[]));
    assert_ne!(code, Some(0));
    assert!(
        err.contains("may not be used with sslrootcert=system"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificate_required_by_the_server() {
    let (pg, broker, db) = servers_with(
        PgOptions {
            tls: true,
            client_cert: true,
            ..PgOptions::default()
        },
        BrokerOptions::default(),
    )
    .await;
    let files = pg.tls().unwrap().clone();
    let verify = format!(
        "sslmode=verify-full sslrootcert={}",
        files.ca_cert.display()
    );
    let with_cert = format!(
        "{verify} sslcert={} sslkey={}",
        files.client_cert.display(),
        files.client_key.display()
    );
    let env = env_with(&pg, &broker, tcp_dsn(&pg, "127.0.0.1", &with_cert), &[]);
    setup(&env);
    // Events streamed: the SQL connection (checks, publication) and the
    // replication connection both presented the certificate.
    assert!(stream(&pg, &broker, &db, &env, 10).await);

    let env = env_with(&pg, &broker, tcp_dsn(&pg, "127.0.0.1", &verify), &[]);
    let mut refused = Walbox::spawn(&["run"], &env);
    assert_ne!(refused.wait(Duration::from_secs(60)).code(), Some(0));
    let log = refused.log();
    assert!(log.contains("certificate"), "{log}");
    assert!(!log.contains("resuming"), "not retried: {log}");
}
