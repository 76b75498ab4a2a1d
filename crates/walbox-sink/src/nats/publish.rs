//! The outcome of each publication. Events are published on the session's
//! core NATS connection, each with a reply subject of walbox's own: the
//! session's reply prefix followed by the publication's sequence number in
//! the session (`_INBOX.<id>.17`). One subscription to the prefix receives
//! every PubAck, and the [`Window`] of publications awaiting theirs finds each
//! one's entry by that number. Outcomes are reported in publishing order: a
//! PubAck checked (a duplicate compared with the stored message), a failure
//! classified, an answer that does not come within the PubAck timeout taken
//! as unknown ([`PublishErrorKind::TimedOut`]: the relay publishes the event
//! again under the same `Nats-Msg-Id`, which the stream's duplicate window
//! covers).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::{
    self, ErrorCode,
    context::{PublishError, PublishErrorKind},
    publish::PublishAck,
};
use futures_util::{FutureExt, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use walbox_outbox::Event;

use super::duplicate::{self, Sent};
use crate::DeliveryClass;
use crate::kit::{AnswerTimer, Reports};

/// One event handed to the session, in publishing order.
pub(super) struct Pending {
    pub(super) token: usize,
    /// Its number in the session: the last token of its reply subject.
    pub(super) seq: u64,
    pub(super) event: Event,
    pub(super) subject: String,
    pub(super) state: State,
    /// What a duplicate's check compares, when it was published.
    pub(super) published: Option<Published>,
    /// A probe's sender waits for its verdict.
    pub(super) probe: Option<oneshot::Sender<Probed>>,
}

/// What was published for an event, besides the event itself.
pub(super) struct Published {
    /// The text of the key header.
    pub(super) key: Option<String>,
}

pub(super) enum State {
    /// Published; its PubAck awaited.
    Waiting,
    /// Its PubAck came, or its wait ended.
    Answered(Answer),
    /// Not published, or refused before it was sent.
    Failed(DeliveryClass, String),
}

/// What the server answered to a publication.
pub(super) enum Answer {
    Stored,
    Duplicate(PublishAck),
    Refused(PublishError),
}

/// The verdict on a probe's publication.
pub(super) enum Probed {
    /// Stored: the chain goes on from it.
    Stored,
    /// Dropped as a duplicate of the same event.
    Duplicate,
    Failed(DeliveryClass, String),
}

/// The class and reason of a publication the server refused or did not
/// acknowledge; `after_duplicate`: the one before it was dropped as a
/// duplicate.
pub(super) fn failure(e: &PublishError, after_duplicate: bool) -> (DeliveryClass, String) {
    let text = match std::error::Error::source(e) {
        Some(s) => format!("{e}: {s}"),
        None => e.to_string(),
    };
    let text = match e.kind() {
        PublishErrorKind::WrongLastMessageId if after_duplicate => {
            format!("{text}: {AFTER_DUPLICATE}")
        }
        PublishErrorKind::WrongLastMessageId => format!("{text}: {NOT_CHAINED}"),
        _ => text,
    };
    (classify(e.kind(), &text), text)
}

/// The class of a failed publication.
pub(super) fn classify(kind: PublishErrorKind, text: &str) -> DeliveryClass {
    match kind {
        PublishErrorKind::MaxPayloadExceeded => DeliveryClass::MessageTooLarge,
        PublishErrorKind::TimedOut => DeliveryClass::Timeout,
        PublishErrorKind::StreamNotFound => DeliveryClass::UnknownTopic,
        _ if text.contains("message size exceeds maximum") => DeliveryClass::MessageTooLarge,
        _ if text.contains("ermission") || text.contains("authorization") => {
            DeliveryClass::Authorization
        }
        _ => DeliveryClass::BrokerError,
    }
}

/// A publication the client did not take (its queue full for the whole
/// PubAck timeout, the connection closed, the message over the server's
/// `max_payload`): never sent.
pub(super) fn unsent(e: Result<async_nats::client::PublishError, ()>) -> PublishError {
    use async_nats::client::PublishErrorKind as K;
    match e {
        Err(()) => PublishError::new(PublishErrorKind::TimedOut),
        Ok(e) => match e.kind() {
            K::MaxPayloadExceeded => {
                PublishError::with_source(PublishErrorKind::MaxPayloadExceeded, e)
            }
            _ => PublishError::with_source(PublishErrorKind::Other, e),
        },
    }
}

/// Why a chained publication was refused, and what walbox does about it.
const NOT_CHAINED: &str = "the stream's last message is not the one walbox published before \
     this one: another publisher wrote to the stream (walbox must be its only publisher), or \
     an earlier publication was lost; walbox publishes again from its acknowledged position";

/// Why a chained publication was refused right after one the stream dropped
/// as a duplicate: the stream's last message is not that one.
const AFTER_DUPLICATE: &str = "the publication before it was dropped by the stream as a \
     duplicate of a copy stored earlier, and the stream's last message is one stored since \
     (a replay or dead-letter replay between two sessions); walbox publishes again from its \
     acknowledged position";

/// A PubAck as the server sends it, read without copying: the stream and
/// sequence of a stored message, or the error of a refused one.
#[derive(serde::Deserialize)]
struct Reply<'a> {
    #[serde(default, borrow)]
    stream: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    seq: Option<u64>,
    #[serde(default)]
    duplicate: bool,
    #[serde(default)]
    error: Option<jetstream::Error>,
}

/// What a reply to a publication says, as async-nats's own publish reads it:
/// no responders (503) is no stream for the subject, a JetStream error its
/// kind, anything else unreadable.
pub(super) fn answer(m: &async_nats::Message) -> Answer {
    if m.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
        return Answer::Refused(PublishError::new(PublishErrorKind::StreamNotFound));
    }
    let reply: Reply<'_> = match serde_json::from_slice(&m.payload) {
        Ok(r) => r,
        Err(e) => return Answer::Refused(PublishError::with_source(PublishErrorKind::Other, e)),
    };
    match reply {
        Reply {
            error: Some(error), ..
        } => Answer::Refused(match error.error_code() {
            ErrorCode::STREAM_WRONG_LAST_MESSAGE_ID => {
                PublishError::with_source(PublishErrorKind::WrongLastMessageId, error)
            }
            ErrorCode::STREAM_WRONG_LAST_SEQUENCE => {
                PublishError::with_source(PublishErrorKind::WrongLastSequence, error)
            }
            _ => PublishError::with_source(PublishErrorKind::Other, error),
        }),
        Reply {
            stream: Some(_),
            seq: Some(_),
            duplicate: false,
            ..
        } => Answer::Stored,
        Reply {
            stream: Some(_),
            seq: Some(_),
            duplicate: true,
            ..
        } => match serde_json::from_slice::<PublishAck>(&m.payload) {
            Ok(ack) => Answer::Duplicate(ack),
            Err(e) => Answer::Refused(PublishError::with_source(PublishErrorKind::Other, e)),
        },
        _ => Answer::Refused(PublishError::with_source(
            PublishErrorKind::Other,
            "a PubAck without its stream and sequence",
        )),
    }
}

/// The sequence number a reply subject carries after `prefix`.
fn seq_of(subject: &str, prefix: &str) -> Option<u64> {
    subject.strip_prefix(prefix)?.parse().ok()
}

/// The publications of a session awaiting their outcome, in publishing order,
/// each with when it was handed over; entry `i` is publication `base + i`.
struct Window {
    entries: VecDeque<(Pending, Instant)>,
    base: u64,
    /// Answers that came before their publication reached the window.
    early: HashMap<u64, Answer>,
    /// No entry before this place from the front waits.
    waiting: usize,
}

impl Window {
    fn push(&mut self, mut p: Pending, sent: Instant) {
        debug_assert_eq!(p.seq, self.base + self.entries.len() as u64);
        if let Some(a) = self.early.remove(&p.seq) {
            p.state = State::Answered(a);
        }
        self.entries.push_back((p, sent));
    }

    /// The place from the front of the oldest publication waiting.
    fn first_waiting(&mut self) -> usize {
        while self
            .entries
            .get(self.waiting)
            .is_some_and(|(p, _)| !matches!(p.state, State::Waiting))
        {
            self.waiting += 1;
        }
        self.waiting
    }

    /// Records the reply to publication `seq`; whether it answered the
    /// oldest publication waiting (the stream has reached it).
    fn answer(&mut self, seq: u64, a: Answer) -> bool {
        let Some(i) = seq.checked_sub(self.base) else {
            // Settled already (its wait ended): a late answer.
            return false;
        };
        let first = self.first_waiting();
        match usize::try_from(i)
            .ok()
            .and_then(|i| self.entries.get_mut(i))
        {
            Some((p, _)) => {
                if matches!(p.state, State::Waiting) {
                    p.state = State::Answered(a);
                    return first as u64 == i;
                }
                false
            }
            None => {
                // The first reply wins, as for one that waits.
                self.early.entry(seq).or_insert(a);
                false
            }
        }
    }

    /// The first entry, when its outcome is known.
    fn settled(&mut self) -> Option<Pending> {
        if matches!(self.entries.front(), Some((p, _)) if !matches!(p.state, State::Waiting)) {
            self.base += 1;
            self.waiting = self.waiting.saturating_sub(1);
            return self.entries.pop_front().map(|(p, _)| p);
        }
        None
    }
}

/// Receives the session's PubAcks on `replies` (the subscription to
/// `prefix`*), matches them with the publications handed over on `rx`, and
/// reports outcomes in publishing order; counts the duplicates delivered.
///
/// The first publication waiting is timed from its hand-over or the PubAck
/// of the one before it, whichever is later ([`AnswerTimer`]): a stream
/// stores a session's publications in order, so one waiting behind a full
/// window is not late while they still come in turn. Replies to later
/// publications (refusals of ones chained to a lost one) do not count.
pub(super) async fn report(
    js: jetstream::Context,
    mut replies: impl futures_util::Stream<Item = async_nats::Message> + Unpin,
    prefix: String,
    ack_timeout: Duration,
    mut rx: mpsc::UnboundedReceiver<Pending>,
    reports: Reports,
    duplicates: Arc<AtomicU64>,
) {
    let mut window = Window {
        entries: VecDeque::new(),
        base: 0,
        early: HashMap::new(),
        waiting: 0,
    };
    // Whether the previous publication was dropped as a duplicate.
    let mut after_duplicate = false;
    let mut handed_over = true;
    let mut subscribed = true;
    let mut answers = AnswerTimer::new(ack_timeout);
    // Fires at or before the first waiting publication's deadline (a
    // deadline only grows: a later publication at the front, or a later
    // PubAck; so it is re-armed only when it fires).
    let timer = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(timer);
    let mut armed = false;
    loop {
        while let Some(p) = window.settled() {
            settle(&js, p, &mut after_duplicate, &reports, &duplicates).await;
        }
        if !handed_over && window.entries.is_empty() {
            return;
        }
        if !armed && let Some((_, sent)) = window.entries.front() {
            timer.as_mut().reset(answers.due(*sent));
            armed = true;
        }
        tokio::select! {
            biased;
            // First: a steady flow of replies and hand-overs must not keep
            // the oldest publication's timeout from being seen.
            () = &mut timer, if armed => {
                armed = false;
                let now = Instant::now();
                if let Some((p, sent)) = window.entries.front_mut()
                    && answers.due(*sent) <= now
                    && matches!(p.state, State::Waiting)
                {
                    p.state = State::Answered(Answer::Refused(PublishError::new(
                        PublishErrorKind::TimedOut,
                    )));
                }
            }
            m = replies.next(), if subscribed => {
                let mut next = Some(m);
                while let Some(m) = next {
                    match m {
                        Some(m) => {
                            // Only an answer to the oldest publication
                            // waiting says the stream reached it (a refusal
                            // of a later one does not).
                            if let Some(seq) = seq_of(m.subject.as_str(), &prefix)
                                && window.answer(seq, answer(&m))
                            {
                                answers.answered();
                            }
                        }
                        None => {
                            // The client closed: nothing more is answered.
                            subscribed = false;
                            for (p, _) in &mut window.entries {
                                if matches!(p.state, State::Waiting) {
                                    p.state = State::Answered(Answer::Refused(
                                        PublishError::new(PublishErrorKind::BrokenPipe),
                                    ));
                                }
                            }
                            break;
                        }
                    }
                    next = replies.next().now_or_never();
                }
            }
            p = rx.recv(), if handed_over => {
                let sent = Instant::now();
                let mut next = p;
                loop {
                    match next {
                        Some(mut p) => {
                            if !subscribed && matches!(p.state, State::Waiting) {
                                p.state = State::Answered(Answer::Refused(PublishError::new(
                                    PublishErrorKind::BrokenPipe,
                                )));
                            }
                            window.push(p, sent);
                        }
                        None => {
                            handed_over = false;
                            break;
                        }
                    }
                    match rx.try_recv() {
                        Ok(p) => next = Some(p),
                        Err(mpsc::error::TryRecvError::Empty) => break,
                        Err(mpsc::error::TryRecvError::Disconnected) => next = None,
                    }
                }
            }
        }
    }
}

/// Reports the outcome of `p`, the first publication not reported yet; a
/// duplicate is compared with the stored message first.
async fn settle(
    js: &jetstream::Context,
    p: Pending,
    after_duplicate: &mut bool,
    reports: &Reports,
    duplicates: &AtomicU64,
) {
    let was_duplicate = std::mem::take(after_duplicate);
    let probe = p.probe.is_some();
    let (failed, probed) = match p.state {
        State::Answered(Answer::Stored) => (None, Probed::Stored),
        State::Answered(Answer::Duplicate(ack)) => {
            let msg_id = super::publication_id(
                super::headers::msg_id(&p.event),
                p.event.origin.replay_name().as_deref(),
            );
            let key = p.published.as_ref().and_then(|pb| pb.key.clone());
            let sent = Sent::of_event(&p.subject, &msg_id, key, &p.event);
            match duplicate::check(js, &ack, &p.event.event_id, &sent).await {
                Ok(()) => {
                    duplicates.fetch_add(1, Ordering::SeqCst);
                    // A probe's duplicate is followed by a publication
                    // without an expectation.
                    *after_duplicate = !probe;
                    (None, Probed::Duplicate)
                }
                Err(e) => (Some(e.clone()), Probed::Failed(e.0, e.1)),
            }
        }
        State::Answered(Answer::Refused(e)) => {
            let (class, reason) = failure(&e, was_duplicate && !probe);
            (Some((class, reason.clone())), Probed::Failed(class, reason))
        }
        State::Failed(class, reason) => {
            (Some((class, reason.clone())), Probed::Failed(class, reason))
        }
        // Not reached (only answered entries are settled): as unanswered.
        State::Waiting => {
            let (class, reason) = failure(&PublishError::new(PublishErrorKind::TimedOut), false);
            (Some((class, reason.clone())), Probed::Failed(class, reason))
        }
    };
    let result = match failed {
        None => Ok(()),
        Some((class, reason)) => Err(crate::kit::refused(
            p.event.event_id.clone(),
            p.subject,
            class,
            reason,
            crate::kit::rejected(&p.event),
        )),
    };
    reports.report(p.token, result);
    if let Some(tx) = p.probe {
        let _ = tx.send(probed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pending(seq: u64, sent: bool) -> Pending {
        Pending {
            token: seq as usize,
            seq,
            event: Event {
                event_id: format!("e{seq}"),
                topic: "outbox.order".into(),
                key: None,
                value: bytes::Bytes::from_static(b"{}"),
                json_value: true,
                headers: Vec::new(),
                position: walbox_outbox::Position {
                    commit_lsn: walbox_pgoutput::Lsn(0x1000 + 2 * seq),
                    index: 0,
                    xid: 7,
                },
                origin: walbox_outbox::Origin::Stream,
            },
            subject: "outbox.order".into(),
            state: if sent {
                State::Waiting
            } else {
                State::Failed(
                    DeliveryClass::InvalidRecord,
                    "refused before sending".into(),
                )
            },
            published: None,
            probe: None,
        }
    }

    /// Which publications of a history were sent (the others were refused
    /// before sending, and no reply can name them).
    fn sent(seq: u64) -> bool {
        seq % 5 != 3
    }

    fn answer_of(kind: u8) -> Answer {
        match kind % 3 {
            0 => Answer::Stored,
            1 => Answer::Refused(PublishError::new(PublishErrorKind::TimedOut)),
            _ => Answer::Duplicate(
                serde_json::from_str(r#"{"stream":"s","seq":1,"duplicate":true}"#).unwrap(),
            ),
        }
    }

    /// An outcome as the model knows it: the answer's kind, or failed unsent.
    fn tag(state: &State) -> u8 {
        match state {
            State::Waiting => 9,
            State::Answered(Answer::Stored) => 0,
            State::Answered(Answer::Refused(_)) => 1,
            State::Answered(Answer::Duplicate(_)) => 2,
            State::Failed(..) => 3,
        }
    }

    proptest! {
        /// Against a model: whatever order publications, replies (early,
        /// repeated, late) and settling come in, publications settle in
        /// publishing order, each with the first reply that named it while it
        /// waited (or failed unsent), and never while it still waits.
        #[test]
        fn the_window_settles_in_publishing_order_with_each_publication_s_first_reply(
            ops in proptest::collection::vec((0u8..3, any::<u8>(), any::<u8>()), 0..200)
        ) {
            let mut w = Window { entries: VecDeque::new(), base: 0, early: HashMap::new(), waiting: 0 };
            let at = Instant::now();
            // The model: publications pushed, settled, and each one's first
            // reply while unsettled.
            let (mut pushed, mut settled) = (0u64, 0u64);
            let mut first: HashMap<u64, u8> = HashMap::new();
            for (op, a, b) in ops {
                match op {
                    0 => {
                        w.push(pending(pushed, sent(pushed)), at);
                        pushed += 1;
                    }
                    1 => {
                        // A reply naming a publication settled already, waiting,
                        // or not yet handed over.
                        let Some(seq) = (settled + u64::from(a % 12)).checked_sub(3) else {
                            continue;
                        };
                        if !sent(seq) {
                            continue;
                        }
                        // It answers the oldest publication waiting: handed
                        // over, sent, not answered, and none before it waits.
                        let waits = |s: u64| s < pushed && sent(s) && !first.contains_key(&s);
                        let oldest = (settled..pushed).find(|s| waits(*s));
                        let want = seq >= settled && waits(seq) && oldest == Some(seq);
                        if seq >= settled {
                            first.entry(seq).or_insert(b % 3);
                        }
                        prop_assert_eq!(w.answer(seq, answer_of(b)), want);
                    }
                    _ => {
                        let want = if settled < pushed {
                            if sent(settled) { first.get(&settled).copied() } else { Some(3) }
                        } else {
                            None
                        };
                        let got = w.settled();
                        prop_assert_eq!(got.as_ref().map(|p| p.seq), want.map(|_| settled));
                        if let (Some(p), Some(t)) = (got, want) {
                            prop_assert_eq!(tag(&p.state), t);
                            settled += 1;
                        }
                    }
                }
            }
        }
    }

    /// A PubAck reporter on replies the test sends: its task, where
    /// publications are handed over, where replies come in, the reports.
    struct Reporter {
        task: tokio::task::JoinHandle<()>,
        tx: mpsc::UnboundedSender<Pending>,
        replies: mpsc::UnboundedSender<async_nats::Message>,
        reports: Reports,
        deliveries: crate::Deliveries,
    }

    const PREFIX: &str = "_INBOX.test.";

    async fn reporter(timeout: Duration) -> Reporter {
        // Only a duplicate's check uses the context: none comes here, and
        // the client never connects.
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect("127.0.0.1:9")
            .await
            .expect("a client connecting in the background");
        let (reports, deliveries) = Reports::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let (replies, reply_rx) = mpsc::unbounded_channel::<async_nats::Message>();
        let stream = Box::pin(futures_util::stream::unfold(
            reply_rx,
            |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
        ));
        let task = tokio::spawn(report(
            jetstream::new(client),
            stream,
            PREFIX.to_string(),
            timeout,
            rx,
            reports.clone(),
            Arc::default(),
        ));
        Reporter {
            task,
            tx,
            replies,
            reports,
            deliveries,
        }
    }

    /// The server's reply to publication `seq`: `payload` on its subject.
    fn reply(seq: u64, payload: String) -> async_nats::Message {
        async_nats::Message {
            subject: format!("{PREFIX}{seq}").into(),
            reply: None,
            payload: payload.into(),
            headers: None,
            status: None,
            description: None,
            length: 0,
        }
    }

    /// Each delivery's class (`None`: stored), by token, for `n` deliveries.
    async fn classes(deliveries: &mut crate::Deliveries, n: usize) -> Vec<Option<DeliveryClass>> {
        let mut got = vec![None; n];
        for _ in 0..n {
            let d = deliveries.recv().await.expect("the reporter is alive");
            got[d.token] = d.result.err().map(|e| e.class);
        }
        got
    }

    /// A stream that stores one publication per 100 ms works through a
    /// window of 20 under a PubAck timeout of 200 ms: none of the first 15
    /// times out, though each waits longer than the timeout in all. The
    /// last 5 are never answered: they time out 200 ms after the last
    /// PubAck.
    #[tokio::test(start_paused = true)]
    async fn a_stream_slower_than_the_window_but_answering_gets_no_timeout() {
        let mut r = reporter(Duration::from_millis(200)).await;
        let start = Instant::now();
        let (n, answered) = (20u64, 15u64);
        for seq in 0..n {
            r.reports.sent();
            r.tx.send(pending(seq, true)).unwrap();
        }
        let replies = r.replies.clone();
        let stream = tokio::spawn(async move {
            for seq in 0..answered {
                tokio::time::sleep_until(start + Duration::from_millis(100) * (seq as u32 + 1))
                    .await;
                let stored = format!(r#"{{"stream":"s","seq":{}}}"#, seq + 1);
                replies.send(reply(seq, stored)).unwrap();
            }
        });
        let got = classes(&mut r.deliveries, n as usize).await;
        let took = start.elapsed();
        assert!(
            got[..answered as usize].iter().all(Option::is_none),
            "{got:?}"
        );
        assert!(
            got[answered as usize..]
                .iter()
                .all(|c| *c == Some(DeliveryClass::Timeout)),
            "{got:?}"
        );
        assert!(
            took >= Duration::from_millis(1700) && took < Duration::from_millis(1800),
            "{took:?}"
        );
        stream.await.unwrap();
        drop(r.tx);
        r.task.await.unwrap();
    }

    /// The oldest publication is lost with a connection and never answered,
    /// while a slow source hands over one event every 150 ms that the
    /// stream refuses at once (its expected last id is the lost one). Those
    /// refusals say nothing of the oldest publication: it times out 200 ms
    /// after its hand-over, not when the window is full.
    #[tokio::test(start_paused = true)]
    async fn replies_to_later_publications_do_not_hold_back_the_oldest_ones_timeout() {
        let mut r = reporter(Duration::from_millis(200)).await;
        let start = Instant::now();
        let source = {
            let (tx, replies, reports) = (r.tx.clone(), r.replies.clone(), r.reports.clone());
            tokio::spawn(async move {
                for seq in 0..40u64 {
                    reports.sent();
                    let _ = tx.send(pending(seq, true));
                    // The refusal comes once the reporter holds the
                    // publication (not as an early answer).
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    if seq > 0 {
                        let refused = r#"{"error":{"code":400,"err_code":10071,"description":"wrong last msg ID: e0"}}"#;
                        let _ = replies.send(reply(seq, refused.to_string()));
                    }
                    tokio::time::sleep(Duration::from_millis(140)).await;
                }
            })
        };
        crate::kit::expect_the_oldest_timed_out(&mut r.deliveries, start).await;
        source.abort();
        r.task.abort();
    }

    #[test]
    fn failures_are_classified() {
        assert_eq!(
            classify(PublishErrorKind::MaxPayloadExceeded, ""),
            DeliveryClass::MessageTooLarge
        );
        assert_eq!(
            classify(
                PublishErrorKind::Other,
                "publish failed: message size exceeds maximum allowed"
            ),
            DeliveryClass::MessageTooLarge
        );
        assert_eq!(
            classify(PublishErrorKind::TimedOut, ""),
            DeliveryClass::Timeout
        );
        assert_eq!(
            classify(PublishErrorKind::WrongLastMessageId, ""),
            DeliveryClass::BrokerError
        );
    }
}
