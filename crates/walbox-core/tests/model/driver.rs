//! The driver: plays the shell around the core (a session as `session()` and
//! `stream()` run it: plan, adopt, resume, the loop's turns, the end of a
//! session), the checkpoint writer thread and the slot, and checks the
//! position invariants (LSN, MEM) at every step.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use walbox_core::{
    CHECKPOINT_VERSION, Checkpoint, Core, CoreConfig, CoreError, ReplayWindow, SnapshotState,
    TableIdentity, WalMessage,
};
use walbox_outbox::{Mapper, MessageConfig, TableConfig, TopicTemplate};
use walbox_pgoutput::{Lsn, TupleValue};

use crate::broker::{Broker, Settle, Sink};
use crate::checks::{self, Excused, Reordered, SnapshotCopies};
use crate::world::{Log, OUTBOX, PREFIX, Tables, relation};

/// The outbox tables' identities (`schema.name`), as a checkpoint records them.
type Identities = BTreeMap<String, TableIdentity>;

/// The relay's bounds and window for one history.
#[derive(Debug, Clone)]
pub struct Params {
    pub max_in_flight: u64,
    pub max_in_flight_bytes: usize,
    pub window: ReplayWindow,
}

pub fn params() -> impl Strategy<Value = Params> {
    (
        3..9u64,
        600..3_000usize,
        prop_oneof![
            3 => Just(ReplayWindow::None),
            1 => (1..200u64).prop_map(ReplayWindow::Bytes),
            1 => (1..500u64).prop_map(|ms| ReplayWindow::Time(Duration::from_millis(ms))),
        ],
    )
        .prop_map(|(max_in_flight, max_in_flight_bytes, window)| Params {
            max_in_flight,
            max_in_flight_bytes,
            window,
        })
}

/// One thing that happens.
#[derive(Debug, Clone)]
pub enum Step {
    /// The shell takes up to `n` messages from the server (while the core is
    /// reading); with `pump`, it hands the core's events to the sink after each
    /// (the shell does), otherwise they wait in the core for a later pump.
    Read { n: u8, pump: bool },
    /// The broker writes and acknowledges the head of a partition (or refuses
    /// it when too large).
    Ack(u8),
    /// The broker writes the next record of a partition; its acknowledgement
    /// comes later, or is lost.
    Write(u8),
    /// The head of a partition times out, having reached the log or not.
    Timeout { sel: u8, written: bool },
    /// Time passes; the shell's end of turn: checkpoint, then report.
    Turn { ms: u16 },
    /// The checkpoint thread writes a submitted checkpoint (and drops older ones).
    Flush(u8),
    /// Postgres checkpoints: the slot's position is persisted.
    PgCheckpoint,
    /// A stop signal: finish the transaction, drain, save, report, exit.
    Stop,
    /// walbox run is stopped (shutdown timeout) and `walbox replay` publishes
    /// again from a position the slot still has to the checkpoint; then walbox
    /// run starts again.
    Replay(u8),
    /// walbox is killed (or, without `walbox`, only the server crashes and
    /// walbox's session ends); with `server`, the slot goes back to some position
    /// between its persisted and its last one. Then walbox starts again with
    /// `tables`.
    Crash {
        walbox: bool,
        server: bool,
        back: u8,
        tables: Tables,
    },
    /// The publication check passes (`PublicationWatch`): positions up to the
    /// end of a transaction of the log (chosen by the number) are verified; a
    /// session of `walbox run` saves and reports nothing beyond it. Once
    /// `outbox_b` was swapped for a new table, the check fails instead (the
    /// table is in no publication: walbox stops, the user adds it and starts
    /// walbox again; or it is in one already, with another identity than the
    /// session started with: the session ends and the next one starts), and
    /// nothing past the last passing check is saved.
    Verify(u8),
    /// The server writes up to this many more entries of the log (a session
    /// reads only what is written). Before the new table joins the
    /// publication, no further than that.
    Advance(u8),
}

fn tables() -> impl Strategy<Value = Tables> {
    prop_oneof![3 => Just(Tables::Both), 1 => Just(Tables::OnlyA)]
}

pub fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        8 => (1..9u8, prop::bool::weighted(0.8)).prop_map(|(n, pump)| Step::Read { n, pump }),
        8 => any::<u8>().prop_map(Step::Ack),
        2 => any::<u8>().prop_map(Step::Write),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(sel, written)| Step::Timeout { sel, written }),
        3 => (0..250u16).prop_map(|ms| Step::Turn { ms }),
        3 => any::<u8>().prop_map(Step::Flush),
        1 => Just(Step::PgCheckpoint),
        1 => Just(Step::Stop),
        1 => any::<u8>().prop_map(Step::Replay),
        2 => any::<u8>().prop_map(Step::Verify),
        2 => (any::<bool>(), any::<bool>(), any::<u8>(), tables()).prop_map(
            |(walbox, server, back, tables)| Step::Crash { walbox, server, back, tables }
        ),
        2 => (1..5u8).prop_map(Step::Advance),
    ];
    prop::collection::vec(step, 0..120)
}

/// The slot: the server's confirmed position, the part of it persisted by the
/// last Postgres checkpoint, and every position it held in between.
#[derive(Debug)]
struct Slot {
    confirmed: Lsn,
    persisted: Lsn,
    held: Vec<Lsn>,
}

/// A snapshot being read (`take_snapshot`): the rows still to read, the
/// tables' identities it read them under, how many it has, and the position
/// the stream then starts from.
#[derive(Debug)]
struct SnapshotRun {
    mapper: Mapper,
    rows: VecDeque<Vec<TupleValue>>,
    read: Identities,
    total: u64,
    start: Lsn,
}

/// One session of `walbox run`.
#[derive(Debug)]
struct Session {
    core: Core,
    tables: Tables,
    sink: Sink,
    /// The messages the server sends, each with the log entry it belongs to.
    stream: VecDeque<(usize, WalMessage)>,
    /// The tables with a new identity whose snapshot is due once reading
    /// stops before their first insert (phase 1 of `session()`).
    catch_up: Option<Identities>,
    /// The snapshot being read, before the stream.
    snapshot: Option<SnapshotRun>,
    /// Held rows the last read took in uncounted (nothing else was in flight):
    /// at most one multi-insert record's.
    uncounted_rows: u64,
    /// Checkpoints handed to the writer thread, not yet on disk.
    submitted: Vec<Checkpoint>,
    stopping: bool,
    /// `walbox replay`: nothing is reported; it ends once the end is reached.
    replay: bool,
    /// Bytes the last message read added in flight (MEM: the bound is checked
    /// before reading, so one message may take the bytes past it).
    overshoot: usize,
}

/// The model: the server's log, the slot, the checkpoint on disk, the broker,
/// and walbox's session.
#[derive(Debug)]
pub struct World<'a> {
    log: &'a Log,
    params: Params,
    disk: Option<Checkpoint>,
    slot: Slot,
    pub broker: Broker,
    pub excused: Excused,
    session: Option<Session>,
    /// Why walbox stopped for good.
    pub stopped: Option<CoreError>,
    now: Instant,
    /// The shell aborts the sink at the first failed delivery.
    abort_on_failure: bool,
    /// No position may reach this (the end of a transaction walbox must stop in).
    pub barrier: Option<Lsn>,
    /// Whether sessions of `walbox run` check the publication (not in the final
    /// clean run, which stands for checks that keep passing).
    watch: bool,
    /// How far the publication is verified in this session.
    limit: Option<Lsn>,
    /// Entries of the log the server has written.
    pub written: usize,
    /// The new `outbox_b` (after a swap) joined the publication.
    fixed: bool,
    /// `outbox_b`'s publication membership (a new one each time it joins).
    membership: u32,
    /// The tables of the last session (a table configured again joins the
    /// publication again).
    last_tables: Tables,
    /// Every session starts with both tables.
    pub both_always: bool,
    /// The positions snapshots gave rows.
    pub snapshot_copies: SnapshotCopies,
    /// Rows only the stream has, after a snapshot that may have later rows
    /// of their key.
    pub reordered: Reordered,
    /// Snapshots completed (every row acknowledged and recorded).
    pub snapshots_taken: u32,
}

impl<'a> World<'a> {
    pub fn new(log: &'a Log, params: Params, tables: Tables) -> Self {
        let mut w = World::idle(log, params, tables);
        w.start(tables);
        w
    }

    /// A world whose server has written the first `written` entries of the
    /// log (before any swap) when walbox first starts (with both tables, in
    /// every session).
    pub fn new_at(log: &'a Log, params: Params, written: usize) -> Self {
        let mut w = World::idle(log, params, Tables::Both);
        w.both_always = true;
        w.written = written.min(log.swap.map_or(log.txns.len(), |sw| sw.at));
        w.start(Tables::Both);
        w
    }

    fn idle(log: &'a Log, params: Params, tables: Tables) -> Self {
        World {
            log,
            params,
            disk: None,
            slot: Slot {
                confirmed: log.created,
                persisted: log.created,
                held: vec![log.created],
            },
            broker: Broker::default(),
            excused: Excused::new(),
            session: None,
            stopped: None,
            now: Instant::now(),
            abort_on_failure: true,
            barrier: None,
            watch: true,
            limit: None,
            written: log.txns.len(),
            fixed: false,
            membership: 1,
            last_tables: tables,
            both_always: false,
            snapshot_copies: SnapshotCopies::new(),
            reordered: Reordered::new(),
            snapshots_taken: 0,
        }
    }

    /// Whether `outbox_b` was swapped for a table in no publication, so that
    /// every check of the publication fails.
    fn swap_unfixed(&self) -> bool {
        self.log
            .swap
            .is_some_and(|sw| !self.fixed && self.written > sw.at)
    }

    /// The user adds the new table to the publication (walbox is not
    /// running): everything before that is written by then.
    fn fix(&mut self) {
        let sw = self.log.swap.expect("a swap");
        assert!(self.session.is_none(), "the fix comes between sessions");
        self.written = self.written.max(sw.fix);
        self.fixed = true;
        self.membership += 1;
    }

    /// The configured outbox tables as they are now (`publication::identities`).
    fn identities(&self, tables: Tables) -> Identities {
        (0..OUTBOX.len())
            .filter(|t| tables.has(*t))
            .map(|t| {
                let oid = if t == 1 && self.fixed {
                    crate::world::OUTBOX_B_SWAPPED
                } else {
                    OUTBOX[t].1
                };
                let membership = if t == 1 { self.membership } else { 1 };
                (
                    format!("public.{}", OUTBOX[t].0),
                    TableIdentity { oid, membership },
                )
            })
            .collect()
    }

    /// `identity::reconcile`: the checkpoint's record of the tables against
    /// `current`; the tables whose snapshot is due. Saves when the record
    /// changes.
    fn reconcile(
        &mut self,
        saved: Option<Checkpoint>,
        current: &Identities,
    ) -> (Option<Checkpoint>, Identities) {
        let Some(mut cp) = saved else {
            return (None, Identities::new());
        };
        let before = cp.clone();
        let recorded = cp.tables.clone();
        let changed: Identities = current
            .iter()
            .filter(|(t, id)| recorded.as_ref().and_then(|r| r.get(*t)) != Some(*id))
            .map(|(t, id)| (t.clone(), *id))
            .collect();
        let mut catch_up = Identities::new();
        if let Some(s) = cp.snapshot.as_mut().filter(|s| !s.complete) {
            if !s.tables.is_empty() {
                for (t, id) in current {
                    if s.tables.contains_key(t) || changed.contains_key(t) {
                        s.tables.insert(t.clone(), *id);
                    }
                }
            }
        } else if recorded.is_none() {
            cp.tables = Some(current.clone());
        } else {
            catch_up = changed;
        }
        if let Some(t) = cp.tables.as_mut() {
            t.retain(|t, _| current.contains_key(t));
        }
        if cp != before {
            self.disk = Some(cp.clone());
        }
        (Some(cp), catch_up)
    }

    /// `session()`: where to start (`plan`), a new core, the checkpoint
    /// adopted, `resume_at`, the first checkpoint when there is none, then
    /// `START_REPLICATION`.
    fn start(&mut self, tables: Tables) {
        let tables = if self.both_always {
            Tables::Both
        } else {
            tables
        };
        if self.swap_unfixed() {
            // The first check of the publication refuses to start: the user
            // adds the new table to it, then starts walbox again.
            self.fix();
        }
        if tables.has(1) && !self.last_tables.has(1) {
            // Configured again, added to the publication again.
            self.membership += 1;
        }
        self.last_tables = tables;
        let saved = self.disk.clone();
        let slot = self.slot.confirmed;
        // `plan`: an unfinished snapshot is taken again from a temporary slot,
        // the slot streaming from its consistent point.
        let snapshot_from = saved.as_ref().filter(|cp| cp.snapshot_interrupted()).map(|cp| {
            let point = cp
                .snapshot
                .as_ref()
                .and_then(|s| s.consistent_point)
                .unwrap_or(slot);
            assert!(
                slot <= point,
                "LSN: the slot is at {slot}, ahead of the unfinished snapshot's consistent point \
                 {point}"
            );
            point
        });
        let current = self.identities(tables);
        let wal_now = snapshot_from
            .is_none()
            .then(|| self.log.wal_now(self.written));
        let (saved, catch_up) = self.reconcile(saved, &current);
        let pause = wal_now.filter(|_| !catch_up.is_empty());
        let mut core = self.new_core(tables);
        // `identity::expected_oids`.
        core.expect_tables(current.iter().flat_map(|(t, now)| {
            let due = saved
                .as_ref()
                .and_then(|cp| cp.snapshot.as_ref())
                .filter(|s| !s.complete)
                .and_then(|s| s.tables.get(t));
            let recorded = saved
                .as_ref()
                .and_then(|cp| cp.tables.as_ref())
                .and_then(|r| r.get(t));
            [Some(now), due, recorded]
                .into_iter()
                .flatten()
                .map(|id| (t.clone(), id.oid))
                .collect::<Vec<_>>()
        }));
        // A new session's watch has verified nothing yet.
        self.limit = self.watch.then_some(Lsn(0));
        core.limit_position(self.limit);
        core.adopt_checkpoint(saved.clone());
        let (start, snapshot) = match snapshot_from {
            Some(start) => (start, Some(self.take_snapshot(&mut core, start, &current))),
            None => {
                let start = match &saved {
                    None => slot,
                    Some(cp) => {
                        assert!(
                            cp.lsn >= slot,
                            "LSN: the slot is at {slot}, ahead of walbox's checkpoint at {}",
                            cp.lsn
                        );
                        cp.lsn
                    }
                };
                let resume = saved.filter(|cp| cp.lsn == start).and_then(|cp| cp.partial);
                core.resume_at(start, slot, resume);
                (start, None)
            }
        };
        if let Some(end) = pause {
            core.pause_before(catch_up.iter().map(|(t, id)| (id.oid, t.clone())));
            core.stop_at(end);
        }
        if core.checkpoint().is_none() {
            let cp = Checkpoint {
                version: CHECKPOINT_VERSION,
                system_identifier: "7".into(),
                database: "app".into(),
                slot: "walbox".into(),
                timeline: None,
                lsn: start,
                partial: None,
                snapshot: None,
                tables: Some(current),
            };
            self.disk = Some(cp.clone());
            core.adopt_checkpoint(Some(cp));
        }
        // The server starts at the later of the asked position and the slot's.
        let from = start.max(slot);
        self.session = Some(Session {
            core,
            tables,
            sink: Sink::new(tables),
            stream: self.log.stream(from, tables).into(),
            catch_up: pause.map(|_| catch_up),
            snapshot,
            uncounted_rows: 0,
            submitted: Vec::new(),
            stopping: false,
            replay: false,
            overshoot: 0,
        });
    }

    /// `take_snapshot` with a resume position, up to reading the rows: the
    /// checkpoint names `start`; a temporary slot's exported snapshot at the
    /// server's WAL position now shows the rows of the tables it lists (rows
    /// deleted before then are in no snapshot: excused when no stream has them).
    fn take_snapshot(&mut self, core: &mut Core, start: Lsn, current: &Identities) -> SnapshotRun {
        let mut cp = core
            .checkpoint()
            .cloned()
            .expect("an unfinished snapshot's checkpoint");
        if let Some(s) = cp.snapshot.as_mut()
            && (cp.lsn != start || s.consistent_point != Some(start))
        {
            cp.lsn = start;
            s.consistent_point = Some(start);
            cp.partial = None;
            self.disk = Some(cp.clone());
            core.adopt_checkpoint(Some(cp.clone()));
        }
        let only: Vec<String> = cp
            .snapshot
            .as_ref()
            .map(|s| s.tables.keys().cloned().collect())
            .unwrap_or_default();
        let b = format!("public.{}", OUTBOX[1].0);
        assert!(
            !only.is_empty() && only.iter().all(|t| *t == b),
            "the model's snapshots are of outbox_b alone: {only:?}"
        );
        let read: Identities = current
            .iter()
            .filter(|(t, _)| only.contains(t))
            .map(|(t, id)| (t.clone(), *id))
            .collect();
        let point = self.log.wal_now(self.written);
        assert!(
            point >= start,
            "the snapshot's point {point} is before {start}"
        );
        let mut rows = VecDeque::new();
        for (i, t) in self.log.txns.iter().enumerate() {
            for (table, row) in t.rows() {
                if table != 1 || row.swapped != self.fixed {
                    continue;
                }
                let gone = self
                    .log
                    .deleted
                    .get(&row.id)
                    .is_some_and(|d| *d < self.written);
                if i >= self.written || gone {
                    if gone && row.hidden {
                        self.excused.insert(row.id.clone());
                    } else if gone && t.end_lsn > start {
                        self.reordered.insert(row.id.clone());
                    }
                    continue;
                }
                let n = u32::try_from(rows.len()).expect("small");
                self.snapshot_copies
                    .entry(row.id.clone())
                    .or_default()
                    .push((point, n));
                rows.push_back(row.tuple());
            }
        }
        let oid = read.get(&b).map_or(OUTBOX[1].1, |id| id.oid);
        let mapper = Mapper::compile(&TableConfig::new(OUTBOX[1].0), "model", &relation(1, oid))
            .expect("the outbox maps");
        core.begin_snapshot(start, point);
        SnapshotRun {
            mapper,
            total: rows.len() as u64,
            rows,
            read,
            start,
        }
    }

    fn new_core(&self, tables: Tables) -> Core {
        Core::new(CoreConfig {
            tables: tables.configs(),
            messages: vec![MessageConfig::new(PREFIX)],
            ignore_tables: Vec::new(),
            producer: "model".into(),
            publication: "walbox_outbox".into(),
            dead_letter_topic: TopicTemplate::parse("{topic}.dlq").expect("template"),
            stop_on_poison: false,
            max_in_flight: self.params.max_in_flight,
            max_in_flight_bytes: self.params.max_in_flight_bytes,
            replay_window: self.params.window,
            checkpoint_every: Duration::from_millis(100),
        })
    }

    pub fn step(&mut self, step: &Step) {
        if self.stopped.is_some() {
            return;
        }
        match *step {
            Step::Read { n, pump } => {
                for _ in 0..n {
                    if !self.read_one(pump) {
                        break;
                    }
                }
            }
            Step::Replay(sel) => self.replay(sel),
            Step::Ack(sel) => self.settle(sel, Settle::Ack),
            Step::Write(sel) => {
                if let Some(s) = &mut self.session {
                    s.sink.write_next(sel, &mut self.broker);
                }
            }
            Step::Timeout { sel, written } => self.settle(sel, Settle::Timeout { written }),
            Step::Turn { ms } => {
                self.now += Duration::from_millis(u64::from(ms));
                self.turn(false);
            }
            Step::Flush(k) => self.flush(Some(usize::from(k))),
            Step::Verify(_) if self.swap_unfixed() && self.watch => {
                // The check fails: the stream ends with the error (the
                // checkpoint saved, the position reported), walbox stops; the
                // user adds the new table to the publication and starts it.
                if let Some(tables) = self.session.as_ref().map(|s| s.tables) {
                    if self.session.as_ref().is_some_and(|s| s.snapshot.is_some()) {
                        self.session = None;
                    } else {
                        self.end_session(true);
                    }
                    self.start(tables);
                }
            }
            Step::Verify(sel) => {
                let now = self.log.wal_now(self.written);
                if let Some(s) = self.session.as_mut().filter(|s| !s.replay)
                    && let Some(limit) = self.limit
                {
                    // A check sees the WAL written when it runs.
                    let mut ends = vec![self.log.created];
                    ends.extend(
                        self.log
                            .txns
                            .iter()
                            .map(|t| t.end_lsn)
                            .filter(|l| *l <= now),
                    );
                    let to = limit.max(ends[usize::from(sel) % ends.len()]);
                    self.limit = Some(to);
                    s.core.limit_position(self.limit);
                }
            }
            Step::Advance(n) => {
                let cap = match self.log.swap {
                    Some(sw) if !self.fixed => sw.fix,
                    _ => self.log.txns.len(),
                };
                self.written = (self.written + usize::from(n)).min(cap).max(self.written);
            }
            Step::PgCheckpoint => self.slot.persisted = self.slot.confirmed,
            Step::Stop => {
                if let Some(s) = &mut self.session {
                    s.stopping = true;
                }
            }
            Step::Crash {
                walbox,
                server,
                back,
                tables,
            } => {
                if walbox {
                    self.session = None;
                } else {
                    // The lost connection ends the session: the checkpoint is
                    // saved; the report does not reach the server.
                    self.end_session(false);
                }
                if server {
                    let candidates: Vec<Lsn> = self
                        .slot
                        .held
                        .iter()
                        .copied()
                        .filter(|l| *l >= self.slot.persisted)
                        .collect();
                    self.slot.confirmed = candidates[usize::from(back) % candidates.len()];
                    self.slot.held.retain(|l| *l <= self.slot.confirmed);
                    self.slot.persisted = self.slot.confirmed;
                }
                self.start(tables);
            }
        }
        self.after_step();
    }

    /// The invariants after every step, and the ends of a session: a stop,
    /// a replay's end, the end of phase 1 (the snapshot is due). Returns
    /// whether a new session started.
    fn after_step(&mut self) -> bool {
        let Some(s) = &self.session else { return false };
        // MEM: held rows count against both bounds, except those of one
        // multi-insert record taken while nothing else was in flight.
        let (held_rows, held_bytes) = s.core.held();
        assert!(
            s.uncounted_rows <= self.log.largest_record(),
            "MEM: {} rows held uncounted, more than one multi-insert record has",
            s.uncounted_rows
        );
        assert!(
            s.core.in_flight() + held_rows <= self.params.max_in_flight + s.uncounted_rows,
            "MEM: {} events in flight and {held_rows} held, bound {} plus {} rows of one record",
            s.core.in_flight(),
            self.params.max_in_flight,
            s.uncounted_rows
        );
        assert!(
            s.core.in_flight_bytes() + held_bytes < self.params.max_in_flight_bytes + s.overshoot,
            "MEM: {} bytes in flight and {held_bytes} held, bound {} plus what the last read \
             added beyond it ({} bytes)",
            s.core.in_flight_bytes(),
            self.params.max_in_flight_bytes,
            s.overshoot
        );
        let tables = s.tables;
        if s.stopping && s.snapshot.is_some() {
            // A stop signal during the snapshot: the session ends at once; the
            // checkpoint still says the snapshot is unfinished.
            self.session = None;
            self.start(tables);
            return true;
        }
        if s.catch_up.is_some() && s.core.reached_end() && s.core.idle() {
            self.snapshot_due();
            self.start(tables);
            return true;
        }
        if (s.stopping || (s.replay && s.core.reached_end())) && s.core.idle() {
            self.end_session(true);
            // A new `walbox run`.
            self.start(tables);
            return true;
        }
        false
    }

    /// The end of phase 1 (`session()` after `stream()` reached its end with
    /// tables to catch up): the checkpoint saved and the position reported as
    /// at any end, then marked with the snapshot due at its position.
    fn snapshot_due(&mut self) {
        self.turn_to(true, true);
        let s = self.session.take().expect("a session");
        let mut cp = s
            .core
            .checkpoint()
            .cloned()
            .expect("a checkpoint after streaming");
        cp.partial = None;
        cp.snapshot = Some(SnapshotState {
            consistent_point: Some(cp.lsn),
            complete: false,
            rows: 0,
            tables: s.catch_up.expect("tables to catch up"),
        });
        self.disk = Some(cp);
    }

    /// The shell takes one message from the server; false when there is
    /// nothing to take (not reading, or the server sent everything and a
    /// keepalive with its WAL end).
    fn read_one(&mut self, pump_now: bool) -> bool {
        let wal_now = self.log.wal_now(self.written);
        let written = self.written;
        let Some(s) = &mut self.session else {
            return false;
        };
        if let Some(snap) = &mut s.snapshot {
            // `take_snapshot`: the next row once the core has room; after the
            // last one, the stream from the resume position.
            if s.core.full() {
                return false;
            }
            let before = s.core.in_flight_bytes();
            match snap.rows.pop_front() {
                Some(row) => {
                    s.core
                        .snapshot_row(&snap.mapper, &row)
                        .expect("a snapshot row maps or is dead-lettered");
                    s.overshoot = s.core.in_flight_bytes().saturating_sub(before);
                    s.uncounted_rows = 0;
                }
                None => {
                    let snap = s.snapshot.take().expect("reading one");
                    s.core.snapshot_tables(snap.read);
                    s.core.end_snapshot(snap.total);
                    s.core.continue_after_snapshot(snap.start);
                }
            }
            pump(s);
            return true;
        }
        if !s.core.reading(s.stopping) {
            // The shell hands the core's events to the sink after every message.
            pump(s);
            return false;
        }
        let (msg, more) = match s.stream.front() {
            Some((n, _)) if *n < written => (s.stream.pop_front().expect("front").1, true),
            _ => (WalMessage::KeepAlive { wal_end: wal_now }, false),
        };
        let (held_rows, held_bytes) = s.core.held();
        let in_flight = s.core.in_flight();
        // What `full` counted before this read: held rows only while something
        // else is in flight.
        let counted = s.core.in_flight_bytes() + if in_flight > 0 { held_bytes } else { 0 };
        match s.core.on_wal(msg) {
            Ok(()) => {
                let now = s.core.in_flight_bytes() + s.core.held().1;
                s.overshoot = now.saturating_sub(counted);
                s.uncounted_rows = if in_flight > 0 { 0 } else { held_rows };
                if pump_now {
                    pump(s);
                }
                more
            }
            Err(e) => {
                assert!(!e.is_transient(), "{e}");
                self.end_session(true);
                self.stopped = Some(e);
                false
            }
        }
    }

    /// The broker settles the head of a partition; the shell hands the outcome
    /// to the core.
    fn settle(&mut self, sel: u8, how: Settle) {
        let Some(s) = &mut self.session else { return };
        let Some((token, outcome)) = s.sink.settle(sel, how, &mut self.broker) else {
            return;
        };
        let before = s.core.in_flight_bytes();
        let failed = match s.core.on_delivery(token, outcome) {
            Ok(Some(_)) => return,
            Ok(None) => {
                assert!(
                    s.core.in_flight_bytes() < before,
                    "a dead letter is smaller than the record the broker refused"
                );
                pump(s);
                return;
            }
            Err(e) => e,
        };
        // Nothing more of this session goes out.
        assert!(
            s.core.next_send().is_none(),
            "the core still hands out events after a failed delivery"
        );
        if !self.abort_on_failure {
            s.sink.linger(&mut self.broker);
        }
        assert!(failed.is_transient(), "{failed}");
        let tables = s.tables;
        if s.snapshot.is_some() {
            // `take_snapshot` returns the error: nothing is saved.
            self.session = None;
        } else {
            self.end_session(true);
        }
        self.start(tables);
    }

    /// `walbox replay --from <a position the slot still has>` (to the
    /// checkpoint), after walbox run stopped; walbox run starts again after it.
    fn replay(&mut self, sel: u8) {
        let Some(tables) = self.session.as_ref().map(|s| s.tables) else {
            return;
        };
        if self.session.as_ref().is_some_and(|s| s.snapshot.is_some()) {
            self.session = None;
        } else {
            self.end_session(true);
        }
        let (Some(cp), slot) = (self.disk.clone(), self.slot.confirmed) else {
            return self.start(tables);
        };
        if cp.snapshot_interrupted() {
            // A snapshot is due: `walbox run` takes it first.
            return self.start(tables);
        }
        let mut from: Vec<Lsn> = vec![slot];
        from.extend(
            self.log
                .txns
                .iter()
                .map(|t| t.end_lsn)
                .filter(|l| *l > slot && *l < cp.lsn),
        );
        let from = from[usize::from(sel) % from.len()];
        let mut core = self.new_core(tables);
        core.adopt_checkpoint(Some(cp.clone()));
        core.resume_at(from, slot, None);
        core.stop_at(cp.lsn);
        self.start(tables);
        let s = self.session.as_mut().expect("started");
        s.replay = true;
        s.core = core;
        s.catch_up = None;
        s.snapshot = None;
        s.stream = self.log.stream(from.max(slot), tables).into();
    }

    /// What the checkpoint writer has on disk, told to the core (`sync_flushed`).
    fn sync_flushed(&mut self) {
        let (Some(s), Some(cp)) = (&mut self.session, &self.disk) else {
            return;
        };
        s.core
            .on_checkpoint_flushed(cp.lsn, !cp.snapshot_interrupted());
    }

    /// The end of a turn of the stream loop: `save_checkpoint(force)`, then
    /// `position_to_report` (when the server is there to take it).
    fn turn(&mut self, force: bool) {
        self.turn_to(force, true);
    }

    fn turn_to(&mut self, force: bool, report: bool) {
        self.sync_flushed();
        let now = self.now;
        let Some(s) = &mut self.session else { return };
        let before = s.core.checkpoint().map_or(Lsn(0), |c| c.lsn);
        let limit = self.limit.filter(|_| !s.replay);
        if let Some(cp) = s.core.checkpoint_due(now, force) {
            assert!(
                limit.is_none_or(|l| cp.lsn <= l.max(before)),
                "checkpoint at {} passes the publication's verified position {limit:?}",
                cp.lsn
            );
            assert!(
                self.barrier.is_none_or(|b| cp.lsn < b),
                "LSN: checkpoint at {} passes a transaction walbox cannot publish",
                cp.lsn
            );
            checks::checkpoint_claims_only_acked(
                self.log,
                &self.broker,
                &self.excused,
                &cp,
                s.tables,
            );
            s.submitted.push(cp);
        }
        if force {
            self.flush(None);
        }
        self.sync_flushed();
        let Some(s) = &mut self.session else { return };
        if !report || s.replay {
            return;
        }
        if let Some(p) = s.core.position_to_report(|| now) {
            let on_disk = self.disk.as_ref().map_or(Lsn(0), |c| c.lsn);
            assert!(
                self.barrier.is_none_or(|b| p < b),
                "LSN: position {p} passes a transaction walbox cannot publish"
            );
            assert!(
                p <= on_disk,
                "LSN: position {p} reported before the checkpoint on disk ({on_disk}) has it"
            );
            checks::passes_only_acked(
                self.log,
                &self.broker,
                &self.excused,
                p,
                s.tables,
                "reported position",
            );
            if p > self.slot.confirmed {
                self.slot.confirmed = p;
                self.slot.held.push(p);
            }
        }
    }

    /// The writer thread takes the submitted checkpoints up to `k` (all with
    /// `None`) and writes the newest of them.
    fn flush(&mut self, k: Option<usize>) {
        let Some(s) = &mut self.session else { return };
        if s.submitted.is_empty() {
            return;
        }
        let upto = k.map_or(s.submitted.len() - 1, |k| k % s.submitted.len());
        let cp = s.submitted.drain(..=upto).next_back().expect("not empty");
        if s.tables == Tables::OnlyA {
            // Events of the table out of the publication, in transactions this
            // position passes, are never sent: by the operator's choice.
            for t in self.log.txns.iter().filter(|t| t.end_lsn <= cp.lsn) {
                for (table, row) in t.rows() {
                    if table == 1 {
                        self.excused.insert(row.id.clone());
                    }
                }
            }
        }
        if cp.snapshot.as_ref().is_some_and(|s| s.complete)
            && self
                .disk
                .as_ref()
                .is_some_and(Checkpoint::snapshot_interrupted)
        {
            self.snapshots_taken += 1;
        }
        self.disk = Some(cp);
    }

    /// The end of `stream()`: the checkpoint saved (waiting for the writer),
    /// the position reported; then the session is over.
    fn end_session(&mut self, report: bool) {
        self.turn_to(true, report);
        self.session = None;
    }

    /// The end of the history: walbox restarts with both tables and runs
    /// without faults until the whole log is published and confirmed.
    pub fn finish(&mut self) {
        self.stopped = None;
        self.session = None;
        self.watch = false;
        self.written = self.log.txns.len();
        if self.log.swap.is_some() && !self.fixed {
            self.fix();
        }
        self.start(Tables::Both);
        for _ in 0..100_000 {
            let more = self.read_one(true);
            while self.session.as_ref().is_some_and(|s| !s.sink.is_empty()) {
                self.settle(0, Settle::Ack);
            }
            self.now += Duration::from_millis(50);
            self.turn(false);
            self.flush(None);
            self.turn(false);
            let restarted = self.after_step();
            let done = self
                .session
                .as_ref()
                .is_some_and(|s| s.core.idle() && s.snapshot.is_none() && s.catch_up.is_none());
            if self.stopped.is_some() || (!more && done && !restarted) {
                break;
            }
        }
        if self.stopped.is_none() {
            self.end_session(true);
            let last = self.log.txns.last().map_or(self.log.created, |t| t.end_lsn);
            let on_disk = self.disk.as_ref().map_or(Lsn(0), |c| c.lsn);
            assert!(
                on_disk >= last,
                "the checkpoint stays at {on_disk}, before the last commit ending at {last}"
            );
        }
    }
}

fn pump(s: &mut Session) {
    while let Some((event, token)) = s.core.next_send() {
        s.sink.send(event, token);
    }
}
