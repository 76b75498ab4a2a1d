//! Reading back what a subscription holds: for `walbox verify` (and
//! audits) every message a subscription made before the events were
//! published holds, acknowledged as it is read; for `walbox dlq replay` the
//! letters of a dead-letter topic's subscription, acknowledged only once
//! replayed.
//!
//! A subscription with message ordering hands out a key's next message only
//! once the one before it is acknowledged, so a read that hands messages
//! back would see one per key: reading to audit acknowledges. Pub/Sub keeps
//! no offsets to read from again; what a subscription held is read once
//! (unless it retains acknowledged messages and is sought back, `gcloud
//! pubsub subscriptions seek`).

use std::time::{Duration, Instant};

use super::PubSubSinkConfig;
use super::client::{Client, Received};
use super::message::{EVENT_ID_ATTRIBUTE, KEY_ENCODING_ATTRIBUTE};
use crate::reader::{OwnedRecord, RecordView};
use crate::{SinkError, nats};

/// How long a read waits with nothing coming before it takes the
/// subscription as read to its end.
const IDLE: Duration = Duration::from_secs(2);

/// A pulled message as a record: offset = its place in the read, key = its
/// ordering key (decoded when it came in base64), headers = its attributes,
/// its own id = its `event_id` attribute.
fn record(place: i64, m: &Received) -> OwnedRecord {
    let encoded = m
        .attributes
        .iter()
        .any(|(k, v)| k == KEY_ENCODING_ATTRIBUTE && v == "base64");
    let key = m.ordering_key.as_ref().map(|k| {
        if encoded {
            nats::base64_decode(k).unwrap_or_else(|| k.as_bytes().to_vec())
        } else {
            k.as_bytes().to_vec()
        }
    });
    OwnedRecord {
        partition: 0,
        offset: place,
        key,
        value: m.data.clone(),
        headers: m
            .attributes
            .iter()
            .map(|(k, v)| (k.clone(), v.as_bytes().to_vec()))
            .collect(),
        message_id: m
            .attributes
            .iter()
            .find(|(k, _)| k == EVENT_ID_ATTRIBUTE)
            .map(|(_, v)| v.clone()),
    }
}

fn read_error(subscription: &str, e: impl std::fmt::Display) -> SinkError {
    SinkError::Read {
        topic: format!("subscription {subscription}"),
        reason: e.to_string(),
    }
}

/// Creates `subscription` to `topic` (with message ordering when
/// `ordered`), and the topic if it does not exist: a subscription holds
/// only what is published after it is made. One that exists is kept.
pub async fn create_subscription(
    config: &PubSubSinkConfig,
    subscription: &str,
    topic: &str,
    ordered: bool,
) -> Result<(), SinkError> {
    let client = Client::connect(config).await?;
    client
        .create_topic(topic)
        .await
        .map_err(|e| read_error(subscription, e))?;
    client
        .create_subscription(subscription, topic, ordered, None)
        .await
        .map_err(|e| read_error(subscription, e))
}

/// Reads every message `subscription` holds, in the order Pub/Sub hands
/// them out (per ordering key, the order published), acknowledging each
/// batch once `each` has seen it; returns how many were read. Ends once
/// nothing came for 2 s (at most `timeout` for the first message). A
/// subscription that does not exist is an error.
pub async fn read_subscription(
    config: &PubSubSinkConfig,
    subscription: &str,
    timeout: Duration,
    mut each: impl FnMut(RecordView<'_>),
) -> Result<u64, SinkError> {
    let client = Client::connect(config).await?;
    if !client
        .subscription_exists(subscription)
        .await
        .map_err(|e| read_error(subscription, e))?
    {
        return Err(read_error(subscription, "it does not exist"));
    }
    let mut read = 0u64;
    let mut last = Instant::now();
    let mut idle = timeout;
    loop {
        let got = client
            .pull(subscription, 1000)
            .await
            .map_err(|e| read_error(subscription, e))?;
        if got.is_empty() {
            if last.elapsed() >= idle {
                return Ok(read);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        for m in &got {
            let r = record(i64::try_from(read).unwrap_or(i64::MAX), m);
            each(RecordView::owned(&r));
            read += 1;
        }
        let ids: Vec<String> = got.into_iter().map(|m| m.ack_id).collect();
        client
            .acknowledge(subscription, &ids)
            .await
            .map_err(|e| read_error(subscription, e))?;
        last = Instant::now();
        idle = IDLE;
    }
}

/// An LSN's text (`X/Y`) as a number, for sorting.
fn lsn(text: &str) -> Option<u64> {
    let (hi, lo) = text.split_once('/')?;
    Some(u64::from_str_radix(hi, 16).ok()? << 32 | u64::from_str_radix(lo, 16).ok()?)
}

/// The letters a dead-letter topic's subscription holds, taken
/// unacknowledged (for the subscription's acknowledgement deadline, 10
/// minutes), in commit order (by their source position), until
/// [`SubscriptionLetters::settle`] acknowledges those replayed and hands
/// the others back.
#[derive(Debug)]
pub struct SubscriptionLetters {
    client: Client,
    subscription: String,
    letters: Vec<Received>,
}

impl SubscriptionLetters {
    /// Takes every letter of dead-letter topic `topic`'s subscription;
    /// `None` when it does not exist (nothing was ever dead-lettered there).
    pub async fn read(
        config: &PubSubSinkConfig,
        topic: &str,
        timeout: Duration,
    ) -> Result<Option<SubscriptionLetters>, SinkError> {
        let client = Client::connect(config).await?;
        let subscription = config.letters_subscription_of(topic);
        if !client
            .subscription_exists(&subscription)
            .await
            .map_err(|e| read_error(&subscription, e))?
        {
            return Ok(None);
        }
        let mut letters = Vec::new();
        let deadline = Instant::now() + timeout;
        let mut empty = 0;
        // The subscription has no ordering: every outstanding letter comes.
        // Ends after three empty pulls in a row.
        while empty < 3 && Instant::now() < deadline {
            let got = client
                .pull(&subscription, 1000)
                .await
                .map_err(|e| read_error(&subscription, e))?;
            if got.is_empty() {
                empty += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            } else {
                empty = 0;
                letters.extend(got);
            }
        }
        // Pub/Sub may hand a letter out twice while it is read: once.
        let mut seen = std::collections::HashSet::new();
        letters.retain(|m| seen.insert(m.message_id.clone()));
        let position = |m: &Received| {
            let get = |n: &str| {
                m.attributes
                    .iter()
                    .find(|(k, _)| k == n)
                    .map(|(_, v)| v.clone())
            };
            (
                get(walbox_outbox::header::COMMIT_LSN).and_then(|l| lsn(&l)),
                get(walbox_outbox::header::INDEX).and_then(|i| i.parse::<u64>().ok()),
            )
        };
        letters.sort_by_key(position);
        Ok(Some(SubscriptionLetters {
            client,
            subscription,
            letters,
        }))
    }

    /// Calls `each` for every letter, in commit order (offset = its place).
    pub fn each(&self, mut each: impl FnMut(RecordView<'_>)) {
        for (i, m) in self.letters.iter().enumerate() {
            let r = record(i64::try_from(i).unwrap_or(i64::MAX), m);
            each(RecordView::owned(&r));
        }
    }

    /// Acknowledges the letters `done` says were replayed (by offset) and
    /// hands the others back to the subscription.
    pub async fn settle(self, done: impl Fn(i64) -> bool) -> Result<(), SinkError> {
        let (mut ack, mut back) = (Vec::new(), Vec::new());
        for (i, m) in self.letters.into_iter().enumerate() {
            if done(i64::try_from(i).unwrap_or(i64::MAX)) {
                ack.push(m.ack_id);
            } else {
                back.push(m.ack_id);
            }
        }
        let s = &self.subscription;
        self.client
            .acknowledge(s, &ack)
            .await
            .map_err(|e| read_error(s, e))?;
        self.client
            .hand_back(s, &back)
            .await
            .map_err(|e| read_error(s, e))
    }
}
