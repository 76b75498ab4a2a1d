//! `walbox replay`: a range of the slot published again without moving it.

use anyhow::{Context, Result, bail};
use walbox_pgoutput::Lsn;
use walbox_sink::Sink;

use super::plan::{Plan, plan};
use super::shell::Relay;
use super::stream::{StreamEnd, StreamSpec, stream};
use super::{Ctx, RunOptions, make_sink, println_out, signals};
use crate::config::Config;
use crate::pg::ConnParams;

/// `walbox replay`: publishes again every outbox event committed between `from`
/// and `to` (default: the checkpoint), with the same event ids, without moving
/// the slot; then the checkpoint is the later of itself and `to`. The sink is
/// told the replay's name, `from`: a destination that deduplicates stores the
/// events again under ids of this replay's own, and drops only what an earlier
/// run with the same `--from` stored, which is reported apart, not as
/// replayed.
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
    // Past the checkpoint, a replay publishes events for the first time: not
    // before `walbox run` has taken the snapshot of a table with a new identity
    // (its earlier rows would come after its later events).
    if let Some(cp) = saved.as_ref().filter(|cp| to > cp.lsn)
        && let Some(recorded) = &cp.tables
    {
        let current =
            crate::publication::identities(&sql, &config.source.publication, &config.outbox)
                .await?;
        if let Some((table, _)) = current.iter().find(|(t, id)| recorded.get(*t) != Some(*id)) {
            bail!(
                "outbox table {table} has a new identity since walbox last streamed (swapped, \
                 added to the publication again, or newly configured), and --to {to} is past the \
                 checkpoint at {}: run `walbox run` first, which takes the table's snapshot, or \
                 replay up to {} at most",
                cp.lsn,
                cp.lsn
            );
        }
    }
    drop(sql);
    let (sink, mut deliveries) = make_sink(config)?;
    let mut relay = Relay::new(ctx, sink)?;
    relay.core.replay_from(from);
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
    let already = relay.sink.duplicates();
    println_out(&summary(
        relay.core.stats().events,
        relay.core.stats().dead_lettered,
        already,
        from,
        to,
        checkpoint,
    ));
    Ok(())
}

/// What a replay did: the events stored again, and apart those an earlier run
/// of the same replay had stored, which the destination dropped.
fn summary(
    events: u64,
    dead_lettered: u64,
    already: u64,
    from: Lsn,
    to: Lsn,
    checkpoint: Lsn,
) -> String {
    let stored = events.saturating_sub(already);
    let mut line = format!(
        "replayed {stored} events ({dead_lettered} dead-lettered) committed from {from} to {to}"
    );
    if already > 0 {
        line.push_str(&format!(
            "; {already} events already stored by an earlier run of this replay (same --from) \
             were not stored again"
        ));
    }
    line.push_str(&format!("; checkpoint at {checkpoint}"));
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_an_earlier_run_stored_are_never_counted_as_replayed() {
        let (from, to) = (Lsn(0x100), Lsn(0x200));
        assert_eq!(
            summary(300, 0, 0, from, to, to),
            "replayed 300 events (0 dead-lettered) committed from 0/100 to 0/200; checkpoint at 0/200"
        );
        let line = summary(300, 1, 120, from, to, to);
        assert!(
            line.starts_with("replayed 180 events (1 dead-lettered)")
                && line.contains("; 120 events already stored by an earlier run of this replay"),
            "{line}"
        );
    }
}
