//! `walbox replay`: a range of the slot published again without moving it.

use anyhow::{Context, Result, bail};
use walbox_pgoutput::Lsn;

use super::plan::{Plan, plan};
use super::shell::Relay;
use super::stream::{StreamEnd, StreamSpec, stream};
use super::{Ctx, RunOptions, make_sink, println_out, signals};
use crate::config::Config;
use crate::pg::ConnParams;

/// `walbox replay`: publishes again every outbox event committed between `from`
/// and `to` (default: the checkpoint), with the same event ids, without moving
/// the slot; then the checkpoint is the later of itself and `to`.
pub async fn replay(config: &Config, from: Lsn, to: Option<Lsn>) -> Result<()> {
    let mut signals = signals()?;
    let conn = ConnParams::parse(config.dsn()?)?.resolve().await?;
    let store = config.checkpoint_store();
    let metrics = super::start_metrics(config, &conn)?;
    let ctx = Ctx {
        config,
        conn: &conn,
        store: &store,
        metrics: metrics.as_ref(),
    };
    let name = &config.source.slot;
    let sql = conn.connect().await?;
    let saved = store.load()?;
    let slot = crate::slot::info(&sql, name)
        .await?
        .with_context(|| format!("replication slot {name:?} does not exist"))?;
    if let Some(pid) = slot.active_pid {
        bail!(
            "replay needs slot {name:?} to itself, and pid {pid} holds it (walbox run?): stop \
             that reader, replay, then start it again"
        );
    }
    let plan = plan(
        config,
        &store,
        saved.as_ref(),
        Some(&slot),
        &RunOptions {
            from_lsn: Some(from),
            replay: true,
            ..RunOptions::default()
        },
    )?;
    let Plan::Stream {
        server_confirmed, ..
    } = plan
    else {
        bail!("the initial snapshot of slot {name:?} did not finish; run `walbox run` first");
    };
    let to = match (to, &saved) {
        (Some(to), _) => to,
        (None, Some(cp)) => cp.lsn,
        (None, None) => bail!("no checkpoint at {}: give --to", store.path().display()),
    };
    if to < from {
        bail!("--to {to} is before --from {from}");
    }
    let end: String = sql
        .query_one("SELECT pg_current_wal_flush_lsn()::text", &[])
        .await?
        .get(0);
    let end: Lsn = end.parse()?;
    if to > end {
        bail!("--to {to} is beyond the server's WAL end {end}");
    }
    drop(sql);
    let (sink, mut deliveries) = make_sink(config)?;
    let mut relay = Relay::new(ctx, sink)?;
    relay.adopt_checkpoint(saved);
    relay.core.resume_at(from, server_confirmed, None);
    let spec = StreamSpec {
        start: from,
        server_confirmed,
        report: false,
        stop_at: Some(to),
        accept_wal_behind: false,
    };
    let ended = stream(&mut relay, &mut deliveries, &mut signals, &spec).await?;
    if ended != StreamEnd::ReachedEnd {
        bail!(
            "replay stopped at {} before reaching {to}; the checkpoint is unchanged",
            relay.core.confirmed()
        );
    }
    let checkpoint = relay.core.checkpoint().map(|c| c.lsn).unwrap_or(to);
    println_out(&format!(
        "replayed {} events ({} dead-lettered) committed from {from} to {to}; checkpoint at {checkpoint}",
        relay.core.stats().events,
        relay.core.stats().dead_lettered
    ));
    Ok(())
}
