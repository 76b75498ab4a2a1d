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

/// The messages of one subject that a durable consumer has not yet had
/// acknowledged, read for `walbox dlq replay`: the consumer's acknowledgements
/// are the replay's progress, kept by the server.
pub struct DurableLetters {
    consumer: consumer::PullConsumer,
    messages: Vec<jetstream::Message>,
}

impl std::fmt::Debug for DurableLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableLetters")
            .field("messages", &self.messages.len())
            .finish_non_exhaustive()
    }
}

impl DurableLetters {
    /// Reads the messages of `subject` that durable consumer `durable` (created
    /// on first use, explicit acknowledgements) has not had acknowledged, in
    /// stream order. `Ok(None)` when no stream holds the subject: nothing was
    /// ever stored there.
    pub async fn read(
        config: &NatsSinkConfig,
        subject: &str,
        durable: &str,
        timeout: Duration,
    ) -> Result<Option<Self>, SinkError> {
        let fail = |reason: String| SinkError::Read {
            topic: subject.to_owned(),
            reason,
        };
        let js = jetstream::new(config.connect().await?);
        let name = match js.stream_by_subject(subject).await {
            Ok(name) => name,
            Err(e) if e.kind() == jetstream::context::GetStreamByNameErrorKind::NotFound => {
                return Ok(None);
            }
            Err(e) => return Err(fail(format!("looking up its stream: {e}"))),
        };
        let stream = js
            .get_stream(&name)
            .await
            .map_err(|e| fail(format!("stream {name}: {e}")))?;
        let consumer: consumer::PullConsumer = stream
            .get_or_create_consumer(
                durable,
                consumer::pull::Config {
                    durable_name: Some(durable.to_owned()),
                    filter_subject: subject.to_owned(),
                    deliver_policy: consumer::DeliverPolicy::All,
                    ack_policy: consumer::AckPolicy::Explicit,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| fail(format!("consumer {durable} on stream {name}: {e}")))?;
        let mut messages = Vec::new();
        let mut seen = std::collections::HashSet::new();
        loop {
            // Until a fetch comes back empty: what is pending now, and the
            // letters a previous run left unacknowledged.
            let mut batch = consumer
                .fetch()
                .max_messages(500)
                .expires(timeout.min(Duration::from_secs(1)))
                .messages()
                .await
                .map_err(|e| fail(format!("reading stream {name}: {e}")))?;
            let mut fetched = 0;
            while let Some(m) = batch.next().await {
                let m = m.map_err(|e| fail(format!("reading stream {name}: {e}")))?;
                fetched += 1;
                // A letter delivered again (a long read outlasted its ack
                // wait) is kept once.
                let sequence = m.info().map(|i| i.stream_sequence).ok();
                if seen.insert(sequence) {
                    messages.push(m);
                }
            }
            if fetched == 0 {
                break;
            }
        }
        Ok(Some(DurableLetters { consumer, messages }))
    }

    /// Each message read, with its stream sequence.
    pub fn each(&self, mut each: impl FnMut(RecordView<'_>)) {
        for m in &self.messages {
            let sequence = m.info().map(|i| i.stream_sequence).unwrap_or(0);
            each(RecordView::nats(&m.message, sequence));
        }
    }

    /// Records progress: the messages `done` says yes to are acknowledged (and
    /// the server confirms it), the others are handed back, to be read again
    /// by the next run.
    pub async fn settle(self, done: impl Fn(u64) -> bool) -> Result<(), SinkError> {
        let name = self.consumer.cached_info().name.clone();
        for m in &self.messages {
            let sequence = m.info().map(|i| i.stream_sequence).unwrap_or(0);
            let result = if done(sequence) {
                m.double_ack().await
            } else {
                m.double_ack_with(jetstream::AckKind::Nak(None)).await
            };
            result.map_err(|e| SinkError::Read {
                topic: m.subject.to_string(),
                reason: format!("recording progress on consumer {name}: {e}"),
            })?;
        }
        Ok(())
    }
}
