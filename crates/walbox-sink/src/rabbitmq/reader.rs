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
            offset: place - 1,
            key,
            value: message.delivery.data.clone(),
            headers,
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
            offset: i64::try_from(delivery.offset()).unwrap_or(i64::MAX),
            key,
            value: m.data().map(<[u8]>::to_vec).unwrap_or_default(),
            headers,
        };
        each(RecordView::owned(&record));
        read += 1;
    }
    let _ = consumer.handle().close().await;
    let _ = client.close().await;
    Ok(read)
}
