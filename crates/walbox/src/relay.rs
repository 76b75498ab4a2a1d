//! `walbox run`, `walbox setup --snapshot`, `walbox replay`: outbox rows from the
//! slot (and from an exported snapshot) to the sink; the checkpoint and the
//! slot's position move only over acknowledged events.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use pgwire_replication::{ReplicationClient, ReplicationEvent};
use tokio::sync::mpsc;
use walbox_outbox::{Event, Mapper, Position, TableConfig, TopicTemplate};
use walbox_pgoutput::{Decoder, LogicalMessage, Lsn, Oid, TupleValue, Xid};
use walbox_replication::{
    AckTracker, CHECKPOINT_VERSION, Checkpoint, CheckpointFile, Partial, SnapshotState, Ticket,
    TxnId,
};
use walbox_sink::{
    Deliveries, Delivery, DeliveryError, KafkaSink, KafkaSinkConfig, Sink, SinkError, StdoutSink,
};

use crate::catalog;
use crate::config::{Config, DeadLetterPolicy, ReplayWindow, SinkKind, SnapshotMode};
use crate::pg::ConnParams;
use crate::snapshot;

/// Events read from the server but not yet taken by the relay; with each row one
/// message, this bounds the memory of the read-ahead.
const READ_AHEAD_EVENTS: usize = 256;
/// How often progress is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);

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

/// A session that ran this long resets the backoff.
const HEALTHY_SESSION: Duration = Duration::from_secs(60);

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
}

/// The configuration and the checkpoint store, shared by every phase.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    config: &'a Config,
    conn: &'a ConnParams,
    store: &'a CheckpointFile,
}

/// Runs the relay until a signal stops it or a fatal error does. Transient errors
/// end the session; after a backoff a new one resumes from the checkpoint
/// (events after it are sent again, with the same ids).
pub async fn run(config: Config, mut options: RunOptions) -> Result<()> {
    // First, so a stop request during start-up is a clean stop too.
    let mut signals = signals()?;
    let conn = ConnParams::parse(config.dsn()?)?;
    let store = config.checkpoint_store();
    let ctx = Ctx {
        config: &config,
        conn: &conn,
        store: &store,
    };
    let mut attempt = 0u32;
    loop {
        let began = Instant::now();
        let result = session(ctx, &options, attempt, &mut signals).await;
        // An explicit start position applies once; later sessions resume from
        // the checkpoint, which then reflects it.
        options.from_lsn = None;
        options.accept_slot_position = false;
        let Err(e) = result else {
            return Ok(());
        };
        if !is_transient(&e) {
            return Err(e);
        }
        if began.elapsed() >= HEALTHY_SESSION {
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

/// The slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone)]
struct SlotInfo {
    plugin: Option<String>,
    same_database: bool,
    active_pid: Option<i32>,
    confirmed: Option<Lsn>,
    wal_status: Option<String>,
}

async fn slot_info(sql: &tokio_postgres::Client, slot: &str) -> Result<Option<SlotInfo>> {
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

/// Where a session starts.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Plan {
    /// Publish the existing rows from an exported snapshot, then stream. Without
    /// `resume`, the slot is created with the snapshot and the stream starts at its
    /// consistent point. With `resume`, the slot of an unfinished snapshot still
    /// holds every change committed after that position (its consistent point):
    /// the snapshot is taken again from a temporary slot and the slot streams
    /// from `resume`.
    Snapshot { resume: Option<Lsn> },
    /// Stream from `start`; the server holds `server_confirmed`.
    Stream { start: Lsn, server_confirmed: Lsn },
}

/// How to recover events that a slot no longer has.
const RECOVER: &str = "To publish them, create a new slot with a snapshot of the rows that \
    were not published (`walbox slot drop`, then `walbox setup --snapshot --snapshot-where \
    \"...\"`); to continue without them, start once with --accept-slot-position";

/// Decides where to start from the checkpoint, the slot and the options.
fn plan(
    config: &Config,
    store: &CheckpointFile,
    saved: Option<&Checkpoint>,
    slot: Option<&SlotInfo>,
    options: &RunOptions,
) -> Result<Plan> {
    let name = &config.source.slot;
    let unfinished = saved.filter(|cp| cp.snapshot_interrupted());
    let Some(slot) = slot else {
        if let Some(cp) = unfinished {
            return snapshot_without_its_slot(name, store, cp, options);
        }
        if let Some(cp) = saved {
            bail!(
                "replication slot {name:?} does not exist, but the checkpoint {} says walbox \
                 published up to {}: the slot was dropped, and outbox events committed while \
                 it was gone are not in any slot. {RECOVER}",
                store.path().display(),
                cp.lsn
            );
        }
        if config.snapshot.mode == SnapshotMode::Initial {
            return Ok(Plan::Snapshot { resume: None });
        }
        bail!(
            "replication slot {name:?} does not exist; create it with `walbox setup` \
             (`walbox setup --snapshot` also publishes the rows already in the outbox)"
        );
    };
    if slot.plugin.as_deref() != Some("pgoutput") {
        bail!(
            "slot {name:?} uses plugin {:?}, walbox needs pgoutput",
            slot.plugin
        );
    }
    if !slot.same_database {
        bail!("slot {name:?} belongs to another database");
    }
    if slot.wal_status.as_deref() == Some("lost") {
        let since = saved.map_or_else(
            || "its confirmed position".to_owned(),
            |cp| format!("{} (walbox's checkpoint)", cp.lsn),
        );
        bail!(
            "slot {name:?} is invalidated (wal_status = lost): the server removed WAL it still \
             needed (max_slot_wal_keep_size), so outbox events committed after {since} may be \
             missing. {RECOVER}"
        );
    }
    let confirmed = slot
        .confirmed
        .with_context(|| format!("slot {name:?} has no confirmed position"))?;
    if let Some(cp) = unfinished {
        let resume = snapshot_resume(name, store, cp, confirmed, options)?;
        tracing::warn!(
            slot = %name,
            checkpoint = %store.path().display(),
            "the initial snapshot did not finish; taking it again from a temporary slot, then \
             streaming the slot from its consistent point {resume} (rows published already, \
             and events committed after that point, may be published again, with the same \
             event ids)"
        );
        return Ok(Plan::Snapshot {
            resume: Some(resume),
        });
    }
    if let Some(from) = options.from_lsn {
        if from < confirmed {
            bail!(
                "--from-lsn {from} is before slot {name:?}'s confirmed position; the earliest \
                 position still available is {confirmed}"
            );
        }
        if let Some(cp) = saved
            && from > cp.lsn
        {
            tracing::warn!(from = %from, checkpoint = %cp.lsn,
                "--from-lsn is after the checkpoint: events between them are skipped");
        }
        return Ok(Plan::Stream {
            start: from,
            server_confirmed: confirmed,
        });
    }
    let start = match saved {
        None => confirmed,
        Some(cp) if cp.lsn >= confirmed => {
            if cp.lsn > confirmed {
                tracing::info!(slot = %confirmed, checkpoint = %cp.lsn,
                    "the slot is behind the checkpoint (server crash or replay window); \
                     starting at the checkpoint");
            }
            cp.lsn
        }
        Some(cp) if options.accept_slot_position => {
            tracing::warn!(slot = %confirmed, checkpoint = %cp.lsn,
                "starting at the slot's position as asked (--accept-slot-position); outbox \
                 events committed between the checkpoint and it were not published by walbox");
            confirmed
        }
        Some(cp) => bail!(
            "slot {name:?} is at {confirmed}, ahead of walbox's checkpoint {} at {}: outbox \
             events committed between {} and {confirmed} were never published (the slot was \
             advanced by another reader, or dropped and created again, while walbox was \
             down). {RECOVER}",
            store.path().display(),
            cp.lsn,
            cp.lsn
        ),
    };
    Ok(Plan::Stream {
        start,
        server_confirmed: confirmed,
    })
}

/// An unfinished snapshot whose slot does not exist. Without a recorded
/// consistent point, walbox stopped between saving the checkpoint and creating
/// the slot: the slot is created with a snapshot, as on a first start. With one,
/// the slot was dropped, and the events it held are gone: refused unless the
/// slot position is accepted.
fn snapshot_without_its_slot(
    name: &str,
    store: &CheckpointFile,
    cp: &Checkpoint,
    options: &RunOptions,
) -> Result<Plan> {
    let Some(point) = cp.snapshot.as_ref().and_then(|s| s.consistent_point) else {
        return Ok(Plan::Snapshot { resume: None });
    };
    if !options.accept_slot_position {
        bail!(
            "replication slot {name:?} does not exist, but the checkpoint {} says the initial \
             snapshot created it at {point} and did not finish: the slot was dropped, and \
             outbox events committed after {point} and deleted from the table since are in no \
             slot, so a new snapshot cannot publish them. To take the snapshot again from a \
             new slot without them, start once with --accept-slot-position",
            store.path().display()
        );
    }
    tracing::warn!(slot = %name, consistent_point = %point,
        "the slot of the unfinished snapshot was dropped; taking the snapshot again from a new \
         slot as asked (--accept-slot-position): outbox events committed after the old \
         consistent point and deleted since are not published");
    Ok(Plan::Snapshot { resume: None })
}

/// Where the stream of an unfinished snapshot's slot continues: its consistent
/// point. walbox reports no position to the server while a snapshot is
/// unfinished, so the slot is still there. Without a recorded point (walbox
/// stopped between creating the slot and saving the point) it is the slot's
/// confirmed position, which nothing has moved since its creation.
fn snapshot_resume(
    name: &str,
    store: &CheckpointFile,
    cp: &Checkpoint,
    confirmed: Lsn,
    options: &RunOptions,
) -> Result<Lsn> {
    let Some(point) = cp.snapshot.as_ref().and_then(|s| s.consistent_point) else {
        return Ok(confirmed);
    };
    if confirmed > point {
        if options.accept_slot_position {
            tracing::warn!(slot = %confirmed, consistent_point = %point,
                "streaming the unfinished snapshot's slot from its position as asked \
                 (--accept-slot-position); outbox events committed between the consistent \
                 point and it and deleted from the table since are not published");
            return Ok(confirmed);
        }
        bail!(
            "slot {name:?} is at {confirmed}, ahead of the consistent point {point} of the \
             unfinished initial snapshot in {}: outbox events committed between {point} and \
             {confirmed} are no longer in the slot, and those deleted from the table since are \
             in no snapshot either (the slot was advanced by another reader). {RECOVER}",
            store.path().display()
        );
    }
    Ok(point)
}

/// Where `walbox run` would start, for `walbox doctor`: the checkpoint and the
/// slot against each other. `None` when there is neither a slot nor a checkpoint.
pub async fn where_run_starts(
    sql: &tokio_postgres::Client,
    config: &Config,
) -> Result<Option<String>> {
    let store = config.checkpoint_store();
    let saved = store.load()?;
    let slot = slot_info(sql, &config.source.slot).await?;
    if saved.is_none() && slot.is_none() {
        return Ok(None);
    }
    let at = match saved.as_ref() {
        Some(cp) => format!("checkpoint {} at {}", store.path().display(), cp.lsn),
        None => format!("no checkpoint yet at {}", store.path().display()),
    };
    Ok(Some(
        match plan(
            config,
            &store,
            saved.as_ref(),
            slot.as_ref(),
            &RunOptions::default(),
        )? {
            Plan::Snapshot {
                resume: Some(resume),
            } => format!(
                "walbox run takes the unfinished snapshot again from a temporary slot, then \
                 streams the slot from {resume} ({at})"
            ),
            Plan::Snapshot { resume: None } => {
                format!("walbox run creates the slot with a snapshot ({at})")
            }
            Plan::Stream { start, .. } => format!("walbox run starts at {start} ({at})"),
        },
    ))
}

/// A gated replication session and the server's identity, checked against the
/// relay's checkpoint (when it has one) before anything else runs on it.
async fn connect_identified(
    relay: &Relay<'_>,
    cfg: pgwire_replication::ReplicationConfig,
) -> Result<(ReplicationClient, pgwire_replication::IdentifySystem)> {
    let ctx = relay.ctx;
    let where_ = || format!("replication connection to {}", ctx.conn.describe());
    let mut client = ReplicationClient::connect_gated(cfg)
        .await
        .with_context(where_)
        .map_err(classify_replication)?;
    let ident = client
        .identify_system()
        .await
        .with_context(where_)
        .map_err(classify_replication)?;
    if let Some(cp) = &relay.checkpoint {
        check_identity(cp, ctx.store, &ident, &ctx.config.source.slot)?;
    }
    Ok((client, ident))
}

/// Refuses a checkpoint written for another cluster, database or slot.
fn check_identity(
    cp: &Checkpoint,
    store: &CheckpointFile,
    ident: &pgwire_replication::IdentifySystem,
    slot: &str,
) -> Result<()> {
    let database = ident.dbname.as_deref().unwrap_or_default();
    if cp.system_identifier != ident.system_id || cp.database != database || cp.slot != slot {
        bail!(
            "checkpoint {} belongs to slot {:?} of database {:?} on cluster {}, not to slot \
             {slot:?} of database {database:?} on cluster {}: give each relay its own \
             checkpoint path (checkpoint.path, --checkpoint)",
            store.path().display(),
            cp.slot,
            cp.database,
            cp.system_identifier,
            ident.system_id
        );
    }
    Ok(())
}

/// Waits while another reader holds the slot (`--wait-for-slot`); `None` when a
/// stop signal came first.
async fn wait_for_slot(
    sql: &tokio_postgres::Client,
    slot: &str,
    mut info: SlotInfo,
    signals: &mut mpsc::UnboundedReceiver<()>,
) -> Result<Option<SlotInfo>> {
    let mut logged = false;
    while let Some(pid) = info.active_pid {
        if !logged {
            tracing::info!(
                slot,
                pid,
                "slot in use; waiting for it to be released (--wait-for-slot)"
            );
            logged = true;
        }
        tokio::select! {
            Some(()) = signals.recv() => return Ok(None),
            () = tokio::time::sleep(SLOT_POLL) => {}
        }
        match slot_info(sql, slot).await.map_err(classify_sql)? {
            Some(next) => info = next,
            None => bail!("slot {slot:?} was dropped while waiting for it"),
        }
    }
    if logged {
        tracing::info!(slot, "slot released; taking over");
    }
    Ok(Some(info))
}

/// How often `--wait-for-slot` looks at the slot.
const SLOT_POLL: Duration = Duration::from_millis(500);

/// One session: check the slot and checkpoint, create the sink, then snapshot
/// and/or stream until stopped or failed.
async fn session(
    ctx: Ctx<'_>,
    options: &RunOptions,
    attempt: u32,
    signals: &mut mpsc::UnboundedReceiver<()>,
) -> Result<()> {
    let config = ctx.config;
    let slot_name = &config.source.slot;
    let sql = ctx.conn.connect().await.map_err(classify_sql)?;
    let saved = ctx.store.load()?;
    let mut slot = slot_info(&sql, slot_name).await.map_err(classify_sql)?;
    if let Some(info) = slot.clone()
        && let Some(pid) = info.active_pid
    {
        if options.wait_for_slot {
            match wait_for_slot(&sql, slot_name, info, signals).await? {
                Some(free) => slot = Some(free),
                None => return Ok(()),
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
    let plan = plan(config, ctx.store, saved.as_ref(), slot.as_ref(), options)?;
    drop(sql);
    let (sink, mut deliveries) = make_sink(config)?;
    let mut relay = Relay::new(ctx, sink)?;
    relay.adopt_checkpoint(saved);
    let (start, server_confirmed) = match plan {
        Plan::Snapshot { resume } => {
            match take_snapshot(&mut relay, &mut deliveries, signals, resume).await? {
                Some(point) => (point, point),
                None => return Ok(()),
            }
        }
        Plan::Stream {
            start,
            server_confirmed,
        } => {
            relay.tracker = AckTracker::new(start);
            if options.from_lsn.is_none() {
                relay.resume_partial = relay
                    .checkpoint
                    .as_ref()
                    .filter(|cp| cp.lsn == start)
                    .and_then(|cp| cp.partial);
            }
            (start, server_confirmed)
        }
    };
    let spec = StreamSpec {
        start,
        server_confirmed,
        report: true,
        stop_at: None,
    };
    stream(&mut relay, &mut deliveries, signals, &spec)
        .await
        .map(drop)
}

/// The configured sink.
enum AnySink {
    Kafka(KafkaSink),
    Stdout(StdoutSink),
}

impl Sink for AnySink {
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        match self {
            AnySink::Kafka(s) => s.send(event, token).await,
            AnySink::Stdout(s) => s.send(event, token).await,
        }
    }

    fn end_batch(&mut self) {
        match self {
            AnySink::Kafka(s) => s.end_batch(),
            AnySink::Stdout(s) => s.end_batch(),
        }
    }

    async fn flush(&mut self, timeout: Duration) -> Result<(), SinkError> {
        match self {
            AnySink::Kafka(s) => s.flush(timeout).await,
            AnySink::Stdout(s) => s.flush(timeout).await,
        }
    }
}

fn make_sink(config: &Config) -> Result<(AnySink, Deliveries)> {
    Ok(match config.sink.kind {
        SinkKind::Kafka => {
            let (sink, deliveries) = KafkaSink::new(KafkaSinkConfig {
                properties: config.sink.kafka_properties()?,
                create_topics: config.sink.create_topics,
                topic_partitions: config.sink.topic_partitions,
                topic_replication: config.sink.topic_replication,
                max_in_flight: config.sink.max_in_flight,
            })?;
            (AnySink::Kafka(sink), deliveries)
        }
        SinkKind::Stdout => {
            let (sink, deliveries) = StdoutSink::new();
            (AnySink::Stdout(sink), deliveries)
        }
    })
}

/// A sink that could not take an event: a Kafka client error may pass (a new
/// session retries), anything else (a missing topic, configuration) would repeat.
fn sink_error(e: SinkError) -> anyhow::Error {
    match e {
        SinkError::Kafka(_) => transient(e),
        other => anyhow!(other),
    }
}

/// Sink tokens of in-flight events: (ticket, bytes), reusing slots.
#[derive(Debug, Default)]
struct InFlight {
    /// (ticket, bytes, commit time of the event's transaction in Postgres
    /// microseconds, 0 when unknown).
    entries: Vec<Option<(Ticket, usize, i64)>>,
    free: Vec<usize>,
    bytes: usize,
}

impl InFlight {
    fn insert(&mut self, ticket: Ticket, size: usize, committed: i64) -> usize {
        self.bytes += size;
        let entry = Some((ticket, size, committed));
        if let Some(token) = self.free.pop()
            && let Some(slot) = self.entries.get_mut(token)
        {
            *slot = entry;
            return token;
        }
        self.entries.push(entry);
        self.entries.len() - 1
    }

    fn remove(&mut self, token: usize) -> Option<(Ticket, i64)> {
        let (ticket, size, committed) = self.entries.get_mut(token)?.take()?;
        self.free.push(token);
        self.bytes -= size;
        Some((ticket, committed))
    }
}

#[derive(Debug)]
struct OpenTxn {
    id: TxnId,
    commit_lsn: Lsn,
    xid: Xid,
    index: u32,
    /// Events at the start of this transaction acknowledged before a restart:
    /// not sent again.
    skip: u32,
    /// Commit time (Postgres microseconds since 2000-01-01).
    committed: i64,
}

#[derive(Debug, Default)]
struct Stats {
    events: u64,
    transactions: u64,
    ignored_updates: u64,
    ignored_deletes: u64,
    ignored_truncates: u64,
    dead_lettered: u64,
    /// Events of a partly acknowledged transaction not sent again on resume.
    skipped: u64,
}

/// How often the checkpoint is written while the position moves.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);

/// What the checkpoint thread has flushed to disk.
#[derive(Debug, Clone)]
enum Saved {
    /// Submission `seq` is on disk: position `lsn`; `snapshot_done` is false
    /// while an initial snapshot is unfinished.
    Done {
        seq: u64,
        lsn: Lsn,
        snapshot_done: bool,
    },
    /// Nothing known yet.
    Nothing,
    /// A write failed; nothing after it is saved.
    Failed(String),
}

/// Writes checkpoints on a thread of its own, so the relay never waits for a
/// disk flush: it hands over the newest state and goes on, and only positions
/// the thread reports flushed are reported to the server. Submissions that
/// arrive while a write is under way are coalesced into the newest one.
struct CheckpointWriter {
    requests: std::sync::mpsc::Sender<(u64, Checkpoint)>,
    saved: Arc<tokio::sync::watch::Sender<Saved>>,
    submitted: u64,
}

impl CheckpointWriter {
    fn new(store: CheckpointFile) -> Self {
        let (requests, queue) = std::sync::mpsc::channel::<(u64, Checkpoint)>();
        let saved = Arc::new(tokio::sync::watch::Sender::new(Saved::Nothing));
        let report = Arc::clone(&saved);
        let spawned = std::thread::Builder::new()
            .name("walbox-checkpoint".into())
            .spawn(move || {
                while let Ok(mut next) = queue.recv() {
                    while let Ok(newer) = queue.try_recv() {
                        next = newer;
                    }
                    let (seq, cp) = next;
                    let state = match store.save(&cp) {
                        Ok(()) => Saved::Done {
                            seq,
                            lsn: cp.lsn,
                            snapshot_done: !cp.snapshot_interrupted(),
                        },
                        Err(e) => Saved::Failed(e.to_string()),
                    };
                    let failed = matches!(state, Saved::Failed(_));
                    report.send_replace(state);
                    if failed {
                        return;
                    }
                }
            });
        if let Err(e) = spawned {
            saved.send_replace(Saved::Failed(format!(
                "starting the checkpoint thread: {e}"
            )));
        }
        CheckpointWriter {
            requests,
            saved,
            submitted: 0,
        }
    }

    /// `cp` is on disk already (loaded, or written before streaming).
    fn known(&mut self, cp: &Checkpoint) {
        self.submitted += 1;
        self.saved.send_replace(Saved::Done {
            seq: self.submitted,
            lsn: cp.lsn,
            snapshot_done: !cp.snapshot_interrupted(),
        });
    }

    fn submit(&mut self, cp: Checkpoint) -> Result<()> {
        self.submitted += 1;
        self.requests
            .send((self.submitted, cp))
            .map_err(|_| anyhow!("the checkpoint thread stopped"))?;
        Ok(())
    }

    /// The flushed position and whether the snapshot (if any) is recorded done;
    /// an error once a write failed.
    fn saved(&self) -> Result<Option<(Lsn, bool)>> {
        match &*self.saved.borrow() {
            Saved::Done {
                lsn, snapshot_done, ..
            } => Ok(Some((*lsn, *snapshot_done))),
            Saved::Nothing => Ok(None),
            Saved::Failed(e) => bail!("writing the checkpoint: {e}"),
        }
    }

    /// Waits until everything submitted is on disk.
    async fn flushed(&self, timeout: Duration) -> Result<()> {
        let want = self.submitted;
        let mut rx = self.saved.subscribe();
        let waited = tokio::time::timeout(
            timeout,
            rx.wait_for(|s| match s {
                Saved::Done { seq, .. } => *seq >= want,
                Saved::Failed(_) => true,
                Saved::Nothing => want == 0,
            }),
        )
        .await;
        match waited {
            Err(_) => bail!(
                "the checkpoint was not written within {} s",
                timeout.as_secs()
            ),
            Ok(Err(_)) => bail!("the checkpoint thread stopped"),
            Ok(Ok(_)) => self.saved().map(drop),
        }
    }
}

/// The stream side of the pipeline: decoding, mapping, the sink, the position.
struct Relay<'a> {
    ctx: Ctx<'a>,
    out: Out,
    tracker: AckTracker,
    decoder: Decoder,
    mappers: HashMap<Oid, Mapper>,
    txn: Option<OpenTxn>,
    /// The newest checkpoint state (`None` until the cluster's identity is
    /// known); the writer says which of it is on disk.
    checkpoint: Option<Checkpoint>,
    writer: CheckpointWriter,
    saved_at: Instant,
    /// The snapshot's transaction and row count, until every row is acknowledged.
    pending_snapshot: Option<(TxnId, u64)>,
    /// Replay: stop before the first transaction that commits at or after it.
    stop_at: Option<Lsn>,
    reached_end: bool,
    /// On resume: the checkpoint's acknowledged prefix of the first transaction,
    /// until that transaction arrives.
    resume_partial: Option<Partial>,
    /// The prefix skipped in the front transaction, which the tracker does not
    /// count (its events are numbered from the first one sent).
    skipped_base: Option<Partial>,
    /// Commit-to-acknowledgement latency of streamed events.
    latency: Latency,
}

/// Hands events to the sink and keeps what is in flight.
struct Out {
    sink: AnySink,
    in_flight: InFlight,
    stats: Stats,
    dead_letter_topic: TopicTemplate,
    policy: DeadLetterPolicy,
}

impl Out {
    /// Maps `row` and sends the event (or its dead letter) as part of `txn`.
    async fn publish(
        &mut self,
        tracker: &mut AckTracker,
        mapper: &Mapper,
        row: &[TupleValue],
        position: Position,
        txn: TxnId,
        committed: i64,
    ) -> Result<()> {
        let event = match mapper.map(row, position) {
            Ok(event) => event,
            Err(e) => {
                let dead = mapper.dead_letter(row, position, &e, &self.dead_letter_topic);
                if self.policy == DeadLetterPolicy::Stop {
                    bail!(
                        "outbox row with event id {} at {}#{} (xid {}) in {} cannot be published ({}): {e}",
                        dead.event_id,
                        position.commit_lsn,
                        position.index,
                        position.xid,
                        mapper.table(),
                        e.class()
                    );
                }
                tracing::warn!(
                    table = mapper.table(),
                    event_id = %dead.event_id,
                    position = %format_args!("{}#{}", position.commit_lsn, position.index),
                    class = e.class(),
                    reason = %e,
                    topic = %dead.topic,
                    "dead-lettered"
                );
                self.stats.dead_lettered += 1;
                dead
            }
        };
        let ticket = tracker.event(txn);
        let token = self.in_flight.insert(ticket, event.size(), committed);
        self.stats.events += 1;
        tracing::debug!(
            event_id = %event.event_id,
            topic = %event.topic,
            position = %format_args!("{}#{}", position.commit_lsn, position.index),
            "sent to the sink"
        );
        self.sink.send(event, token).await.map_err(sink_error)
    }
}

impl<'a> Relay<'a> {
    fn new(ctx: Ctx<'a>, sink: AnySink) -> Result<Self> {
        Ok(Relay {
            ctx,
            out: Out {
                sink,
                in_flight: InFlight::default(),
                stats: Stats::default(),
                dead_letter_topic: ctx.config.dead_letter.template()?,
                policy: ctx.config.dead_letter.policy,
            },
            tracker: AckTracker::new(Lsn(0)),
            decoder: Decoder::new(),
            mappers: HashMap::new(),
            txn: None,
            checkpoint: None,
            writer: CheckpointWriter::new(ctx.store.clone()),
            saved_at: Instant::now(),
            pending_snapshot: None,
            stop_at: None,
            reached_end: false,
            resume_partial: None,
            skipped_base: None,
            latency: Latency::new(),
        })
    }

    /// Whether to take new WAL: not at the in-flight bound, not past a replay's
    /// end, and when stopping only to finish the transaction being read.
    fn reading(&self, stopping: bool) -> bool {
        !self.full() && !self.reached_end && (!stopping || self.txn.is_some())
    }

    fn full(&self) -> bool {
        self.tracker.in_flight() >= self.ctx.config.sink.max_in_flight as u64
            || self.out.in_flight.bytes >= self.ctx.config.sink.max_in_flight_bytes
    }

    /// Whether the checkpoint is behind what could be saved.
    fn checkpoint_dirty(&self) -> bool {
        let Some(cp) = &self.checkpoint else {
            return false;
        };
        if self.pending_snapshot.is_some() {
            return self
                .pending_snapshot
                .is_some_and(|(txn, _)| self.tracker.settled(txn));
        }
        self.savable() > cp.lsn || self.partial(cp) != cp.partial
    }

    /// The acknowledged prefix of the oldest unconfirmed transaction, as the
    /// checkpoint records it.
    fn partial(&self, cp: &Checkpoint) -> Option<Partial> {
        let tracked = self.tracker.partial().map(|(commit_lsn, events)| {
            let base = self
                .skipped_base
                .filter(|b| b.commit_lsn == commit_lsn)
                .map_or(0, |b| b.events);
            Partial {
                commit_lsn,
                events: base + events,
            }
        });
        // Only a transaction after the saved position (not one a replay or an
        // earlier --from-lsn sends again).
        let after = cp.lsn.max(self.savable());
        match tracked.filter(|p| p.commit_lsn >= after) {
            Some(p) => Some(p),
            // Nothing new acknowledged in it yet: the saved prefix still holds
            // while the position has not moved past its transaction.
            None if self.savable() <= cp.lsn => cp.partial,
            None => None,
        }
    }

    /// The acknowledged position, within a replay's end.
    fn savable(&self) -> Lsn {
        let confirmed = self.tracker.confirmed();
        self.stop_at.map_or(confirmed, |end| confirmed.min(end))
    }

    /// Takes a checkpoint that is already on disk as the current one.
    fn adopt_checkpoint(&mut self, cp: Option<Checkpoint>) {
        if let Some(c) = &cp {
            self.writer.known(c);
        }
        self.checkpoint = cp;
    }

    /// Hands the checkpoint to the writer when it is behind and the interval
    /// passed; with `force`, whenever it is behind, and waits until it is on disk.
    async fn save_checkpoint(&mut self, force: bool) -> Result<()> {
        self.writer.saved()?;
        if !self.checkpoint_dirty() || !(force || self.saved_at.elapsed() >= CHECKPOINT_EVERY) {
            if force {
                self.writer.flushed(Duration::from_secs(60)).await?;
            }
            return Ok(());
        }
        let savable = self.savable();
        let settled = self
            .pending_snapshot
            .filter(|(txn, _)| self.tracker.settled(*txn));
        let Some(cp) = self.checkpoint.as_mut() else {
            return Ok(());
        };
        if let Some((_, rows)) = settled {
            if let Some(s) = cp.snapshot.as_mut() {
                s.complete = true;
                s.rows = rows;
            }
            self.pending_snapshot = None;
            tracing::info!(rows, consistent_point = %savable, "snapshot complete: every row acknowledged");
        }
        let partial = self.checkpoint.as_ref().and_then(|c| self.partial(c));
        let Some(cp) = self.checkpoint.as_mut() else {
            return Ok(());
        };
        if self.pending_snapshot.is_none() {
            cp.lsn = cp.lsn.max(savable);
            cp.partial = partial;
        }
        let next = cp.clone();
        self.writer.submit(next)?;
        self.saved_at = Instant::now();
        if force {
            self.writer.flushed(Duration::from_secs(60)).await?;
        }
        Ok(())
    }

    /// The position that may be reported to the server: acknowledged, and on
    /// disk in the checkpoint.
    fn reportable(&self) -> Option<Lsn> {
        let (saved, snapshot_done) = self.writer.saved().ok()??;
        if self.pending_snapshot.is_some() || !snapshot_done {
            return None;
        }
        Some(self.tracker.confirmed().min(saved))
    }

    async fn delivered(&mut self, d: Delivery) -> Result<()> {
        let (ticket, committed) = self
            .out
            .in_flight
            .remove(d.token)
            .context("delivery report for an unknown event")?;
        match d.result {
            Ok(()) => {
                self.tracker.ack(ticket);
                self.latency.record(committed);
                Ok(())
            }
            Err(e) => {
                if e.is_about_the_message()
                    && self.out.policy == DeadLetterPolicy::Topic
                    && let Some(dead) = rejected_dead_letter(&e, &self.out.dead_letter_topic)
                {
                    // Refused for what it is (too large): its dead letter takes its
                    // place; the position passes it once that is acknowledged.
                    tracing::warn!(
                        event_id = %e.event_id,
                        topic = %e.topic,
                        class = e.class,
                        reason = %e.reason,
                        dead_letter_topic = %dead.topic,
                        "dead-lettered"
                    );
                    self.out.stats.dead_lettered += 1;
                    let token = self.out.in_flight.insert(ticket, dead.size(), committed);
                    return self.out.sink.send(dead, token).await.map_err(sink_error);
                }
                self.tracker.fail(ticket);
                // Not about this message (timeout, broker unreachable or refusing,
                // authorization, a dead-letter write failing): resume from the
                // checkpoint after a backoff. About the message, under the stop
                // policy: stop.
                let retry = !e.is_about_the_message();
                let e = anyhow!(e).context(format!(
                    "delivery failed; the position stays at {} and the next session resumes there",
                    self.tracker.confirmed()
                ));
                Err(if retry { transient(e) } else { e })
            }
        }
    }

    fn table_config(&self, namespace: &str, name: &str) -> Option<&'a TableConfig> {
        self.ctx
            .config
            .outbox
            .iter()
            .find(|t| t.qualified() == (namespace, name))
    }

    async fn handle(&mut self, ev: ReplicationEvent) -> Result<()> {
        match ev {
            ReplicationEvent::Begin {
                final_lsn,
                xid,
                commit_time_micros,
                ..
            } => {
                let commit_lsn = Lsn(final_lsn.0);
                if self.stop_at.is_some_and(|end| commit_lsn >= end) {
                    self.reached_end = true;
                    return Ok(());
                }
                let mut skip = 0;
                if let Some(p) = self.resume_partial
                    && commit_lsn >= p.commit_lsn
                {
                    self.resume_partial = None;
                    if commit_lsn == p.commit_lsn {
                        skip = u32::try_from(p.events).unwrap_or(u32::MAX);
                        self.skipped_base = Some(p);
                        tracing::info!(commit_lsn = %commit_lsn, events = p.events,
                            "resuming inside a transaction: its acknowledged events are not sent again");
                    }
                }
                self.latency.record_read(commit_time_micros);
                self.txn = Some(OpenTxn {
                    id: self.tracker.begin(commit_lsn),
                    commit_lsn,
                    xid,
                    index: 0,
                    skip,
                    committed: commit_time_micros,
                });
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                let txn = self.txn.take().context("Commit without Begin")?;
                self.tracker.commit(txn.id, Lsn(end_lsn.0));
                self.out.stats.transactions += 1;
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                self.tracker.idle_wal_end(Lsn(wal_end.0));
                if self.txn.is_none() && self.stop_at.is_some_and(|end| Lsn(wal_end.0) >= end) {
                    self.reached_end = true;
                }
            }
            ReplicationEvent::XLogData { data, .. } => {
                let msg = self.decoder.decode(&data)?;
                self.change(msg).await?;
            }
            ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    async fn change(&mut self, msg: LogicalMessage) -> Result<()> {
        match msg {
            LogicalMessage::Relation(r) => {
                if let Some(cfg) = self.table_config(&r.namespace, &r.name) {
                    let mapper = Mapper::compile(cfg, &self.ctx.config.producer, &r)?;
                    tracing::info!(
                        table = mapper.table(),
                        oid = r.oid,
                        columns = r.columns.len(),
                        "outbox table"
                    );
                    self.mappers.insert(r.oid, mapper);
                } else {
                    self.mappers.remove(&r.oid);
                }
            }
            LogicalMessage::Insert(i) => {
                let Some(mapper) = self.mappers.get(&i.relation_oid) else {
                    return Ok(());
                };
                let txn = self.txn.as_mut().context("Insert outside a transaction")?;
                if txn.index < txn.skip {
                    txn.index += 1;
                    self.out.stats.skipped += 1;
                    return Ok(());
                }
                let position = Position {
                    commit_lsn: txn.commit_lsn,
                    index: txn.index,
                    xid: txn.xid,
                };
                txn.index += 1;
                let (id, committed) = (txn.id, txn.committed);
                self.out
                    .publish(&mut self.tracker, mapper, &i.new, position, id, committed)
                    .await?;
            }
            LogicalMessage::Update(u) if self.mappers.contains_key(&u.relation_oid) => {
                self.out.stats.ignored_updates += 1;
            }
            LogicalMessage::Delete(d) if self.mappers.contains_key(&d.relation_oid) => {
                self.out.stats.ignored_deletes += 1;
            }
            LogicalMessage::Truncate(t)
                if t.relation_oids.iter().any(|o| self.mappers.contains_key(o)) =>
            {
                self.out.stats.ignored_truncates += 1;
            }
            _ => {}
        }
        Ok(())
    }

    fn log_progress(&mut self) {
        let s = &self.out.stats;
        tracing::info!(
            events = s.events,
            transactions = s.transactions,
            in_flight = self.tracker.in_flight(),
            confirmed = %self.tracker.confirmed(),
            ignored_updates = s.ignored_updates,
            ignored_deletes = s.ignored_deletes,
            ignored_truncates = s.ignored_truncates,
            dead_lettered = s.dead_lettered,
            skipped = s.skipped,
            commit_to_ack_ms = %self.latency.window_summary(),
            "progress"
        );
    }
}

/// The dead letter of an event the destination refused for what it is: the
/// event's key and headers, the error's class and reason, and a value that
/// describes it (the value itself is what was refused). `None` for a record that
/// is already a dead letter.
fn rejected_dead_letter(e: &DeliveryError, template: &TopicTemplate) -> Option<Event> {
    use walbox_outbox::dead_letter_header as dl;
    let record = e.rejected.as_ref()?;
    if record.headers.iter().any(|(k, _)| k == dl::ERROR_CLASS) {
        return None;
    }
    let topic = template.dead_letter_topic(&e.topic);
    let header = |name: &str| {
        record
            .headers
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    };
    let position = Position {
        commit_lsn: header(walbox_outbox::header::COMMIT_LSN)
            .and_then(|v| v.parse().ok())
            .unwrap_or(Lsn(0)),
        index: header(walbox_outbox::header::INDEX)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        xid: header(walbox_outbox::header::XID)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    };
    let mut headers: Vec<(walbox_outbox::HeaderName, bytes::Bytes)> = record
        .headers
        .iter()
        .map(|(k, v)| (k.clone().into(), bytes::Bytes::from(v.clone())))
        .collect();
    headers.push((
        dl::ERROR_CLASS.into(),
        bytes::Bytes::from_static(e.class.as_bytes()),
    ));
    headers.push((dl::ERROR.into(), bytes::Bytes::from(e.reason.clone())));
    headers.push((dl::SOURCE_TOPIC.into(), bytes::Bytes::from(e.topic.clone())));
    headers.push((dl::ATTEMPTS.into(), bytes::Bytes::from_static(b"1")));
    let value = serde_json::json!({
        "topic": e.topic,
        "value_bytes": record.value_len,
        "value": null,
    })
    .to_string();
    Some(Event {
        event_id: e.event_id.clone(),
        topic,
        key: record.key.clone().map(bytes::Bytes::from),
        value: bytes::Bytes::from(value),
        json_value: true,
        headers,
        position,
    })
}

/// Commit-to-acknowledgement latency: from the commit time the server gives a
/// transaction to the broker's acknowledgement of each of its events (both
/// clocks are this machine's when walbox runs beside the primary). Beside it, the
/// commit-to-read latency (the commit time to walbox reading the transaction's
/// Begin) says how much of it is spent before walbox has the change at all.
struct Latency {
    /// Since the last progress line.
    window: hdrhistogram::Histogram<u64>,
    /// Since the start of the session.
    total: hdrhistogram::Histogram<u64>,
    /// Commit to read, per transaction, since the start of the session.
    read: hdrhistogram::Histogram<u64>,
    /// The time (Unix microseconds) read for this turn of the stream loop: the
    /// acknowledgements handled in one turn share one clock read.
    now: Option<i64>,
}

/// Microseconds between the Unix epoch and Postgres' (2000-01-01).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

impl Latency {
    fn new() -> Self {
        let h = || {
            // 1 µs to 1 hour, 3 significant figures: a few tens of kB.
            hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 3).unwrap_or_else(|_| {
                hdrhistogram::Histogram::new(3).unwrap_or_else(|_| unreachable!())
            })
        };
        Latency {
            window: h(),
            total: h(),
            read: h(),
            now: None,
        }
    }

    /// A new turn of the stream loop: the next record reads the clock again.
    fn new_turn(&mut self) {
        self.now = None;
    }

    /// Microseconds since `committed` (Postgres microseconds), at least 1; the
    /// clock is read once per turn.
    fn since(&mut self, committed: i64) -> u64 {
        let now = *self.now.get_or_insert_with(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        });
        u64::try_from(now - PG_EPOCH_MICROS - committed)
            .unwrap_or(1)
            .max(1)
    }

    /// An event of a transaction committed at `committed` was acknowledged now.
    fn record(&mut self, committed: i64) {
        if committed == 0 {
            return; // snapshot rows have no commit time
        }
        let micros = self.since(committed);
        self.window.saturating_record(micros);
        self.total.saturating_record(micros);
    }

    /// A transaction committed at `committed` was read now.
    fn record_read(&mut self, committed: i64) {
        if committed != 0 {
            let micros = self.since(committed);
            self.read.saturating_record(micros);
        }
    }

    fn summary(h: &hdrhistogram::Histogram<u64>) -> String {
        if h.is_empty() {
            return "-".to_owned();
        }
        #[allow(clippy::cast_precision_loss)] // milliseconds for people to read
        let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        #[allow(clippy::cast_precision_loss)]
        let max = h.max() as f64 / 1000.0;
        format!(
            "p50={:.1} p95={:.1} p99={:.1} max={max:.1} n={}",
            ms(0.5),
            ms(0.95),
            ms(0.99),
            h.len()
        )
    }

    /// Percentiles since the last call; starts a new window.
    fn window_summary(&mut self) -> String {
        let s = Self::summary(&self.window);
        self.window.reset();
        s
    }

    /// Percentiles of the whole session.
    fn total_summary(&self) -> String {
        Self::summary(&self.total)
    }

    /// Commit-to-read percentiles of the whole session.
    fn read_summary(&self) -> String {
        Self::summary(&self.read)
    }
}

/// How a stream phase ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamEnd {
    /// A stop signal (or the shutdown timeout).
    Stopped,
    /// A replay reached its end and everything was acknowledged.
    ReachedEnd,
}

/// A stream phase.
#[derive(Debug, Clone)]
struct StreamSpec {
    /// START_REPLICATION position.
    start: Lsn,
    /// What the server holds as confirmed now.
    server_confirmed: Lsn,
    /// Report acknowledged positions to the server (not during a replay).
    report: bool,
    /// Replay: stop before transactions that commit at or after it.
    stop_at: Option<Lsn>,
}

/// Streams from the slot through the relay until stopped, failed, or (replay)
/// the end is reached and acknowledged.
async fn stream(
    relay: &mut Relay<'_>,
    deliveries: &mut Deliveries,
    signals: &mut mpsc::UnboundedReceiver<()>,
    spec: &StreamSpec,
) -> Result<StreamEnd> {
    let ctx = relay.ctx;
    let config = ctx.config;
    let status_interval = Duration::from_millis(config.source.status_interval_ms);
    let longest_feedback_ms = Arc::new(AtomicU64::new(0));
    let mut repl_cfg = ctx
        .conn
        .replication(&config.source.slot, &config.source.publication)?
        .with_start_lsn(pgwire_replication::Lsn(spec.start.as_u64()))
        .with_ack_lsn(pgwire_replication::Lsn(spec.server_confirmed.as_u64()))
        .with_status_interval(status_interval)
        .with_wakeup_interval(status_interval)
        .with_buffer_size(READ_AHEAD_EVENTS)
        .with_application_name("walbox")
        // With an observer the client tracks whether a raised position is still
        // unreported, which the final status update on stop waits for. The
        // observer itself keeps the longest delay for the progress log.
        .with_feedback_observer(feedback_observer(Arc::clone(&longest_feedback_ms)));
    // Pin how the server renders values, so envelopes do not depend on its settings.
    repl_cfg.options = Some(SESSION_OPTIONS.into());
    let (mut repl, ident) = connect_identified(relay, repl_cfg).await?;
    match &relay.checkpoint {
        Some(_) => {}
        None => {
            // First start on this slot: the checkpoint adopts the slot's position.
            let cp = Checkpoint {
                version: CHECKPOINT_VERSION,
                system_identifier: ident.system_id.clone(),
                database: ident.dbname.clone().unwrap_or_default(),
                slot: config.source.slot.clone(),
                lsn: spec.start,
                partial: None,
                snapshot: None,
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
    tracing::info!(slot = %config.source.slot, publication = %config.source.publication,
        start = %spec.start, stop_at = ?spec.stop_at.map(|l| l.to_string()), tables = ?tables,
        "streaming");

    relay.stop_at = spec.stop_at;
    let mut holdback = Holdback::new(config.replay_window()?);
    let mut reported = spec.server_confirmed;
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
        if relay.reached_end && relay.tracker.in_flight() == 0 && relay.txn.is_none() {
            break Ok(StreamEnd::ReachedEnd);
        }
        if let Some(deadline) = stopping {
            if relay.tracker.in_flight() == 0 && relay.txn.is_none() {
                break Ok(StreamEnd::Stopped);
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    in_flight = relay.tracker.in_flight(),
                    "shutdown timeout: stopping with events unacknowledged; they will be sent again"
                );
                break Ok(StreamEnd::Stopped);
            }
        }
        let reading = relay.reading(stopping.is_some());
        if !reading {
            // Silence while walbox is not reading is walbox's own doing.
            fresh = true;
        }
        let mut ticked = false;
        relay.latency.new_turn();
        relay.out.sink.end_batch();
        let step: Result<()> = tokio::select! {
            biased;
            // 1. A stop signal: stop reading, drain acknowledgements.
            Some(()) = signals.recv() => {
                tracing::info!(in_flight = relay.tracker.in_flight(), "stopping: waiting for in-flight events");
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
        if ticked {
            if fresh {
                heard = Instant::now();
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
        if spec.report
            && let Some(acked) = relay.reportable()
            && let Some(target) = holdback.target(Instant::now, acked)
            && target > reported
        {
            repl.update_applied_lsn(pgwire_replication::Lsn(target.as_u64()));
            reported = target;
        }
        if let Err(e) = step {
            break Err(e);
        }
    };

    // Whatever happened, the acknowledged position is safe: save it, and make
    // sure the server has what may be reported.
    let saved = relay.save_checkpoint(true).await;
    if spec.report
        && saved.is_ok()
        && let Some(acked) = relay.reportable()
        && let Some(target) = holdback.target(Instant::now, acked)
        && target > reported
    {
        repl.update_applied_lsn(pgwire_replication::Lsn(target.as_u64()));
        reported = target;
        let sent = walbox_wait(status_interval * 2 + Duration::from_secs(1), || {
            repl.feedback_pending_since().is_none()
        })
        .await;
        if !sent {
            tracing::warn!(%reported, "final position may not have reached the server");
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
        confirmed = %relay.tracker.confirmed(),
        reported = %reported,
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
        if relay.reading(stopping) && repl.is_running() {
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
        transient(anyhow!(
            "replication connection stalled: nothing from the server for {secs:.0} s and {why}"
        ))
    };
    let probe = async {
        let sql = ctx.conn.connect().await?;
        let row = sql
            .query_opt(
                "SELECT s.active_pid,
                        coalesce(extract(epoch FROM now() - r.reply_time), 1e9)::float8
                 FROM pg_replication_slots s
                 LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
                 WHERE s.slot_name = $1",
                &[slot],
            )
            .await?;
        Ok::<_, anyhow::Error>((
            sql,
            row.map(|r| (r.get::<_, Option<i32>>(0), r.get::<_, f64>(1))),
        ))
    };
    match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
        Err(_) => Err(stalled(format!(
            "the server did not answer a probe within {} s",
            PROBE_TIMEOUT.as_secs()
        ))),
        Ok(Err(e)) => Err(stalled(format!("a probe failed: {e:#}"))),
        Ok(Ok((_, None | Some((None, _))))) => {
            Err(stalled("the server shows no reader on the slot".to_owned()))
        }
        Ok(Ok((sql, Some((Some(pid), since_reply))))) => {
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

/// Keeps the reported position `replay_window` behind the acknowledged one.
struct Holdback {
    window: ReplayWindow,
    samples: VecDeque<(Instant, Lsn)>,
}

impl Holdback {
    fn new(window: ReplayWindow) -> Self {
        Holdback {
            window,
            samples: VecDeque::new(),
        }
    }

    /// The position to report when `acked` is acknowledged at `now`.
    fn target(&mut self, now: impl FnOnce() -> Instant, acked: Lsn) -> Option<Lsn> {
        match self.window {
            ReplayWindow::None => Some(acked),
            ReplayWindow::Bytes(n) => Some(Lsn(acked.as_u64().saturating_sub(n))),
            ReplayWindow::Time(d) => {
                let now = now();
                if self.samples.back().is_none_or(|(_, l)| *l < acked) {
                    self.samples.push_back((now, acked));
                }
                let mut ready = None;
                while let Some(&(at, lsn)) = self.samples.front()
                    && now.saturating_duration_since(at) >= d
                {
                    ready = Some(lsn);
                    self.samples.pop_front();
                }
                ready
            }
        }
    }
}

/// Session settings of every connection that reads row values, so values render
/// the same in the stream and the snapshot, whatever the server's defaults.
const SESSION_OPTIONS: &str = "-c TimeZone=UTC -c DateStyle=ISO,YMD";

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
async fn take_snapshot(
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
        let mut cp = relay
            .checkpoint
            .clone()
            .context("an unfinished snapshot without a checkpoint")?;
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
            lsn: Lsn(0),
            partial: None,
            snapshot: Some(SnapshotState {
                consistent_point: None,
                complete: false,
                rows: 0,
            }),
        };
        ctx.store.save(&cp)?;
        let created = exporter
            .simple_query(&format!(
                "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput (SNAPSHOT 'export')",
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
    relay.tracker = AckTracker::new(start);

    snapshot::begin(&sql, &snapshot_name)
        .await
        .map_err(classify_sql)?;
    // One transaction at the stream's start for the tracker; the events carry
    // the position of the snapshot that read them.
    let txn = relay.tracker.begin(start);
    let mut index = 0u32;
    let mut rows_total = 0u64;
    for table_cfg in &config.outbox {
        let (schema, name) = table_cfg.qualified();
        let table = catalog::table(&sql, schema, name)
            .await
            .map_err(classify_sql)?
            .with_context(|| format!("outbox table {schema}.{name} does not exist"))?;
        let mapper = Mapper::compile(table_cfg, &config.producer, &table.relation)?;
        let total = snapshot::count(&sql, &table, &config.snapshot).await?;
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
                relay.out.sink.end_batch();
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
                while relay.full() {
                    relay.out.sink.end_batch();
                    tokio::select! {
                        biased;
                        Some(()) = signals.recv() => {
                            tracing::warn!(rows = rows_total, "stopped during the snapshot; the next start takes it again");
                            return Ok(None);
                        }
                        Some(d) = deliveries.recv() => relay.delivered(d).await?,
                    }
                }
                let position = Position {
                    commit_lsn: point,
                    index,
                    xid: 0,
                };
                index = index.saturating_add(1);
                relay
                    .out
                    .publish(&mut relay.tracker, &mapper, &row, position, txn, 0)
                    .await?;
                while let Ok(d) = deliveries.try_recv() {
                    relay.delivered(d).await?;
                }
            }
            rows_total += n;
            progress.add(n);
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
    relay.tracker.commit(txn, start);
    relay.pending_snapshot = Some((txn, rows_total));
    tracing::info!(rows = rows_total, consistent_point = %point, stream_from = %start, "snapshot read; the stream continues from the slot's consistent point");
    Ok(Some(start))
}

/// `walbox setup --snapshot`, after the publication exists: creates the slot with
/// a snapshot, publishes the existing rows, waits until all are acknowledged,
/// and records the consistent point, where `walbox run` continues.
pub async fn setup_snapshot(config: &Config) -> Result<()> {
    let mut signals = signals()?;
    let conn = ConnParams::parse(config.dsn()?)?;
    let store = config.checkpoint_store();
    let ctx = Ctx {
        config,
        conn: &conn,
        store: &store,
    };
    let sql = conn.connect().await?;
    let saved = store.load()?;
    let slot = slot_info(&sql, &config.source.slot).await?;
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
        return Ok(());
    };
    // Wait for every row to be acknowledged, then record it.
    let timeout = Duration::from_millis(config.shutdown.timeout_ms);
    loop {
        relay.save_checkpoint(true).await?;
        if relay.pending_snapshot.is_none() {
            break;
        }
        relay.out.sink.end_batch();
        tokio::select! {
            biased;
            Some(()) = signals.recv() => {
                tracing::warn!(in_flight = relay.tracker.in_flight(), "stopped before every snapshot row was acknowledged; the next start takes it again");
                return Ok(());
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
        relay.out.stats.events, config.source.slot
    ));
    Ok(())
}

/// `walbox replay`: publishes again every outbox event committed between `from`
/// and `to` (default: the checkpoint), with the same event ids, without moving
/// the slot; then the checkpoint is the later of itself and `to`.
pub async fn replay(config: &Config, from: Lsn, to: Option<Lsn>) -> Result<()> {
    let mut signals = signals()?;
    let conn = ConnParams::parse(config.dsn()?)?;
    let store = config.checkpoint_store();
    let ctx = Ctx {
        config,
        conn: &conn,
        store: &store,
    };
    let name = &config.source.slot;
    let sql = conn.connect().await?;
    let saved = store.load()?;
    let slot = slot_info(&sql, name)
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
    relay.tracker = AckTracker::new(from);
    let spec = StreamSpec {
        start: from,
        server_confirmed,
        report: false,
        stop_at: Some(to),
    };
    let ended = stream(&mut relay, &mut deliveries, &mut signals, &spec).await?;
    if ended != StreamEnd::ReachedEnd {
        bail!(
            "replay stopped at {} before reaching {to}; the checkpoint is unchanged",
            relay.tracker.confirmed()
        );
    }
    let checkpoint = relay.checkpoint.as_ref().map(|c| c.lsn).unwrap_or(to);
    println_out(&format!(
        "replayed {} events ({} dead-lettered) committed from {from} to {to}; checkpoint at {checkpoint}",
        relay.out.stats.events, relay.out.stats.dead_lettered
    ));
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn lsn(s: &str) -> Lsn {
        s.parse().unwrap()
    }

    fn cp(at: &str, snapshot: Option<bool>) -> Checkpoint {
        Checkpoint {
            version: CHECKPOINT_VERSION,
            system_identifier: "1".into(),
            database: "postgres".into(),
            slot: "walbox".into(),
            lsn: lsn(at),
            partial: None,
            snapshot: snapshot.map(|complete| SnapshotState {
                consistent_point: Some(lsn("0/100")),
                complete,
                rows: 0,
            }),
        }
    }

    fn slot(at: &str) -> SlotInfo {
        SlotInfo {
            plugin: Some("pgoutput".into()),
            same_database: true,
            active_pid: None,
            confirmed: Some(lsn(at)),
            wal_status: Some("reserved".into()),
        }
    }

    fn config(toml: &str) -> Config {
        Config::parse(toml, std::path::Path::new("t.toml")).unwrap()
    }

    fn planned(
        saved: Option<&Checkpoint>,
        slot: Option<&SlotInfo>,
        options: &RunOptions,
    ) -> Result<Plan> {
        plan(
            &config(""),
            &CheckpointFile::new("cp.json"),
            saved,
            slot,
            options,
        )
    }

    #[test]
    fn starts_at_the_later_of_checkpoint_and_slot_only_when_nothing_was_skipped() {
        let none = RunOptions::default();
        let stream = |start: &str, server: &str| Plan::Stream {
            start: lsn(start),
            server_confirmed: lsn(server),
        };
        // First start: the slot's position.
        assert_eq!(
            planned(None, Some(&slot("0/500")), &none).unwrap(),
            stream("0/500", "0/500")
        );
        // Slot behind the checkpoint (server crash, replay window): the checkpoint.
        assert_eq!(
            planned(Some(&cp("0/900", None)), Some(&slot("0/500")), &none).unwrap(),
            stream("0/900", "0/500")
        );
        // Slot ahead: refused, saying what is missing and how to recover.
        let e = planned(Some(&cp("0/500", None)), Some(&slot("0/900")), &none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("between 0/500 and 0/900 were never published"),
            "{e}"
        );
        assert!(
            e.contains("--accept-slot-position") && e.contains("--snapshot"),
            "{e}"
        );
        let accept = RunOptions {
            accept_slot_position: true,
            ..RunOptions::default()
        };
        assert_eq!(
            planned(Some(&cp("0/500", None)), Some(&slot("0/900")), &accept).unwrap(),
            stream("0/900", "0/900")
        );
        // Slot gone while a checkpoint exists: refused.
        let e = planned(Some(&cp("0/500", None)), None, &none)
            .unwrap_err()
            .to_string();
        assert!(e.contains("was dropped"), "{e}");
        // Lost slot: refused with the checkpoint named.
        let mut lost = slot("0/500");
        lost.wal_status = Some("lost".into());
        let e = planned(Some(&cp("0/500", None)), Some(&lost), &none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("wal_status = lost") && e.contains("0/500 (walbox's checkpoint)"),
            "{e}"
        );
    }

    #[test]
    fn from_lsn_must_still_be_in_the_slot() {
        let from = |at: &str| RunOptions {
            from_lsn: Some(lsn(at)),
            ..RunOptions::default()
        };
        let e = planned(
            Some(&cp("0/900", None)),
            Some(&slot("0/500")),
            &from("0/400"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("earliest position still available is 0/500"),
            "{e}"
        );
        assert_eq!(
            planned(
                Some(&cp("0/900", None)),
                Some(&slot("0/500")),
                &from("0/600")
            )
            .unwrap(),
            Plan::Stream {
                start: lsn("0/600"),
                server_confirmed: lsn("0/500")
            }
        );
    }

    #[test]
    fn snapshots_are_taken_for_new_slots_when_asked_and_taken_again_when_unfinished() {
        let none = RunOptions::default();
        let initial = config("[snapshot]\nmode = \"initial\"");
        let store = CheckpointFile::new("cp.json");
        assert_eq!(
            plan(&initial, &store, None, None, &none).unwrap(),
            Plan::Snapshot { resume: None }
        );
        // An existing slot streams, snapshot mode or not.
        assert!(matches!(
            plan(&initial, &store, None, Some(&slot("0/1")), &none).unwrap(),
            Plan::Stream { .. }
        ));
        let e = planned(None, None, &none).unwrap_err().to_string();
        assert!(e.contains("walbox setup"), "{e}");
        // Unfinished, the slot exists: taken again from a temporary slot, and the
        // slot streams from its consistent point (0/100), whatever the mode.
        let unfinished = cp("0/100", Some(false));
        assert_eq!(
            planned(Some(&unfinished), Some(&slot("0/100")), &none).unwrap(),
            Plan::Snapshot {
                resume: Some(lsn("0/100"))
            }
        );
        // The point not recorded yet (stopped between creating the slot and
        // saving it): the slot's position, which nothing moved since.
        let mut unrecorded = cp("0/0", Some(false));
        if let Some(s) = unrecorded.snapshot.as_mut() {
            s.consistent_point = None;
        }
        assert_eq!(
            planned(Some(&unrecorded), Some(&slot("0/180")), &none).unwrap(),
            Plan::Snapshot {
                resume: Some(lsn("0/180"))
            }
        );
        // ... and no slot yet: created with a snapshot, as on a first start.
        assert_eq!(
            planned(Some(&unrecorded), None, &none).unwrap(),
            Plan::Snapshot { resume: None }
        );
        // The slot was dropped or advanced: what it held is gone; refused unless
        // accepted.
        let accept = RunOptions {
            accept_slot_position: true,
            ..RunOptions::default()
        };
        let e = planned(Some(&unfinished), None, &none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the slot was dropped") && e.contains("--accept-slot-position"),
            "{e}"
        );
        assert_eq!(
            planned(Some(&unfinished), None, &accept).unwrap(),
            Plan::Snapshot { resume: None }
        );
        let e = planned(Some(&unfinished), Some(&slot("0/200")), &none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ahead of the consistent point 0/100")
                && e.contains("--accept-slot-position"),
            "{e}"
        );
        assert_eq!(
            planned(Some(&unfinished), Some(&slot("0/200")), &accept).unwrap(),
            Plan::Snapshot {
                resume: Some(lsn("0/200"))
            }
        );
        let mut lost = slot("0/100");
        lost.wal_status = Some("lost".into());
        assert!(planned(Some(&unfinished), Some(&lost), &none).is_err());
        // Finished: stream.
        assert!(matches!(
            planned(Some(&cp("0/100", Some(true))), Some(&slot("0/100")), &none).unwrap(),
            Plan::Stream { .. }
        ));
    }

    #[test]
    fn the_replay_window_holds_the_reported_position_back() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut none = Holdback::new(ReplayWindow::None);
        assert_eq!(none.target(|| t0, lsn("0/500")), Some(lsn("0/500")));
        let mut bytes = Holdback::new(ReplayWindow::Bytes(0x100));
        assert_eq!(bytes.target(|| t0, lsn("0/500")), Some(lsn("0/400")));
        assert_eq!(bytes.target(|| t0, lsn("0/50")), Some(lsn("0/0")));
        let mut time = Holdback::new(ReplayWindow::Time(s(60)));
        assert_eq!(time.target(|| t0, lsn("0/100")), None);
        assert_eq!(time.target(|| t0 + s(30), lsn("0/200")), None);
        assert_eq!(time.target(|| t0 + s(60), lsn("0/300")), Some(lsn("0/100")));
        assert_eq!(
            time.target(|| t0 + s(89), lsn("0/300")),
            None,
            "nothing newer is old enough"
        );
        assert_eq!(
            time.target(|| t0 + s(120), lsn("0/300")),
            Some(lsn("0/300"))
        );
    }

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
