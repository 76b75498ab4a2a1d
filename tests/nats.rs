//! walbox into NATS JetStream on a real `nats-server -js`: every event stored
//! once in per-key order with `Nats-Msg-Id` = its event id; kill -9 rounds under
//! load leave no duplicate message in the stream, and neither does nats-server
//! stopped or killed under load, whose outage the slot's position never passes;
//! a record the stream refuses
//! goes to `{subject}.dlq`; `walbox verify` audits the stream; a missing stream
//! stops walbox with what to do, and so do refused credentials.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use walbox_testkit::{NatsOptions, NatsServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_stored_once_in_per_key_order_with_their_headers_and_verify_agrees() {
    let (pg, nats, db, env) = servers_nats(CREATE).await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 2, 10, 10, 10).await;
    caught_up(&db, &walbox).await;
    let messages = read_subject(&nats, SUBJECT).await;
    assert_eq!(messages.len(), 200, "{}", walbox.log());
    assert_each_event_once(&messages, &outbox_ids(&db).await);
    assert_per_key_order_once(&messages);
    for m in &messages {
        assert_eq!(m.header("event_type"), "OrderPlaced");
        assert!(m.header("walbox_commit_lsn").contains('/'));
        m.header("walbox_index").parse::<u32>().unwrap();
        m.header("walbox_xid").parse::<u32>().unwrap();
        assert!(m.header("walbox_key").starts_with("order-"));
    }
    walbox.stop();
    let (status, out, err) = walbox_cmd(&["verify"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("missing          0"), "{out}");
    assert!(out.contains("(200 records)"), "{out}");
    // An event gone from the stream is reported missing.
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'order-x', 'OrderPlaced', '{}')",
    )
    .await
    .unwrap();
    let (status, out, _) = walbox_cmd(&["verify"], &env);
    assert_ne!(status, Some(0), "{out}");
    assert!(out.contains("missing          1"), "{out}");
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_rounds_under_load_leave_no_duplicate_message_in_the_stream() {
    let (pg, nats, db, env) = servers_nats(CREATE).await;
    setup(&env);
    let stop_writing = Arc::new(AtomicBool::new(false));
    let writer = steady_writer(&pg, Arc::clone(&stop_writing)).await;
    kill_9_rounds(&pg, &db, &env, 12).await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    stop_writing.store(true, Ordering::Relaxed);
    let written = writer.await.unwrap();
    caught_up(&db, &walbox).await;
    let log = walbox.log();
    walbox.stop();
    let messages = read_subject(&nats, SUBJECT).await;
    let ids = outbox_ids(&db).await;
    assert_eq!(ids.len(), written);
    assert_eq!(messages.len(), written, "exactly once: {log}");
    assert_each_event_once(&messages, &ids);
    assert_per_key_order_once(&messages);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_stream_refuses_goes_to_the_dead_letter_subject() {
    let (pg, nats, db, env) = servers_nats("stream = \"EVENTS\"").await;
    // A stream of the operator's, with a message size limit.
    events_stream(&nats, 4096, 600).await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', 'k', 'Small', '{\"seq\": 0}');
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', 'k', 'Large', jsonb_build_object('blob', repeat('x', 8000)));
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', 'k', 'Small', '{\"seq\": 1}');",
    )
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    let log = walbox.log();
    walbox.stop();
    let stored = read_subject(&nats, SUBJECT).await;
    let types: Vec<&str> = stored.iter().map(|m| m.header("event_type")).collect();
    assert_eq!(types, ["Small", "Small"], "{log}");
    let dead = read_subject(&nats, "outbox.order.dlq").await;
    assert_eq!(dead.len(), 1, "{log}");
    let large = db
        .query_one(
            "SELECT id::text FROM outbox WHERE event_type = 'Large'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, String>(0);
    assert_eq!(dead[0].header("event_id"), large);
    assert!(log.contains("message_too_large"), "{log}");
    let (status, out, err) = walbox_cmd(&["verify"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("dead-lettered    1"), "{out}");
    drop(pg);
}

/// A stream made with a 2-minute duplicate window (the `nats` CLI's default, and
/// what streams made before walbox's default grew have): with
/// `duplicate_window_s` left unset walbox relays into it and warns, naming the
/// fix; set to more than the stream keeps, it is refused, naming the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_with_a_shorter_window_is_used_with_a_warning_unless_a_window_is_set() {
    let (pg, nats, db, env) = servers_nats("stream = \"EVENTS\"").await;
    events_stream(&nats, -1, 120).await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'k', 'E', '{}')",
    )
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    assert_eq!(read_subject(&nats, "outbox.order").await.len(), 1);
    let log = walbox.log();
    assert!(
        log.contains("keeps message ids for less than walbox's default duplicate window")
            && log.contains("--dupe-window 600s"),
        "{log}"
    );
    walbox.stop();
    let explicit = config_file(
        &pg,
        "explicit.toml",
        &format!(
            "[sink]\ntype = \"nats\"\n\n[sink.nats]\nservers = [\"{}\"]\nstream = \"EVENTS\"\n\
             duplicate_window_s = 600\n",
            nats.url()
        ),
    );
    let mut env = env;
    env.retain(|(k, _)| *k != "WALBOX_CONFIG");
    env.push(("WALBOX_CONFIG", explicit));
    let mut refused = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'k', 'E', '{}')",
    )
    .await
    .unwrap();
    let status = refused.wait(Duration::from_secs(60));
    let log = refused.log();
    assert_ne!(status.code(), Some(0), "{log}");
    assert!(log.contains("keeps message ids for 120 s"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_stream_stops_walbox_with_what_to_do() {
    let (pg, _nats, db, env) = servers_nats("stream = \"NOPE\"").await;
    setup(&env);
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
    assert!(log.contains("no JetStream stream holds"), "{log}");
    assert!(log.contains("create_stream = true"), "{log}");
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_stop_walbox_without_printing_the_password() {
    let (_pg, _nats, db, env) = servers_nats_with(
        NatsOptions {
            user: Some(("walbox".into(), "right-7c1e".into())),
            token: None,
        },
        &format!("{CREATE}\nuser = \"walbox\"\npassword = \"wrong-93d2\""),
    )
    .await;
    setup(&env);
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
    assert!(log.contains("user \"walbox\""), "{log}");
    assert!(
        !log.contains("wrong-93d2") && !log.contains("right-7c1e"),
        "{log}"
    );
}

/// The sequence of the first message stream `OUTBOX` stored after `instant`
/// (the server's clock is this machine's), or one past its last message.
async fn first_sequence_after(nats: &NatsServer, instant: std::time::SystemTime) -> i64 {
    let nanos = |t: std::time::SystemTime| {
        i128::try_from(t.duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()).unwrap()
    };
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let mut stream = js.get_stream("OUTBOX").await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    // Stored times grow with the sequence: the first one past `instant`.
    let (mut low, mut high) = (1u64, last + 1);
    while low < high {
        let middle = low + (high - low) / 2;
        let stored = stream.get_raw_message(middle).await.unwrap();
        if stored.time.unix_timestamp_nanos() > nanos(instant) {
            high = middle;
        } else {
            low = middle + 1;
        }
    }
    i64::try_from(low).unwrap()
}

async fn outbox_count(db: &tokio_postgres::Client) -> i64 {
    db.query_one("SELECT count(*) FROM outbox", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_stopped_or_killed_under_load_loses_nothing_and_stores_nothing_twice() {
    let (pg, mut nats, db, env) = servers_nats(&format!(
        "{CREATE}\nstorage = \"file\"\nack_timeout_ms = 2000"
    ))
    .await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    let stop_writing = Arc::new(AtomicBool::new(false));
    let writer = steady_writer(&pg, Arc::clone(&stop_writing)).await;
    // Per outage: when the server went down, and the slot's confirmed
    // positions sampled while it was down.
    let mut outages = Vec::new();
    for kill in [false, true] {
        wait_slot_moves(&db, confirmed_lsn(&db, "walbox").await).await;
        let ended = sessions_ended(&walbox);
        let rows = outbox_count(&db).await;
        if kill {
            nats.kill9().unwrap();
        } else {
            nats.stop().unwrap();
        }
        let down = std::time::SystemTime::now();
        let samples = std::cell::RefCell::new(Vec::new());
        // Stopped: until walbox gave up its session (PubAcks time out after
        // 2 s) and writers committed more. Killed: until writers committed
        // more, then the server comes back at once, within the session.
        walbox_testkit::wait_until_async(
            "the outage's commits (and, stopped, the session's end)",
            Duration::from_secs(60),
            || async {
                let confirmed = confirmed_lsn(&db, "walbox").await;
                samples.borrow_mut().push(confirmed);
                let more = outbox_count(&db).await >= rows + 200;
                let session_over = kill || sessions_ended(&walbox) > ended;
                (more && session_over && samples.borrow().len() >= 10).then_some(())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
        assert!(walbox.running(), "{}", walbox.log());
        nats.start_again().unwrap();
        outages.push((down, samples.into_inner()));
    }
    wait_slot_moves(&db, confirmed_lsn(&db, "walbox").await).await;
    stop_writing.store(true, Ordering::Relaxed);
    let written = writer.await.unwrap();
    caught_up(&db, &walbox).await;
    let log = walbox.log();
    walbox.stop();
    let messages = read_subject(&nats, SUBJECT).await;
    let ids = outbox_ids(&db).await;
    assert_eq!(ids.len(), written);
    assert_eq!(messages.len(), written, "exactly once: {log}");
    assert_each_event_once(&messages, &ids);
    assert_per_key_order_once(&messages);
    // While the server was down the stream could take nothing: each position
    // confirmed then lies at or before the first commit stored after the
    // outage began.
    for (n, (down, samples)) in outages.iter().enumerate() {
        let boundary = first_sequence_after(&nats, *down).await;
        let first_after: walbox_pgoutput::Lsn = messages
            .iter()
            .filter(|m| m.sequence >= boundary)
            .map(|m| m.header("walbox_commit_lsn").parse().unwrap())
            .min()
            .unwrap_or_else(|| panic!("outage {n}: nothing stored after it"));
        let highest = samples.iter().max().unwrap();
        assert!(
            *highest <= first_after,
            "outage {n}: confirmed {highest} while the server was down, past {first_after}, \
             which the stream did not hold yet: {log}"
        );
    }
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_replayed_to_their_subject_after_a_fix_once_and_kept() {
    let (pg, nats, db, env) = servers_nats("stream = \"EVENTS\"").await;
    let (js, mut stream_config) = events_stream(&nats, 4096, 600).await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', 'k', 'Small', '{\"seq\": 0}');
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', 'k', 'Large', jsonb_build_object('blob', repeat('x', 8000)));",
    )
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    walbox.stop();
    let dead = read_subject(&nats, "outbox.order.dlq").await;
    assert_eq!(dead.len(), 1, "{}", walbox.log());

    // Unfixed, the letter still fails; a dry run publishes and records nothing.
    let (code, out, err) = walbox_cmd(&["dlq", "replay", "--dry-run"], &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("would replay 1 dead letters"), "{out}");
    let (code, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(err.contains("message_too_large"), "{out}\n{err}");
    assert_eq!(read_subject(&nats, SUBJECT).await.len(), 1);

    // The stream's limit raised: the event is stored under its own id.
    stream_config.max_message_size = 65536;
    js.update_stream(stream_config).await.unwrap();
    let (code, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("replayed 1 dead letters; 0 still failing"),
        "{out}"
    );
    let stored = read_subject(&nats, SUBJECT).await;
    let types: Vec<&str> = stored.iter().map(|m| m.header("event_type")).collect();
    assert_eq!(types, ["Small", "Large"]);
    let replayed = &stored[1];
    let id = dead[0].header("event_id");
    assert_eq!(replayed.header("event_id"), id);
    assert_eq!(replayed.header("Nats-Msg-Id"), id);
    assert_eq!(
        replayed.header("walbox_commit_lsn"),
        dead[0].header("walbox_commit_lsn")
    );
    assert_eq!(
        replayed.value["payload"]["blob"].as_str().unwrap().len(),
        8000
    );
    // Kept on the dead-letter subject; a second run has nothing left to do.
    assert_eq!(read_subject(&nats, "outbox.order.dlq").await.len(), 1);
    let (code, out, _) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("replayed 0 dead letters"), "{out}");
    assert_eq!(read_subject(&nats, SUBJECT).await.len(), 2);
    // With a sink that stores nothing, the command says what to set.
    let (code, _, err) = walbox_cmd(&["dlq", "replay", "--sink", "stdout"], &env);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("type = \"stdout\" stores none") && err.contains("\"nats\""),
        "{err}"
    );
    drop(pg);
}

/// Publishes one message of another publisher to `subject`.
async fn publish_foreign(nats: &NatsServer, subject: &str, id: &str) {
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", id);
    js.publish_with_headers(subject.to_owned(), headers, "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_publisher_is_refused_within_a_session_and_never_reorders_walbox_events() {
    let (pg, nats, db, env) = servers_nats(CREATE).await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events_from(&pg, 1, 2, 5, 5, 0).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    // Between sessions: the next session's first publication carries no
    // expectation and lands after the other publisher's message.
    publish_foreign(&nats, SUBJECT, "foreign-1").await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events_from(&pg, 1, 2, 5, 5, 5).await;
    caught_up(&db, &walbox).await;
    assert_eq!(sessions_ended(&walbox), 0, "{}", walbox.log());
    // Within a session: walbox's next publication, chained to its last one,
    // is refused; the session ends and the next one publishes the rest.
    publish_foreign(&nats, SUBJECT, "foreign-2").await;
    write_events_from(&pg, 1, 2, 5, 5, 10).await;
    caught_up(&db, &walbox).await;
    let log = walbox.log();
    walbox.stop();
    assert!(sessions_ended(&walbox) >= 1, "{log}");
    assert!(
        log.contains("another publisher wrote to the stream (walbox must be its only publisher)"),
        "{log}"
    );
    let messages = read_subject(&nats, SUBJECT).await;
    let (ours, theirs): (Vec<Stored>, Vec<Stored>) = messages
        .into_iter()
        .partition(|m| m.headers.contains_key("event_id"));
    let foreign: Vec<&str> = theirs.iter().map(|m| m.header("Nats-Msg-Id")).collect();
    assert_eq!(foreign, ["foreign-1", "foreign-2"]);
    assert_each_event_once(&ours, &outbox_ids(&db).await);
    assert_per_key_order_once(&ours);
    // The first session's events, the first foreign message, the second
    // session's: stream order is publishing order.
    assert!(ours[9].sequence < theirs[0].sequence && theirs[0].sequence < ours[10].sequence);
    drop(pg);
}

/// A configuration for the replay tests: the replay window kept for an hour,
/// and `max_in_flight` events at a time (1: a replay slow enough to be killed
/// half-way).
fn replay_config(
    pg: &walbox_testkit::PgCluster,
    nats: &NatsServer,
    max_in_flight: usize,
) -> String {
    config_file(
        pg,
        &format!("replay-{max_in_flight}.toml"),
        &format!(
            "[sink]\ntype = \"nats\"\nmax_in_flight = {max_in_flight}\n\n[sink.nats]\nservers = \
             [\"{}\"]\n{CREATE}\n\n[source]\nreplay_window = \"1h\"\n",
            nats.url()
        ),
    )
}

/// How many messages stream `OUTBOX` holds.
async fn stream_messages(nats: &NatsServer) -> u64 {
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let mut stream = js.get_stream("OUTBOX").await.unwrap();
    stream.info().await.unwrap().state.messages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_stores_the_range_again_once_even_when_killed_and_run_again() {
    let (pg, nats, db, env) = servers_nats(CREATE).await;
    let cfg = replay_config(&pg, &nats, 10_000);
    let slow = replay_config(&pg, &nats, 1);
    setup(&env);
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    write_events(&pg, 2, 10, 10, 10).await; // 200 events
    let from = current_lsn(&db).await;
    write_events_from(&pg, 2, 100, 10, 10, 10).await; // 2000 more, keys 10..19
    // The replay window holds the slot back: wait for the checkpoint.
    wait_checkpoint(&pg, current_lsn(&db).await, Duration::from_secs(60)).await;
    walbox.stop();
    let before = read_subject(&nats, SUBJECT).await;
    assert_eq!(before.len(), 2200, "{}", walbox.log());
    let (from, to) = (from.to_string(), checkpoint(&pg).unwrap().lsn.to_string());
    let replay_args = ["replay", "--from", from.as_str(), "--to", to.as_str()];

    // A consumer lost what was committed after `from`: replay it, and kill
    // the replay half-way.
    let mut replay = Walbox::spawn(&[&replay_args[..], &["--config", &slow]].concat(), &env);
    walbox_testkit::wait_until_async(
        "the killed replay to have stored part of the range",
        Duration::from_secs(60),
        || async { (stream_messages(&nats).await >= 2200 + 300).then_some(()) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", replay.log()));
    replay.kill9();
    let partial = stream_messages(&nats).await;
    assert!(
        partial > 2200 && partial < 2200 + 2000,
        "the kill came when the replay had stored {} of 2000: {}",
        partial - 2200,
        replay.log()
    );
    wait_slot_released(&db, "walbox").await;

    // walbox runs again before the replay is run again: rows written now are
    // stored after the killed replay's copies.
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    write_events_from(&pg, 1, 5, 10, 5, 20).await;
    wait_checkpoint(&pg, current_lsn(&db).await, Duration::from_secs(60)).await;
    walbox.stop();
    assert_eq!(
        stream_messages(&nats).await,
        partial + 50,
        "{}",
        walbox.log()
    );

    // Run again with the same --from: what the killed run stored is not
    // stored twice, the rest is stored, each once.
    let (code, out, err) = walbox_cmd(&[&replay_args[..], &["--config", &cfg]].concat(), &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    // The events the killed run stored are not counted as replayed.
    let number = |before: &str| -> u64 {
        let at = out
            .find(before)
            .unwrap_or_else(|| panic!("{before}: {out}\n{err}"));
        let digits: String = out[at + before.len()..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().unwrap()
    };
    let stored = number("replayed ");
    let already = number("; ");
    assert!(
        out.contains("events already stored by an earlier run of this replay"),
        "{out}"
    );
    assert!(already >= 300 && stored + already == 2000, "{out}");
    let after = read_subject(&nats, SUBJECT).await;
    assert_eq!(after.len(), 4250, "{out}\n{err}");
    let mut copies: HashMap<String, Vec<&Stored>> = HashMap::new();
    for m in &after {
        copies
            .entry(m.header("event_id").to_owned())
            .or_default()
            .push(m);
    }
    let replayed: HashSet<&str> = before[200..].iter().map(|m| m.header("event_id")).collect();
    for m in &before {
        let id = m.header("event_id");
        let c = &copies[id];
        if replayed.contains(id) {
            assert_eq!(c.len(), 2, "event {id}: stored {} times", c.len());
            // The copy keeps the event id and the position; its message id
            // is the replay's own.
            assert_eq!(c[0].header("Nats-Msg-Id"), id);
            assert_ne!(c[1].header("Nats-Msg-Id"), id);
            assert_eq!(
                c[1].header("walbox_commit_lsn"),
                c[0].header("walbox_commit_lsn")
            );
            assert_eq!(c[1].header("walbox_index"), c[0].header("walbox_index"));
        } else {
            assert_eq!(c.len(), 1, "event {id} is before the replay's start");
        }
    }
    // The rows written between are stored once.
    let between = after
        .iter()
        .filter(|m| m.sequence > 2200 && copies[m.header("event_id")].len() == 1)
        .count();
    assert_eq!(between, 50);
    // The replay copies keep each key's order (keys 10..19 start at seq 0),
    // across the kill.
    let replay_copies: Vec<Stored> = after
        .into_iter()
        .filter(|m| m.header("Nats-Msg-Id") != m.header("event_id"))
        .collect();
    assert_eq!(replay_copies.len(), 2000);
    assert_per_key_order_once(&replay_copies);
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_used_again_for_another_event_stops_walbox_naming_both_positions() {
    let (pg, nats, db, env) = servers_nats(CREATE).await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 1, 2, 5, 5).await;
    caught_up(&db, &walbox).await;
    // The lost history of a failover: the stream holds an event under the id,
    // subject and key that the next row gets, from a commit the table no
    // longer has.
    let id = "6f1c2a4e-0000-4000-8000-000000000017";
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let mut headers = async_nats::HeaderMap::new();
    for (name, value) in [
        ("Nats-Msg-Id", id),
        ("event_id", id),
        ("walbox_key", "order-7"),
        ("walbox_commit_lsn", "0/1000000"),
        ("walbox_index", "0"),
        ("walbox_xid", "1"),
    ] {
        headers.insert(name, value);
    }
    js.publish_with_headers(SUBJECT.to_owned(), headers, "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();
    walbox.stop();
    let mut walbox = Walbox::spawn(&["run"], &env);
    // Writes go on around the new event that reuses the id.
    write_events_from(&pg, 1, 1, 3, 3, 20).await;
    db.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         VALUES ($1::text::uuid, 'order', 'order-7', 'OrderPlaced', '{\"seq\": 0}')",
        &[&id],
    )
    .await
    .unwrap();
    let after_insert = current_lsn(&db).await;
    write_events_from(&pg, 1, 1, 3, 3, 30).await;
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_ne!(status.code(), Some(0), "walbox must stop: {log}");
    assert!(log.contains("duplicate_id"), "{log}");
    assert!(
        log.contains("commit LSN 0/1000000, index 0"),
        "the stored event: {log}"
    );
    assert!(
        log.contains(&format!("dropped event {id} (commit LSN ")),
        "the new event: {log}"
    );
    assert!(log.contains("synchronized_standby_slots"), "{log}");
    // Not counted as stored: the slot stays before the new event, the stream
    // holds only the foreign copy under that id.
    assert!(confirmed_lsn(&db, "walbox").await < after_insert, "{log}");
    let stored = read_subject(&nats, SUBJECT).await;
    let under_id: Vec<&Stored> = stored
        .iter()
        .filter(|m| m.header("event_id") == id)
        .collect();
    assert_eq!(under_id.len(), 1);
    assert_eq!(under_id[0].header("walbox_commit_lsn"), "0/1000000");
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_replay_run_again_after_a_kill_reports_what_the_first_run_stored() {
    let (pg, nats, db, env) = servers_nats("stream = \"EVENTS\"").await;
    let (js, mut stream_config) = events_stream(&nats, 4096, 600).await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES
           ('order', 'k', 'Large', jsonb_build_object('blob', repeat('x', 8000)));",
    )
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    walbox.stop();
    let dead = read_subject(&nats, "outbox.order.dlq").await;
    assert_eq!(dead.len(), 1, "{}", walbox.log());
    stream_config.max_message_size = 65536;
    js.update_stream(stream_config).await.unwrap();
    // A first run killed after the stream stored the event and before its
    // progress was recorded: the event is stored under its id, subject, key
    // and position, and the letter is still to do.
    let id = dead[0].header("event_id");
    let mut headers = async_nats::HeaderMap::new();
    for name in [
        "event_id",
        "walbox_key",
        "walbox_commit_lsn",
        "walbox_index",
        "walbox_xid",
    ] {
        headers.insert(name, dead[0].header(name));
    }
    headers.insert("Nats-Msg-Id", id);
    js.publish_with_headers(SUBJECT.to_owned(), headers, "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();
    // The run again stores nothing twice and says so.
    let (code, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("replayed 0 dead letters; 0 still failing")
            && out.contains("; 1 already stored by an earlier run"),
        "{out}"
    );
    let stored = read_subject(&nats, SUBJECT).await;
    assert_eq!(stored.len(), 1, "{out}");
    drop(pg);
}
