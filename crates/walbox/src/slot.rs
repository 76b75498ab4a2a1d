//! The replication slot as the server shows it. Every query of
//! `pg_replication_slots` (and of `pg_stat_replication` for the slot's reader)
//! lives here, with the typed rows walbox reads from them: [`SlotInfo`] for the
//! decisions of `run`, `replay`, `setup` and `doctor`, [`SlotStatus`] for
//! `walbox slot status | list`, [`SlotReader`] for the stall probe. A column
//! that some PostgreSQL versions add or change is read here, in one place, and
//! given a field of these structs.

use anyhow::{Context, Result};
use walbox_pgoutput::Lsn;

/// The slot as walbox's decisions need it.
#[derive(Debug, Clone)]
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
}

/// Reads slot `slot`; `None` when it does not exist.
pub async fn info(sql: &tokio_postgres::Client, slot: &str) -> Result<Option<SlotInfo>> {
    let row = sql
        .query_opt(
            "SELECT plugin::text, database = current_database(), active_pid,
                    confirmed_flush_lsn::text, wal_status
             FROM pg_replication_slots WHERE slot_name = $1",
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
        })
    })
    .transpose()
}

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
}

const STATUS_QUERY: &str = "
    SELECT slot_name::text, plugin::text, database::text, active_pid,
           confirmed_flush_lsn::text, restart_lsn::text, wal_status,
           (pg_current_wal_lsn() - restart_lsn)::bigint,
           (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint, safe_wal_size
    FROM pg_replication_slots WHERE slot_type = 'logical'";

fn status_row(r: &tokio_postgres::Row) -> SlotStatus {
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
    }
}

/// The logical slot `slot`; `None` when it does not exist.
pub async fn status(sql: &tokio_postgres::Client, slot: &str) -> Result<Option<SlotStatus>> {
    Ok(sql
        .query_opt(&format!("{STATUS_QUERY} AND slot_name = $1"), &[&slot])
        .await
        .context("reading pg_replication_slots")?
        .as_ref()
        .map(status_row))
}

/// Every logical slot of the server, by name.
pub async fn list(sql: &tokio_postgres::Client) -> Result<Vec<SlotStatus>> {
    let rows = sql
        .query(&format!("{STATUS_QUERY} ORDER BY slot_name"), &[])
        .await
        .context("reading pg_replication_slots")?;
    Ok(rows.iter().map(status_row).collect())
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
