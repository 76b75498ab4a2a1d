//! Publisher confirms in publish order. Each publication on the channel is
//! queued here with its event; the broker's answers (ack, nack, a lost
//! channel) resolve entries in any order, and only the contiguous prefix of
//! resolved entries is reported, so the relay learns of an event only once
//! every earlier one on the channel is settled.
//!
//! A confirm alone is not delivery: the broker acks an unroutable message
//! once its exchange finds no queue. With `mandatory` it first sends the
//! message back (basic.return), and lapin hands that return to whichever
//! confirm completes next, which may be another publication's. So a return is
//! matched to its event by the `message_id` it carries (the event id), never
//! by the confirm it came with, and every return seen is recorded before an
//! entry is reported: an acked entry whose event came back fails
//! ([`DeliveryClass::UnknownTopic`]: nowhere to go), never reads as stored.

use std::collections::{HashMap, VecDeque};

use crate::DeliveryClass;

/// How the broker answered one publication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Answer {
    /// basic.ack.
    Ack,
    /// basic.nack: the broker could not take it (a queue's process failed, a
    /// full queue with `reject-publish`).
    Nack,
    /// No answer: the channel or connection failed, the wait timed out, or
    /// the publication was never sent.
    Failed(DeliveryClass, String),
}

/// A returned message: why the broker sent it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Returned {
    /// The reply code (312 NO_ROUTE).
    pub(super) code: u16,
    /// The reply text.
    pub(super) text: String,
    /// The exchange it was published to.
    pub(super) exchange: String,
    /// Its routing key.
    pub(super) routing_key: String,
}

/// One publication awaiting its report.
#[derive(Debug)]
pub(super) struct Entry<T> {
    /// What the report needs (token, event id, topic, ...).
    pub(super) item: T,
    /// The event id, which the publication carried as `message_id`.
    pub(super) message_id: String,
    /// The broker's answer, once known.
    pub(super) answer: Option<Answer>,
}

/// The outcome reported for one publication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Acknowledged and routed: stored.
    Stored,
    /// Not stored (or not known to be): the class and why.
    Failed(DeliveryClass, String),
}

/// Publications in publish order, and the returns seen.
#[derive(Debug)]
pub(super) struct Confirms<T> {
    queue: VecDeque<Entry<T>>,
    returned: HashMap<String, Returned>,
    /// Every entry before this place from the front has its answer.
    waiting: usize,
}

impl<T> Default for Confirms<T> {
    fn default() -> Self {
        Confirms {
            queue: VecDeque::new(),
            returned: HashMap::new(),
            waiting: 0,
        }
    }
}

impl<T> Confirms<T> {
    /// Queues a publication (after every one queued before).
    pub(super) fn push(&mut self, item: T, message_id: String, answer: Option<Answer>) {
        self.queue.push_back(Entry {
            item,
            message_id,
            answer,
        });
    }

    /// The entries, in publish order, to resolve.
    pub(super) fn entries(&mut self) -> impl Iterator<Item = &mut Entry<T>> {
        self.queue.iter_mut()
    }

    /// The entry `i` places from the front, if there is one.
    pub(super) fn get_mut(&mut self, i: usize) -> Option<&mut Entry<T>> {
        self.queue.get_mut(i)
    }

    /// The place from the front of the entry whose item `cmp` finds (items
    /// in publish order, `cmp` comparing an item with the one sought).
    pub(super) fn find(&self, mut cmp: impl FnMut(&T) -> std::cmp::Ordering) -> Option<usize> {
        self.queue.binary_search_by(|e| cmp(&e.item)).ok()
    }

    /// The oldest publication still unanswered, and its place from the front.
    pub(super) fn first_waiting(&mut self) -> Option<(usize, &mut Entry<T>)> {
        while self
            .queue
            .get(self.waiting)
            .is_some_and(|e| e.answer.is_some())
        {
            self.waiting += 1;
        }
        let i = self.waiting;
        self.queue.get_mut(i).map(|e| (i, e))
    }

    /// Records the broker's answer for the entry `i` places from the front;
    /// whether it was the oldest one unanswered (the broker has reached the
    /// front of what it has to answer, see [`crate::kit::AnswerTimer`]).
    pub(super) fn answer(&mut self, i: usize, answer: Answer) -> bool {
        let first = self.first_waiting().is_some_and(|(w, _)| w == i);
        match self.queue.get_mut(i) {
            Some(e) => {
                e.answer = Some(answer);
                first
            }
            None => false,
        }
    }

    /// Records a message the broker sent back.
    pub(super) fn returned(&mut self, message_id: Option<String>, returned: Returned) {
        match message_id {
            Some(id) => {
                self.returned.insert(id, returned);
            }
            None => {
                // Every walbox publication carries a message_id; one without
                // is not walbox's to match, so every waiting one fails.
                self.returned.insert(String::new(), returned);
            }
        }
    }

    /// How many publications await their report.
    pub(super) fn len(&self) -> usize {
        self.queue.len()
    }

    /// The oldest publication still unanswered, if it is the first.
    pub(super) fn front_waiting(&self) -> bool {
        self.queue.front().is_some_and(|e| e.answer.is_none())
    }

    /// Fails every unanswered publication (a lost channel, a timeout).
    pub(super) fn fail_waiting(&mut self, class: DeliveryClass, reason: &str) {
        for e in &mut self.queue {
            if e.answer.is_none() {
                e.answer = Some(Answer::Failed(class, reason.to_owned()));
            }
        }
    }

    /// Takes the reports of the contiguous answered prefix. Call it only after
    /// every answer available has been recorded with the returns it carried.
    pub(super) fn ready(&mut self) -> Vec<(T, Outcome)> {
        let mut out = Vec::new();
        while self.queue.front().is_some_and(|e| e.answer.is_some()) {
            let e = self.queue.pop_front().expect("checked above");
            let returned = self
                .returned
                .get(&e.message_id)
                .or_else(|| self.returned.get(""));
            let outcome = match (e.answer.expect("checked above"), returned) {
                (Answer::Failed(class, reason), _) => Outcome::Failed(class, reason),
                (_, Some(r)) => Outcome::Failed(
                    DeliveryClass::UnknownTopic,
                    format!(
                        "the broker returned it unroutable ({} {}): no queue is bound to \
                         exchange {:?} for routing key {:?}; bind a durable queue (or set \
                         an alternate exchange) and walbox publishes it again",
                        r.code, r.text, r.exchange, r.routing_key
                    ),
                ),
                (Answer::Nack, None) => Outcome::Failed(
                    DeliveryClass::BrokerError,
                    "the broker refused it (basic.nack: a queue failed to take it, or is \
                     full with overflow = reject-publish)"
                        .into(),
                ),
                (Answer::Ack, None) => Outcome::Stored,
            };
            out.push((e.item, outcome));
        }
        self.waiting = self.waiting.saturating_sub(out.len());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ret(key: &str) -> Returned {
        Returned {
            code: 312,
            text: "NO_ROUTE".into(),
            exchange: "outbox".into(),
            routing_key: key.into(),
        }
    }

    proptest::proptest! {
        /// Against a model (a list of answered flags): whatever order
        /// publications, answers (in or out of order, again) and reports
        /// come in, the oldest unanswered entry is the model's, and an answer
        /// says it reached the oldest one exactly when the model does.
        #[test]
        fn the_oldest_unanswered_entry_is_tracked_through_any_history(
            ops in proptest::collection::vec((0u8..3, 0usize..12, proptest::bool::ANY), 0..200)
        ) {
            let mut c: Confirms<u64> = Confirms::default();
            let mut model: VecDeque<(u64, bool)> = VecDeque::new();
            let mut next = 0u64;
            for (op, i, answered) in ops {
                match op {
                    0 => {
                        c.push(next, format!("e{next}"), answered.then_some(Answer::Ack));
                        model.push_back((next, answered));
                        next += 1;
                    }
                    1 => {
                        let first = model.iter().position(|(_, a)| !a);
                        let got = c.answer(i, Answer::Ack);
                        proptest::prop_assert_eq!(got, i < model.len() && first == Some(i));
                        if let Some(m) = model.get_mut(i) {
                            m.1 = true;
                        }
                    }
                    _ => {
                        let got: Vec<u64> = c.ready().into_iter().map(|(i, _)| i).collect();
                        let mut want = Vec::new();
                        while model.front().is_some_and(|(_, a)| *a) {
                            want.push(model.pop_front().unwrap().0);
                        }
                        proptest::prop_assert_eq!(got, want);
                    }
                }
                let first = model.iter().position(|(_, a)| !a).map(|p| model[p].0);
                proptest::prop_assert_eq!(c.first_waiting().map(|(_, e)| e.item), first);
                if let Some(seq) = first {
                    proptest::prop_assert_eq!(
                        c.find(|x| x.cmp(&seq)),
                        model.iter().position(|(s, _)| *s == seq)
                    );
                }
            }
        }
    }

    #[test]
    fn only_the_contiguous_answered_prefix_is_reported_in_publish_order() {
        let mut c = Confirms::default();
        for i in 1..=4 {
            c.push(i, format!("e{i}"), None);
        }
        // Answers come out of order: 2 and 3 first.
        for e in c.entries() {
            if e.item == 2 || e.item == 3 {
                e.answer = Some(Answer::Ack);
            }
        }
        assert!(c.ready().is_empty());
        assert!(c.front_waiting());
        c.entries().next().unwrap().answer = Some(Answer::Ack);
        let got: Vec<i32> = c.ready().into_iter().map(|(i, _)| i).collect();
        assert_eq!(got, [1, 2, 3]);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn a_return_fails_its_own_event_whichever_confirm_carried_it() {
        let mut c = Confirms::default();
        for i in 1..=3 {
            c.push(i, format!("e{i}"), None);
        }
        // lapin attached e2's return to e1's confirm: matched by message_id.
        c.returned(Some("e2".into()), ret("orders"));
        for e in c.entries() {
            e.answer = Some(Answer::Ack);
        }
        let got = c.ready();
        assert_eq!(got[0].1, Outcome::Stored);
        match &got[1].1 {
            Outcome::Failed(DeliveryClass::UnknownTopic, why) => {
                assert!(why.contains("\"orders\"") && why.contains("312"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(got[2].1, Outcome::Stored);
    }

    #[test]
    fn a_nack_or_a_lost_channel_fails_the_event_not_as_a_dead_letter() {
        let mut c = Confirms::default();
        c.push(1, "e1".into(), Some(Answer::Nack));
        c.push(2, "e2".into(), None);
        c.fail_waiting(DeliveryClass::BrokerError, "channel closed");
        let got = c.ready();
        for (_, o) in &got {
            match o {
                Outcome::Failed(class, _) => assert!(!class.is_about_the_message()),
                Outcome::Stored => panic!("{got:?}"),
            }
        }
        // A return without a message_id fails everything it could be.
        let mut c = Confirms::default();
        c.push(1, "e1".into(), Some(Answer::Ack));
        c.returned(None, ret("x"));
        assert!(matches!(c.ready()[0].1, Outcome::Failed(..)));
    }
}
