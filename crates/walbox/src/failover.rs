//! Failover slots (PostgreSQL 17 and later): `source.failover` makes walbox's
//! slot one that a standby with `sync_replication_slots = on` keeps in sync, so
//! that the slot, and walbox's position in it, survive the standby's promotion.
//! Here: the server's version, the slot's `failover` and `synced` columns,
//! turning `failover` on for an existing slot (`ALTER_REPLICATION_SLOT`, a
//! replication command), and the warning when the primary does not wait for a
//! standby (`synchronized_standby_slots`).

use anyhow::{Context, Result, bail};

use crate::config::Config;
use crate::pg::ConnParams;

/// The first major version with failover slots.
pub const FAILOVER_SINCE: u32 = 17;

/// The server's major version (`server_version_num` / 10000).
pub async fn server_major(sql: &tokio_postgres::Client) -> Result<u32> {
    let row = sql
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .context("reading server_version_num")?;
    let num: i32 = row.get(0);
    Ok(u32::try_from(num / 10_000).unwrap_or(0))
}

/// The risk of a failover slot on a primary whose `synchronized_standby_slots`
/// (`waited`; `None` before PostgreSQL 17) names no standby: logical decoding is
/// not held back until a standby has the WAL, so walbox can publish events a
/// standby never received, which a promotion then loses from the table (phantom
/// events). `None` when there is nothing to say.
pub fn unwaited_standby_risk(waited: Option<&str>) -> Option<String> {
    let waited = waited?;
    if waited
        .split(',')
        .any(|n| !n.trim().trim_matches('"').is_empty())
    {
        return None;
    }
    Some(
        "source.failover is on but the primary's synchronized_standby_slots is empty: \
         walbox can publish events that no standby has received yet, and after a \
         promotion those events are not in the new primary's table (the takeover check \
         only catches a standby behind walbox's checkpoint). Set synchronized_standby_slots \
         on the primary to the standby's physical slot (ALTER SYSTEM SET \
         synchronized_standby_slots = '<slot>', then reload), which holds logical decoding \
         back until the standby has the WAL; `walbox doctor --standby DSN` checks the rest"
            .to_owned(),
    )
}

/// `synchronized_standby_slots` of the server; `None` before PostgreSQL 17.
pub async fn waited_standby_slots(
    sql: &tokio_postgres::Client,
    major: u32,
) -> Result<Option<String>> {
    if major < FAILOVER_SINCE {
        return Ok(None);
    }
    let row = sql
        .query_one(
            "SELECT current_setting('synchronized_standby_slots', true)",
            &[],
        )
        .await
        .context("reading synchronized_standby_slots")?;
    Ok(row.get(0))
}

/// Refuses `source.failover` on a server without failover slots.
pub fn require_support(major: u32) -> Result<()> {
    if major < FAILOVER_SINCE {
        bail!(
            "source.failover (--failover) needs PostgreSQL {FAILOVER_SINCE} or later: the \
             server is PostgreSQL {major}, whose logical slots do not survive the promotion of \
             a standby. Upgrade the server to {FAILOVER_SINCE}+ (and set up a standby with \
             sync_replication_slots = on), or set source.failover = false"
        );
    }
    Ok(())
}

/// With `source.failover`: refuses an older server, and turns `failover` on for
/// the slot when it exists without it. Returns whether it did. The slot must be
/// free (`ALTER_REPLICATION_SLOT` takes it for a moment).
pub async fn ensure(
    conn: &ConnParams,
    sql: &tokio_postgres::Client,
    config: &Config,
) -> Result<bool> {
    if !config.source.failover {
        return Ok(false);
    }
    let major = server_major(sql).await?;
    require_support(major)?;
    // On a primary; a standby's own setting says nothing.
    let in_recovery: bool = sql
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await
        .context("reading pg_is_in_recovery()")?
        .get(0);
    if !in_recovery
        && let Some(risk) =
            unwaited_standby_risk(waited_standby_slots(sql, major).await?.as_deref())
    {
        tracing::warn!(slot = %config.source.slot, "{risk}");
    }
    let slot = &config.source.slot;
    match crate::slot::info(sql, slot).await? {
        Some(s) if s.failover == Some(false) => {
            enable(conn, config).await?;
            tracing::info!(slot = %slot, "turned failover on for the slot (standbys with \
                sync_replication_slots = on now keep it in sync)");
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// `ALTER_REPLICATION_SLOT slot (FAILOVER true)` on a replication connection.
async fn enable(conn: &ConnParams, config: &Config) -> Result<()> {
    let slot = &config.source.slot;
    let cfg = conn
        .replication(slot, &config.source.publication)?
        .with_application_name("walbox failover");
    let mut client = pgwire_replication::ReplicationClient::connect_gated(cfg)
        .await
        .with_context(|| format!("replication connection to {}", conn.describe()))?;
    client
        .simple_query(&format!(
            "ALTER_REPLICATION_SLOT {} (FAILOVER true)",
            crate::catalog::ident(slot)
        ))
        .await
        .with_context(|| {
            format!(
                "turning failover on for slot {slot} (ALTER_REPLICATION_SLOT; the slot must \
                 not be in use)"
            )
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_primary_that_waits_for_no_standby_is_a_risk_named_by_its_setting() {
        for empty in ["", " ", "\"\""] {
            let risk = unwaited_standby_risk(Some(empty)).unwrap();
            assert!(risk.contains("synchronized_standby_slots"), "{risk}");
            assert!(risk.contains("not in the new primary's table"), "{risk}");
        }
        assert_eq!(unwaited_standby_risk(Some("standby1")), None);
        assert_eq!(unwaited_standby_risk(Some("a, b")), None);
        // Before PostgreSQL 17 there is no such setting, and no failover slot.
        assert_eq!(unwaited_standby_risk(None), None);
    }
}
