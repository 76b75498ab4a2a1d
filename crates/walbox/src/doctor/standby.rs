//! `walbox doctor --standby DSN`: whether a physical standby can take over
//! with walbox's slot after a failover (PostgreSQL 17 failover slots). On the
//! standby: `sync_replication_slots`, `hot_standby_feedback`,
//! `primary_slot_name`, `wal_level` and a `dbname` in `primary_conninfo`; on the
//! primary: `synchronized_standby_slots` naming the standby's physical slot, that
//! slot, and walbox's slot being a failover slot; on the standby, the slot
//! synchronized (`synced = true`) and its position.

use anyhow::Result;

use super::{Report, Verdict, setting};
use crate::config::Config;
use crate::failover::{FAILOVER_SINCE, server_major};
use crate::pg::ConnParams;

/// Adds the standby's checks to `r`; `primary` is the connection to the server
/// walbox reads.
pub(super) async fn check(
    r: &mut Report,
    primary: &tokio_postgres::Client,
    config: &Config,
    dsn: &str,
) -> Result<()> {
    let conn = ConnParams::parse(dsn)?;
    let standby = match conn.connect().await {
        Ok(c) => c,
        Err(e) => {
            r.add(
                Verdict::Fail,
                format!("standby: cannot connect ({e:#}); check --standby"),
            );
            return Ok(());
        }
    };
    let in_recovery: bool = standby
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await?
        .get(0);
    if !in_recovery {
        r.add(
            Verdict::Fail,
            format!(
                "standby {}: not in recovery, so not a standby; give --standby the standby's \
                 connection string",
                conn.describe()
            ),
        );
        return Ok(());
    }
    r.add(
        Verdict::Ok,
        format!("standby {} is in recovery", conn.describe()),
    );
    let (major, standby_major) = (server_major(primary).await?, server_major(&standby).await?);
    if major.min(standby_major) < FAILOVER_SINCE {
        r.add(
            Verdict::Fail,
            format!(
                "failover slots need PostgreSQL {FAILOVER_SINCE} or later on both servers (primary \
                 {major}, standby {standby_major}): before that, walbox's slot does not survive a \
                 promotion"
            ),
        );
        return Ok(());
    }

    // The standby's settings.
    for (name, want, fix) in [
        (
            "sync_replication_slots",
            "on",
            "the standby does not synchronize failover slots",
        ),
        (
            "hot_standby_feedback",
            "on",
            "slot synchronization needs it",
        ),
        (
            "wal_level",
            "logical",
            "a promoted standby can only decode WAL it wrote at wal_level = logical",
        ),
    ] {
        let value = setting(&standby, name).await?;
        r.check(
            value == want,
            format!("standby: {name} = {want}"),
            format!(
                "standby: {name} = {value} ({fix}): set {name} = {want} on the standby (ALTER \
                 SYSTEM SET {name} = '{want}', then reload{})",
                if name == "wal_level" {
                    " and restart"
                } else {
                    ""
                }
            ),
        );
    }
    let physical = setting(&standby, "primary_slot_name").await?;
    r.check(
        !physical.is_empty(),
        format!("standby: primary_slot_name = {physical}"),
        "standby: primary_slot_name is not set: stream through a physical slot (create one on \
         the primary with pg_create_physical_replication_slot, set primary_slot_name on the \
         standby), which synchronized_standby_slots can name",
    );
    match standby
        .query_one("SELECT current_setting('primary_conninfo')", &[])
        .await
    {
        Ok(row) => {
            let conninfo: String = row.get(0);
            r.check(
                has_dbname(&conninfo),
                "standby: primary_conninfo names a dbname",
                "standby: primary_conninfo has no dbname: add dbname=... (the database of \
                 walbox's slot) to primary_conninfo; slot synchronization connects to it",
            );
        }
        Err(_) => r.add(
            Verdict::Warn,
            "standby: cannot read primary_conninfo (needs a superuser or pg_read_all_settings); \
             check that it has a dbname",
        ),
    }

    // The primary's side.
    let waited = setting(primary, "synchronized_standby_slots").await?;
    let names: Vec<&str> = waited
        .split(',')
        .map(|n| n.trim().trim_matches('"'))
        .filter(|n| !n.is_empty())
        .collect();
    r.check(
        !physical.is_empty() && names.contains(&physical.as_str()),
        format!("primary: synchronized_standby_slots names {physical}"),
        format!(
            "primary: synchronized_standby_slots = '{waited}' does not name the standby's \
             physical slot {physical:?}: without it walbox's slot can get ahead of the standby, \
             and a failover would lose events; set it on the primary (ALTER SYSTEM SET \
             synchronized_standby_slots = '{physical}', then reload)"
        ),
    );
    if !physical.is_empty() {
        let row = primary
            .query_opt(
                "SELECT active FROM pg_replication_slots
                 WHERE slot_name = $1 AND slot_type = 'physical'",
                &[&physical],
            )
            .await?;
        match row.map(|r| r.get::<_, bool>(0)) {
            Some(true) => r.add(
                Verdict::Ok,
                format!("primary: physical slot {physical} is in use by the standby"),
            ),
            Some(false) => r.add(
                Verdict::Warn,
                format!(
                    "primary: physical slot {physical} is not in use: the standby is not \
                     streaming (check its primary_conninfo and log)"
                ),
            ),
            None => r.add(
                Verdict::Fail,
                format!(
                    "primary: no physical slot {physical}: create it \
                     (SELECT pg_create_physical_replication_slot('{physical}', true))"
                ),
            ),
        }
    }
    let slot = &config.source.slot;
    let failover = primary
        .query_opt(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
            &[slot],
        )
        .await?
        .map(|row| row.get::<_, bool>(0));
    match failover {
        Some(true) => r.add(
            Verdict::Ok,
            format!("primary: slot {slot} is a failover slot"),
        ),
        Some(false) => r.add(
            Verdict::Fail,
            format!(
                "primary: slot {slot} is not a failover slot: set source.failover = true (or \
                 run `walbox slot create --failover`)"
            ),
        ),
        None => r.add(
            Verdict::Fail,
            format!("primary: no slot {slot}: create it with `walbox setup --failover`"),
        ),
    }

    // The slot on the standby.
    let row = standby
        .query_opt(
            "SELECT synced, temporary, confirmed_flush_lsn::text
             FROM pg_replication_slots WHERE slot_name = $1",
            &[slot],
        )
        .await?;
    match row {
        None => r.add(
            Verdict::Fail,
            format!(
                "standby: no slot {slot} yet: a promotion now would lose it (slot \
                 synchronization fixes this once the settings above are right)"
            ),
        ),
        Some(row) => {
            let (synced, temporary): (bool, bool) = (row.get(0), row.get(1));
            let confirmed: Option<String> = row.get(2);
            let at = confirmed.unwrap_or_else(|| "no position".into());
            if synced && !temporary {
                r.add(
                    Verdict::Ok,
                    format!(
                        "standby: slot {slot} is synchronized (synced = true), confirmed at {at}"
                    ),
                );
            } else if synced {
                r.add(
                    Verdict::Warn,
                    format!(
                        "standby: slot {slot} is being synchronized but not yet persistent (at \
                         {at}): the standby waits until the primary's slot passes its own \
                         position; not ready for a failover yet"
                    ),
                );
            } else {
                r.add(
                    Verdict::Fail,
                    format!(
                        "standby: slot {slot} exists but was not synchronized from the primary \
                         (synced = false): drop it on the standby, slot synchronization then \
                         creates it"
                    ),
                );
            }
        }
    }
    Ok(())
}

/// Whether a libpq key=value string sets `dbname`.
fn has_dbname(conninfo: &str) -> bool {
    conninfo.split_whitespace().any(|kv| {
        kv.split_once('=')
            .is_some_and(|(k, v)| k.trim() == "dbname" && !v.trim().trim_matches('\'').is_empty())
    })
}

#[cfg(test)]
mod tests {
    use super::has_dbname;

    #[test]
    fn a_dbname_in_primary_conninfo_is_found() {
        assert!(has_dbname("host=/tmp port=5432 user=postgres dbname=app"));
        assert!(!has_dbname("host=/tmp port=5432 user=postgres"));
        assert!(!has_dbname("host=/tmp dbname=''"));
    }
}
