//! The Amazon SQS sink: each event a message of the queue its topic names,
//! its body the event's value, its headers message attributes
//! ([`super::attributes`]), sent in `SendMessageBatch` calls of up to 10.
//!
//! FIFO queues (the default): `MessageGroupId` = the event's key (its
//! SHA-256 when SQS cannot take the key as it is), `MessageDeduplicationId`
//! = the event id (for a replay's copy, the event id and the replay's
//! name). SQS drops a message sent again under the same deduplication id
//! within 5 minutes: exactly once within that window. A batch answers each
//! entry on its own and stores the others when one fails, so a call holds
//! at most one message per group and a failed one goes again before
//! anything later of its group ([`crate::batched`]).
//!
//! A standard queue keeps no order: the sink refuses one unless
//! `ordered = false` says order does not matter.
//!
//! The queue name is the topic with every character SQS does not take in a
//! name (anything but `A-Z a-z 0-9 _ -`) made `-`, and `.fifo` added for a
//! FIFO queue: `outbox.order` -> `outbox-order.fifo`, its dead letters'
//! `outbox.order.dlq` -> `outbox-order-dlq.fifo`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName, SendMessageBatchRequestEntry};
use serde::Deserialize;
use walbox_outbox::Event;

use super::attributes::{self, Message, Value};
use super::{AwsConnection, call_error, setup_error};
use crate::batched::{Answer, Api, Batched, CallError, Limits};
use crate::{Deliveries, DeliveryClass, Sink, SinkError};

/// The most entries `SendMessageBatch` takes.
const MAX_ENTRIES: usize = 10;
/// SQS's largest message (body and attributes), and a batch's.
const MAX_MESSAGE_BYTES: usize = 1024 * 1024;
/// The longest queue name SQS takes.
const MAX_QUEUE_NAME: usize = 80;
/// The deduplication window of a FIFO queue.
pub const DEDUP_WINDOW: Duration = Duration::from_secs(300);

/// The `[sink.sqs]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqsSinkConfig {
    /// The region (default: the AWS chain's).
    #[serde(default)]
    pub region: Option<String>,
    /// The service's URL, for a stand-in or a VPC endpoint.
    #[serde(default)]
    pub endpoint_url: Option<String>,
    /// The profile of the AWS shared files.
    #[serde(default)]
    pub profile: Option<String>,
    /// FIFO queues (`.fifo`); `false` for standard queues, which keep no
    /// order and need `ordered = false`.
    #[serde(default = "yes")]
    pub fifo: bool,
    /// Whether per-key order matters: `false` accepts standard queues.
    #[serde(default = "yes")]
    pub ordered: bool,
    /// The largest message (body and attributes); a larger one is
    /// dead-lettered. 262144 (256 KiB) is SQS's classic limit; queues may
    /// take up to 1 MiB.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// Most `SendMessageBatch` calls in flight.
    #[serde(default = "default_max_requests")]
    pub max_requests: usize,
    /// The first backoff before a failed message is sent again.
    #[serde(default = "default_retry_initial_ms")]
    pub retry_initial_ms: u64,
    /// The longest backoff.
    #[serde(default = "default_retry_max_ms")]
    pub retry_max_ms: u64,
    /// How long a message may go on failing before the session ends (and a
    /// new one sends again from the confirmed position).
    #[serde(default = "default_max_retry_ms")]
    pub max_retry_ms: u64,
    /// Create a missing queue (from `[sink] create_topics`).
    #[serde(skip)]
    pub create_queues: bool,
    /// Credentials given by the program instead of the chain's.
    #[serde(skip)]
    pub credentials: Option<aws_credential_types::Credentials>,
}

fn yes() -> bool {
    true
}
fn default_max_message_bytes() -> usize {
    262_144
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
    120_000
}

impl Default for SqsSinkConfig {
    fn default() -> Self {
        SqsSinkConfig {
            region: None,
            endpoint_url: None,
            profile: None,
            fifo: true,
            ordered: true,
            max_message_bytes: default_max_message_bytes(),
            max_requests: default_max_requests(),
            retry_initial_ms: default_retry_initial_ms(),
            retry_max_ms: default_retry_max_ms(),
            max_retry_ms: default_max_retry_ms(),
            create_queues: false,
            credentials: None,
        }
    }
}

impl SqsSinkConfig {
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
        self.connection().validate("sink.sqs")?;
        if !self.fifo && self.ordered {
            return Err(SinkError::Config(
                "sink.sqs: a standard queue (fifo = false) keeps no order, neither per key nor \
                 at all; set ordered = false to say that order does not matter, or use FIFO \
                 queues (fifo = true)"
                    .into(),
            ));
        }
        if self.max_message_bytes == 0 || self.max_message_bytes > MAX_MESSAGE_BYTES {
            return Err(SinkError::Config(format!(
                "sink.sqs.max_message_bytes: {} is not within 1 to {MAX_MESSAGE_BYTES}",
                self.max_message_bytes
            )));
        }
        if self.max_requests == 0 {
            return Err(SinkError::Config(
                "sink.sqs.max_requests: must be at least 1".into(),
            ));
        }
        if self.retry_initial_ms == 0
            || self.retry_max_ms < self.retry_initial_ms
            || self.retry_max_ms > 3_600_000
            || self.max_retry_ms == 0
            || self.max_retry_ms > 86_400_000
        {
            return Err(SinkError::Config(
                "sink.sqs: retry_initial_ms must be at least 1, retry_max_ms at least \
                 retry_initial_ms and at most 3600000, max_retry_ms within 1 and 86400000"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Why a copy sent again may be stored twice, if it can happen within
    /// these settings: a message failing for longer than the deduplication
    /// window is sent again after it.
    #[must_use]
    pub fn window_warning(&self) -> Option<String> {
        (self.fifo && Duration::from_millis(self.max_retry_ms) >= DEDUP_WINDOW).then(|| {
            format!(
                "sink.sqs.max_retry_ms = {} reaches SQS's 5-minute deduplication window: a \
                 message sent again after failing that long is stored again (at least once \
                 then); an outage or a restart longer than 5 minutes has the same effect",
                self.max_retry_ms
            )
        })
    }

    fn limits(&self) -> Limits {
        Limits {
            max_entries: MAX_ENTRIES,
            max_bytes: MAX_MESSAGE_BYTES.max(self.max_message_bytes),
            max_calls: self.max_requests,
            retry_initial: Duration::from_millis(self.retry_initial_ms),
            retry_max: Duration::from_millis(self.retry_max_ms),
            max_retry: Duration::from_millis(self.max_retry_ms),
        }
    }

    /// The queue a topic names.
    #[must_use]
    pub fn queue_name(&self, topic: &str) -> String {
        attributes::aws_name(topic, self.fifo, MAX_QUEUE_NAME)
    }
}

/// The service's part: one `SendMessageBatch` call to a queue URL.
#[derive(Debug)]
struct Sqs {
    connection: AwsConnection,
    client: tokio::sync::OnceCell<aws_sdk_sqs::Client>,
}

impl Sqs {
    async fn client(&self) -> Result<&aws_sdk_sqs::Client, SinkError> {
        self.client
            .get_or_try_init(|| async {
                let sdk = self.connection.sdk_config("sink.sqs").await?;
                Ok(aws_sdk_sqs::Client::new(&sdk))
            })
            .await
    }
}

fn attribute_value(value: &Value) -> MessageAttributeValue {
    let built = match value {
        Value::Text(t) => MessageAttributeValue::builder()
            .data_type("String")
            .string_value(t.clone()),
        Value::Binary(b) => MessageAttributeValue::builder()
            .data_type("Binary")
            .binary_value(Blob::new(b.clone())),
    };
    built.build().expect("the data type is set")
}

impl Api for Sqs {
    type Entry = Message;

    async fn put(&self, dest: Arc<str>, entries: Vec<Message>) -> Result<Vec<Answer>, CallError> {
        let client = self
            .client
            .get()
            .expect("the client is made before the first event is handed on");
        let sent = entries.len();
        let batch: Vec<SendMessageBatchRequestEntry> = entries
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                let attributes: HashMap<String, MessageAttributeValue> = m
                    .attributes
                    .iter()
                    .map(|(n, v)| (n.clone(), attribute_value(v)))
                    .collect();
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(&*m.body)
                    .set_message_attributes(Some(attributes))
                    .set_message_group_id(m.group)
                    .set_message_deduplication_id(m.dedup)
                    .build()
                    .expect("id and body are set")
            })
            .collect();
        let out = client
            .send_message_batch()
            .queue_url(&*dest)
            .set_entries(Some(batch))
            .send()
            .await
            .map_err(|e| call_error(&e, "sqs", &dest))?;
        Ok(attributes::batch_answers(
            "sqs",
            &dest,
            sent,
            out.successful()
                .iter()
                .map(|ok| (ok.id(), !ok.message_id().is_empty())),
            out.failed().iter().map(|f| attributes::Failed {
                id: f.id(),
                code: f.code(),
                sender_fault: f.sender_fault(),
                message: f.message(),
            }),
        ))
    }
}

/// Writes events to SQS queues.
pub struct SqsSink {
    config: SqsSinkConfig,
    api: Arc<Sqs>,
    batched: Batched<Sqs>,
    /// Queue URLs by queue name, found (or made) in this sink's life.
    urls: HashMap<String, Arc<str>>,
}

impl std::fmt::Debug for SqsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsSink")
            .field("queues", &self.urls.len())
            .field("batched", &self.batched)
            .finish_non_exhaustive()
    }
}

impl SqsSink {
    /// A sink with these settings, and the receiver of its deliveries.
    pub fn new(config: SqsSinkConfig) -> Result<(Self, Deliveries), SinkError> {
        config.validate()?;
        if let Some(why) = config.window_warning() {
            tracing::warn!("{why}");
        }
        let api = Arc::new(Sqs {
            connection: config.connection(),
            client: tokio::sync::OnceCell::new(),
        });
        let (batched, deliveries) = Batched::new(Arc::clone(&api), config.limits());
        Ok((
            SqsSink {
                config,
                api,
                batched,
                urls: HashMap::new(),
            },
            deliveries,
        ))
    }

    /// Messages that failed and were sent again, so far.
    #[must_use]
    pub fn retries(&self) -> Arc<AtomicU64> {
        self.batched.retries()
    }

    /// The URL of queue `name`, found, or made when allowed.
    async fn url(&mut self, name: &str) -> Result<Arc<str>, SinkError> {
        if let Some(url) = self.urls.get(name) {
            return Ok(Arc::clone(url));
        }
        let client = self.api.client().await?;
        let url: Arc<str> = Arc::from(
            queue_url(client, name, self.config.create_queues, self.config.fifo)
                .await?
                .as_str(),
        );
        self.urls.insert(name.to_owned(), Arc::clone(&url));
        Ok(url)
    }

    /// The message `event` becomes, or why it cannot be one.
    fn message(&self, event: &Event) -> Result<(Message, usize), (DeliveryClass, String)> {
        attributes::message(
            event,
            self.config.fifo,
            self.config.max_message_bytes,
            "sink.sqs",
        )
    }
}

/// The URL of queue `name`: found, or created when `create` allows (FIFO
/// when `fifo`, deduplicating by the ids walbox gives, not by content).
async fn queue_url(
    client: &aws_sdk_sqs::Client,
    name: &str,
    create: bool,
    fifo: bool,
) -> Result<String, SinkError> {
    match client.get_queue_url().queue_name(name).send().await {
        Ok(out) => {
            return out
                .queue_url()
                .map(str::to_owned)
                .ok_or_else(|| SinkError::Aws(format!("sqs: no URL for queue {name:?}")));
        }
        Err(e) => {
            let missing = e.as_service_error().is_some_and(super::no_such_queue);
            if !missing {
                return Err(setup_error(&e, "sqs", &format!("finding queue {name:?}")));
            }
            if !create {
                return Err(SinkError::MissingTopic(name.to_owned()));
            }
        }
    }
    // The most SQS keeps a message (14 days, its default 4): a consumer
    // down over a long weekend, or a dead letter found late, is still there.
    let mut call = client
        .create_queue()
        .queue_name(name)
        .attributes(QueueAttributeName::MessageRetentionPeriod, MAX_RETENTION_S);
    if fifo {
        call = call
            .attributes(QueueAttributeName::FifoQueue, "true")
            .attributes(QueueAttributeName::ContentBasedDeduplication, "false");
    }
    let out = call.send().await.map_err(|e| SinkError::CreateTopic {
        topic: name.to_owned(),
        reason: super::error_text(&e),
    })?;
    tracing::info!(
        queue = name,
        fifo,
        "created the SQS queue (messages kept 14 days)"
    );
    out.queue_url()
        .map(str::to_owned)
        .ok_or_else(|| SinkError::Aws(format!("sqs: no URL for the queue {name:?} created")))
}

/// The longest SQS keeps a message, in seconds (14 days): what the queues
/// walbox makes keep.
pub const MAX_RETENTION_S: &str = "1209600";

impl Sink for SqsSink {
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        let name = self.config.queue_name(&event.topic);
        match self.message(&event) {
            Ok((message, size)) => {
                let url = self.url(&name).await?;
                self.batched.send(url, event, token, message, size).await
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

#[cfg(test)]
mod tests {
    use super::attributes::entry_answer;
    use super::*;

    #[test]
    fn a_senders_fault_is_the_messages_and_a_throttle_is_sent_again() {
        let refused = |a: Answer| matches!(a, Answer::Refused(..));
        assert!(refused(entry_answer(
            "InvalidParameterValueException",
            true,
            String::new()
        )));
        assert!(refused(entry_answer(
            "InvalidParameterValue",
            true,
            String::new()
        )));
        assert!(refused(entry_answer("SomethingNew", true, String::new())));
        assert!(!refused(entry_answer(
            "InternalError",
            false,
            String::new()
        )));
        assert!(!refused(entry_answer(
            "RequestThrottled",
            true,
            String::new()
        )));
    }

    #[test]
    fn a_long_topic_and_its_dead_letters_name_queues_sqs_takes() {
        let fifo = SqsSinkConfig::default();
        let topic = "t".repeat(73);
        let events = fifo.queue_name(&topic);
        let letters = fifo.queue_name(&format!("{topic}.dlq"));
        assert!(
            events.len() <= 80 && letters.len() <= 80,
            "{events} {letters}"
        );
        assert_ne!(events, letters);
        assert!(letters.ends_with(".fifo"));
        assert_eq!(letters, fifo.queue_name(&format!("{topic}.dlq")));
    }

    #[test]
    fn topics_name_queues_sqs_takes() {
        let fifo = SqsSinkConfig::default();
        assert_eq!(fifo.queue_name("outbox.order"), "outbox-order.fifo");
        assert_eq!(fifo.queue_name("outbox.order.dlq"), "outbox-order-dlq.fifo");
        assert_eq!(fifo.queue_name("orders.fifo"), "orders.fifo");
        let standard = SqsSinkConfig {
            fifo: false,
            ordered: false,
            ..SqsSinkConfig::default()
        };
        assert_eq!(standard.queue_name("outbox.order"), "outbox-order");
    }

    #[test]
    fn a_standard_queue_needs_order_given_up_and_a_long_retry_is_named() {
        let standard = SqsSinkConfig {
            fifo: false,
            ..SqsSinkConfig::default()
        };
        let e = standard.validate().unwrap_err().to_string();
        assert!(e.contains("ordered = false"), "{e}");
        assert!(SqsSinkConfig::default().window_warning().is_none());
        let long = SqsSinkConfig {
            max_retry_ms: 600_000,
            ..SqsSinkConfig::default()
        };
        assert!(long.window_warning().unwrap().contains("5-minute"));
    }

    #[test]
    fn a_body_sqs_cannot_carry_is_refused() {
        let (sink, _rx) = SqsSink::new(SqsSinkConfig::default()).unwrap();
        let mut e = crate::batched::tests_event("e1", "k");
        e.value = bytes::Bytes::from_static(b"a\x01b");
        assert_eq!(
            sink.message(&e).unwrap_err().0,
            DeliveryClass::InvalidRecord
        );
        e.value = bytes::Bytes::from(vec![b'x'; 300_000]);
        assert_eq!(
            sink.message(&e).unwrap_err().0,
            DeliveryClass::MessageTooLarge
        );
        e.value = bytes::Bytes::from_static(b"{}");
        let (m, _) = sink.message(&e).unwrap();
        assert_eq!(m.group.as_deref(), Some("k"));
        assert_eq!(m.dedup.as_deref().map(str::len), Some(64));
        // Two events with one event id at two positions: two messages.
        let mut other = e.clone();
        other.position.commit_lsn = walbox_pgoutput::Lsn(2);
        assert_ne!(sink.message(&other).unwrap().0.dedup, m.dedup);
    }
}
