//! Unit and property tests of the ack tracker.

use proptest::prelude::*;

use super::*;

#[test]
fn confirms_a_transaction_only_when_all_its_events_are_acked() {
    let mut t = AckTracker::new(Lsn(100));
    let tx = t.begin(Lsn(0));
    let a = t.event(tx);
    let b = t.event(tx);
    t.commit(tx, Lsn(200));
    assert_eq!(t.confirmed(), Lsn(100));
    t.ack(b);
    assert_eq!(t.confirmed(), Lsn(100), "one event still in flight");
    t.ack(a);
    assert_eq!(t.confirmed(), Lsn(200));
    assert_eq!(t.in_flight(), 0);
}

#[test]
fn a_later_transaction_waits_for_earlier_ones() {
    let mut t = AckTracker::new(Lsn(0));
    let t1 = t.begin(Lsn(0));
    let e1 = t.event(t1);
    t.commit(t1, Lsn(10));
    let t2 = t.begin(Lsn(0));
    let e2 = t.event(t2);
    t.commit(t2, Lsn(20));
    t.ack(e2);
    assert_eq!(t.confirmed(), Lsn(0), "t1 not acked yet");
    t.ack(e1);
    assert_eq!(t.confirmed(), Lsn(20));
}

#[test]
fn transactions_without_events_confirm_at_once_or_fold_behind_pending_ones() {
    let mut t = AckTracker::new(Lsn(0));
    let empty = t.begin(Lsn(0));
    t.commit(empty, Lsn(5));
    assert_eq!(t.confirmed(), Lsn(5));

    let t1 = t.begin(Lsn(0));
    let e1 = t.event(t1);
    t.commit(t1, Lsn(10));
    for end in [20, 30, 40] {
        let tx = t.begin(Lsn(0));
        t.commit(tx, Lsn(end));
    }
    assert_eq!(
        t.txns.len(),
        1,
        "empty transactions fold into the pending one"
    );
    assert_eq!(t.confirmed(), Lsn(5));
    t.ack(e1);
    assert_eq!(t.confirmed(), Lsn(40));
}

#[test]
fn a_transaction_is_settled_once_it_and_all_before_it_are_acked() {
    // A snapshot is one transaction committed at the slot's consistent point,
    // which is also where the tracker starts: `confirmed` cannot tell when it is
    // done, `settled` can.
    let mut t = AckTracker::new(Lsn(50));
    let snap = t.begin(Lsn(0));
    let rows: Vec<Ticket> = (0..3).map(|_| t.event(snap)).collect();
    assert!(!t.settled(snap), "open");
    t.commit(snap, Lsn(50));
    let later = t.begin(Lsn(0));
    t.commit(later, Lsn(60)); // empty: folds into the snapshot
    assert!(!t.settled(snap));
    assert!(!t.settled(later));
    for r in rows {
        assert!(!t.settled(snap));
        t.ack(r);
    }
    assert!(t.settled(snap));
    assert!(t.settled(later));
    assert_eq!(t.confirmed(), Lsn(60));

    let mut f = AckTracker::new(Lsn(0));
    let tx = f.begin(Lsn(0));
    let e = f.event(tx);
    f.commit(tx, Lsn(10));
    f.fail(e);
    assert!(!f.settled(tx), "a failed event never settles");
}

#[test]
fn partial_progress_is_the_acked_prefix_of_the_oldest_transaction() {
    let mut t = AckTracker::new(Lsn(0));
    let big = t.begin(Lsn(500));
    let e: Vec<Ticket> = (0..5).map(|_| t.event(big)).collect();
    assert_eq!(t.partial(), None);
    let mut e = e.into_iter();
    let (e0, e1, e2, e3, e4) = (
        e.next().unwrap(),
        e.next().unwrap(),
        e.next().unwrap(),
        e.next().unwrap(),
        e.next().unwrap(),
    );
    t.ack(e1); // out of order: no prefix yet
    assert_eq!(t.partial(), None);
    t.ack(e0);
    assert_eq!(t.partial(), Some((Lsn(500), 2)));
    t.ack(e3);
    assert_eq!(t.partial(), Some((Lsn(500), 2)), "event 2 still out");
    t.ack(e2);
    assert_eq!(t.partial(), Some((Lsn(500), 4)));
    let next = t.begin(Lsn(900));
    let n0 = t.event(next);
    t.ack(n0);
    assert_eq!(
        t.partial(),
        Some((Lsn(500), 4)),
        "only the oldest transaction counts"
    );
    t.commit(big, Lsn(600));
    t.ack(e4);
    assert_eq!(t.confirmed(), Lsn(600));
    assert_eq!(t.partial(), Some((Lsn(900), 1)));
    t.commit(next, Lsn(1000));
    assert_eq!(t.partial(), None);
    assert_eq!(t.confirmed(), Lsn(1000));
}

#[test]
fn an_open_transaction_blocks_idle_confirmation() {
    let mut t = AckTracker::new(Lsn(0));
    t.idle_wal_end(Lsn(50));
    assert_eq!(t.confirmed(), Lsn(50), "idle: follow the server");
    let tx = t.begin(Lsn(0));
    t.idle_wal_end(Lsn(90));
    assert_eq!(
        t.confirmed(),
        Lsn(50),
        "a keepalive inside a transaction moves nothing"
    );
    let e = t.event(tx);
    t.commit(tx, Lsn(100));
    t.idle_wal_end(Lsn(120));
    assert_eq!(t.confirmed(), Lsn(50), "an event in flight moves nothing");
    t.ack(e);
    assert_eq!(t.confirmed(), Lsn(100));
    t.idle_wal_end(Lsn(120));
    assert_eq!(t.confirmed(), Lsn(120));
    t.idle_wal_end(Lsn(110));
    assert_eq!(t.confirmed(), Lsn(120), "never backwards");
}

#[test]
fn a_failed_delivery_freezes_the_position_below_it() {
    let mut t = AckTracker::new(Lsn(0));
    let t1 = t.begin(Lsn(0));
    let ok = t.event(t1);
    t.commit(t1, Lsn(10));
    let t2 = t.begin(Lsn(0));
    let bad = t.event(t2);
    let after = t.event(t2);
    t.commit(t2, Lsn(20));
    let t3 = t.begin(Lsn(0));
    let later = t.event(t3);
    t.commit(t3, Lsn(30));
    t.fail(bad);
    t.ack(after);
    t.ack(later);
    t.ack(ok);
    t.idle_wal_end(Lsn(99));
    assert!(t.has_failed());
    assert!(t.confirmed() < Lsn(20), "never past the failed event");
}

/// A random interleaving of transactions, events and acknowledgements.
#[derive(Debug, Clone)]
enum Step {
    Txn { events: u8 },
    Ack(prop::sample::Index),
    Keepalive,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u8..4).prop_map(|events| Step::Txn { events }),
        any::<prop::sample::Index>().prop_map(Step::Ack),
        Just(Step::Keepalive),
    ]
}

proptest! {
    /// The confirmed position never passes an unacknowledged event, never goes
    /// backwards, and reaches the last commit once everything is acknowledged.
    #[test]
    fn never_confirms_past_an_unacked_event(steps in proptest::collection::vec(step(), 1..200)) {
        let mut t = AckTracker::new(Lsn(0));
        let mut lsn = 0u64;
        // (end_lsn and Begin LSN of its transaction, index in it, ticket) for
        // every event not acked yet.
        let mut pending: Vec<(Lsn, Lsn, u64, Ticket)> = Vec::new();
        let mut last = Lsn(0);
        for s in steps {
            match s {
                Step::Txn { events } => {
                    let begin = Lsn(lsn + 50);
                    let tx = t.begin(begin);
                    let tickets: Vec<Ticket> = (0..events).map(|_| t.event(tx)).collect();
                    lsn += 100;
                    t.commit(tx, Lsn(lsn));
                    pending.extend(
                        tickets.into_iter().zip(0u64..).map(|(k, i)| (Lsn(lsn), begin, i, k)),
                    );
                }
                Step::Ack(i) if !pending.is_empty() => {
                    let (_, _, _, ticket) = pending.swap_remove(i.index(pending.len()));
                    t.ack(ticket);
                }
                Step::Ack(_) => {}
                Step::Keepalive => t.idle_wal_end(Lsn(lsn + 7)),
            }
            let c = t.confirmed();
            prop_assert!(c >= last, "went backwards");
            last = c;
            if let Some(oldest) = pending.iter().map(|(end, ..)| *end).min() {
                prop_assert!(c < oldest, "confirmed {c} with an event of the transaction ending {oldest} unacked");
            }
            // The partial prefix never covers an unacknowledged event, and names
            // the oldest transaction still waiting.
            if let Some((begin, n)) = t.partial() {
                prop_assert!(n > 0);
                prop_assert!(
                    !pending.iter().any(|(_, b, i, _)| *b == begin && *i < n),
                    "prefix of {n} at {begin} covers an unacked event"
                );
                let oldest = pending.iter().map(|(_, b, ..)| *b).min();
                prop_assert_eq!(oldest, Some(begin));
            }
            prop_assert_eq!(t.in_flight(), pending.len() as u64);
        }
        for (_, _, _, ticket) in pending.drain(..) {
            t.ack(ticket);
        }
        prop_assert!(t.confirmed() >= Lsn(lsn));
    }
}

#[test]
fn a_non_transactional_message_unit_between_commits_confirms_in_lsn_order() {
    // A commit ending at 200, a non-transactional message whose record ends at
    // 250 (after that commit's end, before the next commit record at 300), then
    // a transaction committing at 300 and ending at 340. The message is a unit
    // of its own: begin and commit at its LSN.
    let mut t = AckTracker::new(Lsn(100));
    let t1 = t.begin(Lsn(180));
    let e1 = t.event(t1);
    t.commit(t1, Lsn(200));
    let m = t.begin(Lsn(250));
    let dead = t.event(m);
    t.commit(m, Lsn(250));
    let t2 = t.begin(Lsn(300));
    let e2 = t.event(t2);
    t.commit(t2, Lsn(340));

    t.ack(e2);
    assert_eq!(t.confirmed(), Lsn(100));
    t.ack(e1);
    assert_eq!(t.confirmed(), Lsn(200), "stops before the message's record");
    assert_eq!(
        t.partial(),
        None,
        "a one-event unit is never partly acknowledged"
    );
    t.ack(dead);
    assert_eq!(t.confirmed(), Lsn(340));

    // Acknowledged before the transaction ahead of it: it waits for it.
    let mut t = AckTracker::new(Lsn(100));
    let t1 = t.begin(Lsn(180));
    let e1 = t.event(t1);
    t.commit(t1, Lsn(200));
    let m = t.begin(Lsn(250));
    let dead = t.event(m);
    t.commit(m, Lsn(250));
    t.ack(dead);
    assert_eq!(t.confirmed(), Lsn(100));
    assert_eq!(t.partial(), None);
    t.ack(e1);
    assert_eq!(t.confirmed(), Lsn(250));
    // Then a keepalive with nothing open moves it on.
    t.idle_wal_end(Lsn(400));
    assert_eq!(t.confirmed(), Lsn(400));
}
