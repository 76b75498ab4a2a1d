//! The Kafka sink: an idempotent rdkafka producer (`acks=all`, murmur2 keys),
//! topics checked or created on first use, delivery failures classified.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use tokio::sync::mpsc;
use walbox_outbox::Event;

use crate::{Deliveries, Delivery, DeliveryClass, DeliveryError, RejectedRecord, Sink, SinkError};

/// Settings of the Kafka sink.
#[derive(Debug, Clone)]
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

/// Forwards librdkafka's delivery reports to the relay.
struct Reports {
    tx: mpsc::UnboundedSender<Delivery>,
}

impl ClientContext for Reports {}

impl ProducerContext for Reports {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, token: usize) {
        let result = match result {
            Ok(_) => Ok(()),
            Err((err, msg)) => {
                // Whatever the record's format.
                let event_id = walbox_outbox::record_event_id(
                    |name| {
                        msg.headers()?
                            .iter()
                            .find(|h| h.key == name)
                            .and_then(|h| std::str::from_utf8(h.value?).ok())
                    },
                    msg.payload(),
                )
                .unwrap_or_default();
                let mut e = DeliveryError {
                    event_id,
                    topic: msg.topic().to_owned(),
                    class: classify(err),
                    reason: err.to_string(),
                    rejected: None,
                };
                if e.is_about_the_message() {
                    e.rejected = Some(RejectedRecord {
                        key: msg.key().map(<[u8]>::to_vec),
                        headers: msg
                            .headers()
                            .map(|hs| {
                                hs.iter()
                                    .map(|h| {
                                        (h.key.to_owned(), h.value.unwrap_or_default().to_vec())
                                    })
                                    .collect()
                            })
                            .unwrap_or_default(),
                        value_len: msg.payload_len(),
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
    admin: AdminClient<DefaultClientContext>,
    config: KafkaSinkConfig,
    known_topics: HashSet<String>,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("known_topics", &self.known_topics)
            .finish_non_exhaustive()
    }
}

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
        let producer: ThreadedProducer<Reports> = cc.create_with_context(Reports { tx })?;
        let admin: AdminClient<DefaultClientContext> = cc.create()?;
        Ok((
            KafkaSink {
                producer: Arc::new(producer),
                admin,
                config,
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
        let exists = tokio::task::spawn_blocking(move || {
            // All topics: asking for one by name could make a broker auto-create it.
            producer
                .client()
                .fetch_metadata(None, Duration::from_secs(30))
                .map(|md| {
                    md.topics()
                        .iter()
                        .any(|t| t.name() == name && t.error().is_none())
                })
        })
        .await
        .map_err(|e| SinkError::Config(format!("metadata task: {e}")))??;
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
                .await?;
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
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        self.ensure_topic(&event.topic).await?;
        let mut headers = OwnedHeaders::new_with_capacity(event.headers.len());
        for (k, v) in &event.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_ref()),
            });
        }
        let mut record = BaseRecord::with_opaque_to(&event.topic, token)
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
                    let mut failure = DeliveryError {
                        event_id: event.event_id.clone(),
                        topic: event.topic.clone(),
                        class: classify(&e),
                        reason: e.to_string(),
                        rejected: None,
                    };
                    if failure.is_about_the_message() {
                        failure.rejected = Some(RejectedRecord {
                            key: event.key.as_ref().map(|k| k.to_vec()),
                            headers: event
                                .headers
                                .iter()
                                .map(|(k, v)| (k.to_string(), v.to_vec()))
                                .collect(),
                            value_len: event.value.len(),
                        });
                    }
                    self.producer
                        .context()
                        .tx
                        .send(Delivery {
                            token: r.delivery_opaque,
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
