//! The confirm reporter of exchange mode: it starts each publication in
//! publish order and reports the events in that order as the broker's
//! confirms (and returns) come, failing what follows a failure unsent.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use tokio::time::Instant;

use lapin::Confirmation;
use lapin::message::BasicReturnMessage;
use tokio::sync::mpsc;

use super::super::confirms::{Answer, Confirms, Outcome, Returned};
use crate::kit::{self, AnswerTimer, FailRest, Reports};
use crate::{DeliveryClass, RejectedRecord};

/// What one publication came to: the broker's answer, and the messages it
/// sent back that lapin handed over with it (each with its `message_id`),
/// whichever publication they belong to.
pub(super) struct Confirmed {
    answer: Answer,
    returns: Vec<(Option<String>, Returned)>,
}

impl Confirmed {
    pub(super) fn failed(class: DeliveryClass, reason: String) -> Self {
        Confirmed {
            answer: Answer::Failed(class, reason),
            returns: Vec::new(),
        }
    }
}

/// A publication not yet started: `basic.publish` and then its confirm. The
/// reporter starts it (its first poll writes nothing yet but registers the
/// publication with lapin and queues its frames), so that it knows of every
/// publication before the broker can answer it.
pub(super) type Publish = Pin<Box<dyn Future<Output = Confirmed> + Send>>;

/// A publication to start, and the flag it sets once its frames are written.
pub(super) struct Start {
    pub(super) publish: Publish,
    pub(super) written: Arc<AtomicBool>,
}

/// One publication on its way to the reporter.
pub(super) struct Published {
    pub(super) token: usize,
    pub(super) event_id: String,
    pub(super) topic: String,
    /// The publication, unless the event failed before it (`answer`).
    pub(super) publish: Option<Start>,
    pub(super) answer: Option<Answer>,
    pub(super) rejected: RejectedRecord,
}

/// What a report needs besides the answer.
struct Item {
    token: usize,
    event_id: String,
    topic: String,
    /// The publication, until it has its answer.
    publish: Option<Start>,
    /// When it was started (its frames queued with lapin), and whether it
    /// is counted among the unwritten until its frames are.
    started: Option<Instant>,
    unwritten: bool,
    /// Wakes the reporter naming this publication.
    waker: Waker,
    rejected: RejectedRecord,
}

/// The publications whose futures woke since the reporter last looked (by
/// sequence number, in the order they woke), and the reporter's waker.
#[derive(Default)]
struct Woken(Mutex<(Vec<u64>, Option<Waker>)>);

impl Woken {
    fn lock(&self) -> std::sync::MutexGuard<'_, (Vec<u64>, Option<Waker>)> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The reporter is about to wait: wake `waker`.
    fn register(&self, waker: &Waker) {
        let mut g = self.lock();
        if !g.1.as_ref().is_some_and(|w| w.will_wake(waker)) {
            g.1 = Some(waker.clone());
        }
    }

    /// Moves the woken sequence numbers into `into`.
    fn take(&self, into: &mut Vec<u64>) {
        into.append(&mut self.lock().0);
    }
}

/// The waker of one publication: records its sequence number and wakes the
/// reporter. lapin resolves every promise from its one I/O loop, so the
/// order of these records is the order the promises were resolved in.
struct Wakes {
    seq: u64,
    woken: Arc<Woken>,
}

impl Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let mut g = self.woken.lock();
        g.0.push(self.seq);
        if let Some(w) = &g.1 {
            w.wake_by_ref();
        }
    }
}

/// What lapin's confirm says, with the messages it handed over.
pub(super) fn confirmed(r: Result<Confirmation, lapin::Error>) -> Confirmed {
    let (answer, returned) = match r {
        Ok(Confirmation::Ack(ret)) => (Answer::Ack, ret),
        Ok(Confirmation::Nack(ret)) => (Answer::Nack, ret),
        Ok(Confirmation::NotRequested) => (
            Answer::Failed(
                DeliveryClass::BrokerError,
                "the channel is not in confirm mode".into(),
            ),
            None,
        ),
        Err(e) => (
            Answer::Failed(
                DeliveryClass::BrokerError,
                format!("no confirm: the channel or connection failed ({e})"),
            ),
            None,
        ),
    };
    let returns = returned
        .into_iter()
        .map(|r: BasicReturnMessage| {
            (
                r.delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|m| m.to_string()),
                Returned {
                    code: r.reply_code,
                    text: r.reply_text.to_string(),
                    exchange: r.delivery.exchange.to_string(),
                    routing_key: r.delivery.routing_key.to_string(),
                },
            )
        })
        .collect();
    Confirmed { answer, returns }
}

/// Publications started whose frames are not yet written, at most: the rest
/// wait unstarted, so that a broker slower than the WAL holds few frames in
/// lapin's queue (each a copy of its message), not `max_in_flight` of them.
const MAX_UNWRITTEN: usize = 256;

/// Starts each publication and reports them in publish order as their
/// confirms come.
///
/// lapin hands each returned message to the next confirm it resolves, which
/// may be another publication's (see [`super::super::confirms`]): when one ack
/// (`multiple`) resolves a batch, it walks the batch in its `HashMap`'s order
/// and the first confirms it resolves take the returns waiting, oldest first.
/// The return of a publication P is the i-th waiting, where i - 1 returns
/// of publications before P wait with it; every one of those i publications
/// is in the batch, so the last of them (or P) that lapin resolves is resolved
/// at or after the confirm carrying P's return. An entry is reported only when
/// it and every entry before it are answered, so it is enough that whatever
/// round sees a confirm resolved has seen every one resolved before it.
///
/// That holds without polling every awaited confirm at each wake:
/// - the reporter starts every publication itself (in publish order, with at
///   most [`MAX_UNWRITTEN`] started and not yet written), so none can be
///   answered before it is known here;
/// - each publication has its own waker ([`Wakes`]), which lapin calls once
///   the promise's outcome is set, and lapin resolves a publication's write
///   before its confirm (the ack comes after the frames are written), so a
///   confirm not yet armed belongs to a publication whose write woke it;
/// - each round takes the woken list and polls what it names, again and
///   again until a take finds it empty, and only then reports: a confirm
///   resolved before anything the round saw woke before that last take.
///
/// After a publication fails (a failed write, a nack, a return, a lost
/// channel, a timeout), nothing later that is not yet started is published:
/// it fails unsent ([`FailRest`]). A timeout fails every entry not reported,
/// answered or not: a return for one of them may ride on a confirm not yet
/// seen.
pub(super) async fn report(
    mut rx: mpsc::UnboundedReceiver<Published>,
    reports: Reports,
    timeout: Duration,
) {
    let mut confirms: Confirms<Item> = Confirms::default();
    let woken = Arc::new(Woken::default());
    let mut due: Vec<u64> = Vec::new();
    let mut unsent = FailRest::default();
    // The sequence number of the next publication, of the oldest one
    // awaiting its report, and of the first not started; how many started
    // are unwritten.
    let mut next: u64 = 0;
    let mut front: u64 = 0;
    let mut started: u64 = 0;
    let mut unwritten: usize = 0;
    let mut closed = false;
    let mut timer = AnswerTimer::new(timeout);
    loop {
        if closed && confirms.len() == 0 {
            return;
        }
        // The oldest publication waiting, timed from its start or the last
        // confirm of the oldest one before it, whichever is later (not yet
        // started: from now).
        let deadline = confirms
            .first_waiting()
            .map(|(_, e)| timer.due(e.item.started.unwrap_or_else(Instant::now)));
        let sleep = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now));
        let progressed = std::future::poll_fn(|cx| {
            woken.register(cx.waker());
            let mut progressed = false;
            while !closed {
                match rx.poll_recv(cx) {
                    Poll::Ready(Some(p)) => {
                        let seq = next;
                        next += 1;
                        let item = Item {
                            token: p.token,
                            event_id: p.event_id.clone(),
                            topic: p.topic,
                            publish: if p.answer.is_none() { p.publish } else { None },
                            started: None,
                            unwritten: false,
                            waker: Waker::from(Arc::new(Wakes {
                                seq,
                                woken: woken.clone(),
                            })),
                            rejected: p.rejected,
                        };
                        confirms.push(item, p.event_id, p.answer);
                        progressed = true;
                    }
                    Poll::Ready(None) => {
                        closed = true;
                        progressed = true;
                    }
                    Poll::Pending => break,
                }
            }
            // Start publications, in order, while few are unwritten.
            started = started.max(front);
            while unwritten < MAX_UNWRITTEN && started < next {
                let Some(e) = confirms.get_mut((started - front) as usize) else {
                    break;
                };
                started += 1;
                if e.answer.is_some() {
                    continue;
                }
                progressed = true;
                if let Some((class, reason)) = unsent.get() {
                    e.item.publish = None;
                    e.answer = Some(Answer::Failed(class, reason));
                    continue;
                }
                e.item.started = Some(Instant::now());
                e.item.unwritten = true;
                unwritten += 1;
                if let Some(c) = advance(&mut e.item, &mut unwritten)
                    && record(&mut confirms, front, started - 1, c, &mut unsent)
                {
                    timer.answered();
                }
            }
            // What woke, until nothing more has.
            loop {
                woken.take(&mut due);
                if due.is_empty() {
                    break;
                }
                for seq in due.drain(..) {
                    let Some(e) = seq
                        .checked_sub(front)
                        .and_then(|i| confirms.get_mut(i as usize))
                    else {
                        continue;
                    };
                    if e.answer.is_some() || e.item.started.is_none() {
                        continue;
                    }
                    if let Some(c) = advance(&mut e.item, &mut unwritten) {
                        if record(&mut confirms, front, seq, c, &mut unsent) {
                            timer.answered();
                        }
                        progressed = true;
                    }
                }
            }
            if progressed {
                Poll::Ready(true)
            } else {
                Poll::Pending
            }
        });
        let progressed = tokio::select! {
            biased;
            p = progressed => p,
            () = sleep, if deadline.is_some() => false,
        };
        // Due: the timer fired, or a round that made progress (a steady flow
        // of events and later confirms) found the oldest publication overdue.
        let overdue = !progressed
            || confirms.first_waiting().is_some_and(|(_, e)| {
                e.item
                    .started
                    .is_some_and(|started| timer.due(started) <= Instant::now())
            });
        if overdue && confirms.front_waiting() {
            let reason = format!("no publisher confirm within {} ms", timeout.as_millis());
            unsent.after(
                DeliveryClass::Timeout,
                format!(
                    "not sent: an earlier event of this session got {reason}; walbox \
                     publishes again from its acknowledged position"
                ),
            );
            for e in confirms.entries() {
                if e.item.unwritten {
                    e.item.unwritten = false;
                    unwritten -= 1;
                }
                e.item.publish = None;
                if matches!(e.answer, None | Some(Answer::Ack)) {
                    e.answer = Some(Answer::Failed(DeliveryClass::Timeout, reason.clone()));
                }
            }
        }
        let ready = confirms.ready();
        front += ready.len() as u64;
        for (item, outcome) in ready {
            let result = match outcome {
                Outcome::Stored => Ok(()),
                Outcome::Failed(class, reason) => Err(kit::refused(
                    item.event_id,
                    item.topic,
                    class,
                    reason,
                    item.rejected,
                )),
            };
            reports.report(item.token, result);
        }
    }
}

/// Polls a started publication with its own waker; what it came to, once
/// it has. `unwritten` counts the started publications whose frames are not
/// yet written: one written is taken off.
fn advance(item: &mut Item, unwritten: &mut usize) -> Option<Confirmed> {
    let start = item.publish.as_mut()?;
    let mut cx = Context::from_waker(&item.waker);
    let r = start.publish.as_mut().poll(&mut cx);
    if item.unwritten && (r.is_ready() || start.written.load(Ordering::Acquire)) {
        item.unwritten = false;
        *unwritten -= 1;
    }
    let Poll::Ready(c) = r else {
        return None;
    };
    item.publish = None;
    Some(c)
}

/// Records what publication `seq` came to: its answer, and the returns it
/// carried (each for the publication it names). A failure of any kind, or a
/// return, leaves every later publication not yet started unsent. Whether
/// the broker answered the oldest publication waiting (a confirm or a nack,
/// not a failure of the channel): the broker has reached it.
fn record(
    confirms: &mut Confirms<Item>,
    front: u64,
    seq: u64,
    c: Confirmed,
    unsent: &mut FailRest,
) -> bool {
    for (id, r) in c.returns {
        tracing::warn!(
            event_id = id.as_deref().unwrap_or("(none)"),
            exchange = r.exchange.as_str(),
            routing_key = r.routing_key.as_str(),
            code = r.code,
            "the broker returned a message: no queue took it"
        );
        unsent.after(
            DeliveryClass::BrokerError,
            format!(
                "not sent: event {} of this session came back unroutable; walbox publishes \
                 again from its acknowledged position",
                id.as_deref().unwrap_or("(none)")
            ),
        );
        confirms.returned(id, r);
    }
    let Some(i) = seq.checked_sub(front).map(|i| i as usize) else {
        return false;
    };
    let Some(e) = confirms.get_mut(i) else {
        return false;
    };
    match &c.answer {
        Answer::Ack => {}
        Answer::Nack => unsent.after(
            DeliveryClass::BrokerError,
            format!(
                "not sent: event {} of this session was refused (basic.nack); walbox \
                 publishes again from its acknowledged position",
                e.item.event_id
            ),
        ),
        Answer::Failed(class, reason) => unsent.after(
            *class,
            format!(
                "not sent: event {} of this session failed ({reason}); walbox publishes \
                 again from its acknowledged position",
                e.item.event_id
            ),
        ),
    }
    let from_the_broker = matches!(c.answer, Answer::Ack | Answer::Nack);
    confirms.answer(i, c.answer) && from_the_broker
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A publication handed to the reporter, whose outcome is `publish`.
    fn published(token: usize, id: &str, publish: Publish, written: bool) -> Published {
        Published {
            token,
            event_id: id.into(),
            topic: "outbox.order".into(),
            publish: Some(Start {
                publish,
                written: Arc::new(AtomicBool::new(written)),
            }),
            answer: None,
            rejected: kit::rejected(&super::super::tests::event(vec![])),
        }
    }

    /// A publication that must never be started: it panics if polled.
    fn never_started() -> Publish {
        Box::pin(async { panic!("started after the session failed") })
    }

    fn ack() -> Confirmed {
        Confirmed {
            answer: Answer::Ack,
            returns: Vec::new(),
        }
    }

    fn no_route(id: &str) -> (Option<String>, Returned) {
        (
            Some(id.into()),
            Returned {
                code: 312,
                text: "NO_ROUTE".into(),
                exchange: "outbox".into(),
                routing_key: "outbox.order".into(),
            },
        )
    }

    /// Each delivery's class (`None`: stored) and reason, by token.
    async fn outcomes(
        deliveries: &mut crate::Deliveries,
        n: usize,
    ) -> Vec<Option<(DeliveryClass, String)>> {
        let mut out = vec![None; n];
        let mut seen = 0;
        while seen < n {
            let d = tokio::time::timeout(Duration::from_secs(10), deliveries.recv())
                .await
                .expect("a delivery in time")
                .expect("the reporter is alive");
            out[d.token] = d.result.err().map(|e| (e.class, e.reason));
            seen += 1;
        }
        out
    }

    /// lapin resolves W's confirm (an ack without the return) after V's,
    /// which carries W's return, and V's waker fires while the round that
    /// polls W is under way: W is reported only once V is seen, so it fails
    /// as returned, never as stored.
    #[tokio::test]
    async fn a_return_carried_by_a_confirm_that_wakes_mid_round_fails_its_own_event() {
        let (reports, mut deliveries) = Reports::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(report(rx, reports.clone(), Duration::from_secs(30)));
        let (w_tx, w_rx) = tokio::sync::oneshot::channel::<Confirmed>();
        let (v_tx, v_rx) = tokio::sync::oneshot::channel::<Confirmed>();
        let w = Box::pin(async move {
            let c = w_rx.await.expect("answered");
            // lapin's I/O loop resolves V (carrying W's return) as W's own
            // confirm comes out: V's waker fires after this round's take.
            let _ = v_tx.send(Confirmed {
                answer: Answer::Ack,
                returns: vec![no_route("w")],
            });
            c
        });
        let v = Box::pin(async move { v_rx.await.expect("answered") });
        reports.sent();
        tx.send(published(0, "w", w, true)).unwrap();
        reports.sent();
        tx.send(published(1, "v", v, true)).unwrap();
        // Both are started (and wait) before W is answered.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        w_tx.send(ack()).ok().expect("W waits");
        let got = outcomes(&mut deliveries, 2).await;
        assert_eq!(
            got[0].as_ref().map(|o| o.0),
            Some(DeliveryClass::UnknownTopic),
            "{got:?}"
        );
        assert_eq!(got[1], None, "{got:?}");
        drop(tx);
        task.await.unwrap();
    }

    /// A broker that confirms one publication per 100 ms works through a
    /// window of 20 under a confirm timeout of 200 ms: each publication
    /// waits longer than the timeout in all, but never more than 100 ms
    /// after the confirm before it, so none of the first 15 times out. The
    /// last 5 are never confirmed: they time out 200 ms after the last
    /// confirm.
    #[tokio::test(start_paused = true)]
    async fn a_broker_slower_than_the_window_but_answering_gets_no_timeout() {
        let (reports, mut deliveries) = Reports::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(report(rx, reports.clone(), Duration::from_millis(200)));
        let start = Instant::now();
        let (n, answered) = (20, 15);
        for i in 0..n {
            reports.sent();
            let at = start + Duration::from_millis(100) * (i as u32 + 1);
            let publish: Publish = if i < answered {
                Box::pin(async move {
                    tokio::time::sleep_until(at).await;
                    ack()
                })
            } else {
                Box::pin(std::future::pending())
            };
            tx.send(published(i, &format!("e{i}"), publish, true))
                .unwrap();
        }
        let got = outcomes(&mut deliveries, n).await;
        assert!(got[..answered].iter().all(Option::is_none), "{got:?}");
        assert!(
            got[answered..]
                .iter()
                .all(|o| o.as_ref().is_some_and(|o| o.0 == DeliveryClass::Timeout)),
            "{got:?}"
        );
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(1700) && took < Duration::from_millis(1800),
            "{took:?}"
        );
        drop(tx);
        task.await.unwrap();
    }

    /// The oldest publication is never confirmed (its queue lost its
    /// quorum) while a slow source hands over one event every 150 ms that
    /// other queues confirm at once, out of order. Those confirms say
    /// nothing of the oldest one: it times out 200 ms after its start, not
    /// when the window is full.
    #[tokio::test(start_paused = true)]
    async fn confirms_of_later_publications_do_not_hold_back_the_oldest_ones_timeout() {
        let (reports, mut deliveries) = Reports::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(report(rx, reports.clone(), Duration::from_millis(200)));
        let start = Instant::now();
        let source = {
            let reports = reports.clone();
            tokio::spawn(async move {
                for i in 0..40 {
                    reports.sent();
                    let publish: Publish = if i == 0 {
                        Box::pin(std::future::pending())
                    } else {
                        Box::pin(async { ack() })
                    };
                    let _ = tx.send(published(i, &format!("e{i}"), publish, true));
                    tokio::time::sleep(Duration::from_millis(150)).await;
                }
            })
        };
        kit::expect_the_oldest_timed_out(&mut deliveries, start).await;
        source.abort();
        task.abort();
    }

    /// A timeout fails every publication not reported, and what is sent
    /// after it fails unsent at once: none is left waiting for a start that
    /// would never come.
    #[tokio::test]
    async fn after_a_timeout_later_publications_fail_unsent_and_none_is_started() {
        let (reports, mut deliveries) = Reports::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(report(rx, reports.clone(), Duration::from_millis(50)));
        let n = MAX_UNWRITTEN + 44;
        for i in 0..n {
            reports.sent();
            let never = Box::pin(std::future::pending::<Confirmed>());
            tx.send(published(i, &format!("e{i}"), never, false))
                .unwrap();
        }
        let got = outcomes(&mut deliveries, n).await;
        assert!(
            got.iter()
                .all(|o| o.as_ref().is_some_and(|o| o.0 == DeliveryClass::Timeout)),
            "{got:?}"
        );
        // A publication after the timeout is never started (its future
        // panics if polled) and fails at once, saying why.
        reports.sent();
        tx.send(published(0, "late", never_started(), false))
            .unwrap();
        let late = tokio::time::timeout(Duration::from_millis(40), deliveries.recv())
            .await
            .expect("failed before a timeout of its own")
            .expect("the reporter is alive");
        let reason = late.result.unwrap_err().reason;
        assert!(reason.contains("not sent"), "{reason}");
        drop(tx);
        task.await.unwrap();
    }

    /// A nack stops the session: a publication handed over after it is never
    /// started and fails unsent, so nothing of a key lands after an earlier
    /// event that did not.
    #[tokio::test]
    async fn after_a_nack_a_publication_not_yet_started_fails_unsent() {
        let (reports, mut deliveries) = Reports::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(report(rx, reports.clone(), Duration::from_secs(30)));
        reports.sent();
        let nacked = Box::pin(async {
            Confirmed {
                answer: Answer::Nack,
                returns: Vec::new(),
            }
        });
        tx.send(published(0, "a", nacked, true)).unwrap();
        let got = outcomes(&mut deliveries, 1).await;
        assert_eq!(
            got[0].as_ref().map(|o| o.0),
            Some(DeliveryClass::BrokerError)
        );
        reports.sent();
        tx.send(published(1, "b", never_started(), false)).unwrap();
        let d = tokio::time::timeout(Duration::from_secs(10), deliveries.recv())
            .await
            .expect("a delivery in time")
            .expect("the reporter is alive");
        assert_eq!(d.token, 1);
        let reason = d.result.unwrap_err().reason;
        assert!(reason.contains("not sent: event a"), "{reason}");
        drop(tx);
        task.await.unwrap();
    }
}
