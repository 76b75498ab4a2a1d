//! The AWS contenders: `walbox run` publishing a backlog to Kinesis
//! (kinesalite), SQS FIFO and SNS FIFO (LocalStack), each next to a plain
//! SDK client sending the same messages to the same server.
//!
//! walbox drains `--aws-events` rows (over the backlog's 1,000 keys) from a
//! slot of its own, timed from its start until the slot confirms the last
//! commit (every event acknowledged), after a first drain of as many rows,
//! untimed, that warms the stand-in for both contenders. What the timed
//! drain stored is read back (all must be there), and the plain client
//! sends exactly those (data or body, attributes, partition key or message
//! group) to another stream, queue or topic with the AWS SDK, nothing to
//! decode, in the order walbox keeps: a
//! key's next message goes once its last one is answered, a call takes up
//! to 500 records (`PutRecords`) or 10 messages (`SendMessageBatch`,
//! `PublishBatch`), at most 8 calls at once (walbox's `max_requests`). The
//! ratio is walbox's time over the plain client's.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use walbox_testkit::kafka::Record;
use walbox_testkit::{Kinesalite, LocalStack};

use crate::Error;
use crate::cloud::per_key_lanes;
use crate::scenarios::Bench;

/// One of the AWS destinations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Kinesis,
    Sqs,
    Sns,
}

impl Service {
    pub const ALL: [Service; 3] = [Service::Kinesis, Service::Sqs, Service::Sns];

    fn name(self) -> &'static str {
        match self {
            Service::Kinesis => "Kinesis Data Streams (kinesalite)",
            Service::Sqs => "SQS FIFO (LocalStack)",
            Service::Sns => "SNS FIFO, read through a subscribed SQS queue (LocalStack)",
        }
    }

    fn sink_type(self) -> &'static str {
        match self {
            Service::Kinesis => "kinesis",
            Service::Sqs => "sqs",
            Service::Sns => "sns",
        }
    }

    /// Messages in one call.
    fn batch(self) -> usize {
        match self {
            Service::Kinesis => 500,
            Service::Sqs | Service::Sns => 10,
        }
    }
}

/// What one AWS scenario measured.
#[derive(Debug)]
pub struct AwsRun {
    pub service: Service,
    pub events: u64,
    pub walbox_seconds: f64,
    pub walbox_cpu_seconds: f64,
    pub walbox_peak_rss_kb: u64,
    pub plain_seconds: f64,
}

/// Calls out at once, for both (walbox's `max_requests` default).
const CALLS: usize = 8;
/// Where walbox's events go: the topic `outbox.{aggregate_type}` of an
/// order, as Kinesis names it and as SQS and SNS name it.
const STREAM: &str = "outbox.order";
const FIFO_NAME: &str = "outbox-order.fifo";
/// The queue subscribed to walbox's SNS topic.
const SNS_QUEUE: &str = "bench-events.fifo";
/// Where the plain client sends.
const PLAIN_STREAM: &str = "bench.plain";
const PLAIN_FIFO: &str = "bench-plain.fifo";
const PLAIN_SNS_QUEUE: &str = "bench-plain-events.fifo";

/// The server of one scenario.
enum Server {
    Kinesis(Kinesalite),
    LocalStack(LocalStack),
}

impl Server {
    fn endpoint(&self) -> String {
        match self {
            Server::Kinesis(k) => k.endpoint(),
            Server::LocalStack(l) => l.endpoint(),
        }
    }
}

impl Bench {
    /// Drains `events` to `service` with walbox, then sends the same
    /// messages with a plain client.
    pub async fn aws(&self, service: Service, events: u64) -> Result<AwsRun, Error> {
        let server = match service {
            Service::Kinesis => {
                Server::Kinesis(tokio::task::spawn_blocking(Kinesalite::start).await??)
            }
            Service::Sqs | Service::Sns => {
                Server::LocalStack(tokio::task::spawn_blocking(LocalStack::start).await??)
            }
        };
        let endpoint = server.endpoint();
        // Neither contender's time includes making its stream, queue or
        // topic: walbox's is made first (walbox finds it), as the plain
        // client's is before its clock starts.
        let sdk = walbox_testkit::kinesis::sdk_config(&endpoint).await;
        match service {
            Service::Kinesis => {
                create_stream(&aws_sdk_kinesis::Client::new(&sdk), STREAM).await?;
            }
            Service::Sqs => {
                walbox_testkit::localstack::create_fifo_queue(&endpoint, FIFO_NAME).await?;
            }
            Service::Sns => {
                for (topic, queue) in [(FIFO_NAME, SNS_QUEUE), (PLAIN_FIFO, PLAIN_SNS_QUEUE)] {
                    walbox_testkit::localstack::subscribe_queue(&endpoint, topic, queue).await?;
                }
            }
        }
        let kind = service.sink_type();
        let config = self.pg.client_dir().join(format!("bench_{kind}.toml"));
        std::fs::write(
            &config,
            format!(
                "[sink]\ntype = \"{kind}\"\ncreate_topics = true\n{}\n[sink.{kind}]\n\
                 endpoint_url = \"{endpoint}\"\nregion = \"us-east-1\"\n",
                if service == Service::Kinesis {
                    "topic_partitions = 4\n"
                } else {
                    ""
                }
            ),
        )?;
        // A first drain, untimed, warms the stand-in (a Python or Node
        // server whose first calls of a kind are slow) for both contenders.
        let env = Kinesalite::client_env();
        self.drain_backlog(&format!("bench_{kind}_warm"), events, &config, &env)
            .await?;
        let walbox = self
            .drain_backlog(&format!("bench_{kind}"), events, &config, &env)
            .await?;
        let wanted = usize::try_from(events)?;
        let mut stored = read_back(service, &endpoint, false, 2 * wanted).await?;
        // The timed drain's events: the outbox holds only its rows.
        let timed: std::collections::HashSet<String> = self
            .db
            .query("SELECT id::text FROM outbox", &[])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        stored.retain(|r| timed.contains(&event_id(r)));
        if stored.len() != wanted {
            return Err(format!(
                "{kind}: {} of the timed drain's {wanted} events stored",
                stored.len()
            )
            .into());
        }
        let plain_seconds = plain_client(service, &endpoint, &stored).await?;
        let copied = read_back(service, &endpoint, true, wanted).await?;
        if copied.len() < stored.len() {
            return Err(format!(
                "{kind} plain client: {} of {} messages stored",
                copied.len(),
                stored.len()
            )
            .into());
        }
        drop(server);
        Ok(AwsRun {
            service,
            events,
            walbox_seconds: walbox.seconds,
            walbox_cpu_seconds: walbox.cpu_seconds,
            walbox_peak_rss_kb: walbox.peak_rss_kb,
            plain_seconds,
        })
    }
}

/// Everything walbox (or, with `plain`, the plain client) stored, once at
/// least `wanted` messages are there (within five minutes).
async fn read_back(
    service: Service,
    endpoint: &str,
    plain: bool,
    wanted: usize,
) -> Result<Vec<Record>, Error> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    let mut out = Vec::new();
    loop {
        match service {
            Service::Kinesis => {
                let stream = if plain { PLAIN_STREAM } else { STREAM };
                out = walbox_testkit::kinesis::read_stream(endpoint, stream).await?;
            }
            Service::Sqs | Service::Sns => {
                let queue = match (service, plain) {
                    (Service::Sqs, false) => FIFO_NAME,
                    (Service::Sqs, true) => PLAIN_FIFO,
                    (_, false) => SNS_QUEUE,
                    (_, true) => PLAIN_SNS_QUEUE,
                };
                // Reading a queue takes its messages: they add up.
                out.extend(walbox_testkit::localstack::drain(endpoint, queue).await?);
            }
        }
        if out.len() >= wanted {
            return Ok(out);
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "{}: {} of {wanted} messages stored",
                service.sink_type(),
                out.len()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The messages by key, in the order they were stored.
fn by_key<M>(stored: &[Record], each: impl Fn(&Record) -> M) -> BTreeMap<Vec<u8>, Vec<M>> {
    let mut out: BTreeMap<Vec<u8>, Vec<M>> = BTreeMap::new();
    for r in stored {
        out.entry(r.key.clone().unwrap_or_default())
            .or_default()
            .push(each(r));
    }
    out
}

fn text(bytes: Option<&Vec<u8>>) -> String {
    String::from_utf8_lossy(bytes.map_or(&[][..], Vec::as_slice)).into_owned()
}

/// Sends `stored` with the SDK's client as walbox orders it; the seconds it
/// took.
async fn plain_client(service: Service, endpoint: &str, stored: &[Record]) -> Result<f64, Error> {
    let sdk = walbox_testkit::kinesis::sdk_config(endpoint).await;
    match service {
        Service::Kinesis => {
            let client = aws_sdk_kinesis::Client::new(&sdk);
            create_stream(&client, PLAIN_STREAM).await?;
            // The record's data as walbox writes it: a JSON object with the
            // event's id, key, headers and value.
            let records = by_key(stored, |r| {
                let headers: serde_json::Map<String, serde_json::Value> = r
                    .headers
                    .iter()
                    .map(|(k, v)| (k.clone(), serde_json::Value::String(text(v.as_ref()))))
                    .collect();
                let key = text(r.key.as_ref());
                let value: serde_json::Value =
                    serde_json::from_slice(r.value.as_deref().unwrap_or_default())
                        .unwrap_or_default();
                let data = serde_json::json!({
                    "event_id": headers.get("event_id").cloned().unwrap_or_default(),
                    "topic": STREAM,
                    "key": key,
                    "headers": headers,
                    "value": value,
                });
                aws_sdk_kinesis::types::PutRecordsRequestEntry::builder()
                    .partition_key(key)
                    .data(aws_sdk_kinesis::primitives::Blob::new(data.to_string()))
                    .build()
                    .expect("key and data are set")
            });
            let client = Arc::new(client);
            per_key_lanes(records, service.batch(), CALLS, move |batch| {
                let client = Arc::clone(&client);
                async move {
                    let out = client
                        .put_records()
                        .stream_name(PLAIN_STREAM)
                        .set_records(Some(batch))
                        .send()
                        .await
                        .map_err(|e| format!("PutRecords: {e}"))?;
                    match out.failed_record_count() {
                        Some(n) if n > 0 => Err(format!("PutRecords: {n} records failed")),
                        _ => Ok(()),
                    }
                }
            })
            .await
        }
        Service::Sqs => {
            let client = aws_sdk_sqs::Client::new(&sdk);
            let url = walbox_testkit::localstack::create_fifo_queue(endpoint, PLAIN_FIFO).await?;
            let messages = by_key(stored, Plain::of);
            let client = Arc::new(client);
            per_key_lanes(messages, service.batch(), CALLS, move |batch| {
                let (client, url) = (Arc::clone(&client), url.clone());
                async move {
                    let entries = batch
                        .into_iter()
                        .enumerate()
                        .map(|(i, m): (usize, Plain)| {
                            let attributes = m.attributes.into_iter().map(|(k, v)| {
                                let value = aws_sdk_sqs::types::MessageAttributeValue::builder()
                                    .data_type("String")
                                    .string_value(v)
                                    .build()
                                    .expect("the data type is set");
                                (k, value)
                            });
                            aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                                .id(i.to_string())
                                .message_body(m.body)
                                .message_group_id(m.group)
                                .message_deduplication_id(m.dedup)
                                .set_message_attributes(Some(attributes.collect()))
                                .build()
                                .expect("id and body are set")
                        })
                        .collect();
                    let out = client
                        .send_message_batch()
                        .queue_url(url)
                        .set_entries(Some(entries))
                        .send()
                        .await
                        .map_err(|e| format!("SendMessageBatch: {e}"))?;
                    if out.failed().is_empty() {
                        Ok(())
                    } else {
                        Err(format!("SendMessageBatch: {} failed", out.failed().len()))
                    }
                }
            })
            .await
        }
        Service::Sns => {
            let client = aws_sdk_sns::Client::new(&sdk);
            let arn = client
                .create_topic()
                .name(PLAIN_FIFO)
                .attributes("FifoTopic", "true")
                .send()
                .await
                .map_err(|e| format!("creating {PLAIN_FIFO}: {e}"))?
                .topic_arn()
                .unwrap_or_default()
                .to_owned();
            let messages = by_key(stored, Plain::of);
            let client = Arc::new(client);
            per_key_lanes(messages, service.batch(), CALLS, move |batch| {
                let (client, arn) = (Arc::clone(&client), arn.clone());
                async move {
                    let entries = batch
                        .into_iter()
                        .enumerate()
                        .map(|(i, m): (usize, Plain)| {
                            let attributes = m.attributes.into_iter().map(|(k, v)| {
                                let value = aws_sdk_sns::types::MessageAttributeValue::builder()
                                    .data_type("String")
                                    .string_value(v)
                                    .build()
                                    .expect("the data type is set");
                                (k, value)
                            });
                            aws_sdk_sns::types::PublishBatchRequestEntry::builder()
                                .id(i.to_string())
                                .message(m.body)
                                .message_group_id(m.group)
                                .message_deduplication_id(m.dedup)
                                .set_message_attributes(Some(attributes.collect()))
                                .build()
                                .expect("id and message are set")
                        })
                        .collect();
                    let out = client
                        .publish_batch()
                        .topic_arn(arn)
                        .set_publish_batch_request_entries(Some(entries))
                        .send()
                        .await
                        .map_err(|e| format!("PublishBatch: {e}"))?;
                    if out.failed().is_empty() {
                        Ok(())
                    } else {
                        Err(format!("PublishBatch: {} failed", out.failed().len()))
                    }
                }
            })
            .await
        }
    }
}

/// An SQS or SNS message as the plain client sends it.
struct Plain {
    body: String,
    group: String,
    dedup: String,
    attributes: Vec<(String, String)>,
}

impl Plain {
    /// The message walbox stored as `r`, deduplicated by its event id.
    fn of(r: &Record) -> Plain {
        Plain {
            body: text(r.value.as_ref()),
            group: text(r.key.as_ref()),
            dedup: event_id(r),
            attributes: attribute_pairs(r),
        }
    }
}

/// A stored message's headers as at most 10 text attributes, as walbox
/// sends them: the first nine as they are, the rest in one JSON object.
fn attribute_pairs(r: &Record) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    let mut rest = serde_json::Map::new();
    for (k, v) in &r.headers {
        if out.len() < 9 {
            out.push((k.clone(), text(v.as_ref())));
        } else {
            rest.insert(k.clone(), serde_json::Value::String(text(v.as_ref())));
        }
    }
    if !rest.is_empty() {
        out.push((
            "walbox_headers".to_owned(),
            serde_json::Value::Object(rest).to_string(),
        ));
    }
    out
}

/// The event id a stored message carries.
fn event_id(r: &Record) -> String {
    r.headers
        .iter()
        .find(|(k, _)| k == "event_id")
        .map(|(_, v)| text(v.as_ref()))
        .unwrap_or_default()
}

/// Makes Kinesis stream `stream` with 4 shards and waits until it is
/// active.
async fn create_stream(client: &aws_sdk_kinesis::Client, stream: &str) -> Result<(), Error> {
    client
        .create_stream()
        .stream_name(stream)
        .shard_count(4)
        .send()
        .await
        .map_err(|e| format!("creating {stream}: {e}"))?;
    walbox_testkit::wait_until_async(
        "the stream to be active",
        Duration::from_secs(60),
        || async {
            let out = client
                .describe_stream_summary()
                .stream_name(stream)
                .send()
                .await
                .ok()?;
            (out.stream_description_summary()?.stream_status()
                == &aws_sdk_kinesis::types::StreamStatus::Active)
                .then_some(())
        },
    )
    .await?;
    Ok(())
}

/// The runs as a table.
pub fn print(runs: &[AwsRun]) {
    if runs.is_empty() {
        return;
    }
    println!();
    println!(
        "AWS destinations (stand-ins on this machine): events over 1,000 keys, against a plain \
         SDK client sending the same messages one call per key in flight, {CALLS} calls at once"
    );
    println!(
        "| destination | events | walbox s | walbox events/s | CPU s | peak RSS MiB | plain client s | plain events/s | ratio to the plain client |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in runs {
        println!(
            "| {} | {} | {:.1} | {:.0} | {:.1} | {:.0} | {:.1} | {:.0} | {:.2} |",
            r.service.name(),
            r.events,
            r.walbox_seconds,
            r.events as f64 / r.walbox_seconds,
            r.walbox_cpu_seconds,
            r.walbox_peak_rss_kb as f64 / 1024.0,
            r.plain_seconds,
            r.events as f64 / r.plain_seconds,
            r.walbox_seconds / r.plain_seconds
        );
    }
}
