//! walbox's own durable record of the acknowledged position.
//!
//! The slot's `confirmed_flush_lsn` is not enough on its own: Postgres persists it
//! only at a checkpoint (after a crash the slot can go back and resend), a replay
//! window keeps it behind on purpose, and a slot that was dropped and recreated
//! looks like any other. The checkpoint file says what walbox itself has seen
//! acknowledged, on which cluster and slot, and whether an initial snapshot
//! finished. It is written before a position is reported to the server, so the
//! server never holds a position walbox could forget.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use walbox_pgoutput::Lsn;

/// Format version written into every file.
pub const CHECKPOINT_VERSION: u32 = 1;

/// The saved state of one relay (one slot on one cluster).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    /// [`CHECKPOINT_VERSION`].
    pub version: u32,
    /// The cluster's system identifier (`IDENTIFY_SYSTEM`): a checkpoint never
    /// applies to another cluster.
    pub system_identifier: String,
    /// Database of the slot.
    pub database: String,
    /// Slot name.
    pub slot: String,
    /// The server's timeline when the checkpoint was last adopted or written
    /// (`IDENTIFY_SYSTEM`); absent in files written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<u32>,
    /// Resume position: the commit end LSN of the newest transaction whose
    /// outbox events, and those of all transactions before it, were acknowledged.
    #[serde(with = "lsn_text")]
    pub lsn: Lsn,
    /// Progress inside the transaction after `lsn` (a large one): its first
    /// events that are all acknowledged. A restart skips them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial: Option<Partial>,
    /// The initial snapshot, when walbox created the slot with one; or the
    /// snapshot of outbox tables whose identity changed (see `tables`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<SnapshotState>,
    /// The outbox tables (`schema.name`) the slot has covered since this
    /// position, each with the identity it had then: every insert into that
    /// table (that oid, in that publication membership) committed after `lsn`
    /// is in the slot's stream. A configured table whose identity is another
    /// one now (swapped for a new table, added to the publication afresh, or
    /// configured since) may hold rows the slot never decoded: the next start
    /// takes a snapshot of it before it streams past it. `None` in files
    /// written before it was recorded (then the tables as they are are
    /// recorded); empty when no table is covered (only `[[messages]]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tables: Option<BTreeMap<String, TableIdentity>>,
}

/// What makes an outbox table the one whose inserts the slot decodes: the
/// relation's oid, and the catalog row that puts it in the publication
/// (`pg_publication_rel`, or `pg_publication_namespace` for a schema, or the
/// publication itself when it is `FOR ALL TABLES`). A table dropped from the
/// publication and added again has a new membership; a table renamed away and
/// replaced by a new one of the same name has a new oid. pgoutput decodes a
/// change against the publication as it was when the change was written, so
/// inserts into a table before it (that oid) joined the publication are in no
/// slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableIdentity {
    /// The relation's oid (`pg_class.oid`).
    pub oid: u32,
    /// The oid of the catalog row that makes it a member of the publication.
    pub membership: u32,
}

impl std::fmt::Display for TableIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "oid {} (publication membership {})",
            self.oid, self.membership
        )
    }
}

/// The acknowledged beginning of one transaction: the resume position is the
/// transaction's start, and its first `events` events need not be sent again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Partial {
    /// The transaction's commit LSN, as its Begin message gives it.
    #[serde(with = "lsn_text")]
    pub commit_lsn: Lsn,
    /// Events `0..events` (the `walbox_index` header) are acknowledged.
    pub events: u64,
    /// The outbox tables (`schema.name`, sorted) whose inserts were counted as
    /// events. A restart configured with other tables would count other events,
    /// so it sends the transaction whole instead of skipping. Empty in files
    /// written before it was recorded: treated as different.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tables: Vec<String>,
}

/// Progress of an initial snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotState {
    /// The slot's consistent point; `None` until the slot exists.
    #[serde(with = "opt_lsn_text", default)]
    pub consistent_point: Option<Lsn>,
    /// Every snapshot row was acknowledged. An incomplete snapshot is never
    /// continued: it is taken again (from a temporary slot, while the slot
    /// streams from `consistent_point`), and is complete only when every row of
    /// that new snapshot is acknowledged. Until then the resume position stays
    /// at `consistent_point` and nothing is reported to the server.
    pub complete: bool,
    /// Rows published by the snapshot (when complete).
    pub rows: u64,
    /// The tables the snapshot reads, with the identity each had when it was
    /// planned (read again when it is taken); empty in files written before it
    /// was recorded: every configured table. Once complete, these identities
    /// are recorded in the checkpoint's `tables`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tables: BTreeMap<String, TableIdentity>,
}

impl Checkpoint {
    /// Whether a snapshot was started and did not finish.
    #[must_use]
    pub fn snapshot_interrupted(&self) -> bool {
        self.snapshot.as_ref().is_some_and(|s| !s.complete)
    }
}

/// Why a checkpoint could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file system refused.
    #[error("checkpoint {path}: cannot {op}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was attempted.
        op: &'static str,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not a checkpoint.
    #[error("checkpoint {path} is not valid: {source}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
    /// The file was written by a newer walbox.
    #[error(
        "checkpoint {path} has version {found}; this walbox reads version {CHECKPOINT_VERSION}"
    )]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u32,
    },
}

/// A checkpoint kept in one JSON file, replaced atomically: the new content goes
/// to a temporary file beside it, which is flushed to disk and renamed over the
/// old one, and the directory is flushed so the rename itself survives a crash.
#[derive(Debug, Clone)]
pub struct CheckpointFile {
    path: PathBuf,
}

impl CheckpointFile {
    /// The store at `path` (created on the first save).
    #[must_use]
    pub fn new(path: impl Into<PathBuf>) -> Self {
        CheckpointFile { path: path.into() }
    }

    /// Where the checkpoint lives.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io(&self, op: &'static str) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
        move |source| CheckpointError::Io {
            path: self.path.clone(),
            op,
            source,
        }
    }

    /// The saved checkpoint; `None` when there is none yet.
    pub fn load(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        let text = match fs::read(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(self.io("read")(e)),
        };
        #[derive(Deserialize)]
        struct Versioned {
            version: u32,
        }
        let invalid = |source| CheckpointError::Invalid {
            path: self.path.clone(),
            source,
        };
        let v: Versioned = serde_json::from_slice(&text).map_err(invalid)?;
        if v.version != CHECKPOINT_VERSION {
            return Err(CheckpointError::Version {
                path: self.path.clone(),
                found: v.version,
            });
        }
        serde_json::from_slice(&text).map(Some).map_err(invalid)
    }

    /// Replaces the checkpoint durably.
    pub fn save(&self, checkpoint: &Checkpoint) -> Result<(), CheckpointError> {
        let mut text =
            serde_json::to_vec_pretty(checkpoint).map_err(|source| CheckpointError::Invalid {
                path: self.path.clone(),
                source,
            })?;
        text.push(b'\n');
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let mut tmp_name = self.path.file_name().unwrap_or_default().to_os_string();
        tmp_name.push(".tmp");
        let tmp = dir.join(tmp_name);
        let mut f = File::create(&tmp).map_err(self.io("create its temporary file"))?;
        f.write_all(&text).map_err(self.io("write"))?;
        f.sync_all().map_err(self.io("flush to disk"))?;
        drop(f);
        fs::rename(&tmp, &self.path).map_err(self.io("replace"))?;
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(self.io("flush its directory"))?;
        Ok(())
    }

    /// Deletes the checkpoint (no error when there is none).
    pub fn remove(&self) -> Result<(), CheckpointError> {
        match fs::remove_file(&self.path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(self.io("remove")(e)),
            _ => Ok(()),
        }
    }
}

mod lsn_text {
    use serde::{Deserialize, Deserializer, Serializer};
    use walbox_pgoutput::Lsn;

    pub fn serialize<S: Serializer>(lsn: &Lsn, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(lsn)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Lsn, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

mod opt_lsn_text {
    use serde::{Deserialize, Deserializer, Serializer};
    use walbox_pgoutput::Lsn;

    #[allow(clippy::ref_option)] // the signature serde's `with` expects
    pub fn serialize<S: Serializer>(lsn: &Option<Lsn>, s: S) -> Result<S::Ok, S::Error> {
        match lsn {
            Some(l) => s.collect_str(l),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Lsn>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|t| t.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Checkpoint {
        Checkpoint {
            version: CHECKPOINT_VERSION,
            system_identifier: "7380000000000000001".into(),
            database: "postgres".into(),
            slot: "walbox".into(),
            timeline: None,
            lsn: "0/16B3748".parse().unwrap(),
            partial: Some(Partial {
                commit_lsn: "0/16B4000".parse().unwrap(),
                events: 7,
                tables: vec!["public.outbox".into()],
            }),
            snapshot: Some(SnapshotState {
                consistent_point: Some("0/16B0000".parse().unwrap()),
                complete: false,
                rows: 0,
                tables: BTreeMap::from([(
                    "public.outbox".into(),
                    TableIdentity {
                        oid: 16_390,
                        membership: 16_401,
                    },
                )]),
            }),
            tables: Some(BTreeMap::from([(
                "public.outbox".into(),
                TableIdentity {
                    oid: 16_384,
                    membership: 16_395,
                },
            )])),
        }
    }

    #[test]
    fn saves_and_loads_and_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointFile::new(dir.path().join("cp.json"));
        assert_eq!(store.load().unwrap(), None);
        let mut cp = sample();
        store.save(&cp).unwrap();
        assert_eq!(store.load().unwrap(), Some(cp.clone()));
        assert!(cp.snapshot_interrupted());
        cp.lsn = "1/0".parse().unwrap();
        cp.snapshot = None;
        store.save(&cp).unwrap();
        assert_eq!(store.load().unwrap(), Some(cp));
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("cp.json")],
            "no temporary file left"
        );
        let text = fs::read_to_string(store.path()).unwrap();
        assert!(text.contains("\"lsn\": \"1/0\""), "{text}");
        store.remove().unwrap();
        assert_eq!(store.load().unwrap(), None);
        store.remove().unwrap();
    }

    #[test]
    fn refuses_damaged_unknown_and_newer_files() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointFile::new(dir.path().join("cp.json"));
        fs::write(store.path(), b"{\"version\": 1, \"lsn\": ").unwrap();
        assert!(matches!(store.load(), Err(CheckpointError::Invalid { .. })));
        let mut v = serde_json::to_value(sample()).unwrap();
        v["extra"] = 1.into();
        fs::write(store.path(), v.to_string()).unwrap();
        let e = store.load().unwrap_err().to_string();
        assert!(e.contains("extra"), "{e}");
        v = serde_json::to_value(sample()).unwrap();
        v["version"] = 2.into();
        fs::write(store.path(), v.to_string()).unwrap();
        assert!(matches!(
            store.load(),
            Err(CheckpointError::Version { found: 2, .. })
        ));
        v["version"] = 1.into();
        v["lsn"] = "zz".into();
        fs::write(store.path(), v.to_string()).unwrap();
        assert!(matches!(store.load(), Err(CheckpointError::Invalid { .. })));
    }

    #[test]
    fn files_written_before_table_identities_load_without_them() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointFile::new(dir.path().join("cp.json"));
        let mut v = serde_json::to_value(sample()).unwrap();
        v.as_object_mut().unwrap().remove("tables");
        v["snapshot"].as_object_mut().unwrap().remove("tables");
        fs::write(store.path(), v.to_string()).unwrap();
        let cp = store.load().unwrap().unwrap();
        assert!(cp.tables.is_none(), "not recorded, not empty");
        assert!(cp.snapshot.unwrap().tables.is_empty());
        let text = serde_json::to_string(&sample()).unwrap();
        assert!(
            text.contains(r#""tables":{"public.outbox":{"oid":16384,"membership":16395}}"#),
            "{text}"
        );
    }
}
