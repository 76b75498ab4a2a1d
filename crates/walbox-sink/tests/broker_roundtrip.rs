//! The test broker speaks enough Kafka for walbox: an idempotent producer's records
//! come back with key, headers and value intact, each key on one partition in order.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use walbox_testkit::{Broker, kafka};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_producer_round_trip() {
    let broker = Broker::start().expect("broker starts");
    let bootstrap = broker.bootstrap();
    let topic = format!("roundtrip-{}", std::process::id());
    kafka::create_topic(&bootstrap, &topic, 3)
        .await
        .expect("topic created");

    let producer: FutureProducer = kafka::client_config(&bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .create()
        .expect("producer");

    const RECORDS: usize = 1_000;
    const KEYS: usize = 37;
    let mut deliveries = Vec::with_capacity(RECORDS);
    for n in 0..RECORDS {
        let key = format!("order-{}", n % KEYS);
        let value = format!(r#"{{"seq":{n},"text":"Grüße 🎉"}}"#);
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "event_id",
                value: Some(format!("evt-{n}").as_bytes()),
            })
            .insert(Header {
                key: "empty",
                value: None::<&[u8]>,
            });
        let record = FutureRecord::to(&topic)
            .key(&key)
            .payload(&value)
            .headers(headers);
        deliveries.push(producer.send_result(record).expect("queued"));
    }
    let mut partition_of_key: HashMap<String, i32> = HashMap::new();
    for (n, d) in deliveries.into_iter().enumerate() {
        let delivery = d.await.expect("not cancelled").expect("acknowledged");
        let key = format!("order-{}", n % KEYS);
        let p = *partition_of_key
            .entry(key.clone())
            .or_insert(delivery.partition);
        assert_eq!(p, delivery.partition, "{key} moved partitions");
    }
    producer.flush(Duration::from_secs(10)).expect("flushed");

    let records = tokio::task::spawn_blocking({
        let (b, t) = (bootstrap.clone(), topic.clone());
        move || kafka::read_all(&b, &t, Duration::from_secs(60))
    })
    .await
    .unwrap()
    .expect("topic read");

    assert_eq!(records.len(), RECORDS, "every record once");
    let mut last_seq_of_key: HashMap<String, (i64, usize)> = HashMap::new();
    let mut sorted = records.clone();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    for r in &sorted {
        let key = r.key_str().expect("key").to_owned();
        let value: serde_json::Value = serde_json::from_str(r.value_str().unwrap()).unwrap();
        let seq = value["seq"].as_u64().unwrap() as usize;
        assert_eq!(value["text"], "Grüße 🎉");
        assert_eq!(key, format!("order-{}", seq % KEYS));
        assert_eq!(r.header("event_id"), Some(format!("evt-{seq}").as_str()));
        assert_eq!(r.headers.len(), 2);
        assert_eq!(r.headers[1], ("empty".to_owned(), None));
        assert_eq!(r.partition, partition_of_key[&key]);
        if let Some((offset, prev)) = last_seq_of_key.insert(key.clone(), (r.offset, seq)) {
            assert!(r.offset > offset && seq > prev, "{key}: order kept");
        }
    }
    let mut seqs: Vec<usize> = records
        .iter()
        .map(|r| {
            serde_json::from_str::<serde_json::Value>(r.value_str().unwrap()).unwrap()["seq"]
                .as_u64()
                .unwrap() as usize
        })
        .collect();
    seqs.sort_unstable();
    assert_eq!(seqs, (0..RECORDS).collect::<Vec<_>>());
}

/// After the first failed delivery the relay aborts the sink: events still queued
/// must never reach the broker, or a partition could hold a later event of a key
/// before an earlier one that failed (and is sent again by the next session).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_sink_writes_nothing_it_still_held() {
    use walbox_outbox::{Event, Position};
    use walbox_pgoutput::Lsn;
    use walbox_sink::{KafkaSink, KafkaSinkConfig, Sink};

    let mut broker = Broker::start_with(walbox_testkit::BrokerOptions {
        storage: walbox_testkit::BrokerStorage::Sqlite,
    })
    .expect("broker starts");
    if broker.is_external() {
        return; // needs a broker this test can stop
    }
    let bootstrap = broker.bootstrap();
    let topic = "aborted";
    kafka::create_topic(&bootstrap, topic, 1)
        .await
        .expect("topic created");
    let event = |n: u32| Event {
        event_id: format!("e{n}"),
        topic: topic.to_owned(),
        key: Some(bytes::Bytes::from_static(b"order-1")),
        value: bytes::Bytes::from(format!("{{\"seq\":{n}}}")),
        json_value: true,
        headers: Vec::new(),
        position: Position {
            commit_lsn: Lsn(0x100),
            index: n,
            xid: 1,
        },
        origin: walbox_outbox::Origin::Stream,
    };
    let (mut sink, mut deliveries) = KafkaSink::new(KafkaSinkConfig {
        properties: vec![
            ("bootstrap.servers".to_owned(), bootstrap.clone()),
            ("message.timeout.ms".to_owned(), "120000".to_owned()),
            ("reconnect.backoff.max.ms".to_owned(), "200".to_owned()),
        ],
        ..KafkaSinkConfig::default()
    })
    .expect("sink");
    sink.send(event(0), 0).await.expect("sent");
    let first = tokio::time::timeout(Duration::from_secs(60), deliveries.recv())
        .await
        .expect("a report")
        .expect("open");
    assert!(first.result.is_ok(), "{:?}", first.result);

    // The broker goes away; the next events wait in the producer's queue.
    broker.stop().expect("broker stops");
    for n in 1..=20 {
        sink.send(event(n), n as usize).await.expect("queued");
    }
    sink.abort();
    broker.start_again().expect("broker back");
    // Every held event is reported failed at once, none acknowledged.
    for _ in 1..=20 {
        let d = tokio::time::timeout(Duration::from_secs(30), deliveries.recv())
            .await
            .expect("a report soon after the abort, not after message.timeout.ms")
            .expect("open");
        assert!(
            d.result.is_err(),
            "event {} acknowledged after the abort",
            d.token
        );
    }
    // ... and the broker holds only the event acknowledged before it.
    sink.flush(Duration::from_secs(5)).await.ok();
    let records = tokio::task::spawn_blocking(move || {
        kafka::read_all(&bootstrap, topic, Duration::from_secs(60))
    })
    .await
    .unwrap()
    .expect("topic read");
    let ids: Vec<&str> = records.iter().filter_map(|r| r.value_str()).collect();
    assert_eq!(records.len(), 1, "{ids:?}");
}
