//! Reading back what a JetStream stream holds of one subject, for audits
//! (`walbox verify`): an ephemeral pull consumer from the stream's first
//! message of the subject to the last one stored when reading began.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures_util::StreamExt;

use crate::reader::RecordView;
use crate::{NatsSinkConfig, SinkError};

/// Reads every message of `subject` in the configured stream (or the stream
/// that holds the subject), in stream order, calling `each` for each; returns
/// how many were read. Gives up after `timeout` without a message.
pub async fn read_subject(
    config: &NatsSinkConfig,
    subject: &str,
    timeout: Duration,
    mut each: impl FnMut(RecordView<'_>),
) -> Result<u64, SinkError> {
    let fail = |reason: String| SinkError::Read {
        topic: subject.to_owned(),
        reason,
    };
    let client = config.connect().await?;
    let js = jetstream::new(client);
    let name = js
        .stream_by_subject(subject)
        .await
        .map_err(|e| fail(format!("no stream holds it: {e}")))?;
    let stream = js
        .get_stream(&name)
        .await
        .map_err(|e| fail(format!("stream {name}: {e}")))?;
    let mut reader = stream
        .create_consumer(consumer::pull::Config {
            filter_subject: subject.to_owned(),
            deliver_policy: consumer::DeliverPolicy::All,
            ack_policy: consumer::AckPolicy::None,
            inactive_threshold: Duration::from_secs(60),
            ..Default::default()
        })
        .await
        .map_err(|e| fail(format!("creating a reader on stream {name}: {e}")))?;
    let total = reader
        .info()
        .await
        .map_err(|e| fail(format!("reader on stream {name}: {e}")))?
        .num_pending;
    let mut read = 0u64;
    if total > 0 {
        let mut messages = reader
            .messages()
            .await
            .map_err(|e| fail(format!("reading stream {name}: {e}")))?;
        while read < total {
            let next = tokio::time::timeout(timeout, messages.next())
                .await
                .map_err(|_| {
                    fail(format!(
                        "nothing for {} s after {read} of {total} messages",
                        timeout.as_secs()
                    ))
                })?;
            let m = match next {
                Some(Ok(m)) => m,
                Some(Err(e)) => return Err(fail(e.to_string())),
                None => return Err(fail(format!("ended after {read} of {total} messages"))),
            };
            let sequence = m.info().map(|i| i.stream_sequence).unwrap_or(0);
            read += 1;
            each(RecordView::nats(&m.message, sequence));
        }
    }
    let _ = stream.delete_consumer(&reader.cached_info().name).await;
    Ok(read)
}
