//! The outbox tables' identities against the checkpoint's record: which tables
//! the slot may be missing rows of, and so need a snapshot before the stream
//! passes them.
//!
//! pgoutput decodes each change against the publication as it was when the
//! change was written. Rows written to a table before it joined the
//! publication (a new table swapped in under the outbox's name, a table added
//! to the configuration, a table dropped from the publication and added again)
//! are in no slot, even when the slot has not passed them yet. The checkpoint
//! records each outbox table's identity ([`TableIdentity`]) while the slot
//! covers it; a table whose identity differs at a start gets a snapshot.

use std::collections::BTreeMap;

use anyhow::Result;
use walbox_core::{Checkpoint, CheckpointFile, TableIdentity};

use crate::config::Config;

/// The tables whose identity changed since the checkpoint recorded them, with
/// the identity each has now, to be read by a snapshot before the stream goes
/// past the first transaction that writes to them.
pub(super) type CatchUp = BTreeMap<String, TableIdentity>;

/// Brings the checkpoint's record of the outbox tables up to date with `current`
/// (the configured tables as they are now) and says which tables need a
/// snapshot. Saves the checkpoint when its record changes.
///
/// - No checkpoint: nothing to compare (the first checkpoint or the initial
///   snapshot records the tables).
/// - A snapshot is due (unfinished): tables that changed since are added to
///   the ones it reads, each with its identity now.
/// - A checkpoint without a record (written before walbox recorded tables):
///   the tables as they are now are recorded.
/// - Otherwise: every configured table whose identity differs from the record
///   (or that the record lacks) is returned; tables no longer configured leave
///   the record (configured again later, they are new).
pub(super) fn reconcile(
    config: &Config,
    store: &CheckpointFile,
    saved: Option<Checkpoint>,
    current: &BTreeMap<String, TableIdentity>,
) -> Result<(Option<Checkpoint>, CatchUp)> {
    let Some(mut cp) = saved else {
        return Ok((None, CatchUp::new()));
    };
    let configured: Vec<String> = config
        .outbox
        .iter()
        .map(|t| {
            let (s, n) = t.qualified();
            format!("{s}.{n}")
        })
        .collect();
    let before = cp.clone();
    let recorded = cp.tables.clone();
    let changed: CatchUp = current
        .iter()
        .filter(|(t, id)| {
            configured.contains(t) && recorded.as_ref().and_then(|r| r.get(*t)) != Some(*id)
        })
        .map(|(t, id)| (t.clone(), *id))
        .collect();
    let mut catch_up = CatchUp::new();
    if let Some(s) = cp.snapshot.as_mut().filter(|s| !s.complete) {
        // Empty: every configured table is read anyway.
        if !s.tables.is_empty() {
            for (t, id) in current.iter().filter(|(t, _)| configured.contains(t)) {
                if s.tables.contains_key(t) || changed.contains_key(t) {
                    s.tables.insert(t.clone(), *id);
                }
            }
        }
    } else if recorded.is_none() {
        tracing::info!(tables = ?current.keys().collect::<Vec<_>>(),
            "recording the outbox tables' identities in the checkpoint");
        cp.tables = Some(current.clone());
    } else {
        for (t, id) in &changed {
            match recorded.as_ref().and_then(|r| r.get(t)) {
                Some(was) => tracing::warn!(table = %t, was = %was, now = %id,
                    "outbox table has a new identity since walbox last streamed (swapped for a \
                     new table, or added to the publication again): the slot has none of its \
                     rows written before then, so walbox takes a snapshot of it before streaming \
                     past its first insert; rows inserted into it and deleted again before now \
                     cannot be published"),
                None => tracing::warn!(table = %t, now = %id,
                    "outbox table is new to this slot (configured since walbox last streamed): \
                     the slot has none of its rows written before it joined the publication, so \
                     walbox takes a snapshot of it before streaming past its first insert; rows \
                     inserted into it and deleted again before now cannot be published"),
            }
        }
        catch_up = changed;
    }
    if let Some(t) = cp.tables.as_mut() {
        t.retain(|t, _| configured.contains(t));
    }
    if cp != before {
        store.save(&cp)?;
    }
    Ok((Some(cp), catch_up))
}

/// A checkpoint written before walbox recorded the tables records them as they
/// are now, before the publication is checked: a table not in the publication
/// yet (swapped, the fix not applied) is recorded without a membership, so the
/// start after the fix finds its new one and takes its snapshot.
pub(super) fn record_if_unrecorded(
    store: &CheckpointFile,
    saved: Option<Checkpoint>,
    current: &BTreeMap<String, TableIdentity>,
) -> Result<Option<Checkpoint>> {
    match saved {
        Some(mut cp) if cp.tables.is_none() && !cp.snapshot_interrupted() => {
            tracing::info!(tables = ?current.keys().collect::<Vec<_>>(),
                "recording the outbox tables' identities in the checkpoint");
            cp.tables = Some(current.clone());
            store.save(&cp)?;
            Ok(Some(cp))
        }
        other => Ok(other),
    }
}

/// The oids each configured table may have in the stream: the one the
/// checkpoint recorded (inserts before a swap), the one a due snapshot reads
/// (its later inserts follow that snapshot) and the one it has now. Another oid
/// under a configured name is a table swapped while walbox streams.
pub(super) fn expected_oids(
    saved: Option<&Checkpoint>,
    current: &BTreeMap<String, TableIdentity>,
) -> Vec<(String, u32)> {
    let mut expected = Vec::new();
    for (t, now) in current {
        expected.push((t.clone(), now.oid));
        let due = saved
            .and_then(|cp| cp.snapshot.as_ref())
            .filter(|s| !s.complete)
            .and_then(|s| s.tables.get(t));
        let recorded = saved
            .and_then(|cp| cp.tables.as_ref())
            .and_then(|r| r.get(t));
        expected.extend(
            due.into_iter()
                .chain(recorded)
                .map(|id| (t.clone(), id.oid)),
        );
    }
    expected
}

#[cfg(test)]
mod tests {
    use super::*;
    use walbox_core::{CHECKPOINT_VERSION, SnapshotState};

    fn config(tables: &[&str]) -> Config {
        let mut text = String::from("[source]\ndsn = \"host=x\"\n");
        for t in tables {
            text.push_str(&format!("[[outbox]]\ntable = \"{t}\"\n"));
        }
        Config::parse(&text, std::path::Path::new("t.toml")).unwrap()
    }

    fn id(oid: u32, membership: u32) -> TableIdentity {
        TableIdentity { oid, membership }
    }

    fn cp(tables: &[(&str, TableIdentity)]) -> Checkpoint {
        Checkpoint {
            version: CHECKPOINT_VERSION,
            system_identifier: "7".into(),
            database: "app".into(),
            slot: "walbox".into(),
            timeline: None,
            lsn: "0/100".parse().unwrap(),
            partial: None,
            snapshot: None,
            tables: Some(tables.iter().map(|(t, i)| ((*t).to_owned(), *i)).collect()),
        }
    }

    fn now(tables: &[(&str, TableIdentity)]) -> BTreeMap<String, TableIdentity> {
        tables.iter().map(|(t, i)| ((*t).to_owned(), *i)).collect()
    }

    #[test]
    fn a_swapped_a_readded_and_a_newly_configured_table_each_need_a_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointFile::new(dir.path().join("cp.json"));
        let config = config(&["public.outbox", "public.a", "public.b", "public.c"]);
        let saved = cp(&[
            ("public.outbox", id(10, 20)),
            ("public.a", id(11, 21)),
            ("public.b", id(12, 22)),
            ("public.gone", id(13, 23)),
        ]);
        let current = now(&[
            ("public.outbox", id(10, 20)),
            ("public.a", id(31, 32)),
            ("public.b", id(12, 33)),
            ("public.c", id(14, 24)),
        ]);
        let (cp, catch_up) = reconcile(&config, &store, Some(saved), &current).unwrap();
        assert_eq!(
            catch_up,
            now(&[
                ("public.a", id(31, 32)),
                ("public.b", id(12, 33)),
                ("public.c", id(14, 24)),
            ])
        );
        // The record keeps the old identities until the snapshot is complete;
        // a table no longer configured leaves it.
        let cp = cp.unwrap();
        let recorded = cp.tables.as_ref().unwrap();
        assert_eq!(recorded.get("public.a"), Some(&id(11, 21)));
        assert!(!recorded.contains_key("public.gone"));
        assert_eq!(store.load().unwrap(), Some(cp));
    }

    #[test]
    fn unchanged_tables_need_nothing_and_leave_the_file_alone() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointFile::new(dir.path().join("cp.json"));
        let config = config(&["public.outbox"]);
        let saved = cp(&[("public.outbox", id(10, 20))]);
        let current = now(&[("public.outbox", id(10, 20))]);
        let (_, catch_up) = reconcile(&config, &store, Some(saved), &current).unwrap();
        assert!(catch_up.is_empty());
        assert_eq!(store.load().unwrap(), None, "nothing to save");
    }

    #[test]
    fn a_checkpoint_without_a_record_records_the_tables_as_they_are() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointFile::new(dir.path().join("cp.json"));
        let config = config(&["public.outbox"]);
        let current = now(&[("public.outbox", id(10, 20))]);
        let mut old = cp(&[]);
        old.tables = None;
        let (cp, catch_up) = reconcile(&config, &store, Some(old), &current).unwrap();
        assert!(catch_up.is_empty());
        assert_eq!(cp.unwrap().tables, Some(current.clone()));
        assert_eq!(store.load().unwrap().unwrap().tables, Some(current));
    }

    #[test]
    fn an_empty_record_is_no_old_file_a_table_it_lacks_needs_a_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointFile::new(dir.path().join("cp.json"));
        // Only [[messages]] before, or the one table replaced by another and a
        // session that ended before the snapshot was marked.
        let config = config(&["public.b"]);
        let current = now(&[("public.b", id(12, 22))]);
        let (first, catch_up) = reconcile(&config, &store, Some(cp(&[])), &current).unwrap();
        assert_eq!(catch_up, current);
        assert_eq!(first.unwrap().tables, Some(BTreeMap::new()));
        let saved = cp(&[("public.a", id(11, 21))]);
        let (saved, catch_up) = reconcile(&config, &store, Some(saved), &current).unwrap();
        assert_eq!(catch_up, current);
        // Saved without a: the next start still finds b missing.
        let (_, again) = reconcile(&config, &store, saved, &current).unwrap();
        assert_eq!(again, current);
    }

    #[test]
    fn an_old_file_records_the_tables_before_the_check_membership_or_not() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointFile::new(dir.path().join("cp.json"));
        let mut old = cp(&[]);
        old.tables = None;
        // The swapped-in table, not in the publication yet.
        let current = now(&[("public.outbox", id(30, 0))]);
        let cp = record_if_unrecorded(&store, Some(old), &current).unwrap();
        assert_eq!(cp.as_ref().unwrap().tables, Some(current.clone()));
        // After the fix it has a membership: a snapshot is due.
        let config = config(&["public.outbox"]);
        let fixed = now(&[("public.outbox", id(30, 31))]);
        let (_, catch_up) = reconcile(&config, &store, cp, &fixed).unwrap();
        assert_eq!(catch_up, fixed);
    }

    #[test]
    fn a_due_snapshot_of_some_tables_takes_in_tables_changed_since() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointFile::new(dir.path().join("cp.json"));
        let config = config(&["public.outbox", "public.a", "public.b"]);
        let mut saved = cp(&[
            ("public.outbox", id(10, 20)),
            ("public.a", id(11, 21)),
            ("public.b", id(12, 22)),
        ]);
        saved.snapshot = Some(SnapshotState {
            consistent_point: Some("0/100".parse().unwrap()),
            complete: false,
            rows: 0,
            tables: now(&[("public.outbox", id(40, 41))]),
        });
        let current = now(&[
            ("public.outbox", id(50, 51)),
            ("public.a", id(11, 21)),
            ("public.b", id(12, 60)),
        ]);
        let (cp, catch_up) = reconcile(&config, &store, Some(saved), &current).unwrap();
        assert!(catch_up.is_empty(), "the due snapshot reads them");
        assert_eq!(
            cp.unwrap().snapshot.unwrap().tables,
            now(&[("public.outbox", id(50, 51)), ("public.b", id(12, 60))])
        );
    }

    #[test]
    fn an_unfinished_initial_snapshot_reads_every_table_anyway() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointFile::new(dir.path().join("cp.json"));
        let config = config(&["public.outbox"]);
        let mut saved = cp(&[]);
        saved.tables = None;
        saved.snapshot = Some(SnapshotState {
            consistent_point: None,
            complete: false,
            rows: 0,
            tables: BTreeMap::new(),
        });
        let current = now(&[("public.outbox", id(10, 20))]);
        let (cp, catch_up) = reconcile(&config, &store, Some(saved), &current).unwrap();
        assert!(catch_up.is_empty());
        let cp = cp.unwrap();
        assert_eq!(cp.tables, None, "recorded when the snapshot completes");
        assert!(cp.snapshot.unwrap().tables.is_empty());
    }
}
