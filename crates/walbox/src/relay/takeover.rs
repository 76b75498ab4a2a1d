//! A session on a server that was promoted since walbox's checkpoint (a later
//! timeline): the slot there against the checkpoint, decided by
//! [`walbox_core::check_takeover`], before the plan, and again on the
//! replication connection with `IDENTIFY_SYSTEM`'s timeline (`connect_identified`),
//! where whether the new timeline forked off before the checkpoint is checked
//! too.

use anyhow::{Result, bail};
use walbox_core::{Checkpoint, SlotOnServer, Takeover, TakeoverProblem, check_takeover};
use walbox_pgoutput::Lsn;

use super::plan::RECOVER;
use super::{Ctx, RunOptions, classify_sql};
use crate::slot::SlotInfo;

/// Refuses a promoted server whose slot is missing, was not synchronized from the
/// old primary or is ahead of the checkpoint (the last two unless
/// `--accept-slot-position`); logs a good takeover.
pub(super) async fn check(
    ctx: Ctx<'_>,
    sql: &tokio_postgres::Client,
    saved: Option<&Checkpoint>,
    slot: Option<&SlotInfo>,
    options: &RunOptions,
) -> Result<()> {
    let Some(cp) = saved.filter(|cp| !cp.snapshot_interrupted()) else {
        return Ok(());
    };
    let Some(timeline) = cp.timeline else {
        return Ok(());
    };
    let Some(server) = server_timeline(sql).await.map_err(classify_sql)? else {
        return Ok(()); // a standby: no promotion to judge
    };
    if server == timeline {
        return Ok(());
    }
    // The replication connection's check announces a good takeover.
    let announce = false;
    decide(
        ctx,
        cp,
        server,
        slot,
        options.accept_slot_position,
        announce,
    )
}

/// The same decision where the timeline is authoritative: on a replication
/// connection whose `IDENTIFY_SYSTEM` shows `server_timeline`, before the
/// checkpoint's timeline is rewritten, for `run`, `replay` and a snapshot alike
/// (a server promoted after the SQL check, or a session that never ran it, is
/// judged here). The slot's state comes from a SQL connection to the same server.
pub(super) async fn check_identified(
    ctx: Ctx<'_>,
    cp: &Checkpoint,
    server_timeline: u32,
    accept_slot_position: bool,
) -> Result<()> {
    if cp.snapshot_interrupted() || cp.timeline.is_none_or(|t| t == server_timeline) {
        return Ok(());
    }
    let sql = ctx.conn.connect().await.map_err(classify_sql)?;
    let slot = crate::slot::info(&sql, &ctx.config.source.slot)
        .await
        .map_err(classify_sql)?;
    decide(
        ctx,
        cp,
        server_timeline,
        slot.as_ref(),
        accept_slot_position,
        true,
    )
}

/// [`check_takeover`] with the slot's synchronization state, as an error with
/// the recovery steps; a takeover that goes ahead is logged when `announce`.
fn decide(
    ctx: Ctx<'_>,
    cp: &Checkpoint,
    server: u32,
    slot: Option<&SlotInfo>,
    accept_slot_position: bool,
    announce: bool,
) -> Result<()> {
    let Some(timeline) = cp.timeline else {
        return Ok(());
    };
    let name = &ctx.config.source.slot;
    let on_server = slot.map(|s| SlotOnServer {
        confirmed: s.confirmed.unwrap_or(Lsn(0)),
        synced: s.synced,
    });
    match check_takeover(name, timeline, cp.lsn, server, on_server) {
        Ok(Takeover::SameTimeline) => Ok(()),
        Ok(Takeover::Synced) => {
            if !announce {
                return Ok(());
            }
            tracing::info!(slot = %name, from_timeline = timeline, to_timeline = server,
                checkpoint = %cp.lsn,
                "the server was promoted; its slot was synchronized from the old primary and \
                 is not past the checkpoint: resuming at the checkpoint");
            Ok(())
        }
        Err(problem @ TakeoverProblem::EarlierTimeline { .. }) => bail!(
            "{problem} (checkpoint {}, server {})",
            ctx.store.path().display(),
            ctx.conn.server()
        ),
        Err(problem @ TakeoverProblem::SlotMissing { .. }) => bail!(
            "{problem}. To publish them, move the checkpoint {} aside and create the slot with \
             a snapshot of the rows not yet published (`walbox setup --snapshot \
             --snapshot-where \"...\"`, with --failover so that it survives the next \
             promotion)",
            ctx.store.path().display()
        ),
        Err(problem @ (TakeoverProblem::Ahead { .. } | TakeoverProblem::NotSynced { .. }))
            if accept_slot_position =>
        {
            if !announce {
                return Ok(());
            }
            tracing::warn!(slot = %name, from_timeline = timeline, to_timeline = server,
                checkpoint = %cp.lsn, problem = %problem,
                "--accept-slot-position: resuming on the promoted server as told");
            Ok(())
        }
        Err(problem @ (TakeoverProblem::Ahead { .. } | TakeoverProblem::NotSynced { .. })) => {
            bail!(
                "{problem} (checkpoint {}). {RECOVER}",
                ctx.store.path().display()
            )
        }
    }
}

/// The timeline a primary writes (from its current WAL file's name); `None` on a
/// server in recovery.
async fn server_timeline(sql: &tokio_postgres::Client) -> Result<Option<u32>> {
    let row = sql
        .query_one(
            "SELECT CASE WHEN pg_is_in_recovery() THEN NULL
                    ELSE pg_walfile_name(pg_current_wal_lsn()) END",
            &[],
        )
        .await?;
    let file: Option<String> = row.get(0);
    Ok(file.and_then(|f| u32::from_str_radix(f.get(..8)?, 16).ok()))
}
