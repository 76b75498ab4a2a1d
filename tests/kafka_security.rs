//! Kafka security end to end: walbox relays through a broker that requires
//! SASL/SCRAM, and stops on refused credentials with an error naming the user
//! and no secret, without moving the slot and without a dead letter. TLS to the
//! broker (SASL_SSL) runs against a real Kafka named by `WALBOX_TEST_KAFKA`: the
//! test broker, tansu 0.6.0, accepts `--cert`/`--key` but serves plaintext.

mod common;

use std::time::Duration;

use common::*;
use walbox_testkit::{Broker, BrokerUser, OUTBOX_DDL, PgCluster, Scram};

const PASSWORD: &str = "kafka-Pw-6d2f0a";
const WRONG: &str = "kafka-Wrong-93be1";

/// A cluster with the outbox table, a broker requiring SASL/SCRAM-SHA-512 of
/// user `walbox`, and walbox's environment and configuration file, whose
/// `[sink.kafka]` holds `password`.
async fn start(
    password: &str,
) -> (
    PgCluster,
    Broker,
    tokio_postgres::Client,
    Vec<(&'static str, String)>,
) {
    let pg = PgCluster::start().unwrap();
    let broker =
        Broker::start_authenticated(&[BrokerUser::new("walbox", PASSWORD, Scram::Sha512)]).unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let mut env = walbox_env(&pg, &broker);
    let file = config_file(
        &pg,
        "kafka.toml",
        &format!(
            r#"
            [sink.kafka]
            "security.protocol" = "SASL_PLAINTEXT"
            "sasl.mechanism" = "SCRAM-SHA-512"
            "sasl.username" = "walbox"
            "sasl.password" = "{password}"
            "message.timeout.ms" = 20000
            "#
        ),
    );
    env.push(("WALBOX_CONFIG", file));
    env.push(("WALBOX_LOG", "debug".into()));
    (pg, broker, db, env)
}

fn sasl(broker: &Broker) -> Vec<(String, String)> {
    let mut props = BrokerUser::new("walbox", PASSWORD, Scram::Sha512).client_properties();
    props.push(("bootstrap.servers".into(), broker.bootstrap()));
    props
}

const INSERT: &str = "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
     SELECT 'order', 'k' || n % 3, 'Created', jsonb_build_object('n', n)
     FROM generate_series(1, 20) n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walbox_relays_through_a_broker_requiring_sasl_scram() {
    let (_pg, broker, db, env) = start(PASSWORD).await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(INSERT).await.unwrap();
    let target = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", target, Duration::from_secs(60)).await;
    let props = sasl(&broker);
    let ids = tokio::task::spawn_blocking(move || {
        let mut ids = std::collections::HashSet::new();
        walbox_sink::read_topic(&props, "outbox.order", Duration::from_secs(30), |r| {
            ids.insert(r.header("event_id").unwrap_or_default().to_owned());
        })
        .map(|_| ids)
    })
    .await
    .unwrap()
    .expect("topic read with the same credentials");
    assert_eq!(ids, outbox_ids(&db).await);
    walbox.stop();
    assert!(!walbox.log().contains(PASSWORD));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_kafka_password_stops_walbox_naming_the_user_and_no_secret() {
    let (_pg, broker, db, env) = start(WRONG).await;
    setup(&env);
    let before = confirmed_lsn(&db, "walbox").await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(INSERT).await.unwrap();
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_ne!(code(status), Some(0), "{log}");
    assert!(
        log.contains("authentication failed for user \"walbox\""),
        "{log}"
    );
    assert!(!log.contains(WRONG) && !log.contains(PASSWORD), "{log}");
    assert!(!log.contains("dead-lettered"), "{log}");
    assert!(!log.contains("session ended; resuming"), "retried: {log}");
    assert_eq!(confirmed_lsn(&db, "walbox").await, before, "the slot moved");
    // No topic was made: neither the events' nor a dead-letter topic.
    let props = sasl(&broker);
    let topics = tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let mut c = rdkafka::ClientConfig::new();
        for (k, v) in &props {
            c.set(k, v);
        }
        let consumer: BaseConsumer = c.create().unwrap();
        let md = consumer
            .fetch_metadata(None, Duration::from_secs(30))
            .unwrap();
        md.topics()
            .iter()
            .map(|t| t.name().to_owned())
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    assert!(
        !topics.iter().any(|t| t.starts_with("outbox.")),
        "{topics:?}"
    );
}

/// SASL_SSL against a real Kafka: `WALBOX_TEST_KAFKA` is the bootstrap address
/// of its TLS listener and `WALBOX_TEST_KAFKA_PROPERTIES` the client properties
/// for it, `;`-separated (`security.protocol=SASL_SSL;ssl.ca.location=...;
/// sasl.mechanism=SCRAM-SHA-512;sasl.username=...;sasl.password=...`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::print_stderr)] // the reason a skipped test did not run
async fn walbox_relays_over_sasl_ssl_to_a_real_kafka() {
    let Some(bootstrap) = std::env::var("WALBOX_TEST_KAFKA")
        .ok()
        .filter(|b| !b.is_empty())
    else {
        eprintln!(
            "skipped: WALBOX_TEST_KAFKA is not set; the test broker (tansu 0.6.0) cannot \
             listen on TLS, so SASL_SSL needs a real Kafka"
        );
        return;
    };
    let Some(properties) = std::env::var("WALBOX_TEST_KAFKA_PROPERTIES")
        .ok()
        .filter(|p| p.to_ascii_lowercase().contains("ssl"))
    else {
        eprintln!(
            "skipped: WALBOX_TEST_KAFKA_PROPERTIES names no SSL settings for the Kafka at \
             {bootstrap}"
        );
        return;
    };
    let props: Vec<(String, String)> = properties
        .split(';')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let broker = Broker::start().unwrap();
    let mut env = walbox_env(&pg, &broker);
    let toml: String = props
        .iter()
        .map(|(k, v)| format!("{k:?} = {v:?}\n"))
        .collect();
    env.push((
        "WALBOX_CONFIG",
        config_file(&pg, "kafka.toml", &format!("[sink.kafka]\n{toml}")),
    ));
    let topic = format!("outbox.sslorder{}", std::process::id());
    env.push(("WALBOX_TOPIC", topic.clone()));
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(INSERT).await.unwrap();
    let target = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", target, Duration::from_secs(120)).await;
    walbox.stop();
    let mut all = props.clone();
    all.push(("bootstrap.servers".into(), bootstrap));
    let read = tokio::task::spawn_blocking(move || {
        walbox_sink::read_topic(&all, &topic, Duration::from_secs(60), |_| {})
    })
    .await
    .unwrap()
    .expect("topic read over SASL_SSL");
    assert!(read >= 20, "{read} records");
    for (k, v) in &props {
        if walbox_sink::is_secret_property(k) {
            assert!(!walbox.log().contains(v.as_str()));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_with_a_wrong_password_says_the_broker_refused_it_not_that_it_timed_out() {
    let broker =
        Broker::start_authenticated(&[BrokerUser::new("walbox", PASSWORD, Scram::Sha512)]).unwrap();
    let mut props = BrokerUser::new("walbox", WRONG, Scram::Sha512).client_properties();
    props.push(("bootstrap.servers".into(), broker.bootstrap()));
    // Long enough that a timeout is not what ends the read.
    let err = tokio::task::spawn_blocking(move || {
        walbox_sink::read_topic(&props, "outbox.order", Duration::from_secs(120), |_| {})
    })
    .await
    .unwrap()
    .expect_err("refused credentials");
    let text = err.to_string();
    assert!(
        matches!(err, walbox_sink::SinkError::Authentication { .. }),
        "{text}"
    );
    assert!(text.contains("\"walbox\""), "{text}");
    assert!(!text.contains(WRONG) && !text.contains(PASSWORD), "{text}");
}
