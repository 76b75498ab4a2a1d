//! The Kafka sink: an idempotent rdkafka producer (`acks=all`, murmur2 keys),
//! topics checked or created on first use, delivery failures classified. A
//! broker that refuses the credentials stops the sink with
//! [`SinkError::Authentication`].

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use tokio::sync::mpsc;
use walbox_outbox::Event;

use crate::secrets::{AuthFailure, Redacted};
use crate::{Deliveries, Delivery, DeliveryClass, DeliveryError, RejectedRecord, Sink, SinkError};

/// Settings of the Kafka sink. Its `Debug` form hides the values of secret
/// properties ([`crate::is_secret_property`]).
#[derive(Clone)]
pub struct KafkaSinkConfig {
    /// librdkafka properties (`bootstrap.servers`, security, compression, linger,
    /// ...), passed through. `enable.idempotence` and `acks` are fixed.
    pub properties: Vec<(String, String)>,
    /// Create a missing topic on first use instead of stopping.
    pub create_topics: bool,
    /// Partitions of created topics.
    pub topic_partitions: i32,
    /// Replication factor of created topics.
    pub topic_replication: i32,
    /// Most events in flight at once (the relay's bound); sizes the producer queue.
    pub max_in_flight: usize,
}

impl std::fmt::Debug for KafkaSinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSinkConfig")
            .field("properties", &Redacted(&self.properties))
            .field("create_topics", &self.create_topics)
            .field("topic_partitions", &self.topic_partitions)
            .field("topic_replication", &self.topic_replication)
            .field("max_in_flight", &self.max_in_flight)
            .finish()
    }
}

impl KafkaSinkConfig {
    /// The error for a broker that refused the credentials.
    fn authentication_error(&self, reason: String) -> SinkError {
        crate::secrets::authentication_error(&self.properties, reason)
    }
}

impl Default for KafkaSinkConfig {
    fn default() -> Self {
        KafkaSinkConfig {
            properties: Vec::new(),
            create_topics: false,
            topic_partitions: 6,
            topic_replication: 1,
            max_in_flight: 10_000,
        }
    }
}

/// Forwards librdkafka's delivery reports to the relay, and records the
/// broker refusing the credentials.
struct Reports {
    tx: mpsc::UnboundedSender<Delivery>,
    auth: AuthFailure,
}

impl ClientContext for Reports {
    fn error(&self, error: KafkaError, reason: &str) {
        if self.auth.observe(&error, reason) {
            tracing::error!(%error, reason, "kafka: the broker refused the credentials");
        } else {
            tracing::error!(%error, reason, "kafka client error");
        }
    }
}

/// Records the admin client's authentication failures too.
struct AdminContext {
    auth: AuthFailure,
}

impl ClientContext for AdminContext {
    fn error(&self, error: KafkaError, reason: &str) {
        if !self.auth.observe(&error, reason) {
            tracing::error!(%error, reason, "kafka admin client error");
        }
    }
}

/// What a record's delivery report gives back: the relay's token and the
/// event's id, as the sink was handed them (never read from the record's
/// headers, where each format puts the id somewhere else).
struct Sent {
    token: usize,
    event_id: String,
}

impl ProducerContext for Reports {
    type DeliveryOpaque = Box<Sent>;

    fn delivery(&self, result: &DeliveryResult<'_>, sent: Box<Sent>) {
        let Sent { token, event_id } = *sent;
        let result = match result {
            Ok(_) => Ok(()),
            Err((err, msg)) => {
                let mut class = classify(err);
                // Undelivered because no broker would take the credentials.
                if matches!(class, DeliveryClass::Timeout | DeliveryClass::BrokerError)
                    && self.auth.get().is_some()
                {
                    class = DeliveryClass::Authentication;
                }
                let mut e = DeliveryError {
                    event_id,
                    topic: msg.topic().to_owned(),
                    class,
                    reason: err.to_string(),
                    rejected: None,
                };
                if e.is_about_the_message() {
                    e.rejected = Some(RejectedRecord {
                        key: msg.key().map(bytes::Bytes::copy_from_slice),
                        headers: msg
                            .headers()
                            .map(|hs| {
                                hs.iter()
                                    .map(|h| {
                                        (
                                            h.key.to_owned().into(),
                                            bytes::Bytes::copy_from_slice(
                                                h.value.unwrap_or_default(),
                                            ),
                                        )
                                    })
                                    .collect()
                            })
                            .unwrap_or_default(),
                        value_len: msg.payload_len(),
                        attempts: 1,
                    });
                }
                Err(e)
            }
        };
        let _ = self.tx.send(Delivery { token, result });
    }
}

/// The class of a delivery failure.
fn classify(err: &KafkaError) -> DeliveryClass {
    match err.rdkafka_error_code() {
        Some(RDKafkaErrorCode::MessageSizeTooLarge | RDKafkaErrorCode::InvalidMessageSize) => {
            DeliveryClass::MessageTooLarge
        }
        Some(RDKafkaErrorCode::MessageTimedOut) => DeliveryClass::Timeout,
        Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic) => {
            DeliveryClass::UnknownTopic
        }
        Some(
            RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed
            | RDKafkaErrorCode::TransactionalIdAuthorizationFailed,
        ) => DeliveryClass::Authorization,
        Some(RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed) => {
            DeliveryClass::Authentication
        }
        Some(RDKafkaErrorCode::InvalidTopic) => DeliveryClass::InvalidTopic,
        // The broker refuses this record as such (e.g. no key on a compacted topic).
        Some(RDKafkaErrorCode::InvalidRecord) => DeliveryClass::InvalidRecord,
        _ => DeliveryClass::BrokerError,
    }
}

/// Publishes events with an idempotent producer (`acks=all`); keys are
/// partitioned with murmur2 like the Java client, so an aggregate lands on the same
/// partition whichever client wrote it.
pub struct KafkaSink {
    producer: Arc<ThreadedProducer<Reports>>,
    admin: AdminClient<AdminContext>,
    config: KafkaSinkConfig,
    auth: AuthFailure,
    known_topics: HashSet<String>,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("known_topics", &self.known_topics)
            .finish_non_exhaustive()
    }
}

/// What a topic check found out.
enum TopicCheck {
    /// The broker answered: whether the topic exists.
    Exists(bool),
    /// The broker refused the credentials.
    Refused(String),
    /// No answer.
    Failed(KafkaError),
}

/// A metadata request's wait, and how many of them make up the 30 s a topic
/// check waits for the broker.
const METADATA_TURN: Duration = Duration::from_secs(1);
const METADATA_TURNS: u32 = 30;

/// Properties walbox sets itself and does not let configuration change.
const FIXED: &[(&str, &str)] = &[("enable.idempotence", "true"), ("acks", "all")];

impl KafkaSink {
    /// Creates the producer; returns the sink and the receiver of its deliveries.
    pub fn new(config: KafkaSinkConfig) -> Result<(Self, Deliveries), SinkError> {
        let mut cc = ClientConfig::new();
        // Defaults the configuration may override.
        cc.set("partitioner", "murmur2_random")
            .set("linger.ms", "5")
            .set(
                "queue.buffering.max.messages",
                (config.max_in_flight.saturating_mul(2))
                    .max(100_000)
                    .to_string(),
            );
        for (k, v) in &config.properties {
            if let Some((_, fixed)) = FIXED.iter().find(|(name, _)| name == k)
                && v != fixed
            {
                return Err(SinkError::Config(format!(
                    "kafka property {k} must be {fixed} (walbox relies on it)"
                )));
            }
            cc.set(k, v);
        }
        for (k, v) in FIXED {
            cc.set(*k, *v);
        }
        if cc.get("bootstrap.servers").is_none() {
            return Err(SinkError::Config(
                "kafka property bootstrap.servers is required".into(),
            ));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let auth = AuthFailure::default();
        let producer: ThreadedProducer<Reports> = cc.create_with_context(Reports {
            tx,
            auth: auth.clone(),
        })?;
        let admin: AdminClient<AdminContext> =
            cc.create_with_context(AdminContext { auth: auth.clone() })?;
        Ok((
            KafkaSink {
                producer: Arc::new(producer),
                admin,
                config,
                auth,
                known_topics: HashSet::new(),
            },
            rx,
        ))
    }

    /// Makes sure `topic` exists: known, found in metadata, or created.
    async fn ensure_topic(&mut self, topic: &str) -> Result<(), SinkError> {
        if self.known_topics.contains(topic) {
            return Ok(());
        }
        let producer = Arc::clone(&self.producer);
        let name = topic.to_owned();
        let auth = self.auth.clone();
        // Asked in short turns, so that refused credentials stop it early.
        let answer = tokio::task::spawn_blocking(move || {
            let mut last = None;
            for _ in 0..METADATA_TURNS {
                if let Some(reason) = auth.get() {
                    return TopicCheck::Refused(reason);
                }
                // All topics: asking for one by name could make a broker auto-create it.
                match producer.client().fetch_metadata(None, METADATA_TURN) {
                    Ok(md) => {
                        return TopicCheck::Exists(
                            md.topics()
                                .iter()
                                .any(|t| t.name() == name && t.error().is_none()),
                        );
                    }
                    Err(e) => last = Some(e),
                }
            }
            match (auth.get(), last) {
                (Some(reason), _) => TopicCheck::Refused(reason),
                (None, Some(e)) => TopicCheck::Failed(e),
                (None, None) => TopicCheck::Failed(KafkaError::MetadataFetch(
                    RDKafkaErrorCode::OperationTimedOut,
                )),
            }
        })
        .await
        .map_err(|e| SinkError::Config(format!("metadata task: {e}")))?;
        let exists = match answer {
            TopicCheck::Exists(exists) => exists,
            TopicCheck::Refused(reason) => return Err(self.config.authentication_error(reason)),
            TopicCheck::Failed(e) => return Err(e.into()),
        };
        if !exists {
            if !self.config.create_topics {
                return Err(SinkError::MissingTopic(topic.to_owned()));
            }
            let results = self
                .admin
                .create_topics(
                    &[NewTopic::new(
                        topic,
                        self.config.topic_partitions,
                        TopicReplication::Fixed(self.config.topic_replication),
                    )],
                    &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
                )
                .await;
            let results = match (results, self.auth.get()) {
                (_, Some(reason)) => return Err(self.config.authentication_error(reason)),
                (r, None) => r?,
            };
            for r in results {
                match r {
                    Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                    Err((t, code)) => {
                        return Err(SinkError::CreateTopic {
                            topic: t,
                            reason: code.to_string(),
                        });
                    }
                }
            }
            tracing::info!(
                topic,
                partitions = self.config.topic_partitions,
                "created topic"
            );
        }
        self.known_topics.insert(topic.to_owned());
        Ok(())
    }
}

impl Sink for KafkaSink {
    async fn send(&mut self, mut event: Event, token: usize) -> Result<(), SinkError> {
        self.ensure_topic(&event.topic).await?;
        let sent = Box::new(Sent {
            token,
            event_id: std::mem::take(&mut event.event_id),
        });
        let mut headers = OwnedHeaders::new_with_capacity(event.headers.len());
        for (k, v) in &event.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_ref()),
            });
        }
        let mut record = BaseRecord::with_opaque_to(&event.topic, sent)
            .payload(event.value.as_ref())
            .headers(headers);
        if let Some(key) = &event.key {
            record = record.key(key.as_ref());
        }
        loop {
            match self.producer.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    // The relay bounds what is in flight below the queue size, so this
                    // is rare: give the producer thread a moment to drain.
                    record = r;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, r)) => {
                    // Refused before it was queued (e.g. larger than message.max.bytes):
                    // report it as this event's delivery failure.
                    let Sent { token, event_id } = *r.delivery_opaque;
                    let mut failure = crate::kit::failure(&event, classify(&e), e.to_string());
                    failure.event_id = event_id;
                    self.producer
                        .context()
                        .tx
                        .send(Delivery {
                            token,
                            result: Err(failure),
                        })
                        .ok();
                    return Ok(());
                }
            }
        }
    }

    fn abort(&mut self) {
        // Queued messages are never sent; requests on the wire are abandoned
        // (a broker may still have written those: they precede the failure in
        // the partition only if they were sent before it).
        self.producer
            .purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
    }

    async fn flush(&mut self, timeout: Duration) -> Result<(), SinkError> {
        let producer = Arc::clone(&self.producer);
        tokio::task::spawn_blocking(move || producer.flush(timeout))
            .await
            .map_err(|e| SinkError::Config(format!("flush task: {e}")))??;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(props: &[(&str, &str)]) -> KafkaSinkConfig {
        KafkaSinkConfig {
            properties: props
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..KafkaSinkConfig::default()
        }
    }

    #[test]
    fn tls_sasl_and_compression_properties_are_available() {
        // librdkafka refuses these at configuration time when built without them.
        let sink = KafkaSink::new(config(&[
            ("bootstrap.servers", "127.0.0.1:1"),
            ("security.protocol", "sasl_ssl"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "walbox"),
            ("sasl.password", "secret"),
            ("compression.type", "zstd"),
        ]));
        assert!(sink.is_ok(), "{:?}", sink.err());
        for mechanism in ["SCRAM-SHA-256", "PLAIN"] {
            let sink = KafkaSink::new(config(&[
                ("bootstrap.servers", "127.0.0.1:1"),
                ("security.protocol", "sasl_plaintext"),
                ("sasl.mechanism", mechanism),
                ("sasl.username", "walbox"),
                ("sasl.password", "secret"),
            ]));
            assert!(sink.is_ok(), "{mechanism}: {:?}", sink.err());
        }
    }

    #[test]
    fn settings_and_configuration_errors_print_no_secret() {
        let c = config(&[
            ("bootstrap.servers", "127.0.0.1:1"),
            ("sasl.password", "pw-4f1b8e"),
            ("ssl.key.password", "pw-90ac2d"),
        ]);
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("pw-4f1b8e") && !shown.contains("pw-90ac2d"),
            "{shown}"
        );
        assert!(shown.contains("127.0.0.1:1"), "{shown}");
        // A mistyped key with a secret value, and a bad value of a secret key.
        for (k, v) in [("sasl.pasword", "pw-4f1b8e"), ("linger.ms", "pw-4f1b8e")] {
            let err = KafkaSink::new(config(&[("bootstrap.servers", "127.0.0.1:1"), (k, v)]))
                .unwrap_err();
            let text = format!("{err} {err:?}");
            assert!(text.contains(k), "{text}");
            assert!(!text.contains("pw-4f1b8e"), "{text}");
        }
    }

    #[test]
    fn fixed_and_required_properties_are_enforced() {
        let err = KafkaSink::new(config(&[
            ("bootstrap.servers", "127.0.0.1:1"),
            ("enable.idempotence", "false"),
        ]))
        .unwrap_err();
        assert!(
            err.to_string().contains("enable.idempotence must be true"),
            "{err}"
        );
        let err =
            KafkaSink::new(config(&[("acks", "1"), ("bootstrap.servers", "x:1")])).unwrap_err();
        assert!(err.to_string().contains("acks must be all"), "{err}");
        let err = KafkaSink::new(config(&[])).unwrap_err();
        assert!(
            err.to_string().contains("bootstrap.servers is required"),
            "{err}"
        );
        let err = KafkaSink::new(config(&[
            ("bootstrap.servers", "x:1"),
            ("no.such.property", "1"),
        ]))
        .unwrap_err();
        assert!(err.to_string().contains("no.such.property"), "{err}");
    }
}
