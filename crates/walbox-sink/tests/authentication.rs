//! The Kafka sink against a broker that requires SASL authentication: SCRAM-SHA-512
//! and SCRAM-SHA-256 credentials deliver (the test broker offers no PLAIN, which
//! it refuses like wrong credentials); a wrong password or an unknown
//! user stops the sink with an authentication error that names the user and
//! never the password, within a bound, with no event delivered.

use std::time::{Duration, Instant};

use bytes::Bytes;
use walbox_outbox::{Event, Position};
use walbox_sink::{KafkaSink, KafkaSinkConfig, Sink, SinkError};
use walbox_testkit::{Broker, BrokerUser, Scram};

const ALICE_PASSWORD: &str = "alice-Pw-7c1e9";
const BOB_PASSWORD: &str = "bob-Pw-31d0a";

fn users() -> Vec<BrokerUser> {
    vec![
        BrokerUser::new("alice", ALICE_PASSWORD, Scram::Sha512),
        BrokerUser::new("bob", BOB_PASSWORD, Scram::Sha256),
    ]
}

fn properties(
    bootstrap: &str,
    mechanism: &str,
    user: &str,
    password: &str,
) -> Vec<(String, String)> {
    [
        ("bootstrap.servers", bootstrap),
        ("security.protocol", "SASL_PLAINTEXT"),
        ("sasl.mechanism", mechanism),
        ("sasl.username", user),
        ("sasl.password", password),
        ("message.timeout.ms", "20000"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

fn event(id: &str, topic: &str) -> Event {
    Event {
        event_id: id.into(),
        topic: topic.into(),
        key: Some(Bytes::from_static(b"order-1")),
        value: Bytes::from_static(br#"{"n":1}"#),
        json_value: true,
        headers: vec![("event_id".into(), Bytes::copy_from_slice(id.as_bytes()))],
        position: Position {
            commit_lsn: walbox_pgoutput::Lsn(1),
            index: 0,
            xid: 7,
        },
        origin: walbox_outbox::Origin::Stream,
    }
}

fn sink(properties: Vec<(String, String)>) -> (KafkaSink, walbox_sink::Deliveries) {
    KafkaSink::new(KafkaSinkConfig {
        properties,
        create_topics: true,
        topic_partitions: 1,
        ..KafkaSinkConfig::default()
    })
    .expect("sink created")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_512_and_scram_256_credentials_deliver() {
    let broker = Broker::start_authenticated(&users()).expect("broker starts");
    let bootstrap = broker.bootstrap();
    let cases = [
        ("SCRAM-SHA-512", "alice", ALICE_PASSWORD),
        ("SCRAM-SHA-256", "bob", BOB_PASSWORD),
    ];
    for (n, (mechanism, user, password)) in cases.into_iter().enumerate() {
        let props = properties(&bootstrap, mechanism, user, password);
        let (mut sink, mut deliveries) = sink(props.clone());
        let topic = format!("auth-{n}");
        let id = format!("evt-{mechanism}");
        sink.send(event(&id, &topic), n).await.expect("sent");
        sink.flush(Duration::from_secs(30)).await.expect("flushed");
        let d = tokio::time::timeout(Duration::from_secs(30), deliveries.recv())
            .await
            .expect("a delivery report")
            .expect("the channel is open");
        assert_eq!(d.token, n);
        d.result
            .unwrap_or_else(|e| panic!("{mechanism} as {user}: not delivered: {e}"));
        // Read back with the same credentials.
        let read = tokio::task::spawn_blocking(move || {
            let mut ids = Vec::new();
            walbox_sink::read_topic(&props, &topic, Duration::from_secs(30), |r| {
                ids.push(r.header("event_id").map(str::to_owned));
            })
            .map(|_| ids)
        })
        .await
        .unwrap()
        .expect("topic read back");
        assert_eq!(read, [Some(id)], "{mechanism}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_stop_the_sink_naming_the_user_not_the_password() {
    let broker = Broker::start_authenticated(&users()).expect("broker starts");
    let bootstrap = broker.bootstrap();
    let wrong = "wrong-Pw-55ab0";
    let cases = [
        ("SCRAM-SHA-512", "alice", wrong),
        ("SCRAM-SHA-256", "bob", wrong),
        ("SCRAM-SHA-512", "mallory", ALICE_PASSWORD),
        ("PLAIN", "alice", ALICE_PASSWORD),
    ];
    for (mechanism, user, password) in cases {
        let (mut sink, mut deliveries) = sink(properties(&bootstrap, mechanism, user, password));
        let began = Instant::now();
        let err = sink
            .send(event("evt-refused", "auth-refused"), 0)
            .await
            .expect_err("refused credentials fail the send");
        assert!(
            began.elapsed() < Duration::from_secs(25),
            "took {:?}",
            began.elapsed()
        );
        assert!(
            matches!(err, SinkError::Authentication { .. }),
            "{mechanism} as {user}: {err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("authentication failed")
                && text.contains(user)
                && text.contains(mechanism),
            "{text}"
        );
        for secret in [wrong, ALICE_PASSWORD, BOB_PASSWORD] {
            assert!(!text.contains(secret), "{text}");
            assert!(!format!("{err:?}").contains(secret), "{err:?}");
        }
        assert!(deliveries.try_recv().is_err(), "nothing was queued");
    }
}
