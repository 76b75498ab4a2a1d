//! The Pub/Sub sink against Google's emulator (one for the whole binary,
//! each test with topics of its own): messages with their attributes,
//! `event_id` and ordering key, read back in order from a subscription with
//! message ordering; a header Pub/Sub cannot carry refuses its event alone,
//! with the reason; dead letters kept by the letters subscription and
//! settled; a missing topic named; and the ordering key paused by a failed
//! publish (through a proxy that refuses connections): a later event of the
//! key is never stored before the failed one, which is sent again, and
//! nothing more of the key goes once the failure is final; a batch Pub/Sub
//! refuses (the fault proxy) is sent again one by one, so only the invalid
//! message is refused; a topic gone with a restarted (empty) emulator is
//! created again and the event sent.

use std::sync::OnceLock;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use walbox_outbox::{Event, Position};
use walbox_sink::{
    DeliveryClass, PubSubSink, PubSubSinkConfig, Sink, SinkError, SubscriptionLetters,
    read_subscription,
};
use walbox_testkit::{PubSubEmulator, TcpProxy, wait_until_async};

/// The binary's emulator, gone when the binary ends.
fn emulator() -> &'static PubSubEmulator {
    static EMULATOR: OnceLock<PubSubEmulator> = OnceLock::new();
    EMULATOR.get_or_init(|| {
        let e = PubSubEmulator::start().expect("starting the pubsub emulator");
        e.removed_when_this_process_ends().unwrap();
        e
    })
}

fn config(host: String) -> PubSubSinkConfig {
    PubSubSinkConfig {
        project: PubSubEmulator::PROJECT.into(),
        emulator_host: Some(host),
        create_topics: true,
        ..PubSubSinkConfig::default()
    }
}

fn event(id: &str, topic: &str, key: &str, index: u32) -> Event {
    Event {
        event_id: id.into(),
        topic: topic.into(),
        key: Some(Bytes::copy_from_slice(key.as_bytes())),
        value: Bytes::from(format!("{{\"id\":\"{id}\"}}")),
        json_value: true,
        headers: vec![
            ("event_type".into(), Bytes::from_static(b"OrderPlaced")),
            ("walbox_commit_lsn".into(), Bytes::from_static(b"0/10")),
            (
                "walbox_index".into(),
                Bytes::from(index.to_string().into_bytes()),
            ),
        ],
        position: Position {
            commit_lsn: walbox_pgoutput::Lsn(16),
            index,
            xid: 7,
        },
        origin: walbox_outbox::Origin::Stream,
    }
}

/// A message read back: its event id attribute, ordering key, data.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Read {
    id: String,
    key: Option<String>,
    value: String,
    headers: Vec<(String, String)>,
}

async fn read(cfg: &PubSubSinkConfig, subscription: &str) -> Vec<Read> {
    let mut out = Vec::new();
    read_subscription(cfg, subscription, Duration::from_secs(5), |r| {
        out.push(Read {
            id: r.event_id().unwrap_or_default(),
            key: r.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            value: String::from_utf8_lossy(r.value().unwrap_or_default()).into_owned(),
            headers: ["event_type", "event_id", "walbox_error_class"]
                .iter()
                .filter_map(|n| Some(((*n).to_owned(), r.header(n)?.to_owned())))
                .collect(),
        });
    })
    .await
    .unwrap();
    out
}

/// Each delivery's outcome, by token, once `n` came.
async fn outcomes(
    deliveries: &mut walbox_sink::Deliveries,
    n: usize,
) -> Vec<Result<(), (DeliveryClass, String)>> {
    let mut out = vec![None; n];
    for _ in 0..n {
        let d = tokio::time::timeout(Duration::from_secs(60), deliveries.recv())
            .await
            .expect("a delivery within 60 s")
            .expect("the sink reports");
        out[d.token] = Some(d.result.map_err(|e| (e.class, e.reason)));
    }
    out.into_iter().map(Option::unwrap).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_arrive_with_attributes_in_key_order_and_a_refused_one_is_dead_lettered() {
    let em = emulator();
    let cfg = config(em.host());
    em.create_subscription("rt.orders.sub", "rt.orders", true)
        .unwrap();
    let (mut sink, mut deliveries) = PubSubSink::new(cfg.clone()).unwrap();
    let mut events = Vec::new();
    for i in 0..20u32 {
        events.push(event(
            &format!("e{i}"),
            "rt.orders",
            &format!("k{}", i % 3),
            i,
        ));
    }
    // A header Pub/Sub keeps for itself: this event alone is refused.
    events[7]
        .headers
        .push(("googclient_x".into(), Bytes::from_static(b"secret-value")));
    let n = events.len();
    for (i, e) in events.into_iter().enumerate() {
        sink.send(e, i).await.unwrap();
    }
    sink.end_batch();
    let results = outcomes(&mut deliveries, n).await;
    for (i, r) in results.iter().enumerate() {
        if i == 7 {
            let (class, reason) = r.as_ref().unwrap_err();
            assert_eq!(*class, DeliveryClass::InvalidRecord);
            assert!(reason.contains("googclient_x"), "{reason}");
            assert!(!reason.contains("secret-value"), "{reason}");
        } else {
            assert!(r.is_ok(), "event {i}: {r:?}");
        }
    }
    let got = read(&cfg, "rt.orders.sub").await;
    assert_eq!(got.len(), 19, "{got:?}");
    for key in ["k0", "k1", "k2"] {
        let ids: Vec<u32> = got
            .iter()
            .filter(|r| r.key.as_deref() == Some(key))
            .map(|r| r.id[1..].parse().unwrap())
            .collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{key}: {ids:?}");
    }
    let e3 = got.iter().find(|r| r.id == "e3").unwrap();
    assert_eq!(e3.value, "{\"id\":\"e3\"}");
    assert_eq!(
        e3.headers,
        [
            ("event_type".to_owned(), "OrderPlaced".to_owned()),
            ("event_id".to_owned(), "e3".to_owned())
        ]
    );

    // Its dead letter: to a topic created with the subscription that keeps
    // letters, read back in commit order, settled (acknowledged or handed
    // back).
    let mut letter = event("e7", "rt.orders.dlq", "k1", 7);
    letter.headers.push((
        "walbox_error_class".into(),
        Bytes::from_static(b"invalid_record"),
    ));
    letter
        .headers
        .push(("googclient_x".into(), Bytes::from_static(b"secret-value")));
    let mut second = letter.clone();
    second.event_id = "e8".into();
    second.headers[2].1 = Bytes::from_static(b"8");
    // Sent in reverse: read back in commit order.
    sink.send(second, 0).await.unwrap();
    sink.send(letter, 1).await.unwrap();
    assert!(outcomes(&mut deliveries, 2).await.iter().all(Result::is_ok));
    let letters = SubscriptionLetters::read(&cfg, "rt.orders.dlq", Duration::from_secs(10))
        .await
        .unwrap()
        .expect("the letters subscription");
    let mut seen = Vec::new();
    letters.each(|r| {
        seen.push((
            r.event_id().unwrap(),
            r.header("walbox_dropped_headers").map(str::to_owned),
        ));
    });
    assert_eq!(
        seen,
        [
            ("e7".to_owned(), Some("1 googclient_x".to_owned())),
            ("e8".to_owned(), Some("1 googclient_x".to_owned()))
        ]
    );
    // The first is done, the second handed back: it is all a next read has.
    letters.settle(|offset| offset == 0).await.unwrap();
    let again = SubscriptionLetters::read(&cfg, "rt.orders.dlq", Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    let mut left = Vec::new();
    again.each(|r| left.push(r.event_id().unwrap()));
    assert_eq!(left, ["e8"]);
    again.settle(|_| true).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_is_named_when_topics_are_not_created() {
    let em = emulator();
    let mut cfg = config(em.host());
    cfg.create_topics = false;
    let (mut sink, _deliveries) = PubSubSink::new(cfg.clone()).unwrap();
    let e = sink
        .send(event("m1", "missing.orders", "k", 0), 0)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, SinkError::MissingTopic(t) if t.ends_with("/topics/missing.orders")),
        "{e}"
    );
    // A dead-letter topic without the subscription that keeps its letters.
    em.create_topic("missing.orders.dlq").unwrap();
    let mut letter = event("m2", "missing.orders.dlq", "k", 0);
    letter.headers.push((
        "walbox_error_class".into(),
        Bytes::from_static(b"invalid_record"),
    ));
    let (mut sink, _deliveries) = PubSubSink::new(cfg).unwrap();
    let e = sink.send(letter, 0).await.unwrap_err();
    assert!(
        matches!(&e, SinkError::PubSubMissingSubscription { subscription, .. } if subscription == "missing.orders.dlq.walbox-letters"),
        "{e}"
    );
}

/// The sink reaches the emulator through a proxy the test can make refuse.
fn proxied() -> (TcpProxy, PubSubSinkConfig) {
    let em = emulator();
    let proxy = TcpProxy::start(format!("127.0.0.1:{}", em.port()).parse().unwrap()).unwrap();
    let mut cfg = config(proxy.addr().to_string());
    // Long enough (1.5 to 3 s before the first retry) that an event sent
    // while the first waits to be tried again would be stored first, were
    // the key not paused, even on a busy machine.
    cfg.retry_initial_ms = 3000;
    cfg.retry_max_ms = 6000;
    (proxy, cfg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_publish_pauses_its_key_until_it_is_sent_again() {
    let em = emulator();
    let (proxy, cfg) = proxied();
    em.create_subscription("pause.orders.sub", "pause.orders", true)
        .unwrap();
    let (mut sink, mut deliveries) = PubSubSink::new(cfg.clone()).unwrap();
    let retries = sink.retries();
    sink.send(event("p0", "pause.orders", "k", 0), 0)
        .await
        .unwrap();
    assert!(outcomes(&mut deliveries, 1).await[0].is_ok());
    // The link fails: p1's publish fails and waits to be sent again.
    proxy.refuse();
    proxy.cut();
    sink.send(event("p1", "pause.orders", "k", 1), 1)
        .await
        .unwrap();
    sink.end_batch();
    wait_until_async("p1's publish to fail", Duration::from_secs(30), || async {
        (retries.load(Ordering::SeqCst) >= 1).then_some(())
    })
    .await
    .unwrap();
    // The link is back before p1 is tried again; p2 of the same key comes
    // now, and p3 of another key.
    proxy.accept();
    sink.send(event("p2", "pause.orders", "k", 2), 2)
        .await
        .unwrap();
    sink.send(event("p3", "pause.orders", "j", 3), 3)
        .await
        .unwrap();
    sink.end_batch();
    let mut got = std::collections::HashMap::new();
    for _ in 0..3 {
        let d = tokio::time::timeout(Duration::from_secs(60), deliveries.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(d.result.is_ok(), "{:?}", d.result);
        got.insert(d.token, std::time::Instant::now());
    }
    // The other key did not wait for the paused one.
    assert!(got[&3] < got[&1], "key j waited for key k");
    let read = read(&cfg, "pause.orders.sub").await;
    let k: Vec<&str> = read
        .iter()
        .filter(|r| r.key.as_deref() == Some("k"))
        .map(|r| r.id.as_str())
        .collect();
    // p1 may be there twice (a request whose answer was lost), never after p2.
    let first: Vec<&str> = k.iter().fold(Vec::new(), |mut v, id| {
        if !v.contains(id) {
            v.push(*id);
        }
        v
    });
    assert_eq!(first, ["p0", "p1", "p2"], "stored: {k:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_that_cannot_be_stored_fails_the_session_and_nothing_later_of_its_key_goes() {
    let em = emulator();
    let (proxy, mut cfg) = proxied();
    cfg.retry_initial_ms = 200;
    cfg.retry_max_ms = 400;
    cfg.max_retry_duration_s = 2;
    em.create_subscription("final.orders.sub", "final.orders", true)
        .unwrap();
    let (mut sink, mut deliveries) = PubSubSink::new(cfg.clone()).unwrap();
    sink.send(event("f0", "final.orders", "k", 0), 0)
        .await
        .unwrap();
    assert!(outcomes(&mut deliveries, 1).await[0].is_ok());
    proxy.refuse();
    proxy.cut();
    // The cut takes effect on the proxy's own thread: until f0's kept-alive
    // connection is gone, a request written on it could still reach the
    // emulator.
    walbox_testkit::wait_until(
        "the proxy to drop its connections",
        Duration::from_secs(10),
        || (proxy.live() == 0).then_some(()),
    )
    .unwrap();
    sink.send(event("f1", "final.orders", "k", 1), 1)
        .await
        .unwrap();
    sink.send(event("f2", "final.orders", "k", 2), 2)
        .await
        .unwrap();
    sink.end_batch();
    let d = tokio::time::timeout(Duration::from_secs(60), deliveries.recv())
        .await
        .unwrap()
        .unwrap();
    let e = d.result.unwrap_err();
    // Not the message's fault (no dead letter), not final (walbox retries
    // the session from its confirmed position).
    assert_eq!(e.class, DeliveryClass::Timeout, "{e:?}");
    assert!(!e.is_about_the_message() && !e.is_final());
    assert!(e.reason.contains("max_retry_duration_s"), "{}", e.reason);
    sink.abort();
    proxy.accept();
    // The relay's next session sends both again; this one sent nothing more.
    let read = read(&cfg, "final.orders.sub").await;
    let ids: Vec<&str> = read.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["f0"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_gone_with_a_restarted_emulator_is_created_again_and_the_event_sent() {
    // An emulator of its own: restarting it empties it.
    let mut em = tokio::task::spawn_blocking(PubSubEmulator::start)
        .await
        .unwrap()
        .unwrap();
    let cfg = config(em.host());
    let (mut sink, mut deliveries) = PubSubSink::new(cfg.clone()).unwrap();
    sink.send(event("g0", "gone.orders", "k", 0), 0)
        .await
        .unwrap();
    assert!(outcomes(&mut deliveries, 1).await[0].is_ok());
    em.kill9().unwrap();
    em.start_again().unwrap();
    let topic_url = format!(
        "http://{}/v1/projects/{}/topics/gone.orders",
        em.host(),
        PubSubEmulator::PROJECT
    );
    assert!(
        walbox_testkit::prometheus::get(&topic_url).is_err(),
        "the restarted emulator is empty"
    );
    // The session knows the topic; its publish finds it gone (404), creates
    // it again and sends the event.
    sink.send(event("g1", "gone.orders", "k", 1), 1)
        .await
        .unwrap();
    sink.end_batch();
    let d = tokio::time::timeout(Duration::from_secs(60), deliveries.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(d.token, 1);
    assert!(d.result.is_ok(), "{:?}", d.result);
    assert!(walbox_testkit::prometheus::get(&topic_url).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_refused_in_a_batch_is_refused_alone_and_its_key_goes_on_in_order() {
    let em = emulator();
    em.create_subscription("split.orders.sub", "split.orders", true)
        .unwrap();
    // walbox -> link proxy -> fault proxy -> emulator: the link holds a
    // key's request while the key's next events queue behind it (one batch);
    // the fault proxy refuses any Publish holding s3, as Pub/Sub refuses a
    // request with a message it takes for invalid.
    let faults =
        walbox_testkit::FaultProxy::start(format!("127.0.0.1:{}", em.port()).parse().unwrap())
            .unwrap();
    faults.fail_when(|e| e.json["attributes"]["event_id"] == "s3");
    let fault_addr = faults.endpoint().trim_start_matches("http://").to_owned();
    let link = TcpProxy::start(fault_addr.parse().unwrap()).unwrap();
    let mut cfg = config(link.addr().to_string());
    cfg.retry_initial_ms = 1500;
    cfg.retry_max_ms = 3000;
    let (mut sink, mut deliveries) = PubSubSink::new(cfg.clone()).unwrap();
    let retries = sink.retries();
    sink.send(event("s0", "split.orders", "k", 0), 0)
        .await
        .unwrap();
    assert!(outcomes(&mut deliveries, 1).await[0].is_ok());
    link.refuse();
    link.cut();
    sink.send(event("s1", "split.orders", "k", 1), 1)
        .await
        .unwrap();
    sink.end_batch();
    wait_until_async("s1's publish to fail", Duration::from_secs(30), || async {
        (retries.load(Ordering::SeqCst) >= 1).then_some(())
    })
    .await
    .unwrap();
    for (i, id) in ["s2", "s3", "s4"].iter().enumerate() {
        let token = i + 2;
        sink.send(
            event(id, "split.orders", "k", u32::try_from(token).unwrap()),
            token,
        )
        .await
        .unwrap();
    }
    sink.end_batch();
    link.accept();
    let mut results = vec![None; 5];
    for _ in 0..4 {
        let d = tokio::time::timeout(Duration::from_secs(60), deliveries.recv())
            .await
            .unwrap()
            .unwrap();
        results[d.token] = Some(d.result.map_err(|e| (e.class, e.reason)));
    }
    for (token, r) in results.iter().enumerate().skip(1) {
        let r = r.as_ref().expect("reported");
        if token == 3 {
            let (class, reason) = r.as_ref().unwrap_err();
            assert_eq!(*class, DeliveryClass::InvalidRecord);
            assert!(reason.contains("INVALID_ARGUMENT"), "{reason}");
        } else {
            assert!(r.is_ok(), "token {token}: {r:?}");
        }
    }
    // The batch [s2, s3, s4] refused whole, then s3 alone.
    assert_eq!(faults.failed(), 2);
    let read = read(&cfg, "split.orders.sub").await;
    let ids: Vec<&str> = read.iter().map(|r| r.id.as_str()).collect();
    let first: Vec<&str> = ids.iter().fold(Vec::new(), |mut v, id| {
        if !v.contains(id) {
            v.push(*id);
        }
        v
    });
    assert_eq!(first, ["s0", "s1", "s2", "s4"], "stored: {ids:?}");
}
