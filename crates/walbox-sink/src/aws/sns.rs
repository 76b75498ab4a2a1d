//! The Amazon SNS sink: each event a message of the topic its topic names
//! (made a name SNS takes as SQS's queue names are, `.fifo` added), its
//! body the event's value, its headers message attributes, sent in
//! `PublishBatch` calls of up to 10 through per-key lanes.
//!
//! FIFO topics (the default) take `MessageGroupId` and
//! `MessageDeduplicationId` as SQS does ([`super::attributes`]): each key in
//! commit order, a message sent again within 5 minutes dropped. A standard
//! topic keeps no order and is refused unless `ordered = false`.
//!
//! SNS keeps nothing: a message published to a topic without a
//! subscription is gone, though acknowledged. The sink checks on first use
//! that every topic it publishes to has a subscription, and stops naming
//! the topic otherwise (`allow_no_subscription = true` to publish anyway).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use aws_sdk_sns::primitives::Blob;
use aws_sdk_sns::types::{MessageAttributeValue, PublishBatchRequestEntry};
use serde::Deserialize;
use walbox_outbox::Event;

use super::attributes::{self, Message, Value};
use super::{AwsConnection, call_error, setup_error};
use crate::batched::{Answer, Api, Batched, CallError, Limits};
use crate::{Deliveries, Sink, SinkError};

/// The most entries `PublishBatch` takes.
const MAX_ENTRIES: usize = 10;
/// SNS's largest message (body and attributes), and a batch's.
const MAX_MESSAGE_BYTES: usize = 256 * 1024;
/// The longest topic name SNS takes.
const MAX_TOPIC_NAME: usize = 256;
/// How long SNS FIFO remembers a deduplication id.
const DEDUP_WINDOW: Duration = Duration::from_secs(300);
/// How often a topic's subscriptions are looked at again while walbox
/// publishes to it: a topic deleted and made again keeps its ARN and loses
/// its subscriptions, and SNS goes on accepting what it then drops.
const SUBSCRIPTIONS_AGAIN: Duration = Duration::from_secs(30);

/// The `[sink.sns]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnsSinkConfig {
    /// The region (default: the AWS chain's).
    #[serde(default)]
    pub region: Option<String>,
    /// The service's URL, for a stand-in or a VPC endpoint.
    #[serde(default)]
    pub endpoint_url: Option<String>,
    /// The profile of the AWS shared files.
    #[serde(default)]
    pub profile: Option<String>,
    /// FIFO topics (`.fifo`); `false` for standard topics, which keep no
    /// order and need `ordered = false`.
    #[serde(default = "yes")]
    pub fifo: bool,
    /// Whether per-key order matters: `false` accepts standard topics.
    #[serde(default = "yes")]
    pub ordered: bool,
    /// Publish to a topic without a subscription (SNS drops the messages).
    #[serde(default)]
    pub allow_no_subscription: bool,
    /// The SQS queue subscribed to the dead-letter topics (raw delivery),
    /// which `walbox dlq replay` reads the letters back from.
    #[serde(default)]
    pub dead_letter_queue: Option<String>,
    /// The SQS service's URL for `dead_letter_queue` (default: the region's
    /// SQS endpoint; `endpoint_url` when that is set, for a stand-in that
    /// serves both).
    #[serde(default)]
    pub dead_letter_queue_endpoint_url: Option<String>,
    /// The largest message (body and attributes); a larger one is
    /// dead-lettered.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// Most `PublishBatch` calls in flight.
    #[serde(default = "default_max_requests")]
    pub max_requests: usize,
    /// The first backoff before a failed message is sent again.
    #[serde(default = "default_retry_initial_ms")]
    pub retry_initial_ms: u64,
    /// The longest backoff.
    #[serde(default = "default_retry_max_ms")]
    pub retry_max_ms: u64,
    /// How long a message may go on failing before the session ends.
    #[serde(default = "default_max_retry_ms")]
    pub max_retry_ms: u64,
    /// Create a missing topic (from `[sink] create_topics`).
    #[serde(skip)]
    pub create_topics: bool,
    /// Credentials given by the program instead of the chain's.
    #[serde(skip)]
    pub credentials: Option<aws_credential_types::Credentials>,
}

fn yes() -> bool {
    true
}
fn default_max_message_bytes() -> usize {
    MAX_MESSAGE_BYTES
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

impl Default for SnsSinkConfig {
    fn default() -> Self {
        SnsSinkConfig {
            region: None,
            endpoint_url: None,
            profile: None,
            fifo: true,
            ordered: true,
            allow_no_subscription: false,
            dead_letter_queue: None,
            dead_letter_queue_endpoint_url: None,
            max_message_bytes: default_max_message_bytes(),
            max_requests: default_max_requests(),
            retry_initial_ms: default_retry_initial_ms(),
            retry_max_ms: default_retry_max_ms(),
            max_retry_ms: default_max_retry_ms(),
            create_topics: false,
            credentials: None,
        }
    }
}

impl SnsSinkConfig {
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

    /// Where the SQS queue of the dead letters is: `endpoint_url` names
    /// SNS's endpoint, and SQS has its own.
    #[must_use]
    pub fn letters_connection(&self) -> AwsConnection {
        AwsConnection {
            endpoint_url: self
                .dead_letter_queue_endpoint_url
                .clone()
                .or_else(|| self.endpoint_url.clone()),
            ..self.connection()
        }
    }

    /// A warning when a message may go on failing past SNS's 5-minute
    /// deduplication window, after which a resend is stored again.
    #[must_use]
    pub fn window_warning(&self) -> Option<String> {
        (self.fifo && Duration::from_millis(self.max_retry_ms) >= DEDUP_WINDOW).then(|| {
            format!(
                "sink.sns.max_retry_ms = {} reaches SNS's 5-minute deduplication window: a \
                 message published again after failing that long is delivered again (at least \
                 once then); an outage or a restart longer than 5 minutes has the same effect",
                self.max_retry_ms
            )
        })
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<(), SinkError> {
        self.connection().validate("sink.sns")?;
        if !self.fifo && self.ordered {
            return Err(SinkError::Config(
                "sink.sns: a standard topic (fifo = false) keeps no order; set ordered = false \
                 to say that order does not matter, or use FIFO topics (fifo = true)"
                    .into(),
            ));
        }
        if self.max_message_bytes == 0 || self.max_message_bytes > MAX_MESSAGE_BYTES {
            return Err(SinkError::Config(format!(
                "sink.sns.max_message_bytes: {} is not within 1 to {MAX_MESSAGE_BYTES}",
                self.max_message_bytes
            )));
        }
        if self.max_requests == 0
            || self.retry_initial_ms == 0
            || self.retry_max_ms < self.retry_initial_ms
            || self.retry_max_ms > 3_600_000
            || self.max_retry_ms == 0
            || self.max_retry_ms > 86_400_000
        {
            return Err(SinkError::Config(
                "sink.sns: max_requests and retry_initial_ms must be at least 1, retry_max_ms \
                 at least retry_initial_ms and at most 3600000, max_retry_ms within 1 and \
                 86400000"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The topic name a topic template's topic gives.
    #[must_use]
    pub fn topic_name(&self, topic: &str) -> String {
        attributes::aws_name(topic, self.fifo, MAX_TOPIC_NAME)
    }

    fn limits(&self) -> Limits {
        Limits {
            max_entries: MAX_ENTRIES,
            max_bytes: MAX_MESSAGE_BYTES,
            max_calls: self.max_requests,
            retry_initial: Duration::from_millis(self.retry_initial_ms),
            retry_max: Duration::from_millis(self.retry_max_ms),
            max_retry: Duration::from_millis(self.max_retry_ms),
        }
    }
}

/// The service's part: one `PublishBatch` call to a topic ARN.
#[derive(Debug)]
struct Sns {
    connection: AwsConnection,
    client: tokio::sync::OnceCell<aws_sdk_sns::Client>,
}

impl Sns {
    async fn client(&self) -> Result<&aws_sdk_sns::Client, SinkError> {
        self.client
            .get_or_try_init(|| async {
                let sdk = self.connection.sdk_config("sink.sns").await?;
                Ok(aws_sdk_sns::Client::new(&sdk))
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

impl Api for Sns {
    type Entry = Message;

    async fn put(&self, dest: Arc<str>, entries: Vec<Message>) -> Result<Vec<Answer>, CallError> {
        let client = self
            .client
            .get()
            .expect("the client is made before the first event is handed on");
        let sent = entries.len();
        let batch: Vec<PublishBatchRequestEntry> = entries
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                let attributes: HashMap<String, MessageAttributeValue> = m
                    .attributes
                    .iter()
                    .map(|(n, v)| (n.clone(), attribute_value(v)))
                    .collect();
                PublishBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message(&*m.body)
                    .set_message_attributes(Some(attributes))
                    .set_message_group_id(m.group)
                    .set_message_deduplication_id(m.dedup)
                    .build()
                    .expect("id and message are set")
            })
            .collect();
        let out = client
            .publish_batch()
            .topic_arn(&*dest)
            .set_publish_batch_request_entries(Some(batch))
            .send()
            .await
            .map_err(|e| call_error(&e, "sns", &dest))?;
        Ok(attributes::batch_answers(
            "sns",
            &dest,
            sent,
            out.successful()
                .iter()
                .filter_map(|ok| Some((ok.id()?, ok.message_id().is_some()))),
            out.failed().iter().map(|f| attributes::Failed {
                id: f.id(),
                code: f.code(),
                sender_fault: f.sender_fault(),
                message: f.message(),
            }),
        ))
    }
}

/// Publishes events to SNS topics.
pub struct SnsSink {
    config: SnsSinkConfig,
    api: Arc<Sns>,
    batched: Batched<Sns>,
    /// Topic ARNs by topic name, found (or made) in this sink's life, and
    /// when their subscriptions were last seen.
    arns: HashMap<String, (Arc<str>, tokio::time::Instant)>,
}

impl std::fmt::Debug for SnsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnsSink")
            .field("topics", &self.arns.len())
            .field("batched", &self.batched)
            .finish_non_exhaustive()
    }
}

impl SnsSink {
    /// A sink with these settings, and the receiver of its deliveries.
    pub fn new(config: SnsSinkConfig) -> Result<(Self, Deliveries), SinkError> {
        config.validate()?;
        if let Some(why) = config.window_warning() {
            tracing::warn!("{why}");
        }
        let api = Arc::new(Sns {
            connection: config.connection(),
            client: tokio::sync::OnceCell::new(),
        });
        let (batched, deliveries) = Batched::new(Arc::clone(&api), config.limits());
        Ok((
            SnsSink {
                config,
                api,
                batched,
                arns: HashMap::new(),
            },
            deliveries,
        ))
    }

    /// Messages that failed and were sent again, so far.
    #[must_use]
    pub fn retries(&self) -> Arc<AtomicU64> {
        self.batched.retries()
    }

    /// The ARN of topic `name`: found, or made when allowed; checked to have
    /// a confirmed subscription, and checked again every
    /// [`SUBSCRIPTIONS_AGAIN`].
    async fn arn(&mut self, name: &str) -> Result<Arc<str>, SinkError> {
        let now = tokio::time::Instant::now();
        if let Some((arn, seen)) = self.arns.get(name)
            && (self.config.allow_no_subscription
                || now.duration_since(*seen) < SUBSCRIPTIONS_AGAIN)
        {
            return Ok(Arc::clone(arn));
        }
        let client = self.api.client().await?;
        let arn = match self.arns.get(name) {
            Some((arn, _)) => arn.to_string(),
            None => topic_arn(client, name, self.config.create_topics, self.config.fifo).await?,
        };
        if !self.config.allow_no_subscription && subscriptions(client, &arn).await? == 0 {
            return Err(SinkError::AwsRefused(format!(
                "sns: topic {name:?} has no subscription, so SNS would drop every message \
                 published to it (acknowledged, and lost): subscribe its consumers (an SQS \
                 queue) first, or set allow_no_subscription = true in [sink.sns]"
            )));
        }
        let arn: Arc<str> = Arc::from(arn.as_str());
        self.arns.insert(name.to_owned(), (Arc::clone(&arn), now));
        Ok(arn)
    }
}

/// The ARN of topic `name`: created when `create` allows (CreateTopic is
/// idempotent and answers the ARN), else found among the account's topics.
pub(crate) async fn topic_arn(
    client: &aws_sdk_sns::Client,
    name: &str,
    create: bool,
    fifo: bool,
) -> Result<String, SinkError> {
    if create {
        let mut call = client.create_topic().name(name);
        if fifo {
            call = call
                .attributes("FifoTopic", "true")
                .attributes("ContentBasedDeduplication", "false");
        }
        let out = call.send().await.map_err(|e| SinkError::CreateTopic {
            topic: name.to_owned(),
            reason: super::error_text(&e),
        })?;
        return out
            .topic_arn()
            .map(str::to_owned)
            .ok_or_else(|| SinkError::Aws(format!("sns: no ARN for topic {name:?}")));
    }
    let suffix = format!(":{name}");
    let mut next: Option<String> = None;
    loop {
        let out = client
            .list_topics()
            .set_next_token(next.take())
            .send()
            .await
            .map_err(|e| setup_error(&e, "sns", "listing the topics"))?;
        if let Some(arn) = out
            .topics()
            .iter()
            .filter_map(|t| t.topic_arn())
            .find(|arn| arn.ends_with(&suffix))
        {
            return Ok(arn.to_owned());
        }
        match out.next_token() {
            Some(token) => next = Some(token.to_owned()),
            None => return Err(SinkError::MissingTopic(name.to_owned())),
        }
    }
}

/// How many confirmed subscriptions topic `arn` has, page by page until one
/// is found (0: none at all).
pub(crate) async fn subscriptions(
    client: &aws_sdk_sns::Client,
    arn: &str,
) -> Result<usize, SinkError> {
    let mut next: Option<String> = None;
    let mut count = 0;
    loop {
        let out = client
            .list_subscriptions_by_topic()
            .topic_arn(arn)
            .set_next_token(next.take())
            .send()
            .await
            .map_err(|e| setup_error(&e, "sns", &format!("listing the subscriptions of {arn}")))?;
        count += confirmed(out.subscriptions());
        match out.next_token() {
            Some(token) if count == 0 => next = Some(token.to_owned()),
            _ => return Ok(count),
        }
    }
}

/// The subscriptions of `listed` that deliver: confirmed ones, whose ARN
/// is an ARN (one awaiting confirmation is listed as
/// `PendingConfirmation`, one being removed as `Deleted`; neither gets
/// anything).
fn confirmed(listed: &[aws_sdk_sns::types::Subscription]) -> usize {
    listed
        .iter()
        .filter(|s| s.subscription_arn().is_some_and(|a| a.starts_with("arn:")))
        .count()
}

impl Sink for SnsSink {
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        let name = self.config.topic_name(&event.topic);
        match attributes::message(
            &event,
            self.config.fifo,
            self.config.max_message_bytes,
            "sink.sns",
        ) {
            Ok((message, size)) => {
                let arn = self.arn(&name).await?;
                self.batched.send(arn, event, token, message, size).await
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
    use super::*;

    #[test]
    fn a_subscription_awaiting_confirmation_or_being_removed_delivers_nothing() {
        let listed = |arn: &str| {
            aws_sdk_sns::types::Subscription::builder()
                .subscription_arn(arn)
                .protocol("sqs")
                .build()
        };
        assert_eq!(confirmed(&[listed("PendingConfirmation")]), 0);
        assert_eq!(confirmed(&[listed("Deleted")]), 0);
        assert_eq!(
            confirmed(&[
                listed("PendingConfirmation"),
                listed("arn:aws:sns:us-east-1:000000000000:t.fifo:5d1e")
            ]),
            1
        );
    }

    #[test]
    fn a_retry_ceiling_reaching_the_window_is_warned_of_and_the_letters_have_sqss_endpoint() {
        assert!(SnsSinkConfig::default().window_warning().is_none());
        let long = SnsSinkConfig {
            max_retry_ms: 300_000,
            ..SnsSinkConfig::default()
        };
        assert!(long.window_warning().unwrap().contains("5-minute"));
        let aws = SnsSinkConfig {
            endpoint_url: Some("https://sns.eu-west-1.amazonaws.com".into()),
            dead_letter_queue_endpoint_url: Some("https://sqs.eu-west-1.amazonaws.com".into()),
            ..SnsSinkConfig::default()
        };
        assert_eq!(
            aws.letters_connection().endpoint_url.as_deref(),
            Some("https://sqs.eu-west-1.amazonaws.com")
        );
        let stand_in = SnsSinkConfig {
            endpoint_url: Some("http://127.0.0.1:4566".into()),
            ..SnsSinkConfig::default()
        };
        assert_eq!(
            stand_in.letters_connection().endpoint_url.as_deref(),
            Some("http://127.0.0.1:4566")
        );
    }

    #[test]
    fn topics_name_sns_topics_and_a_standard_topic_needs_order_given_up() {
        let fifo = SnsSinkConfig::default();
        assert_eq!(fifo.topic_name("outbox.order"), "outbox-order.fifo");
        assert_eq!(fifo.topic_name("outbox.order.dlq"), "outbox-order-dlq.fifo");
        let standard = SnsSinkConfig {
            fifo: false,
            ..SnsSinkConfig::default()
        };
        assert!(
            standard
                .validate()
                .unwrap_err()
                .to_string()
                .contains("ordered = false")
        );
    }
}
