//! walbox into SQS FIFO queues (LocalStack) from a real PostgreSQL: entries
//! that AWS would fail out of a `SendMessageBatch` (played by the test
//! kit's fault proxy, which answers chosen entries as failed and never
//! forwards them) are sent again before anything later of their group, so
//! every key's messages stay in commit order and none is missing; a resend
//! after a kill is dropped by the queue's deduplication (exactly once
//! within the window); a standard queue is refused unless order is given
//! up; a missing queue stops walbox naming it; the credentials never reach
//! the log, even at trace.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use walbox_testkit::{FaultProxy, LocalStack};

const TOPIC: &str = "outbox.order";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_failed_out_of_a_batch_go_again_before_anything_later_of_their_group() {
    let sqs = LocalStack::start().unwrap();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", sqs.port()).parse().unwrap()).unwrap();
    // Every message of order-1 fails twice, and one in four of the others
    // once.
    let attempts: Arc<std::sync::Mutex<HashMap<String, usize>>> = Arc::default();
    let scattered = Arc::new(AtomicUsize::new(0));
    {
        let attempts = Arc::clone(&attempts);
        let scattered = Arc::clone(&scattered);
        proxy.fail_when(move |e| {
            let dedup = e.json["MessageDeduplicationId"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let group = e.json["MessageGroupId"].as_str().unwrap_or_default();
            let mut seen = attempts.lock().unwrap();
            let n = seen.entry(dedup).or_insert(0);
            *n += 1;
            if group == "order-1" {
                *n <= 2
            } else {
                *n == 1 && scattered.fetch_add(1, Ordering::SeqCst).is_multiple_of(4)
            }
        });
    }
    let (pg, db, env) = aws_servers("sqs", &proxy.endpoint(), "create_topics = true", "").await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 2, 10, 10, 6).await;
    caught_up(&db, &walbox).await;
    // Killed, and run again from the confirmed position: what it sends
    // again within the window, the queue drops.
    walbox.kill9();
    write_events_from(&pg, 1, 5, 4, 2, 6).await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    caught_up(&db, &walbox).await;
    walbox.stop();
    assert!(
        proxy.failed() >= 2 * 200 / 6,
        "the proxy failed entries ({} of {} calls)",
        proxy.failed(),
        proxy.calls()
    );
    let records = drain_queue(&sqs.endpoint(), TOPIC).await;
    assert_all_once_in_key_order(&records, &outbox_ids(&db).await);
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_queues_missing_queues_and_credentials() {
    let sqs = LocalStack::start().unwrap();
    let (pg, db, mut env) = aws_servers("sqs", &sqs.endpoint(), "", "").await;
    setup(&env);
    write_events(&pg, 1, 1, 2, 2).await;

    // A standard queue without `ordered = false`: refused at start.
    assert_standard_refused("sqs", &pg, &env, &sqs.endpoint());

    // No queue and no create_topics: walbox stops naming the queue.
    let mut walbox = Walbox::spawn(&["run"], &env);
    let status = walbox.wait(std::time::Duration::from_secs(60));
    assert_ne!(code(status), Some(0));
    let log = walbox.log();
    assert!(
        log.contains("\"outbox-order.fifo\" does not exist"),
        "{log}"
    );

    // At trace, with the queue made: neither the secret key nor the
    // session token is printed.
    const SECRET: &str = "sqs-Secret-51e0aa";
    const TOKEN: &str = "sqs-Session-Token-9d1e";
    env.retain(|(k, _)| *k != "AWS_SECRET_ACCESS_KEY");
    env.push(("AWS_SECRET_ACCESS_KEY", SECRET.into()));
    env.push(("AWS_SESSION_TOKEN", TOKEN.into()));
    env.push(("WALBOX_LOG", "trace".into()));
    env.push(("WALBOX_CREATE_TOPICS", "true".into()));
    // A header with an empty value, which SQS takes as no attribute: it
    // goes in walbox_headers, and the event is stored, not refused.
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
         VALUES ('order', 'order-empty', 'OrderPlaced', '{\"seq\": 0}', '{\"tenant\": \"\"}')",
    )
    .await
    .unwrap();
    let mut walbox = Walbox::spawn(&["run"], &env);
    caught_up(&db, &walbox).await;
    walbox.stop();
    let log = walbox.log();
    assert!(log.contains("TRACE"), "trace logging is on");
    assert!(!log.contains(SECRET), "the secret key is in the log");
    assert!(!log.contains(TOKEN), "the session token is in the log");
    let records = drain_queue(&sqs.endpoint(), TOPIC).await;
    assert_all_once_in_key_order(&records, &outbox_ids(&db).await);
    // The queue walbox made keeps its messages 14 days, not SQS's 4.
    assert_eq!(
        walbox_testkit::localstack::queue_attribute(
            &sqs.endpoint(),
            "outbox-order.fifo",
            "MessageRetentionPeriod"
        )
        .await,
        Ok(Some("1209600".to_owned()))
    );
    let empty = records
        .iter()
        .find(|r| r.key.as_deref() == Some(&b"order-empty"[..]))
        .expect("the event with an empty header is stored");
    assert!(
        empty
            .headers
            .iter()
            .any(|(k, v)| k == "tenant" && v.is_empty()),
        "{:?}",
        empty.headers
    );
}
