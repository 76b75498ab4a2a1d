//! The JetStream sink against a real `nats-server -js`: a publication that
//! was never sent leaves nothing after it stored.
//!
//! `send_publish` can fail before the message leaves the client: with the
//! server frozen (SIGSTOP) the socket and the client's write buffer fill, then
//! its command queue, and a publication waiting for room there gives up after
//! the PubAck timeout, unsent. Publications are chained with
//! `Nats-Expected-Last-Msg-Id`; one sent after the unsent one would name the
//! one before it, which the server does store once it runs again, so it would
//! be stored after a gap: a key's later event before its earlier one. The
//! sink must send nothing more in that session.

use std::time::{Duration, Instant};

use bytes::Bytes;
use walbox_outbox::{Event, Position};
use walbox_pgoutput::Lsn;
use walbox_sink::{NatsSink, NatsSinkConfig, NatsStorage, Sink};
use walbox_testkit::NatsServer;

const SUBJECT: &str = "outbox.order";
const ACK_TIMEOUT: Duration = Duration::from_millis(300);

fn event(n: u32, payload: &Bytes) -> Event {
    Event {
        event_id: format!("e{n}"),
        topic: SUBJECT.to_owned(),
        key: Some(Bytes::from_static(b"order-1")),
        value: payload.clone(),
        json_value: false,
        headers: Vec::new(),
        position: Position {
            commit_lsn: Lsn(0x100),
            index: n,
            xid: 1,
        },
        origin: walbox_outbox::Origin::Stream,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_publication_that_was_never_sent_nothing_later_is_stored() {
    let mut nats = NatsServer::start().expect("nats-server starts");
    let config = NatsSinkConfig {
        servers: vec![nats.url()],
        create_stream: true,
        storage: NatsStorage::Memory,
        ack_timeout_ms: u64::try_from(ACK_TIMEOUT.as_millis()).unwrap(),
        max_in_flight: 1_000_000,
        ..NatsSinkConfig::default()
    };
    let (mut sink, mut deliveries) = NatsSink::new(config.clone()).unwrap();
    // 8 KiB, one buffer shared by every event.
    let payload = Bytes::from(vec![b'x'; 8192]);
    sink.send(event(0, &payload), 0).await.unwrap();
    let first = deliveries.recv().await.unwrap();
    assert!(first.result.is_ok(), "{first:?}");

    // Frozen: sends fill the socket and the client's queue until one waits
    // longer than the PubAck timeout for room, and gives up unsent.
    nats.pause().unwrap();
    let mut n = 1;
    let unsent = loop {
        let started = Instant::now();
        sink.send(event(n, &payload), n as usize).await.unwrap();
        if started.elapsed() >= ACK_TIMEOUT {
            break n;
        }
        n += 1;
        assert!(n < 200_000, "no send waited for room");
    };
    nats.resume().unwrap();
    // The same session goes on with later events of the same key.
    for m in unsent + 1..=unsent + 20 {
        sink.send(event(m, &payload), m as usize).await.unwrap();
    }
    let last = unsent + 20;
    sink.flush(Duration::from_secs(60)).await.unwrap();
    let mut failed = Vec::new();
    while let Ok(d) = deliveries.try_recv() {
        if d.result.is_err() {
            failed.push(d.token);
        }
    }
    assert!(
        failed.contains(&(unsent as usize)),
        "event {unsent} did not fail"
    );

    // What the stream holds, in stream order: the events from 0 on, without a
    // gap (those after the unsent one would be stored after it).
    let mut stored = Vec::new();
    walbox_sink::read_subject(&config, SUBJECT, Duration::from_secs(30), |r| {
        stored.push(r.header("Nats-Msg-Id").unwrap_or_default().to_owned());
    })
    .await
    .unwrap();
    let gap = stored
        .iter()
        .enumerate()
        .find(|(i, id)| **id != format!("e{i}"));
    assert!(
        gap.is_none(),
        "{:?} stored where e{} belongs (e{unsent} was never sent; e{last} published last)",
        gap.map(|(_, id)| id),
        gap.map_or(0, |(i, _)| i),
    );
    assert!(!stored.contains(&format!("e{unsent}")));
}

/// A replay whose first copy the stream no longer holds (a work queue consumed
/// it, retention or a deletion removed it) is answered duplicate naming a
/// sequence that cannot be read: it is delivered, not retried until the
/// duplicate window passes (and then stored twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_whose_first_copy_is_gone_is_delivered() {
    let nats = NatsServer::start().expect("nats-server starts");
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: "WORK".into(),
            subjects: vec!["outbox.>".into()],
            retention: async_nats::jetstream::stream::RetentionPolicy::WorkQueue,
            duplicate_window: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .unwrap();
    let config = NatsSinkConfig {
        servers: vec![nats.url()],
        stream: "WORK".into(),
        create_stream: false,
        ..NatsSinkConfig::default()
    };
    let payload = Bytes::from_static(b"{}");
    let (mut sink, mut deliveries) = NatsSink::new(config.clone()).unwrap();
    sink.send(event(0, &payload), 0).await.unwrap();
    let first = deliveries.recv().await.unwrap();
    assert!(first.result.is_ok(), "{first:?}");
    // Consumed and gone.
    assert!(stream.delete_message(1).await.unwrap());
    // The next session publishes it again (a replay after a crash).
    let (mut sink, mut deliveries) = NatsSink::new(config).unwrap();
    sink.send(event(0, &payload), 0).await.unwrap();
    let again = deliveries.recv().await.unwrap();
    assert!(again.result.is_ok(), "{again:?}");
    let mut stream = js.get_stream("WORK").await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        0,
        "not stored twice"
    );
}

/// A legitimate repeat can differ in its value (a CloudEvent without
/// `occurred_at` takes its time from the commit, which a snapshot row lacks) and
/// in its position headers (a snapshot taken again): same subject and key under
/// the same id is the same event, delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_with_another_value_under_the_same_id_subject_and_key_is_delivered() {
    let nats = NatsServer::start().expect("nats-server starts");
    let config = NatsSinkConfig {
        servers: vec![nats.url()],
        create_stream: true,
        storage: NatsStorage::Memory,
        ..NatsSinkConfig::default()
    };
    let (mut sink, mut deliveries) = NatsSink::new(config.clone()).unwrap();
    sink.send(event(0, &Bytes::from_static(b"{\"time\":null}")), 0)
        .await
        .unwrap();
    assert!(deliveries.recv().await.unwrap().result.is_ok());
    let (mut sink, mut deliveries) = NatsSink::new(config).unwrap();
    let mut repeat = event(
        0,
        &Bytes::from_static(b"{\"time\":\"2026-12-01T00:00:00Z\"}"),
    );
    repeat.position.index = 7;
    sink.send(repeat, 0).await.unwrap();
    let again = deliveries.recv().await.unwrap();
    assert!(again.result.is_ok(), "{again:?}");
}
