//! [`Relay`]: the core with its sink, checkpoint writer and latency clocks;
//! carries out what the core asks.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use pgwire_replication::{ReplicationClient, ReplicationEvent};
use walbox_core::{
    Checkpoint, CheckpointFile, Core, CoreConfig, CoreError, Outcome, WalMessage, check_timeline,
};
use walbox_pgoutput::Lsn;
use walbox_sink::{Delivery, Sink};

use super::checkpoint_writer::CheckpointWriter;
use super::latency::Latency;
use super::sink::{AnySink, failure, sink_error};
use super::{Ctx, classify_replication, transient};
use crate::config::{Config, DeadLetterPolicy};
use crate::metrics::SendCounters;
use crate::publication::PublicationWatch;

/// How often the checkpoint is written while the position moves.
pub(super) const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);

/// The core's view of the configuration.
pub(super) fn core_config(config: &Config) -> Result<CoreConfig> {
    Ok(CoreConfig {
        tables: config.outbox.clone(),
        messages: config.messages.clone(),
        ignore_tables: config
            .source
            .ignore_tables
            .iter()
            .map(|t| {
                if t.contains('.') {
                    t.clone()
                } else {
                    format!("public.{t}")
                }
            })
            .collect(),
        producer: config.producer.clone(),
        publication: config.source.publication.clone(),
        dead_letter_topic: config.dead_letter.template()?,
        stop_on_poison: config.dead_letter.policy == DeadLetterPolicy::Stop,
        max_in_flight: config.sink.max_in_flight() as u64,
        max_in_flight_bytes: config.sink.max_in_flight_bytes,
        replay_window: config.replay_window()?,
        checkpoint_every: CHECKPOINT_EVERY,
    })
}

/// A core error in the shell's terms: transient when a new session may succeed.
pub(super) fn core_error(e: CoreError) -> anyhow::Error {
    if e.is_transient() {
        transient(e)
    } else {
        anyhow!(e)
    }
}

/// The core and the parts of the shell it acts through.
pub(super) struct Relay<'a> {
    pub(super) ctx: Ctx<'a>,
    pub(super) sink: AnySink,
    pub(super) core: Core,
    writer: CheckpointWriter,
    /// Commit-to-acknowledgement latency of streamed events.
    pub(super) latency: Latency,
    /// `run` only: the publication checked while streaming; positions beyond
    /// what it verified are neither saved nor reported.
    pub(super) publication: Option<PublicationWatch>,
    /// The counters of the events in flight, when metrics are on.
    counters: Option<SendCounters>,
    /// When the gauges were last set from the core.
    sampled: Instant,
    /// Events acknowledged since the gauges were last set.
    acked: u64,
    /// `run --accept-slot-position`: a promoted server's slot that is ahead of
    /// the checkpoint or not synchronized is taken as it is.
    pub(super) accept_slot_position: bool,
    /// The outbox tables' identities at the session's start, which the first
    /// checkpoint on a slot records.
    pub(super) tables: std::collections::BTreeMap<String, walbox_core::TableIdentity>,
}

/// How often the gauges are set from the core.
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

impl<'a> Relay<'a> {
    pub(super) fn new(ctx: Ctx<'a>, sink: AnySink) -> Result<Self> {
        Ok(Relay {
            ctx,
            sink,
            core: Core::new(core_config(ctx.config)?),
            writer: CheckpointWriter::new(ctx.store.clone()),
            latency: Latency::new(),
            publication: None,
            counters: ctx
                .metrics
                .map(|m| SendCounters::new(std::sync::Arc::clone(m))),
            sampled: Instant::now(),
            acked: 0,
            accept_slot_position: false,
            tables: std::collections::BTreeMap::new(),
        })
    }

    /// A turn of the relay loop: the heartbeat, and a few times a second the
    /// gauges from the core.
    pub(super) fn observe_turn(&mut self) {
        let Some(m) = self.ctx.metrics else {
            return;
        };
        let now = Instant::now();
        m.health.beat(now);
        if now.duration_since(self.sampled) < SAMPLE_EVERY {
            return;
        }
        self.sampled = now;
        if std::mem::take(&mut self.acked) > 0 {
            m.health.acked(now);
        }
        m.health.set_in_flight(self.core.in_flight());
        m.sample_core(&self.core);
    }

    /// Takes a checkpoint that is already on disk as the current one.
    pub(super) fn adopt_checkpoint(&mut self, cp: Option<Checkpoint>) {
        if let Some(c) = &cp {
            self.writer.known(c);
        }
        self.core.adopt_checkpoint(cp);
    }

    /// Hands every event the core has queued to the sink.
    pub(super) async fn pump(&mut self) -> Result<()> {
        if let Some(counters) = &mut self.counters {
            while let Some((event, token, origin)) = self.core.next_send_with_origin() {
                counters.sent(token, &event, &origin);
                self.sink.send(event, token).await.map_err(sink_error)?;
            }
            return Ok(());
        }
        while let Some((event, token)) = self.core.next_send() {
            self.sink.send(event, token).await.map_err(sink_error)?;
        }
        Ok(())
    }

    /// One message from the replication stream.
    pub(super) async fn handle(&mut self, ev: ReplicationEvent) -> Result<()> {
        let msg = match ev {
            ReplicationEvent::Begin {
                final_lsn,
                xid,
                commit_time_micros,
            } => {
                if let Some(micros) = self.latency.record_read(commit_time_micros)
                    && let Some(m) = self.ctx.metrics
                {
                    m.commit_to_read.observe(micros as f64 / 1e6);
                }
                WalMessage::Begin {
                    final_lsn: Lsn(final_lsn.0),
                    xid,
                    commit_time: commit_time_micros,
                }
            }
            ReplicationEvent::Commit { end_lsn, .. } => WalMessage::Commit {
                end_lsn: Lsn(end_lsn.0),
            },
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                if let Some(m) = self.ctx.metrics {
                    m.server_wal_end_lsn
                        .set(i64::try_from(wal_end.0).unwrap_or(i64::MAX));
                }
                WalMessage::KeepAlive {
                    wal_end: Lsn(wal_end.0),
                }
            }
            ReplicationEvent::XLogData {
                wal_start, data, ..
            } => WalMessage::Data {
                wal_start: Lsn(wal_start.0),
                data,
            },
            // The client decodes logical decoding messages itself.
            ReplicationEvent::Message {
                transactional,
                lsn,
                prefix,
                content,
            } => WalMessage::Message(walbox_pgoutput::DecodingMessage {
                xid: None,
                flags: u8::from(transactional),
                lsn: Lsn(lsn.0),
                prefix,
                content,
            }),
            ReplicationEvent::StoppedAt { .. } => return Ok(()),
        };
        self.core.on_wal(msg).map_err(core_error)?;
        if self.core.take_outbox_renamed()
            && let Some(watch) = &self.publication
        {
            watch.recheck();
        }
        self.pump().await
    }

    /// A delivery report from the sink.
    pub(super) async fn delivered(&mut self, d: Delivery) -> Result<()> {
        let outcome = match d.result {
            Ok(()) => Outcome::Acked,
            Err(e) => Outcome::Failed(failure(e)),
        };
        if let Some(counters) = &mut self.counters {
            let acked = matches!(outcome, Outcome::Acked);
            counters.settled(d.token, acked);
            self.acked += u64::from(acked);
        }
        match self.core.on_delivery(d.token, outcome) {
            Ok(Some(committed)) => {
                super::ACKNOWLEDGED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if let Some(micros) = self.latency.record(committed)
                    && let Some(m) = self.ctx.metrics
                {
                    m.commit_to_ack.observe(micros as f64 / 1e6);
                }
                Ok(())
            }
            Ok(None) => self.pump().await,
            Err(e) => {
                // Nothing more of this session may reach the destination: a later
                // event of a partition must not land after an earlier one failed.
                self.sink.abort();
                Err(core_error(e))
            }
        }
    }

    /// Tells the core how far the publication is verified.
    fn sync_limit(&mut self) {
        if let Some(watch) = &self.publication {
            self.core.limit_position(Some(watch.verified_up_to()));
        }
    }

    /// An error once the publication watch found a problem (fatal) or lost its
    /// connection (transient).
    pub(super) fn publication_ok(&self) -> Result<()> {
        match self
            .publication
            .as_ref()
            .and_then(PublicationWatch::failure)
        {
            None => Ok(()),
            Some(f) => Err(watch_error(f)),
        }
    }

    /// On a clean stop: the publication checked up to the acknowledged
    /// position, so the final save is not held back by the check interval.
    pub(super) async fn publication_settled(&mut self) -> Result<()> {
        let target = self.core.confirmed();
        let Some(watch) = self.publication.as_mut() else {
            return Ok(());
        };
        match watch.settle(target, Duration::from_secs(10)).await {
            None => Ok(()),
            Some(f) => Err(watch_error(f)),
        }
    }

    /// Tells the core what the checkpoint writer has on disk.
    fn sync_flushed(&mut self) -> Result<()> {
        if let Some((lsn, snapshot_done)) = self.writer.saved()? {
            self.core.on_checkpoint_flushed(lsn, snapshot_done);
        }
        Ok(())
    }

    /// Hands the checkpoint to the writer when the core says it is due; with
    /// `force`, whenever it is behind, and waits until it is on disk.
    pub(super) async fn save_checkpoint(&mut self, force: bool) -> Result<()> {
        self.writer.saved()?;
        self.sync_limit();
        if let Some(cp) = self.core.checkpoint_due(Instant::now(), force) {
            self.writer.submit(cp)?;
        }
        if force {
            self.writer.flushed(Duration::from_secs(60)).await?;
        }
        self.sync_flushed()
    }

    /// A position to report to the server now, if any.
    pub(super) fn position_to_report(&mut self) -> Result<Option<Lsn>> {
        self.sync_flushed()?;
        self.sync_limit();
        Ok(self.core.position_to_report(Instant::now))
    }

    pub(super) fn log_progress(&mut self) {
        let s = self.core.stats();
        tracing::info!(
            events = s.events,
            transactions = s.transactions,
            in_flight = self.core.in_flight(),
            in_flight_bytes = self.core.in_flight_bytes(),
            confirmed = %self.core.confirmed(),
            ignored_updates = s.ignored_updates,
            ignored_deletes = s.ignored_deletes,
            ignored_truncates = s.ignored_truncates,
            ignored_unmapped = s.ignored_unmapped,
            ignored_messages = s.ignored_messages,
            dead_lettered = s.dead_lettered,
            skipped = s.skipped,
            commit_to_ack_ms = %self.latency.window_summary(),
            "progress"
        );
    }
}

/// A publication problem stops walbox; a lost check connection ends the session.
fn watch_error(f: crate::publication::WatchFailure) -> anyhow::Error {
    if f.retry {
        transient(anyhow!(f.message))
    } else {
        anyhow!(f.message)
    }
}

/// A gated replication session and the server's identity, checked against the
/// relay's checkpoint (when it has one) before anything else runs on it.
pub(super) async fn connect_identified(
    relay: &mut Relay<'_>,
    cfg: pgwire_replication::ReplicationConfig,
    accept_wal_behind: bool,
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
    if let Some(cp) = relay.core.checkpoint().cloned() {
        check_identity(&cp, ctx.store, &ident, &ctx.config.source.slot)?;
        check_wal_end(&cp, ctx.store, Lsn(ident.xlogpos.0), accept_wal_behind)?;
        // Before the checkpoint's timeline is rewritten below.
        super::takeover::check_identified(ctx, &cp, ident.timeline, relay.accept_slot_position)
            .await?;
        if let Some(timeline) = cp.timeline.filter(|t| *t != ident.timeline) {
            let history = if ident.timeline > timeline {
                let h = client
                    .timeline_history(ident.timeline)
                    .await
                    .with_context(|| format!("reading the history of timeline {}", ident.timeline))
                    .map_err(classify_replication)?;
                Some(String::from_utf8_lossy(&h.content).into_owned())
            } else {
                None
            };
            if let Err(problem) =
                check_timeline(timeline, cp.lsn, ident.timeline, history.as_deref())
            {
                if !accept_wal_behind {
                    bail!(
                        "{problem}. Outbox rows this server commits below {} would be skipped, \
                         and events walbox published may not be on it. To publish what is \
                         missing, create a new slot with a snapshot of the rows not yet \
                         published (`walbox slot drop`, then `walbox setup --snapshot \
                         --snapshot-where \"...\"`); to start anyway, once, pass \
                         --accept-wal-behind (checkpoint {})",
                        cp.lsn,
                        ctx.store.path().display()
                    );
                }
                tracing::warn!(%problem, "starting anyway as asked (--accept-wal-behind)");
            }
        }
        if cp.timeline != Some(ident.timeline) {
            // Recorded now, so the next start compares against this timeline.
            let mut cp = cp;
            cp.timeline = Some(ident.timeline);
            ctx.store.save(&cp)?;
            relay.adopt_checkpoint(Some(cp));
        }
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

/// Refuses a server whose WAL ends before the checkpoint: it was restored from
/// an older copy, or a standby that had not received everything was promoted.
/// Every position walbox saved was flushed WAL on the server it read, so after a
/// crash the server's WAL always reaches the checkpoint. Started at the
/// checkpoint, the server would skip every transaction that commits below it.
pub(super) fn check_wal_end(
    cp: &Checkpoint,
    store: &CheckpointFile,
    wal_end: Lsn,
    accept: bool,
) -> Result<()> {
    if wal_end >= cp.lsn || cp.lsn == Lsn(0) {
        return Ok(());
    }
    if accept {
        tracing::warn!(wal_end = %wal_end, checkpoint = %cp.lsn,
            "the server's WAL ends before the checkpoint; starting anyway as asked \
             (--accept-wal-behind): transactions the server commits below the checkpoint \
             are not published");
        return Ok(());
    }
    bail!(
        "the server's WAL ends at {wal_end}, before walbox's checkpoint {} at {}: this server \
         does not have WAL walbox already read (restored from an older copy, or a standby \
         promoted before it received everything). The events walbox published from {wal_end} \
         to {} are not on this server, and outbox rows this server commits below {} would be \
         skipped. To publish them: take the checkpoint aside and create a new slot with a \
         snapshot of the rows not yet published (`walbox slot drop`, then `walbox setup \
         --snapshot --snapshot-where \"...\"`); to start anyway, once, pass \
         --accept-wal-behind",
        store.path().display(),
        cp.lsn,
        cp.lsn,
        cp.lsn
    )
}
