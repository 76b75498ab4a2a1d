//! What every sink does the same way, written once: a sink keeps only what
//! its destination's protocol needs.
//!
//! - [`Lifecycle`]: a session opened on the first event and ended by an
//!   abort or a drop, its connections closed ([`Close`]).
//! - [`Reports`]: the deliveries going back to the relay, counted in flight
//!   from the moment an event is handed on until it is reported; a flush
//!   that waits on that count's signal, not on a timer; and the session's
//!   tasks watched, so that a task that died fails the session instead of
//!   leaving its events unreported for ever.
//! - [`FailRest`]: after one failure of a session, every later event fails
//!   unsent, so nothing of a key lands after an earlier event that did not.
//! - [`AnswerTimer`]: when the oldest unanswered request of a window a
//!   destination works through in order has waited too long.
//! - [`rejected`]: the record as sent, without its value, for a dead letter.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use walbox_outbox::Event;

use crate::{Deliveries, Delivery, DeliveryClass, DeliveryError, RejectedRecord, SinkError};

/// The record `event` becomes, without its value: what a dead letter needs
/// of a record the destination refused for what it is.
///
/// The key and the header values are copied, compact: a sink keeps this
/// record until the event is confirmed, and the event's own bytes may be
/// slices of the buffer the WAL was read into, which a shared slice would
/// keep whole for as long. The header names are shared (mostly static).
pub(crate) fn rejected(event: &Event) -> RejectedRecord {
    RejectedRecord {
        key: event.key.as_deref().map(bytes::Bytes::copy_from_slice),
        headers: event
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), bytes::Bytes::copy_from_slice(v)))
            .collect(),
        value_len: event.value.len(),
        attempts: 1,
    }
}

/// The failure of the event `event_id` to `topic` with `class` and `reason`,
/// with `rejected` (the record as sent) when the class is about the message
/// (for its dead letter).
pub(crate) fn refused(
    event_id: String,
    topic: String,
    class: DeliveryClass,
    reason: String,
    rejected: RejectedRecord,
) -> DeliveryError {
    DeliveryError {
        event_id,
        topic,
        class,
        reason,
        rejected: class.is_about_the_message().then_some(rejected),
    }
}

/// The failure of `event` with `class` and `reason`; for a class about the
/// message, with the record as sent (for its dead letter).
pub(crate) fn failure(event: &Event, class: DeliveryClass, reason: String) -> DeliveryError {
    DeliveryError {
        event_id: event.event_id.clone(),
        topic: event.topic.clone(),
        class,
        reason,
        rejected: class.is_about_the_message().then(|| rejected(event)),
    }
}

/// Retries so far in this process, by topic (for `walbox_sink_retries`).
static RETRIES: Mutex<std::collections::BTreeMap<String, u64>> =
    Mutex::new(std::collections::BTreeMap::new());

/// A sink sends something of `topic` again after a failure.
pub(crate) fn count_retry(topic: &str) {
    let mut r = RETRIES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    *r.entry(topic.to_owned()).or_insert(0) += 1;
}

/// Sends made again after a failure so far in this process, by topic: a
/// webhook's 408, 425, 429, 5xx, timeouts and connection errors, a Pub/Sub
/// publish, a Kinesis record or SQS message throttled or failed.
#[must_use]
pub fn retries_by_topic() -> Vec<(String, u64)> {
    RETRIES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .map(|(t, n)| (t.clone(), *n))
        .collect()
}

/// Whether `event` is a dead letter (it carries the error class).
pub(crate) fn is_dead_letter(event: &Event) -> bool {
    event
        .headers
        .iter()
        .any(|(k, _)| k.as_ref() == walbox_outbox::dead_letter_header::ERROR_CLASS)
}

/// A session's connections, closed when the session ends.
pub(crate) trait Close: Send + Sized + 'static {
    /// Closes what the session holds: by default at once, by dropping it (its
    /// tasks stop, its connections close with what they still held); a
    /// protocol with a goodbye says it in the future returned.
    fn close(self) -> impl Future<Output = ()> + Send {
        drop(self);
        std::future::ready(())
    }
}

/// A sink's session: opened on the first event, ended (its connections
/// closed) by [`Lifecycle::abort`] or when the sink is dropped. After an
/// abort nothing more is sent in this sink's life: the relay starts a new
/// sink for its next session.
#[derive(Debug)]
pub(crate) struct Lifecycle<S: Close> {
    session: Option<S>,
    aborted: bool,
}

impl<S: Close> Default for Lifecycle<S> {
    fn default() -> Self {
        Lifecycle {
            session: None,
            aborted: false,
        }
    }
}

impl<S: Close> Lifecycle<S> {
    /// Whether the session was aborted: nothing more goes out.
    pub(crate) fn aborted(&self) -> bool {
        self.aborted
    }

    /// The session, if one is open.
    pub(crate) fn get(&self) -> Option<&S> {
        self.session.as_ref()
    }

    /// The session, if one is open.
    pub(crate) fn get_mut(&mut self) -> Option<&mut S> {
        self.session.as_mut()
    }

    /// The session, opened by `open` if none is.
    pub(crate) async fn open_with<F, Fut>(&mut self, open: F) -> Result<&mut S, SinkError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<S, SinkError>>,
    {
        if self.session.is_none() {
            self.session = Some(open().await?);
        }
        Ok(self.session.as_mut().expect("opened above"))
    }

    /// [`crate::Sink::flush`]: waits up to `timeout` until every event handed
    /// on is reported ([`Reports::settled`]); at once after an abort.
    pub(crate) async fn flush(
        &self,
        reports: &Reports,
        timeout: Duration,
    ) -> Result<(), SinkError> {
        if self.aborted {
            return Ok(());
        }
        reports.settled(timeout).await
    }

    /// Nothing more of this session reaches the destination: its
    /// connections close; what they still held is not reported.
    pub(crate) fn abort(&mut self) {
        self.aborted = true;
        self.end();
    }

    fn end(&mut self) {
        if let Some(session) = self.session.take() {
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => {
                    handle.spawn(session.close());
                }
                // No runtime left (the process ends): dropping closes.
                Err(_) => drop(session),
            }
        }
    }
}

impl<S: Close> Drop for Lifecycle<S> {
    fn drop(&mut self) {
        self.end();
    }
}

/// The deliveries a sink sends back to the relay, and its in-flight count.
#[derive(Debug, Clone)]
pub(crate) struct Reports {
    tx: mpsc::UnboundedSender<Delivery>,
    state: Arc<State>,
}

#[derive(Debug, Default)]
struct State {
    in_flight: AtomicUsize,
    /// Signalled when nothing is in flight any more, or a task died.
    changed: Notify,
    /// Why a task of the session died.
    died: Mutex<Option<String>>,
}

impl Reports {
    /// A sink's reports and the receiver the relay reads them from.
    pub(crate) fn new() -> (Reports, Deliveries) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            Reports {
                tx,
                state: Arc::new(State::default()),
            },
            rx,
        )
    }

    /// An event is handed on: it counts in flight until it is reported.
    pub(crate) fn sent(&self) {
        self.state.in_flight.fetch_add(1, Ordering::SeqCst);
    }

    /// An event counted by [`Reports::sent`] could not be handed on after all
    /// (its session is gone) and will never be reported.
    pub(crate) fn withdrawn(&self) {
        self.count_out();
    }

    /// Reports the outcome of the event of `token` and counts it out;
    /// `false` once the relay no longer listens.
    pub(crate) fn report(&self, token: usize, result: Result<(), DeliveryError>) -> bool {
        let listening = self.tx.send(Delivery { token, result }).is_ok();
        self.count_out();
        listening
    }

    fn count_out(&self) {
        if self.state.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.state.changed.notify_waiters();
        }
    }

    /// Events handed on and not yet reported.
    pub(crate) fn in_flight(&self) -> usize {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    /// `Err` once a task of the session died: the session must end (a new
    /// one sends again what was not acknowledged).
    pub(crate) fn check(&self) -> Result<(), SinkError> {
        match self.state.died.lock().expect("not poisoned").as_ref() {
            Some(why) => Err(SinkError::TaskDied(why.clone())),
            None => Ok(()),
        }
    }

    /// Waits up to `timeout` until nothing is in flight, woken by the last
    /// report (no polling). `Err` when a task of the session died.
    pub(crate) async fn settled(&self, timeout: Duration) -> Result<(), SinkError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.state.changed.notified();
            tokio::pin!(changed);
            // Registered before the count is read: a report in between wakes it.
            changed.as_mut().enable();
            self.check()?;
            if self.in_flight() == 0 {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.check();
            }
        }
    }

    /// Runs `task` (a writer, a confirm reporter) for the session, on
    /// `runtime`, watched: if it panics, the sink's next send or flush fails
    /// naming `what` and the panic, and a flush waiting is woken. Dropping
    /// the returned handle (the session ends) stops the task.
    pub(crate) fn spawn_on<F>(
        &self,
        runtime: &tokio::runtime::Handle,
        what: &'static str,
        task: F,
    ) -> SessionTask
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let handle = runtime.spawn(task);
        let abort = handle.abort_handle();
        let state = Arc::clone(&self.state);
        runtime.spawn(async move {
            if let Err(e) = handle.await
                && e.is_panic()
            {
                let panic = e.into_panic();
                let text = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "no message".to_owned());
                tracing::error!(task = what, "a task of the sink's session panicked");
                let mut died = state.died.lock().expect("not poisoned");
                died.get_or_insert_with(|| format!("the sink's {what} task panicked: {text}"));
                drop(died);
                state.changed.notify_waiters();
            }
        });
        SessionTask(abort)
    }

    /// [`Reports::spawn_on`] on the current runtime.
    pub(crate) fn spawn<F>(&self, what: &'static str, task: F) -> SessionTask
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.spawn_on(&tokio::runtime::Handle::current(), what, task)
    }
}

/// A task of a session; dropping it stops the task.
#[derive(Debug)]
pub(crate) struct SessionTask(tokio::task::AbortHandle);

impl Drop for SessionTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// After one failure of a session, every later event fails unsent: a later
/// event of a key must never be stored after an earlier one that was not
/// (the next session sends both again, in order).
#[derive(Debug, Default, Clone)]
pub(crate) struct FailRest(Option<(DeliveryClass, String)>);

impl FailRest {
    /// The class and reason every event now fails with, if one failed.
    pub(crate) fn get(&self) -> Option<(DeliveryClass, String)> {
        self.0.clone()
    }

    /// An event failed with `class`: the later ones fail unsent, saying why
    /// (`reason`). They are not at fault themselves: a class about the
    /// message, or a final one, becomes `broker_error` for them, so that
    /// they are neither dead-lettered nor taken for a stop. The first
    /// failure's reason is kept.
    pub(crate) fn after(&mut self, class: DeliveryClass, reason: String) {
        if self.0.is_none() {
            let later = if class.is_about_the_message() || class.is_final() {
                DeliveryClass::BrokerError
            } else {
                class
            };
            self.0 = Some((later, reason));
        }
    }
}

/// Test support: the first delivery is event 0's, failed as a timeout
/// between 200 and 300 ms after `start` (a 200 ms timeout, counted from its
/// sending, not held back by answers to later events).
#[cfg(test)]
pub(crate) async fn expect_the_oldest_timed_out(
    deliveries: &mut Deliveries,
    start: tokio::time::Instant,
) {
    let d = deliveries.recv().await.expect("the reporter is alive");
    let took = start.elapsed();
    assert_eq!(d.token, 0);
    assert_eq!(
        d.result.err().map(|e| e.class),
        Some(DeliveryClass::Timeout)
    );
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_millis(300),
        "{took:?}"
    );
}

/// The timer of a window of requests a destination works through in order
/// (a session's publications on one connection or channel): the oldest
/// request still unanswered is due `timeout` after the later of its sending
/// and the answer to the oldest one before it.
///
/// Timing it from its sending alone counts the time it waited behind the
/// rest of the window: with a full window of `n` requests and a destination
/// that answers fewer than `n` per `timeout`, every request is already
/// `timeout` old when the destination reaches it, and a slow but working
/// destination gets a false timeout, and the whole window again. The answer
/// to the request before it says the destination has reached it, so its
/// timer runs from then.
///
/// Only an answer to the oldest request waiting counts
/// ([`AnswerTimer::answered`]). Answers to later ones (a confirm of another
/// queue's message, a refusal of a publication chained to a lost one) say
/// nothing of it: counting them would let a destination that answers
/// everything but the oldest hold it, and the position, until the window is
/// full, one timeout per answer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AnswerTimer {
    timeout: Duration,
    answered: Option<tokio::time::Instant>,
}

impl AnswerTimer {
    pub(crate) fn new(timeout: Duration) -> Self {
        AnswerTimer {
            timeout,
            answered: None,
        }
    }

    /// The oldest request waiting got its answer, now.
    pub(crate) fn answered(&mut self) {
        self.answered = Some(tokio::time::Instant::now());
    }

    /// When the oldest request waiting, sent at `sent`, is due.
    pub(crate) fn due(&self, sent: tokio::time::Instant) -> tokio::time::Instant {
        self.answered.map_or(sent, |a| a.max(sent)) + self.timeout
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The front request is timed from its sending while nothing has been
    /// answered, and from the answer to the request before it once that
    /// came after it was sent.
    #[tokio::test(start_paused = true)]
    async fn the_front_request_is_timed_from_its_sending_or_the_answer_before_it_whichever_is_later()
     {
        let t = Duration::from_millis(200);
        let mut timer = AnswerTimer::new(t);
        let sent = tokio::time::Instant::now();
        assert_eq!(timer.due(sent), sent + t);
        tokio::time::advance(Duration::from_millis(150)).await;
        timer.answered();
        assert_eq!(timer.due(sent), sent + Duration::from_millis(350));
        // A request sent after the last answer is timed from its sending.
        tokio::time::advance(Duration::from_millis(50)).await;
        let later = tokio::time::Instant::now();
        assert_eq!(timer.due(later), later + t);
    }

    #[tokio::test]
    async fn a_flush_is_woken_by_the_last_report_and_a_dead_task_fails_it() {
        let (reports, mut rx) = Reports::new();
        reports.sent();
        reports.sent();
        let waiting = {
            let reports = reports.clone();
            tokio::spawn(async move { reports.settled(Duration::from_secs(30)).await })
        };
        reports.report(0, Ok(()));
        assert!(!waiting.is_finished());
        let started = std::time::Instant::now();
        reports.report(1, Ok(()));
        waiting.await.unwrap().unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(rx.recv().await.unwrap().token, 0);
        assert_eq!(rx.recv().await.unwrap().token, 1);

        // A task that panics fails the waiting flush and every later check.
        reports.sent();
        let waiting = {
            let reports = reports.clone();
            tokio::spawn(async move { reports.settled(Duration::from_secs(30)).await })
        };
        let _task = reports.spawn("writer", async { panic!("lost its connection state") });
        let e = waiting.await.unwrap().unwrap_err();
        assert!(
            e.to_string()
                .contains("writer task panicked: lost its connection state"),
            "{e}"
        );
        assert!(reports.check().is_err());
    }

    #[tokio::test]
    async fn a_dropped_session_task_stops() {
        let (reports, _rx) = Reports::new();
        let (tx, mut rx) = mpsc::unbounded_channel::<()>();
        let task = reports.spawn("reporter", async move {
            let _tx = tx;
            std::future::pending::<()>().await;
        });
        drop(task);
        // The task's sender is dropped with it.
        assert!(rx.recv().await.is_none());
        assert!(reports.check().is_ok());
    }

    #[test]
    fn the_rest_fail_with_the_first_reason_and_never_as_the_messages_fault() {
        let mut rest = FailRest::default();
        assert!(rest.get().is_none());
        rest.after(DeliveryClass::MessageTooLarge, "first".into());
        rest.after(DeliveryClass::Timeout, "second".into());
        assert_eq!(
            rest.get(),
            Some((DeliveryClass::BrokerError, "first".into()))
        );
        let mut rest = FailRest::default();
        rest.after(DeliveryClass::Timeout, "t".into());
        assert_eq!(rest.get().unwrap().0, DeliveryClass::Timeout);
    }
}
