//! A physical standby of a running cluster, built without `pg_basebackup`: a
//! low-level base backup (`pg_backup_start`, a copy of the data directory,
//! `pg_backup_stop` writing `backup_label` into the copy), streaming from the
//! primary through a physical slot. And its promotion.

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::{PgCluster, PgOptions, SERVER_TIMEOUT};
use crate::process::give_to;
use crate::{Result, TestkitError, wait_until_async};

/// Entries of a data directory a base backup leaves out (as `pg_basebackup`
/// does): the server's lock and runtime files, and recovery markers.
const SKIP_FILES: &[&str] = &[
    "postmaster.pid",
    "postmaster.opts",
    "backup_label",
    "tablespace_map",
    "standby.signal",
    "recovery.signal",
    "promote",
];

/// Directories a base backup copies empty: WAL comes from streaming, the rest is
/// reset at start-up. The subdirectories of `pg_wal` are kept (empty), since the
/// server expects `pg_wal/archive_status` and `pg_wal/summaries`.
const EMPTY_DIRS: &[&str] = &[
    "pg_wal",
    "pg_replslot",
    "pg_dynshmem",
    "pg_notify",
    "pg_serial",
    "pg_snapshots",
    "pg_stat_tmp",
    "pg_subtrans",
];

impl PgCluster {
    /// Starts a hot standby of `primary` (which must be running): creates a
    /// physical slot on the primary ([`primary_slot_name`](Self::primary_slot_name)),
    /// takes a low-level base backup into a new cluster directory and starts it
    /// with `standby.signal`, `primary_conninfo` (over the primary's Unix socket,
    /// with a `dbname`, as slot synchronization needs), `primary_slot_name` and
    /// `hot_standby_feedback = on`. `options` are the standby's own settings
    /// (`sync_replication_slots = on`, say); they come after the kit's.
    pub async fn standby_of(primary: &PgCluster, options: PgOptions) -> Result<PgCluster> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let slot = format!(
            "standby_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let db = primary.connect("postgres").await?;
        db.execute(
            "SELECT pg_create_physical_replication_slot($1, true)",
            &[&slot],
        )
        .await?;

        let dir = tempfile::Builder::new()
            .prefix("walbox-pg-standby-")
            .tempdir()
            .map_err(TestkitError::io("creating", std::env::temp_dir()))?;
        let data = dir.path().join("data");
        db.execute("SELECT pg_backup_start('walbox-testkit', true)", &[])
            .await?;
        let copied = copy_data_dir(&primary.data_dir(), &data);
        let row = db
            .query_one(
                "SELECT labelfile, spcmapfile FROM pg_backup_stop(false)",
                &[],
            )
            .await?;
        copied?;
        let label: String = row.get(0);
        let map: Option<String> = row.get(1);
        write(&data.join("backup_label"), &label)?;
        if let Some(map) = map.filter(|m| !m.is_empty()) {
            write(&data.join("tablespace_map"), &map)?;
        }
        write(&data.join("standby.signal"), "")?;
        give_to(primary.user.as_ref(), dir.path())?;

        let mut settings = vec![
            (
                "primary_conninfo".to_owned(),
                format!(
                    "{} application_name={slot}",
                    primary.socket_conninfo("postgres")
                ),
            ),
            ("primary_slot_name".to_owned(), slot.clone()),
            ("hot_standby".to_owned(), "on".to_owned()),
            ("hot_standby_feedback".to_owned(), "on".to_owned()),
        ];
        settings.extend(options.settings);
        let options = PgOptions {
            settings,
            ..options
        };
        let mut standby =
            Self::configure_and_launch(dir, primary.bindir.clone(), primary.user.clone(), options)?;
        standby.primary_slot = Some(slot);
        Ok(standby)
    }

    /// The physical slot on the primary this standby streams through, when it is
    /// one made by [`standby_of`](Self::standby_of).
    #[must_use]
    pub fn primary_slot_name(&self) -> Option<&str> {
        self.primary_slot.as_deref()
    }

    /// Promotes this standby (`pg_promote`) and waits until it accepts writes.
    pub async fn promote(&self) -> Result<()> {
        let db = self.connect("postgres").await?;
        db.execute("SELECT pg_promote(true, 60)", &[]).await?;
        wait_until_async(
            "the promoted standby to accept writes",
            SERVER_TIMEOUT,
            || {
                let db = &db;
                async move {
                    let row = db.query_one("SELECT pg_is_in_recovery()", &[]).await.ok()?;
                    (!row.get::<_, bool>(0)).then_some(())
                }
            },
        )
        .await
    }

    /// Waits until this standby has replayed the primary's WAL up to `lsn`
    /// (`pg_last_wal_replay_lsn`, as text like `0/3000060`).
    pub async fn wait_replayed(&self, lsn: &str, timeout: Duration) -> Result<()> {
        let db = self.connect("postgres").await?;
        wait_until_async("the standby to replay the primary's WAL", timeout, || {
            let db = &db;
            async move {
                let row = db
                    .query_one(
                        "SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn",
                        &[&lsn],
                    )
                    .await
                    .ok()?;
                row.get::<_, Option<bool>>(0).filter(|done| *done).map(drop)
            }
        })
        .await
    }
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(TestkitError::io("writing", path))
}

/// Copies a running server's data directory for a base backup: modes kept,
/// [`SKIP_FILES`] left out, [`EMPTY_DIRS`] without their files. A file the
/// server removes while the copy runs is skipped (WAL replay recreates what
/// matters from the backup's start on).
fn copy_data_dir(from: &Path, to: &Path) -> Result<()> {
    copy_dir(from, to, true, false)
}

fn copy_dir(from: &Path, to: &Path, top: bool, inside_empty: bool) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir(to).map_err(TestkitError::io("creating", to))?;
    let mode = std::fs::metadata(from)
        .map_err(TestkitError::io("reading", from))?
        .permissions()
        .mode();
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode))
        .map_err(TestkitError::io("setting the mode of", to))?;
    let name = from.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let empty = inside_empty || (!top && EMPTY_DIRS.contains(&name));
    let entries = std::fs::read_dir(from).map_err(TestkitError::io("listing", from))?;
    for entry in entries {
        let entry = entry.map_err(TestkitError::io("listing", from))?;
        let path = entry.path();
        let target = to.join(entry.file_name());
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            if empty && name != "pg_wal" {
                continue; // a slot's directory, say
            }
            match copy_dir(&path, &target, false, empty) {
                Err(TestkitError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound => {}
                other => other?,
            }
            continue;
        }
        let file = entry.file_name();
        let file = file.to_str().unwrap_or("");
        if empty || (top && SKIP_FILES.contains(&file)) || file.starts_with("pgsql_tmp") {
            continue;
        }
        match std::fs::copy(&path, &target) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(TestkitError::Io {
                    action: "copying",
                    path,
                    source: e,
                });
            }
        }
    }
    Ok(())
}
