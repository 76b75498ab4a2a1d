//! The Google Cloud Pub/Sub sink: each event is a message of the topic its
//! template names, with its aggregate key as the ordering key, its headers
//! as attributes (`event_id` always one of them), and counts as delivered
//! once Pub/Sub answered the Publish request with a message id for it.
//!
//! Per-key order: a Publish request is all or nothing, so events go into
//! lanes by topic and ordering key (all events without a key share one lane
//! per topic). A lane has at most one request in flight, holding its key's
//! events queued since, in commit order (up to `max_batch_messages` and
//! `max_batch_bytes`); lanes run at once, up to `max_requests` requests.
//! When a request fails, its lane pauses: nothing later of the key is sent
//! while the failed request is tried again with backoff, as Google's
//! client libraries pause a key until it is resumed. Once it is stored the
//! key goes on; if it cannot be within `max_retry_duration_s`, or the
//! failure is not one a retry can mend, its events fail, nothing more of
//! the session starts, and the relay sends again from its confirmed
//! position. Acknowledgements so come out of send order, which the relay's
//! tracker takes (it moves the position over the acknowledged prefix only).
//!
//! A request Pub/Sub refuses as invalid (400) is sent again one message at
//! a time, in order, so that only the message at fault is refused (it goes
//! to a dead letter) and the rest of its key go on behind it. What Pub/Sub
//! cannot carry (see [`message`]) is refused before anything is sent.
//!
//! Publishing is at least once: a request whose answer was lost is sent
//! again, and a new session sends again what was not acknowledged, each
//! copy with the same `event_id` attribute. Pub/Sub has no idempotent
//! publish; exactly-once delivery is a subscription's setting, about
//! acknowledgements on the consumer's side (see `docs/guarantees.md`).
//!
//! Topics are checked (or created with `create_topics`) when a session
//! first sends to them. A dead-letter topic comes with a subscription that
//! keeps its letters for `walbox dlq replay` ([`SubscriptionLetters`]).

mod client;
mod config;
mod message;
mod reader;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{Mutex, Semaphore, mpsc};
use tokio::task::JoinSet;
use walbox_outbox::Event;

pub use config::{EMULATOR_HOST_ENV, PubSubSinkConfig};
pub use message::DROPPED_HEADERS_ATTRIBUTE;
pub use reader::{SubscriptionLetters, create_subscription, read_subscription};

use client::{ApiError, Client};
use message::{Prepared, prepare, publish_body, sanitized_topic, valid_topic};

use crate::kit::count_retry;
use crate::kit::{Close, Lifecycle, Reports, SessionTask, failure, is_dead_letter};
use crate::webhook::backoff;
use crate::{Deliveries, DeliveryClass, DeliveryError, Sink, SinkError};

/// What the session's publishing shares.
#[derive(Debug)]
struct Shared {
    client: Client,
    config: PubSubSinkConfig,
    /// Requests open at once.
    requests: Semaphore,
    retries: Arc<AtomicU64>,
    /// Topics checked or created in this session.
    topics: Mutex<HashSet<String>>,
}

impl Shared {
    /// Makes sure `topic` exists (creating it with `create_topics`), and,
    /// for a dead-letter topic, the subscription that keeps its letters.
    /// `again`: check even if this session did already (it was not found).
    async fn ensure(&self, topic: &str, letters: bool, again: bool) -> Result<(), Missing> {
        if !again && self.topics.lock().await.contains(topic) {
            return Ok(());
        }
        match self.check(topic, letters).await {
            // A publisher's role (roles/pubsub.publisher) may publish
            // without the right to look at or create topics and
            // subscriptions: walbox goes on, and a publish to a topic that
            // is not there says so (404).
            Err(Missing::Api(e)) if e.http() == Some(403) => {
                tracing::warn!(
                    topic,
                    error = %e,
                    "may not check or create the topic{}; publishing to it as it is",
                    if letters {
                        " and the subscription that keeps its letters (make sure it exists)"
                    } else {
                        ""
                    }
                );
            }
            other => other?,
        }
        self.topics.lock().await.insert(topic.to_owned());
        Ok(())
    }

    async fn check(&self, topic: &str, letters: bool) -> Result<(), Missing> {
        let c = &self.client;
        if self.config.create_topics {
            c.create_topic(topic).await?;
        } else if !c.topic_exists(topic).await? {
            return Err(Missing::Topic(topic.to_owned()));
        }
        if letters {
            let sub = self.config.letters_subscription_of(topic);
            if self.config.create_topics {
                c.create_subscription(&sub, topic, false, Some(self.config.letters_retention_days))
                    .await?;
            } else if !c.subscription_exists(&sub).await? {
                return Err(Missing::Subscription {
                    topic: topic.to_owned(),
                    subscription: sub,
                });
            }
        }
        Ok(())
    }
}

/// Why a topic could not be made sure of.
#[derive(Debug)]
enum Missing {
    Topic(String),
    Subscription { topic: String, subscription: String },
    Api(ApiError),
}

impl From<ApiError> for Missing {
    fn from(e: ApiError) -> Self {
        Missing::Api(e)
    }
}

impl Missing {
    fn into_sink_error(self, project: &str) -> SinkError {
        match self {
            Missing::Topic(t) => SinkError::MissingTopic(format!("projects/{project}/topics/{t}")),
            Missing::Subscription {
                topic,
                subscription,
            } => SinkError::PubSubMissingSubscription {
                topic,
                subscription,
            },
            Missing::Api(e) if e.http() == Some(401) => {
                SinkError::PubSubAuthentication(e.to_string())
            }
            Missing::Api(e) if e.transient() => SinkError::PubSub(e.to_string()),
            Missing::Api(e) => SinkError::PubSubRefused(e.to_string()),
        }
    }
}

/// The session: the dispatcher task. Ending it drops the requests in
/// flight with their connections.
struct Dispatcher {
    shared: Arc<Shared>,
    _task: SessionTask,
}

impl Close for Dispatcher {}

/// Publishes events to Google Cloud Pub/Sub.
pub struct PubSubSink {
    config: PubSubSinkConfig,
    events: mpsc::UnboundedSender<(Event, usize)>,
    waiting: Option<mpsc::UnboundedReceiver<(Event, usize)>>,
    session: Lifecycle<Dispatcher>,
    reports: Reports,
    retries: Arc<AtomicU64>,
}

impl std::fmt::Debug for PubSubSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PubSubSink")
            .field("project", &self.config.project)
            .field("in_flight", &self.reports.in_flight())
            .finish_non_exhaustive()
    }
}

impl PubSubSink {
    /// A sink with these settings. Returns the sink and the receiver of its
    /// deliveries. Nothing is reached before the first event.
    pub fn new(config: PubSubSinkConfig) -> Result<(Self, Deliveries), SinkError> {
        config.validate()?;
        let (reports, rx) = Reports::new();
        let (events, queue) = mpsc::unbounded_channel();
        Ok((
            PubSubSink {
                config,
                events,
                waiting: Some(queue),
                session: Lifecycle::default(),
                reports,
                retries: Arc::new(AtomicU64::new(0)),
            },
            rx,
        ))
    }

    /// Publish requests that failed and were sent again, so far.
    #[must_use]
    pub fn retries(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.retries)
    }
}

/// What `walbox doctor` says of the sink's connection: where it publishes
/// and with which credentials (looked up now), and whether per-key order can
/// move between regions (the global endpoint). `Err` when no credentials
/// are found.
pub async fn describe(config: &PubSubSinkConfig) -> Result<(String, Option<String>), SinkError> {
    Client::connect(config).await?;
    let (base, emulator) = config.base();
    if emulator {
        return Ok((format!("Pub/Sub emulator at {base}, no credentials"), None));
    }
    let global = config.endpoint.is_none()
        || config
            .endpoint
            .as_deref()
            .is_some_and(|e| e.trim_end_matches('/') == config::DEFAULT_ENDPOINT);
    Ok((
        format!("Pub/Sub at {base}, credentials from Application Default Credentials"),
        global.then(|| {
            "sink.pubsub.endpoint is Pub/Sub's global endpoint: Pub/Sub keeps an ordering key's \
             order per region, and the global endpoint may route a restarted walbox to another \
             one; a regional endpoint (https://REGION-pubsub.googleapis.com) keeps it in one"
                .to_owned()
        }),
    ))
}

/// The topic an event is published to: its own, or for a dead letter whose
/// own is no Pub/Sub name, one made valid.
fn topic_of(event: &Event, letter: bool) -> String {
    if letter && !valid_topic(&event.topic) {
        sanitized_topic(&event.topic)
    } else {
        event.topic.clone()
    }
}

impl Sink for PubSubSink {
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        if self.session.aborted() {
            return Ok(());
        }
        self.reports.check()?;
        if let Some(queue) = self.waiting.take() {
            let config = self.config.clone();
            let retries = Arc::clone(&self.retries);
            let reports = self.reports.clone();
            let opened = self
                .session
                .open_with(|| async move {
                    let shared = Arc::new(Shared {
                        client: Client::connect(&config).await?,
                        requests: Semaphore::new(config.max_requests),
                        config,
                        retries,
                        topics: Mutex::new(HashSet::new()),
                    });
                    let task = reports.spawn(
                        "pubsub dispatcher",
                        dispatch(Arc::clone(&shared), queue, reports.clone()),
                    );
                    Ok(Dispatcher {
                        shared,
                        _task: task,
                    })
                })
                .await;
            if let Err(e) = opened {
                // Nothing was taken from the queue: the next send tries again.
                let (tx, rx) = mpsc::unbounded_channel();
                self.events = tx;
                self.waiting = Some(rx);
                return Err(e);
            }
        }
        let shared = Arc::clone(&self.session.get().expect("opened above").shared);
        let letter = is_dead_letter(&event);
        let topic = topic_of(&event, letter);
        if letter || valid_topic(&topic) {
            shared
                .ensure(&topic, letter, false)
                .await
                .map_err(|m| m.into_sink_error(&self.config.project))?;
        }
        self.reports.sent();
        self.events.send((event, token)).map_err(|_| {
            self.reports.withdrawn();
            SinkError::TaskDied("the pubsub dispatcher stopped".into())
        })
    }

    fn abort(&mut self) {
        self.session.abort();
    }

    async fn flush(&mut self, timeout: Duration) -> Result<(), SinkError> {
        self.session.flush(&self.reports, timeout).await
    }
}

/// Where an event waits for the ones before it: its topic and ordering key.
type Lane = (String, Option<Bytes>);

/// An event waiting in its lane, ready to send.
struct Queued {
    event: Event,
    token: usize,
    prepared: Prepared,
}

/// The outcomes of one lane's request, in the lane's order.
struct Done {
    lane: Lane,
    outcomes: Vec<(usize, Result<(), DeliveryError>)>,
}

/// What the dispatcher knows of a running request, to report its events
/// should its task end without outcomes (a panic).
type Started = HashMap<tokio::task::Id, (Lane, Vec<(usize, String, String)>)>;

/// Runs the lanes: starts a request when its lane is free, reports each
/// outcome and starts the lane's next request with what queued meanwhile.
async fn dispatch(
    shared: Arc<Shared>,
    mut events: mpsc::UnboundedReceiver<(Event, usize)>,
    reports: Reports,
) {
    let mut waiting: HashMap<Lane, VecDeque<Queued>> = HashMap::new();
    let mut running: JoinSet<Done> = JoinSet::new();
    let mut started = Started::new();
    let mut open = true;
    // A failure that ends the session: nothing more starts.
    let mut stopped = false;
    while open || !running.is_empty() {
        tokio::select! {
            next = events.recv(), if open => {
                let Some((event, token)) = next else {
                    open = false;
                    continue;
                };
                if stopped {
                    continue;
                }
                let letter = is_dead_letter(&event);
                let topic = topic_of(&event, letter);
                if !valid_topic(&topic) {
                    let reason = format!(
                        "{topic:?} is not a Pub/Sub topic name (3 to 255 characters, starting \
                         with a letter, of letters, digits and -_.~+%, not starting with goog)"
                    );
                    if !reports.report(token, Err(failure(&event, DeliveryClass::InvalidTopic, reason))) {
                        return;
                    }
                    continue;
                }
                let prepared = match prepare(&event) {
                    Ok(p) => p,
                    Err((class, reason)) => {
                        if !reports.report(token, Err(failure(&event, class, reason))) {
                            return;
                        }
                        continue;
                    }
                };
                let lane = (topic, event.key.clone());
                let queued = Queued { event, token, prepared };
                if let Some(queue) = waiting.get_mut(&lane) {
                    queue.push_back(queued);
                } else {
                    waiting.insert(lane.clone(), VecDeque::new());
                    start(&shared, &mut running, &mut started, lane, vec![queued]);
                }
            }
            Some(done) = running.join_next_with_id() => {
                let Done { lane, outcomes } = match done {
                    Ok((id, done)) => {
                        started.remove(&id);
                        done
                    }
                    Err(e) => match lost(&mut started, &e) {
                        Some(lost) => lost,
                        None => continue,
                    },
                };
                for (token, result) in outcomes {
                    if let Err(e) = &result
                        && !e.is_about_the_message()
                    {
                        stopped = true;
                    }
                    if !reports.report(token, result) {
                        return;
                    }
                }
                if stopped {
                    waiting.clear();
                    continue;
                }
                let batch = next_batch(&shared.config, waiting.get_mut(&lane));
                if batch.is_empty() {
                    waiting.remove(&lane);
                } else {
                    start(&shared, &mut running, &mut started, lane, batch);
                }
            }
        }
    }
}

/// The next request of a lane: its queued events in order, up to the
/// batch's limits (at least one).
fn next_batch(config: &PubSubSinkConfig, queue: Option<&mut VecDeque<Queued>>) -> Vec<Queued> {
    let Some(queue) = queue else {
        return Vec::new();
    };
    let mut batch = Vec::new();
    let (mut bytes, mut sent) = (0usize, 0usize);
    while let Some(next) = queue.front() {
        let len = next.prepared.json.len();
        if !batch.is_empty()
            && (batch.len() >= config.max_batch_messages
                || bytes + len > config.max_batch_bytes
                || sent + len + 20 > message::MAX_REQUEST)
        {
            break;
        }
        bytes += next.prepared.size.max(len);
        sent += len + 1;
        batch.push(queue.pop_front().expect("a front"));
    }
    batch
}

fn start(
    shared: &Arc<Shared>,
    running: &mut JoinSet<Done>,
    started: &mut Started,
    lane: Lane,
    batch: Vec<Queued>,
) {
    let about: Vec<(usize, String, String)> = batch
        .iter()
        .map(|q| (q.token, q.event.event_id.clone(), q.event.topic.clone()))
        .collect();
    let shared = Arc::clone(shared);
    let task_lane = lane.clone();
    let task = running.spawn(async move {
        let outcomes = publish_lane(&shared, &task_lane.0, batch).await;
        Done {
            lane: task_lane,
            outcomes,
        }
    });
    started.insert(task.id(), (lane, about));
}

/// The outcomes of a request whose task ended without them (it panicked):
/// failures that end the session, never silence.
fn lost(started: &mut Started, e: &tokio::task::JoinError) -> Option<Done> {
    let (lane, about) = started.remove(&e.id())?;
    tracing::error!(topic = %lane.0, "a pubsub publish task ended without an outcome");
    Some(Done {
        lane,
        outcomes: about
            .into_iter()
            .map(|(token, event_id, topic)| {
                (
                    token,
                    Err(DeliveryError {
                        event_id,
                        topic,
                        class: DeliveryClass::BrokerError,
                        reason: "the pubsub publish task ended without an outcome".into(),
                        rejected: None,
                    }),
                )
            })
            .collect(),
    })
}

/// How one request ended, after its retries.
enum Attempt {
    /// Stored: a message id for every message.
    Stored,
    /// Pub/Sub refused the request as such (400, 413): about its messages.
    Refused(DeliveryClass, String),
    /// It could not be stored: the session ends.
    Failed(DeliveryClass, String),
}

/// Publishes one lane's batch: all of it, or (after a refusal) one by one
/// in order, so only the message at fault is refused.
async fn publish_lane(
    shared: &Shared,
    topic: &str,
    batch: Vec<Queued>,
) -> Vec<(usize, Result<(), DeliveryError>)> {
    match send(shared, topic, &batch).await {
        Attempt::Stored => batch.iter().map(|q| (q.token, Ok(()))).collect(),
        Attempt::Failed(class, reason) => fail_all(&batch, class, &reason),
        Attempt::Refused(class, reason) if batch.len() == 1 => {
            vec![(batch[0].token, Err(failure(&batch[0].event, class, reason)))]
        }
        Attempt::Refused(..) => {
            let mut outcomes = Vec::with_capacity(batch.len());
            for (i, q) in batch.iter().enumerate() {
                match send(shared, topic, std::slice::from_ref(q)).await {
                    Attempt::Stored => outcomes.push((q.token, Ok(()))),
                    Attempt::Refused(class, reason) => {
                        outcomes.push((q.token, Err(failure(&q.event, class, reason))));
                    }
                    Attempt::Failed(class, reason) => {
                        outcomes.extend(fail_all(&batch[i..], class, &reason));
                        break;
                    }
                }
            }
            outcomes
        }
    }
}

fn fail_all(
    batch: &[Queued],
    class: DeliveryClass,
    reason: &str,
) -> Vec<(usize, Result<(), DeliveryError>)> {
    batch
        .iter()
        .map(|q| (q.token, Err(failure(&q.event, class, reason.to_owned()))))
        .collect()
}

/// Sends `batch` in one Publish request, again with backoff (the lane
/// paused meanwhile) while the failure is one a retry can mend, until
/// `max_retry_duration_s`.
async fn send(shared: &Shared, topic: &str, batch: &[Queued]) -> Attempt {
    let config = &shared.config;
    let deadline = Instant::now() + Duration::from_secs(config.max_retry_duration_s);
    let letters = batch.first().is_some_and(|q| is_dead_letter(&q.event));
    let body = publish_body(batch.iter().map(|q| &q.prepared));
    let mut attempt = 0u32;
    loop {
        let result = {
            let _permit = shared.requests.acquire().await;
            shared.client.publish(topic, body.clone()).await
        };
        let error = match result {
            Ok(ids) if ids.len() == batch.len() => return Attempt::Stored,
            Ok(ids) => ApiError::Transport(format!(
                "{} message ids for {} messages",
                ids.len(),
                batch.len()
            )),
            Err(e) => e,
        };
        match error.http() {
            Some(400) => return Attempt::Refused(DeliveryClass::InvalidRecord, error.to_string()),
            Some(413) => {
                return Attempt::Refused(DeliveryClass::MessageTooLarge, error.to_string());
            }
            Some(401) => return Attempt::Failed(DeliveryClass::Authentication, error.to_string()),
            Some(403) => return Attempt::Failed(DeliveryClass::Authorization, error.to_string()),
            Some(404) if config.create_topics => {
                // Gone since it was checked (deleted, or an emulator that
                // restarted empty): created again, then sent again.
                tracing::warn!(topic, "the topic is gone; creating it again");
                if let Err(Missing::Api(e)) = shared.ensure(topic, letters, true).await
                    && !e.transient()
                {
                    return Attempt::Failed(DeliveryClass::UnknownTopic, e.to_string());
                }
            }
            Some(404) => {
                return Attempt::Failed(
                    DeliveryClass::UnknownTopic,
                    format!("{error} (topic {topic}; set create_topics = true to create it)"),
                );
            }
            _ if error.transient() => {}
            _ => return Attempt::Failed(DeliveryClass::BrokerError, error.to_string()),
        }
        attempt += 1;
        let delay = backoff(
            attempt,
            Duration::from_millis(config.retry_initial_ms),
            Duration::from_millis(config.retry_max_ms),
        );
        if Instant::now() + delay > deadline {
            return Attempt::Failed(
                DeliveryClass::Timeout,
                format!(
                    "{error}; not stored after {attempt} attempts in {} s (max_retry_duration_s)",
                    config.max_retry_duration_s
                ),
            );
        }
        count_retry(topic);
        shared.retries.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            topic,
            attempt,
            messages = batch.len(),
            error = %error,
            "publish failed; its ordering key waits while it is sent again"
        );
        tokio::time::sleep(delay).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queued(n: usize, len: usize) -> Queued {
        let event = Event {
            event_id: format!("e{n}"),
            topic: "orders".into(),
            key: Some(Bytes::from_static(b"k")),
            value: Bytes::from(vec![b'x'; len]),
            json_value: false,
            headers: vec![],
            position: walbox_outbox::Position {
                commit_lsn: walbox_pgoutput::Lsn(1),
                index: u32::try_from(n).unwrap(),
                xid: 1,
            },
            origin: walbox_outbox::Origin::Stream,
        };
        let prepared = prepare(&event).unwrap();
        Queued {
            event,
            token: n,
            prepared,
        }
    }

    #[test]
    fn a_lanes_next_request_takes_its_queue_in_order_up_to_the_limits() {
        let config = PubSubSinkConfig {
            max_batch_messages: 3,
            max_batch_bytes: 4096,
            ..PubSubSinkConfig::default()
        };
        let mut queue: VecDeque<Queued> = (0..5).map(|n| queued(n, 10)).collect();
        let batch = next_batch(&config, Some(&mut queue));
        assert_eq!(batch.iter().map(|q| q.token).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(queue.len(), 2);
        // A message over the byte limit goes alone.
        let mut queue: VecDeque<Queued> = [queued(0, 5000), queued(1, 10)].into();
        assert_eq!(next_batch(&config, Some(&mut queue)).len(), 1);
        let mut queue: VecDeque<Queued> = [queued(0, 10), queued(1, 3000), queued(2, 10)].into();
        assert_eq!(next_batch(&config, Some(&mut queue)).len(), 1);
        assert_eq!(next_batch(&config, Some(&mut queue)).len(), 1);
        assert!(next_batch(&config, None).is_empty());
    }
}
