//! The stream phase: the `select!` loop that feeds the core from the slot and
//! the sink, writes checkpoints and reports positions; the stall probe.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use pgwire_replication::ReplicationClient;
use tokio::sync::mpsc;
use walbox_core::{CHECKPOINT_VERSION, Checkpoint};
use walbox_pgoutput::Lsn;
use walbox_sink::{Deliveries, Sink};

use super::shell::{CHECKPOINT_EVERY, Relay, connect_identified};
use super::{Ctx, classify_replication, feedback_observer, transient, walbox_wait};

/// Messages read from the server but not yet taken by the relay.
const READ_AHEAD_EVENTS: usize = 256;

/// Payload bytes read from the server but not yet taken by the relay: a quarter
/// of `sink.max_in_flight_bytes` (at least 64 KiB), so rows held by walbox stay
/// within 1.25 times that bound (plus one row larger than the read-ahead, which
/// passes alone), however large the rows are.
fn read_ahead_bytes(max_in_flight_bytes: usize) -> usize {
    (max_in_flight_bytes / 4).max(64 * 1024)
}
/// How often progress is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);

/// How a stream phase ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StreamEnd {
    /// A stop signal (or the shutdown timeout).
    Stopped,
    /// A replay reached its end and everything was acknowledged.
    ReachedEnd,
}

/// A stream phase.
#[derive(Debug, Clone)]
pub(super) struct StreamSpec {
    /// START_REPLICATION position.
    pub(super) start: Lsn,
    /// What the server holds as confirmed now.
    pub(super) server_confirmed: Lsn,
    /// Report acknowledged positions to the server (not during a replay).
    pub(super) report: bool,
    /// Replay: stop before transactions that commit at or after it.
    pub(super) stop_at: Option<Lsn>,
    /// Start although the server's WAL ends before the checkpoint.
    pub(super) accept_wal_behind: bool,
}

/// Streams from the slot through the relay until stopped, failed, or (replay)
/// the end is reached and acknowledged.
pub(super) async fn stream(
    relay: &mut Relay<'_>,
    deliveries: &mut Deliveries,
    signals: &mut mpsc::UnboundedReceiver<()>,
    spec: &StreamSpec,
) -> Result<StreamEnd> {
    let ctx = relay.ctx;
    let config = ctx.config;
    let status_interval = Duration::from_millis(config.source.status_interval_ms);
    let longest_feedback_ms = Arc::new(AtomicU64::new(0));
    let repl_cfg = ctx
        .conn
        .replication(&config.source.slot, &config.source.publication)?
        .with_start_lsn(pgwire_replication::Lsn(spec.start.as_u64()))
        .with_ack_lsn(pgwire_replication::Lsn(spec.server_confirmed.as_u64()))
        .with_status_interval(status_interval)
        .with_wakeup_interval(status_interval)
        .with_buffer_size(READ_AHEAD_EVENTS)
        .with_buffer_bytes(read_ahead_bytes(config.sink.max_in_flight_bytes))
        .with_application_name("walbox")
        // With an observer the client tracks whether a raised position is still
        // unreported, which the final status update on stop waits for. The
        // observer itself keeps the longest delay for the progress log.
        .with_feedback_observer(feedback_observer(Arc::clone(&longest_feedback_ms)));
    let (mut repl, ident) = connect_identified(relay, repl_cfg, spec.accept_wal_behind).await?;
    match relay.core.checkpoint() {
        Some(_) => {}
        None => {
            // First start on this slot: the checkpoint adopts the slot's position.
            let cp = Checkpoint {
                version: CHECKPOINT_VERSION,
                system_identifier: ident.system_id.clone(),
                database: ident.dbname.clone().unwrap_or_default(),
                slot: config.source.slot.clone(),
                timeline: Some(ident.timeline),
                lsn: spec.start,
                partial: None,
                snapshot: None,
                tables: Some(relay.tables.clone()),
            };
            ctx.store.save(&cp)?;
            tracing::info!(checkpoint = %ctx.store.path().display(), lsn = %cp.lsn, "checkpoint created");
            relay.adopt_checkpoint(Some(cp));
        }
    }
    repl.start()
        .await
        .map_err(|e| classify_replication(e.into()))?;
    repl.wait_started()
        .await
        .with_context(|| {
            format!(
                "starting replication from slot {:?} on {}",
                config.source.slot,
                ctx.conn.describe()
            )
        })
        .map_err(classify_replication)?;
    let tables: Vec<&str> = config.outbox.iter().map(|t| t.table.as_str()).collect();
    let prefixes: Vec<&str> = config
        .messages
        .iter()
        .flat_map(|m| m.prefixes.iter().map(String::as_str))
        .collect();
    ctx.state(
        crate::metrics::State::Streaming,
        format!(
            "streaming from slot {:?} at {}",
            config.source.slot, spec.start
        ),
    );
    tracing::info!(slot = %config.source.slot, publication = %config.source.publication,
        start = %spec.start, stop_at = ?spec.stop_at.map(|l| l.to_string()), tables = ?tables,
        message_prefixes = ?prefixes, "streaming");

    if let Some(end) = spec.stop_at {
        relay.core.stop_at(end);
    }
    let mut stopping: Option<Instant> = None;
    let mut progress = tokio::time::interval(PROGRESS_EVERY);
    progress.tick().await;
    let mut housekeeping = tokio::time::interval(CHECKPOINT_EVERY);
    housekeeping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let stall_timeout = Duration::from_millis(config.source.stall_timeout_ms);
    // When a message last came from the server while walbox was waiting for one,
    // to the housekeeping interval: `fresh` says one came since the last tick, so
    // the clock is read once per tick, not once per message.
    let mut heard = Instant::now();
    let mut fresh = false;
    let mut shutdown = std::pin::pin!(tokio::time::sleep(Duration::ZERO));

    let outcome: Result<StreamEnd> = loop {
        // A stop asked for wins over an end reached in the same turn: the
        // caller must not go on to a next phase.
        if relay.core.reached_end() && relay.core.idle() && stopping.is_none() {
            break Ok(StreamEnd::ReachedEnd);
        }
        if let Some(deadline) = stopping {
            if relay.core.idle() {
                break Ok(StreamEnd::Stopped);
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    in_flight = relay.core.in_flight(),
                    "shutdown timeout: stopping with events unacknowledged; they will be sent again"
                );
                break Ok(StreamEnd::Stopped);
            }
        }
        let reading = relay.core.reading(stopping.is_some());
        if !reading {
            // Silence while walbox is not reading is walbox's own doing.
            fresh = true;
        }
        let mut ticked = false;
        relay.latency.new_turn();
        relay.sink.end_batch();
        let step: Result<()> = tokio::select! {
            biased;
            // 1. A stop signal: stop reading, drain acknowledgements.
            Some(()) = signals.recv() => {
                tracing::info!(in_flight = relay.core.in_flight(), "stopping: waiting for in-flight events");
                ctx.state(crate::metrics::State::Stopping, "stopping: waiting for in-flight events");
                let deadline = Instant::now() + Duration::from_millis(config.shutdown.timeout_ms);
                stopping = Some(deadline);
                shutdown.as_mut().reset(deadline.into());
                Ok(())
            }
            // 2. Delivery reports before new input: they free room and move the position.
            Some(d) = deliveries.recv() => relay.delivered(d).await,
            // 3. The shutdown deadline.
            () = &mut shutdown, if stopping.is_some() => Ok(()),
            // 4. New WAL, unless the in-flight bound is reached (backpressure). When
            //    stopping, only to the end of the transaction being read: its events
            //    count as delivered only once its Commit is seen, so stopping inside
            //    it would make the next start send them again.
            ev = repl.recv(), if reading => match ev {
                Ok(Some(ev)) => {
                    fresh = true;
                    relay.handle(ev).await
                }
                Ok(None) => Err(transient(anyhow!("the replication stream ended"))),
                Err(e) => Err(classify_replication(anyhow!(e).context("replication stream"))),
            },
            // 5. Checkpoint and report on time even when nothing else happens.
            _ = housekeeping.tick() => {
                ticked = true;
                Ok(())
            }
            // 6. Progress in the log.
            _ = progress.tick() => {
                relay.log_progress();
                Ok(())
            }
        };
        // Whatever else is ready is handled in the same turn, so the bookkeeping
        // below runs once per batch rather than once per message.
        let step = match step {
            Ok(()) => {
                drain_ready(relay, deliveries, &mut repl, stopping.is_some(), &mut fresh).await
            }
            Err(e) => Err(e),
        };
        relay.observe_turn();
        if ticked {
            if let Err(e) = relay.publication_ok() {
                break Err(e);
            }
            if fresh {
                heard = Instant::now();
                if let Some(m) = ctx.metrics {
                    m.health.heard(heard);
                }
                fresh = false;
            } else if !stall_timeout.is_zero() && heard.elapsed() >= stall_timeout {
                if let Err(e) = check_stall(ctx, stall_timeout).await {
                    break Err(e);
                }
                heard = Instant::now();
            }
        }
        // The checkpoint first: the server never holds a position walbox could forget.
        if let Err(e) = relay.save_checkpoint(false).await {
            break Err(e);
        }
        if spec.report {
            match relay.position_to_report() {
                Ok(Some(target)) => {
                    repl.update_applied_lsn(pgwire_replication::Lsn(target.as_u64()));
                }
                Ok(None) => {}
                Err(e) => break Err(e),
            }
        }
        if let Err(e) = step {
            break Err(e);
        }
    };

    let outcome = match outcome {
        Ok(end) => relay.publication_settled().await.map(|()| end),
        other => other,
    };
    // Whatever happened, the acknowledged position is safe: save it, and make
    // sure the server has what may be reported.
    let saved = relay.save_checkpoint(true).await;
    if spec.report && saved.is_ok() {
        if let Ok(Some(target)) = relay.position_to_report() {
            repl.update_applied_lsn(pgwire_replication::Lsn(target.as_u64()));
        }
        // Whether raised just now or in an earlier turn, the last position handed
        // to the client must reach the server before the goodbye.
        let sent = walbox_wait(status_interval * 2 + Duration::from_secs(1), || {
            repl.feedback_pending_since().is_none()
        })
        .await;
        if !sent {
            tracing::warn!(reported = %relay.core.reported(),
                "final position may not have reached the server");
        }
    }
    // A stalled server may never answer the goodbye.
    if tokio::time::timeout(Duration::from_secs(5), repl.shutdown())
        .await
        .is_err()
    {
        repl.abort();
    }
    relay.log_progress();
    tracing::info!(
        confirmed = %relay.core.confirmed(),
        reported = %relay.core.reported(),
        longest_feedback_delay_ms = longest_feedback_ms.load(Ordering::Relaxed),
        commit_to_read_ms = %relay.latency.read_summary(),
        commit_to_ack_ms = %relay.latency.total_summary(),
        "stopped"
    );
    saved?;
    outcome
}

/// Most messages handled in one turn of the stream loop beyond the first.
const BATCH: usize = 256;

/// Handles the delivery reports and WAL messages that are ready now, without
/// waiting, up to [`BATCH`] of each: one wakeup of the loop serves many events.
///
/// The WAL channel is polled only while the replication worker runs: once it has
/// ended, the loop's own `recv` collects its result (the channel's close and the
/// worker's result come together on the single-threaded runtime `run` uses).
async fn drain_ready(
    relay: &mut Relay<'_>,
    deliveries: &mut Deliveries,
    repl: &mut ReplicationClient,
    stopping: bool,
    fresh: &mut bool,
) -> Result<()> {
    for _ in 0..BATCH {
        let mut progressed = false;
        if let Ok(d) = deliveries.try_recv() {
            relay.delivered(d).await?;
            progressed = true;
        }
        if relay.core.reading(stopping) && repl.is_running() {
            match ready_now(repl.recv()) {
                Some(Ok(Some(ev))) => {
                    *fresh = true;
                    relay.handle(ev).await?;
                    progressed = true;
                }
                Some(Ok(None)) => return Err(transient(anyhow!("the replication stream ended"))),
                Some(Err(e)) => {
                    return Err(classify_replication(
                        anyhow!(e).context("replication stream"),
                    ));
                }
                None => {}
            }
        }
        if !progressed {
            break;
        }
    }
    Ok(())
}

/// The output of `fut` if it is ready on its first poll. Only for futures that
/// may be dropped unfinished without losing anything (a channel's `recv`).
fn ready_now<F: std::future::Future>(fut: F) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(out) => Some(out),
        std::task::Poll::Pending => None,
    }
}

/// Nothing came from the server for `timeout` while walbox waited: an idle
/// stream is quiet too, so ask the server (on a new connection) whether the
/// walsender still processes walbox's status updates. It is stalled when it does
/// not (its `reply_time` is older than `timeout`), when it is gone, or when the
/// server does not answer; then the stuck walsender is terminated (so the slot is
/// free again) and the session ends with a transient error.
async fn check_stall(ctx: Ctx<'_>, timeout: Duration) -> Result<()> {
    const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
    let slot = &ctx.config.source.slot;
    let secs = timeout.as_secs_f64();
    let stalled = |why: String| {
        transient(super::Stalled(format!(
            "replication connection stalled: nothing from the server for {secs:.0} s and {why}"
        )))
    };
    if let Some(m) = ctx.metrics {
        m.stall_probes.inc();
    }
    let probe = async {
        let sql = ctx.conn.connect().await?;
        let reader = crate::slot::reader(&sql, slot).await?;
        Ok::<_, anyhow::Error>((sql, reader))
    };
    match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
        Err(_) => Err(stalled(format!(
            "the server did not answer a probe within {} s",
            PROBE_TIMEOUT.as_secs()
        ))),
        Ok(Err(e)) => Err(stalled(format!("a probe failed: {e:#}"))),
        Ok(Ok((_, None))) => Err(stalled("the server shows no reader on the slot".to_owned())),
        Ok(Ok((sql, Some(reader)))) => {
            let (pid, since_reply) = (reader.pid, reader.since_reply_secs);
            if since_reply < secs {
                tracing::debug!(pid, since_reply, "quiet stream, walsender alive");
                return Ok(());
            }
            let _ = tokio::time::timeout(
                PROBE_TIMEOUT,
                sql.execute("SELECT pg_terminate_backend($1)", &[&pid]),
            )
            .await;
            Err(stalled(format!(
                "walsender pid {pid} has not processed a status update for {since_reply:.0} s \
                 (terminated)"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_now_takes_only_what_is_already_there() {
        let (tx, mut rx) = mpsc::unbounded_channel::<u32>();
        assert_eq!(ready_now(rx.recv()), None, "nothing sent yet");
        tx.send(1).unwrap();
        tx.send(2).unwrap();
        assert_eq!(ready_now(rx.recv()), Some(Some(1)));
        // A recv given up unfinished loses nothing.
        assert_eq!(ready_now(rx.recv()), Some(Some(2)));
        assert_eq!(ready_now(rx.recv()), None);
        drop(tx);
        assert_eq!(ready_now(rx.recv()), Some(None), "closed");
    }
}
