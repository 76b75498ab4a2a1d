//! The Pub/Sub contender: `walbox run` publishing a backlog to Google's
//! Pub/Sub emulator (the test kit's, on this machine), next to a plain
//! client publishing the same messages to the same emulator.
//!
//! walbox drains `--pubsub-events` rows (the backlog's rows, over 1,000
//! keys) from a slot of its own, timed from its start until the slot
//! confirms the last commit (every event acknowledged by Pub/Sub). The
//! messages it published are then read back (a subscription made before
//! the run counts them: all must be there), and the plain client publishes
//! exactly those (data, attributes, ordering key) to another topic the way
//! walbox does, with nothing to decode: one Publish request in flight per
//! ordering key, batches of up to 1,000 messages, at most 64 requests at
//! once, timed from its first request to its last answer. The ratio is
//! walbox's time over the plain client's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use walbox_testkit::PubSubEmulator;

use crate::Error;
use crate::scenarios::Bench;

/// What the scenario measured.
#[derive(Debug)]
pub struct PubSubRun {
    pub events: u64,
    pub walbox_seconds: f64,
    pub walbox_cpu_seconds: f64,
    pub walbox_peak_rss_kb: u64,
    pub plain_seconds: f64,
}

const TOPIC: &str = "outbox.order";
const PLAIN_TOPIC: &str = "bench.plain";
/// Requests open at once, for both (walbox's `max_requests` default).
const REQUESTS: usize = 64;

impl Bench {
    /// Drains `events` to the emulator with walbox, then publishes the same
    /// messages with a plain client.
    pub async fn pubsub(&self, events: u64) -> Result<PubSubRun, Error> {
        let emulator = tokio::task::spawn_blocking(PubSubEmulator::start).await??;
        emulator.create_subscription("bench.count", TOPIC, false)?;
        emulator.create_subscription("bench.plain.count", PLAIN_TOPIC, false)?;
        let config = self.pg.client_dir().join("bench_pubsub.toml");
        std::fs::write(
            &config,
            format!(
                "[sink]\ntype = \"pubsub\"\ncreate_topics = true\n\n[sink.pubsub]\n\
                 project = \"{}\"\nemulator_host = \"{}\"\n",
                PubSubEmulator::PROJECT,
                emulator.host()
            ),
        )?;
        let walbox = self
            .drain_backlog("bench_pubsub", events, &config, &[])
            .await?;
        let wanted = usize::try_from(events)?;
        let messages = {
            let emulator = &emulator;
            tokio::task::block_in_place(|| {
                emulator.read_at_least("bench.count", TOPIC, wanted, Duration::from_secs(300))
            })?
        };
        if messages.len() < wanted {
            return Err(format!(
                "pubsub run: {} of {wanted} events in the topic",
                messages.len()
            )
            .into());
        }
        let plain_seconds = plain_client(&emulator.host(), &messages).await?;
        let copied = tokio::task::block_in_place(|| {
            emulator.read_at_least(
                "bench.plain.count",
                PLAIN_TOPIC,
                wanted,
                Duration::from_secs(300),
            )
        })?;
        if copied.len() < messages.len() {
            return Err(format!(
                "pubsub plain client: {} of {} messages in the topic",
                copied.len(),
                messages.len()
            )
            .into());
        }
        Ok(PubSubRun {
            events,
            walbox_seconds: walbox.seconds,
            walbox_cpu_seconds: walbox.cpu_seconds,
            walbox_peak_rss_kb: walbox.peak_rss_kb,
            plain_seconds,
        })
    }
}

/// Publishes `messages` as walbox does (one request in flight per ordering
/// key, batches of up to 1,000, at most [`REQUESTS`] at once); the seconds
/// it took.
async fn plain_client(
    host: &str,
    messages: &[walbox_testkit::kafka::Record],
) -> Result<f64, Error> {
    use base64::Engine as _;
    let mut by_key: std::collections::BTreeMap<Vec<u8>, Vec<String>> = Default::default();
    for m in messages {
        let attributes: serde_json::Map<String, serde_json::Value> = m
            .headers
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    serde_json::Value::String(
                        String::from_utf8_lossy(v.as_deref().unwrap_or_default()).into_owned(),
                    ),
                )
            })
            .collect();
        let key = m.key.clone().unwrap_or_default();
        let json = serde_json::json!({
            "data": base64::engine::general_purpose::STANDARD.encode(m.value.as_deref().unwrap_or_default()),
            "attributes": attributes,
            "orderingKey": String::from_utf8_lossy(&key),
        });
        by_key.entry(key).or_default().push(json.to_string());
    }
    let client = reqwest::Client::new();
    let url = format!(
        "http://{host}/v1/projects/{}/topics/{PLAIN_TOPIC}:publish",
        PubSubEmulator::PROJECT
    );
    let requests = Arc::new(tokio::sync::Semaphore::new(REQUESTS));
    let started = Instant::now();
    let mut lanes = tokio::task::JoinSet::new();
    for (_, lane) in by_key {
        let (client, url, requests) = (client.clone(), url.clone(), Arc::clone(&requests));
        lanes.spawn(async move {
            for batch in lane.chunks(1000) {
                let body = format!("{{\"messages\":[{}]}}", batch.join(","));
                let _permit = requests.acquire().await.map_err(|e| e.to_string())?;
                let answer = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                if !answer.status().is_success() {
                    return Err(format!("publish answered {}", answer.status()));
                }
                let _ = answer.bytes().await.map_err(|e| e.to_string())?;
            }
            Ok::<(), String>(())
        });
    }
    while let Some(lane) = lanes.join_next().await {
        lane??;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// The run as a table.
pub fn print(run: Option<&PubSubRun>) {
    let Some(r) = run else {
        return;
    };
    println!();
    println!(
        "Google Cloud Pub/Sub (the emulator on this machine): {} events over 1,000 ordering keys",
        r.events
    );
    println!(
        "| contender | seconds | events/s | CPU s | peak RSS MiB | ratio to the plain client |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    println!(
        "| walbox run (WAL to acknowledged) | {:.1} | {:.0} | {:.1} | {:.0} | {:.2} |",
        r.walbox_seconds,
        r.events as f64 / r.walbox_seconds,
        r.walbox_cpu_seconds,
        r.walbox_peak_rss_kb as f64 / 1024.0,
        r.walbox_seconds / r.plain_seconds
    );
    println!(
        "| plain client (the same messages, one request per key in flight) | {:.1} | {:.0} | - | - | 1.00 |",
        r.plain_seconds,
        r.events as f64 / r.plain_seconds
    );
}
