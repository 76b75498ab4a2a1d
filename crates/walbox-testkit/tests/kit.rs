//! The kit's own guarantees: clusters are real, isolated, controllable and cleaned
//! up; TLS and SCRAM are enforced; the broker survives what its storage promises.

use std::path::PathBuf;
use std::time::Duration;

use pgwire_replication::{ReplicationClient, ReplicationConfig, TlsConfig};
use walbox_testkit::{Broker, BrokerOptions, BrokerStorage, PgCluster, PgOptions, StopMode, kafka};

async fn count(db: &tokio_postgres::Client) -> i64 {
    db.query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0)
}

async fn show(db: &tokio_postgres::Client, name: &str) -> String {
    db.query_one(&format!("SHOW {name}"), &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_is_logical_unprivileged_and_survives_restarts_and_kills() {
    let mut pg = PgCluster::start_with(PgOptions {
        max_slot_wal_keep_size: Some("64MB".into()),
        wal_sender_timeout: Some(Duration::from_secs(7)),
        ..PgOptions::default()
    })
    .unwrap();
    let db = pg.connect("postgres").await.unwrap();
    assert_eq!(show(&db, "wal_level").await, "logical");
    assert_eq!(show(&db, "max_slot_wal_keep_size").await, "64MB");
    assert_eq!(show(&db, "wal_sender_timeout").await, "7s");
    assert_eq!(show(&db, "port").await, pg.port().to_string());

    // The server never runs as root.
    let data_dir = show(&db, "data_directory").await;
    let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&data_dir).unwrap());
    if nix::unistd::Uid::effective().is_root() {
        assert_ne!(owner, 0, "data directory owned by an unprivileged user");
    }

    db.batch_execute("CREATE TABLE t (k int); INSERT INTO t SELECT generate_series(1, 100);")
        .await
        .unwrap();
    drop(db);

    for mode in [StopMode::Fast, StopMode::Immediate, StopMode::Smart] {
        pg.restart(mode).unwrap();
        let db = pg.connect("postgres").await.unwrap();
        assert_eq!(count(&db).await, 100, "after {mode:?} restart");
    }

    // SIGKILL of every server process: committed rows survive crash recovery.
    {
        let db = pg.connect("postgres").await.unwrap();
        db.batch_execute("INSERT INTO t SELECT generate_series(101, 150)")
            .await
            .unwrap();
    }
    pg.kill9().unwrap();
    assert!(!pg.is_running());
    assert!(
        pg.connect("postgres").await.is_err(),
        "nothing listens after kill -9"
    );
    pg.start_again().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    assert_eq!(count(&db).await, 150);
}

/// Backends are not in the postmaster's process group, and one busy in a long
/// query notices the postmaster's death only when it next waits: a kill -9 that
/// left it running would make the next start fail on the shared memory it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_takes_every_backend_with_it_even_one_busy_in_a_query() {
    let mut pg = PgCluster::start().unwrap();
    let busy = pg.connect("postgres").await.unwrap();
    let pid: i32 = busy
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let query = tokio::spawn(async move {
        busy.query_one("SELECT count(*) FROM generate_series(1, 10000000000)", &[])
            .await
    });
    let db = pg.connect("postgres").await.unwrap();
    let admin = &db;
    walbox_testkit::wait_until_async(
        "the busy query to run",
        Duration::from_secs(30),
        move || async move {
            let active: i64 = admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active'",
                    &[&pid],
                )
                .await
                .unwrap()
                .get(0);
            (active == 1).then_some(())
        },
    )
    .await
    .unwrap();
    drop(db);

    pg.kill9().unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit(')')
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .next();
    assert!(
        matches!(state, None | Some("Z" | "X")),
        "backend {pid} still runs after kill -9: {stat}"
    );
    pg.start_again().unwrap();
    assert!(
        query.await.unwrap().is_err(),
        "the busy query died with its server"
    );
    let db = pg.connect("postgres").await.unwrap();
    assert_eq!(show(&db, "port").await, pg.port().to_string());
}

#[test]
fn cluster_files_are_removed_on_drop_and_on_panic() {
    let pg = PgCluster::start().unwrap();
    let dir: PathBuf = pg.socket_dir().to_path_buf();
    assert!(dir.join("data").is_dir());
    drop(pg);
    assert!(!dir.exists(), "removed on drop");

    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::panic::catch_unwind(move || {
        let pg = PgCluster::start().unwrap();
        tx.send((pg.socket_dir().to_path_buf(), pg.port())).unwrap();
        panic!("test failure while the cluster runs");
    });
    assert!(result.is_err());
    let (dir, port) = rx.recv().unwrap();
    assert!(!dir.exists(), "removed after a panic");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "server stopped"
    );
}

fn replication_config(pg: &PgCluster, password: &str, tls: TlsConfig) -> ReplicationConfig {
    ReplicationConfig::new(pg.host(), pg.user(), password, "postgres", "none", "none")
        .with_port(pg.port())
        .with_tls(tls)
}

/// Whether a gated replication connection with `cfg` gets through authentication.
async fn accepted(cfg: ReplicationConfig) -> bool {
    match ReplicationClient::connect_gated(cfg).await {
        Ok(mut c) => c.identify_system().await.is_ok(),
        Err(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_scram_are_enforced() {
    let password = "s3cret-Pässword";
    let pg = PgCluster::start_with(PgOptions {
        tls: true,
        password: Some(password.into()),
        ..PgOptions::default()
    })
    .unwrap();
    let ca = pg.tls().unwrap().ca_cert.clone();
    // The certificate names both localhost and 127.0.0.1; this client verifies
    // names, not IP addresses, so it is told which name to expect.
    let verify = || TlsConfig::verify_full(Some(ca.clone())).with_sni_hostname("localhost");

    assert!(
        accepted(replication_config(&pg, password, verify())).await,
        "verify-full against the generated CA with the right password"
    );
    assert!(
        !accepted(replication_config(&pg, "wrong", verify())).await,
        "wrong password refused"
    );
    assert!(
        !accepted(replication_config(&pg, password, TlsConfig::disabled())).await,
        "connection without TLS refused"
    );
    assert!(
        !accepted(replication_config(
            &pg,
            password,
            verify().with_sni_hostname("db.example.com")
        ))
        .await,
        "verify-full checks the host name"
    );

    // The kit's own socket access stays open.
    let db = pg.connect("postgres").await.unwrap();
    assert_eq!(show(&db, "ssl").await, "on");
    assert_eq!(show(&db, "password_encryption").await, "scram-sha-256");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_keeps_acknowledged_records_across_restart_and_kill_with_sqlite() {
    let mut broker = Broker::start_with(BrokerOptions {
        storage: BrokerStorage::Sqlite,
    })
    .unwrap();
    if broker.is_external() {
        return; // an external Kafka cannot be restarted from here
    }
    let bootstrap = broker.bootstrap();
    kafka::create_topic(&bootstrap, "durable", 2).await.unwrap();
    let produce = |bootstrap: String, from: usize, to: usize| {
        std::thread::spawn(move || {
            let producer: rdkafka::producer::BaseProducer = kafka::client_config(&bootstrap)
                .set("enable.idempotence", "true")
                .create()
                .unwrap();
            for n in from..to {
                let key = format!("k{}", n % 5);
                let value = n.to_string();
                producer
                    .send(
                        rdkafka::producer::BaseRecord::to("durable")
                            .key(&key)
                            .payload(&value),
                    )
                    .unwrap();
            }
            rdkafka::producer::Producer::flush(&producer, Duration::from_secs(30)).unwrap();
        })
        .join()
        .unwrap();
    };
    let read = |b: String| {
        std::thread::spawn(move || kafka::read_all(&b, "durable", Duration::from_secs(60)).unwrap())
            .join()
            .unwrap()
    };

    produce(bootstrap.clone(), 0, 50);
    broker.restart().unwrap();
    assert_eq!(
        read(bootstrap.clone()).len(),
        50,
        "after a graceful restart"
    );

    produce(bootstrap.clone(), 50, 80);
    broker.kill9().unwrap();
    broker.start_again().unwrap();
    let mut values: Vec<usize> = read(bootstrap)
        .iter()
        .map(|r| r.value_str().unwrap().parse().unwrap())
        .collect();
    values.sort_unstable();
    assert_eq!(values, (0..80).collect::<Vec<_>>(), "after kill -9");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_broker_reads_an_empty_topic_and_times_out_clearly() {
    let broker = Broker::start().unwrap();
    let bootstrap = broker.bootstrap();
    kafka::create_topic(&bootstrap, "empty", 1).await.unwrap();
    let b = bootstrap.clone();
    let records =
        tokio::task::spawn_blocking(move || kafka::read_all(&b, "empty", Duration::from_secs(30)))
            .await
            .unwrap()
            .unwrap();
    assert!(records.is_empty());
    let err = tokio::task::spawn_blocking(move || {
        kafka::read_at_least(&bootstrap, "empty", 1, Duration::from_millis(500))
    })
    .await
    .unwrap()
    .unwrap_err();
    assert!(err.to_string().contains("0 records read"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_streams_from_its_primary_and_is_promoted_after_a_kill() {
    let mut primary = PgCluster::start().unwrap();
    let db = primary.connect("postgres").await.unwrap();
    db.batch_execute("CREATE TABLE t (n int); INSERT INTO t SELECT generate_series(1, 10)")
        .await
        .unwrap();
    let standby = PgCluster::standby_of(&primary, PgOptions::default())
        .await
        .unwrap();
    let slot = standby.primary_slot_name().unwrap().to_owned();
    db.batch_execute("INSERT INTO t SELECT generate_series(11, 20)")
        .await
        .unwrap();
    let at: String = db
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    standby
        .wait_replayed(&at, Duration::from_secs(60))
        .await
        .unwrap();
    let active: bool = db
        .query_one(
            "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert!(active, "the standby streams through its physical slot");
    let sdb = standby.connect("postgres").await.unwrap();
    assert_eq!(count(&sdb).await, 20);
    assert!(
        sdb.batch_execute("INSERT INTO t VALUES (0)").await.is_err(),
        "a standby refuses writes"
    );

    primary.kill9().unwrap();
    standby.promote().await.unwrap();
    let sdb = standby.connect("postgres").await.unwrap();
    sdb.batch_execute("INSERT INTO t VALUES (21)")
        .await
        .unwrap();
    assert_eq!(count(&sdb).await, 21);
    let timeline: String = sdb
        .query_one("SELECT pg_walfile_name(pg_current_wal_lsn())", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        &timeline[..8],
        "00000002",
        "a new timeline after the promotion"
    );
}
