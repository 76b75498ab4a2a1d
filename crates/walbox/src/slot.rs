//! The replication slot as the server shows it. Every query of
//! `pg_replication_slots` (and of `pg_stat_replication` for the slot's reader)
//! lives here, with the typed rows walbox reads from them: [`SlotInfo`] for the
//! decisions of `run`, `replay`, `setup` and `doctor`, [`SlotStatus`] for
//! `walbox slot status | list`, [`SlotReader`] for the stall probe. A column
//! that some PostgreSQL versions add or change is read here, in one place, and
//! given a field of these structs: [`Columns`] says which the server has.

use anyhow::{Context, Result};
use walbox_pgoutput::Lsn;

/// The columns of `pg_replication_slots` that depend on the server's major
/// version, from its `server_version_num`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Columns {
    /// `server_version_num`, e.g. 170004.
    pub version_num: i32,
}

impl Columns {
    /// Asks the server for its version.
    pub async fn of(sql: &tokio_postgres::Client) -> Result<Self> {
        let version_num = sql
            .query_one("SELECT current_setting('server_version_num')::int", &[])
            .await
            .context("reading server_version_num")?
            .get(0);
        Ok(Columns { version_num })
    }

    /// `conflicting` (16+).
    pub fn conflicting(self) -> bool {
        self.version_num >= 160_000
    }

    /// `failover`, `synced`, `inactive_since` and `invalidation_reason` (17+).
    pub fn failover(self) -> bool {
        self.version_num >= 170_000
    }

    /// `two_phase_at` (18+).
    pub fn two_phase_at(self) -> bool {
        self.version_num >= 180_000
    }

    /// The select list of the version-dependent columns, in this order:
    /// `conflicting`, `failover`, `synced`, `inactive_since`,
    /// `invalidation_reason`, `two_phase_at`; NULL where the server has none.
    fn select(self) -> String {
        let col = |present: bool, name: &str, ty: &str| {
            if present {
                format!("{name}{}", if ty == "text" { "::text" } else { "" })
            } else {
                format!("NULL::{ty}")
            }
        };
        [
            col(self.conflicting(), "conflicting", "bool"),
            col(self.failover(), "failover", "bool"),
            col(self.failover(), "synced", "bool"),
            col(self.failover(), "inactive_since", "text"),
            col(self.failover(), "invalidation_reason", "text"),
            col(self.two_phase_at(), "two_phase_at", "text"),
        ]
        .join(", ")
    }
}

/// The slot as walbox's decisions need it.
#[derive(Debug, Clone, Default)]
pub struct SlotInfo {
    /// Output plugin (walbox needs `pgoutput`).
    pub plugin: Option<String>,
    /// Whether the slot belongs to the connection's database.
    pub same_database: bool,
    /// The process reading the slot, if any.
    pub active_pid: Option<i32>,
    /// The confirmed flush position.
    pub confirmed: Option<Lsn>,
    /// `reserved`, `extended`, `unreserved` or `lost` (invalidated).
    pub wal_status: Option<String>,
    /// Invalidated by a conflict with recovery (16+; `None` before).
    pub conflicting: Option<bool>,
    /// Why the server invalidated the slot (17+): `wal_removed`,
    /// `rows_removed`, `wal_level_insufficient`, `idle_timeout` (18+).
    pub invalidation_reason: Option<String>,
    /// Whether the slot is synchronized to standbys (17+).
    pub failover: Option<bool>,
    /// Whether this is a standby's copy synchronized from the primary (17+).
    pub synced: Option<bool>,
    /// Since when nobody has read the slot (17+), as the server writes it.
    pub inactive_since: Option<String>,
}

impl SlotInfo {
    /// Why the slot can no longer be read, when the server invalidated it: the
    /// reason as the server names it and what caused it; `None` for a usable
    /// slot.
    pub fn invalidation(&self) -> Option<String> {
        let lost = self.wal_status.as_deref() == Some("lost");
        if !lost && self.invalidation_reason.is_none() {
            return None;
        }
        let status = self
            .wal_status
            .as_deref()
            .map_or_else(String::new, |s| format!("wal_status = {s}, "));
        Some(match self.invalidation_reason.as_deref() {
            Some("wal_removed") => format!(
                "{status}invalidation_reason = wal_removed: the server removed WAL the slot still \
                 needed (max_slot_wal_keep_size)"
            ),
            Some("rows_removed") => format!(
                "{status}invalidation_reason = rows_removed: the server removed catalog rows the \
                 slot still needed (on a standby: turn on hot_standby_feedback and stream \
                 through a physical slot on the primary)"
            ),
            Some("wal_level_insufficient") => format!(
                "{status}invalidation_reason = wal_level_insufficient: wal_level on the primary \
                 was set below logical; set wal_level = logical there"
            ),
            Some("idle_timeout") => format!(
                "{status}invalidation_reason = idle_timeout: nobody read the slot for longer \
                 than idle_replication_slot_timeout and a checkpoint invalidated it; before \
                 creating the slot again, set idle_replication_slot_timeout = 0 or longer than \
                 walbox may ever be stopped"
            ),
            Some(other) => format!("{status}invalidation_reason = {other}"),
            None if self.conflicting == Some(true) => format!(
                "{status}conflicting = true: the server removed catalog rows the slot still \
                 needed, or wal_level on the primary was set below logical"
            ),
            None => format!(
                "{status}the server removed WAL the slot still needed (max_slot_wal_keep_size)"
            ),
        })
    }
}

/// Reads slot `slot`; `None` when it does not exist.
pub async fn info(sql: &tokio_postgres::Client, slot: &str) -> Result<Option<SlotInfo>> {
    let columns = Columns::of(sql).await?;
    let row = sql
        .query_opt(
            &format!(
                "SELECT plugin::text, database = current_database(), active_pid,
                        confirmed_flush_lsn::text, wal_status, {}
                 FROM pg_replication_slots WHERE slot_name = $1",
                columns.select()
            ),
            &[&slot],
        )
        .await
        .context("reading pg_replication_slots")?;
    row.map(|r| {
        let confirmed: Option<String> = r.get(3);
        Ok(SlotInfo {
            plugin: r.get(0),
            same_database: r.get::<_, Option<bool>>(1) == Some(true),
            active_pid: r.get(2),
            confirmed: confirmed
                .map(|c| c.parse())
                .transpose()
                .context("slot position")?,
            wal_status: r.get(4),
            conflicting: r.get(5),
            failover: r.get(6),
            synced: r.get(7),
            inactive_since: r.get(8),
            invalidation_reason: r.get(9),
        })
    })
    .transpose()
}

/// A column some PostgreSQL versions do not have: `None` when the server has
/// no such column (left out of `--json`), `Some(None)` when its value is NULL.
pub type Column<T> = Option<Option<T>>;

/// One logical slot as `walbox slot status` / `list` show it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SlotStatus {
    /// Its name.
    pub slot: String,
    /// Output plugin.
    pub plugin: Option<String>,
    /// Its database.
    pub database: Option<String>,
    /// The process reading it, if any.
    pub active_pid: Option<i32>,
    /// Confirmed flush position, as the server writes it.
    pub confirmed_flush_lsn: Option<String>,
    /// The oldest WAL it may still need, as the server writes it.
    pub restart_lsn: Option<String>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// WAL the slot keeps on the server's disk: current WAL position - restart_lsn.
    pub retained_wal_bytes: Option<i64>,
    /// How far the confirmed position is behind the server's WAL end.
    pub lag_bytes: Option<i64>,
    /// WAL that can still be written before the slot is lost (`safe_wal_size`;
    /// none without `max_slot_wal_keep_size`).
    pub safe_wal_size: Option<i64>,
    /// Invalidated by a conflict with recovery (16+).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conflicting: Column<bool>,
    /// Synchronized to standbys (17+).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failover: Column<bool>,
    /// A standby's copy synchronized from the primary (17+).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub synced: Column<bool>,
    /// Since when nobody has read it (17+).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inactive_since: Column<String>,
    /// Why the server invalidated it (17+).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invalidation_reason: Column<String>,
    /// Where two-phase decoding was enabled (18+).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub two_phase_at: Column<String>,
}

fn status_query(columns: Columns) -> String {
    format!(
        "SELECT slot_name::text, plugin::text, database::text, active_pid,
                confirmed_flush_lsn::text, restart_lsn::text, wal_status,
                (pg_current_wal_lsn() - restart_lsn)::bigint,
                (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint, safe_wal_size, {}
         FROM pg_replication_slots WHERE slot_type = 'logical'",
        columns.select()
    )
}

fn status_row(columns: Columns, r: &tokio_postgres::Row) -> SlotStatus {
    let when = |present: bool| present.then_some(());
    SlotStatus {
        slot: r.get(0),
        plugin: r.get(1),
        database: r.get(2),
        active_pid: r.get(3),
        confirmed_flush_lsn: r.get(4),
        restart_lsn: r.get(5),
        wal_status: r.get(6),
        retained_wal_bytes: r.get(7),
        lag_bytes: r.get(8),
        safe_wal_size: r.get(9),
        conflicting: when(columns.conflicting()).map(|()| r.get(10)),
        failover: when(columns.failover()).map(|()| r.get(11)),
        synced: when(columns.failover()).map(|()| r.get(12)),
        inactive_since: when(columns.failover()).map(|()| r.get(13)),
        invalidation_reason: when(columns.failover()).map(|()| r.get(14)),
        two_phase_at: when(columns.two_phase_at()).map(|()| r.get(15)),
    }
}

/// The logical slot `slot`; `None` when it does not exist.
pub async fn status(sql: &tokio_postgres::Client, slot: &str) -> Result<Option<SlotStatus>> {
    let columns = Columns::of(sql).await?;
    Ok(sql
        .query_opt(
            &format!("{} AND slot_name = $1", status_query(columns)),
            &[&slot],
        )
        .await
        .context("reading pg_replication_slots")?
        .map(|r| status_row(columns, &r)))
}

/// Every logical slot of the server, by name.
pub async fn list(sql: &tokio_postgres::Client) -> Result<Vec<SlotStatus>> {
    let columns = Columns::of(sql).await?;
    let rows = sql
        .query(
            &format!("{} ORDER BY slot_name", status_query(columns)),
            &[],
        )
        .await
        .context("reading pg_replication_slots")?;
    Ok(rows.iter().map(|r| status_row(columns, r)).collect())
}

/// Creates logical slot `slot` with pgoutput; returns its position as the
/// server writes it.
pub async fn create(sql: &tokio_postgres::Client, slot: &str) -> Result<String> {
    let row = sql
        .query_one(
            "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .with_context(|| format!("creating replication slot {slot}"))?;
    Ok(row.get(0))
}

/// Drops slot `slot`.
pub async fn drop(sql: &tokio_postgres::Client, slot: &str) -> Result<()> {
    sql.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await
        .with_context(|| format!("dropping slot {slot}"))?;
    Ok(())
}

/// `(max_replication_slots, slots in use)`.
pub async fn slots_in_use(sql: &tokio_postgres::Client) -> Result<(i64, i64)> {
    let row = sql
        .query_one(
            "SELECT current_setting('max_replication_slots')::bigint,
                    (SELECT count(*) FROM pg_replication_slots)",
            &[],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// `(max_wal_senders, walsenders running)`.
pub async fn senders_in_use(sql: &tokio_postgres::Client) -> Result<(i64, i64)> {
    let row = sql
        .query_one(
            "SELECT current_setting('max_wal_senders')::bigint,
                    (SELECT count(*) FROM pg_stat_replication)",
            &[],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// The walsender reading a slot.
#[derive(Debug, Clone, Copy)]
pub struct SlotReader {
    /// Its process id.
    pub pid: i32,
    /// Seconds since it last processed a status update from its client (1e9
    /// when it never did).
    pub since_reply_secs: f64,
}

/// The walsender reading slot `slot`; `None` when the slot does not exist or
/// nobody reads it.
pub async fn reader(sql: &tokio_postgres::Client, slot: &str) -> Result<Option<SlotReader>> {
    let row = sql
        .query_opt(
            "SELECT s.active_pid,
                    coalesce(extract(epoch FROM now() - r.reply_time), 1e9)::float8
             FROM pg_replication_slots s
             LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
             WHERE s.slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.and_then(|r| {
        r.get::<_, Option<i32>>(0).map(|pid| SlotReader {
            pid,
            since_reply_secs: r.get(1),
        })
    }))
}
