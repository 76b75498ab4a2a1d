//! [`Core`]: the relay's state and every decision it makes, fed by the shell.
//!
//! The shell hands the core what happened (a WAL message, a delivery result, a
//! flushed checkpoint, the clock) and carries out what the core asks: events to
//! send ([`Core::next_send`]), checkpoints to write ([`Core::checkpoint_due`]),
//! positions to report ([`Core::position_to_report`]). The core never waits and
//! never touches a socket, a file or a thread, so a test can drive it through any
//! history.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use walbox_outbox::{Event, Mapper, MessageConfig, Position, TableConfig, TopicTemplate};
use walbox_pgoutput::{Decoder, LogicalMessage, Lsn, Oid, Xid};

use crate::ack::{AckTracker, TxnId};
use crate::checkpoint::{Checkpoint, Partial};
use crate::error::{CoreError, Failure};
use crate::holdback::{Holdback, ReplayWindow};
use crate::ledger::Ledger;

mod message;
mod pause;
mod poison;
mod progress;
mod snapshot;

use poison::map_row;

/// What the core needs to know of the configuration.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// The outbox tables.
    pub tables: Vec<TableConfig>,
    /// The table-less outbox: prefixes of logical decoding messages.
    pub messages: Vec<MessageConfig>,
    /// Published tables (`schema.name`) whose inserts are knowingly not relayed.
    pub ignore_tables: Vec<String>,
    /// The producer name written into envelopes.
    pub producer: String,
    /// The publication's name, for messages.
    pub publication: String,
    /// Where dead letters go (`{topic}` is the intended topic).
    pub dead_letter_topic: TopicTemplate,
    /// Stop at the first poison row instead of dead-lettering it.
    pub stop_on_poison: bool,
    /// Most events in flight.
    pub max_in_flight: u64,
    /// Most bytes in flight.
    pub max_in_flight_bytes: usize,
    /// How far the reported position stays behind the acknowledged one.
    pub replay_window: ReplayWindow,
    /// How often the checkpoint is written while the position moves.
    pub checkpoint_every: Duration,
}

impl CoreConfig {
    /// The configured tables and message prefixes (`message:<prefix>`), sorted:
    /// what the count of a partly acknowledged transaction's events depends on.
    #[must_use]
    pub fn table_set(&self) -> Vec<String> {
        let mut t: Vec<String> = self
            .tables
            .iter()
            .map(|t| {
                let (s, n) = t.qualified();
                format!("{s}.{n}")
            })
            .chain(
                self.messages
                    .iter()
                    .flat_map(|m| m.prefixes.iter().map(|p| MessageConfig::source_name(p))),
            )
            .collect();
        t.sort();
        t.dedup();
        t
    }
}

/// A message from the replication stream, as the shell's client gives it.
#[derive(Debug, Clone)]
pub enum WalMessage {
    /// A transaction starts.
    Begin {
        /// Its commit LSN.
        final_lsn: Lsn,
        /// Its transaction id.
        xid: Xid,
        /// Its commit time (Postgres microseconds since 2000-01-01).
        commit_time: i64,
    },
    /// The transaction ends; its commit record ends at `end_lsn`.
    Commit {
        /// End of the commit record.
        end_lsn: Lsn,
    },
    /// The server's WAL end, from a keepalive.
    KeepAlive {
        /// The server's WAL end.
        wal_end: Lsn,
    },
    /// Any other pgoutput message (Relation, Insert, ...), undecoded, with the
    /// WAL position the server sent it at (an insert's: the start of its record).
    Data {
        /// The `XLogData` start position.
        wal_start: Lsn,
        /// The pgoutput message.
        data: Bytes,
    },
    /// A logical decoding message, decoded by the replication client.
    Message(walbox_pgoutput::DecodingMessage),
}

/// The outcome of one event the sink took.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Durably accepted.
    Acked,
    /// Not accepted.
    Failed(Failure),
}

/// Where an event handed to the sink comes from, for counts by table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provenance {
    /// The outbox table (`schema.name`) of its row, or `message:<prefix>` for
    /// a logical decoding message.
    pub table: Arc<str>,
    /// A dead letter: the row could not become an event, or the broker refused
    /// the event for what it is.
    pub dead_letter: bool,
    /// It takes the place of an event already handed to the sink (a dead letter
    /// for an event the broker refused), so it is no new row.
    pub replaces: bool,
}

/// Counters for the log.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    /// Events handed to the sink (dead letters included).
    pub events: u64,
    /// Transactions read.
    pub transactions: u64,
    /// Updates of outbox rows (ignored: an event is an insert).
    pub ignored_updates: u64,
    /// Deletes of outbox rows.
    pub ignored_deletes: u64,
    /// Truncates of outbox tables.
    pub ignored_truncates: u64,
    /// Changes to published tables that are not outboxes: updates, deletes and
    /// truncates, and inserts into tables ignored as configured.
    pub ignored_unmapped: u64,
    /// Events dead-lettered.
    pub dead_lettered: u64,
    /// Events of a partly acknowledged transaction not sent again on resume.
    pub skipped: u64,
    /// Logical decoding messages of prefixes no `[[messages]]` section names.
    pub ignored_messages: u64,
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
    committed: i64,
}

/// What the checkpoint writer has on disk.
#[derive(Debug, Clone, Copy)]
struct Flushed {
    lsn: Lsn,
    snapshot_done: bool,
}

/// The relay's state as a pure machine.
#[derive(Debug)]
pub struct Core {
    cfg: CoreConfig,
    tables: Vec<String>,
    tracker: AckTracker,
    decoder: Decoder,
    /// Outbox relations by oid, with their names for [`Provenance`].
    mappers: HashMap<Oid, (Mapper, Arc<str>)>,
    /// Published relations that are not outboxes, by oid: their names, and
    /// whether a change of theirs was logged.
    unmapped: HashMap<Oid, (String, bool)>,
    /// Published relations ignored as configured, by oid: their names.
    ignored: HashMap<Oid, String>,
    /// Message mappers by prefix, compiled at the prefix's first message.
    message_mappers: HashMap<String, Arc<(walbox_outbox::MessageMapper, Arc<str>)>>,
    /// Prefixes of messages ignored (no section names them), each logged once.
    unknown_prefixes: std::collections::HashSet<String>,
    txn: Option<OpenTxn>,
    ledger: Ledger,
    sends: VecDeque<(Event, usize, Provenance)>,
    stats: Stats,
    /// The newest checkpoint state (`None` until the cluster's identity is known).
    checkpoint: Option<Checkpoint>,
    flushed: Option<Flushed>,
    submitted_at: Option<Instant>,
    /// The snapshot's transaction and row count, until every row is acknowledged.
    pending_snapshot: Option<(TxnId, u64)>,
    /// The table of the snapshot's rows, named once.
    snapshot_table: Option<Arc<str>>,
    /// The snapshot being published: its transaction, position and next index.
    snapshot: Option<(TxnId, Lsn, u32)>,
    /// Replay: stop before the first transaction that commits at or after it.
    stop_at: Option<Lsn>,
    /// The origin of the events read from the slot: the stream's, or a
    /// replay's (see [`Core::replay_from`]).
    streamed: walbox_outbox::Origin,
    reached_end: bool,
    /// Positions above this are not saved or reported (the publication was last
    /// verified there).
    limit: Option<Lsn>,
    /// On resume: the checkpoint's acknowledged prefix of the first transaction,
    /// until that transaction arrives.
    resume_partial: Option<Partial>,
    /// The prefix skipped in the front transaction, which the tracker does not
    /// count (its events are numbered from the first one sent).
    skipped_base: Option<Partial>,
    holdback: Holdback,
    reported: Lsn,
    /// A mapped relation came with another name since the last look.
    renamed: bool,
    /// Relations (by oid) whose first insert ends reading before its
    /// transaction: outbox tables with a new identity, whose earlier rows only
    /// a snapshot can bring (see [`Core::pause_before`]).
    pause_before: HashMap<Oid, String>,
    /// Reading ended before a transaction with an insert into one of them.
    paused: bool,
    /// The oids each outbox table (`schema.name`) may come with: a Relation
    /// message of a configured name with another oid is a table swapped while
    /// walbox streams, and reading ends before its first insert too.
    expected: HashMap<String, Vec<Oid>>,
    /// Outbox tables whose expected oid the stream has shown in this session.
    seen_expected: std::collections::HashSet<String>,
    /// Outbox inserts not yet taken, all at one WAL start (a multi-insert
    /// record, as `COPY` writes, gives each of its rows its start): a message
    /// that ends there was written before them (see [`Core::in_wal_order`]).
    held: Option<(Lsn, Vec<LogicalMessage>)>,
    /// The bytes of the held inserts' values (their tuples), counted against
    /// the byte bound as [`Core::full`] says.
    held_bytes: usize,
}

impl Core {
    /// A core with nothing read yet; its position is `Lsn(0)` until
    /// [`resume_at`](Self::resume_at) or [`begin_snapshot`](Self::begin_snapshot).
    #[must_use]
    pub fn new(cfg: CoreConfig) -> Self {
        Core {
            tables: cfg.table_set(),
            holdback: Holdback::new(cfg.replay_window),
            cfg,
            tracker: AckTracker::new(Lsn(0)),
            decoder: Decoder::new(),
            mappers: HashMap::new(),
            unmapped: HashMap::new(),
            ignored: HashMap::new(),
            message_mappers: HashMap::new(),
            unknown_prefixes: std::collections::HashSet::new(),
            txn: None,
            ledger: Ledger::default(),
            sends: VecDeque::new(),
            stats: Stats::default(),
            checkpoint: None,
            flushed: None,
            submitted_at: None,
            pending_snapshot: None,
            snapshot_table: None,
            snapshot: None,
            stop_at: None,
            streamed: walbox_outbox::Origin::Stream,
            reached_end: false,
            limit: None,
            resume_partial: None,
            skipped_base: None,
            reported: Lsn(0),
            renamed: false,
            pause_before: HashMap::new(),
            paused: false,
            expected: HashMap::new(),
            seen_expected: std::collections::HashSet::new(),
            held: None,
            held_bytes: 0,
        }
    }

    // ---- set-up -------------------------------------------------------------

    /// Takes a checkpoint that is already on disk (loaded, or written before
    /// streaming) as the current one.
    pub fn adopt_checkpoint(&mut self, cp: Option<Checkpoint>) {
        if let Some(c) = &cp {
            self.flushed = Some(Flushed {
                lsn: c.lsn,
                snapshot_done: !c.snapshot_interrupted(),
            });
        }
        self.checkpoint = cp;
    }

    /// The current checkpoint state.
    #[must_use]
    pub fn checkpoint(&self) -> Option<&Checkpoint> {
        self.checkpoint.as_ref()
    }

    /// Streaming starts at `start`; the server already holds `server_confirmed`.
    /// With `resume`, the first events of the transaction the checkpoint records
    /// as partly acknowledged are skipped, when the checkpoint counted them over
    /// the same tables; otherwise that transaction is sent whole again.
    pub fn resume_at(&mut self, start: Lsn, server_confirmed: Lsn, resume: Option<Partial>) {
        self.tracker = AckTracker::new(start);
        self.reported = server_confirmed;
        self.resume_partial = resume.and_then(|p| {
            if p.tables == self.tables {
                Some(p)
            } else {
                tracing::warn!(
                    commit_lsn = %p.commit_lsn,
                    events = p.events,
                    counted_over = ?p.tables,
                    configured = ?self.tables,
                    "the checkpoint counted a partly acknowledged transaction over other outbox \
                     tables; it is sent whole again (its acknowledged events are repeated, with \
                     the same ids)"
                );
                None
            }
        });
    }

    /// The stream continues after a snapshot; the server holds `server_confirmed`.
    pub fn continue_after_snapshot(&mut self, server_confirmed: Lsn) {
        self.reported = server_confirmed;
    }

    /// Replay: stop before transactions that commit at or after `end`, and never
    /// save a position past it.
    pub fn stop_at(&mut self, end: Lsn) {
        self.stop_at = Some(end);
    }

    /// The events read from now on are `walbox replay`'s of the range that
    /// starts at `from`: each carries [`walbox_outbox::Origin::Replay`], so
    /// a sink names them apart from the stream's copies.
    pub fn replay_from(&mut self, from: Lsn) {
        self.streamed = walbox_outbox::Origin::Replay { from };
    }

    /// Positions above `limit` are neither saved nor reported.
    pub fn limit_position(&mut self, limit: Option<Lsn>) {
        self.limit = limit;
    }

    // ---- state --------------------------------------------------------------

    /// Whether to take new WAL: not at an in-flight bound, not past a replay's
    /// end, and when stopping only to finish the transaction being read.
    #[must_use]
    pub fn reading(&self, stopping: bool) -> bool {
        !self.full() && !self.reached_end && (!stopping || self.txn.is_some())
    }

    /// Whether an in-flight bound (count or bytes) is reached.
    #[must_use]
    pub fn full(&self) -> bool {
        // Held inserts are as good as in flight (the next change releases
        // them), by count and by their values' bytes, unless nothing else is:
        // then only reading on releases them (the rows of one multi-insert
        // record, a heap page's worth, are the most held then).
        let in_flight = self.tracker.in_flight();
        let (held, held_bytes) = match &self.held {
            Some((_, h)) if in_flight > 0 => (h.len() as u64, self.held_bytes),
            _ => (0, 0),
        };
        in_flight + held >= self.cfg.max_in_flight
            || self.ledger.bytes() + held_bytes >= self.cfg.max_in_flight_bytes
    }

    /// Outbox inserts held (see [`Core::in_wal_order`]) and their values' bytes.
    #[must_use]
    pub fn held(&self) -> (u64, usize) {
        self.held
            .as_ref()
            .map_or((0, 0), |(_, h)| (h.len() as u64, self.held_bytes))
    }

    /// Events in flight.
    #[must_use]
    pub fn in_flight(&self) -> u64 {
        self.ledger.count()
    }

    /// Bytes in flight.
    #[must_use]
    pub fn in_flight_bytes(&self) -> usize {
        self.ledger.bytes()
    }

    /// Whether a transaction is being read.
    #[must_use]
    pub fn in_transaction(&self) -> bool {
        self.txn.is_some()
    }

    /// Replay: the end was reached (nothing more will be read).
    #[must_use]
    pub fn reached_end(&self) -> bool {
        self.reached_end
    }

    /// Nothing in flight and no transaction open.
    #[must_use]
    pub fn idle(&self) -> bool {
        self.ledger.count() == 0 && self.txn.is_none() && self.sends.is_empty()
    }

    /// The acknowledged position.
    #[must_use]
    pub fn confirmed(&self) -> Lsn {
        self.tracker.confirmed()
    }

    /// The last position handed out by [`position_to_report`](Self::position_to_report).
    #[must_use]
    pub fn reported(&self) -> Lsn {
        self.reported
    }

    /// The counters.
    #[must_use]
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Whether the snapshot's rows are not all acknowledged yet.
    #[must_use]
    pub fn snapshot_pending(&self) -> bool {
        self.pending_snapshot.is_some() || self.snapshot.is_some()
    }

    /// Whether an outbox table was renamed (its Relation message came with
    /// another name) since the last call: the configured name may now be another
    /// table, so the publication is worth checking again.
    pub fn take_outbox_renamed(&mut self) -> bool {
        std::mem::take(&mut self.renamed)
    }

    /// The next event to hand to the sink, with its token.
    pub fn next_send(&mut self) -> Option<(Event, usize)> {
        self.sends
            .pop_front()
            .map(|(event, token, _)| (event, token))
    }

    /// The next event to hand to the sink, with its token and where it comes from.
    pub fn next_send_with_origin(&mut self) -> Option<(Event, usize, Provenance)> {
        self.sends.pop_front()
    }

    // ---- input: the stream --------------------------------------------------

    /// One message from the replication stream.
    ///
    /// # Errors
    /// A message that cannot be decoded or is out of protocol, an outbox table
    /// whose shape cannot be mapped, an insert into a published table that is
    /// not an outbox, a poison row under the stop policy.
    pub fn on_wal(&mut self, msg: WalMessage) -> Result<(), CoreError> {
        if self.paused {
            // Nothing after the pause counts: it is read again after the snapshot.
            return Ok(());
        }
        match msg {
            WalMessage::Begin {
                final_lsn,
                xid,
                commit_time,
            } => {
                if self.stop_at.is_some_and(|end| final_lsn >= end) {
                    self.reached_end = true;
                    return Ok(());
                }
                if self.txn.is_some() {
                    return Err(CoreError::Protocol("Begin inside a transaction"));
                }
                let mut skip = 0;
                if let Some(p) = self.resume_partial.clone()
                    && final_lsn >= p.commit_lsn
                {
                    self.resume_partial = None;
                    if final_lsn == p.commit_lsn {
                        skip = u32::try_from(p.events).unwrap_or(u32::MAX);
                        tracing::info!(commit_lsn = %final_lsn, events = p.events,
                            "resuming inside a transaction: its acknowledged events are not sent again");
                        self.skipped_base = Some(p);
                    }
                }
                self.txn = Some(OpenTxn {
                    id: self.tracker.begin(final_lsn),
                    commit_lsn: final_lsn,
                    xid,
                    index: 0,
                    skip,
                    committed: commit_time,
                });
            }
            WalMessage::Commit { end_lsn } => {
                self.release_held()?;
                if self.paused {
                    // A held insert into a table to pause before: reading
                    // ended before this transaction.
                    return Ok(());
                }
                let txn = self
                    .txn
                    .take()
                    .ok_or(CoreError::Protocol("Commit without Begin"))?;
                self.tracker.commit(txn.id, end_lsn);
                self.stats.transactions += 1;
            }
            WalMessage::KeepAlive { wal_end } => {
                self.tracker.idle_wal_end(wal_end);
                if self.txn.is_none() && self.stop_at.is_some_and(|end| wal_end >= end) {
                    self.reached_end = true;
                }
            }
            WalMessage::Data { wal_start, data } => {
                let msg = self.decoder.decode(&data)?;
                // A message is placed at its own LSN (the end of its record).
                let at = match &msg {
                    LogicalMessage::Message(m) => m.lsn,
                    _ => wal_start,
                };
                self.in_wal_order(at, msg)?;
            }
            WalMessage::Message(m) => self.in_wal_order(m.lsn, LogicalMessage::Message(m))?,
        }
        Ok(())
    }

    fn table_config(&self, namespace: &str, name: &str) -> Option<&TableConfig> {
        self.cfg
            .tables
            .iter()
            .find(|t| t.qualified() == (namespace, name))
    }

    fn change(&mut self, msg: LogicalMessage) -> Result<(), CoreError> {
        match msg {
            LogicalMessage::Relation(r) => {
                self.check_oid(&r);
                if let Some(cfg) = self.table_config(&r.namespace, &r.name) {
                    let mapper = Mapper::compile(cfg, &self.cfg.producer, &r)?;
                    tracing::info!(
                        table = mapper.table(),
                        oid = r.oid,
                        columns = r.columns.len(),
                        "outbox table"
                    );
                    self.unmapped.remove(&r.oid);
                    let name = Arc::from(mapper.table());
                    self.mappers.insert(r.oid, (mapper, name));
                } else {
                    if let Some((old, _)) = self.mappers.remove(&r.oid) {
                        self.renamed = true;
                        tracing::warn!(
                            oid = r.oid,
                            was = old.table(),
                            now = %format_args!("{}.{}", r.namespace, r.name),
                            "an outbox table was renamed; it is no longer an outbox"
                        );
                    }
                    let name = format!("{}.{}", r.namespace, r.name);
                    if self.cfg.ignore_tables.contains(&name) {
                        tracing::info!(table = %name, oid = r.oid,
                            "published table ignored as configured (source.ignore_tables)");
                        self.unmapped.remove(&r.oid);
                        self.ignored.insert(r.oid, name);
                    } else {
                        self.ignored.remove(&r.oid);
                        self.unmapped.insert(r.oid, (name, false));
                    }
                }
            }
            LogicalMessage::Insert(i) if self.ignored.contains_key(&i.relation_oid) => {
                self.stats.ignored_unmapped += 1;
            }
            LogicalMessage::Insert(i) if self.pause_before.contains_key(&i.relation_oid) => {
                self.pause(i.relation_oid);
            }
            _ if self.paused => {}
            LogicalMessage::Insert(i) => {
                if !self.mappers.contains_key(&i.relation_oid) {
                    let table = self
                        .unmapped
                        .get(&i.relation_oid)
                        .map(|(t, _)| t.clone())
                        .unwrap_or_else(|| format!("relation {}", i.relation_oid));
                    return Err(CoreError::Unmapped {
                        table,
                        publication: self.cfg.publication.clone(),
                        oid: i.relation_oid,
                        commit_lsn: self.txn.as_ref().map(|t| t.commit_lsn),
                    });
                }
                let Some((position, id, committed)) =
                    self.next_in_txn("Insert outside a transaction")?
                else {
                    return Ok(());
                };
                let (mapper, table) = &self.mappers[&i.relation_oid];
                let (event, dead_letter) = map_row(
                    mapper,
                    &i.new,
                    position,
                    Some(committed),
                    &self.cfg,
                    &mut self.stats.dead_lettered,
                )?;
                let origin = Provenance {
                    table: Arc::clone(table),
                    dead_letter,
                    replaces: false,
                };
                self.queue(event, id, committed, origin, self.streamed.clone());
            }
            LogicalMessage::Update(u) => {
                if self.mappers.contains_key(&u.relation_oid) {
                    self.stats.ignored_updates += 1;
                } else {
                    self.unmapped_change(&[u.relation_oid]);
                }
            }
            LogicalMessage::Delete(d) => {
                if self.mappers.contains_key(&d.relation_oid) {
                    self.stats.ignored_deletes += 1;
                } else {
                    self.unmapped_change(&[d.relation_oid]);
                }
            }
            LogicalMessage::Truncate(t) => {
                if t.relation_oids.iter().any(|o| self.mappers.contains_key(o)) {
                    self.stats.ignored_truncates += 1;
                } else {
                    self.unmapped_change(&t.relation_oids);
                }
            }
            LogicalMessage::Message(m) => self.message(m)?,
            _ => {}
        }
        Ok(())
    }

    /// The next event's place in the open transaction: its position, the
    /// transaction and its commit time; `None` for one of the events a resume
    /// skips (acknowledged before the restart). `outside` names the protocol
    /// error when no transaction is open.
    fn next_in_txn(
        &mut self,
        outside: &'static str,
    ) -> Result<Option<(Position, TxnId, i64)>, CoreError> {
        let txn = self.txn.as_mut().ok_or(CoreError::Protocol(outside))?;
        if txn.index < txn.skip {
            txn.index += 1;
            self.stats.skipped += 1;
            return Ok(None);
        }
        let position = Position {
            commit_lsn: txn.commit_lsn,
            index: txn.index,
            xid: txn.xid,
        };
        txn.index += 1;
        Ok(Some((position, txn.id, txn.committed)))
    }

    /// Counts an update, delete or truncate of published tables no `[[outbox]]`
    /// maps, and names each such table in the log once.
    fn unmapped_change(&mut self, oids: &[Oid]) {
        self.stats.ignored_unmapped += 1;
        for oid in oids {
            if let Some((table, logged @ false)) = self.unmapped.get_mut(oid) {
                *logged = true;
                tracing::warn!(table = %table, oid,
                    "changes of a published table that no [[outbox]] maps: its updates, deletes \
                     and truncates are ignored (counted as ignored_unmapped), an insert would \
                     stop walbox");
            }
        }
    }

    /// Hands `event` (of transaction `txn`, read as `read`) to the sink.
    fn queue(
        &mut self,
        mut event: Event,
        txn: TxnId,
        committed: i64,
        origin: Provenance,
        read: walbox_outbox::Origin,
    ) {
        let ticket = self.tracker.event(txn);
        event.origin = read.clone();
        let token = self.ledger.insert(
            ticket,
            event.size(),
            committed,
            Arc::clone(&origin.table),
            read,
        );
        self.stats.events += 1;
        tracing::debug!(
            event_id = %event.event_id,
            topic = %event.topic,
            position = %format_args!("{}#{}", event.position.commit_lsn, event.position.index),
            "sent to the sink"
        );
        self.sends.push_back((event, token, origin));
    }

    // ---- input: the sink ----------------------------------------------------

    /// The sink's outcome for the event of `token`. Returns the commit time of
    /// an acknowledged event's transaction (for latency), `None` otherwise.
    ///
    /// # Errors
    /// A failed delivery (the position stays before it; see
    /// [`CoreError::is_transient`]), or a token the core never gave out.
    pub fn on_delivery(
        &mut self,
        token: usize,
        outcome: Outcome,
    ) -> Result<Option<i64>, CoreError> {
        let (ticket, committed, table, read) = self
            .ledger
            .remove(token)
            .ok_or(CoreError::UnknownToken(token))?;
        match outcome {
            Outcome::Acked => {
                self.tracker.ack(ticket);
                Ok(Some(committed))
            }
            Outcome::Failed(f) => {
                if f.about_message
                    && !self.cfg.stop_on_poison
                    && let Some(mut dead) = f.dead_letter(&self.cfg.dead_letter_topic, &table)
                {
                    // The letter stands where the event stood, read the same way.
                    dead.origin = read.clone();
                    // Refused for what it is (too large): its dead letter takes its
                    // place; the position passes it once that is acknowledged.
                    tracing::warn!(
                        event_id = %f.event_id,
                        topic = %f.topic,
                        class = f.class,
                        reason = %f.reason,
                        dead_letter_topic = %dead.topic,
                        "dead-lettered"
                    );
                    if !f.is_dead_letter() {
                        // A dead letter sent again smaller was counted already.
                        self.stats.dead_lettered += 1;
                    }
                    let token = self.ledger.insert(
                        ticket,
                        dead.size(),
                        committed,
                        Arc::clone(&table),
                        read,
                    );
                    let origin = Provenance {
                        table,
                        dead_letter: true,
                        replaces: true,
                    };
                    self.sends.push_back((dead, token, origin));
                    return Ok(None);
                }
                self.tracker.fail(ticket);
                // Nothing more goes out in this session: what was queued is
                // dropped, and the position stays before the failed event.
                self.sends.clear();
                Err(CoreError::Delivery {
                    transient: !f.about_message && !f.lasting,
                    confirmed: self.tracker.confirmed(),
                    failure: Box::new(f),
                })
            }
        }
    }
}
