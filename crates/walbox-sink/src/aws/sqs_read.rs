//! Reading SQS messages back as records: a queue belongs to its consumers,
//! so reading takes messages from them.
//!
//! - [`drain_sqs_queue`]: receives every message a queue holds and deletes
//!   each once handed over (a consumer's reading, for the tests and the
//!   demo).
//! - [`SqsLetters`]: `walbox dlq replay`'s reading of a dead-letter queue,
//!   in rounds: the letters received are replayed, those done deleted, the
//!   others made visible again. A FIFO queue hands out a group's next
//!   message only once the one before it is deleted, so rounds go on until
//!   a receive comes back empty or a letter still fails.
//!
//! A record's key is the message's group id (the event's key, or its
//! SHA-256 when SQS could not take the key); its headers are the message
//! attributes, those in `walbox_headers` put back in their own names.

use std::time::Duration;

use aws_sdk_sqs::types::{Message, MessageSystemAttributeName};
use base64::Engine as _;

use super::attributes::{EVENT_ID, MORE_HEADERS};
use super::setup_error;
use super::sqs::SqsSinkConfig;
use crate::{OwnedRecord, RecordView, SinkError};

/// A received message as a record at place `offset`.
fn record(m: &Message, offset: i64) -> OwnedRecord {
    let mut headers: Vec<(String, Vec<u8>)> = Vec::new();
    let mut event_id = None;
    let mut names: Vec<&String> = m
        .message_attributes()
        .map(|a| a.keys().collect())
        .unwrap_or_default();
    // Attributes come as a map: in name order, which is stable.
    names.sort();
    for name in names {
        let Some(v) = m.message_attributes().and_then(|a| a.get(name)) else {
            continue;
        };
        let bytes = match (v.string_value(), v.binary_value()) {
            (Some(s), _) => s.as_bytes().to_vec(),
            (None, Some(b)) => b.as_ref().to_vec(),
            (None, None) => continue,
        };
        if name == EVENT_ID {
            event_id = String::from_utf8(bytes.clone()).ok();
        }
        if name == MORE_HEADERS {
            let Ok(serde_json::Value::Object(more)) = serde_json::from_slice(&bytes) else {
                continue;
            };
            for (k, v) in more {
                let values = match v {
                    serde_json::Value::Array(all) => all,
                    one => vec![one],
                };
                for v in values {
                    let bytes = match &v {
                        serde_json::Value::String(s) => s.as_bytes().to_vec(),
                        other => other["base64"]
                            .as_str()
                            .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
                            .unwrap_or_default(),
                    };
                    headers.push((k.clone(), bytes));
                }
            }
            continue;
        }
        headers.push((name.clone(), bytes));
    }
    let group = m
        .attributes()
        .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
        .map(|g| g.as_bytes().to_vec());
    OwnedRecord {
        partition: 0,
        offset,
        key: group,
        value: m.body().unwrap_or_default().as_bytes().to_vec(),
        headers,
        message_id: event_id,
    }
}

async fn client_and_url(
    config: &SqsSinkConfig,
    topic: &str,
) -> Result<Option<(aws_sdk_sqs::Client, String)>, SinkError> {
    let sdk = config.connection().sdk_config("sink.sqs").await?;
    let client = aws_sdk_sqs::Client::new(&sdk);
    let name = config.queue_name(topic);
    match client.get_queue_url().queue_name(&name).send().await {
        Ok(out) => Ok(out.queue_url().map(|u| (client, u.to_owned()))),
        Err(e) if e.as_service_error().is_some_and(super::no_such_queue) => Ok(None),
        Err(e) => Err(setup_error(&e, "sqs", &format!("finding queue {name:?}"))),
    }
}

/// One receive of up to 10 messages, holding them for `hold` seconds.
async fn receive(
    client: &aws_sdk_sqs::Client,
    url: &str,
    hold: i32,
) -> Result<Vec<Message>, SinkError> {
    client
        .receive_message()
        .queue_url(url)
        .max_number_of_messages(10)
        .wait_time_seconds(1)
        .visibility_timeout(hold)
        .message_attribute_names("All")
        .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
        .send()
        .await
        .map(|out| out.messages().to_vec())
        .map_err(|e| setup_error(&e, "sqs", &format!("receiving from {url}")))
}

/// Receives every message of the queue `topic` names, calling `each` for
/// it and then deleting it, until two receives in a row come back empty;
/// returns how many. `Ok(None)` when the queue does not exist.
pub async fn drain_sqs_queue(
    config: &SqsSinkConfig,
    topic: &str,
    timeout: Duration,
    mut each: impl FnMut(RecordView<'_>),
) -> Result<Option<u64>, SinkError> {
    let Some((client, url)) = client_and_url(config, topic).await? else {
        return Ok(None);
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let mut count = 0u64;
    let mut empty = 0;
    while empty < 2 {
        if tokio::time::Instant::now() > deadline {
            return Err(SinkError::Read {
                topic: topic.to_owned(),
                reason: format!("the queue was not drained within {timeout:?}"),
            });
        }
        let messages = receive(&client, &url, 60).await?;
        if messages.is_empty() {
            empty += 1;
            continue;
        }
        empty = 0;
        let mut done = Vec::new();
        for m in &messages {
            each(RecordView::owned(&record(
                m,
                i64::try_from(count).unwrap_or(i64::MAX),
            )));
            count += 1;
            if let Some(handle) = m.receipt_handle() {
                done.push(
                    aws_sdk_sqs::types::DeleteMessageBatchRequestEntry::builder()
                        .id(done.len().to_string())
                        .receipt_handle(handle)
                        .build()
                        .expect("id and handle are set"),
                );
            }
        }
        // Deleted once handed over, ten to a call.
        let out = client
            .delete_message_batch()
            .queue_url(&url)
            .set_entries(Some(done))
            .send()
            .await
            .map_err(|e| setup_error(&e, "sqs", &format!("deleting from {url}")))?;
        if let Some(failed) = out.failed().first() {
            return Err(SinkError::Read {
                topic: topic.to_owned(),
                reason: format!("deleting a message: {}", failed.code()),
            });
        }
    }
    Ok(Some(count))
}

/// A dead-letter queue being replayed, round by round.
pub struct SqsLetters {
    client: aws_sdk_sqs::Client,
    url: String,
    /// This round's messages.
    round: Vec<Message>,
    /// Letters handed over in earlier rounds (the offsets go on).
    before: i64,
}

impl std::fmt::Debug for SqsLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsLetters")
            .field("url", &self.url)
            .field("round", &self.round.len())
            .finish_non_exhaustive()
    }
}

/// How long a round holds its letters from other readers: well inside the
/// deduplication window, so that a run again after a kill (which sees the
/// letters once the hold ends) republishes them while SQS still drops the
/// copies.
const HOLD_S: i32 = 60;

impl SqsLetters {
    /// Opens the dead-letter queue `topic` names; `None` when it does not
    /// exist (nothing was dead-lettered there).
    pub async fn open(config: &SqsSinkConfig, topic: &str) -> Result<Option<Self>, SinkError> {
        Ok(client_and_url(config, topic)
            .await?
            .map(|(client, url)| SqsLetters {
                client,
                url,
                round: Vec::new(),
                before: 0,
            }))
    }

    /// Opens the queue named `queue` (a queue subscribed to SNS
    /// dead-letter topics) with `connection`; `None` when it does not exist.
    pub async fn open_queue(
        connection: &super::AwsConnection,
        queue: &str,
    ) -> Result<Option<Self>, SinkError> {
        let sdk = connection.sdk_config("sink.sns").await?;
        let client = aws_sdk_sqs::Client::new(&sdk);
        match client.get_queue_url().queue_name(queue).send().await {
            Ok(out) => Ok(out.queue_url().map(|url| SqsLetters {
                client,
                url: url.to_owned(),
                round: Vec::new(),
                before: 0,
            })),
            Err(e) if e.as_service_error().is_some_and(super::no_such_queue) => Ok(None),
            Err(e) => Err(setup_error(&e, "sqs", &format!("finding queue {queue:?}"))),
        }
    }

    /// Receives the next round: the letters the queue hands out now, held
    /// from other readers, up to [`ROUND_LETTERS`] or for a third of the
    /// hold (the rest of the hold is the round's to replay and settle in).
    /// Empty when none is left.
    pub async fn next_round(&mut self) -> Result<usize, SinkError> {
        self.before += i64::try_from(self.round.len()).unwrap_or(i64::MAX);
        self.round.clear();
        let started = std::time::Instant::now();
        while !round_full(self.round.len(), started.elapsed()) {
            let got = receive(&self.client, &self.url, HOLD_S).await?;
            if got.is_empty() {
                break;
            }
            self.round.extend(got);
        }
        Ok(self.round.len())
    }

    /// Calls `each` for every letter of this round (partition 0, a place
    /// unique across rounds as offset).
    pub fn each(&self, mut each: impl FnMut(RecordView<'_>)) {
        for (i, m) in self.round.iter().enumerate() {
            let offset = self.before + i64::try_from(i).unwrap_or(i64::MAX);
            each(RecordView::owned(&record(m, offset)));
        }
    }

    /// Deletes this round's letters `done` takes (by offset) and makes the
    /// others visible again at once.
    pub async fn settle(&self, done: impl Fn(i64) -> bool) -> Result<(), SinkError> {
        for (i, m) in self.round.iter().enumerate() {
            let Some(handle) = m.receipt_handle() else {
                continue;
            };
            let offset = self.before + i64::try_from(i).unwrap_or(i64::MAX);
            let result = if done(offset) {
                self.client
                    .delete_message()
                    .queue_url(&self.url)
                    .receipt_handle(handle)
                    .send()
                    .await
                    .map(|_| ())
                    .map_err(|e| setup_error(&e, "sqs", "deleting a replayed letter"))
            } else {
                self.client
                    .change_message_visibility()
                    .queue_url(&self.url)
                    .receipt_handle(handle)
                    .visibility_timeout(0)
                    .send()
                    .await
                    .map(|_| ())
                    .map_err(|e| setup_error(&e, "sqs", "handing a letter back"))
            };
            result?;
        }
        Ok(())
    }
}

/// The most letters of one round.
const ROUND_LETTERS: usize = 1_000;

/// Whether a round of `letters` received over `receiving` takes no more: a
/// round's letters are held [`HOLD_S`] from the moment each was received,
/// and must be replayed and settled within it.
fn round_full(letters: usize, receiving: std::time::Duration) -> bool {
    let hold = std::time::Duration::from_secs(u64::try_from(HOLD_S).unwrap_or(60));
    letters >= ROUND_LETTERS || receiving >= hold / 3
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_round_is_bounded_by_letters_and_by_a_third_of_the_hold() {
        use std::time::Duration;
        assert!(!super::round_full(0, Duration::ZERO));
        assert!(!super::round_full(999, Duration::from_secs(19)));
        assert!(super::round_full(1_000, Duration::ZERO));
        assert!(super::round_full(1, Duration::from_secs(20)));
    }

    #[test]
    fn a_rerun_after_a_kill_sees_the_letters_inside_the_window() {
        let hold = std::time::Duration::from_secs(u64::try_from(super::HOLD_S).unwrap());
        assert!(hold * 2 <= super::super::sqs::DEDUP_WINDOW);
    }
}
