//! The Amazon Kinesis Data Streams sink: each event a record of the stream
//! its topic names, its partition key the event's key, its data the JSON
//! object of [`super::envelope`] (the event id, key, headers and value),
//! sent in `PutRecords` batches.
//!
//! `PutRecords` stores the other records of a batch when one fails, and a
//! record sent again lands after whatever was stored meanwhile, so a batch
//! holds at most one record per key and a key has at most one record out
//! ([`crate::batched`]): a failed record (`ProvisionedThroughputExceeded`,
//! `InternalFailure`) goes again before anything later of its key. Kinesis
//! keeps no ids, so a record sent again after a crash or a lost answer is
//! stored again: at least once, the same `event_id` on every copy.
//!
//! The stream is checked on first use (and created with `create_topics`,
//! with `topic_partitions` shards, waiting until it is active).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use aws_sdk_kinesis::primitives::Blob;
use aws_sdk_kinesis::types::{PutRecordsRequestEntry, StreamStatus};
use bytes::Bytes;
use serde::Deserialize;
use walbox_outbox::Event;

use super::{AwsConnection, call_error, envelope, setup_error};
use crate::batched::{Answer, Api, Batched, CallError, Limits};
use crate::{Deliveries, DeliveryClass, Sink, SinkError};

/// The most records `PutRecords` takes.
const MAX_RECORDS: usize = 500;
/// The most bytes a `PutRecords` call takes (data and partition keys).
const MAX_REQUEST_BYTES: usize = 5 * 1024 * 1024;
/// The longest partition key, in characters.
const MAX_KEY_CHARS: usize = 256;

/// The `[sink.kinesis]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KinesisSinkConfig {
    /// The region (default: the AWS chain's).
    #[serde(default)]
    pub region: Option<String>,
    /// The service's URL, for a stand-in or a VPC endpoint.
    #[serde(default)]
    pub endpoint_url: Option<String>,
    /// The profile of the AWS shared files.
    #[serde(default)]
    pub profile: Option<String>,
    /// Most records per `PutRecords` call (at most 500).
    #[serde(default = "default_max_records")]
    pub max_records: usize,
    /// The largest record (data and partition key); a larger one is
    /// dead-lettered. 1 MiB is Kinesis's default limit.
    #[serde(default = "default_max_record_bytes")]
    pub max_record_bytes: usize,
    /// Most `PutRecords` calls in flight.
    #[serde(default = "default_max_requests")]
    pub max_requests: usize,
    /// The first backoff before a failed record is sent again.
    #[serde(default = "default_retry_initial_ms")]
    pub retry_initial_ms: u64,
    /// The longest backoff.
    #[serde(default = "default_retry_max_ms")]
    pub retry_max_ms: u64,
    /// How long a record may go on failing before the session ends (and a
    /// new one sends again from the confirmed position).
    #[serde(default = "default_max_retry_ms")]
    pub max_retry_ms: u64,
    /// With `create_topics`, the hours every stream walbox writes to keeps
    /// its records at least (Kinesis's own default is 24; past 24 is
    /// extended retention, billed per shard hour). A dead letter or an event
    /// nobody read in time is gone after it.
    #[serde(default = "default_retention_hours")]
    pub retention_hours: i32,
    /// Create a missing stream (from `[sink] create_topics`).
    #[serde(skip)]
    pub create_streams: bool,
    /// Shards of a created stream (from `[sink] topic_partitions`).
    #[serde(skip)]
    pub shards: i32,
    /// Credentials given by the program instead of the chain's.
    #[serde(skip)]
    pub credentials: Option<aws_credential_types::Credentials>,
}

fn default_max_records() -> usize {
    MAX_RECORDS
}
fn default_max_record_bytes() -> usize {
    1024 * 1024
}
fn default_max_requests() -> usize {
    8
}
fn default_retry_initial_ms() -> u64 {
    100
}
fn default_retry_max_ms() -> u64 {
    5_000
}
fn default_max_retry_ms() -> u64 {
    300_000
}
/// A week, as Kafka's `log.retention.hours`: a weekend's outage of a
/// consumer, or a dead letter found on Monday, is still there.
fn default_retention_hours() -> i32 {
    168
}
/// The hours Kinesis keeps a stream's records unless told otherwise, and
/// the most it keeps them.
const BASE_RETENTION_HOURS: i32 = 24;
const MAX_RETENTION_HOURS: i32 = 8_760;

impl Default for KinesisSinkConfig {
    fn default() -> Self {
        KinesisSinkConfig {
            region: None,
            endpoint_url: None,
            profile: None,
            max_records: default_max_records(),
            max_record_bytes: default_max_record_bytes(),
            max_requests: default_max_requests(),
            retry_initial_ms: default_retry_initial_ms(),
            retry_max_ms: default_retry_max_ms(),
            max_retry_ms: default_max_retry_ms(),
            retention_hours: default_retention_hours(),
            create_streams: false,
            shards: 1,
            credentials: None,
        }
    }
}

impl KinesisSinkConfig {
    /// Where the service is.
    #[must_use]
    pub fn connection(&self) -> AwsConnection {
        AwsConnection {
            region: self.region.clone(),
            endpoint_url: self.endpoint_url.clone(),
            profile: self.profile.clone(),
            credentials: self.credentials.clone(),
        }
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<(), SinkError> {
        self.connection().validate("sink.kinesis")?;
        if !(1..=MAX_RECORDS).contains(&self.max_records) {
            return Err(SinkError::Config(format!(
                "sink.kinesis.max_records: {} is not within 1 to {MAX_RECORDS}",
                self.max_records
            )));
        }
        if self.max_record_bytes == 0 || self.max_record_bytes > MAX_REQUEST_BYTES {
            return Err(SinkError::Config(format!(
                "sink.kinesis.max_record_bytes: {} is not within 1 to {MAX_REQUEST_BYTES}",
                self.max_record_bytes
            )));
        }
        if self.max_requests == 0 {
            return Err(SinkError::Config(
                "sink.kinesis.max_requests: must be at least 1".into(),
            ));
        }
        if !(BASE_RETENTION_HOURS..=MAX_RETENTION_HOURS).contains(&self.retention_hours) {
            return Err(SinkError::Config(format!(
                "sink.kinesis.retention_hours: {} is not within {BASE_RETENTION_HOURS} to \
                 {MAX_RETENTION_HOURS}",
                self.retention_hours
            )));
        }
        if self.retry_initial_ms == 0
            || self.retry_max_ms < self.retry_initial_ms
            || self.retry_max_ms > 3_600_000
        {
            return Err(SinkError::Config(
                "sink.kinesis: retry_initial_ms must be at least 1, and retry_max_ms at least \
                 retry_initial_ms and at most 3600000 (an hour)"
                    .into(),
            ));
        }
        if self.max_retry_ms == 0 || self.max_retry_ms > 86_400_000 {
            return Err(SinkError::Config(
                "sink.kinesis.max_retry_ms: must be within 1 and 86400000 (a day)".into(),
            ));
        }
        Ok(())
    }

    fn limits(&self) -> Limits {
        Limits {
            max_entries: self.max_records,
            max_bytes: MAX_REQUEST_BYTES,
            max_calls: self.max_requests,
            retry_initial: Duration::from_millis(self.retry_initial_ms),
            retry_max: Duration::from_millis(self.retry_max_ms),
            max_retry: Duration::from_millis(self.max_retry_ms),
        }
    }
}

/// A record as `PutRecords` takes it.
#[derive(Debug, Clone)]
pub(crate) struct Record {
    key: String,
    data: Bytes,
}

/// The service's part: one `PutRecords` call. The client is made on the
/// first event (the credentials chain is read then, on the relay's
/// runtime).
#[derive(Debug)]
struct Kinesis {
    connection: AwsConnection,
    client: tokio::sync::OnceCell<aws_sdk_kinesis::Client>,
}

impl Kinesis {
    async fn client(&self) -> Result<&aws_sdk_kinesis::Client, SinkError> {
        self.client
            .get_or_try_init(|| async {
                let sdk = self.connection.sdk_config("sink.kinesis").await?;
                Ok(aws_sdk_kinesis::Client::new(&sdk))
            })
            .await
    }
}

impl Api for Kinesis {
    type Entry = Record;

    async fn put(&self, dest: Arc<str>, entries: Vec<Record>) -> Result<Vec<Answer>, CallError> {
        let client = self
            .client
            .get()
            .expect("the client is made before the first event is handed on");
        let records: Vec<PutRecordsRequestEntry> = entries
            .into_iter()
            .map(|r| {
                PutRecordsRequestEntry::builder()
                    .partition_key(r.key)
                    .data(Blob::new(r.data.to_vec()))
                    .build()
                    .expect("data and partition key are set")
            })
            .collect();
        let sent = records.len();
        let out = client
            .put_records()
            .stream_name(&*dest)
            .set_records(Some(records))
            .send()
            .await
            .map_err(|e| call_error(&e, "kinesis", &dest))?;
        let answers: Vec<Answer> = out
            .records()
            .iter()
            .map(|r| match (r.error_code(), r.sequence_number()) {
                (None, Some(_)) => Answer::Stored,
                (None, None) => Answer::Retry(format!(
                    "kinesis answered a record of {dest:?} with neither a sequence number nor \
                     an error code"
                )),
                // Throttled, an internal failure, a KMS key throttled or
                // unusable: sent again; what does not pass ends the session
                // at the retry ceiling, with the code in its reason.
                (Some(code), _) => Answer::Retry(format!(
                    "kinesis answered {code} for a record of {dest:?}: {}",
                    r.error_message().unwrap_or("")
                )),
            })
            .collect();
        if answers.len() != sent {
            return Err(CallError::Retry(format!(
                "kinesis answered {} records of {sent} sent to {dest:?}",
                answers.len()
            )));
        }
        Ok(answers)
    }
}

/// Writes events to Kinesis Data Streams.
pub struct KinesisSink {
    config: KinesisSinkConfig,
    api: Arc<Kinesis>,
    batched: Batched<Kinesis>,
    /// Streams checked (or created) in this sink's life, with the largest
    /// record each takes (its `MaxRecordSizeInKiB`, 1 MiB unless raised).
    known: HashMap<Arc<str>, usize>,
}

impl std::fmt::Debug for KinesisSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KinesisSink")
            .field("streams", &self.known.len())
            .field("batched", &self.batched)
            .finish_non_exhaustive()
    }
}

impl KinesisSink {
    /// A sink with these settings, and the receiver of its deliveries.
    pub fn new(config: KinesisSinkConfig) -> Result<(Self, Deliveries), SinkError> {
        config.validate()?;
        let api = Arc::new(Kinesis {
            connection: config.connection(),
            client: tokio::sync::OnceCell::new(),
        });
        let (batched, deliveries) = Batched::new(Arc::clone(&api), config.limits());
        Ok((
            KinesisSink {
                config,
                api,
                batched,
                known: HashMap::new(),
            },
            deliveries,
        ))
    }

    /// Records that failed and were sent again, so far.
    #[must_use]
    pub fn retries(&self) -> Arc<AtomicU64> {
        self.batched.retries()
    }

    /// Checks that `stream` exists and is active, creating it when allowed;
    /// the largest record it takes.
    async fn ensure(&mut self, stream: &Arc<str>) -> Result<usize, SinkError> {
        if let Some(largest) = self.known.get(stream) {
            return Ok(*largest);
        }
        let client = self.api.client().await?;
        let largest = ensure_stream(
            client,
            stream,
            self.config.create_streams.then_some(Created {
                shards: self.config.shards,
                retention_hours: self.config.retention_hours,
            }),
        )
        .await?;
        self.known.insert(Arc::clone(stream), largest);
        Ok(largest)
    }

    /// The record `event` becomes, or why it cannot be one.
    fn record(&self, event: &Event) -> Result<(Record, usize), (DeliveryClass, String)> {
        let key = partition_key(event)?;
        let data = Bytes::from(envelope::encode(event));
        let size = data.len() + key.len();
        if size > self.config.max_record_bytes {
            return Err((
                DeliveryClass::MessageTooLarge,
                format!(
                    "the record is {size} bytes (data and partition key), above \
                     sink.kinesis.max_record_bytes = {}",
                    self.config.max_record_bytes
                ),
            ));
        }
        Ok((Record { key, data }, size))
    }
}

/// The partition key of `event`: its key, which must be UTF-8 text of 1 to
/// 256 characters. An event without a key is spread by its event id (no
/// order is promised for it); a dead letter whose key Kinesis cannot take
/// goes under its event id, so that the letter itself is never refused.
fn partition_key(event: &Event) -> Result<String, (DeliveryClass, String)> {
    let Some(key) = &event.key else {
        return Ok(id_key(&event.event_id));
    };
    let refused = match std::str::from_utf8(key) {
        Ok("") => "an empty key is no Kinesis partition key".to_owned(),
        Ok(text) if key_units(text) > MAX_KEY_CHARS => format!(
            "the key is {} UTF-16 units long, above Kinesis's {MAX_KEY_CHARS} for a partition \
             key",
            key_units(text)
        ),
        Ok(text) => return Ok(text.to_owned()),
        Err(_) => "the key is no UTF-8 text, which a Kinesis partition key must be".to_owned(),
    };
    if crate::kit::is_dead_letter(event) {
        return Ok(id_key(&event.event_id));
    }
    Err((DeliveryClass::InvalidRecord, refused))
}

/// A partition key's length as Kinesis counts it (UTF-16 units).
fn key_units(text: &str) -> usize {
    text.encode_utf16().count()
}

/// The partition key an event id gives: the id itself when Kinesis takes
/// it, else its SHA-256 in hex (an id that is empty or too long).
fn id_key(event_id: &str) -> String {
    if !event_id.is_empty() && key_units(event_id) <= MAX_KEY_CHARS {
        return event_id.to_owned();
    }
    use sha2::Digest as _;
    sha2::Sha256::digest(event_id.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Raises the retention of `stream`, which walbox just made, to what
/// `create` says.
async fn keep_records(
    client: &aws_sdk_kinesis::Client,
    stream: &str,
    create: Option<Created>,
) -> Result<(), SinkError> {
    let hours = create.map_or(BASE_RETENTION_HOURS, |c| c.retention_hours);
    if hours <= BASE_RETENTION_HOURS {
        return Ok(());
    }
    client
        .increase_stream_retention_period()
        .stream_name(stream)
        .retention_period_hours(hours)
        .send()
        .await
        .map_err(|e| {
            setup_error(
                &e,
                "kinesis",
                &format!("raising the retention of stream {stream:?} to {hours} h"),
            )
        })?;
    tracing::info!(stream, hours, "the Kinesis stream keeps its records");
    Ok(())
}

/// The largest record a stream whose summary says `kib` takes: 1 MiB
/// unless the stream was raised (`UpdateMaxRecordSize`, up to 10 MiB).
fn largest_record(kib: Option<i32>) -> usize {
    kib.and_then(|k| usize::try_from(k).ok())
        .filter(|k| *k > 0)
        .map_or(BASE_RECORD_BYTES, |k| k * 1024)
}

/// The largest record of a stream whose size was never raised.
const BASE_RECORD_BYTES: usize = 1024 * 1024;

/// How walbox makes a stream that is missing.
#[derive(Debug, Clone, Copy)]
struct Created {
    shards: i32,
    retention_hours: i32,
}

/// Checks that `stream` exists and is active (or updating), creating it as
/// `create` says when it allows, and waiting while it is being created.
/// When `create` allows, a stream keeping its records less than
/// `retention_hours` is raised to it. The largest record the stream takes.
async fn ensure_stream(
    client: &aws_sdk_kinesis::Client,
    stream: &str,
    create: Option<Created>,
) -> Result<usize, SinkError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut created = false;
    loop {
        match client
            .describe_stream_summary()
            .stream_name(stream)
            .send()
            .await
        {
            Ok(out) => {
                let summary = out.stream_description_summary();
                let status = summary.map(|s| s.stream_status().clone());
                let largest = largest_record(summary.and_then(|s| s.max_record_size_in_kib()));
                let kept = summary.map_or(BASE_RETENTION_HOURS, |s| s.retention_period_hours());
                match status {
                    // With create_topics walbox keeps its streams' records
                    // at least `retention_hours`: also a stream it made in
                    // a run that ended before the retention was raised.
                    Some(StreamStatus::Active)
                        if create.is_some_and(|c| kept < c.retention_hours) =>
                    {
                        keep_records(client, stream, create).await?;
                        return Ok(largest);
                    }
                    Some(StreamStatus::Active | StreamStatus::Updating) => return Ok(largest),
                    Some(StreamStatus::Deleting) => {
                        return Err(SinkError::AwsRefused(format!(
                            "kinesis: stream {stream:?} is being deleted"
                        )));
                    }
                    _ => {}
                }
            }
            Err(e) => {
                let missing = e
                    .as_service_error()
                    .is_some_and(|se| se.is_resource_not_found_exception());
                if !missing {
                    return Err(setup_error(
                        &e,
                        "kinesis",
                        &format!("describing stream {stream:?}"),
                    ));
                }
                let Some(Created { shards, .. }) = create else {
                    return Err(SinkError::MissingTopic(stream.to_owned()));
                };
                if !created {
                    if let Err(e) = client
                        .create_stream()
                        .stream_name(stream)
                        .shard_count(shards.max(1))
                        .send()
                        .await
                    {
                        let raced = e
                            .as_service_error()
                            .is_some_and(|se| se.is_resource_in_use_exception());
                        if !raced {
                            return Err(SinkError::CreateTopic {
                                topic: stream.to_owned(),
                                reason: super::error_text(&e),
                            });
                        }
                    }
                    tracing::info!(stream, shards, "created the Kinesis stream");
                    created = true;
                }
            }
        }
        if tokio::time::Instant::now() > deadline {
            return Err(SinkError::Aws(format!(
                "kinesis: stream {stream:?} is not active after 120 s"
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

impl Sink for KinesisSink {
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        let stream: Arc<str> = Arc::from(event.topic.as_str());
        if !valid_stream_name(&stream) {
            let why =
                format!("{stream:?} is no Kinesis stream name (1 to 128 of a-z, A-Z, 0-9, _ . -)");
            self.batched
                .refuse(&event, token, DeliveryClass::InvalidTopic, why);
            return Ok(());
        }
        match self.record(&event) {
            Ok((record, size)) => {
                let largest = self.ensure(&stream).await?;
                if size > largest {
                    // The stream's own bound, below walbox's: Kinesis would
                    // refuse the whole call holding it.
                    let why = format!(
                        "the record is {size} bytes (data and partition key), above the {largest} \
                         stream {stream:?} takes (its MaxRecordSizeInKiB; raise it with \
                         UpdateMaxRecordSize, up to 10 MiB)"
                    );
                    self.batched
                        .refuse(&event, token, DeliveryClass::MessageTooLarge, why);
                    return Ok(());
                }
                self.batched.send(stream, event, token, record, size).await
            }
            Err((class, why)) => {
                self.batched.refuse(&event, token, class, why);
                Ok(())
            }
        }
    }

    fn abort(&mut self) {
        self.batched.abort();
    }

    async fn flush(&mut self, timeout: Duration) -> Result<(), SinkError> {
        self.batched.flush(timeout).await
    }
}

fn valid_stream_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_kinesis_cannot_take_is_refused_but_a_dead_letters_is_not() {
        let mut event = crate::batched::tests_event("e1", "k");
        assert_eq!(partition_key(&event).unwrap(), "k");
        event.key = Some(Bytes::from("x".repeat(257)));
        let (class, why) = partition_key(&event).unwrap_err();
        assert_eq!(class, DeliveryClass::InvalidRecord);
        assert!(why.contains("257 UTF-16 units"), "{why}");
        event.key = Some(Bytes::from_static(&[0xff]));
        assert!(partition_key(&event).is_err());
        event.headers.push((
            walbox_outbox::dead_letter_header::ERROR_CLASS.into(),
            Bytes::from_static(b"invalid_record"),
        ));
        assert_eq!(partition_key(&event).unwrap(), "e1");
        event.key = None;
        assert_eq!(partition_key(&event).unwrap(), "e1");
        // Ids Kinesis cannot take as they are go by their hash.
        event.event_id = "x".repeat(300);
        assert_eq!(partition_key(&event).unwrap().len(), 64);
        event.event_id = String::new();
        assert_eq!(partition_key(&event).unwrap().len(), 64);
        // Lengths are counted in UTF-16 units, as Kinesis counts them.
        event.key = Some(Bytes::from("😀".repeat(200)));
        event.headers.clear();
        assert!(partition_key(&event).is_err(), "400 UTF-16 units");
    }

    #[test]
    fn stream_names_are_checked_as_kinesis_does() {
        assert!(valid_stream_name("outbox.order-1_x"));
        assert!(!valid_stream_name(""));
        assert!(!valid_stream_name("a/b"));
        assert!(!valid_stream_name(&"a".repeat(129)));
    }

    #[test]
    fn a_stream_takes_a_mebibyte_record_unless_raised() {
        assert_eq!(largest_record(None), 1024 * 1024);
        assert_eq!(largest_record(Some(0)), 1024 * 1024);
        assert_eq!(largest_record(Some(10_240)), 10 * 1024 * 1024);
    }
}
