//! walbox into SNS FIFO topics (LocalStack) from a real PostgreSQL, read
//! back through an SQS FIFO queue subscribed with raw delivery: a topic
//! without a subscription, whose messages SNS would acknowledge and drop,
//! stops walbox before anything is published to it, and once the consumers
//! subscribe as the message says, every event committed meanwhile arrives
//! exactly once, each key in commit order, also after a kill -9; a topic
//! deleted and made again under walbox (same ARN, no subscription) stops it
//! within the half minute it looks again; a standard topic is refused
//! unless order is given up; the credentials never reach the log, even at
//! trace.

mod common;

use std::time::Duration;

use common::*;
use walbox_testkit::{LocalStack, wait_until};

const TOPIC: &str = "outbox.order";
/// The SNS topic and the SQS queue subscribed to it (the same name, in two
/// services): `drain_queue` reads the queue `TOPIC` names.
const NAME: &str = "outbox-order.fifo";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_subscription_stops_walbox_and_after_subscribing_every_event_arrives_once() {
    let sns = LocalStack::start().unwrap();
    let (pg, db, mut env) = aws_servers(
        "sns",
        &sns.endpoint(),
        "create_topics = true",
        "dead_letter_queue = \"outbox-letters.fifo\"",
    )
    .await;
    setup(&env);

    // One queue holds every topic's letters: a replay of one topic's is
    // refused, naming the flag.
    let (exit, out, err) = walbox_cmd(&["dlq", "replay", "--dlq-topic", "outbox.order.dlq"], &env);
    assert_eq!(exit, Some(1), "{out}\n{err}");
    assert!(
        err.contains("--dlq-topic") && err.contains("replayed together"),
        "{err}"
    );

    // A standard topic without `ordered = false`: refused at start.
    assert_standard_refused("sns", &pg, &env, &sns.endpoint());

    // The topic walbox makes has no subscription: walbox stops, naming it
    // and what to do, with the events unconfirmed.
    write_events(&pg, 2, 4, 5, 3).await;
    let written = current_lsn(&db).await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    let status = walbox.wait(Duration::from_secs(60));
    assert_ne!(code(status), Some(0));
    let log = walbox.log();
    assert!(
        log.contains(&format!("topic \\\"{NAME}\\\" has no subscription"))
            || log.contains(&format!("topic \"{NAME}\" has no subscription")),
        "{log}"
    );
    assert!(log.contains("subscribe its consumers"), "{log}");

    // As the message says: the consumers' queue subscribed, walbox run
    // again, and killed -9 while it publishes; run again at trace with a
    // secret key and a session token it must never print.
    walbox_testkit::localstack::subscribe_queue(&sns.endpoint(), NAME, NAME)
        .await
        .unwrap();
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events_from(&pg, 1, 4, 5, 3, 3).await;
    wait_until("walbox to publish", Duration::from_secs(120), || {
        checkpoint(&pg).filter(|c| c.lsn > written)
    })
    .unwrap_or_else(|e| panic!("{e}; log:\n{}", walbox.log()));
    walbox.kill9();
    write_events_from(&pg, 1, 2, 5, 2, 6).await;
    const SECRET: &str = "sns-Secret-7c41f0";
    const TOKEN: &str = "sns-Session-Token-2a9b";
    env.retain(|(k, _)| *k != "AWS_SECRET_ACCESS_KEY");
    env.push(("AWS_SECRET_ACCESS_KEY", SECRET.into()));
    env.push(("AWS_SESSION_TOKEN", TOKEN.into()));
    env.push(("WALBOX_LOG", "trace".into()));
    let mut walbox = Walbox::spawn(&["run"], &env);
    caught_up(&db, &walbox).await;
    walbox.stop();
    let log = walbox.log();
    assert!(log.contains("TRACE"), "trace logging is on");
    assert!(!log.contains(SECRET), "the secret key is in the log");
    assert!(!log.contains(TOKEN), "the session token is in the log");

    let records = drain_queue(&sns.endpoint(), TOPIC).await;
    assert_all_once_in_key_order(&records, &outbox_ids(&db).await);
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_made_again_without_its_subscription_stops_walbox() {
    let sns = LocalStack::start().unwrap();
    let (pg, db, env) = aws_servers("sns", &sns.endpoint(), "create_topics = true", "").await;
    setup(&env);
    walbox_testkit::localstack::subscribe_queue(&sns.endpoint(), NAME, NAME)
        .await
        .unwrap();
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 1, 2, 5, 2).await;
    caught_up(&db, &walbox).await;
    // Replaced under walbox: the same ARN, and nobody subscribed.
    walbox_testkit::localstack::make_topic_again(&sns.endpoint(), NAME)
        .await
        .unwrap();
    // walbox looks at the subscriptions again within half a minute of
    // publishing, and stops.
    let writing = tokio::spawn({
        let conninfo = pg.conninfo("postgres");
        async move {
            let (db, conn) = tokio_postgres::connect(&conninfo, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            for i in 0..600 {
                let done = db
                    .batch_execute(&format!(
                        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                         VALUES ('order', 'order-late', 'OrderPlaced', '{{\"seq\": {i}}}')"
                    ))
                    .await;
                if done.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    let status = walbox.wait(Duration::from_secs(90));
    writing.abort();
    assert_ne!(code(status), Some(0));
    let log = walbox.log();
    assert!(log.contains("has no subscription"), "{log}");
    drop(pg);
}
