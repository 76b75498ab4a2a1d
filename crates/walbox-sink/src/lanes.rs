//! Per-key lanes for destinations that take entries in batches and answer
//! each entry on its own (Kinesis `PutRecords`, SQS `SendMessageBatch`, SNS
//! `PublishBatch`), without I/O.
//!
//! Such a destination stores the other entries of a batch when one fails, so
//! two entries of one key in the same batch (or in two batches in flight at
//! once) could be stored out of order: the later one stored, the earlier one
//! failed and sent again after it. Lanes keep that from happening:
//!
//! - every key of every destination has a lane, and a lane has at most one
//!   entry out (in a batch in flight) at any time;
//! - a batch takes the heads of up to `max_entries` lanes of one
//!   destination, as many as fit `max_bytes`;
//! - an entry stored lets its lane's next entry go; an entry that failed goes
//!   back to the head of its lane, which pauses until a given time and then
//!   sends it again: nothing later of that key goes out before it.
//!
//! A lane without a key ([`LaneKey::Alone`]) holds one entry: events without
//! a key promise no order.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

/// What a lane is for, within its destination.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum LaneKey {
    /// The events of one key.
    Key(Bytes),
    /// One event without a key (a number unique in the lanes).
    Alone(u64),
}

/// A lane: a destination and what it holds there.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct LaneId {
    /// The destination (a stream, a queue, a topic).
    pub(crate) dest: Arc<str>,
    /// The key.
    pub(crate) key: LaneKey,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Its head may go: it is in its destination's ready queue.
    Ready,
    /// Its head is out, in a batch in flight.
    Out,
    /// Its head failed and waits until the time in `paused`.
    Paused(Instant),
}

#[derive(Debug)]
struct Lane<T> {
    /// The entries not yet out, oldest first (the head is out when `Out`).
    queue: VecDeque<T>,
    state: State,
}

/// A batch for one destination: the heads of distinct lanes.
#[derive(Debug)]
pub(crate) struct Batch<T> {
    /// The destination.
    pub(crate) dest: Arc<str>,
    /// Each entry with its lane.
    pub(crate) entries: Vec<(LaneId, T)>,
}

/// The lanes of a session.
#[derive(Debug)]
pub(crate) struct Lanes<T> {
    lanes: HashMap<LaneId, Lane<T>>,
    /// Per destination, its ready lanes in the order they became ready.
    ready: HashMap<Arc<str>, VecDeque<LaneId>>,
    /// The destinations with ready lanes, each once, served in turn.
    dests: VecDeque<Arc<str>>,
    /// Paused lanes by the time they may go again.
    paused: BTreeSet<(Instant, LaneId)>,
    /// Entries held (queued or out).
    held: usize,
}

impl<T> Default for Lanes<T> {
    fn default() -> Self {
        Lanes {
            lanes: HashMap::new(),
            ready: HashMap::new(),
            dests: VecDeque::new(),
            paused: BTreeSet::new(),
            held: 0,
        }
    }
}

impl<T> Lanes<T> {
    /// Queues `entry` at the end of its lane.
    pub(crate) fn push(&mut self, id: LaneId, entry: T) {
        self.held += 1;
        if let Some(lane) = self.lanes.get_mut(&id) {
            lane.queue.push_back(entry);
            return;
        }
        self.lanes.insert(
            id.clone(),
            Lane {
                queue: VecDeque::from([entry]),
                state: State::Ready,
            },
        );
        self.make_ready(id);
    }

    fn make_ready(&mut self, id: LaneId) {
        let queue = self.ready.entry(Arc::clone(&id.dest)).or_default();
        if queue.is_empty() {
            self.dests.push_back(Arc::clone(&id.dest));
        }
        queue.push_back(id);
    }

    /// The next batch: the heads of up to `max_entries` ready lanes of one
    /// destination (taken in turn), whose sizes (`size`) add up to at most
    /// `max_bytes` (a first entry larger than that goes alone). `None` when
    /// no lane is ready.
    pub(crate) fn take(
        &mut self,
        max_entries: usize,
        max_bytes: usize,
        size: impl Fn(&T) -> usize,
    ) -> Option<Batch<T>> {
        let dest = self.dests.pop_front()?;
        let ready = self
            .ready
            .get_mut(&dest)
            .expect("a listed destination has ready lanes");
        let mut entries = Vec::new();
        let mut bytes = 0usize;
        while entries.len() < max_entries.max(1) {
            let Some(id) = ready.front() else { break };
            let lane = self.lanes.get_mut(id).expect("a ready lane exists");
            let head = lane.queue.pop_front().expect("a ready lane holds an entry");
            let n = size(&head);
            if !entries.is_empty() && bytes.saturating_add(n) > max_bytes {
                lane.queue.push_front(head);
                break;
            }
            bytes = bytes.saturating_add(n);
            lane.state = State::Out;
            let id = ready.pop_front().expect("looked at above");
            entries.push((id, head));
        }
        if ready.is_empty() {
            self.ready.remove(&dest);
        } else {
            self.dests.push_back(Arc::clone(&dest));
        }
        Some(Batch { dest, entries })
    }

    /// The entry out of lane `id` was stored: the lane's next entry may go.
    pub(crate) fn stored(&mut self, id: &LaneId) {
        self.held -= 1;
        let lane = self.lanes.get_mut(id).expect("an entry out has its lane");
        debug_assert_eq!(lane.state, State::Out);
        if lane.queue.is_empty() {
            self.lanes.remove(id);
        } else {
            lane.state = State::Ready;
            self.make_ready(id.clone());
        }
    }

    /// The entry out of lane `id` failed: it goes back to the head of its
    /// lane, which sends nothing before `until`, and then this entry first.
    pub(crate) fn retry(&mut self, id: LaneId, entry: T, until: Instant) {
        let lane = self.lanes.get_mut(&id).expect("an entry out has its lane");
        debug_assert_eq!(lane.state, State::Out);
        lane.queue.push_front(entry);
        lane.state = State::Paused(until);
        self.paused.insert((until, id));
    }

    /// Lanes paused until `now` or earlier become ready.
    pub(crate) fn wake(&mut self, now: Instant) {
        while let Some((until, _)) = self.paused.first() {
            if *until > now {
                break;
            }
            let (_, id) = self.paused.pop_first().expect("looked at above");
            if let Some(lane) = self.lanes.get_mut(&id) {
                lane.state = State::Ready;
                self.make_ready(id);
            }
        }
    }

    /// When the first paused lane may go again.
    pub(crate) fn next_wake(&self) -> Option<Instant> {
        self.paused.first().map(|(until, _)| *until)
    }

    /// Entries held: queued, paused or out.
    pub(crate) fn held(&self) -> usize {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;
    use std::time::Duration;

    fn id(dest: &str, key: &str) -> LaneId {
        LaneId {
            dest: Arc::from(dest),
            key: LaneKey::Key(Bytes::from(key.to_owned())),
        }
    }

    #[test]
    fn a_batch_takes_one_entry_per_key_and_a_failed_one_holds_its_key() {
        let mut lanes = Lanes::default();
        let t0 = Instant::now();
        for (k, n) in [("a", 1), ("a", 2), ("b", 3), ("a", 4), ("c", 5)] {
            lanes.push(id("s", k), n);
        }
        let batch = lanes.take(10, usize::MAX, |_| 1).unwrap();
        let got: Vec<i32> = batch.entries.iter().map(|(_, n)| *n).collect();
        assert_eq!(got, [1, 3, 5], "the heads of a, b and c; a's second waits");
        assert!(lanes.take(10, usize::MAX, |_| 1).is_none());
        // 1 fails, 3 and 5 are stored: a waits, nothing of a goes meanwhile.
        let mut entries = batch.entries.into_iter();
        let (a, one) = entries.next().unwrap();
        lanes.retry(a, one, t0 + Duration::from_millis(50));
        for (lane, _) in entries {
            lanes.stored(&lane);
        }
        assert!(lanes.take(10, usize::MAX, |_| 1).is_none());
        assert_eq!(lanes.next_wake(), Some(t0 + Duration::from_millis(50)));
        lanes.wake(t0 + Duration::from_millis(50));
        let again = lanes.take(10, usize::MAX, |_| 1).unwrap();
        assert_eq!(again.entries.len(), 1);
        assert_eq!(again.entries[0].1, 1, "the failed entry goes again first");
        assert_eq!(lanes.held(), 3);
    }

    #[test]
    fn batches_keep_to_their_destination_and_byte_budget() {
        let mut lanes = Lanes::default();
        for k in ["a", "b", "c"] {
            lanes.push(id("one", k), 400usize);
            lanes.push(id("two", k), 400usize);
        }
        let first = lanes.take(10, 1000, |n| *n).unwrap();
        assert_eq!(&*first.dest, "one");
        assert_eq!(first.entries.len(), 2, "a third 400 passes 1000");
        let second = lanes.take(10, 1000, |n| *n).unwrap();
        assert_eq!(&*second.dest, "two", "destinations take turns");
        let third = lanes.take(10, 1000, |n| *n).unwrap();
        assert_eq!(&*third.dest, "one");
        assert_eq!(third.entries.len(), 1);
        // An entry larger than the budget goes alone.
        let mut lanes = Lanes::default();
        lanes.push(id("one", "a"), 5000usize);
        assert_eq!(lanes.take(10, 1000, |n| *n).unwrap().entries.len(), 1);
    }

    /// What the model does in one step.
    #[derive(Debug, Clone)]
    enum Step {
        /// An event of key `key` (0..4) to destination `dest` (0..2).
        Push { dest: u8, key: u8 },
        /// A batch is taken and sent.
        Take { max: usize },
        /// The oldest batch in flight is answered: per entry, stored or not.
        Answer { stored: Vec<bool> },
        /// Time passes.
        Tick,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0u8..2, 0u8..4).prop_map(|(dest, key)| Step::Push { dest, key }),
            3 => (1usize..6).prop_map(|max| Step::Take { max }),
            3 => proptest::collection::vec(any::<bool>(), 0..8)
                .prop_map(|stored| Step::Answer { stored }),
            1 => Just(Step::Tick),
        ]
    }

    proptest! {
        /// Against a reference model of what the destination stores: every
        /// event is stored once (the model's destination stores what it is
        /// sent, so a second copy would show), in its key's order, a lane
        /// never has two entries out, and once answers stop failing
        /// everything is stored.
        #[test]
        fn every_key_is_stored_in_order_whatever_fails(steps in proptest::collection::vec(step(), 1..120)) {
            let t0 = Instant::now();
            let mut now = t0;
            let mut lanes: Lanes<(u8, u8, u32)> = Lanes::default();
            let mut sent: BTreeMap<(u8, u8), u32> = BTreeMap::new();
            let mut stored: BTreeMap<(u8, u8), Vec<u32>> = BTreeMap::new();
            let mut flight: VecDeque<Batch<(u8, u8, u32)>> = VecDeque::new();
            let mut out: BTreeSet<LaneId> = BTreeSet::new();
            let settle = |lanes: &mut Lanes<(u8, u8, u32)>,
                          out: &mut BTreeSet<LaneId>,
                          stored: &mut BTreeMap<(u8, u8), Vec<u32>>,
                          batch: Batch<(u8, u8, u32)>,
                          answers: &[bool],
                          now: Instant| {
                for (i, (lane, entry)) in batch.entries.into_iter().enumerate() {
                    out.remove(&lane);
                    if answers.get(i).copied().unwrap_or(true) {
                        stored.entry((entry.0, entry.1)).or_default().push(entry.2);
                        lanes.stored(&lane);
                    } else {
                        lanes.retry(lane, entry, now + Duration::from_millis(10));
                    }
                }
            };
            for s in steps {
                match s {
                    Step::Push { dest, key } => {
                        let n = sent.entry((dest, key)).or_default();
                        *n += 1;
                        lanes.push(id(&dest.to_string(), &key.to_string()), (dest, key, *n));
                    }
                    Step::Take { max } => {
                        if let Some(batch) = lanes.take(max, usize::MAX, |_| 1) {
                            prop_assert!(batch.entries.len() <= max);
                            for (lane, entry) in &batch.entries {
                                let dest = entry.0.to_string();
                                prop_assert_eq!(&*lane.dest, dest.as_str());
                                prop_assert!(out.insert(lane.clone()), "two entries of {:?} out", lane);
                            }
                            flight.push_back(batch);
                        }
                    }
                    Step::Answer { stored: answers } => {
                        if let Some(batch) = flight.pop_front() {
                            settle(&mut lanes, &mut out, &mut stored, batch, &answers, now);
                        }
                    }
                    Step::Tick => {
                        now += Duration::from_millis(10);
                        lanes.wake(now);
                    }
                }
            }
            // Answers stop failing: everything drains.
            loop {
                while let Some(batch) = flight.pop_front() {
                    settle(&mut lanes, &mut out, &mut stored, batch, &[], now);
                }
                now += Duration::from_millis(10);
                lanes.wake(now);
                match lanes.take(3, usize::MAX, |_| 1) {
                    Some(batch) => flight.push_back(batch),
                    None if lanes.next_wake().is_none() => break,
                    None => {}
                }
            }
            prop_assert_eq!(lanes.held(), 0);
            for (k, n) in &sent {
                let want: Vec<u32> = (1..=*n).collect();
                prop_assert_eq!(stored.get(k), Some(&want), "key {:?}", k);
            }
        }
    }
}
