//! walbox into a real HTTP receiver (the test kit's, scripted): every event
//! POSTed in per-key order, signed so that the official Standard Webhooks
//! library verifies it under each secret; kill -9 rounds under four writers
//! while the receiver fails at random lose nothing and keep per-key order;
//! one key retried for a while holds back only that key while 50 others flow;
//! `Retry-After` is honoured; a 400 dead-letters the event into the local
//! file and `walbox dlq replay` sends it again (and a file cut in place by
//! `copytruncate` from its first letter); a 410 stops walbox; TLS with
//! a custom CA and a client certificate.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use walbox_testkit::webhook::Reply;
use walbox_testkit::{Receiver, TlsFiles, wait_until};

/// `n` events per key for `keys` keys named `{prefix}{k}`, in one transaction
/// per round (each key's `seq` its commit order).
async fn insert_rounds(db: &tokio_postgres::Client, prefix: &str, keys: usize, n: usize) {
    for seq in 0..n {
        let mut sql = String::from("BEGIN;");
        for k in 0..keys {
            sql.push_str(&format!(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', '{prefix}{k}', 'OrderPlaced', '{{\"seq\": {seq}}}');"
            ));
        }
        sql.push_str("COMMIT;");
        db.batch_execute(&sql).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_arrive_in_per_key_order_signed_for_the_official_library_under_each_secret() {
    let receiver = Receiver::start().unwrap();
    let (pg, db, env) = servers_webhook(&receiver, "").await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 2, 10, 10, 10).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    let arrivals = receiver.arrivals();
    let delivered = assert_arrival_order(&arrivals);
    assert_eq!(delivered, outbox_ids(&db).await, "every event arrived");
    for a in &arrivals {
        assert_eq!(a.path, "/hooks/order");
        assert_eq!(a.header("content-type"), Some("application/json"));
        assert_eq!(a.header("event_type"), Some("OrderPlaced"));
        assert!(a.header("walbox_commit_lsn").unwrap().contains('/'));
        assert!(a.header("traceparent").unwrap().starts_with("00-"));
        // Two secrets: two signatures, one per secret.
        assert_eq!(a.header("webhook-signature").unwrap().split(' ').count(), 2);
    }
    for secret in [SECRET, SECRET_ENV] {
        let (ok, report) = verify_with_library(&arrivals, secret);
        assert!(ok, "{report}");
        assert_eq!(report.matches("ok ").count(), arrivals.len(), "{report}");
    }
    // A signature under another secret is refused: the check can fail.
    let (ok, report) = verify_with_library(&arrivals[..1], "whsec_b3RoZXIgc2VjcmV0IGhlcmU=");
    assert!(!ok, "{report}");
    // doctor checks the retry ceiling and the dead-letter file.
    let (_, out, err) = walbox_cmd(&["doctor"], &env);
    assert!(out.contains("max_retry_duration_s = 3600"), "{out}{err}");
    assert!(out.contains("(writable)"), "{out}{err}");
    // The signing secrets never reach the log.
    let log = walbox.log();
    assert!(!log.contains("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"));
    assert!(!log.contains("c2Vjb25kIHNlY3JldCBmb3Igcm90YXRpb24"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_rounds_under_four_writers_with_a_failing_receiver_lose_nothing_and_keep_key_order()
{
    let receiver = Receiver::start().unwrap();
    // Three requests in eight fail (a 500, a dropped connection, a 429); one
    // in eight is slow.
    receiver.set_script(|_| match kill_loop_random(8) {
        0 => Reply::Status(500, "busy".into()),
        1 => Reply::Reset,
        2 => Reply::Status(429, String::new()),
        3 => Reply::Slow(Duration::from_millis(100)),
        _ => Reply::Ok,
    });
    let (pg, db, env) = servers_webhook(&receiver, "").await;
    setup(&env);
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..4 {
        writers.push(keyed_writer(&pg, w, Arc::clone(&stop)).await);
    }
    // The slot's confirmed position, sampled with the time it was seen.
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let db = pg.connect("postgres").await.unwrap();
        let sampling = Arc::clone(&sampling);
        tokio::spawn(async move {
            let mut samples = Vec::new();
            while sampling.load(Ordering::Relaxed) {
                samples.push((confirmed_lsn(&db, "walbox").await, Instant::now()));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            samples
        })
    };
    kill_9_rounds(&pg, &db, &env, 6).await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    stop.store(true, Ordering::Relaxed);
    let mut written = 0;
    for w in writers {
        written += w.await.unwrap();
    }
    caught_up(&db, &walbox).await;
    walbox.stop();
    sampling.store(false, Ordering::Relaxed);
    let ids = outbox_ids(&db).await;
    assert_eq!(ids.len(), written);
    let arrivals = receiver.arrivals();
    let delivered = assert_arrival_order(&arrivals);
    // The position never passed an event before its first 2xx: every event
    // whose transaction commits below a confirmed position had been answered
    // 2xx when that position was seen.
    let mut first_2xx: HashMap<String, (walbox_pgoutput::Lsn, Instant)> = HashMap::new();
    for a in arrivals.iter().filter(|a| a.delivered()) {
        let lsn = a.header("walbox_commit_lsn").unwrap().parse().unwrap();
        first_2xx.entry(a.id.clone()).or_insert((lsn, a.at));
    }
    let samples = sampler.await.unwrap();
    assert!(samples.len() > 20, "{} samples", samples.len());
    for (confirmed, seen) in &samples {
        for (id, (lsn, at)) in &first_2xx {
            assert!(
                lsn >= confirmed || at <= seen,
                "the slot confirmed {confirmed} before event {id} (commit {lsn}) got its 2xx"
            );
        }
    }
    assert_eq!(
        delivered, ids,
        "every committed event answered 2xx at least once"
    );
    assert!(
        arrivals.iter().any(|a| !a.delivered()),
        "the receiver failed some requests"
    );
}

fn kill_loop_random(n: u64) -> u64 {
    random_below(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_retried_holds_back_only_that_key_while_50_others_flow() {
    // The stuck key's first event gets 503 for a minute (the binary's other
    // tests run meanwhile).
    const STUCK_FOR: Duration = Duration::from_secs(60);
    let receiver = Receiver::start().unwrap();
    // The clock starts at the stuck key's first request.
    let first = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let since = Arc::clone(&first);
    receiver.set_script(move |seen| {
        if seen.key != Some("stuck-0") {
            return Reply::Ok;
        }
        let mut at = since.lock().unwrap();
        if at.get_or_insert_with(Instant::now).elapsed() < STUCK_FOR {
            Reply::Status(503, String::new())
        } else {
            Reply::Ok
        }
    });
    let (_pg, db, mut env) = servers_webhook(&receiver, "").await;
    env.push(("WALBOX_METRICS_LISTEN", "127.0.0.1:0".into()));
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    insert_rounds(&db, "stuck-", 1, 5).await;
    insert_rounds(&db, "flow-", 50, 5).await;
    // The 250 others arrive while the stuck key is still refused.
    wait_until("the other keys' events", Duration::from_secs(60), || {
        let d = receiver.delivered();
        (d.iter()
            .filter(|a| a.key.as_deref() != Some("stuck-0"))
            .count()
            >= 250)
            .then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    let held = first
        .lock()
        .unwrap()
        .expect("the stuck key was tried")
        .elapsed();
    assert!(
        held < STUCK_FOR,
        "the others waited for the stuck key ({held:?})"
    );
    let stuck: Vec<_> = receiver
        .arrivals()
        .into_iter()
        .filter(|a| a.key.as_deref() == Some("stuck-0"))
        .collect();
    assert!(stuck.len() >= 2, "retried");
    assert!(
        stuck.iter().all(|a| a.id == stuck[0].id && !a.delivered()),
        "only the first event of the stuck key was tried"
    );
    let rss = rss_kb(walbox.pid());
    assert!(rss < 200_000, "RSS {rss} kB");
    // Once the receiver takes it, the stuck key's five events follow.
    wait_until(
        "the stuck key's events",
        STUCK_FOR + Duration::from_secs(60),
        || {
            let d = receiver.delivered();
            (d.iter()
                .filter(|a| a.key.as_deref() == Some("stuck-0"))
                .count()
                >= 5)
                .then_some(())
        },
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    caught_up(&db, &walbox).await;
    let arrivals = receiver.arrivals();
    let delivered = assert_arrival_order(&arrivals);
    assert_eq!(delivered.len(), 255);
    let log = walbox.log();
    assert!(log.contains("webhook delivery failed; retrying"), "{log}");
    // Each retry counted, by topic.
    let metrics =
        walbox_testkit::prometheus::get(&format!("http://{}/metrics", walbox.metrics_addr()))
            .unwrap();
    let retries: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("walbox_sink_retries_total{topic=\"outbox.order\"} "))
        .unwrap_or_else(|| panic!("{metrics}"))
        .parse()
        .unwrap();
    assert!(
        retries + 1 >= stuck.len() as u64,
        "{retries} retries, {} attempts",
        stuck.len()
    );
    walbox.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_honoured() {
    let receiver = Receiver::start().unwrap();
    receiver.set_script(|seen| {
        if seen.earlier == 0 {
            Reply::RetryAfter(2)
        } else {
            Reply::Ok
        }
    });
    let (_pg, db, env) = servers_webhook(&receiver, "").await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    insert_rounds(&db, "ra-", 1, 1).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    let a = receiver.arrivals();
    assert_eq!(a.len(), 2);
    assert_eq!(a[0].status, 429);
    let waited = a[1].at - a[0].at;
    // Without it the backoff (50 ms) would have tried again at once.
    assert!(waited >= Duration::from_millis(1900), "{waited:?}");
    // Signed again for the second attempt, with its own timestamp.
    assert_ne!(
        a[0].header("webhook-timestamp"),
        a[1].header("webhook-timestamp")
    );
    assert_ne!(
        a[0].header("webhook-signature"),
        a[1].header("webhook-signature")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_400_dead_letters_the_event_to_the_local_file_and_dlq_replay_sends_it_again() {
    let receiver = Receiver::start().unwrap();
    receiver.set_script(|seen| {
        if seen.key == Some("bad-0") {
            Reply::Status(400, "missing field \"amount\"\r\nat line 1".into())
        } else {
            Reply::Ok
        }
    });
    let (pg, db, env) = servers_webhook(&receiver, "").await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    insert_rounds(&db, "bad-", 1, 1).await;
    insert_rounds(&db, "good-", 3, 2).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    assert_eq!(receiver.delivered().len(), 6, "the others arrived");
    let letters = walbox_sink::read_letters(&dead_letter_path(&pg)).unwrap();
    assert_eq!(letters.len(), 1, "{}", walbox.log());
    let (_, letter) = &letters[0];
    assert_eq!(letter.header("walbox_error_class"), Some("http_refused"));
    let error = letter.header("walbox_error").unwrap();
    assert!(error.starts_with("HTTP 400: missing field"), "{error}");
    assert!(!error.contains('\n'), "sanitized: {error}");
    assert_eq!(letter.key.as_deref(), Some("bad-0"));
    let bad_id = letter.header("event_id").unwrap().to_owned();
    // Fixed: the receiver takes it now; replay sends it once.
    receiver.set_script(|_| Reply::Ok);
    let (status, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("replayed 1 dead letters"), "{out}");
    let again: Vec<_> = receiver
        .delivered()
        .into_iter()
        .filter(|a| a.id == bad_id)
        .collect();
    assert_eq!(again.len(), 1);
    let (status, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("replayed 0 dead letters"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_run_out_into_a_dead_letter_that_counts_the_attempts_and_describes_the_event() {
    let receiver = Receiver::start().unwrap();
    receiver.set_script(|seen| {
        if seen.key == Some("down-0") {
            Reply::Status(503, String::new())
        } else {
            Reply::Ok
        }
    });
    let (pg, db, env) = servers_webhook(&receiver, "max_retry_duration_s = 2").await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    insert_rounds(&db, "down-", 1, 1).await;
    insert_rounds(&db, "up-", 2, 1).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    let letters = walbox_sink::read_letters(&dead_letter_path(&pg)).unwrap();
    assert_eq!(letters.len(), 1, "{}", walbox.log());
    let (_, letter) = &letters[0];
    assert_eq!(
        letter.header("walbox_error_class"),
        Some("retries_exhausted")
    );
    let sent = receiver
        .arrivals()
        .into_iter()
        .filter(|a| a.key.as_deref() == Some("down-0"))
        .count();
    assert!(sent >= 2, "retried: {sent} requests");
    let error = letter.header("walbox_error").unwrap();
    assert!(
        error.contains(&format!(", {sent} attempts)")),
        "{sent} sent: {error}"
    );
    assert_eq!(
        letter.header("walbox_attempts"),
        Some(sent.to_string().as_str()),
        "{error}"
    );
    // The letter's value describes the event; its body is not kept (dlq
    // replay rebuilds it from the table).
    let value: serde_json::Value = serde_json::from_str(&letter.value).unwrap();
    let body_len = receiver
        .arrivals()
        .into_iter()
        .find(|a| a.key.as_deref() == Some("down-0"))
        .unwrap()
        .body
        .len();
    assert_eq!(
        value,
        serde_json::json!({"topic": "outbox.order", "value": null, "value_bytes": body_len}),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_file_cut_in_place_by_copytruncate_is_replayed_from_its_first_letter() {
    let receiver = Receiver::start().unwrap();
    // Each bad- event refused when it first comes, taken when replayed.
    receiver.set_script(|seen| {
        if seen.key.is_some_and(|k| k.starts_with("bad-")) && seen.earlier == 0 {
            Reply::Status(400, "refused".into())
        } else {
            Reply::Ok
        }
    });
    let (pg, db, env) = servers_webhook(&receiver, "").await;
    setup(&env);
    let file = dead_letter_path(&pg);
    let mut walbox = Walbox::spawn(&["run"], &env);
    insert_rounds(&db, "bad-", 1, 1).await;
    caught_up(&db, &walbox).await;
    let (status, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("replayed 1 dead letters"), "{out}");
    // logrotate's copytruncate while walbox runs, then two new letters: more
    // lines than the one replayed.
    let copy = file.with_extension("jsonl.1");
    std::fs::copy(&file, &copy).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(0)
        .unwrap();
    insert_rounds(&db, "bad-new-", 2, 1).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    let letters = walbox_sink::read_letters(&file).unwrap();
    assert_eq!(letters.len(), 2, "{}", walbox.log());
    assert_eq!(walbox_sink::read_letters(&copy).unwrap().len(), 1);
    let (status, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("replayed 2 dead letters"), "{out}");
    assert!(
        out.contains(&format!(
            "replaying {} from its first letter",
            file.display()
        )),
        "{out}"
    );
    for (_, letter) in &letters {
        let id = letter.header("event_id").unwrap();
        assert_eq!(
            receiver.delivered().iter().filter(|a| a.id == id).count(),
            1
        );
    }
    let (status, out, err) = walbox_cmd(&["dlq", "replay"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("replayed 0 dead letters"), "{out}");
    assert!(!out.contains("from its first letter"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_stops_walbox_and_the_position_stays_before_the_event() {
    let receiver = Receiver::start().unwrap();
    receiver.set_script(|_| Reply::Status(410, String::new()));
    let (_pg, db, env) = servers_webhook(&receiver, "").await;
    setup(&env);
    let before = confirmed_lsn(&db, "walbox").await;
    let mut walbox = Walbox::spawn(&["run"], &env);
    insert_rounds(&db, "gone-", 2, 2).await;
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_ne!(status.code(), Some(0), "{log}");
    assert!(log.contains("endpoint_gone"), "{log}");
    assert!(log.contains("410"), "{log}");
    assert_eq!(confirmed_lsn(&db, "walbox").await, before);
    // Nothing after the refused event of its key was sent.
    let arrivals = receiver.arrivals();
    assert!(arrivals.iter().all(|a| seq_of(a) == 0), "{arrivals:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_custom_ca_and_a_client_certificate_speaks_http2() {
    let dir = tempfile::tempdir().unwrap();
    let tls = TlsFiles::generate(dir.path(), "walbox").unwrap();
    let receiver = Receiver::start_tls(&tls, true).unwrap();
    let extra = format!(
        "ca_file = \"{}\"\nclient_cert = \"{}\"\nclient_key = \"{}\"",
        tls.ca_cert.display(),
        tls.client_cert.display(),
        tls.client_key.display()
    );
    let (_pg, db, env) = servers_webhook(&receiver, &extra).await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    insert_rounds(&db, "tls-", 3, 3).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    let d = receiver.delivered();
    assert_eq!(d.len(), 9);
    assert!(d.iter().all(|a| a.http2), "HTTP/2 over ALPN");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_sends_the_range_again_under_webhook_ids_of_its_own() {
    let receiver = Receiver::start().unwrap();
    let (pg, db, env) = servers_webhook(&receiver, "\n[source]\nreplay_window = \"1h\"").await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    insert_rounds(&db, "before-", 3, 2).await;
    let from = current_lsn(&db).await;
    insert_rounds(&db, "range-", 2, 2).await;
    // The replay window holds the slot back: wait for the checkpoint.
    wait_checkpoint(&pg, current_lsn(&db).await, Duration::from_secs(60)).await;
    walbox.stop();
    assert_eq!(receiver.delivered().len(), 10, "{}", walbox.log());
    let (from, to) = (from.to_string(), checkpoint(&pg).unwrap().lsn.to_string());
    let (code, out, err) = walbox_cmd(&["replay", "--from", &from, "--to", &to], &env);
    assert_eq!(code, Some(0), "{out}\n{err}");
    let replayed: Vec<_> = receiver
        .delivered()
        .into_iter()
        .filter(|a| a.id.contains("_replay_"))
        .collect();
    assert_eq!(replayed.len(), 4, "{out}");
    for a in &replayed {
        // A receiver deduplicating by webhook-id takes the replay; the
        // event's own id is unchanged.
        let event_id = a.header("event_id").unwrap();
        assert_eq!(a.id, format!("{event_id}_replay_{from}"));
        assert!(a.key.as_deref().unwrap().starts_with("range-"));
    }
    let (ok, report) = verify_with_library(&replayed, SECRET);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_go_in_the_http_binding_s_binary_mode_percent_encoded() {
    let receiver = Receiver::start().unwrap();
    let pg = walbox_testkit::PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(walbox_testkit::OUTBOX_DDL).await.unwrap();
    let env = webhook_env(
        &pg,
        &format!("{}/ce/{{topic}}", receiver.base_url()),
        "\n[[outbox]]\ntable = \"public.outbox\"\nformat = \"cloudevents\"\n\
         cloudevents_source = \"urn:walbox:{table}\"\n\
         cloudevents_subject = \"{aggregate_type}/{aggregate_id}\"\n",
    );
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'o 1 Grüße', 'OrderPlaced', '{\"total\": 12}')",
    )
    .await
    .unwrap();
    caught_up(&db, &walbox).await;
    walbox.stop();
    let d = receiver.delivered();
    assert_eq!(d.len(), 1, "{}", walbox.log());
    let a = &d[0];
    assert_eq!(a.path, "/ce/outbox.order");
    assert_eq!(a.header("ce-specversion"), Some("1.0"));
    assert_eq!(a.header("ce-id"), Some(a.id.as_str()));
    assert_eq!(a.header("ce-type"), Some("OrderPlaced"));
    assert_eq!(
        a.header("ce-subject"),
        Some("order/o%201%20Gr%C3%BC%C3%9Fe")
    );
    assert_eq!(a.header("content-type"), Some("application/json"));
    assert_eq!(
        a.header("ce-datacontenttype"),
        None,
        "Content-Type carries it"
    );
    // A key that is not printable ASCII goes in base64.
    assert_eq!(a.header("walbox-key-encoding"), Some("base64"));
    let body: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    assert_eq!(body, serde_json::json!({"total": 12}));
    let (ok, report) = verify_with_library(&d, SECRET);
    assert!(ok, "{report}");
}
