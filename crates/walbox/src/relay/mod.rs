//! `walbox run`, `walbox setup --snapshot`, `walbox replay`: the shell around
//! [`walbox_core::Core`]. It owns every connection, thread and timer: it feeds the
//! core the slot's messages, the snapshot's rows, the sink's delivery reports and
//! the clock, and carries out what the core asks (send an event, write a
//! checkpoint, report a position). Sessions, backoff and the stop signal live
//! here; every decision about events and positions lives in the core.

mod checkpoint_writer;
mod identity;
mod latency;
mod plan;
mod replay;
mod shell;
mod sink;
mod snapshot;
mod stream;
mod takeover;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use tokio::sync::mpsc;

use crate::config::Config;
use crate::metrics::{Metrics, State};
use crate::pg::ConnParams;
use crate::publication::PublicationWatch;
use walbox_core::CheckpointFile;
use walbox_pgoutput::Lsn;

pub use plan::where_run_starts;
pub use replay::replay;
pub use snapshot::setup_snapshot;

use plan::{Plan, plan, wait_for_slot};
use shell::Relay;
use sink::make_sink;
use snapshot::take_snapshot;
use stream::{StreamEnd, StreamSpec, stream};

/// How a session of `walbox run` ended without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SessionEnd {
    /// A stop signal.
    Stopped,
    /// Reading stopped before a table with a new identity: the next session,
    /// at once, takes its snapshot (the checkpoint says so) and streams on.
    SnapshotDue,
}

/// An error after which a new session, resuming from the slot's confirmed
/// position, can succeed: connection loss, a server restart, a delivery that timed
/// out. Displays as the error it wraps.
#[derive(Debug)]
struct Transient(anyhow::Error);

impl std::fmt::Display for Transient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

impl std::error::Error for Transient {}

fn transient(e: impl Into<anyhow::Error>) -> anyhow::Error {
    anyhow::Error::new(Transient(e.into()))
}

/// The replication connection stalled (inside a [`Transient`]). Displays as
/// its message.
#[derive(Debug)]
struct Stalled(String);

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Stalled {}

/// The slot is gone or invalidated: walbox cannot go on without an operator.
/// Displays as the error it wraps.
#[derive(Debug)]
struct SlotLost(anyhow::Error);

impl std::fmt::Display for SlotLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

impl std::error::Error for SlotLost {}

/// Why a session ended, for `walbox_sessions_ended_total{reason}`.
fn end_reason(result: &Result<()>) -> &'static str {
    use pgwire_replication::PgWireError;
    let Err(e) = result else {
        return "stopped";
    };
    if e.downcast_ref::<SlotLost>().is_some() {
        return "slot_lost";
    }
    let Some(Transient(inner)) = e.downcast_ref::<Transient>() else {
        return "error";
    };
    if inner.downcast_ref::<Stalled>().is_some() {
        return "stall";
    }
    for cause in inner.chain() {
        if let Some(walbox_core::CoreError::Delivery { .. }) = cause.downcast_ref() {
            return "broker_timeout";
        }
        if cause.downcast_ref::<walbox_sink::SinkError>().is_some() {
            return "broker_error";
        }
        match cause.downcast_ref::<PgWireError>() {
            Some(PgWireError::Server(_)) => return "server_restart",
            Some(PgWireError::Io(_)) => return "connection_lost",
            _ => {}
        }
        if let Some(pg) = cause.downcast_ref::<tokio_postgres::Error>() {
            return if pg.as_db_error().is_some() {
                "server_restart"
            } else {
                "connection_lost"
            };
        }
    }
    "connection_lost"
}

/// A failed SQL connection is transient when the server may answer later (refused,
/// reset, starting up, shutting down); wrong credentials, a missing database, a
/// certificate that does not verify, or a bad TLS setup would only repeat.
fn classify_sql(e: anyhow::Error) -> anyhow::Error {
    let Some(pg) = e
        .chain()
        .find_map(|c| c.downcast_ref::<tokio_postgres::Error>())
    else {
        return e; // not from the connection itself: configuration
    };
    if let Some(db) = pg.as_db_error() {
        let code = db.code().code();
        let lasting = code.starts_with("28") || code == "3D000" || code == "42501";
        return if lasting { e } else { transient(e) };
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(pg);
    while let Some(err) = source {
        let tls = err.downcast_ref::<rustls::Error>().is_some()
            || err
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some());
        if tls {
            return e;
        }
        source = err.source();
    }
    transient(e)
}

/// Finding the server of a session: transient when servers answered but none
/// was of the kind asked for (a standby being promoted) or none answered in
/// time; fatal when two primaries answered (only fencing one ends that);
/// connection errors as [`classify_sql`] has them.
fn classify_resolve(e: anyhow::Error) -> anyhow::Error {
    if e.downcast_ref::<crate::pg::TwoPrimaries>().is_some() {
        e
    } else if e.downcast_ref::<crate::pg::NoServer>().is_some() {
        transient(e)
    } else {
        classify_sql(e)
    }
}

/// Replication errors: I/O and server errors (restart, shutdown, a lost
/// connection) are transient; authentication, TLS and protocol errors are not.
fn classify_replication(e: anyhow::Error) -> anyhow::Error {
    use pgwire_replication::PgWireError;
    match e.chain().find_map(|c| c.downcast_ref::<PgWireError>()) {
        Some(PgWireError::Io(_) | PgWireError::Server(_)) => transient(e),
        _ => e,
    }
}

fn is_transient(e: &anyhow::Error) -> bool {
    e.downcast_ref::<Transient>().is_some()
}

/// Backoff before session `attempt` (1, 2, ...): 250 ms doubling to 30 s, with
/// up to 20% jitter so that several relays do not reconnect in step.
fn backoff(attempt: u32) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let base = 250u64
        .saturating_mul(1 << attempt.saturating_sub(1).min(10))
        .min(30_000);
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    Duration::from_millis(base + random % (base / 5 + 1))
}

/// A session that ran this long, or moved the checkpoint over events the
/// destination acknowledged, resets the backoff: a link that fails now and then
/// between sessions that make progress is tried again within the first step,
/// not after a wait grown to 30 s.
const HEALTHY_SESSION: Duration = Duration::from_secs(60);

/// Events the destination acknowledged in this process, over every session.
static ACKNOWLEDGED: AtomicU64 = AtomicU64::new(0);

/// What `walbox run` was asked on its command line.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Start here instead of at the checkpoint (the first session only).
    pub from_lsn: Option<Lsn>,
    /// Wait while another reader holds the slot, then take it over.
    pub wait_for_slot: bool,
    /// Start at the slot's position even when it is ahead of the checkpoint
    /// (events between them were never published by walbox).
    pub accept_slot_position: bool,
    /// Start at `from_lsn` even when it is after the checkpoint (without one,
    /// after the slot's position): the events in between are not published.
    pub accept_skip: bool,
    /// Planning for `walbox replay`, whose start flag is `--from` and which
    /// never skips.
    pub replay: bool,
    /// Start although the server's WAL ends before the checkpoint (the server
    /// was restored from an older copy, or a lagging standby was promoted).
    pub accept_wal_behind: bool,
}

/// The configuration and the checkpoint store, shared by every phase.
#[derive(Clone, Copy)]
pub(crate) struct Ctx<'a> {
    pub(crate) config: &'a Config,
    pub(crate) conn: &'a ConnParams,
    pub(crate) store: &'a CheckpointFile,
    /// The metrics, when `metrics.listen` is set.
    pub(crate) metrics: Option<&'a Arc<Metrics>>,
}

impl Ctx<'_> {
    /// Tells `/readyz` what the relay does now.
    pub(crate) fn state(&self, state: State, reason: impl Into<String>) {
        if let Some(m) = self.metrics {
            m.health.set(state, reason);
        }
    }
}

/// Starts the metrics endpoint and the slot sampler when `metrics.listen` is set.
pub(crate) fn start_metrics(config: &Config, conn: &ConnParams) -> Result<Option<Arc<Metrics>>> {
    let Some(listen) = config.metrics.listen.as_deref() else {
        return Ok(None);
    };
    let m = Metrics::new();
    let n = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
    m.in_flight_events_limit.set(n(config.sink.max_in_flight()));
    m.in_flight_bytes_limit
        .set(n(config.sink.max_in_flight_bytes));
    let (sampled, conn, slot) = (Arc::clone(&m), conn.clone(), config.source.slot.clone());
    crate::metrics::server::start(listen, Arc::clone(&m), move || {
        crate::metrics::slot_sampler::run(sampled, conn, slot)
    })?;
    Ok(Some(m))
}

/// Runs the relay until a signal stops it or a fatal error does. Transient errors
/// end the session; after a backoff a new one resumes from the checkpoint
/// (events after it are sent again, with the same ids).
pub async fn run(config: Config, mut options: RunOptions) -> Result<()> {
    // First, so a stop request during start-up is a clean stop too.
    let mut signals = signals()?;
    let conn = ConnParams::parse(config.dsn()?)?;
    let store = config.checkpoint_store();
    let metrics = start_metrics(&config, &conn)?;
    let ctx = Ctx {
        config: &config,
        conn: &conn,
        store: &store,
        metrics: metrics.as_ref(),
    };
    if config.sink.kind == crate::config::SinkKind::Nats
        && let Some(risk) =
            crate::doctor::duplicate_window_risk(config.sink.nats.duplicate_window_s())
    {
        tracing::warn!("{risk}");
    }
    let mut attempt = 0u32;
    loop {
        let began = Instant::now();
        ctx.state(
            State::Connecting,
            format!("connecting to {}", conn.describe()),
        );
        if let Some(m) = ctx.metrics {
            m.sessions_started.inc();
        }
        let saved = || ctx.store.load().ok().flatten().map(|c| c.lsn);
        let before = saved();
        let acknowledged = ACKNOWLEDGED.load(Ordering::Relaxed);
        let result = session(ctx, &options, attempt, &mut signals).await;
        if let Ok(SessionEnd::SnapshotDue) = result {
            if let Some(m) = ctx.metrics {
                m.session_ended("snapshot_due");
            }
            options.from_lsn = None;
            attempt = 0;
            tracing::info!("taking the snapshot of the tables with a new identity");
            continue;
        }
        let result = result.map(drop);
        let reason = end_reason(&result);
        if let Some(m) = ctx.metrics {
            m.session_ended(reason);
        }
        // An explicit start position applies once; later sessions resume from
        // the checkpoint, which then reflects it.
        options.from_lsn = None;
        options.accept_slot_position = false;
        options.accept_wal_behind = false;
        options.accept_skip = false;
        let Err(e) = result else {
            ctx.state(State::Stopping, "stopped");
            return Ok(());
        };
        if !is_transient(&e) {
            let state = if reason == "slot_lost" {
                State::SlotLost
            } else {
                State::Failed
            };
            ctx.state(state, format!("{e:#}"));
            if ctx.metrics.is_some() {
                // The endpoints stay up so /readyz can say why; a restart
                // would fail the same way.
                tracing::error!("{e:#}");
                tracing::warn!("walbox stopped relaying; /readyz says why until walbox is stopped");
                let _ = signals.recv().await;
                return Err(anyhow!("stopped after an error: {e:#}"));
            }
            return Err(e);
        }
        ctx.state(
            if reason == "stall" {
                State::Stalled
            } else {
                State::BackingOff
            },
            format!("{e:#}"),
        );
        // A checkpoint moved by keepalives alone (an idle outbox) is no
        // progress: a fault that recurs in every session still backs off.
        let progressed = saved() > before && ACKNOWLEDGED.load(Ordering::Relaxed) > acknowledged;
        if began.elapsed() >= HEALTHY_SESSION || progressed {
            attempt = 0;
        }
        attempt += 1;
        let delay = backoff(attempt);
        tracing::warn!(
            error = %format!("{e:#}"),
            attempt,
            retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            "session ended; resuming from the checkpoint"
        );
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            Some(()) = signals.recv() => {
                tracing::info!("stopped while waiting to reconnect");
                return Ok(());
            }
        }
    }
}

/// One session: check the slot and checkpoint, create the sink, then snapshot
/// and/or stream until stopped or failed.
async fn session(
    ctx: Ctx<'_>,
    options: &RunOptions,
    attempt: u32,
    signals: &mut mpsc::UnboundedReceiver<()>,
) -> Result<SessionEnd> {
    let config = ctx.config;
    let slot_name = &config.source.slot;
    // One server for the whole session, the SQL and the replication connection.
    let pinned = ctx.conn.resolve().await.map_err(classify_resolve)?;
    let ctx = Ctx {
        conn: &pinned,
        ..ctx
    };
    let sql = ctx.conn.connect().await.map_err(classify_sql)?;
    let saved = ctx.store.load()?;
    let mut slot = crate::slot::info(&sql, slot_name)
        .await
        .map_err(classify_sql)?;
    if let Some(info) = slot.clone()
        && let Some(pid) = info.active_pid
    {
        if options.wait_for_slot {
            match wait_for_slot(&sql, slot_name, info, signals).await? {
                Some(free) => slot = Some(free),
                None => return Ok(SessionEnd::Stopped),
            }
        } else {
            let e = anyhow!(
                "slot {slot_name:?} is in use by pid {pid} (another walbox?); stop it, or start \
                 this one with --wait-for-slot to take over when it ends"
            );
            // After a lost connection the old walsender can hold the slot a little
            // longer; at first start a holder is another reader.
            return Err(if attempt > 0 { transient(e) } else { e });
        }
    }
    takeover::check(ctx, &sql, saved.as_ref(), slot.as_ref(), options).await?;
    let plan = plan(config, ctx.store, saved.as_ref(), slot.as_ref(), options)?;
    crate::failover::ensure(ctx.conn, &sql, config)
        .await
        .map_err(classify_replication)
        .map_err(classify_sql)?;
    // The outbox tables as they are now, against what the checkpoint recorded.
    let current = crate::publication::identities(&sql, &config.source.publication, &config.outbox)
        .await
        .map_err(classify_sql)?;
    let saved = identity::record_if_unrecorded(ctx.store, saved, &current)?;
    // Where reading stops when a table has a new identity (before its first
    // insert, or here): the server's WAL position now, past every change to the
    // publication made before this start.
    let wal_now = match &plan {
        Plan::Stream { .. } => {
            let now: String = sql
                .query_one("SELECT pg_current_wal_lsn()::text", &[])
                .await
                .map_err(|e| classify_sql(e.into()))?
                .get(0);
            Some(now.parse::<Lsn>()?)
        }
        _ => None,
    };
    drop(sql);
    let (sink, mut deliveries) = make_sink(config)?;
    let mut relay = Relay::new(ctx, sink)?;
    relay.accept_slot_position = options.accept_slot_position;
    relay.publication = Some(
        PublicationWatch::start(
            ctx.conn,
            &config.source.publication,
            &config.outbox,
            &config.producer,
            current.clone(),
        )
        .await
        .map_err(|e| {
            if e.downcast_ref::<crate::publication::IdentityChanged>()
                .is_some()
            {
                transient(e)
            } else {
                classify_sql(e)
            }
        })?,
    );
    // The publication passed its first check: every configured table is in it.
    let (saved, catch_up) = identity::reconcile(config, ctx.store, saved, &current)?;
    let pause = wal_now.filter(|_| !catch_up.is_empty());
    relay
        .core
        .expect_tables(identity::expected_oids(saved.as_ref(), &current));
    relay.adopt_checkpoint(saved);
    relay.tables = current;
    let (start, server_confirmed) = match plan {
        Plan::Snapshot { resume } => {
            match take_snapshot(&mut relay, &mut deliveries, signals, resume).await? {
                Some(point) => {
                    relay.core.continue_after_snapshot(point);
                    (point, point)
                }
                None => return Ok(SessionEnd::Stopped),
            }
        }
        Plan::Stream {
            start,
            server_confirmed,
        } => {
            let resume = relay
                .core
                .checkpoint()
                .filter(|cp| cp.lsn == start && options.from_lsn.is_none())
                .and_then(|cp| cp.partial.clone());
            relay.core.resume_at(start, server_confirmed, resume);
            (start, server_confirmed)
        }
    };
    if pause.is_some() {
        relay
            .core
            .pause_before(catch_up.iter().map(|(table, id)| (id.oid, table.clone())));
    }
    let spec = StreamSpec {
        start,
        server_confirmed,
        report: true,
        stop_at: pause,
        accept_wal_behind: options.accept_wal_behind,
    };
    let end = stream(&mut relay, &mut deliveries, signals, &spec).await?;
    if end != StreamEnd::ReachedEnd {
        return Ok(SessionEnd::Stopped);
    }
    if pause.is_none() {
        // Reading ended before a table swapped while walbox streamed: the next
        // session finds its new identity and takes its snapshot first.
        return Err(transient(anyhow!(
            "an outbox table came with a new oid in the stream (swapped while walbox streamed); \
             everything before its first insert is published, and a new session takes its \
             snapshot"
        )));
    }
    // Everything before the tables' first insert is published: their snapshot
    // is due at this position (a crash from here on takes it at the next start).
    let mut cp = relay
        .core
        .checkpoint()
        .cloned()
        .context("a checkpoint after streaming")?;
    cp.partial = None;
    cp.snapshot = Some(walbox_core::SnapshotState {
        consistent_point: Some(cp.lsn),
        complete: false,
        rows: 0,
        tables: catch_up,
    });
    ctx.store.save(&cp)?;
    tracing::info!(position = %cp.lsn, tables = ?cp.snapshot.as_ref().map(|s| s.tables.keys().collect::<Vec<_>>()),
        "published everything before the first insert into a table with a new identity; its \
         snapshot is next");
    Ok(SessionEnd::SnapshotDue)
}

#[allow(clippy::print_stdout)] // command output
fn println_out(line: &str) {
    println!("{line}");
}

/// Records the longest time an acknowledged position waited before the server had it.
fn feedback_observer(longest_ms: Arc<AtomicU64>) -> pgwire_replication::FeedbackObserver {
    pgwire_replication::FeedbackObserver::new(move |sent| {
        let ms = u64::try_from(sent.pending_for.as_millis()).unwrap_or(u64::MAX);
        longest_ms.fetch_max(ms, Ordering::Relaxed);
    })
}

/// Polls `done` until it holds or `timeout` passes; says which.
async fn walbox_wait(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

/// SIGINT / SIGTERM: the first asks for a clean stop; the second exits at once
/// without confirming anything more.
fn signals() -> Result<mpsc::UnboundedReceiver<()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut seen = 0;
        loop {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            seen += 1;
            if seen > 1 {
                tracing::warn!("second signal: exiting now");
                std::process::exit(130);
            }
            let _ = tx.send(());
        }
    });
    Ok(rx)
}
