//! Where a session starts: the checkpoint, the slot and the options against each
//! other, and the server's identity against the checkpoint.

use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use tokio::sync::mpsc;
use walbox_core::{Checkpoint, CheckpointFile};
use walbox_pgoutput::Lsn;

use super::{RunOptions, SlotLost, classify_sql};

/// An error that says the slot is gone or invalidated.
fn slot_lost(e: anyhow::Error) -> anyhow::Error {
    anyhow::Error::new(SlotLost(e))
}
use crate::config::{Config, SnapshotMode};
use crate::slot::SlotInfo;

/// Where a session starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Plan {
    /// Publish the existing rows from an exported snapshot, then stream. Without
    /// `resume`, the slot is created with the snapshot and the stream starts at its
    /// consistent point. With `resume`, the slot of an unfinished snapshot still
    /// holds every change committed after that position (its consistent point):
    /// the snapshot is taken again from a temporary slot and the slot streams
    /// from `resume`.
    Snapshot { resume: Option<Lsn> },
    /// Stream from `start`; the server holds `server_confirmed`.
    Stream { start: Lsn, server_confirmed: Lsn },
}

/// How to recover events that a slot no longer has.
pub(super) const RECOVER: &str = "To publish them, create a new slot with a snapshot of the rows that \
    were not published (`walbox slot drop`, then `walbox setup --snapshot --snapshot-where \
    \"...\"`); logical decoding messages ([[messages]]) are in no table, so no \
    snapshot can bring them back; to continue without them, start once with \
    --accept-slot-position";

/// Decides where to start from the checkpoint, the slot and the options.
pub(super) fn plan(
    config: &Config,
    store: &CheckpointFile,
    saved: Option<&Checkpoint>,
    slot: Option<&SlotInfo>,
    options: &RunOptions,
) -> Result<Plan> {
    let name = &config.source.slot;
    let unfinished = saved.filter(|cp| cp.snapshot_interrupted());
    let Some(slot) = slot else {
        if let Some(cp) = unfinished {
            return snapshot_without_its_slot(name, store, cp, options);
        }
        if let Some(cp) = saved {
            return Err(slot_lost(anyhow!(
                "replication slot {name:?} does not exist, but the checkpoint {} says walbox \
                 published up to {}: the slot was dropped, and outbox events committed while \
                 it was gone are not in any slot. {RECOVER}",
                store.path().display(),
                cp.lsn
            )));
        }
        if config.snapshot.mode == SnapshotMode::Initial {
            return Ok(Plan::Snapshot { resume: None });
        }
        bail!(
            "replication slot {name:?} does not exist; create it with `walbox setup` \
             (`walbox setup --snapshot` also publishes the rows already in the outbox)"
        );
    };
    if slot.plugin.as_deref() != Some("pgoutput") {
        bail!(
            "slot {name:?} uses plugin {:?}, walbox needs pgoutput",
            slot.plugin
        );
    }
    if !slot.same_database {
        bail!("slot {name:?} belongs to another database");
    }
    if let Some(why) = slot.invalidation() {
        let since = saved.map_or_else(
            || "its confirmed position".to_owned(),
            |cp| format!("{} (walbox's checkpoint)", cp.lsn),
        );
        return Err(slot_lost(anyhow!(
            "slot {name:?} is invalidated ({why}), so the slot can never be read again and \
             outbox events committed after {since} may be missing. {RECOVER}"
        )));
    }
    let confirmed = slot
        .confirmed
        .with_context(|| format!("slot {name:?} has no confirmed position"))?;
    if let Some(cp) = unfinished {
        let resume = snapshot_resume(name, store, cp, confirmed, options)?;
        let tables: Vec<&String> = cp
            .snapshot
            .as_ref()
            .map(|s| s.tables.keys().collect())
            .unwrap_or_default();
        if !tables.is_empty() {
            tracing::warn!(
                slot = %name,
                tables = ?tables,
                "a snapshot of outbox tables with a new identity is due; taking it from a \
                 temporary slot, then streaming the slot from {resume} (rows of theirs \
                 committed after that point may be published twice, with the same event ids)"
            );
            return Ok(Plan::Snapshot {
                resume: Some(resume),
            });
        }
        tracing::warn!(
            slot = %name,
            checkpoint = %store.path().display(),
            "the initial snapshot did not finish; taking it again from a temporary slot, then \
             streaming the slot from its consistent point {resume} (rows published already, \
             and events committed after that point, may be published again, with the same \
             event ids)"
        );
        return Ok(Plan::Snapshot {
            resume: Some(resume),
        });
    }
    if saved.is_none()
        && config.snapshot.mode == SnapshotMode::Initial
        && options.from_lsn.is_none()
        && !options.replay
    {
        // The slot was created without a snapshot (by `walbox setup` of an
        // earlier walbox, `walbox slot create`, or by hand): the rows already in
        // the outbox are in no slot.
        tracing::warn!(
            slot = %name,
            position = %confirmed,
            "snapshot.mode = \"initial\", and slot {name:?} exists with no checkpoint of walbox's \
             on it: no snapshot was taken on it, so the rows already in the outbox are not in \
             it; taking the initial snapshot from a temporary slot, then streaming the slot \
             from {confirmed} (rows committed after that point may be published twice, with \
             the same event ids). To stream from the slot without them, set snapshot.mode = \
             \"never\""
        );
        return Ok(Plan::Snapshot {
            resume: Some(confirmed),
        });
    }
    if let Some(from) = options.from_lsn {
        let flag = if options.replay {
            "--from"
        } else {
            "--from-lsn"
        };
        if from < confirmed {
            bail!(
                "{flag} {from} is before slot {name:?}'s confirmed position; the earliest \
                 position still available is {confirmed}"
            );
        }
        // Everything before this was published: the checkpoint, or without one
        // the slot's position.
        let (published, what) = match saved {
            Some(cp) => (
                cp.lsn,
                format!("walbox's checkpoint {}", store.path().display()),
            ),
            None => (confirmed, format!("slot {name:?}'s confirmed position")),
        };
        if from > published {
            if options.replay {
                bail!(
                    "--from {from} is after {what} at {published}: outbox events committed \
                     between {published} and {from} were never published, and replay would \
                     move the checkpoint past them. Replay from {published} or earlier; \
                     `walbox run` publishes what comes after it"
                );
            }
            if !options.accept_skip {
                bail!(
                    "--from-lsn {from} is after {what} at {published}: outbox events committed \
                     between {published} and {from} would never be published. Start without \
                     --from-lsn (or at {published} or earlier) to publish them; to skip them, \
                     add --accept-skip"
                );
            }
            tracing::warn!(from = %from, published = %published,
                "starting at --from-lsn as asked (--accept-skip); outbox events committed \
                 between the published position and it are not published by walbox");
        }
        return Ok(Plan::Stream {
            start: from,
            server_confirmed: confirmed,
        });
    }
    let start = match saved {
        None => confirmed,
        Some(cp) if cp.lsn >= confirmed => {
            if cp.lsn > confirmed {
                tracing::info!(slot = %confirmed, checkpoint = %cp.lsn,
                    "the slot is behind the checkpoint (server crash or replay window); \
                     starting at the checkpoint");
            }
            cp.lsn
        }
        Some(cp) if options.accept_slot_position => {
            tracing::warn!(slot = %confirmed, checkpoint = %cp.lsn,
                "starting at the slot's position as asked (--accept-slot-position); outbox \
                 events committed between the checkpoint and it were not published by walbox");
            confirmed
        }
        Some(cp) => bail!(
            "slot {name:?} is at {confirmed}, ahead of walbox's checkpoint {} at {}: outbox \
             events committed between {} and {confirmed} were never published (the slot was \
             advanced by another reader, or dropped and created again, while walbox was \
             down). {RECOVER}",
            store.path().display(),
            cp.lsn,
            cp.lsn
        ),
    };
    Ok(Plan::Stream {
        start,
        server_confirmed: confirmed,
    })
}

/// An unfinished snapshot whose slot does not exist. Without a recorded
/// consistent point, walbox stopped between saving the checkpoint and creating
/// the slot: the slot is created with a snapshot, as on a first start. With one,
/// the slot was dropped, and the events it held are gone: refused unless the
/// slot position is accepted.
fn snapshot_without_its_slot(
    name: &str,
    store: &CheckpointFile,
    cp: &Checkpoint,
    options: &RunOptions,
) -> Result<Plan> {
    let Some(point) = cp.snapshot.as_ref().and_then(|s| s.consistent_point) else {
        return Ok(Plan::Snapshot { resume: None });
    };
    if !options.accept_slot_position {
        bail!(
            "replication slot {name:?} does not exist, but the checkpoint {} says the initial \
             snapshot created it at {point} and did not finish: the slot was dropped, and \
             outbox events committed after {point} and deleted from the table since are in no \
             slot, so a new snapshot cannot publish them. To take the snapshot again from a \
             new slot without them, start once with --accept-slot-position",
            store.path().display()
        );
    }
    tracing::warn!(slot = %name, consistent_point = %point,
        "the slot of the unfinished snapshot was dropped; taking the snapshot again from a new \
         slot as asked (--accept-slot-position): outbox events committed after the old \
         consistent point and deleted since, and every logical decoding message committed \
         after it, are not published");
    Ok(Plan::Snapshot { resume: None })
}

/// Where the stream of an unfinished snapshot's slot continues: its consistent
/// point. walbox reports no position to the server while a snapshot is
/// unfinished, so the slot is still there. Without a recorded point (walbox
/// stopped between creating the slot and saving the point) it is the slot's
/// confirmed position, which nothing has moved since its creation.
fn snapshot_resume(
    name: &str,
    store: &CheckpointFile,
    cp: &Checkpoint,
    confirmed: Lsn,
    options: &RunOptions,
) -> Result<Lsn> {
    let Some(point) = cp.snapshot.as_ref().and_then(|s| s.consistent_point) else {
        return Ok(confirmed);
    };
    if confirmed > point {
        if options.accept_slot_position {
            tracing::warn!(slot = %confirmed, consistent_point = %point,
                "streaming the unfinished snapshot's slot from its position as asked \
                 (--accept-slot-position); outbox events committed between the consistent \
                 point and it and deleted from the table since, and the logical decoding messages \
                 committed in that gap, are not published");
            return Ok(confirmed);
        }
        bail!(
            "slot {name:?} is at {confirmed}, ahead of the consistent point {point} of the \
             unfinished initial snapshot in {}: outbox events committed between {point} and \
             {confirmed} are no longer in the slot, and those deleted from the table since are \
             in no snapshot either (the slot was advanced by another reader). {RECOVER}",
            store.path().display()
        );
    }
    Ok(point)
}

/// Where `walbox run` would start, for `walbox doctor`: the checkpoint and the
/// slot against each other. `None` when there is neither a slot nor a checkpoint.
pub async fn where_run_starts(
    sql: &tokio_postgres::Client,
    config: &Config,
) -> Result<Option<String>> {
    let store = config.checkpoint_store();
    let saved = store.load()?;
    let slot = crate::slot::info(sql, &config.source.slot).await?;
    if saved.is_none() && slot.is_none() {
        return Ok(None);
    }
    let at = match saved.as_ref() {
        Some(cp) => format!("checkpoint {} at {}", store.path().display(), cp.lsn),
        None => format!("no checkpoint yet at {}", store.path().display()),
    };
    Ok(Some(
        match plan(
            config,
            &store,
            saved.as_ref(),
            slot.as_ref(),
            &RunOptions::default(),
        )? {
            Plan::Snapshot {
                resume: Some(resume),
            } => format!(
                "walbox run takes the snapshot (unfinished, due for tables with a new identity, \
                 or the initial one on a slot created without it) from a temporary slot, then \
                 streams the slot from {resume} ({at})"
            ),
            Plan::Snapshot { resume: None } => {
                format!("walbox run creates the slot with a snapshot ({at})")
            }
            Plan::Stream { start, .. } => format!("walbox run starts at {start} ({at})"),
        },
    ))
}

/// Waits while another reader holds the slot (`--wait-for-slot`); `None` when a
/// stop signal came first.
pub(super) async fn wait_for_slot(
    sql: &tokio_postgres::Client,
    slot: &str,
    mut info: SlotInfo,
    signals: &mut mpsc::UnboundedReceiver<()>,
) -> Result<Option<SlotInfo>> {
    let mut logged = false;
    while let Some(pid) = info.active_pid {
        if !logged {
            tracing::info!(
                slot,
                pid,
                "slot in use; waiting for it to be released (--wait-for-slot)"
            );
            logged = true;
        }
        tokio::select! {
            Some(()) = signals.recv() => return Ok(None),
            () = tokio::time::sleep(SLOT_POLL) => {}
        }
        match crate::slot::info(sql, slot).await.map_err(classify_sql)? {
            Some(next) => info = next,
            None => bail!("slot {slot:?} was dropped while waiting for it"),
        }
    }
    if logged {
        tracing::info!(slot, "slot released; taking over");
    }
    Ok(Some(info))
}

/// How often `--wait-for-slot` looks at the slot.
const SLOT_POLL: Duration = Duration::from_millis(500);

#[cfg(test)]
mod tests {
    use super::*;
    use walbox_core::{CHECKPOINT_VERSION, SnapshotState};

    fn lsn(s: &str) -> Lsn {
        s.parse().unwrap()
    }

    fn cp(at: &str, snapshot: Option<bool>) -> Checkpoint {
        Checkpoint {
            version: CHECKPOINT_VERSION,
            system_identifier: "1".into(),
            database: "postgres".into(),
            slot: "walbox".into(),
            timeline: None,
            lsn: lsn(at),
            partial: None,
            snapshot: snapshot.map(|complete| SnapshotState {
                consistent_point: Some(lsn("0/100")),
                complete,
                rows: 0,
                tables: std::collections::BTreeMap::new(),
            }),
            tables: None,
        }
    }

    fn slot(at: &str) -> SlotInfo {
        SlotInfo {
            plugin: Some("pgoutput".into()),
            same_database: true,
            active_pid: None,
            confirmed: Some(lsn(at)),
            wal_status: Some("reserved".into()),
            ..SlotInfo::default()
        }
    }

    fn config(toml: &str) -> Config {
        Config::parse(toml, std::path::Path::new("t.toml")).unwrap()
    }

    fn planned(
        saved: Option<&Checkpoint>,
        slot: Option<&SlotInfo>,
        options: &RunOptions,
    ) -> Result<Plan> {
        plan(
            &config(""),
            &CheckpointFile::new("cp.json"),
            saved,
            slot,
            options,
        )
    }

    #[test]
    fn starts_at_the_later_of_checkpoint_and_slot_only_when_nothing_was_skipped() {
        let none = RunOptions::default();
        let stream = |start: &str, server: &str| Plan::Stream {
            start: lsn(start),
            server_confirmed: lsn(server),
        };
        // First start: the slot's position.
        assert_eq!(
            planned(None, Some(&slot("0/500")), &none).unwrap(),
            stream("0/500", "0/500")
        );
        // Slot behind the checkpoint (server crash, replay window): the checkpoint.
        assert_eq!(
            planned(Some(&cp("0/900", None)), Some(&slot("0/500")), &none).unwrap(),
            stream("0/900", "0/500")
        );
        // Slot ahead: refused, saying what is missing and how to recover.
        let e = planned(Some(&cp("0/500", None)), Some(&slot("0/900")), &none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("between 0/500 and 0/900 were never published"),
            "{e}"
        );
        assert!(
            e.contains("--accept-slot-position") && e.contains("--snapshot"),
            "{e}"
        );
        let accept = RunOptions {
            accept_slot_position: true,
            ..RunOptions::default()
        };
        assert_eq!(
            planned(Some(&cp("0/500", None)), Some(&slot("0/900")), &accept).unwrap(),
            stream("0/900", "0/900")
        );
        // Slot gone while a checkpoint exists: refused.
        let e = planned(Some(&cp("0/500", None)), None, &none)
            .unwrap_err()
            .to_string();
        assert!(e.contains("was dropped"), "{e}");
        // Lost slot: refused with the checkpoint named.
        let mut lost = slot("0/500");
        lost.wal_status = Some("lost".into());
        let e = planned(Some(&cp("0/500", None)), Some(&lost), &none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("wal_status = lost") && e.contains("0/500 (walbox's checkpoint)"),
            "{e}"
        );
    }

    #[test]
    fn every_invalidation_reason_is_refused_with_its_cause_and_the_recovery() {
        let none = RunOptions::default();
        let refused = |wal_status: &str, reason: Option<&str>, conflicting: Option<bool>| {
            let mut s = slot("0/500");
            s.wal_status = Some(wal_status.into());
            s.invalidation_reason = reason.map(Into::into);
            s.conflicting = conflicting;
            planned(Some(&cp("0/500", None)), Some(&s), &none)
                .unwrap_err()
                .to_string()
        };
        for (reason, cause) in [
            ("wal_removed", "max_slot_wal_keep_size"),
            ("rows_removed", "hot_standby_feedback"),
            ("wal_level_insufficient", "wal_level = logical"),
            ("idle_timeout", "idle_replication_slot_timeout = 0"),
        ] {
            let e = refused("lost", Some(reason), Some(reason != "wal_removed"));
            assert!(
                e.contains(&format!("invalidation_reason = {reason}"))
                    && e.contains(cause)
                    && e.contains("0/500 (walbox's checkpoint)")
                    && e.contains("--snapshot"),
                "{e}"
            );
        }
        // 16 names no reason, only the conflict.
        let e = refused("lost", None, Some(true));
        assert!(e.contains("conflicting = true"), "{e}");
        // A reason without wal_status = lost is still refused.
        let e = refused("reserved", Some("idle_timeout"), None);
        assert!(e.contains("idle_timeout"), "{e}");
        // A usable slot has no invalidation.
        assert!(slot("0/500").invalidation().is_none());
    }

    #[test]
    fn from_lsn_must_still_be_in_the_slot() {
        let from = |at: &str| RunOptions {
            from_lsn: Some(lsn(at)),
            ..RunOptions::default()
        };
        let e = planned(
            Some(&cp("0/900", None)),
            Some(&slot("0/500")),
            &from("0/400"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("earliest position still available is 0/500"),
            "{e}"
        );
        assert_eq!(
            planned(
                Some(&cp("0/900", None)),
                Some(&slot("0/500")),
                &from("0/600")
            )
            .unwrap(),
            Plan::Stream {
                start: lsn("0/600"),
                server_confirmed: lsn("0/500")
            }
        );
    }

    #[test]
    fn from_lsn_after_what_was_published_is_refused_unless_the_skip_is_accepted() {
        let from = |at: &str, accept_skip: bool| RunOptions {
            from_lsn: Some(lsn(at)),
            accept_skip,
            ..RunOptions::default()
        };
        let stream = |start: &str, server: &str| Plan::Stream {
            start: lsn(start),
            server_confirmed: lsn(server),
        };
        // After the checkpoint: the events in between would never go out.
        let e = planned(
            Some(&cp("0/900", None)),
            Some(&slot("0/500")),
            &from("0/A00", false),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("after walbox's checkpoint cp.json at 0/900")
                && e.contains("between 0/900 and 0/A00 would never be published")
                && e.contains("--accept-skip"),
            "{e}"
        );
        // No checkpoint: after the slot's position, the same.
        let e = planned(None, Some(&slot("0/500")), &from("0/600", false))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("after slot \"walbox\"'s confirmed position at 0/500")
                && e.contains("between 0/500 and 0/600 would never be published")
                && e.contains("--accept-skip"),
            "{e}"
        );
        // Accepted: it starts there.
        assert_eq!(
            planned(None, Some(&slot("0/500")), &from("0/600", true)).unwrap(),
            stream("0/600", "0/500")
        );
        assert_eq!(
            planned(
                Some(&cp("0/900", None)),
                Some(&slot("0/500")),
                &from("0/A00", true)
            )
            .unwrap(),
            stream("0/A00", "0/500")
        );
        // At what was published, nothing is skipped.
        assert_eq!(
            planned(None, Some(&slot("0/500")), &from("0/500", false)).unwrap(),
            stream("0/500", "0/500")
        );
        assert_eq!(
            planned(
                Some(&cp("0/900", None)),
                Some(&slot("0/500")),
                &from("0/900", false)
            )
            .unwrap(),
            stream("0/900", "0/500")
        );
    }

    #[test]
    fn replay_names_its_own_flag_and_never_skips() {
        let replay = |at: &str| RunOptions {
            from_lsn: Some(lsn(at)),
            replay: true,
            accept_skip: true,
            ..RunOptions::default()
        };
        let e = planned(
            Some(&cp("0/900", None)),
            Some(&slot("0/500")),
            &replay("0/100"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--from 0/100 is before") && !e.contains("--from-lsn"),
            "{e}"
        );
        let e = planned(
            Some(&cp("0/900", None)),
            Some(&slot("0/500")),
            &replay("0/A00"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--from 0/A00 is after walbox's checkpoint")
                && e.contains("Replay from 0/900 or earlier")
                && !e.contains("--from-lsn")
                && !e.contains("--accept-skip"),
            "{e}"
        );
        assert!(matches!(
            planned(
                Some(&cp("0/900", None)),
                Some(&slot("0/500")),
                &replay("0/600")
            )
            .unwrap(),
            Plan::Stream { .. }
        ));
    }

    #[test]
    fn snapshots_are_taken_for_new_slots_when_asked_and_taken_again_when_unfinished() {
        let none = RunOptions::default();
        let initial = config("[snapshot]\nmode = \"initial\"");
        let store = CheckpointFile::new("cp.json");
        assert_eq!(
            plan(&initial, &store, None, None, &none).unwrap(),
            Plan::Snapshot { resume: None }
        );
        // An existing slot without walbox's checkpoint had no snapshot taken on
        // it: with the initial mode it is not adopted as it is; the snapshot
        // comes from a temporary slot and the slot streams from its position.
        assert_eq!(
            plan(&initial, &store, None, Some(&slot("0/1")), &none).unwrap(),
            Plan::Snapshot {
                resume: Some(lsn("0/1"))
            }
        );
        // Never: the slot streams as it is.
        assert!(matches!(
            planned(None, Some(&slot("0/1")), &none).unwrap(),
            Plan::Stream { .. }
        ));
        // With a checkpoint, the mode no longer matters: walbox started on it.
        assert!(matches!(
            plan(
                &initial,
                &store,
                Some(&cp("0/1", None)),
                Some(&slot("0/1")),
                &none
            )
            .unwrap(),
            Plan::Stream { .. }
        ));
        let e = planned(None, None, &none).unwrap_err().to_string();
        assert!(e.contains("walbox setup"), "{e}");
        // Unfinished, the slot exists: taken again from a temporary slot, and the
        // slot streams from its consistent point (0/100), whatever the mode.
        let unfinished = cp("0/100", Some(false));
        assert_eq!(
            planned(Some(&unfinished), Some(&slot("0/100")), &none).unwrap(),
            Plan::Snapshot {
                resume: Some(lsn("0/100"))
            }
        );
        // The point not recorded yet (stopped between creating the slot and
        // saving it): the slot's position, which nothing moved since.
        let mut unrecorded = cp("0/0", Some(false));
        if let Some(s) = unrecorded.snapshot.as_mut() {
            s.consistent_point = None;
        }
        assert_eq!(
            planned(Some(&unrecorded), Some(&slot("0/180")), &none).unwrap(),
            Plan::Snapshot {
                resume: Some(lsn("0/180"))
            }
        );
        // ... and no slot yet: created with a snapshot, as on a first start.
        assert_eq!(
            planned(Some(&unrecorded), None, &none).unwrap(),
            Plan::Snapshot { resume: None }
        );
        // The slot was dropped or advanced: what it held is gone; refused unless
        // accepted.
        let accept = RunOptions {
            accept_slot_position: true,
            ..RunOptions::default()
        };
        let e = planned(Some(&unfinished), None, &none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the slot was dropped") && e.contains("--accept-slot-position"),
            "{e}"
        );
        assert_eq!(
            planned(Some(&unfinished), None, &accept).unwrap(),
            Plan::Snapshot { resume: None }
        );
        let e = planned(Some(&unfinished), Some(&slot("0/200")), &none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ahead of the consistent point 0/100")
                && e.contains("--accept-slot-position"),
            "{e}"
        );
        assert_eq!(
            planned(Some(&unfinished), Some(&slot("0/200")), &accept).unwrap(),
            Plan::Snapshot {
                resume: Some(lsn("0/200"))
            }
        );
        let mut lost = slot("0/100");
        lost.wal_status = Some("lost".into());
        assert!(planned(Some(&unfinished), Some(&lost), &none).is_err());
        // Finished: stream.
        assert!(matches!(
            planned(Some(&cp("0/100", Some(true))), Some(&slot("0/100")), &none).unwrap(),
            Plan::Stream { .. }
        ));
    }
}
