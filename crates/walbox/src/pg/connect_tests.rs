//! Both connections against real servers under each `sslmode`: whether the
//! session is encrypted (`pg_stat_ssl` of the connection's own backend), which
//! certificates are accepted, and client certificates.

use walbox_testkit::{PgCluster, PgOptions};

use super::ConnParams;

const SSL_OF_SELF: &str = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()";

fn dsn(pg: &PgCluster, host: &str, tail: &str) -> ConnParams {
    ConnParams::parse(&format!(
        "host={host} port={} user=postgres dbname=postgres {tail}",
        pg.port()
    ))
    .unwrap()
}

fn ca(pg: &PgCluster) -> String {
    pg.tls().unwrap().ca_cert.display().to_string()
}

/// Whether the SQL connection's session is encrypted.
async fn sql_ssl(conn: &ConnParams) -> anyhow::Result<bool> {
    let client = conn.connect().await?;
    Ok(client.query_one(SSL_OF_SELF, &[]).await?.get(0))
}

/// Whether the replication connection's session is encrypted.
async fn replication_ssl(conn: &ConnParams) -> anyhow::Result<bool> {
    let cfg = conn.replication("unused", "unused")?;
    let mut client = pgwire_replication::ReplicationClient::connect_gated(cfg).await?;
    let rows = client.simple_query(SSL_OF_SELF).await?;
    let value = rows
        .first()
        .and_then(|r| r.first().cloned().flatten())
        .ok_or_else(|| anyhow::anyhow!("no row in pg_stat_ssl"))?;
    // Dropping the gated client closes the session.
    drop(client);
    Ok(value.as_ref() == b"t")
}

/// (SQL, replication) encryption, or the errors' text.
async fn both(conn: &ConnParams) -> (Result<bool, String>, Result<bool, String>) {
    let limit = std::time::Duration::from_secs(30);
    let text = |e: anyhow::Error| format!("{e:#}");
    let sql = tokio::time::timeout(limit, sql_ssl(conn))
        .await
        .expect("the SQL connection answers in time");
    let replication = tokio::time::timeout(limit, replication_ssl(conn))
        .await
        .expect("the replication connection answers in time");
    (sql.map_err(text), replication.map_err(text))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sslmode_against_a_server_offering_tls() {
    let pg = PgCluster::start_with(PgOptions {
        tls: true,
        plaintext_too: true,
        ..PgOptions::default()
    })
    .unwrap();
    for (mode, encrypted) in [
        ("disable", false),
        ("allow", false),
        ("prefer", true),
        ("require", true),
    ] {
        let conn = dsn(&pg, "127.0.0.1", &format!("sslmode={mode}"));
        assert_eq!(both(&conn).await, (Ok(encrypted), Ok(encrypted)), "{mode}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_retries_over_tls_when_the_server_requires_it() {
    // hostssl only, hostnossl rejected.
    let pg = PgCluster::start_with(PgOptions {
        tls: true,
        ..PgOptions::default()
    })
    .unwrap();
    let conn = dsn(&pg, "127.0.0.1", "sslmode=allow");
    assert_eq!(both(&conn).await, (Ok(true), Ok(true)));
    let (sql, repl) = both(&dsn(&pg, "127.0.0.1", "sslmode=disable")).await;
    for e in [sql.unwrap_err(), repl.unwrap_err()] {
        assert!(e.contains("no encryption"), "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefer_falls_back_only_when_the_server_refuses_tls() {
    let plain = PgCluster::start().unwrap();
    let conn = dsn(&plain, "127.0.0.1", "sslmode=prefer");
    assert_eq!(both(&conn).await, (Ok(false), Ok(false)));
    let (sql, repl) = both(&dsn(&plain, "127.0.0.1", "sslmode=require")).await;
    for e in [sql.unwrap_err(), repl.unwrap_err()] {
        assert!(e.contains("does not support TLS"), "{e}");
    }

    // A server that offers TLS and accepts plaintext, but fails the handshake:
    // it checks client certificates against its own CA and gets one from
    // another. An error, never plaintext.
    let tls = PgCluster::start_with(PgOptions {
        tls: true,
        plaintext_too: true,
        ..PgOptions::default()
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let foreign = walbox_testkit::TlsFiles::generate(dir.path(), "postgres").unwrap();
    let conn = dsn(
        &tls,
        "127.0.0.1",
        &format!(
            "sslmode=prefer sslcert={} sslkey={}",
            foreign.client_cert.display(),
            foreign.client_key.display()
        ),
    );
    let (sql, repl) = both(&conn).await;
    for e in [sql.unwrap_err(), repl.unwrap_err()] {
        assert!(e.contains("received fatal alert"), "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_checks_an_ip_host_against_the_certificates_addresses() {
    let ip_only = PgCluster::start_with(PgOptions {
        tls: true,
        server_cert_names: vec!["127.0.0.1".into()],
        ..PgOptions::default()
    })
    .unwrap();
    let conn = dsn(
        &ip_only,
        "127.0.0.1",
        &format!("sslmode=verify-full sslrootcert={}", ca(&ip_only)),
    );
    assert_eq!(both(&conn).await, (Ok(true), Ok(true)));

    let name_only = PgCluster::start_with(PgOptions {
        tls: true,
        server_cert_names: vec!["localhost".into()],
        ..PgOptions::default()
    })
    .unwrap();
    let root = format!("sslrootcert={}", ca(&name_only));
    let (sql, repl) = both(&dsn(
        &name_only,
        "127.0.0.1",
        &format!("sslmode=verify-full {root}"),
    ))
    .await;
    for e in [sql.unwrap_err(), repl.unwrap_err()] {
        assert!(e.contains("not valid for name"), "{e}");
    }
    // The same certificate passes verify-ca (the chain is trusted) and
    // verify-full under the name it was issued for.
    let conn = dsn(
        &name_only,
        "127.0.0.1",
        &format!("sslmode=verify-ca {root}"),
    );
    assert_eq!(both(&conn).await, (Ok(true), Ok(true)));
    let conn = dsn(
        &name_only,
        "localhost",
        &format!("sslmode=verify-full {root}"),
    );
    assert_eq!(both(&conn).await, (Ok(true), Ok(true)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_on_both_connections() {
    let pg = PgCluster::start_with(PgOptions {
        tls: true,
        client_cert: true,
        ..PgOptions::default()
    })
    .unwrap();
    let files = pg.tls().unwrap().clone();
    let root = format!("sslmode=verify-full sslrootcert={}", ca(&pg));
    let with_cert = dsn(
        &pg,
        "127.0.0.1",
        &format!(
            "{root} sslcert={} sslkey={}",
            files.client_cert.display(),
            files.client_key.display()
        ),
    );
    assert_eq!(both(&with_cert).await, (Ok(true), Ok(true)));
    let (sql, repl) = both(&dsn(&pg, "127.0.0.1", &root)).await;
    for e in [sql.unwrap_err(), repl.unwrap_err()] {
        assert!(e.contains("certificate"), "{e}");
    }
    // libpq's default files, ~/.postgresql/postgresql.{crt,key}.
    let home = tempfile::tempdir().unwrap();
    let dir = home.path().join(".postgresql");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(&files.client_cert, dir.join("postgresql.crt")).unwrap();
    std::fs::copy(&files.client_key, dir.join("postgresql.key")).unwrap();
    let env = super::Env::empty().with("HOME", home.path().display().to_string());
    let conn = ConnParams::parse_with(
        &format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres {root}",
            pg.port()
        ),
        &env,
    )
    .unwrap();
    assert_eq!(both(&conn).await, (Ok(true), Ok(true)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_with_a_ca_at_hand_checks_the_chain_as_verify_ca() {
    // The server's certificate is issued for "localhost" by its own CA; another
    // CA is at hand.
    let pg = PgCluster::start_with(PgOptions {
        tls: true,
        plaintext_too: true,
        server_cert_names: vec!["localhost".into()],
        ..PgOptions::default()
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let other = walbox_testkit::TlsFiles::generate(dir.path(), "postgres").unwrap();
    let other_ca = other.ca_cert.display().to_string();
    for mode in ["require", "prefer"] {
        let conn = dsn(
            &pg,
            "127.0.0.1",
            &format!("sslmode={mode} sslrootcert={other_ca}"),
        );
        let (sql, repl) = both(&conn).await;
        for e in [sql.unwrap_err(), repl.unwrap_err()] {
            assert!(e.contains("invalid peer certificate"), "{mode}: {e}");
        }
        // The server's own CA: accepted, and the name (an address the
        // certificate does not hold) is not checked.
        let conn = dsn(
            &pg,
            "127.0.0.1",
            &format!("sslmode={mode} sslrootcert={}", ca(&pg)),
        );
        assert_eq!(both(&conn).await, (Ok(true), Ok(true)), "{mode}");
    }

    // libpq's default file, ~/.postgresql/root.crt, counts as given.
    let home = tempfile::tempdir().unwrap();
    std::fs::create_dir(home.path().join(".postgresql")).unwrap();
    let root = home.path().join(".postgresql/root.crt");
    let env = super::Env::empty().with("HOME", home.path().display().to_string());
    let with_home = || {
        ConnParams::parse_with(
            &format!(
                "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=require",
                pg.port()
            ),
            &env,
        )
        .unwrap()
    };
    std::fs::copy(&other.ca_cert, &root).unwrap();
    let (sql, repl) = both(&with_home()).await;
    for e in [sql.unwrap_err(), repl.unwrap_err()] {
        assert!(e.contains("invalid peer certificate"), "{e}");
    }
    std::fs::copy(&pg.tls().unwrap().ca_cert, &root).unwrap();
    assert_eq!(both(&with_home()).await, (Ok(true), Ok(true)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replication_connection_falls_back_under_prefer_only_on_n() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // A listener that answers the SSLRequest with `answer`, then closes.
    for (answer, plain) in [(b'N', true), (b'E', false), (0u8, false)] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 8];
            s.read_exact(&mut request).await.unwrap();
            s.write_all(&[answer]).await.unwrap();
            // What follows in plaintext: the startup message's length.
            let mut next = [0u8; 4];
            s.read_exact(&mut next).await.is_ok()
        });
        let conn = ConnParams::parse(&format!(
            "host=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=prefer"
        ))
        .unwrap();
        let cfg = conn.replication("unused", "unused").unwrap();
        let session = async {
            let mut client = pgwire_replication::ReplicationClient::connect_gated(cfg).await?;
            client.simple_query("SELECT 1").await?;
            anyhow::Ok(())
        };
        let err = tokio::time::timeout(std::time::Duration::from_secs(30), session)
            .await
            .expect("the replication connection answers in time")
            .expect_err("the listener is no server");
        let err = format!("{err:#}");
        let went_on_in_plaintext = server.await.unwrap();
        assert_eq!(went_on_in_plaintext, plain, "answer {answer:#04x}: {err}");
        if !plain {
            assert!(err.to_string().contains("neither 'S' nor 'N'"), "{err}");
        }
    }
}
