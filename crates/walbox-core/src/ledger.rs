//! The in-flight ledger: every event handed to the sink and not yet settled, by
//! the token the sink reports it with, with its size, so the relay's bounds hold
//! by count and by bytes.

use std::sync::Arc;

use walbox_outbox::Origin;

use crate::ack::Ticket;

/// One event in flight.
#[derive(Debug)]
struct Entry {
    ticket: Ticket,
    size: usize,
    /// Commit time of the event's transaction (Postgres microseconds), 0 when
    /// unknown (a snapshot row).
    committed: i64,
    /// The outbox table of its row.
    table: Arc<str>,
    /// Which read of the source it comes from (a dead letter that takes its
    /// place keeps it).
    origin: Origin,
}

/// Sink tokens of in-flight events, reusing freed slots.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    entries: Vec<Option<Entry>>,
    free: Vec<usize>,
    bytes: usize,
    count: u64,
}

impl Ledger {
    /// Records an event of `size` bytes from `table`; returns its token.
    pub(crate) fn insert(
        &mut self,
        ticket: Ticket,
        size: usize,
        committed: i64,
        table: Arc<str>,
        origin: Origin,
    ) -> usize {
        self.bytes += size;
        self.count += 1;
        let entry = Some(Entry {
            ticket,
            size,
            committed,
            table,
            origin,
        });
        if let Some(token) = self.free.pop()
            && let Some(slot) = self.entries.get_mut(token)
        {
            *slot = entry;
            return token;
        }
        self.entries.push(entry);
        self.entries.len() - 1
    }

    /// Settles the event of `token`: its ticket, commit time, table and origin.
    pub(crate) fn remove(&mut self, token: usize) -> Option<(Ticket, i64, Arc<str>, Origin)> {
        let entry = self.entries.get_mut(token)?.take()?;
        self.free.push(token);
        self.bytes -= entry.size;
        self.count -= 1;
        Some((entry.ticket, entry.committed, entry.table, entry.origin))
    }

    /// Bytes in flight.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Events in flight.
    pub(crate) fn count(&self) -> u64 {
        self.count
    }
}
