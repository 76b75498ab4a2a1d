//! The initial snapshot: a slot created with an exported snapshot, the outbox
//! rows it shows published as one transaction at its consistent point, then the
//! stream from there.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::sync::mpsc;
use walbox_core::{CHECKPOINT_VERSION, Checkpoint, SnapshotState};
use walbox_outbox::Mapper;
use walbox_pgoutput::Lsn;
use walbox_sink::{Deliveries, Sink};

use super::plan::{Plan, plan};
use super::shell::{Relay, connect_identified};
use super::{Ctx, RunOptions, classify_replication, classify_sql, make_sink, println_out, signals};
use crate::catalog;
use crate::config::Config;
use crate::pg::ConnParams;
use crate::snapshot;

/// Publishes every outbox row an exported snapshot shows, as one transaction at
/// the position the stream then starts from, and returns that position. `None`
/// when a stop signal came first: the checkpoint then says the snapshot is
/// unfinished, and the next start takes it again.
///
/// Without `resume`, the slot is created with the snapshot, and the stream starts
/// at its consistent point. With `resume` (an unfinished snapshot whose slot
/// exists), the snapshot comes from a temporary slot created for it, whose
/// consistent point is at or after `resume`, and the slot streams from `resume`:
/// events committed in between come from both (same event ids), and events
/// deleted from the table after `resume` come from the stream. The checkpoint
/// keeps `resume` as its position until every row is acknowledged.
pub(super) async fn take_snapshot(
    relay: &mut Relay<'_>,
    deliveries: &mut Deliveries,
    signals: &mut mpsc::UnboundedReceiver<()>,
    resume: Option<Lsn>,
) -> Result<Option<Lsn>> {
    let ctx = relay.ctx;
    let config = ctx.config;
    let slot = &config.source.slot;
    // The replication session that exports the snapshot; it stays open, idle,
    // until every row is read (the snapshot, and a temporary slot, live as long
    // as it does).
    let (mut exporter, ident) = connect_identified(
        relay,
        ctx.conn
            .replication(slot, &config.source.publication)?
            .with_application_name("walbox snapshot"),
        false,
    )
    .await?;
    let sql = ctx.conn.connect().await.map_err(classify_sql)?;
    let export = |created: Vec<pgwire_replication::client::QueryRow>| -> Result<(Lsn, String)> {
        let text = |i: usize| -> Result<String> {
            created
                .first()
                .and_then(|row| row.get(i))
                .and_then(|v| v.as_ref())
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .with_context(|| format!("CREATE_REPLICATION_SLOT returned no column {i}"))
        };
        Ok((text(1)?.parse().context("consistent_point")?, text(2)?))
    };
    let (point, snapshot_name, start) = if let Some(start) = resume {
        // The checkpoint already says "unfinished"; it names `start` as the
        // position before anything is read (the same, unless the point was not
        // recorded yet).
        // Without a checkpoint: the initial snapshot on a slot created without
        // one; saved before anything is read, as for a new slot.
        let fresh = relay.core.checkpoint().is_none();
        let mut cp = relay
            .core
            .checkpoint()
            .cloned()
            .unwrap_or_else(|| Checkpoint {
                version: CHECKPOINT_VERSION,
                system_identifier: ident.system_id.clone(),
                database: ident.dbname.clone().unwrap_or_default(),
                slot: slot.clone(),
                timeline: Some(ident.timeline),
                lsn: start,
                partial: None,
                snapshot: Some(SnapshotState {
                    consistent_point: Some(start),
                    complete: false,
                    rows: 0,
                    tables: BTreeMap::new(),
                }),
                tables: None,
            });
        if fresh {
            ctx.store.save(&cp)?;
            relay.adopt_checkpoint(Some(cp.clone()));
        }
        if let Some(s) = cp.snapshot.as_mut()
            && (cp.lsn != start || s.consistent_point != Some(start))
        {
            cp.lsn = start;
            s.consistent_point = Some(start);
            cp.partial = None;
            ctx.store.save(&cp)?;
            relay.adopt_checkpoint(Some(cp));
        }
        // Unique per attempt: the temporary slot of an earlier session can
        // outlive it for a moment (until the server sees its connection end).
        static ATTEMPT: AtomicU64 = AtomicU64::new(0);
        let temporary = format!(
            "{}_snap_{}_{}",
            slot.chars().take(36).collect::<String>(),
            std::process::id(),
            ATTEMPT.fetch_add(1, Ordering::Relaxed)
        );
        let created = exporter
            .simple_query(&format!(
                "CREATE_REPLICATION_SLOT {} TEMPORARY LOGICAL pgoutput (SNAPSHOT 'export')",
                crate::catalog::ident(&temporary)
            ))
            .await
            .with_context(|| {
                format!(
                    "creating temporary slot {temporary} with an exported snapshot (it needs \
                     one free replication slot: max_replication_slots)"
                )
            })
            .map_err(classify_replication)?;
        let (point, name) = export(created)?;
        tracing::info!(slot = %slot, temporary_slot = %temporary, consistent_point = %point,
            stream_from = %start, "taking the snapshot again from a temporary slot");
        (point, name, start)
    } else {
        // Saved before the slot exists: a crash from here on leaves a checkpoint
        // that says "unfinished", never a slot without one.
        let mut cp = Checkpoint {
            version: CHECKPOINT_VERSION,
            system_identifier: ident.system_id.clone(),
            database: ident.dbname.clone().unwrap_or_default(),
            slot: slot.clone(),
            timeline: Some(ident.timeline),
            lsn: Lsn(0),
            partial: None,
            snapshot: Some(SnapshotState {
                consistent_point: None,
                complete: false,
                rows: 0,
                tables: BTreeMap::new(),
            }),
            tables: None,
        };
        ctx.store.save(&cp)?;
        // FAILOVER: PostgreSQL 17+, which the session checked.
        let failover = if config.source.failover {
            ", FAILOVER"
        } else {
            ""
        };
        let created = exporter
            .simple_query(&format!(
                "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput (SNAPSHOT 'export'{failover})",
                crate::catalog::ident(slot)
            ))
            .await
            .with_context(|| format!("creating slot {slot} with an exported snapshot"))
            .map_err(classify_replication)?;
        let (point, name) = export(created)?;
        cp.lsn = point;
        if let Some(s) = cp.snapshot.as_mut() {
            s.consistent_point = Some(point);
        }
        ctx.store.save(&cp)?;
        relay.adopt_checkpoint(Some(cp));
        tracing::info!(slot = %slot, consistent_point = %point, "created slot with an exported snapshot");
        (point, name, point)
    };
    // The tables a snapshot due for tables with a new identity reads; empty:
    // every configured table.
    let only: Vec<String> = relay
        .core
        .checkpoint()
        .and_then(|cp| cp.snapshot.as_ref())
        .filter(|_| resume.is_some())
        .map(|s| s.tables.keys().cloned().collect())
        .unwrap_or_default();
    relay.core.begin_snapshot(start, point);

    snapshot::begin(&sql, &snapshot_name)
        .await
        .map_err(classify_sql)?;
    let mut rows_total = 0u64;
    if config.outbox.is_empty() {
        tracing::info!(
            "initial snapshot: nothing to publish, only [[messages]] are configured (logical \
             decoding messages live in the WAL alone; there are no rows to read)"
        );
    }
    // Each table's identity as the snapshot sees it, recorded once every row
    // is acknowledged.
    let mut read = BTreeMap::new();
    for table_cfg in &config.outbox {
        let (schema, name) = table_cfg.qualified();
        if !only.is_empty() && !only.contains(&format!("{schema}.{name}")) {
            continue;
        }
        let seen = crate::publication::identities(
            &sql,
            &config.source.publication,
            std::slice::from_ref(table_cfg),
        )
        .await
        .map_err(classify_sql)?;
        // The cursor names the table, which resolves against the catalog as it
        // is now; the rows are the snapshot's. A table swapped since the export
        // would be read empty: the snapshot is taken again instead.
        let now: Option<u32> = sql
            .query_one(
                "SELECT to_regclass(format('%I.%I', $1::text, $2::text))::oid",
                &[&schema, &name],
            )
            .await
            .map_err(|e| classify_sql(e.into()))?
            .get(0);
        if let Some((_, id)) = seen.iter().next()
            && now != Some(id.oid)
        {
            return Err(super::transient(anyhow::anyhow!(
                "outbox table {schema}.{name} was replaced while its snapshot was taken \
                 (oid {} in the snapshot, {now:?} now); the next session takes it again",
                id.oid
            )));
        }
        read.extend(seen);
        let table = catalog::table(&sql, schema, name)
            .await
            .map_err(classify_sql)?
            .with_context(|| format!("outbox table {schema}.{name} does not exist"))?;
        let mapper = Mapper::compile(table_cfg, &config.producer, &table.relation)?;
        let total = snapshot::count(&sql, &table, &config.snapshot).await?;
        ctx.state(
            crate::metrics::State::Snapshot,
            format!("initial snapshot of {schema}.{name}"),
        );
        if let Some(m) = ctx.metrics {
            m.snapshot_rows_total
                .inc_by(i64::try_from(total).unwrap_or(i64::MAX));
        }
        let mut progress = snapshot::Progress::new(mapper.table().to_owned(), total);
        snapshot::declare(&sql, &table, table_cfg, &config.snapshot).await?;
        let fetch_sql = format!(
            "FETCH FORWARD {} FROM {}",
            config.snapshot.chunk_rows,
            snapshot::CURSOR
        );
        loop {
            // The fetch stays pinned while deliveries are handled: dropping it
            // would lose the rows the server already sent for it.
            let fetch = sql.simple_query(&fetch_sql);
            tokio::pin!(fetch);
            let messages = loop {
                relay.sink.end_batch();
                tokio::select! {
                    biased;
                    Some(()) = signals.recv() => {
                        tracing::warn!(rows = rows_total, "stopped during the snapshot; the next start takes it again");
                        return Ok(None);
                    }
                    Some(d) = deliveries.recv() => relay.delivered(d).await?,
                    r = &mut fetch => break r.context("reading the snapshot").map_err(classify_sql)?,
                }
            };
            let chunk = snapshot::rows(messages, table.relation.columns.len())?;
            if chunk.is_empty() {
                break;
            }
            let n = chunk.len() as u64;
            for row in chunk {
                while relay.core.full() {
                    relay.sink.end_batch();
                    tokio::select! {
                        biased;
                        Some(()) = signals.recv() => {
                            tracing::warn!(rows = rows_total, "stopped during the snapshot; the next start takes it again");
                            return Ok(None);
                        }
                        Some(d) = deliveries.recv() => relay.delivered(d).await?,
                    }
                }
                relay
                    .core
                    .snapshot_row(&mapper, &row)
                    .map_err(super::shell::core_error)?;
                relay.pump().await?;
                while let Ok(d) = deliveries.try_recv() {
                    relay.delivered(d).await?;
                }
            }
            rows_total += n;
            progress.add(n);
            relay.observe_turn();
            if let Some(m) = ctx.metrics {
                m.snapshot_rows_done
                    .inc_by(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
        sql.batch_execute(&format!("CLOSE {}", snapshot::CURSOR))
            .await
            .map_err(|e| classify_sql(e.into()))?;
        progress.finish();
    }
    sql.batch_execute("COMMIT")
        .await
        .map_err(|e| classify_sql(e.into()))?;
    drop(sql);
    // Read: the exported snapshot is no longer needed.
    drop(exporter);
    relay.core.snapshot_tables(read);
    relay.core.end_snapshot(rows_total);
    tracing::info!(rows = rows_total, consistent_point = %point, stream_from = %start,
        "snapshot read; the stream continues from the slot's consistent point");
    Ok(Some(start))
}

/// Why `walbox setup --snapshot` fails when a signal stops it.
const SNAPSHOT_STOPPED: &str = "stopped before the snapshot finished; the next start \
    (`walbox setup --snapshot` or `walbox run`) takes it again";

/// `walbox setup --snapshot`, after the publication exists: creates the slot with
/// a snapshot, publishes the existing rows, waits until all are acknowledged,
/// and records the consistent point, where `walbox run` continues.
pub async fn setup_snapshot(config: &Config) -> Result<()> {
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
    let sql = conn.connect().await?;
    let saved = store.load()?;
    let slot = crate::slot::info(&sql, &config.source.slot).await?;
    drop(sql);
    let resume = match (&saved, &slot) {
        (Some(cp), _) if cp.snapshot_interrupted() => {
            if let Some(pid) = slot.as_ref().and_then(|s| s.active_pid) {
                bail!(
                    "slot {:?} is in use by pid {pid}; stop that reader first",
                    config.source.slot
                );
            }
            // As `walbox run` would, except that a dropped slot of the unfinished
            // snapshot is replaced: taking a new snapshot is what was asked for.
            let options = RunOptions {
                accept_slot_position: slot.is_none(),
                ..RunOptions::default()
            };
            match plan(config, &store, saved.as_ref(), slot.as_ref(), &options)? {
                Plan::Snapshot { resume } => resume,
                Plan::Stream { .. } => bail!("the unfinished snapshot cannot be taken again"),
            }
        }
        (_, Some(_)) => {
            println_out(&format!(
                "slot {} exists; a snapshot is taken only when the slot is created \
                 (drop it with `walbox slot drop` to take one)",
                config.source.slot
            ));
            return Ok(());
        }
        (Some(cp), None) => {
            // The recovery path for a lost or skipped slot: the snapshot replaces
            // the old slot's checkpoint (same cluster only: checked on connect).
            tracing::info!(checkpoint = %store.path().display(), old_position = %cp.lsn,
                "replacing the checkpoint of the dropped slot");
            None
        }
        (None, None) => None,
    };
    let (sink, mut deliveries) = make_sink(config)?;
    let mut relay = Relay::new(ctx, sink)?;
    relay.adopt_checkpoint(saved);
    let Some(point) = take_snapshot(&mut relay, &mut deliveries, &mut signals, resume).await?
    else {
        bail!(SNAPSHOT_STOPPED);
    };
    // Wait for every row to be acknowledged, then record it.
    let timeout = Duration::from_millis(config.shutdown.timeout_ms);
    loop {
        relay.save_checkpoint(true).await?;
        if !relay.core.snapshot_pending() {
            break;
        }
        relay.sink.end_batch();
        tokio::select! {
            biased;
            Some(()) = signals.recv() => {
                tracing::warn!(in_flight = relay.core.in_flight(), "stopped before every snapshot row was acknowledged; the next start takes it again");
                bail!(SNAPSHOT_STOPPED);
            }
            Some(d) = deliveries.recv() => relay.delivered(d).await?,
            () = tokio::time::sleep(timeout) => bail!(
                "snapshot rows not acknowledged within {} ms; the next start takes the snapshot again",
                config.shutdown.timeout_ms
            ),
        }
    }
    let slot_at = if resume.is_some() {
        "the unfinished snapshot's slot"
    } else {
        "created"
    };
    println_out(&format!(
        "snapshot: published {} rows; slot {} ({slot_at}) at {point}; `walbox run` streams from there",
        relay.core.stats().events,
        config.source.slot
    ));
    Ok(())
}
