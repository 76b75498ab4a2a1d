//! Reading back what a queue holds, for audits (`walbox verify` in exchange
//! mode): every message of the queue the user bound to walbox's exchange,
//! taken with `basic.get` unacknowledged and handed back (requeued, in their
//! order) when the channel closes, so that reading changes nothing.

use std::time::Duration;

use lapin::options::BasicGetOptions;
use lapin::types::{AMQPValue, ShortString};

use super::RabbitMqSinkConfig;
use super::exchange::connect;
use crate::reader::{OwnedRecord, RecordView};
use crate::{KEY_HEADER, SinkError};

/// The headers of a message as bytes (long strings as they are, other values
/// as their text).
fn headers_of(props: &lapin::BasicProperties) -> Vec<(String, Vec<u8>)> {
    let Some(table) = props.headers() else {
        return Vec::new();
    };
    table
        .inner()
        .iter()
        .map(|(k, v)| {
            let bytes = match v {
                AMQPValue::LongString(s) => s.as_bytes().to_vec(),
                AMQPValue::ShortString(s) => s.as_str().as_bytes().to_vec(),
                AMQPValue::ByteArray(b) => b.as_slice().to_vec(),
                other => format!("{other:?}").into_bytes(),
            };
            (k.to_string(), bytes)
        })
        .collect()
}

/// Reads every message `queue` holds that was published with `routing_key`
/// (every message when `None`), in queue order, calling `each` for each
/// (offset = its place in the queue, from 0); returns how many were handed
/// over. The messages stay in the queue.
pub async fn read_queue(
    config: &RabbitMqSinkConfig,
    queue: &str,
    routing_key: Option<&str>,
    timeout: Duration,
    mut each: impl FnMut(RecordView<'_>),
) -> Result<u64, SinkError> {
    let fail = |reason: String| SinkError::Read {
        topic: queue.to_owned(),
        reason,
    };
    let (connection, channel) = connect(config).await?;
    let mut read = 0u64;
    let mut place = 0i64;
    loop {
        let got = tokio::time::timeout(
            timeout,
            channel.basic_get(ShortString::from(queue), BasicGetOptions { no_ack: false }),
        )
        .await
        .map_err(|_| fail(format!("no answer within {} s", timeout.as_secs())))?
        .map_err(|e| fail(e.to_string()))?;
        let Some(message) = got else { break };
        place += 1;
        if routing_key.is_some_and(|k| k != message.delivery.routing_key.as_str()) {
            continue;
        }
        let headers = headers_of(&message.delivery.properties);
        let key = headers
            .iter()
            .find(|(k, _)| k == KEY_HEADER)
            .map(|(_, v)| v.clone());
        let record = OwnedRecord {
            partition: 0,
            offset: place - 1,
            key,
            value: message.delivery.data.clone(),
            headers,
            message_id: queue_message_id(&message.delivery.properties),
        };
        each(RecordView::owned(&record));
        read += 1;
    }
    // Unacknowledged, every message goes back to the queue.
    let _ = channel.close(200, ShortString::from("walbox: read")).await;
    let _ = connection
        .close(200, ShortString::from("walbox: read"))
        .await;
    Ok(read)
}

/// Reads every message of `stream` from its first, in stream order, calling
/// `each` for each (offset = its stream offset; headers = its application
/// properties as text); returns how many were read. Ends once nothing came
/// for `idle` (at most `timeout` for the first message).
pub async fn read_stream(
    config: &RabbitMqSinkConfig,
    stream: &str,
    timeout: Duration,
    mut each: impl FnMut(RecordView<'_>),
) -> Result<u64, SinkError> {
    use futures_util::StreamExt;
    use rabbitmq_stream_client::types::OffsetSpecification;
    let fail = |reason: String| SinkError::Read {
        topic: stream.to_owned(),
        reason,
    };
    let (environment, client) = super::stream::connect(config).await?;
    let mut consumer = environment
        .consumer()
        .offset(OffsetSpecification::First)
        .build(stream)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let mut read = 0u64;
    let mut wait = timeout;
    while let Ok(Some(delivery)) = tokio::time::timeout(wait, consumer.next()).await {
        let delivery = delivery.map_err(|e| fail(e.to_string()))?;
        wait = Duration::from_secs(2);
        let m = delivery.message();
        let headers: Vec<(String, Vec<u8>)> = m
            .application_properties()
            .map(|p| {
                p.keys()
                    .filter_map(|k| {
                        super::stream::property(m, k).map(|v| (k.clone(), v.into_bytes()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let key = headers
            .iter()
            .find(|(k, _)| k == KEY_HEADER)
            .map(|(_, v)| v.clone());
        let record = OwnedRecord {
            partition: 0,
            offset: i64::try_from(delivery.offset()).unwrap_or(i64::MAX),
            key,
            value: m.data().map(<[u8]>::to_vec).unwrap_or_default(),
            message_id: super::stream::stored_event_id(m),
            headers,
        };
        each(RecordView::owned(&record));
        read += 1;
    }
    let _ = consumer.handle().close().await;
    let _ = client.close().await;
    Ok(read)
}

/// The messages of a dead-letter queue, read for `walbox dlq replay` in
/// exchange mode: taken unacknowledged, then each acknowledged (done, gone
/// from the queue) or handed back (still failing, or not a letter this replay
/// handles) by [`QueueLetters::settle`]. A run killed before settling hands
/// every message back when its connection ends.
pub struct QueueLetters {
    connection: lapin::Connection,
    channel: lapin::Channel,
    /// Each message with its routing key and delivery tag.
    records: Vec<(String, u64, OwnedRecord)>,
}

impl std::fmt::Debug for QueueLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueLetters")
            .field("messages", &self.records.len())
            .finish_non_exhaustive()
    }
}

impl QueueLetters {
    /// Takes every message `queue` holds (offset = its place, from 0).
    pub async fn read(
        config: &RabbitMqSinkConfig,
        queue: &str,
        timeout: Duration,
    ) -> Result<Self, SinkError> {
        let fail = |reason: String| SinkError::Read {
            topic: queue.to_owned(),
            reason,
        };
        let (connection, channel) = connect(config).await?;
        let mut records = Vec::new();
        loop {
            let got = tokio::time::timeout(
                timeout,
                channel.basic_get(ShortString::from(queue), BasicGetOptions { no_ack: false }),
            )
            .await
            .map_err(|_| fail(format!("no answer within {} s", timeout.as_secs())))?
            .map_err(|e| fail(e.to_string()))?;
            let Some(message) = got else { break };
            let headers = headers_of(&message.delivery.properties);
            let key = headers
                .iter()
                .find(|(k, _)| k == KEY_HEADER)
                .map(|(_, v)| v.clone());
            records.push((
                message.delivery.routing_key.to_string(),
                message.delivery.delivery_tag,
                OwnedRecord {
                    partition: 0,
                    offset: i64::try_from(records.len()).unwrap_or(i64::MAX),
                    key,
                    value: message.delivery.data.clone(),
                    message_id: queue_message_id(&message.delivery.properties),
                    headers,
                },
            ));
        }
        Ok(QueueLetters {
            connection,
            channel,
            records,
        })
    }

    /// Hands each message published with `routing_key` to `each`, in queue
    /// order.
    pub fn each(&self, routing_key: &str, mut each: impl FnMut(RecordView<'_>)) {
        for (key, _, record) in &self.records {
            if key == routing_key {
                each(RecordView::owned(record));
            }
        }
    }

    /// Acknowledges the messages whose offset `done` accepts and hands every
    /// other one back to the queue, then closes the connection.
    pub async fn settle(self, done: impl Fn(i64) -> bool) -> Result<(), SinkError> {
        use lapin::options::{BasicAckOptions, BasicNackOptions};
        for (_, tag, record) in &self.records {
            let r = if done(record.offset) {
                self.channel
                    .basic_ack(*tag, BasicAckOptions { multiple: false })
                    .await
            } else {
                self.channel
                    .basic_nack(
                        *tag,
                        BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        },
                    )
                    .await
            };
            r.map_err(|e| SinkError::RabbitMq(format!("settling a dead letter: {e}")))?;
        }
        let _ = self
            .channel
            .close(200, ShortString::from("walbox: done"))
            .await;
        let _ = self
            .connection
            .close(200, ShortString::from("walbox: done"))
            .await;
        Ok(())
    }
}

/// The letters of a dead-letter stream that `walbox dlq replay` has not yet
/// done (stream mode): read from the offset after the one stored under the
/// replay's consumer name (from the first when none is stored), and the
/// progress stored back by [`StreamLetters::settle`]: the offset of the last
/// letter of the done prefix (a letter that still fails stops it there).
pub struct StreamLetters {
    client: rabbitmq_stream_client::Client,
    stream: String,
    reference: String,
    records: Vec<OwnedRecord>,
}

impl std::fmt::Debug for StreamLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamLetters")
            .field("stream", &self.stream)
            .field("letters", &self.records.len())
            .finish_non_exhaustive()
    }
}

impl StreamLetters {
    /// Reads the letters of `stream` after those `reference` recorded as
    /// done; `Ok(None)` when the stream does not exist (nothing was ever
    /// dead-lettered there).
    pub async fn read(
        config: &RabbitMqSinkConfig,
        stream: &str,
        reference: &str,
        timeout: Duration,
    ) -> Result<Option<Self>, SinkError> {
        use futures_util::StreamExt;
        use rabbitmq_stream_client::error::ConsumerCreateError;
        use rabbitmq_stream_client::types::OffsetSpecification;
        let fail = |reason: String| SinkError::Read {
            topic: stream.to_owned(),
            reason,
        };
        let (environment, client) = super::stream::connect(config).await?;
        let from = match client.query_offset(reference.to_owned(), stream).await {
            Ok(done) => OffsetSpecification::Offset(done + 1),
            Err(_) => OffsetSpecification::First,
        };
        let mut consumer = match environment.consumer().offset(from).build(stream).await {
            Ok(c) => c,
            Err(ConsumerCreateError::StreamDoesNotExist { .. }) => return Ok(None),
            Err(e) => return Err(fail(e.to_string())),
        };
        let mut records = Vec::new();
        let mut wait = timeout.min(Duration::from_secs(2));
        while let Ok(Some(delivery)) = tokio::time::timeout(wait, consumer.next()).await {
            let delivery = delivery.map_err(|e| fail(e.to_string()))?;
            wait = Duration::from_secs(2);
            let m = delivery.message();
            let headers: Vec<(String, Vec<u8>)> = m
                .application_properties()
                .map(|p| {
                    p.keys()
                        .filter_map(|k| {
                            super::stream::property(m, k).map(|v| (k.clone(), v.into_bytes()))
                        })
                        .collect()
                })
                .unwrap_or_default();
            let key = headers
                .iter()
                .find(|(k, _)| k == KEY_HEADER)
                .map(|(_, v)| v.clone());
            records.push(OwnedRecord {
                partition: 0,
                offset: i64::try_from(delivery.offset()).unwrap_or(i64::MAX),
                key,
                value: m.data().map(<[u8]>::to_vec).unwrap_or_default(),
                message_id: super::stream::stored_event_id(m),
                headers,
            });
        }
        let _ = consumer.handle().close().await;
        Ok(Some(StreamLetters {
            client,
            stream: stream.to_owned(),
            reference: reference.to_owned(),
            records,
        }))
    }

    /// Hands each letter to `each`, in stream order.
    pub fn each(&self, mut each: impl FnMut(RecordView<'_>)) {
        for r in &self.records {
            each(RecordView::owned(r));
        }
    }

    /// Records as done the letters up to the first that `done` refuses.
    pub async fn settle(self, done: impl Fn(i64) -> bool) -> Result<(), SinkError> {
        let last = self
            .records
            .iter()
            .take_while(|r| done(r.offset))
            .last()
            .map(|r| r.offset);
        if let Some(offset) = last.and_then(|o| u64::try_from(o).ok()) {
            self.client
                .store_offset(&self.reference, &self.stream, offset)
                .await
                .map_err(|e| {
                    SinkError::RabbitMq(format!(
                        "recording dead-letter progress on stream {}: {e}",
                        self.stream
                    ))
                })?;
        }
        let _ = self.client.close().await;
        Ok(())
    }
}

/// The `message_id` property of a message read from a queue: the event id
/// walbox wrote there, whatever the record's format.
fn queue_message_id(properties: &lapin::BasicProperties) -> Option<String> {
    properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str().to_owned())
}
