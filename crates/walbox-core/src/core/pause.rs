//! Reading that ends before a table whose identity changed: the first insert
//! into a relation named by [`Core::pause_before`] (the shell planned a snapshot
//! of it), or into a relation of an outbox table's name with an oid the shell did
//! not expect (the table was swapped while walbox streamed). The position stays
//! before that transaction; the shell takes the table's snapshot and streams on.

use walbox_pgoutput::{Oid, Relation};

use super::Core;

impl Core {
    /// Reading ends before the first transaction that inserts into one of
    /// these relations (oid, `schema.name`), as at a replay's end: the
    /// position stays before that transaction. The shell then takes a snapshot
    /// of those tables and streams on from there, so that a key's rows that only
    /// the snapshot has come after its events committed before them. Events of
    /// that transaction already handed to the sink (it inserted into another
    /// outbox first) stay in flight; the transaction is read again after the
    /// snapshot.
    pub fn pause_before(&mut self, relations: impl IntoIterator<Item = (Oid, String)>) {
        self.pause_before = relations.into_iter().collect();
    }

    /// The oids each outbox table (`schema.name`) may have in the stream (the
    /// one the checkpoint recorded, the one a due snapshot reads, the one it has
    /// now). A Relation message of a configured name with another oid, after
    /// one with an expected oid and not one [`pause_before`](Self::pause_before)
    /// names, is a table swapped while walbox streams: its first insert ends
    /// reading as a planned pause does, and [`paused`](Self::paused) says so.
    /// Another oid before any expected one is a table the name had earlier (a
    /// stream that starts before a swap whose snapshot is done): its inserts are
    /// taken. A name given no oid is not checked.
    pub fn expect_tables(&mut self, tables: impl IntoIterator<Item = (String, Oid)>) {
        self.expected.clear();
        self.seen_expected.clear();
        for (table, oid) in tables {
            self.expected.entry(table).or_default().push(oid);
        }
    }

    /// Whether reading ended before an insert into a relation of
    /// [`pause_before`](Self::pause_before).
    #[must_use]
    pub fn paused(&self) -> bool {
        self.paused
    }

    /// A Relation message: another oid under an outbox table's name, after an
    /// expected one in this session, is a table swapped while walbox streams.
    pub(super) fn check_oid(&mut self, r: &Relation) {
        let name = format!("{}.{}", r.namespace, r.name);
        let expected = self.expected.get(&name);
        if expected.is_some_and(|e| e.contains(&r.oid)) {
            self.seen_expected.insert(name);
        } else if !self.pause_before.contains_key(&r.oid)
            && let Some(expected) = expected
            && self.seen_expected.contains(&name)
            && self.table_config(&r.namespace, &r.name).is_some()
        {
            tracing::warn!(table = %name, oid = r.oid, expected = ?expected,
                "an outbox table comes with another oid than walbox recorded (it was swapped \
                 while walbox streamed): reading ends before its first insert, and its snapshot \
                 comes first");
            self.pause_before.insert(r.oid, name);
        }
    }

    /// Ends reading before the open transaction, which inserts into `oid`.
    pub(super) fn pause(&mut self, oid: Oid) {
        let txn = self.txn.take();
        self.held = None;
        self.held_bytes = 0;
        self.paused = true;
        self.reached_end = true;
        let (commit_lsn, sent) = txn.map_or((None, 0), |t| {
            (Some(t.commit_lsn), t.index.saturating_sub(t.skip))
        });
        tracing::info!(
            table = self.pause_before.get(&oid).map_or("", String::as_str),
            oid,
            commit_lsn = ?commit_lsn.map(|l| l.to_string()),
            events_of_it_sent = sent,
            "reading ends before the first transaction that inserts into a table with a new \
             identity; its snapshot comes first"
        );
    }
}
