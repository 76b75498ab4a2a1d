//! A sink over a destination that takes entries in batches and answers
//! each entry on its own (Kinesis, SQS, SNS): events go into per-key
//! [`Lanes`], a driver task sends batches of lane heads with at most
//! `max_calls` calls in flight, and each entry's answer settles it:
//!
//! - stored: reported delivered, its lane's next entry may go;
//! - to retry (throttled, an internal error of the service, the call lost):
//!   back to the head of its lane, which pauses with a backoff and then
//!   sends it again, so nothing later of its key is stored before it; after
//!   `max_retry` of failures it is reported failed (not the message's
//!   fault), and the relay ends the session and sends again from its
//!   confirmed position;
//! - refused for what it is (by the sink's own checks before it is sent,
//!   or by the destination's answer): reported with its class, and its dead
//!   letter takes its place;
//! - a failure of the session (refused credentials, a destination gone):
//!   every entry of the call reports it and nothing more is sent.
//!
//! The destination's own part ([`Api`]) builds nothing and keeps nothing: it
//! sends one batch and says what became of each entry.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;
use walbox_outbox::Event;

use crate::kit::{Close, FailRest, Lifecycle, Reports, SessionTask, failure};
use crate::lanes::{Batch, LaneId, Lanes};
use crate::{DeliveryClass, DeliveryError, SinkError};

/// What became of one entry of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Stored.
    Stored,
    /// Not stored; sending it again may work (throttled, an internal error).
    Retry(String),
    /// Refused for what it is: it never will be stored (its dead letter
    /// takes its place).
    Refused(DeliveryClass, String),
}

/// A call that got no answer per entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CallError {
    /// Every entry may be sent again (the connection, a timeout, the whole
    /// call throttled).
    Retry(String),
    /// The call was larger than the destination takes as a whole, though
    /// each entry fit the bound walbox counts (`BatchRequestTooLong`): each
    /// entry goes again in a call of its own, and one refused alone is
    /// too large for good.
    TooLarge(String),
    /// The session cannot go on (credentials refused, the destination
    /// gone): every entry fails with this class.
    Fail(DeliveryClass, String),
}

/// A destination's part: one batch sent, one answer per entry, in order.
pub(crate) trait Api: Send + Sync + 'static {
    /// An entry as the call takes it (cheap to clone: it is sent again on a
    /// retry).
    type Entry: Clone + Send + Sync + 'static;

    /// Sends `entries` to `dest` in one call.
    fn put(
        &self,
        dest: Arc<str>,
        entries: Vec<Self::Entry>,
    ) -> impl Future<Output = Result<Vec<Answer>, CallError>> + Send;
}

/// The driver's bounds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Most entries per call.
    pub(crate) max_entries: usize,
    /// Most bytes per call (entries' sizes added up).
    pub(crate) max_bytes: usize,
    /// Most calls in flight.
    pub(crate) max_calls: usize,
    /// The first retry's backoff.
    pub(crate) retry_initial: Duration,
    /// The longest backoff.
    pub(crate) retry_max: Duration,
    /// How long an entry may go on failing before it is reported failed.
    pub(crate) max_retry: Duration,
}

/// An event on its way: its entry, lane and what its report needs.
struct Item<E> {
    event: Event,
    token: usize,
    entry: E,
    size: usize,
    /// When it first failed, and how many times.
    failing: Option<(Instant, u32)>,
}

/// The session: the driver task, started with the first event.
struct Driver {
    _task: SessionTask,
}

impl Close for Driver {}

/// The sink's side of the driver: what `send` hands over.
pub(crate) struct Batched<A: Api> {
    api: Arc<A>,
    limits: Limits,
    events: mpsc::UnboundedSender<(LaneId, Item<A::Entry>)>,
    waiting: Option<mpsc::UnboundedReceiver<(LaneId, Item<A::Entry>)>>,
    session: Lifecycle<Driver>,
    reports: Reports,
    retries: Arc<AtomicU64>,
    next_alone: u64,
}

impl<A: Api> std::fmt::Debug for Batched<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batched")
            .field("in_flight", &self.reports.in_flight())
            .finish_non_exhaustive()
    }
}

impl<A: Api> Batched<A> {
    /// A driver for `api` within `limits`, and the receiver of its
    /// deliveries.
    pub(crate) fn new(api: Arc<A>, limits: Limits) -> (Self, crate::Deliveries) {
        let (reports, rx) = Reports::new();
        let (events, queue) = mpsc::unbounded_channel();
        (
            Batched {
                api,
                limits,
                events,
                waiting: Some(queue),
                session: Lifecycle::default(),
                reports,
                retries: Arc::new(AtomicU64::new(0)),
                next_alone: 0,
            },
            rx,
        )
    }

    /// Entries that failed and were sent again, so far.
    pub(crate) fn retries(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.retries)
    }

    /// Reports `event` refused before it was sent (it cannot be put in an
    /// entry): its dead letter takes its place.
    pub(crate) fn refuse(
        &mut self,
        event: &Event,
        token: usize,
        class: DeliveryClass,
        why: String,
    ) {
        self.reports.sent();
        self.reports.report(token, Err(failure(event, class, why)));
    }

    /// Hands `event` on as `entry` (of `size` bytes) to `dest`.
    pub(crate) async fn send(
        &mut self,
        dest: Arc<str>,
        event: Event,
        token: usize,
        entry: A::Entry,
        size: usize,
    ) -> Result<(), SinkError> {
        if self.session.aborted() {
            return Ok(());
        }
        self.reports.check()?;
        if let Some(queue) = self.waiting.take() {
            let task = self.reports.spawn(
                "batch driver",
                drive(
                    Arc::clone(&self.api),
                    self.limits,
                    queue,
                    self.reports.clone(),
                    Arc::clone(&self.retries),
                ),
            );
            self.session
                .open_with(|| async { Ok(Driver { _task: task }) })
                .await?;
        }
        let key = match &event.key {
            Some(k) => crate::lanes::LaneKey::Key(k.clone()),
            None => {
                self.next_alone += 1;
                crate::lanes::LaneKey::Alone(self.next_alone)
            }
        };
        let lane = LaneId { dest, key };
        self.reports.sent();
        let item = Item {
            event,
            token,
            entry,
            size,
            failing: None,
        };
        self.events.send((lane, item)).map_err(|_| {
            self.reports.withdrawn();
            SinkError::TaskDied("the batch driver stopped".into())
        })
    }

    /// [`crate::Sink::abort`].
    pub(crate) fn abort(&mut self) {
        self.session.abort();
    }

    /// [`crate::Sink::flush`].
    pub(crate) async fn flush(&mut self, timeout: Duration) -> Result<(), SinkError> {
        self.session.flush(&self.reports, timeout).await
    }
}

/// The backoff before the `attempt`th retry (from 1): doubling from
/// `initial` up to `max`, with up to a quarter taken off at random so that
/// lanes paused together do not all come back at once.
fn backoff(limits: &Limits, attempt: u32) -> Duration {
    let doubled = limits
        .retry_initial
        .saturating_mul(1u32 << attempt.saturating_sub(1).min(16));
    let full = doubled.min(limits.retry_max);
    full.mul_f64(1.0 - fastrand::f64() * 0.25)
}

type Call = Result<Vec<Answer>, CallError>;

/// Runs the lanes: takes events, sends batches, settles answers.
async fn drive<A: Api>(
    api: Arc<A>,
    limits: Limits,
    mut events: mpsc::UnboundedReceiver<(LaneId, Item<A::Entry>)>,
    reports: Reports,
    retries: Arc<AtomicU64>,
) {
    let mut lanes: Lanes<Item<A::Entry>> = Lanes::default();
    let mut calls: JoinSet<Call> = JoinSet::new();
    let mut out: HashMap<tokio::task::Id, Batch<Item<A::Entry>>> = HashMap::new();
    let mut open = true;
    let mut stopped = FailRest::default();
    loop {
        while stopped.get().is_none() && calls.len() < limits.max_calls {
            let Some(batch) = lanes.take(limits.max_entries, limits.max_bytes, |i| i.size) else {
                break;
            };
            let entries = batch.entries.iter().map(|(_, i)| i.entry.clone()).collect();
            let api = Arc::clone(&api);
            let dest = Arc::clone(&batch.dest);
            let task = calls.spawn(async move { api.put(dest, entries).await });
            out.insert(task.id(), batch);
        }
        if !open && calls.is_empty() && (lanes.held() == 0 || stopped.get().is_some()) {
            return;
        }
        let wake = lanes.next_wake();
        tokio::select! {
            next = events.recv(), if open => match next {
                Some((lane, item)) => lanes.push(lane, item),
                None => open = false,
            },
            Some(done) = calls.join_next_with_id() => {
                let (id, answers) = match done {
                    Ok((id, answers)) => (id, answers),
                    Err(e) => {
                        let what = if e.is_panic() { "panicked" } else { "was cancelled" };
                        (e.id(), Err(CallError::Fail(
                            DeliveryClass::BrokerError,
                            format!("the call to the destination {what}"),
                        )))
                    }
                };
                let Some(batch) = out.remove(&id) else { continue };
                if !settle(&mut lanes, batch, answers, &limits, &reports, &retries, &mut stopped) {
                    return;
                }
            }
            () = sleep_until(wake), if wake.is_some() => lanes.wake(Instant::now().into_std()),
        }
    }
}

async fn sleep_until(when: Option<std::time::Instant>) {
    if let Some(when) = when {
        tokio::time::sleep_until(Instant::from_std(when)).await;
    }
}

/// Settles the entries of one answered call; `false` once the relay no
/// longer listens.
fn settle<E>(
    lanes: &mut Lanes<Item<E>>,
    batch: Batch<Item<E>>,
    answers: Call,
    limits: &Limits,
    reports: &Reports,
    retries: &AtomicU64,
    stopped: &mut FailRest,
) -> bool {
    let now = Instant::now();
    let alone = batch.entries.len() == 1;
    for (i, (lane, mut item)) in batch.entries.into_iter().enumerate() {
        let answer = match &answers {
            Ok(all) => all.get(i).cloned().unwrap_or_else(|| {
                Answer::Retry("the destination's answer named fewer entries than were sent".into())
            }),
            Err(CallError::Retry(why)) => Answer::Retry(why.clone()),
            Err(CallError::TooLarge(why)) if alone => {
                Answer::Refused(DeliveryClass::MessageTooLarge, why.clone())
            }
            Err(CallError::TooLarge(why)) => {
                // Counted as filling a call: it goes in one of its own.
                item.size = limits.max_bytes;
                Answer::Retry(why.clone())
            }
            Err(CallError::Fail(class, why)) => {
                stopped.after(*class, why.clone());
                let e = failure(&item.event, *class, why.clone());
                if !reports.report(item.token, Err(e)) {
                    return false;
                }
                continue;
            }
        };
        let result = match answer {
            Answer::Stored => {
                lanes.stored(&lane);
                Ok(())
            }
            Answer::Refused(class, why) => {
                lanes.stored(&lane);
                Err(failure(&item.event, class, why))
            }
            Answer::Retry(why) => {
                let (since, attempts) = item.failing.unwrap_or((now, 0));
                if now.duration_since(since) >= limits.max_retry {
                    let why = format!(
                        "still failing after {} attempts over {:.1} s: {why}",
                        attempts + 1,
                        now.duration_since(since).as_secs_f64()
                    );
                    stopped.after(DeliveryClass::Timeout, why.clone());
                    Err(DeliveryError {
                        event_id: item.event.event_id.clone(),
                        topic: item.event.topic.clone(),
                        class: DeliveryClass::Timeout,
                        reason: why,
                        rejected: None,
                    })
                } else {
                    retries.fetch_add(1, Ordering::Relaxed);
                    crate::kit::count_retry(&item.event.topic);
                    if attempts == 0 {
                        tracing::debug!(
                            event_id = %item.event.event_id,
                            topic = %item.event.topic,
                            "an entry failed and is sent again: {why}"
                        );
                    }
                    item.failing = Some((since, attempts + 1));
                    let until = now + backoff(limits, attempts + 1);
                    lanes.retry(lane, item, until.into_std());
                    continue;
                }
            }
        };
        if !reports.report(item.token, result) {
            return false;
        }
    }
    true
}

/// An event of key `key` for unit tests.
#[cfg(test)]
pub(crate) fn tests_event(id: &str, key: &str) -> Event {
    tests::event(id, key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::sync::Mutex;
    use walbox_outbox::Position;

    /// A destination that fails the entries a script names, and records
    /// what it stored in order.
    #[derive(Default)]
    struct Script {
        /// Event ids whose next attempts fail, and how many times.
        fail: Mutex<HashMap<String, u32>>,
        stored: Mutex<Vec<String>>,
        calls: Mutex<Vec<Vec<String>>>,
    }

    impl Api for Script {
        type Entry = String;

        async fn put(
            &self,
            _dest: Arc<str>,
            entries: Vec<String>,
        ) -> Result<Vec<Answer>, CallError> {
            self.calls.lock().unwrap().push(entries.clone());
            let mut fail = self.fail.lock().unwrap();
            Ok(entries
                .into_iter()
                .map(|id| match fail.get_mut(&id) {
                    Some(n) if *n > 0 => {
                        *n -= 1;
                        Answer::Retry("ProvisionedThroughputExceededException".into())
                    }
                    _ => {
                        self.stored.lock().unwrap().push(id);
                        Answer::Stored
                    }
                })
                .collect())
        }
    }

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

    fn limits() -> Limits {
        Limits {
            max_entries: 10,
            max_bytes: 1 << 20,
            max_calls: 4,
            retry_initial: Duration::from_millis(5),
            retry_max: Duration::from_millis(20),
            max_retry: Duration::from_secs(30),
        }
    }

    #[tokio::test]
    async fn an_entry_that_fails_is_sent_again_before_anything_later_of_its_key() {
        let api = Arc::new(Script::default());
        api.fail.lock().unwrap().insert("a1".into(), 3);
        let (mut sink, mut deliveries) = Batched::new(Arc::clone(&api), limits());
        let events = [
            ("a1", "a"),
            ("b1", "b"),
            ("a2", "a"),
            ("b2", "b"),
            ("a3", "a"),
        ];
        for (token, (id, key)) in events.iter().enumerate() {
            let mut e = event(id, key);
            e.topic = "batched-retries".into();
            sink.send(Arc::from("s"), e, token, (*id).to_owned(), 10)
                .await
                .unwrap();
        }
        sink.flush(Duration::from_secs(20)).await.unwrap();
        let mut reported = Vec::new();
        while let Ok(d) = deliveries.try_recv() {
            d.result.unwrap();
            reported.push(d.token);
        }
        reported.sort_unstable();
        assert_eq!(reported, [0, 1, 2, 3, 4]);
        let stored = api.stored.lock().unwrap().clone();
        let of = |k: char| {
            stored
                .iter()
                .filter(|id| id.starts_with(k))
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(of('a'), ["a1", "a2", "a3"], "{stored:?}");
        assert_eq!(of('b'), ["b1", "b2"]);
        // b went on while a waited, and no call held two entries of a key.
        assert!(stored.iter().position(|i| i == "b2") < stored.iter().position(|i| i == "a1"));
        for call in api.calls.lock().unwrap().iter() {
            let a = call.iter().filter(|i| i.starts_with('a')).count();
            assert!(a <= 1, "{call:?}");
        }
        assert_eq!(sink.retries().load(Ordering::Relaxed), 3);
        // Counted by topic for walbox_sink_retries.
        let counted = crate::kit::retries_by_topic();
        assert!(
            counted
                .iter()
                .any(|(t, n)| t == "batched-retries" && *n == 3),
            "{counted:?}"
        );
    }

    #[tokio::test]
    async fn an_entry_failing_past_the_ceiling_fails_the_session_and_nothing_more_goes() {
        let api = Arc::new(Script::default());
        api.fail.lock().unwrap().insert("a1".into(), u32::MAX);
        let (mut sink, mut deliveries) = Batched::new(
            Arc::clone(&api),
            Limits {
                max_retry: Duration::from_millis(50),
                ..limits()
            },
        );
        sink.send(Arc::from("s"), event("a1", "a"), 0, "a1".into(), 10)
            .await
            .unwrap();
        let d = tokio::time::timeout(Duration::from_secs(10), deliveries.recv())
            .await
            .unwrap()
            .unwrap();
        let e = d.result.unwrap_err();
        assert!(!e.is_about_the_message() && !e.is_final(), "{e:?}");
        assert!(e.reason.contains("still failing after"), "{}", e.reason);
        sink.send(Arc::from("s"), event("a2", "a"), 1, "a2".into(), 10)
            .await
            .unwrap();
        assert!(api.stored.lock().unwrap().is_empty());
    }

    /// A destination that refuses any call of more than one entry as too
    /// large as a whole, and a call of entry "huge" even alone.
    #[derive(Default)]
    struct Small {
        stored: Mutex<Vec<String>>,
    }

    impl Api for Small {
        type Entry = String;

        async fn put(
            &self,
            _dest: Arc<str>,
            entries: Vec<String>,
        ) -> Result<Vec<Answer>, CallError> {
            if entries.len() > 1 || entries[0] == "huge" {
                return Err(CallError::TooLarge("BatchRequestTooLong".into()));
            }
            self.stored.lock().unwrap().extend(entries);
            Ok(vec![Answer::Stored])
        }
    }

    #[tokio::test]
    async fn a_call_too_large_as_a_whole_is_sent_again_entry_by_entry() {
        let api = Arc::new(Small::default());
        let (mut sink, mut deliveries) = Batched::new(Arc::clone(&api), limits());
        for (token, (id, key)) in [("a1", "a"), ("b1", "b"), ("huge", "c"), ("a2", "a")]
            .iter()
            .enumerate()
        {
            sink.send(Arc::from("s"), event(id, key), token, (*id).to_owned(), 10)
                .await
                .unwrap();
        }
        sink.flush(Duration::from_secs(20)).await.unwrap();
        let mut answers = Vec::new();
        while let Ok(d) = deliveries.try_recv() {
            answers.push((d.token, d.result.map_err(|e| e.class)));
        }
        answers.sort_by_key(|(t, _)| *t);
        assert_eq!(
            answers,
            [
                (0, Ok(())),
                (1, Ok(())),
                (2, Err(DeliveryClass::MessageTooLarge)),
                (3, Ok(()))
            ]
        );
        let stored = api.stored.lock().unwrap().clone();
        let a: Vec<&String> = stored.iter().filter(|i| i.starts_with('a')).collect();
        assert_eq!(a, ["a1", "a2"]);
    }
}
