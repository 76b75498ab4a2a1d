//! The initial snapshot as the core sees it: one transaction at the stream's
//! start whose events carry the snapshot's own position, complete once every
//! row is acknowledged.

use walbox_outbox::{Mapper, Position};
use walbox_pgoutput::{Lsn, TupleValue};

use std::collections::BTreeMap;
use std::sync::Arc;

use super::poison::map_row;
use super::{Core, Provenance};
use crate::ack::AckTracker;
use crate::checkpoint::TableIdentity;
use crate::error::CoreError;

impl Core {
    /// A snapshot taken at `point` is about to be published, as one transaction
    /// whose events carry positions `(point, 0..)`; the stream then continues
    /// from `stream_start` (the slot's consistent point, at or before `point`).
    pub fn begin_snapshot(&mut self, stream_start: Lsn, point: Lsn) {
        self.tracker = AckTracker::new(stream_start);
        let txn = self.tracker.begin(stream_start);
        self.snapshot = Some((txn, point, 0));
    }

    /// One row of the snapshot, mapped with `mapper`.
    ///
    /// # Errors
    /// Outside a snapshot; a poison row under the stop policy.
    pub fn snapshot_row(&mut self, mapper: &Mapper, row: &[TupleValue]) -> Result<(), CoreError> {
        let (txn, point, index) = self
            .snapshot
            .as_mut()
            .ok_or(CoreError::Protocol("snapshot row outside a snapshot"))?;
        let position = Position {
            commit_lsn: *point,
            index: *index,
            xid: 0,
        };
        *index = index.saturating_add(1);
        let txn = *txn;
        let point = position.commit_lsn;
        let (event, dead_letter) = map_row(
            mapper,
            row,
            position,
            None,
            &self.cfg,
            &mut self.stats.dead_lettered,
        )?;
        let table = match &self.snapshot_table {
            Some(t) if **t == *mapper.table() => Arc::clone(t),
            _ => {
                let t: Arc<str> = Arc::from(mapper.table());
                self.snapshot_table = Some(Arc::clone(&t));
                t
            }
        };
        let origin = Provenance {
            table,
            dead_letter,
            replaces: false,
        };
        self.queue(
            event,
            txn,
            0,
            origin,
            walbox_outbox::Origin::Snapshot { point },
        );
        Ok(())
    }

    /// The tables the snapshot read, with the identity each had in it: once
    /// every row is acknowledged, the checkpoint records them as covered by the
    /// slot from the stream's start on.
    pub fn snapshot_tables(&mut self, tables: BTreeMap<String, TableIdentity>) {
        if let Some(s) = self.checkpoint.as_mut().and_then(|c| c.snapshot.as_mut()) {
            s.tables = tables;
        }
    }

    /// Every row of the snapshot was read (`rows` of them); it is complete once
    /// all are acknowledged.
    pub fn end_snapshot(&mut self, rows: u64) {
        if let Some((txn, _, _)) = self.snapshot.take() {
            let start = self.tracker.confirmed();
            self.tracker.commit(txn, start);
            self.pending_snapshot = Some((txn, rows));
        }
    }
}
