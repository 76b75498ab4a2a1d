//! The webhook contender: `walbox run` POSTing a backlog to the test kit's
//! HTTP receiver (on the same machine, answering 200 at once), with the
//! backlog's events spread over 1, 16 and 256 keys, so that at most that many
//! requests are in flight (one per key). Each run has a slot of its own,
//! created before its load, and is timed from walbox's start until the
//! receiver answered 2xx to every event. One run per key count.
//!
//! The ceiling of each run is the same receiver driven by a plain load
//! generator with no walbox: the very requests walbox made (path, headers,
//! body, as the receiver recorded them), sent again by a reqwest client with
//! one request in flight per key, each key's in walbox's order, so as many in
//! flight as walbox had. Both are compared on the receiver's clock, from the
//! first request that arrived to the last, so walbox's start (connecting,
//! starting replication) is not counted against it; its time from its start is
//! given beside.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use walbox_testkit::Receiver;
use walbox_testkit::webhook::Arrival;

use crate::Error;
use crate::contenders::checkpoint_file;
use crate::scenarios::{Bench, INSERT, ROW_SELECT};

/// The keys in flight of the runs.
pub const KEYS: [usize; 3] = [1, 16, 256];

/// One run's result.
#[derive(Debug)]
pub struct WebhookRun {
    pub keys: usize,
    pub events: u64,
    pub seconds: f64,
    /// From walbox's first request's arrival to its last's.
    pub drain_seconds: f64,
    /// walbox's CPU seconds.
    pub cpu_seconds: f64,
    /// walbox's peak RSS (VmHWM), kB.
    pub peak_rss_kb: u64,
    /// Requests the receiver answered (one per event, plus any resend).
    pub requests: usize,
    /// The plain load generator's time for the same requests.
    pub plain_seconds: f64,
    /// Whether walbox's requests came over HTTP/2.
    pub http2: bool,
}

impl Bench {
    /// Drains `events` to a receiver once per key count of [`KEYS`].
    pub async fn webhook(&self, events: u64) -> Result<Vec<WebhookRun>, Error> {
        let mut out = Vec::new();
        for keys in KEYS {
            let slot = format!("bench_webhook_{keys}");
            self.db
                .execute(
                    "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                    &[&slot],
                )
                .await?;
            let select = ROW_SELECT.replace("(n % 1000)", &format!("(n % {keys})"));
            self.db
                .batch_execute(&format!(
                    "DO $$
                     BEGIN
                       FOR t IN 0..{last} LOOP
                         {INSERT} {select} FROM generate_series(t * 10, t * 10 + 9) n;
                         COMMIT;
                       END LOOP;
                     END $$;",
                    last = events / 10 - 1
                ))
                .await?;
            let receiver = Receiver::start()?;
            let config = self.pg.client_dir().join(format!("{slot}.webhook.toml"));
            std::fs::write(
                &config,
                format!(
                    "[sink]\ntype = \"webhook\"\n\n[sink.webhook]\n\
                     url = \"{}/hooks/{{topic}}\"\n\
                     secrets = [\"whsec_YmVuY2ggc2VjcmV0IGZvciB0aGUgd2ViaG9vaw==\"]\n\
                     max_connections = 256\ndead_letter_file = \"{}\"\n",
                    receiver.base_url(),
                    self.pg
                        .client_dir()
                        .join(format!("{slot}.dead-letters.jsonl"))
                        .display()
                ),
            )?;
            let started = Instant::now();
            let mut child = Command::new(&self.a.walbox)
                .arg("run")
                .env("WALBOX_CONFIG", &config)
                .env("WALBOX_DSN", self.pg.conninfo("postgres"))
                .env("WALBOX_SLOT", &slot)
                .env("WALBOX_CHECKPOINT", checkpoint_file(&self.pg, &slot))
                .env("WALBOX_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()?;
            let wanted = usize::try_from(events)?;
            let deadline = started + Duration::from_secs(3_600);
            while receiver.count() < wanted {
                if Instant::now() > deadline || child.try_wait()?.is_some() {
                    let _ = child.kill();
                    return Err(format!(
                        "webhook run with {keys} keys: {} of {wanted} events arrived",
                        receiver.count()
                    )
                    .into());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let seconds = started.elapsed().as_secs_f64();
            let (peak_rss_kb, cpu_seconds) = crate::contenders::usage(child.id());
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(i32::try_from(child.id())?),
                nix::sys::signal::Signal::SIGTERM,
            );
            child.wait()?;
            self.db
                .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await?;
            let requests = receiver.count();
            let sent = receiver.delivered();
            let http2 = sent.iter().all(|a| a.http2);
            let drain_seconds = span(&sent);
            receiver.clear();
            let plain_seconds = plain_load(&receiver, &sent).await?;
            out.push(WebhookRun {
                keys,
                events,
                seconds,
                drain_seconds,
                cpu_seconds,
                peak_rss_kb,
                requests,
                plain_seconds,
                http2,
            });
        }
        Ok(out)
    }
}

/// Seconds from the first of `arrivals` to the last.
fn span(arrivals: &[Arrival]) -> f64 {
    let first = arrivals.iter().map(|a| a.at).min();
    let last = arrivals.iter().map(|a| a.at).max();
    match (first, last) {
        (Some(f), Some(l)) => (l - f).as_secs_f64(),
        _ => 0.0,
    }
}

/// Sends `requests` again to `receiver` with a plain reqwest client, one
/// request in flight per key (each key's in their order), and returns the
/// seconds from the first one's arrival to the last one's.
async fn plain_load(receiver: &Receiver, requests: &[Arrival]) -> Result<f64, Error> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(usize::MAX)
        .build()?;
    let mut lanes: HashMap<
        Option<String>,
        Vec<(String, reqwest::header::HeaderMap, reqwest::Body)>,
    > = HashMap::new();
    for a in requests {
        let mut headers = reqwest::header::HeaderMap::new();
        for (name, value) in &a.headers {
            if matches!(
                name.as_str(),
                "host" | "content-length" | "connection" | "user-agent"
            ) {
                continue;
            }
            if let (Ok(n), Ok(v)) = (
                reqwest::header::HeaderName::from_bytes(name.as_bytes()),
                reqwest::header::HeaderValue::from_str(value),
            ) {
                headers.append(n, v);
            }
        }
        lanes.entry(a.key.clone()).or_default().push((
            format!("{}{}", receiver.base_url(), a.path),
            headers,
            reqwest::Body::from(a.body.clone()),
        ));
    }
    let mut tasks = tokio::task::JoinSet::new();
    for (_, lane) in lanes {
        let client = client.clone();
        tasks.spawn(async move {
            for (url, headers, body) in lane {
                client
                    .post(url)
                    .headers(headers)
                    .body(body)
                    .send()
                    .await?
                    .error_for_status()?;
            }
            Ok::<(), reqwest::Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    let arrived = receiver.delivered();
    if arrived.len() != requests.len() {
        return Err(format!(
            "the plain load generator: {} of {} requests answered 2xx",
            arrived.len(),
            requests.len()
        )
        .into());
    }
    Ok(span(&arrived))
}

/// The runs as a table.
pub fn print(runs: &[WebhookRun]) {
    let Some(first) = runs.first() else {
        return;
    };
    println!();
    println!(
        "Webhooks: {} events POSTed to a local receiver (200 at once), one request in flight per key; \
         the ceiling is a plain reqwest client sending the same requests to the same receiver, \
         one in flight per key; seconds from the first request's arrival to the last's, and \
         walbox's from its start",
        first.events
    );
    println!(
        "| keys in flight | walbox seconds | walbox events/s | walbox from its start, s | walbox CPU s per M events | HTTP | ceiling seconds | ceiling events/s | of ceiling | requests |"
    );
    println!("|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|");
    for r in runs {
        println!(
            "| {} | {:.2} | {:.0} | {:.2} | {:.1} | {} | {:.2} | {:.0} | {:.2} | {} |",
            r.keys,
            r.drain_seconds,
            r.events as f64 / r.drain_seconds,
            r.seconds,
            r.cpu_seconds / (r.events as f64 / 1e6),
            if r.http2 { "2" } else { "1.1" },
            r.plain_seconds,
            r.events as f64 / r.plain_seconds,
            r.plain_seconds / r.drain_seconds,
            r.requests
        );
    }
}
