//! The HTTP webhook sink: each event is POSTed to the URL its template names,
//! signed as Standard Webhooks says (`webhook-id` = the event id, the same on
//! every attempt and after a restart; `webhook-timestamp` and
//! `webhook-signature` made anew per attempt), and counts as delivered only on
//! a 2xx.
//!
//! Per-key order with many keys in flight: events go into lanes by key (all
//! events without a key share one lane). A lane has at most one request in
//! flight; the next event of its key waits until the one before it is settled
//! (a 2xx, or its dead letter on disk). Lanes run at once, as many as the relay's
//! in-flight bound lets events in, with at most `max_connections` requests
//! open; a lane waiting to retry holds no connection. Acknowledgements so come
//! out of send order, which the relay's tracker takes (it moves the position
//! over the acknowledged prefix only).
//!
//! Retries happen inside the sink (see [`attempt`]); the relay hears of an
//! event once: delivered, refused (its dead letter takes its place), or a
//! final failure that stops walbox (410, a redirect not followed).
//!
//! A receiver deduplicates by `webhook-id`, so `walbox replay` sends each
//! event under an id of its own, `{event id}_replay_{name}` (the `event_id`
//! header unchanged): the receiver takes the replay, and drops only what an
//! earlier run of the same replay delivered.
//!
//! Dead letters (events that carry `walbox_error_class`: a refusal's, a row
//! the mapping refused) never go to the receiver: they are appended to a local
//! file and fsynced before they are reported ([`dead_letters`]).

mod attempt;
mod config;
mod dead_letters;
mod request;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{Mutex, Semaphore, mpsc};
use tokio::task::JoinSet;
use walbox_outbox::Event;

pub(crate) use attempt::backoff;
pub use config::WebhookSinkConfig;
pub use dead_letters::{DeadLetterFile, LetterLine, ReplayStart, read_letters, replayed_path};
pub use request::{DROPPED_HEADERS_HEADER, KEY_ENCODING_HEADER, KEY_HEADER};

use attempt::{Shared, deliver};
use dead_letters::LetterFile;

use crate::kit::{Close, Lifecycle, Reports, SessionTask, is_dead_letter};
use crate::{Deliveries, DeliveryClass, DeliveryError, Sink, SinkError};

/// Where an event waits for the one before it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Lane {
    /// Events of one key (or, `None`, without one).
    Key(Option<Bytes>),
    /// Dead letters, appended in the order they come.
    DeadLetters,
}

/// The session: the dispatcher task, which starts with the first event.
/// Ending it drops the requests in flight with their connections.
struct Dispatcher {
    _task: SessionTask,
}

// Closed at once, by dropping: nothing more of the session goes out.
impl Close for Dispatcher {}

/// POSTs events to an HTTP receiver.
pub struct WebhookSink {
    shared: Arc<Shared>,
    letters: Arc<Mutex<LetterFile>>,
    events: mpsc::UnboundedSender<(Event, usize)>,
    /// The queue of events, taken by the dispatcher when the first event
    /// comes.
    waiting: Option<mpsc::UnboundedReceiver<(Event, usize)>>,
    session: Lifecycle<Dispatcher>,
    reports: Reports,
}

impl std::fmt::Debug for WebhookSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookSink")
            .field("in_flight", &self.reports.in_flight())
            .finish_non_exhaustive()
    }
}

impl WebhookSink {
    /// A sink with these settings. Returns the sink and the receiver of its
    /// deliveries.
    pub fn new(config: WebhookSinkConfig) -> Result<(Self, Deliveries), SinkError> {
        config.validate()?;
        let path = config
            .dead_letter_file
            .clone()
            .ok_or_else(|| SinkError::Config("sink.webhook.dead_letter_file: not set".into()))?;
        let letters = LetterFile::open(&path)?;
        let shared = Shared {
            client: config.client()?,
            keys: config.keys()?,
            template: config.template()?,
            retry_initial: Duration::from_millis(config.retry_initial_ms),
            retry_max: Duration::from_millis(config.retry_max_ms),
            max_retry: config.max_retry_duration(),
            connections: Arc::new(Semaphore::new(config.max_connections)),
            retries: Arc::new(AtomicU64::new(0)),
        };
        let (reports, rx) = Reports::new();
        let (events, queue) = mpsc::unbounded_channel();
        Ok((
            WebhookSink {
                shared: Arc::new(shared),
                letters: Arc::new(Mutex::new(letters)),
                events,
                waiting: Some(queue),
                session: Lifecycle::default(),
                reports,
            },
            rx,
        ))
    }

    /// Attempts that failed and were tried again, so far.
    #[must_use]
    pub fn retries(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.shared.retries)
    }
}

impl Sink for WebhookSink {
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        if self.session.aborted() {
            return Ok(());
        }
        self.reports.check()?;
        if let Some(queue) = self.waiting.take() {
            let task = self.reports.spawn(
                "webhook dispatcher",
                dispatch(
                    Arc::clone(&self.shared),
                    Arc::clone(&self.letters),
                    queue,
                    self.reports.clone(),
                ),
            );
            self.session
                .open_with(|| async { Ok(Dispatcher { _task: task }) })
                .await?;
        }
        self.reports.sent();
        self.events.send((event, token)).map_err(|_| {
            self.reports.withdrawn();
            SinkError::TaskDied("the webhook dispatcher stopped".into())
        })
    }

    fn abort(&mut self) {
        // Nothing more of this session reaches the receiver: requests in
        // flight are dropped with their connections.
        self.session.abort();
    }

    async fn flush(&mut self, timeout: Duration) -> Result<(), SinkError> {
        self.session.flush(&self.reports, timeout).await
    }
}

/// One settled event.
struct Settled {
    lane: Lane,
    token: usize,
    result: Result<(), DeliveryError>,
    event_id: String,
    key: Option<Bytes>,
}

/// What the dispatcher knows of a running task, to report its event should
/// the task end without an outcome (a panic).
type Started = HashMap<tokio::task::Id, (Lane, usize, String, String)>;

fn start(
    running: &mut JoinSet<Settled>,
    started: &mut Started,
    shared: &Arc<Shared>,
    letters: &Arc<Mutex<LetterFile>>,
    lane: Lane,
    event: Event,
    token: usize,
) {
    let shared = Arc::clone(shared);
    let letters = Arc::clone(letters);
    let about = (
        lane.clone(),
        token,
        event.event_id.clone(),
        event.topic.clone(),
    );
    let (event_id, key) = (event.event_id.clone(), event.key.clone());
    let task = running.spawn(async move {
        #[cfg(test)]
        assert_ne!(event.event_id, tests::PANICS, "a delivery task panics");
        let result = if lane == Lane::DeadLetters {
            write_letter(&letters, &event).await
        } else {
            deliver(&shared, &event).await
        };
        Settled {
            lane,
            token,
            result,
            event_id,
            key,
        }
    });
    started.insert(task.id(), about);
}

/// The outcome of a task that ended without one (it panicked): a failure
/// that ends the session (a new one sends the event again), never silence.
fn lost_task(started: &mut Started, e: &tokio::task::JoinError) -> Option<Settled> {
    let (lane, token, event_id, topic) = started.remove(&e.id())?;
    let what = if e.is_panic() {
        "panicked"
    } else {
        "was cancelled"
    };
    tracing::error!(event_id = %event_id, topic = %topic, "the webhook delivery task {what}");
    Some(Settled {
        lane,
        token,
        result: Err(DeliveryError {
            event_id: event_id.clone(),
            topic,
            class: DeliveryClass::BrokerError,
            reason: format!("the webhook delivery task {what}"),
            rejected: None,
        }),
        event_id,
        key: None,
    })
}

async fn write_letter(
    letters: &Arc<Mutex<LetterFile>>,
    event: &Event,
) -> Result<(), DeliveryError> {
    let mut file = Arc::clone(letters).lock_owned().await;
    let event_for_file = event.clone();
    let written = tokio::task::spawn_blocking(move || {
        let r = file.append(&event_for_file);
        (r, file.path().display().to_string())
    })
    .await;
    match written {
        Ok((Ok(()), _)) => Ok(()),
        Ok((Err(e), path)) => Err(DeliveryError {
            event_id: event.event_id.clone(),
            topic: event.topic.clone(),
            class: DeliveryClass::IoError,
            reason: format!("appending the dead letter to {path}: {e}"),
            rejected: None,
        }),
        Err(e) => Err(DeliveryError {
            event_id: event.event_id.clone(),
            topic: event.topic.clone(),
            class: DeliveryClass::IoError,
            reason: format!("appending the dead letter: {e}"),
            rejected: None,
        }),
    }
}

/// Runs the lanes: starts an event when its lane is free, reports each
/// settled event and starts the next of its lane.
///
/// An event refused for what it is (a dead letter takes its place) holds its
/// key's lane until its dead letter, which the relay sends next, is on disk:
/// were walbox killed before that, the event would be sent again, and must
/// not then arrive after the key's next event.
async fn dispatch(
    shared: Arc<Shared>,
    letters: Arc<Mutex<LetterFile>>,
    mut events: mpsc::UnboundedReceiver<(Event, usize)>,
    reports: Reports,
) {
    let mut lanes = Lanes {
        shared,
        letters,
        waiting: HashMap::new(),
        running: JoinSet::new(),
        started: Started::new(),
        held: HashSet::new(),
    };
    let mut open = true;
    // A final failure (the endpoint gone or moved): nothing more starts.
    let mut stopped = false;
    while open || !lanes.running.is_empty() {
        tokio::select! {
            next = events.recv(), if open => {
                let Some((event, token)) = next else {
                    open = false;
                    continue;
                };
                if !stopped {
                    lanes.take(event, token);
                }
            }
            Some(done) = lanes.running.join_next_with_id() => {
                let settled = match done {
                    Ok((id, settled)) => {
                        lanes.started.remove(&id);
                        settled
                    }
                    Err(e) => match lost_task(&mut lanes.started, &e) {
                        Some(lost) => lost,
                        None => continue,
                    },
                };
                let Settled { lane, token, result, event_id, key } = settled;
                let ok = result.is_ok();
                let refused = match &result {
                    Ok(()) => false,
                    Err(e) if e.is_about_the_message() => true,
                    Err(_) => {
                        stopped = true;
                        lanes.waiting.clear();
                        false
                    }
                };
                if !reports.report(token, result) {
                    return;
                }
                if stopped {
                    continue;
                }
                match lane {
                    Lane::Key(_) if refused => {
                        lanes.held.insert((event_id, lane));
                    }
                    Lane::DeadLetters => {
                        lanes.next(Lane::DeadLetters);
                        let held = (event_id, Lane::Key(key));
                        if ok && lanes.held.remove(&held) {
                            lanes.next(held.1);
                        }
                    }
                    lane => lanes.next(lane),
                }
            }
        }
    }
}

/// The dispatcher's lanes.
struct Lanes {
    shared: Arc<Shared>,
    letters: Arc<Mutex<LetterFile>>,
    /// Lanes with an event in flight (or held), and the events waiting
    /// behind it.
    waiting: HashMap<Lane, VecDeque<(Event, usize)>>,
    running: JoinSet<Settled>,
    started: Started,
    /// Key lanes held until the dead letter of their refused event (by its
    /// event id and key) is on disk.
    held: HashSet<(String, Lane)>,
}

impl Lanes {
    /// A new event: started when its lane is free, else queued behind it.
    fn take(&mut self, event: Event, token: usize) {
        let lane = if is_dead_letter(&event) {
            Lane::DeadLetters
        } else {
            Lane::Key(event.key.clone())
        };
        if let Some(queue) = self.waiting.get_mut(&lane) {
            queue.push_back((event, token));
        } else {
            self.waiting.insert(lane.clone(), VecDeque::new());
            self.start(lane, event, token);
        }
    }

    /// `lane`'s event settled: its next one starts, or the lane is free.
    fn next(&mut self, lane: Lane) {
        match self.waiting.get_mut(&lane).and_then(VecDeque::pop_front) {
            Some((event, token)) => self.start(lane, event, token),
            None => {
                self.waiting.remove(&lane);
            }
        }
    }

    fn start(&mut self, lane: Lane, event: Event, token: usize) {
        start(
            &mut self.running,
            &mut self.started,
            &self.shared,
            &self.letters,
            lane,
            event,
            token,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use walbox_outbox::Position;

    /// The event id whose delivery task panics.
    pub(super) const PANICS: &str = "panics";

    pub(super) fn event(id: &str, key: &str) -> Event {
        Event {
            event_id: id.into(),
            topic: "t".into(),
            key: Some(Bytes::from(key.to_owned())),
            value: Bytes::from_static(b"{}"),
            json_value: true,
            headers: vec![],
            position: Position {
                commit_lsn: walbox_pgoutput::Lsn(1),
                index: 0,
                xid: 1,
            },
            origin: walbox_outbox::Origin::Stream,
        }
    }

    pub(super) fn sink(dir: &std::path::Path) -> (WebhookSink, Deliveries) {
        WebhookSink::new(WebhookSinkConfig {
            // Never reached by these tests.
            url: "http://127.0.0.1:9/{topic}".into(),
            secrets: vec!["whsec_aGVsbG8gd29ybGQ=".into()],
            dead_letter_file: Some(dir.join("dl.jsonl")),
            ..WebhookSinkConfig::default()
        })
        .unwrap()
    }

    #[tokio::test]
    async fn a_delivery_task_that_panics_is_reported_as_a_failure_not_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let (mut sink, mut deliveries) = sink(dir.path());
        sink.send(event(PANICS, "k"), 7).await.unwrap();
        let d = tokio::time::timeout(Duration::from_secs(10), deliveries.recv())
            .await
            .expect("the panicked event is reported")
            .unwrap();
        assert_eq!(d.token, 7);
        let e = d.result.unwrap_err();
        assert!(!e.is_about_the_message() && !e.is_final(), "{e:?}");
        assert_eq!(e.event_id, PANICS);
    }
}
