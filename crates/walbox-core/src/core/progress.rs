//! What the core saves and reports: the acknowledged position within a replay's
//! end and the publication check's limit, the partly acknowledged transaction,
//! when a checkpoint is due, and which position may go to the server (on disk,
//! past the replay window).

use std::time::Instant;

use walbox_pgoutput::Lsn;

use super::{Core, Flushed};
use crate::checkpoint::{Checkpoint, Partial};

/// What the checkpoint's acknowledged prefix is to be.
#[derive(Debug, Clone, Copy)]
enum NextPartial {
    /// The one it records.
    Keep,
    /// None.
    Drop,
    /// This transaction's first `events` events.
    New { commit_lsn: Lsn, events: u64 },
}

impl Core {
    /// The acknowledged position, within a replay's end and the limit.
    fn savable(&self) -> Lsn {
        let mut at = self.tracker.confirmed();
        if let Some(end) = self.stop_at {
            at = at.min(end);
        }
        if let Some(limit) = self.limit {
            at = at.min(limit);
        }
        at
    }

    /// The acknowledged prefix of the oldest unconfirmed transaction, as the
    /// checkpoint is to record it: decided without building a [`Partial`] (it is
    /// asked every turn of the loop; the table list is copied only when a
    /// checkpoint is written).
    fn next_partial(&self, cp: &Checkpoint) -> NextPartial {
        let savable = self.savable();
        let keep_saved = if savable <= cp.lsn {
            NextPartial::Keep
        } else {
            NextPartial::Drop
        };
        if savable < self.tracker.confirmed() {
            // Held back (the publication check's limit): the transactions between
            // the saved position and the partly acknowledged one are sent again
            // in full; only a prefix already recorded for a transaction the saved
            // position has not passed still holds.
            return keep_saved;
        }
        // Only a transaction after the saved position (not one a replay or an
        // earlier --from-lsn sends again).
        let after = cp.lsn.max(savable);
        match self.tracker.partial() {
            Some((commit_lsn, events)) if commit_lsn >= after => {
                let base = self
                    .skipped_base
                    .as_ref()
                    .filter(|b| b.commit_lsn == commit_lsn)
                    .map_or(0, |b| b.events);
                NextPartial::New {
                    commit_lsn,
                    events: base + events,
                }
            }
            // Nothing new acknowledged in it yet: the saved prefix still holds
            // while the position has not moved past its transaction.
            _ => keep_saved,
        }
    }

    /// Whether the checkpoint is behind what could be saved.
    fn checkpoint_dirty(&self) -> bool {
        let Some(cp) = &self.checkpoint else {
            return false;
        };
        if let Some((txn, _)) = self.pending_snapshot {
            return self.tracker.settled(txn);
        }
        if self.snapshot.is_some() {
            return false;
        }
        if self.savable() > cp.lsn {
            return true;
        }
        match self.next_partial(cp) {
            NextPartial::Keep => false,
            NextPartial::Drop => cp.partial.is_some(),
            NextPartial::New { commit_lsn, events } => cp.partial.as_ref().is_none_or(|p| {
                p.commit_lsn != commit_lsn || p.events != events || p.tables != self.tables
            }),
        }
    }

    /// The checkpoint to hand to the writer, when it is behind and the interval
    /// passed since the last one (with `force`, whenever it is behind).
    pub fn checkpoint_due(&mut self, now: Instant, force: bool) -> Option<Checkpoint> {
        if !self.checkpoint_dirty() {
            return None;
        }
        if !force
            && self
                .submitted_at
                .is_some_and(|t| now.saturating_duration_since(t) < self.cfg.checkpoint_every)
        {
            return None;
        }
        let savable = self.savable();
        let settled = self
            .pending_snapshot
            .filter(|(txn, _)| self.tracker.settled(*txn));
        if let Some((_, rows)) = settled {
            if let Some(cp) = self.checkpoint.as_mut()
                && let Some(s) = cp.snapshot.as_mut()
            {
                s.complete = true;
                s.rows = rows;
                // Their rows are published: from here on the slot covers them.
                cp.tables
                    .get_or_insert_with(Default::default)
                    .extend(s.tables.iter().map(|(t, id)| (t.clone(), *id)));
            }
            self.pending_snapshot = None;
            tracing::info!(rows, consistent_point = %savable,
                "snapshot complete: every row acknowledged");
        }
        let next = self
            .checkpoint
            .as_ref()
            .map_or(NextPartial::Keep, |c| self.next_partial(c));
        let waiting = self.pending_snapshot.is_some();
        let tables = &self.tables;
        let cp = self.checkpoint.as_mut()?;
        if !waiting {
            cp.lsn = cp.lsn.max(savable);
            match next {
                NextPartial::Keep => {}
                NextPartial::Drop => cp.partial = None,
                NextPartial::New { commit_lsn, events } => {
                    cp.partial = Some(Partial {
                        commit_lsn,
                        events,
                        tables: tables.clone(),
                    });
                }
            }
        }
        self.submitted_at = Some(now);
        Some(cp.clone())
    }

    /// The checkpoint writer has `lsn` on disk; `snapshot_done` is false while
    /// an initial snapshot is unfinished.
    pub fn on_checkpoint_flushed(&mut self, lsn: Lsn, snapshot_done: bool) {
        self.flushed = Some(Flushed { lsn, snapshot_done });
    }

    /// The position that may be reported to the server: acknowledged, and on
    /// disk in the checkpoint.
    #[must_use]
    pub fn reportable(&self) -> Option<Lsn> {
        let flushed = self.flushed?;
        if self.snapshot_pending() || !flushed.snapshot_done {
            return None;
        }
        Some(self.savable().min(flushed.lsn))
    }

    /// A position to report to the server now, when it is newer than the last
    /// one reported (held back by the replay window).
    pub fn position_to_report(&mut self, now: impl FnOnce() -> Instant) -> Option<Lsn> {
        let acked = self.reportable()?;
        let target = self.holdback.target(now, acked)?;
        (target > self.reported).then(|| {
            self.reported = target;
            target
        })
    }
}
