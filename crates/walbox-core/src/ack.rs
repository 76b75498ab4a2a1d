//! Which flush position is safe to confirm.

use std::collections::{BTreeSet, VecDeque};

use walbox_pgoutput::Lsn;

/// A transaction being read, from its Begin to its Commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnId(u64);

/// One event handed to the sink; acknowledge or fail it exactly once.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "every event must be acknowledged or failed"]
pub struct Ticket {
    txn: u64,
    /// The event's place in its transaction (0, 1, ...).
    index: u64,
}

#[derive(Debug)]
struct Txn {
    seq: u64,
    /// The Begin message's commit LSN (`final_lsn`): names the transaction.
    commit_lsn: Lsn,
    /// Events handed out so far.
    issued: u64,
    /// Events `0..acked_prefix` are all acknowledged.
    acked_prefix: u64,
    /// Acknowledged events after a gap (acks arrive in any order across
    /// partitions); they join the prefix when the gap closes.
    acked_ahead: BTreeSet<u64>,
    /// Commit end LSN, known once the Commit arrives.
    end_lsn: Option<Lsn>,
    /// Events handed to the sink and not yet acknowledged.
    outstanding: u64,
}

/// Tracks transactions and their in-flight events in commit order.
///
/// Transactions arrive one after another (pgoutput protocol 1 sends each whole,
/// after it commits); acknowledgements arrive in any order. Memory is one entry per
/// transaction that still has unacknowledged events, plus the open one: committed
/// transactions without events fold into the entry before them.
#[derive(Debug)]
pub struct AckTracker {
    txns: VecDeque<Txn>,
    next_seq: u64,
    confirmed: Lsn,
    in_flight: u64,
    failed: bool,
}

impl AckTracker {
    /// A tracker whose confirmed position starts at `start` (the position the
    /// server already has, or walbox's durable checkpoint).
    #[must_use]
    pub fn new(start: Lsn) -> Self {
        AckTracker {
            txns: VecDeque::new(),
            next_seq: 0,
            confirmed: start,
            in_flight: 0,
            failed: false,
        }
    }

    /// The flush position that is safe to send to the server.
    #[must_use]
    pub fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    /// Events handed to the sink and not acknowledged yet.
    #[must_use]
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// Whether a delivery failed: the position is frozen below it for good.
    #[must_use]
    pub fn has_failed(&self) -> bool {
        self.failed
    }

    /// Whether transaction `txn` committed and its events, and those of every
    /// transaction before it, are all acknowledged.
    #[must_use]
    pub fn settled(&self, txn: TxnId) -> bool {
        !self.failed && self.txns.front().is_none_or(|t| t.seq > txn.0)
    }

    /// A transaction starts (Begin); `commit_lsn` is its Begin's commit LSN.
    #[must_use]
    pub fn begin(&mut self, commit_lsn: Lsn) -> TxnId {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.txns.push_back(Txn {
            seq,
            commit_lsn,
            issued: 0,
            acked_prefix: 0,
            acked_ahead: BTreeSet::new(),
            end_lsn: None,
            outstanding: 0,
        });
        TxnId(seq)
    }

    /// An event of transaction `txn` goes to the sink; events of a transaction
    /// are numbered in the order they are handed out.
    pub fn event(&mut self, txn: TxnId) -> Ticket {
        let mut index = 0;
        if let Some(t) = self.find(txn.0) {
            index = t.issued;
            t.issued += 1;
            t.outstanding += 1;
            self.in_flight += 1;
        } else {
            debug_assert!(false, "event for an unknown transaction");
        }
        Ticket { txn: txn.0, index }
    }

    /// Progress inside the oldest unconfirmed transaction: its Begin's commit LSN
    /// and how many of its first events are all acknowledged (at least one). A
    /// restart at [`confirmed`](Self::confirmed) receives that transaction again
    /// and may skip that many events of it.
    #[must_use]
    pub fn partial(&self) -> Option<(Lsn, u64)> {
        if self.failed {
            return None;
        }
        let front = self.txns.front()?;
        (front.acked_prefix > 0).then_some((front.commit_lsn, front.acked_prefix))
    }

    /// Transaction `txn` committed; its Commit ends at `end_lsn`.
    pub fn commit(&mut self, txn: TxnId, end_lsn: Lsn) {
        let Some(pos) = self.txns.iter().position(|t| t.seq == txn.0) else {
            debug_assert!(false, "commit of an unknown transaction");
            return;
        };
        let outstanding = self.txns.get(pos).map_or(0, |t| t.outstanding);
        if outstanding == 0 && pos > 0 {
            // No events in flight: fold into the transaction before it, which then
            // stands for both (confirming the later end covers the empty one).
            self.txns.remove(pos);
            if let Some(prev) = self.txns.get_mut(pos - 1) {
                prev.end_lsn = Some(prev.end_lsn.map_or(end_lsn, |e| e.max(end_lsn)));
            }
        } else if let Some(t) = self.txns.get_mut(pos) {
            t.end_lsn = Some(end_lsn);
        }
        self.advance();
    }

    /// The sink acknowledged the event of `ticket`.
    pub fn ack(&mut self, ticket: Ticket) {
        if let Some(t) = self.find(ticket.txn) {
            debug_assert!(t.outstanding > 0, "more acks than events");
            t.outstanding = t.outstanding.saturating_sub(1);
            if ticket.index == t.acked_prefix {
                t.acked_prefix += 1;
                while t.acked_ahead.remove(&t.acked_prefix) {
                    t.acked_prefix += 1;
                }
            } else {
                t.acked_ahead.insert(ticket.index);
            }
            self.in_flight = self.in_flight.saturating_sub(1);
        } else {
            debug_assert!(false, "ack for an unknown transaction");
        }
        self.advance();
    }

    /// The sink failed the event of `ticket` for good (timeout or permanent error).
    /// The confirmed position never passes it; the relay must restart from
    /// [`confirmed`](Self::confirmed).
    pub fn fail(&mut self, ticket: Ticket) {
        self.failed = true;
        // The ticket stays counted as outstanding: its transaction never completes.
        drop(ticket);
    }

    /// The server reported its WAL end (keepalive). With no transaction open and
    /// nothing in flight, everything up to it has been seen and is safe to confirm.
    pub fn idle_wal_end(&mut self, wal_end: Lsn) {
        if self.txns.is_empty() && !self.failed {
            self.confirmed = self.confirmed.max(wal_end);
        }
    }

    fn find(&mut self, seq: u64) -> Option<&mut Txn> {
        // Entries are in seq order, but folding leaves gaps: search by value.
        let front = self.txns.front()?.seq;
        if seq < front {
            return None;
        }
        let guess = usize::try_from(seq - front).unwrap_or(usize::MAX);
        let idx = if self.txns.get(guess).is_some_and(|t| t.seq == seq) {
            guess
        } else {
            self.txns.iter().position(|t| t.seq == seq)?
        };
        self.txns.get_mut(idx)
    }

    fn advance(&mut self) {
        if self.failed {
            return;
        }
        while let Some(front) = self.txns.front() {
            match front.end_lsn {
                Some(end) if front.outstanding == 0 => {
                    self.confirmed = self.confirmed.max(end);
                    self.txns.pop_front();
                }
                _ => break,
            }
        }
    }
}

#[cfg(test)]
mod tests;
