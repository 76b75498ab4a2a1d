//! The webhook sink against the test kit's receiver, without PostgreSQL: one
//! request in flight per key, acknowledgements out of send order across keys,
//! a refusal reported as about the event while its key moves on, and nothing
//! sent after an abort.

use std::time::Duration;

use bytes::Bytes;
use walbox_outbox::{Event, Position};
use walbox_sink::{DeliveryClass, Sink, WebhookSink, WebhookSinkConfig};
use walbox_testkit::Receiver;
use walbox_testkit::webhook::Reply;

fn event(key: &str, n: u32) -> Event {
    Event {
        event_id: format!("{key}-{n}"),
        topic: "outbox.order".into(),
        key: Some(Bytes::from(key.to_owned())),
        value: Bytes::from(format!("{{\"n\": {n}}}")),
        json_value: true,
        headers: vec![("event_id".into(), Bytes::from(format!("{key}-{n}")))],
        position: Position {
            commit_lsn: walbox_pgoutput::Lsn(u64::from(n) + 1),
            index: 0,
            xid: 1,
        },
        origin: walbox_outbox::Origin::Stream,
    }
}

fn sink(receiver: &Receiver, dir: &std::path::Path) -> (WebhookSink, walbox_sink::Deliveries) {
    WebhookSink::new(WebhookSinkConfig {
        url: format!("{}/{{topic}}", receiver.base_url()),
        secrets: vec!["whsec_aGVsbG8gd29ybGQ=".into()],
        retry_initial_ms: 20,
        retry_max_ms: 100,
        dead_letter_file: Some(dir.join("dl.jsonl")),
        ..WebhookSinkConfig::default()
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_flow_apart_one_request_per_key_and_acks_come_out_of_send_order() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().unwrap();
    // Key a's first event fails three times; b's go through.
    receiver.set_script(|seen| {
        if seen.id == "a-0" && seen.earlier < 3 {
            Reply::Status(500, String::new())
        } else if seen.id == "a-2" {
            Reply::Status(422, "no such order".into())
        } else {
            Reply::Ok
        }
    });
    let (mut sink, mut deliveries) = sink(&receiver, dir.path());
    let mut token = 0;
    for n in 0..3 {
        for key in ["a", "b"] {
            sink.send(event(key, n), token).await.unwrap();
            token += 1;
        }
    }
    sink.end_batch();
    let mut order = Vec::new();
    let mut refused = Vec::new();
    for _ in 0..6 {
        let d = tokio::time::timeout(Duration::from_secs(30), deliveries.recv())
            .await
            .unwrap()
            .unwrap();
        if let Err(e) = &d.result {
            assert_eq!(e.class, DeliveryClass::HttpRefused);
            assert!(e.is_about_the_message());
            assert!(e.reason.contains("422") && e.reason.contains("no such order"));
            assert!(e.rejected.is_some());
            refused.push(d.token);
        }
        order.push(d.token);
    }
    // Tokens: a-0 = 0, b-0 = 1, a-1 = 2, b-1 = 3, a-2 = 4, b-2 = 5.
    assert_eq!(refused, [4]);
    let pos = |t: usize| order.iter().position(|x| *x == t).unwrap();
    assert!(
        pos(5) < pos(0),
        "b's events are acknowledged before a's first: {order:?}"
    );
    assert!(
        pos(0) < pos(2) && pos(2) < pos(4),
        "a's in order: {order:?}"
    );
    // At the receiver: a's arrivals in order, each after the one before it
    // was answered 2xx.
    let a: Vec<(String, u16)> = receiver
        .arrivals()
        .into_iter()
        .filter(|x| x.key.as_deref() == Some("a"))
        .map(|x| (x.id, x.status))
        .collect();
    assert_eq!(
        a,
        [
            ("a-0".to_owned(), 500),
            ("a-0".to_owned(), 500),
            ("a-0".to_owned(), 500),
            ("a-0".to_owned(), 200),
            ("a-1".to_owned(), 200),
            ("a-2".to_owned(), 422),
        ]
    );
    assert!(sink.retries().load(std::sync::atomic::Ordering::Relaxed) >= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_is_final_and_nothing_of_its_key_follows_and_an_abort_sends_nothing_more() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().unwrap();
    receiver.set_script(|_| Reply::Status(410, String::new()));
    let (mut sink, mut deliveries) = sink(&receiver, dir.path());
    for n in 0..3 {
        sink.send(event("a", n), n as usize).await.unwrap();
    }
    let d = tokio::time::timeout(Duration::from_secs(30), deliveries.recv())
        .await
        .unwrap()
        .unwrap();
    let e = d.result.unwrap_err();
    assert_eq!(e.class, DeliveryClass::EndpointGone);
    assert!(e.is_final());
    sink.abort();
    sink.send(event("b", 9), 9).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(500), deliveries.recv())
            .await
            .map_or(true, |d| d.is_none()),
        "nothing reported after the abort"
    );
    assert_eq!(receiver.count(), 1, "{:?}", receiver.arrivals());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followed_redirects_keep_the_post_and_a_redirect_that_would_turn_it_into_a_get_stops() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().unwrap();
    // 307 keeps the method and body; 302 would make them a GET without body.
    receiver.set_script(|seen| match (seen.path, seen.key) {
        ("/outbox.order", Some("a")) => Reply::Redirect(307, "/moved".into()),
        ("/outbox.order", _) => Reply::Redirect(302, "/moved".into()),
        _ => Reply::Ok,
    });
    let (mut sink, mut deliveries) = WebhookSink::new(WebhookSinkConfig {
        url: format!("{}/{{topic}}", receiver.base_url()),
        secrets: vec!["whsec_aGVsbG8gd29ybGQ=".into()],
        follow_redirects: true,
        dead_letter_file: Some(dir.path().join("dl.jsonl")),
        ..WebhookSinkConfig::default()
    })
    .unwrap();
    sink.send(event("a", 0), 0).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(30), deliveries.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(d.result.is_ok(), "{:?}", d.result);
    sink.send(event("b", 0), 1).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(30), deliveries.recv())
        .await
        .unwrap()
        .unwrap();
    let e = d.result.expect_err("a 302 is not delivered by a GET");
    assert_eq!(e.class, DeliveryClass::EndpointMoved);
    let moved: Vec<(String, String, Bytes)> = receiver
        .arrivals()
        .into_iter()
        .filter(|x| x.path == "/moved")
        .map(|x| (x.method, x.id, x.body))
        .collect();
    assert_eq!(
        moved,
        [(
            "POST".to_owned(),
            "a-0".to_owned(),
            Bytes::from_static(b"{\"n\": 0}")
        )]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_s_next_event_waits_until_the_refused_one_s_dead_letter_is_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().unwrap();
    receiver.set_script(|seen| {
        if seen.id == "a-0" {
            Reply::Status(400, "bad".into())
        } else {
            Reply::Ok
        }
    });
    let (mut sink, mut deliveries) = sink(&receiver, dir.path());
    sink.send(event("a", 0), 0).await.unwrap();
    sink.send(event("a", 1), 1).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(30), deliveries.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(d.token, 0);
    let e = d.result.unwrap_err();
    assert_eq!(e.class, DeliveryClass::HttpRefused);
    // Until a-0's dead letter is on disk, a-1 is not sent: were walbox killed
    // now, a-0 would be sent again, and must not arrive after a-1.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), deliveries.recv())
            .await
            .is_err(),
        "nothing of key a before the dead letter"
    );
    assert_eq!(receiver.count(), 1, "{:?}", receiver.arrivals());
    // The relay's dead letter for a-0 (same event id and key).
    let mut dead = event("a", 0);
    dead.topic = "outbox.order.dlq".into();
    dead.headers.push((
        walbox_outbox::dead_letter_header::ERROR_CLASS.into(),
        Bytes::from_static(b"http_refused"),
    ));
    sink.send(dead, 2).await.unwrap();
    let mut order = Vec::new();
    for _ in 0..2 {
        let d = tokio::time::timeout(Duration::from_secs(30), deliveries.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(d.result.is_ok(), "{:?}", d.result);
        order.push(d.token);
    }
    assert_eq!(order, [2, 1], "the dead letter, then the key's next event");
    assert_eq!(
        walbox_sink::read_letters(&dir.path().join("dl.jsonl"))
            .unwrap()
            .len(),
        1
    );
}

/// "One request per key in flight" holds at walbox, not at the receiver: an
/// attempt that times out may still be processed while its retry arrives.
/// Both carry the same `webhook-id` and the source position, which is what
/// docs/guarantees.md tells a concurrent receiver to order by.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_timeout_overlaps_the_first_attempt_and_both_carry_the_position() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().unwrap();
    // The first attempt is answered only after 1.5 s; walbox gives up on it
    // after 300 ms and tries again at once.
    // The script sees each request as it begins (the receiver records an
    // arrival only once it has answered, and the first is never answered:
    // walbox hangs up on it).
    let begun = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = std::sync::Arc::clone(&begun);
    receiver.set_script(move |s| {
        let mut begun = seen.lock().unwrap();
        begun.push((s.id.to_owned(), std::time::Instant::now()));
        if begun.len() == 1 {
            Reply::Slow(Duration::from_millis(1_500))
        } else {
            Reply::Ok
        }
    });
    let (mut sink, mut deliveries) = WebhookSink::new(WebhookSinkConfig {
        url: format!("{}/{{topic}}", receiver.base_url()),
        secrets: vec!["whsec_aGVsbG8gd29ybGQ=".into()],
        retry_initial_ms: 20,
        retry_max_ms: 100,
        request_timeout_ms: 300,
        dead_letter_file: Some(dir.path().join("dl.jsonl")),
        ..WebhookSinkConfig::default()
    })
    .unwrap();
    let mut e = event("k", 0);
    e.headers
        .push(("walbox_commit_lsn".into(), Bytes::from_static(b"0/1")));
    e.headers
        .push(("walbox_index".into(), Bytes::from_static(b"0")));
    sink.send(e, 0).await.unwrap();
    sink.end_batch();
    let d = tokio::time::timeout(Duration::from_secs(30), deliveries.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(d.result.is_ok(), "{:?}", d.result);
    let begun = begun.lock().unwrap().clone();
    assert_eq!(begun.len(), 2, "{begun:?}");
    assert_eq!(begun[0].0, begun[1].0, "the same webhook-id");
    assert!(
        begun[1].1 < begun[0].1 + Duration::from_millis(1_500),
        "the retry began while the first attempt was still being processed"
    );
    let retry = &receiver.delivered()[0];
    assert_eq!(retry.id, begun[0].0);
    assert_eq!(retry.header("walbox_commit_lsn"), Some("0/1"));
    assert_eq!(retry.header("walbox_index"), Some("0"));
}
