//! Operating walbox: its Prometheus metrics scraped by a real Prometheus, the
//! readiness endpoint through a PostgreSQL outage and a dropped slot, JSON log
//! lines, and the metric names the deployment files use.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use common::*;
use walbox_testkit::prometheus::get_status;
use walbox_testkit::{Prometheus, StopMode, wait_until, wait_until_async};

/// A port on 127.0.0.1 nothing listened on a moment ago.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `walbox run` with the metrics endpoint on a port the system picks; returns
/// it and the endpoint's address.
fn run_with_metrics(env: &mut Vec<(&'static str, String)>) -> (Walbox, String) {
    env.push(("WALBOX_METRICS_LISTEN", "127.0.0.1:0".into()));
    let walbox = Walbox::spawn(&["run"], env);
    let addr = walbox.metrics_addr();
    (walbox, addr)
}

/// `/readyz`'s status and JSON body.
fn readyz(addr: &str) -> Option<(u16, serde_json::Value)> {
    let (status, body) = get_status(&format!("http://{addr}/readyz")).ok()?;
    Some((status, serde_json::from_str(&body).unwrap()))
}

/// Waits until `/readyz` answers `status`; returns its body.
fn wait_ready(addr: &str, status: u16, walbox: &Walbox) -> serde_json::Value {
    wait_until(
        &format!("/readyz to answer {status}"),
        Duration::from_secs(90),
        || readyz(addr).filter(|(s, _)| *s == status).map(|(_, b)| b),
    )
    .unwrap_or_else(|e| {
        panic!(
            "{e}; last answer {:?}; log:\n{}",
            readyz(addr),
            walbox.log()
        )
    })
}

/// The `walbox_*` metric names in `text` (a rules file, a dashboard, an
/// exposition), histogram series reduced to their metric: `_bucket`, `_sum` and
/// `_count` stripped.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut i = 0;
    while let Some(found) = text[i..].find("walbox_") {
        let start = i + found;
        let mut end = start;
        while end < bytes.len() && ident(bytes[end]) {
            end += 1;
        }
        if start == 0 || !ident(bytes[start - 1]) {
            let name = &text[start..end];
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            names.insert(base.to_owned());
        }
        i = end.max(start + 1);
    }
    names
}

/// The metric names a `/metrics` exposition has samples for.
fn exported_names(exposition: &str) -> BTreeSet<String> {
    let samples: String = exposition
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect::<Vec<_>>()
        .join("\n");
    metric_names(&samples)
}

#[test]
fn metric_names_are_found_in_rules_and_dashboards() {
    let rules = r#"
      - alert: WalboxWalRetained
        expr: walbox_slot_retained_wal_bytes > 1e9 and deriv(walbox_slot_retained_wal_bytes[10m]) > 0
      - expr: histogram_quantile(0.99, sum by (le) (rate(walbox_commit_to_ack_seconds_bucket[5m])))
      - expr: rate(walbox_commit_to_ack_seconds_sum[5m]) / rate(walbox_commit_to_ack_seconds_count[5m])
        labels: {job: walbox, slot: my_walbox_slot}
    "#;
    let dashboard =
        r#"{"targets":[{"expr":"sum(rate(walbox_events_published_total{job=\"walbox\"}[1m]))"}]}"#;
    assert_eq!(
        metric_names(rules),
        BTreeSet::from([
            "walbox_commit_to_ack_seconds".to_owned(),
            "walbox_slot_retained_wal_bytes".to_owned()
        ])
    );
    assert_eq!(
        metric_names(dashboard),
        BTreeSet::from(["walbox_events_published_total".to_owned()])
    );
    let exposition = "# TYPE walbox_events_read counter\nwalbox_events_read_total{table=\"public.outbox\"} 3\n\
                      walbox_commit_to_ack_seconds_bucket{le=\"0.1\"} 1\nwalbox_ready 1\n# EOF\n";
    assert_eq!(
        exported_names(exposition),
        BTreeSet::from([
            "walbox_commit_to_ack_seconds".to_owned(),
            "walbox_events_read_total".to_owned(),
            "walbox_ready".to_owned()
        ])
    );
}

/// A real Prometheus scrapes walbox while writers commit: the published
/// counter equals the committed rows, the slot's gauges equal what
/// pg_replication_slots shows, the latency histograms have a sample per event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_what_walbox_publishes() {
    let (pg, broker, db) = servers().await;
    let mut env = walbox_env(&pg, &broker);
    setup(&env);
    let (walbox, addr) = run_with_metrics(&mut env);
    wait_ready(&addr, 200, &walbox);
    let prometheus =
        Prometheus::start(std::slice::from_ref(&addr), Duration::from_millis(500)).unwrap();
    // The newest sample of the last minute: one scrape that timed out on this
    // busy machine marks the series stale, which is not what is asked here.
    let value = |q: &str| {
        prometheus
            .value(&format!("last_over_time({q}[1m])"))
            .unwrap()
    };

    write_events(&pg, 4, 25, 4, 20).await;
    let rows: i64 = db
        .query_one("SELECT count(*) FROM outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 400);
    let published = wait_until(
        "Prometheus to see every row published",
        Duration::from_secs(120),
        || {
            value(r#"walbox_events_published_total{table="public.outbox",topic="outbox.order"}"#)
                .filter(|v| *v == 400.0)
        },
    );
    assert!(
        published.is_ok(),
        "{published:?}: {:?}\nwalbox log:\n{}\nprometheus log:\n{}",
        prometheus.query("walbox_events_published_total"),
        walbox.log(),
        prometheus.log_tail()
    );
    assert_eq!(
        value(r#"walbox_events_read_total{table="public.outbox"}"#),
        Some(400.0)
    );
    // A sample per acknowledged event, one per transaction read.
    assert_eq!(value("walbox_commit_to_ack_seconds_count"), Some(400.0));
    // Transactions without outbox rows may be read too.
    assert!(value("walbox_commit_to_read_seconds_count").unwrap() >= 100.0);
    assert!(value("walbox_commit_to_ack_seconds_sum").unwrap() > 0.0);
    assert!(
        value(r#"walbox_commit_to_ack_seconds_bucket{le="+Inf"}"#) == Some(400.0),
        "{:?}",
        prometheus.query("walbox_commit_to_ack_seconds_bucket")
    );

    // The slot's gauges: what pg_replication_slots shows for the same WAL.
    let slot = || async {
        let r = db
            .query_one(
                "SELECT (pg_current_wal_lsn() - restart_lsn)::float8,
                        (pg_current_wal_lsn() - confirmed_flush_lsn)::float8
                 FROM pg_replication_slots WHERE slot_name = 'walbox'",
                &[],
            )
            .await
            .unwrap();
        (r.get::<_, f64>(0), r.get::<_, f64>(1))
    };
    let agreed = || async {
        wait_until_async(
            "the slot gauges to match pg_replication_slots",
            Duration::from_secs(60),
            || async {
                let (retained, lag) = slot().await;
                let seen = (
                    value("walbox_slot_retained_wal_bytes"),
                    value("walbox_slot_confirmed_lag_bytes"),
                );
                (seen == (Some(retained), Some(lag))).then_some(retained)
            },
        )
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{e}: walbox {:?} {:?}",
                prometheus.query("walbox_slot_retained_wal_bytes"),
                prometheus.query("walbox_slot_confirmed_lag_bytes"),
            )
        })
    };
    let first = agreed().await;
    assert!(first > 0.0);
    // More WAL (not outbox rows): the gauges follow the slot to its new state.
    let before = current_lsn(&db).await;
    db.batch_execute(
        "CREATE TABLE filler AS SELECT g, repeat('x', 200) AS pad FROM generate_series(1, 20000) g",
    )
    .await
    .unwrap();
    assert!(current_lsn(&db).await.as_u64() > before.as_u64() + 1_000_000);
    wait_caught_up(&db).await;
    agreed().await;

    assert_eq!(
        value(r#"walbox_slot_wal_status{status="reserved"}"#),
        Some(1.0)
    );
    assert_eq!(value("walbox_slot_active"), Some(1.0));
    assert_eq!(value("walbox_ready"), Some(1.0));
    assert_eq!(value("walbox_sessions_started_total"), Some(1.0));
    assert_eq!(value("walbox_in_flight_events_limit"), Some(10_000.0));
    let info = prometheus.query("walbox_build_info").unwrap();
    let labels = &info.first().expect("walbox_build_info").labels;
    for l in ["version", "librdkafka_version", "postgres_version"] {
        assert!(
            labels
                .get(l)
                .and_then(|v| v.as_str())
                .is_some_and(|v| !v.is_empty()),
            "{l} in {labels:?}"
        );
    }
    drop(walbox);
}

/// `/readyz` answers 503 while PostgreSQL is down and 200 again once walbox
/// has reconnected; `/healthz` stays 200 throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_turns_503_while_postgres_is_down_and_200_after_the_reconnect() {
    let (mut pg, broker, _db) = servers().await;
    let mut env = walbox_env(&pg, &broker);
    setup(&env);
    let (walbox, addr) = run_with_metrics(&mut env);
    let body = wait_ready(&addr, 200, &walbox);
    assert_eq!(body["state"], "streaming", "{body}");

    pg.stop(StopMode::Fast).unwrap();
    let body = wait_ready(&addr, 503, &walbox);
    let state = body["state"].as_str().unwrap();
    assert!(
        ["connecting", "backing_off"].contains(&state) && body["reason"].is_string(),
        "{body}"
    );
    let (health, _) = get_status(&format!("http://{addr}/healthz")).unwrap();
    assert_eq!(health, 200);

    pg.start_again().unwrap();
    let body = wait_ready(&addr, 200, &walbox);
    assert_eq!(body["state"], "streaming", "{body}");
    let metrics = walbox_testkit::prometheus::get(&format!("http://{addr}/metrics")).unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("walbox_sessions_ended_total{reason=")),
        "{metrics}"
    );
    let started: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("walbox_sessions_started_total "))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(started >= 2.0, "{metrics}");
}

/// With the slot dropped under walbox, `/readyz` answers 503 naming the reason,
/// and walbox keeps answering until it is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_a_slot_dropped_under_walbox() {
    let (pg, broker, db) = servers().await;
    let mut env = walbox_env(&pg, &broker);
    setup(&env);
    let (mut walbox, addr) = run_with_metrics(&mut env);
    wait_ready(&addr, 200, &walbox);
    write_events(&pg, 1, 2, 2, 2).await;
    wait_caught_up(&db).await;

    wait_until_async(
        "the slot to be dropped",
        Duration::from_secs(60),
        || async {
            let _ = db
                .execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
                 WHERE slot_name = 'walbox' AND active_pid IS NOT NULL",
                    &[],
                )
                .await;
            db.execute("SELECT pg_drop_replication_slot('walbox')", &[])
                .await
                .ok()
        },
    )
    .await
    .unwrap();
    let body = wait_ready(&addr, 503, &walbox);
    wait_until(
        "/readyz to say the slot is lost",
        Duration::from_secs(60),
        || readyz(&addr).filter(|(_, b)| b["state"] == "slot_lost"),
    )
    .unwrap_or_else(|e| panic!("{e}: {body}; log:\n{}", walbox.log()));
    let (_, body) = readyz(&addr).unwrap();
    let reason = body["reason"].as_str().unwrap();
    assert!(reason.contains("\"walbox\" does not exist"), "{body}");
    assert!(walbox.running(), "walbox keeps answering: {}", walbox.log());
    let metrics = walbox_testkit::prometheus::get(&format!("http://{addr}/metrics")).unwrap();
    assert!(metrics.contains("walbox_ready 0"), "{metrics}");
    walbox.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(code(walbox.wait(Duration::from_secs(30))), Some(1));
}

/// `WALBOX_LOG_FORMAT=json` and `[log] format = "json"`: one JSON object per
/// line with the fields of the text lines, never a row value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_log_lines_parse_and_carry_the_fields() {
    let (pg, broker, db) = servers().await;
    let mut env = walbox_env(&pg, &broker);
    setup(&env);
    env.push(("WALBOX_LOG_FORMAT", "json".into()));
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 2, 5, 2, 4).await;
    wait_caught_up(&db).await;
    walbox.stop();
    let log = walbox.log();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let streaming = lines
        .iter()
        .find(|l| l["message"] == "streaming")
        .unwrap_or_else(|| panic!("{log}"));
    assert_eq!(streaming["level"], "INFO");
    assert_eq!(streaming["slot"], "walbox");
    assert_eq!(streaming["publication"], "walbox_outbox");
    assert!(streaming["timestamp"].is_string() && streaming["start"].is_string());
    let stopped = lines
        .iter()
        .rev()
        .find(|l| l["message"] == "progress")
        .unwrap();
    assert_eq!(stopped["events"], 20, "{stopped}");
    assert!(!log.contains("Grüße"), "{log}");

    // The file's [log] format, for any command: an error as a JSON line.
    let port = free_port();
    let cfg = config_file(
        &pg,
        "json-log.toml",
        &format!(
            "[log]\nformat = \"json\"\n[source]\ndsn = \"host=127.0.0.1 port={port} user=postgres dbname=postgres connect_timeout=5\"\n"
        ),
    );
    let (status, _, stderr) = walbox_cmd(&["slot", "list", "-c", &cfg], &[]);
    assert_eq!(status, Some(1), "{stderr}");
    let error: serde_json::Value = serde_json::from_str(stderr.lines().last().unwrap())
        .unwrap_or_else(|e| panic!("{e}: {stderr}"));
    assert_eq!(error["level"], "ERROR", "{error}");
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains(&port.to_string())),
        "{error}"
    );
}

/// Every `walbox_*` name the alert rules and the dashboard use is one a
/// running walbox exports (with an event published and one dead-lettered, so
/// every labelled family has a series).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_files_use_only_exported_metric_names() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut used = BTreeSet::new();
    for (dir, ext) in [("deploy/prometheus", "yml"), ("deploy/grafana", "json")] {
        let dir = root.join(dir);
        let files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == ext))
            .collect();
        assert!(!files.is_empty(), "no .{ext} file in {}", dir.display());
        for f in files {
            let names = metric_names(&std::fs::read_to_string(&f).unwrap());
            assert!(!names.is_empty(), "{} names no walbox metric", f.display());
            used.extend(names);
        }
    }

    let (pg, broker, db) = servers().await;
    let mut env = walbox_env(&pg, &broker);
    setup(&env);
    let (walbox, addr) = run_with_metrics(&mut env);
    wait_ready(&addr, 200, &walbox);
    write_events(&pg, 1, 1, 1, 1).await;
    // Headers that are not a JSON object: a dead letter.
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
         VALUES ('order', 'x', 'Bad', '{}', '[1]')",
    )
    .await
    .unwrap();
    let exported = wait_until("both events to be counted", Duration::from_secs(60), || {
        let text = walbox_testkit::prometheus::get(&format!("http://{addr}/metrics")).ok()?;
        let names = exported_names(&text);
        (names.contains("walbox_events_dead_lettered_total")
            && names.contains("walbox_events_published_total"))
        .then_some(names)
    })
    .unwrap_or_else(|e| panic!("{e}; log:\n{}", walbox.log()));
    let unknown: Vec<_> = used.difference(&exported).collect();
    assert!(
        unknown.is_empty(),
        "the deployment files use metrics walbox does not export: {unknown:?}; exported: {exported:?}"
    );
}
