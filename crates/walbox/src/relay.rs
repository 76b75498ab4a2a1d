//! `walbox run`: outbox inserts from the slot to the sink; the slot's position
//! confirmed only over acknowledged events.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use pgwire_replication::{ReplicationClient, ReplicationEvent};
use tokio::sync::mpsc;
use walbox_outbox::{Mapper, Position, TableConfig, TopicTemplate};
use walbox_pgoutput::{Decoder, LogicalMessage, Lsn, Oid, Xid};
use walbox_replication::{AckTracker, Ticket, TxnId};
use walbox_sink::{Deliveries, Delivery, KafkaSink, KafkaSinkConfig, Sink, SinkError, StdoutSink};

use crate::config::{Config, DeadLetterPolicy, SinkKind};
use crate::pg::ConnParams;

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

/// Runs the relay until a signal stops it or a fatal error does. Transient errors
/// end the session; after a backoff a new one resumes from the slot's confirmed
/// position (events after it are sent again, with the same ids).
pub async fn run(config: Config) -> Result<()> {
    // First, so a stop request during start-up is a clean stop too.
    let mut signals = signals()?;
    let conn = ConnParams::parse(config.dsn()?)?;
    let mut attempt = 0u32;
    loop {
        let began = Instant::now();
        let Err(e) = session(&config, &conn, attempt, &mut signals).await else {
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
            "session ended; resuming from the slot's confirmed position"
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

/// One session: check the slot, create the sink, stream until stopped or failed.
async fn session(
    config: &Config,
    conn: &ConnParams,
    attempt: u32,
    signals: &mut mpsc::UnboundedReceiver<()>,
) -> Result<()> {
    let sql = conn.connect().await.map_err(classify_sql)?;
    let start = match slot_start(&sql, &config.source.slot).await {
        Ok(lsn) => lsn,
        // After a lost connection the old walsender can hold the slot a little
        // longer; at first start a holder is another reader.
        Err(e) if attempt > 0 && format!("{e}").contains("is in use by pid") => {
            return Err(transient(e));
        }
        Err(e) => return Err(e),
    };
    drop(sql);
    match config.sink.kind {
        SinkKind::Kafka => {
            let (sink, deliveries) = KafkaSink::new(KafkaSinkConfig {
                properties: config.sink.kafka_properties()?,
                create_topics: config.sink.create_topics,
                topic_partitions: config.sink.topic_partitions,
                topic_replication: config.sink.topic_replication,
                max_in_flight: config.sink.max_in_flight,
            })?;
            relay(config, conn, start, sink, deliveries, signals).await
        }
        SinkKind::Stdout => {
            let (sink, deliveries) = StdoutSink::new();
            relay(config, conn, start, sink, deliveries, signals).await
        }
    }
}

/// The slot's confirmed position; refuses a missing, busy, lost or foreign slot.
async fn slot_start(sql: &tokio_postgres::Client, slot: &str) -> Result<Lsn> {
    let row = sql
        .query_opt(
            "SELECT plugin, database = current_database(), active_pid,
                    confirmed_flush_lsn::text, wal_status
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .context("reading pg_replication_slots")?
        .ok_or_else(|| {
            anyhow!("replication slot {slot:?} does not exist; create it with `walbox setup`")
        })?;
    let plugin: Option<String> = row.get(0);
    let same_db: Option<bool> = row.get(1);
    let active: Option<i32> = row.get(2);
    let confirmed: Option<String> = row.get(3);
    let wal_status: Option<String> = row.get(4);
    if plugin.as_deref() != Some("pgoutput") {
        bail!("slot {slot:?} uses plugin {plugin:?}, walbox needs pgoutput");
    }
    if same_db != Some(true) {
        bail!("slot {slot:?} belongs to another database");
    }
    if let Some(pid) = active {
        bail!("slot {slot:?} is in use by pid {pid}");
    }
    if wal_status.as_deref() == Some("lost") {
        bail!(
            "slot {slot:?} is invalidated (wal_status = lost): the WAL it needed was removed \
             (max_slot_wal_keep_size). Events after its position may be missing; drop and \
             recreate the slot to continue"
        );
    }
    confirmed
        .context("slot has no confirmed position")?
        .parse()
        .context("slot position")
}

/// Sink tokens of in-flight events: (ticket, bytes), reusing slots.
#[derive(Debug, Default)]
struct InFlight {
    entries: Vec<Option<(u64, usize)>>,
    free: Vec<usize>,
    bytes: usize,
}

impl InFlight {
    fn insert(&mut self, ticket: Ticket, size: usize) -> usize {
        self.bytes += size;
        let entry = Some((ticket.into_raw(), size));
        if let Some(token) = self.free.pop()
            && let Some(slot) = self.entries.get_mut(token)
        {
            *slot = entry;
            return token;
        }
        self.entries.push(entry);
        self.entries.len() - 1
    }

    fn remove(&mut self, token: usize) -> Option<Ticket> {
        let (raw, size) = self.entries.get_mut(token)?.take()?;
        self.free.push(token);
        self.bytes -= size;
        Some(Ticket::from_raw(raw))
    }
}

#[derive(Debug)]
struct OpenTxn {
    id: TxnId,
    commit_lsn: Lsn,
    xid: Xid,
    index: u32,
}

#[derive(Debug, Default)]
struct Stats {
    events: u64,
    transactions: u64,
    ignored_updates: u64,
    ignored_deletes: u64,
    ignored_truncates: u64,
    dead_lettered: u64,
}

struct Relay<'a, S: Sink> {
    config: &'a Config,
    sink: S,
    tracker: AckTracker,
    in_flight: InFlight,
    decoder: Decoder,
    mappers: HashMap<Oid, Mapper>,
    txn: Option<OpenTxn>,
    stats: Stats,
    dead_letter_topic: TopicTemplate,
}

async fn relay<S: Sink>(
    config: &Config,
    conn: &ConnParams,
    start: Lsn,
    sink: S,
    mut deliveries: Deliveries,
    signals: &mut mpsc::UnboundedReceiver<()>,
) -> Result<()> {
    let status_interval = Duration::from_millis(config.source.status_interval_ms);
    let longest_feedback_ms = Arc::new(AtomicU64::new(0));
    let mut repl_cfg = conn
        .replication(&config.source.slot, &config.source.publication)?
        .with_start_lsn(pgwire_replication::Lsn(start.as_u64()))
        .with_ack_lsn(pgwire_replication::Lsn(start.as_u64()))
        .with_status_interval(status_interval)
        .with_wakeup_interval(status_interval)
        .with_buffer_size(READ_AHEAD_EVENTS)
        .with_application_name("walbox")
        // With an observer the client tracks whether a raised position is still
        // unreported, which the final status update on stop waits for. The
        // observer itself keeps the longest delay for the progress log.
        .with_feedback_observer(feedback_observer(Arc::clone(&longest_feedback_ms)));
    // Pin how the server renders values, so envelopes do not depend on its settings.
    repl_cfg.options = Some("-c TimeZone=UTC -c DateStyle=ISO,YMD".into());
    let mut repl = ReplicationClient::connect(repl_cfg)
        .await
        .with_context(|| format!("replication connection to {}", conn.describe()))
        .map_err(classify_replication)?;
    repl.wait_started()
        .await
        .with_context(|| {
            format!(
                "starting replication from slot {:?} on {}",
                config.source.slot,
                conn.describe()
            )
        })
        .map_err(classify_replication)?;
    let tables: Vec<&str> = config.outbox.iter().map(|t| t.table.as_str()).collect();
    tracing::info!(slot = %config.source.slot, publication = %config.source.publication,
        start = %start, tables = ?tables, "streaming");

    let mut relay = Relay {
        config,
        sink,
        tracker: AckTracker::new(start),
        in_flight: InFlight::default(),
        decoder: Decoder::new(),
        mappers: HashMap::new(),
        txn: None,
        stats: Stats::default(),
        dead_letter_topic: config.dead_letter.template()?,
    };
    let mut reported = start;
    let mut stopping: Option<Instant> = None;
    let mut progress = tokio::time::interval(PROGRESS_EVERY);
    progress.tick().await;
    let max_events = config.sink.max_in_flight as u64;
    let max_bytes = config.sink.max_in_flight_bytes;

    let outcome: Result<()> = loop {
        if let Some(deadline) = stopping {
            if relay.tracker.in_flight() == 0 && relay.txn.is_none() {
                break Ok(());
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    in_flight = relay.tracker.in_flight(),
                    "shutdown timeout: stopping with events unacknowledged; they will be sent again"
                );
                break Ok(());
            }
        }
        let full = relay.tracker.in_flight() >= max_events || relay.in_flight.bytes >= max_bytes;
        let deadline = stopping.unwrap_or_else(Instant::now);
        let step: Result<()> = tokio::select! {
            biased;
            // 1. A stop signal: stop reading, drain acknowledgements.
            Some(()) = signals.recv() => {
                tracing::info!(in_flight = relay.tracker.in_flight(), "stopping: waiting for in-flight events");
                stopping = Some(Instant::now() + Duration::from_millis(config.shutdown.timeout_ms));
                Ok(())
            }
            // 2. Delivery reports before new input: they free room and move the position.
            Some(d) = deliveries.recv() => relay.delivered(d),
            // 3. The shutdown deadline.
            () = tokio::time::sleep_until(deadline.into()), if stopping.is_some() => Ok(()),
            // 4. New WAL, unless the in-flight bound is reached (backpressure). When
            //    stopping, only to the end of the transaction being read: its events
            //    count as delivered only once its Commit is seen, so stopping inside
            //    it would make the next start send them again.
            ev = repl.recv(), if !full && (stopping.is_none() || relay.txn.is_some()) => match ev {
                Ok(Some(ev)) => relay.handle(ev).await,
                Ok(None) => Err(transient(anyhow!("the replication stream ended"))),
                Err(e) => Err(classify_replication(anyhow!(e).context("replication stream"))),
            },
            // 5. Progress in the log.
            _ = progress.tick() => {
                relay.log_progress();
                Ok(())
            }
        };
        let confirmed = relay.tracker.confirmed();
        if confirmed > reported {
            repl.update_applied_lsn(pgwire_replication::Lsn(confirmed.as_u64()));
            reported = confirmed;
        }
        if let Err(e) = step {
            break Err(e);
        }
    };

    // Whatever happened, the tracker's position is safe: make sure the server has it.
    let confirmed = relay.tracker.confirmed();
    repl.update_applied_lsn(pgwire_replication::Lsn(confirmed.as_u64()));
    let sent = walbox_wait(status_interval * 2 + Duration::from_secs(1), || {
        repl.feedback_pending_since().is_none()
    })
    .await;
    if !sent {
        tracing::warn!(%confirmed, "final position may not have reached the server");
    }
    let _ = repl.shutdown().await;
    relay.log_progress();
    tracing::info!(
        %confirmed,
        longest_feedback_delay_ms = longest_feedback_ms.load(Ordering::Relaxed),
        "stopped"
    );
    outcome
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

impl<S: Sink> Relay<'_, S> {
    fn delivered(&mut self, d: Delivery) -> Result<()> {
        let ticket = self
            .in_flight
            .remove(d.token)
            .context("delivery report for an unknown event")?;
        match d.result {
            Ok(()) => {
                self.tracker.ack(ticket);
                Ok(())
            }
            Err(e) => {
                self.tracker.fail(ticket);
                // A timeout or broker error may pass: resume from the confirmed
                // position. A failure about the message itself would repeat.
                let retry = matches!(e.class, "timeout" | "broker_error");
                let e = anyhow!(e).context(format!(
                    "delivery failed; the slot stays at {} and the next session resumes there",
                    self.tracker.confirmed()
                ));
                Err(if retry { transient(e) } else { e })
            }
        }
    }

    fn table_config(&self, namespace: &str, name: &str) -> Option<&TableConfig> {
        self.config
            .outbox
            .iter()
            .find(|t| t.qualified() == (namespace, name))
    }

    async fn handle(&mut self, ev: ReplicationEvent) -> Result<()> {
        match ev {
            ReplicationEvent::Begin { final_lsn, xid, .. } => {
                self.txn = Some(OpenTxn {
                    id: self.tracker.begin(),
                    commit_lsn: Lsn(final_lsn.0),
                    xid,
                    index: 0,
                });
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                let txn = self.txn.take().context("Commit without Begin")?;
                self.tracker.commit(txn.id, Lsn(end_lsn.0));
                self.stats.transactions += 1;
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                self.tracker.idle_wal_end(Lsn(wal_end.0));
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
                    let mapper = Mapper::compile(cfg, &self.config.producer, &r)?;
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
                let position = Position {
                    commit_lsn: txn.commit_lsn,
                    index: txn.index,
                    xid: txn.xid,
                };
                let event = match mapper.map(&i.new, position) {
                    Ok(event) => event,
                    Err(e) => {
                        let dead =
                            mapper.dead_letter(&i.new, position, &e, &self.dead_letter_topic);
                        if self.config.dead_letter.policy == DeadLetterPolicy::Stop {
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
                txn.index += 1;
                let ticket = self.tracker.event(txn.id);
                let token = self.in_flight.insert(ticket, event.size());
                self.stats.events += 1;
                tracing::debug!(
                    event_id = %event.event_id,
                    topic = %event.topic,
                    position = %format_args!("{}#{}", position.commit_lsn, position.index),
                    "sent to the sink"
                );
                self.sink.send(event, token).await.map_err(|e| match e {
                    SinkError::Kafka(_) => transient(e),
                    other => anyhow!(other),
                })?;
            }
            LogicalMessage::Update(u) if self.mappers.contains_key(&u.relation_oid) => {
                self.stats.ignored_updates += 1;
            }
            LogicalMessage::Delete(d) if self.mappers.contains_key(&d.relation_oid) => {
                self.stats.ignored_deletes += 1;
            }
            LogicalMessage::Truncate(t)
                if t.relation_oids.iter().any(|o| self.mappers.contains_key(o)) =>
            {
                self.stats.ignored_truncates += 1;
            }
            _ => {}
        }
        Ok(())
    }

    fn log_progress(&self) {
        tracing::info!(
            events = self.stats.events,
            transactions = self.stats.transactions,
            in_flight = self.tracker.in_flight(),
            confirmed = %self.tracker.confirmed(),
            ignored_updates = self.stats.ignored_updates,
            ignored_deletes = self.stats.ignored_deletes,
            ignored_truncates = self.stats.ignored_truncates,
            dead_lettered = self.stats.dead_lettered,
            "progress"
        );
    }
}
