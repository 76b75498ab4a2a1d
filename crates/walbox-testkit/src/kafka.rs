//! Topic administration and a reader for assertions on what a topic holds.
//!
//! The reader counts what a topic holds by consuming it from the beginning, never
//! from watermarks. Its functions block the calling thread; from async code call
//! them through `tokio::task::spawn_blocking`, or from a multi-threaded runtime.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::{Result, TestkitError};

/// One record read back from a topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Key bytes.
    pub key: Option<Vec<u8>>,
    /// Headers in order, with their values.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// Value bytes.
    pub value: Option<Vec<u8>>,
}

impl Record {
    /// The key as UTF-8 text.
    #[must_use]
    pub fn key_str(&self) -> Option<&str> {
        self.key
            .as_deref()
            .and_then(|k| std::str::from_utf8(k).ok())
    }

    /// The value as UTF-8 text.
    #[must_use]
    pub fn value_str(&self) -> Option<&str> {
        self.value
            .as_deref()
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    /// The first header called `name`, as UTF-8 text.
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_deref())
            .and_then(|v| std::str::from_utf8(v).ok())
    }
}

/// A client configuration for `bootstrap` with quiet logging.
#[must_use]
pub fn client_config(bootstrap: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap).set("log_level", "3");
    c
}

/// Creates `topic` with `partitions` partitions (replication factor 1); an existing
/// topic is accepted.
pub async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = client_config(bootstrap).create()?;
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => {
                return Err(TestkitError::CreateTopic {
                    topic: name,
                    reason: code.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// Reads every record `topic` holds now: consumes each partition from its start
/// until the broker reports its end.
pub fn read_all(bootstrap: &str, topic: &str, timeout: Duration) -> Result<Vec<Record>> {
    read(bootstrap, topic, timeout, |_, all_at_end| all_at_end)
}

/// Reads `topic` from the start until it has yielded at least `count` records, or
/// fails after `timeout` (the error says how many arrived).
pub fn read_at_least(
    bootstrap: &str,
    topic: &str,
    count: usize,
    timeout: Duration,
) -> Result<Vec<Record>> {
    read(bootstrap, topic, timeout, |records, _| {
        records.len() >= count
    })
}

/// Reads `topic` from the start until `done(records, every_partition_at_end)`.
pub fn read(
    bootstrap: &str,
    topic: &str,
    timeout: Duration,
    mut done: impl FnMut(&[Record], bool) -> bool,
) -> Result<Vec<Record>> {
    let consumer: BaseConsumer = client_config(bootstrap)
        .set("group.id", format!("walbox-testkit-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set("auto.offset.reset", "earliest")
        .create()?;
    let deadline = Instant::now() + timeout;
    let partitions = partitions(&consumer, topic, timeout)?;
    let mut assignment = TopicPartitionList::new();
    for p in &partitions {
        assignment.add_partition_offset(topic, *p, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;

    let mut records = Vec::new();
    let mut at_end: HashSet<i32> = HashSet::new();
    loop {
        if done(&records, at_end.len() == partitions.len()) {
            return Ok(records);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(TestkitError::Timeout {
                what: format!(
                    "topic {topic} ({} records read, {} of {} partitions at their end)",
                    records.len(),
                    at_end.len(),
                    partitions.len()
                ),
                after: timeout,
            });
        }
        match consumer.poll(left.min(Duration::from_millis(200))) {
            None => {}
            Some(Ok(m)) => {
                at_end.remove(&m.partition());
                records.push(Record {
                    topic: m.topic().to_owned(),
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(<[u8]>::to_vec),
                    headers: m
                        .headers()
                        .map(|hs| {
                            hs.iter()
                                .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                                .collect()
                        })
                        .unwrap_or_default(),
                    value: m.payload().map(<[u8]>::to_vec),
                });
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                at_end.insert(p);
            }
            Some(Err(e)) => return Err(e.into()),
        }
    }
}

/// Partition ids of `topic`, waiting for the topic to appear in metadata.
fn partitions(consumer: &BaseConsumer, topic: &str, timeout: Duration) -> Result<Vec<i32>> {
    crate::wait_until(&format!("topic {topic} in metadata"), timeout, || {
        let md = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .ok()?;
        let t = md.topics().iter().find(|t| t.name() == topic)?;
        if t.error().is_some() || t.partitions().is_empty() {
            return None;
        }
        Some(t.partitions().iter().map(|p| p.id()).collect())
    })
}
