//! walbox into RabbitMQ on a real node (Debian's rabbitmq-server, one node
//! for this binary). Exchange mode: kill -9 rounds of walbox under four
//! writers lose nothing, keep each key's order in the durable queue bound to
//! the exchange, and store an event again only as a copy with the same
//! message_id; the node killed -9 and restarted on its data directory under
//! writers loses nothing it acknowledged; an unroutable publish holds the
//! position and walbox says why; refused credentials stop walbox, and no
//! password is ever logged, at trace level either.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::print_stderr)] // prints how many events were stored twice
async fn exchange_kill_9_rounds_under_four_writers_lose_nothing_keep_key_order_and_repeat_only_the_same_message_id()
 {
    let node = node().read().await;
    node.declare_exchange("kill9", "topic").await.unwrap();
    node.bind_queue("kill9.all", "kill9", "#").await.unwrap();
    let (pg, db, env) =
        servers_rabbitmq(&node, "exchange = \"kill9\"\nverify_queue = \"kill9.all\"").await;
    setup(&env);
    let stop = Arc::new(AtomicBool::new(false));
    let writers = four_writers(&pg, Arc::clone(&stop)).await;
    kill_9_rounds(&pg, &db, &env, 5).await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    let written = stop_writers(&stop, writers).await;
    caught_up(&db, &walbox).await;
    let log = walbox.log();
    walbox.stop();
    let records = node.read_queue("kill9.all").await.unwrap();
    let ids = outbox_ids(&db).await;
    assert_eq!(ids.len(), written);
    let twice = assert_all_there_duplicates_same_message_id(&records, &ids);
    assert_per_key_order(&records, true);
    eprintln!(
        "{written} events, {} messages, {twice} events stored more than once",
        records.len()
    );
    assert!(!log.contains("returned"), "{log}");
    let (status, out, err) = walbox_cmd(&["verify"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("missing          0"), "{out}");
    assert!(out.contains("out of order     0"), "{out}");
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_publish_holds_the_position_until_a_queue_takes_it_and_walbox_says_why() {
    let node = node().read().await;
    let (pg, db, env) = servers_rabbitmq(&node, "exchange = \"unrouted\"\ndeclare = true").await;
    setup(&env);
    let before = confirmed_lsn(&db, "walbox").await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'k1', 'OrderPlaced', '{\"seq\": 0}')",
    )
    .await
    .unwrap();
    let committed = current_lsn(&db).await;
    walbox_testkit::wait_until(
        "walbox to say the event came back",
        Duration::from_secs(60),
        || {
            let log = walbox.log();
            (log.matches("no queue is bound to exchange").count() >= 2).then_some(())
        },
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    let log = walbox.log();
    assert!(log.contains("\"outbox.order\""), "{log}");
    assert!(log.contains("312"), "{log}");
    assert!(walbox.running(), "{log}");
    assert!(confirmed_lsn(&db, "walbox").await < committed);
    assert!(confirmed_lsn(&db, "walbox").await >= before);
    // Nothing was dead-lettered in silence.
    assert!(!log.contains("dead letter"), "{log}");
    node.bind_queue("unrouted.q", "unrouted", "outbox.#")
        .await
        .unwrap();
    caught_up(&db, &walbox).await;
    let records = node.read_queue("unrouted.q").await.unwrap();
    let ids = outbox_ids(&db).await;
    assert_all_there_duplicates_same_message_id(&records, &ids);
    walbox.stop();
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exchange_node_killed_9_and_restarted_under_writers_loses_nothing_acknowledged() {
    let mut node = node().write().await;
    node.declare_exchange("crash", "topic").await.unwrap();
    node.bind_queue("crash.all", "crash", "#").await.unwrap();
    let (pg, db, env) = servers_rabbitmq(&node, "exchange = \"crash\"").await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    let stop = Arc::new(AtomicBool::new(false));
    let writers = four_writers(&pg, Arc::clone(&stop)).await;
    wait_slot_moves(&db, confirmed_lsn(&db, "walbox").await).await;
    node.kill9().unwrap();
    let rows = outbox_count(&db).await;
    walbox_testkit::wait_until_async(
        "writes while the node is down",
        Duration::from_secs(60),
        || async { (outbox_count(&db).await >= rows + 200).then_some(()) },
    )
    .await
    .unwrap();
    node.start_again().unwrap();
    wait_slot_moves(&db, confirmed_lsn(&db, "walbox").await).await;
    let written = stop_writers(&stop, writers).await;
    caught_up(&db, &walbox).await;
    assert!(walbox.running(), "{}", walbox.log());
    walbox.stop();
    let records = node.read_queue("crash.all").await.unwrap();
    let ids = outbox_ids(&db).await;
    assert_eq!(ids.len(), written);
    assert_all_there_duplicates_same_message_id(&records, &ids);
    assert_per_key_order(&records, true);
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_stop_walbox_and_no_password_is_logged_even_at_trace() {
    let node = node().read().await;
    node.add_user("walbox-user", "right-5b1f").unwrap();
    node.declare_exchange("secret", "topic").await.unwrap();
    node.bind_queue("secret.all", "secret", "#").await.unwrap();
    // The password from the environment, at trace level: delivered, never logged.
    let (pg, db, mut env) =
        servers_rabbitmq(&node, "exchange = \"secret\"\nuser = \"walbox-user\"").await;
    env.push(("WALBOX_RABBITMQ_PASSWORD", "right-5b1f".into()));
    env.push(("WALBOX_LOG", "trace".into()));
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 1, 2, 5, 3).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    let log = walbox.log();
    assert!(
        log.contains("lapin") || log.contains("amq"),
        "trace logs of the client: {log}"
    );
    assert!(!log.contains("right-5b1f"), "{log}");
    assert_eq!(node.read_queue("secret.all").await.unwrap().len(), 10);
    // Stream mode at trace: the stream client's logs hold no password either.
    let streams = config_file(
        &pg,
        "streams.toml",
        &format!(
            "[sink]\ntype = \"rabbitmq\"\n[sink.rabbitmq]\nmode = \"stream\"\ndeclare = true\n\
             stream_port = {}\nuser = \"walbox-user\"\n",
            node.stream_port()
        ),
    );
    let stream_env: Vec<(&str, String)> = env
        .iter()
        .filter(|(k, _)| *k != "WALBOX_CONFIG")
        .cloned()
        .chain([
            ("WALBOX_CONFIG", streams),
            ("WALBOX_TOPIC", "secrets.{aggregate_type}".to_owned()),
        ])
        .collect();
    let mut walbox = Walbox::spawn(&["run"], &stream_env);
    write_events_from(&pg, 1, 1, 5, 1, 40).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    let log = walbox.log();
    assert!(
        log.contains("rabbitmq_stream_client"),
        "trace logs of the stream client: {log}"
    );
    assert!(!log.contains("right-5b1f"), "{log}");
    assert_eq!(read_stream(&node, "secrets.order").await.len(), 5, "{log}");
    // A wrong password in the file: walbox stops, naming the user only.
    let wrong = config_file(
        &pg,
        "wrong.toml",
        &format!(
            "[sink]\ntype = \"rabbitmq\"\n[sink.rabbitmq]\nport = {}\nexchange = \"secret\"\n\
             user = \"walbox-user\"\npassword = \"wrong-77aa\"\n",
            node.amqp_port()
        ),
    );
    let env: Vec<(&str, String)> = env
        .into_iter()
        .filter(|(k, _)| *k != "WALBOX_CONFIG" && *k != "WALBOX_RABBITMQ_PASSWORD")
        .chain([("WALBOX_CONFIG", wrong)])
        .collect();
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'k', 'E', '{}')",
    )
    .await
    .unwrap();
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_ne!(status.code(), Some(0), "{log}");
    assert!(log.contains("refused walbox's credentials"), "{log}");
    assert!(log.contains("walbox-user"), "{log}");
    assert!(
        !log.contains("wrong-77aa") && !log.contains("right-5b1f"),
        "{log}"
    );
    drop(pg);
}

async fn outbox_count(db: &tokio_postgres::Client) -> i64 {
    db.query_one("SELECT count(*) FROM outbox", &[])
        .await
        .unwrap()
        .get(0)
}

/// Everything `stream` holds, as records (key from `walbox_key`, headers
/// from the application properties).
async fn read_stream(
    node: &walbox_testkit::RabbitMq,
    stream: &str,
) -> Vec<walbox_testkit::kafka::Record> {
    let config = walbox_sink::RabbitMqSinkConfig {
        mode: walbox_sink::RabbitMqMode::Stream,
        port: Some(node.amqp_port()),
        stream_port: Some(node.stream_port()),
        ..Default::default()
    };
    let mut out = Vec::new();
    walbox_sink::read_rabbit_stream(&config, stream, Duration::from_secs(10), |r| {
        let headers = [
            "event_id",
            "walbox_commit_lsn",
            "walbox_index",
            "walbox_producer",
            "walbox_publishing_id",
        ]
        .iter()
        .filter_map(|n| {
            r.header(n)
                .map(|v| ((*n).to_owned(), Some(v.as_bytes().to_vec())))
        })
        .collect();
        out.push(walbox_testkit::kafka::Record {
            topic: stream.to_owned(),
            partition: 0,
            offset: r.offset(),
            key: r.key().map(<[u8]>::to_vec),
            headers,
            value: r.value().map(<[u8]>::to_vec),
        });
    })
    .await
    .unwrap();
    out
}

/// Each event of the table once in the stream, in per-key order.
fn assert_exactly_once(
    records: &[walbox_testkit::kafka::Record],
    ids: &std::collections::HashSet<String>,
) {
    let mut seen = std::collections::HashSet::new();
    for r in records {
        let id = header(r, "event_id").expect("event_id");
        assert!(seen.insert(id.to_owned()), "event {id} stored twice");
    }
    let missing = ids.iter().filter(|id| !seen.contains(*id)).count();
    assert_eq!(missing, 0, "missing events");
    assert_eq!(seen.len(), ids.len());
    assert_per_key_order(records, false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_kill_9_rounds_under_four_writers_store_each_event_exactly_once_in_key_order() {
    let node = node().read().await;
    let (pg, db, env) = servers_rabbitmq(
        &node,
        "mode = \"stream\"\ndeclare = true\nproducer = \"kill9\"",
    )
    .await;
    // The stream is named by the topic; this test's topic is its own.
    let env: Vec<(&str, String)> = env
        .into_iter()
        .chain([("WALBOX_TOPIC", "kill9s.{aggregate_type}".to_owned())])
        .collect();
    setup(&env);
    let stop = Arc::new(AtomicBool::new(false));
    let writers = four_writers(&pg, Arc::clone(&stop)).await;
    kill_9_rounds(&pg, &db, &env, 5).await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    let written = stop_writers(&stop, writers).await;
    caught_up(&db, &walbox).await;
    let log = walbox.log();
    walbox.stop();
    let records = read_stream(&node, "kill9s.order").await;
    let ids = outbox_ids(&db).await;
    assert_eq!(ids.len(), written);
    assert_exactly_once(&records, &ids);
    assert!(
        log.contains("those are not sent again") || records.len() == written,
        "{log}"
    );
    let (status, out, err) = walbox_cmd(&["verify"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("missing          0"), "{out}");
    assert!(out.contains("duplicated       0"), "{out}");
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_producer_with_walbox_s_name_is_refused_naming_the_stream_and_the_name() {
    let node = node().read().await;
    // Another publisher took the name walbox's first epoch would use.
    node.publish_to_stream("taken.order", "taken.0", 1 << 40, b"{}")
        .await
        .unwrap();
    let (pg, db, env) = servers_rabbitmq(&node, "mode = \"stream\"\nproducer = \"taken\"").await;
    let env: Vec<(&str, String)> = env
        .into_iter()
        .chain([("WALBOX_TOPIC", "taken.{aggregate_type}".to_owned())])
        .collect();
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'k', 'E', '{\"seq\": 0}')",
    )
    .await
    .unwrap();
    let committed = current_lsn(&db).await;
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_ne!(status.code(), Some(0), "{log}");
    assert!(
        log.contains("another producer uses the name taken.0"),
        "{log}"
    );
    assert!(log.contains("stream taken.order"), "{log}");
    assert!(confirmed_lsn(&db, "walbox").await < committed);
    // Nothing of walbox's was stored.
    assert_eq!(read_stream(&node, "taken.order").await.len(), 1);
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_node_killed_9_and_restarted_under_writers_loses_nothing_acknowledged_and_stores_nothing_twice()
 {
    let mut node = node().write().await;
    let (pg, db, env) = servers_rabbitmq(
        &node,
        "mode = \"stream\"\ndeclare = true\nproducer = \"crash\"\nconfirm_timeout_ms = 3000",
    )
    .await;
    let env: Vec<(&str, String)> = env
        .into_iter()
        .chain([("WALBOX_TOPIC", "crashs.{aggregate_type}".to_owned())])
        .collect();
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    let stop = Arc::new(AtomicBool::new(false));
    let writers = four_writers(&pg, Arc::clone(&stop)).await;
    wait_slot_moves(&db, confirmed_lsn(&db, "walbox").await).await;
    node.kill9().unwrap();
    let rows = outbox_count(&db).await;
    walbox_testkit::wait_until_async(
        "writes while the node is down",
        Duration::from_secs(60),
        || async { (outbox_count(&db).await >= rows + 200).then_some(()) },
    )
    .await
    .unwrap();
    node.start_again().unwrap();
    let before = confirmed_lsn(&db, "walbox").await;
    walbox_testkit::wait_until_async(
        "the slot to move after the restart",
        Duration::from_secs(60),
        || async { (confirmed_lsn(&db, "walbox").await > before).then_some(()) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    let written = stop_writers(&stop, writers).await;
    caught_up(&db, &walbox).await;
    assert!(walbox.running(), "{}", walbox.log());
    walbox.stop();
    let records = read_stream(&node, "crashs.order").await;
    let ids = outbox_ids(&db).await;
    assert_eq!(ids.len(), written);
    assert_exactly_once(&records, &ids);
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exchange_dead_letters_are_replayed_from_their_queue_after_a_fix_and_leave_it() {
    let node = node().read().await;
    node.declare_exchange("dlx", "topic").await.unwrap();
    node.bind_queue("dlx.main", "dlx", "outbox.#")
        .await
        .unwrap();
    node.bind_queue("dlx.dead", "dlx", "#.dlq").await.unwrap();
    let (pg, db, env) = servers_rabbitmq(
        &node,
        "exchange = \"dlx\"\ndead_letter_queue = \"dlx.dead\"",
    )
    .await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    // A row that cannot name its topic is dead-lettered; the next one is published.
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('bad type', 'k', 'E', '{\"seq\": 0}');
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('order', 'k2', 'E', '{\"seq\": 0}');",
    )
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    walbox.stop();
    let dead = node.read_queue("dlx.dead").await.unwrap();
    assert_eq!(dead.len(), 1, "{}", walbox.log());
    assert!(dead[0].topic.ends_with(".dlq"), "{:?}", dead[0].topic);
    assert_eq!(node.read_queue("dlx.main").await.unwrap().len(), 1);

    // Unfixed, it still fails and stays in the queue.
    let (code, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert_eq!(node.read_queue("dlx.dead").await.unwrap().len(), 1);
    // Fixed in the table: published to its topic, gone from the queue.
    db.batch_execute(
        "UPDATE outbox SET aggregate_type = 'order' WHERE aggregate_type = 'bad type'",
    )
    .await
    .unwrap();
    let (code, out, err) = walbox_cmd(&["dlq", "replay", "--from-table"], &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("replayed 1 dead letters; 0 still failing"),
        "{out}"
    );
    let main = node.read_queue("dlx.main").await.unwrap();
    assert_eq!(main.len(), 2);
    assert_eq!(header(&main[1], "event_id"), header(&dead[0], "event_id"));
    assert_eq!(main[1].topic, "outbox.order");
    assert!(node.read_queue("dlx.dead").await.unwrap().is_empty());
    let (code, out, _) = walbox_cmd(&["dlq", "replay", "--from-table"], &env);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("replayed 0 dead letters"), "{out}");
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_a_replay_stores_the_range_again_under_its_own_names_and_once_when_run_again() {
    let node = node().read().await;
    let (pg, db, env) = servers_rabbitmq(
        &node,
        "mode = \"stream\"\ndeclare = true\nproducer = \"rp\"\n\n[source]\nreplay_window = \"1h\"",
    )
    .await;
    let env: Vec<(&str, String)> = env
        .into_iter()
        .chain([("WALBOX_TOPIC", "replays.{aggregate_type}".to_owned())])
        .collect();
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 1, 5, 10, 5).await; // 50 events
    let from = current_lsn(&db).await;
    write_events_from(&pg, 1, 3, 10, 5, 5).await; // 30 more
    wait_checkpoint(&pg, current_lsn(&db).await, Duration::from_secs(60)).await;
    walbox.stop();
    assert_eq!(
        read_stream(&node, "replays.order").await.len(),
        80,
        "{}",
        walbox.log()
    );
    let (from, to) = (from.to_string(), checkpoint(&pg).unwrap().lsn.to_string());
    let args = ["replay", "--from", from.as_str(), "--to", to.as_str()];
    let (code, out, err) = walbox_cmd(&args, &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    let records = read_stream(&node, "replays.order").await;
    assert_eq!(records.len(), 110, "{out}\n{err}");
    let replayed: Vec<_> = records[80..]
        .iter()
        .map(|r| header(r, "walbox_producer").unwrap_or_default().to_owned())
        .collect();
    assert!(
        replayed
            .iter()
            .all(|n| n.starts_with(&format!("rp.replay.{from}"))),
        "{replayed:?}"
    );
    // Run again: the broker drops what the first run stored, reported as such.
    let (code, out, err) = walbox_cmd(&args, &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert_eq!(
        read_stream(&node, "replays.order").await.len(),
        110,
        "{out}\n{err}"
    );
    assert!(out.contains("already"), "{out}");
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_client_certificate_is_used_in_exchange_mode_and_required() {
    let node = node().read().await;
    node.declare_exchange("tls", "topic").await.unwrap();
    node.bind_queue("tls.all", "tls", "#").await.unwrap();
    let t = node.tls();
    let tls = format!(
        "exchange = \"tls\"\ntls = true\nca_file = \"{}\"\nclient_cert = \"{}\"\nclient_key = \"{}\"",
        t.ca_cert.display(),
        t.client_cert.display(),
        t.client_key.display()
    );
    let (pg, db, env) = servers_rabbitmq(&node, &tls).await;
    // The TLS port, in place of the plain one the helper gave.
    let config = config_file(
        &pg,
        "tls.toml",
        &format!(
            "[sink]\ntype = \"rabbitmq\"\n[sink.rabbitmq]\nhost = \"127.0.0.1\"\nport = {}\n{tls}\n",
            node.amqps_port()
        ),
    );
    let env: Vec<(&str, String)> = env
        .into_iter()
        .filter(|(k, _)| *k != "WALBOX_CONFIG")
        .chain([("WALBOX_CONFIG", config)])
        .collect();
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 1, 2, 5, 3).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    assert!(walbox.log().contains("tls://127.0.0.1"), "{}", walbox.log());
    assert_eq!(node.read_queue("tls.all").await.unwrap().len(), 10);
    // Without the client certificate the broker refuses the connection:
    // walbox retries, the position stays.
    let bare = config_file(
        &pg,
        "bare.toml",
        &format!(
            "[sink]\ntype = \"rabbitmq\"\n[sink.rabbitmq]\nport = {}\nexchange = \"tls\"\n\
             tls = true\nca_file = \"{}\"\n",
            node.amqps_port(),
            t.ca_cert.display()
        ),
    );
    let env: Vec<(&str, String)> = env
        .into_iter()
        .filter(|(k, _)| *k != "WALBOX_CONFIG")
        .chain([("WALBOX_CONFIG", bare)])
        .collect();
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events_from(&pg, 1, 1, 1, 1, 50).await;
    let committed = current_lsn(&db).await;
    walbox_testkit::wait_until("a refused TLS session", Duration::from_secs(60), || {
        (walbox.log().matches("session ended").count() >= 2).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    assert!(confirmed_lsn(&db, "walbox").await < committed);
    walbox.stop();
    assert_eq!(node.read_queue("tls.all").await.unwrap().len(), 10);
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_client_certificate_is_used_in_stream_mode() {
    let node = node().read().await;
    let t = node.tls();
    let (pg, db, env) = servers_rabbitmq(&node, "").await;
    let config = config_file(
        &pg,
        "stls.toml",
        &format!(
            "[sink]\ntype = \"rabbitmq\"\n[sink.rabbitmq]\nmode = \"stream\"\ndeclare = true\n\
             host = \"127.0.0.1\"\nstream_port = {}\ntls = true\nca_file = \"{}\"\n\
             client_cert = \"{}\"\nclient_key = \"{}\"\n",
            node.stream_tls_port(),
            t.ca_cert.display(),
            t.client_cert.display(),
            t.client_key.display()
        ),
    );
    let env: Vec<(&str, String)> = env
        .into_iter()
        .filter(|(k, _)| *k != "WALBOX_CONFIG")
        .chain([
            ("WALBOX_CONFIG", config),
            ("WALBOX_TOPIC", "stls.{aggregate_type}".to_owned()),
        ])
        .collect();
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 1, 2, 5, 3).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    assert_eq!(
        read_stream(&node, "stls.order").await.len(),
        10,
        "{}",
        walbox.log()
    );
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_dead_letters_are_replayed_after_a_fix_each_under_a_name_of_its_own_once() {
    let node = node().read().await;
    let (pg, db, env) = servers_rabbitmq(
        &node,
        "mode = \"stream\"\ndeclare = true\nproducer = \"dl\"\n\n[dead_letter]\ntopic = \"dls.{topic}.dlq\"",
    )
    .await;
    let env: Vec<(&str, String)> = env
        .into_iter()
        .chain([("WALBOX_TOPIC", "dls.{aggregate_type}".to_owned())])
        .collect();
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('bad type', 'k', 'E', '{\"seq\": 0}');
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('order', 'k2', 'E', '{\"seq\": 0}');",
    )
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    walbox.stop();
    let dlq = "dls.walbox.public.outbox.dlq";
    let dead = read_stream(&node, dlq).await;
    assert_eq!(dead.len(), 1, "{}", walbox.log());
    assert_eq!(read_stream(&node, "dls.order").await.len(), 1);
    // Unfixed: still fails, nothing recorded.
    let (code, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(code, Some(1), "{out}\n{err}");
    db.batch_execute(
        "UPDATE outbox SET aggregate_type = 'order' WHERE aggregate_type = 'bad type'",
    )
    .await
    .unwrap();
    let (code, out, err) = walbox_cmd(&["dlq", "replay", "--from-table"], &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("replayed 1 dead letters; 0 still failing"),
        "{out}\n{err}"
    );
    let main = read_stream(&node, "dls.order").await;
    assert_eq!(main.len(), 2);
    assert_eq!(header(&main[1], "event_id"), header(&dead[0], "event_id"));
    assert!(
        header(&main[1], "walbox_producer").is_some_and(|n| n.starts_with("dl.replay.dlq.")),
        "{:?}",
        main[1].headers
    );
    // Done: a second run has nothing to do; the letter stays in its stream.
    let (code, out, _) = walbox_cmd(&["dlq", "replay", "--from-table"], &env);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("replayed 0 dead letters"), "{out}");
    assert_eq!(read_stream(&node, "dls.order").await.len(), 2);
    assert_eq!(read_stream(&node, dlq).await.len(), 1);
    drop(pg);
}

/// An event at `(lsn, index)` for `stream`, with its event id as a header.
fn stream_event(stream: &str, id: &str, lsn: u64, index: u32) -> walbox_outbox::Event {
    walbox_outbox::Event {
        event_id: id.to_owned(),
        topic: stream.to_owned(),
        key: Some(bytes::Bytes::from_static(b"k")),
        value: bytes::Bytes::from_static(b"{}"),
        json_value: true,
        headers: vec![(
            walbox_outbox::header::EVENT_ID.into(),
            bytes::Bytes::from(id.to_owned()),
        )],
        position: walbox_outbox::Position {
            commit_lsn: walbox_pgoutput::Lsn(lsn),
            index,
            xid: 7,
        },
        origin: walbox_outbox::Origin::Stream,
    }
}

/// A sink's settings against `node`: in stream mode, `name` is the producer
/// name; in exchange mode, the exchange it publishes to.
fn sink_config(
    node: &walbox_testkit::RabbitMq,
    mode: walbox_sink::RabbitMqMode,
    name: &str,
) -> walbox_sink::RabbitMqSinkConfig {
    let mut config = walbox_sink::RabbitMqSinkConfig {
        mode,
        port: Some(node.amqp_port()),
        stream_port: Some(node.stream_port()),
        declare: true,
        ..Default::default()
    };
    match mode {
        walbox_sink::RabbitMqMode::Stream => {
            config.producer = Some(name.to_owned());
            config.confirm_timeout_ms = 5_000;
        }
        walbox_sink::RabbitMqMode::Exchange => {
            config.exchange = name.to_owned();
            config.confirm_timeout_ms = 30_000;
        }
    }
    config
}

/// Sends `events` through a new sink in `mode` (see [`sink_config`] for
/// `name`) and returns each delivery's outcome, in token order, and how
/// many were dropped as duplicates.
async fn send_through_sink(
    node: &walbox_testkit::RabbitMq,
    mode: walbox_sink::RabbitMqMode,
    name: &str,
    events: Vec<walbox_outbox::Event>,
) -> (Vec<Result<(), walbox_sink::DeliveryClass>>, u64) {
    use walbox_sink::Sink as _;
    let config = sink_config(node, mode, name);
    let (mut sink, mut deliveries) = walbox_sink::RabbitMqSink::new(config).unwrap();
    let n = events.len();
    for (token, e) in events.into_iter().enumerate() {
        sink.send(e, token).await.unwrap();
    }
    sink.end_batch();
    let mut out = vec![None; n];
    for _ in 0..n {
        let d = tokio::time::timeout(Duration::from_secs(60), deliveries.recv())
            .await
            .expect("a delivery in time")
            .expect("the sink is alive");
        out[d.token] = Some(d.result.map_err(|e| e.class));
    }
    let duplicates = sink.duplicates();
    (out.into_iter().map(Option::unwrap).collect(), duplicates)
}

/// [`send_through_sink`] in stream mode, under the producer name `producer`.
async fn send_through_stream_sink(
    node: &walbox_testkit::RabbitMq,
    producer: &str,
    events: Vec<walbox_outbox::Event>,
) -> (Vec<Result<(), walbox_sink::DeliveryClass>>, u64) {
    send_through_sink(node, walbox_sink::RabbitMqMode::Stream, producer, events).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_an_event_below_a_name_s_sequence_counts_as_stored_only_if_the_stream_holds_it() {
    let node = node().read().await;
    let s = "history.order";
    // One history stored two events under the name.
    let first = vec![
        stream_event(s, "h1-a", 0x2000, 0),
        stream_event(s, "h1-b", 0x2000, 1),
    ];
    let (got, _) = send_through_stream_sink(&node, "hist", first).await;
    assert_eq!(got, [Ok(()), Ok(())]);
    // A resend of the first is dropped by the broker and checked: stored.
    let (got, dup) =
        send_through_stream_sink(&node, "hist", vec![stream_event(s, "h1-a", 0x2000, 0)]).await;
    assert_eq!((got, dup), (vec![Ok(())], 1));
    // Another history's event at a position below the name's sequence (a
    // restored cluster, another database under the same name) is not there:
    // it must not read as stored.
    let (got, dup) =
        send_through_stream_sink(&node, "hist", vec![stream_event(s, "h2-a", 0x1000, 0)]).await;
    assert_eq!(dup, 0);
    assert_eq!(got, [Err(walbox_sink::DeliveryClass::DuplicateId)]);
    // Nor another event at a position the stream holds.
    let (got, _) =
        send_through_stream_sink(&node, "hist", vec![stream_event(s, "h2-b", 0x2000, 0)]).await;
    assert_eq!(got, [Err(walbox_sink::DeliveryClass::DuplicateId)]);
    assert_eq!(read_stream(&node, s).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_events_under_several_producer_names_keep_their_order_in_the_stream() {
    let node = node().read().await;
    let s = "names.order";
    // Each transaction's event past 2^23 goes under its transaction's own
    // name, the next transaction's under the epoch's: two producers, each
    // on a connection of its own. The stream must hold them in send order.
    let mut events = vec![stream_event(s, "e-0", 0x1000, 0)];
    for i in 0..8u64 {
        let lsn = 0x2000 + 0x100 * i;
        events.push(stream_event(s, &format!("x-{i}"), lsn, 1 << 23));
        events.push(stream_event(s, &format!("e-{}", i + 1), lsn + 0x10, 0));
    }
    let sent: Vec<String> = events.iter().map(|e| e.event_id.clone()).collect();
    let (got, _) = send_through_stream_sink(&node, "names", events).await;
    assert!(got.iter().all(Result::is_ok), "{got:?}");
    let stored: Vec<String> = read_stream(&node, s)
        .await
        .iter()
        .map(|r| header(r, "event_id").unwrap_or_default().to_owned())
        .collect();
    assert_eq!(stored, sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exchange_returns_amid_thousands_in_flight_fail_their_own_events_and_stop_the_rest() {
    // The broker acks many publications at once; lapin hands each return to
    // whichever confirm of such a batch it resolves first. However the
    // returns and confirms interleave, no unroutable event reads as stored:
    // each one the broker sent back fails as such; after the first, what
    // was not yet started fails unsent (and is published again from the
    // acknowledged position); everything reported stored is in the queue
    // once, in order, and nothing else is.
    let node = node().read().await;
    node.declare_exchange("amid", "topic").await.unwrap();
    node.bind_queue("amid.q", "amid", "routed.#").await.unwrap();
    let n = 4_000usize;
    let unroutable = |i: usize| i % 37 == 5 || (1_000..1_003).contains(&i);
    let mut events = Vec::new();
    for i in 0..n {
        let topic = if unroutable(i) {
            "unbound.order"
        } else {
            "routed.order"
        };
        let mut e = stream_event(topic, &format!("amid-{i}"), 0x3000 + i as u64, 0);
        e.key = Some(bytes::Bytes::from(format!("k{}", i % 7)));
        events.push(e);
    }
    let (got, _) =
        send_through_sink(&node, walbox_sink::RabbitMqMode::Exchange, "amid", events).await;
    for (i, r) in got.iter().enumerate().take(5) {
        assert_eq!(*r, Ok(()), "event {i}");
    }
    assert_eq!(got[5], Err(walbox_sink::DeliveryClass::UnknownTopic));
    let mut returned = 0;
    for (i, r) in got.iter().enumerate() {
        match r {
            Ok(()) => assert!(!unroutable(i), "unroutable event {i} reported stored"),
            Err(walbox_sink::DeliveryClass::UnknownTopic) => {
                assert!(unroutable(i), "event {i}");
                returned += 1;
            }
            Err(c) => assert_eq!(*c, walbox_sink::DeliveryClass::BrokerError, "event {i}"),
        }
    }
    assert!(returned >= 1);
    let stored: Vec<String> = node
        .read_queue("amid.q")
        .await
        .unwrap()
        .iter()
        .map(|r| {
            let id = r.headers.iter().find(|(k, _)| k == "message_id");
            String::from_utf8(id.unwrap().1.clone().unwrap()).unwrap()
        })
        .collect();
    let reported: Vec<String> = (0..n)
        .filter(|i| got[*i].is_ok())
        .map(|i| format!("amid-{i}"))
        .collect();
    // Started before the first return came back, a routed event may be
    // stored though it fails unsent: stored, in order, holding every one
    // reported stored.
    let mut at = 0;
    for id in &reported {
        let found = stored[at..].iter().position(|s| s == id);
        at += found.unwrap_or_else(|| panic!("{id} reported stored, not in the queue")) + 1;
    }
    let mut sorted = stored.clone();
    sorted.sort_by_key(|id| id.trim_start_matches("amid-").parse::<usize>().unwrap());
    sorted.dedup();
    assert_eq!(sorted, stored, "in order, each once");
}
