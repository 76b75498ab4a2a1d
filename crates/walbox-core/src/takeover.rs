//! Whether walbox may resume on a server that took over from the one its
//! checkpoint was written on (a promoted standby: a later timeline).
//!
//! A logical slot survives a promotion only as a failover slot that the standby
//! synchronized (PostgreSQL 17: `FAILOVER`, `sync_replication_slots`); the
//! promoted server keeps `synced = true` on it. The standby synchronizes a
//! slot's position only up to the WAL it has, and walbox saves only positions the
//! old primary confirmed, so a synced slot is at or before walbox's checkpoint:
//! streaming from the checkpoint then skips nothing. Where the new timeline
//! forked off is [`check_timeline`](crate::check_timeline)'s question, asked on
//! the replication connection; this one is about the slot.

use walbox_pgoutput::Lsn;

/// The slot as a promoted server shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotOnServer {
    /// Its confirmed position.
    pub confirmed: Lsn,
    /// `synced` (PostgreSQL 17 and later; `None` before): the slot was
    /// synchronized from the old primary.
    pub synced: Option<bool>,
}

/// How walbox takes over on the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Takeover {
    /// The server is on the checkpoint's timeline: no promotion since.
    SameTimeline,
    /// A synchronized slot at or before the checkpoint: resume at the checkpoint.
    Synced,
}

/// Why walbox may not resume on the promoted server.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TakeoverProblem {
    /// The promoted server has no such slot.
    #[error(
        "the server was promoted (timeline {from} to {to}) and has no slot {slot:?}: the standby \
         did not synchronize it (the slot needs failover = true, source.failover; the standby \
         sync_replication_slots = on, hot_standby_feedback = on, a primary_slot_name and a \
         dbname in primary_conninfo; see `walbox doctor --standby`). Outbox events committed \
         from walbox's checkpoint at {checkpoint} on are in no slot"
    )]
    SlotMissing {
        /// The slot's name.
        slot: String,
        /// The checkpoint's timeline.
        from: u32,
        /// The server's timeline.
        to: u32,
        /// The checkpoint's position.
        checkpoint: Lsn,
    },
    /// The slot is at or before the checkpoint but was not synchronized from the
    /// old primary: created or kept on this server by someone else, so nothing
    /// says it holds what walbox needs (its catalog horizon, its decoding start).
    #[error(
        "the server was promoted (timeline {from} to {to}) and its slot {slot:?} at \
         {confirmed} was not synchronized from the old primary (synced is not true): it is \
         not the slot walbox streamed from, and walbox cannot tell whether it can decode \
         every outbox event from its checkpoint at {checkpoint} on"
    )]
    NotSynced {
        /// The slot's name.
        slot: String,
        /// The checkpoint's timeline.
        from: u32,
        /// The server's timeline.
        to: u32,
        /// The slot's position.
        confirmed: Lsn,
        /// The checkpoint's position.
        checkpoint: Lsn,
    },
    /// The server is on an earlier timeline than walbox's checkpoint: not a
    /// promoted standby but a server the history went past.
    #[error(
        "the server is on timeline {server}, earlier than timeline {checkpoint_timeline} of \
         walbox's checkpoint at {checkpoint}: it is an old primary that was not fenced after a \
         failover (still writable, on the timeline it had), or a restored backup. Events it \
         commits are not on the current primary's timeline, and what walbox published from \
         timeline {checkpoint_timeline} is not on it. Fence the old primary (stop it, or make \
         it a standby of the new one) and point walbox at the current primary; for a restored \
         backup, take the checkpoint aside and create a new slot with a snapshot of the rows \
         not yet published"
    )]
    EarlierTimeline {
        /// The server's timeline.
        server: u32,
        /// The checkpoint's timeline.
        checkpoint_timeline: u32,
        /// The checkpoint's position.
        checkpoint: Lsn,
    },
    /// The slot is ahead of the checkpoint.
    #[error(
        "the server was promoted (timeline {from} to {to}) and its slot {slot:?} is at \
         {confirmed}, {kind}, ahead of walbox's checkpoint at {checkpoint}: outbox events \
         committed from {checkpoint} to {confirmed} would never be published",
        kind = if *synced { "synchronized from the old primary" } else {
            "not synchronized from the old primary (created or advanced on this server)"
        }
    )]
    Ahead {
        /// The slot's name.
        slot: String,
        /// The checkpoint's timeline.
        from: u32,
        /// The server's timeline.
        to: u32,
        /// The slot's position.
        confirmed: Lsn,
        /// Whether it was synchronized.
        synced: bool,
        /// The checkpoint's position.
        checkpoint: Lsn,
    },
}

/// Decides whether walbox, with its checkpoint at `checkpoint` on timeline
/// `checkpoint_timeline`, may resume slot `name` on a server on timeline
/// `server_timeline` that shows the slot as `slot` (`None`: no such slot).
///
/// # Errors
/// When the server is on an earlier timeline than the checkpoint's; when, after
/// a promotion, the slot is missing, was not synchronized from the
/// old primary, or is ahead of the checkpoint.
pub fn check_takeover(
    name: &str,
    checkpoint_timeline: u32,
    checkpoint: Lsn,
    server_timeline: u32,
    slot: Option<SlotOnServer>,
) -> Result<Takeover, TakeoverProblem> {
    if server_timeline == checkpoint_timeline {
        return Ok(Takeover::SameTimeline);
    }
    if server_timeline < checkpoint_timeline {
        return Err(TakeoverProblem::EarlierTimeline {
            server: server_timeline,
            checkpoint_timeline,
            checkpoint,
        });
    }
    let (from, to) = (checkpoint_timeline, server_timeline);
    let Some(slot) = slot else {
        return Err(TakeoverProblem::SlotMissing {
            slot: name.to_owned(),
            from,
            to,
            checkpoint,
        });
    };
    let synced = slot.synced == Some(true);
    if slot.confirmed > checkpoint {
        return Err(TakeoverProblem::Ahead {
            slot: name.to_owned(),
            from,
            to,
            confirmed: slot.confirmed,
            synced,
            checkpoint,
        });
    }
    if !synced {
        return Err(TakeoverProblem::NotSynced {
            slot: name.to_owned(),
            from,
            to,
            confirmed: slot.confirmed,
            checkpoint,
        });
    }
    Ok(Takeover::Synced)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lsn(s: &str) -> Lsn {
        s.parse().unwrap()
    }

    fn slot(confirmed: &str, synced: Option<bool>) -> Option<SlotOnServer> {
        Some(SlotOnServer {
            confirmed: lsn(confirmed),
            synced,
        })
    }

    #[test]
    fn without_a_promotion_there_is_nothing_to_check() {
        assert_eq!(
            check_takeover("w", 1, lsn("0/5"), 1, None),
            Ok(Takeover::SameTimeline)
        );
    }

    #[test]
    fn a_synced_slot_at_or_before_the_checkpoint_is_resumed() {
        for at in ["0/3000000", "0/2FFFF00"] {
            assert_eq!(
                check_takeover("w", 1, lsn("0/3000000"), 2, slot(at, Some(true))),
                Ok(Takeover::Synced)
            );
        }
    }

    #[test]
    fn a_slot_not_synchronized_from_the_old_primary_is_refused_even_behind_the_checkpoint() {
        for synced in [Some(false), None] {
            let e =
                check_takeover("w", 1, lsn("0/3000000"), 2, slot("0/2000000", synced)).unwrap_err();
            assert!(matches!(
                e,
                TakeoverProblem::NotSynced { from: 1, to: 2, .. }
            ));
            let text = e.to_string();
            assert!(text.contains("not synchronized"), "{text}");
            assert!(text.contains("checkpoint at 0/3000000"), "{text}");
        }
    }

    #[test]
    fn a_server_on_an_earlier_timeline_is_refused_as_unfenced_or_restored() {
        for slot in [None, slot("0/2000000", Some(true)), slot("0/2000000", None)] {
            let e = check_takeover("w", 2, lsn("0/3000000"), 1, slot).unwrap_err();
            assert_eq!(
                e,
                TakeoverProblem::EarlierTimeline {
                    server: 1,
                    checkpoint_timeline: 2,
                    checkpoint: lsn("0/3000000"),
                }
            );
            let text = e.to_string();
            assert!(!text.contains("promoted from"), "{text}");
            assert!(!text.contains("not synchronized"), "{text}");
            assert!(text.contains("timeline 1"), "{text}");
            assert!(text.contains("timeline 2"), "{text}");
            assert!(text.contains("not fenced"), "{text}");
            assert!(text.contains("backup"), "{text}");
        }
    }

    #[test]
    fn a_missing_slot_after_a_promotion_is_refused_with_the_checkpoint() {
        let e = check_takeover("w", 1, lsn("0/3000000"), 2, None).unwrap_err();
        assert!(matches!(
            e,
            TakeoverProblem::SlotMissing { from: 1, to: 2, .. }
        ));
        let text = e.to_string();
        assert!(text.contains("sync_replication_slots"), "{text}");
        assert!(
            text.contains("from walbox's checkpoint at 0/3000000"),
            "{text}"
        );
    }

    #[test]
    fn a_slot_ahead_of_the_checkpoint_is_refused_with_the_range() {
        for synced in [Some(true), Some(false), None] {
            let e =
                check_takeover("w", 1, lsn("0/3000000"), 2, slot("0/3000100", synced)).unwrap_err();
            let text = e.to_string();
            assert!(text.contains("from 0/3000000 to 0/3000100"), "{text}");
            assert_eq!(
                text.contains("not synchronized"),
                synced != Some(true),
                "{text}"
            );
        }
    }
}
