//! The driver: plays the shell around the core (a session as `session()` and
//! `stream()` run it: plan, adopt, resume, the loop's turns, the end of a
//! session), the checkpoint writer thread and the slot, and checks the
//! position invariants (LSN, MEM) at every step.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use walbox_core::{
    CHECKPOINT_VERSION, Checkpoint, Core, CoreConfig, CoreError, ReplayWindow, WalMessage,
};
use walbox_outbox::{MessageConfig, TopicTemplate};
use walbox_pgoutput::Lsn;

use crate::broker::{Broker, Settle, Sink};
use crate::checks::{self, Excused};
use crate::world::{Log, PREFIX, Tables};

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
    /// session of `walbox run` saves and reports nothing beyond it.
    Verify(u8),
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

/// One session of `walbox run`.
#[derive(Debug)]
struct Session {
    core: Core,
    tables: Tables,
    sink: Sink,
    stream: VecDeque<WalMessage>,
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
}

impl<'a> World<'a> {
    pub fn new(log: &'a Log, params: Params, tables: Tables) -> Self {
        let mut w = World {
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
        };
        w.start(tables);
        w
    }

    /// `session()`: where to start (`plan`), a new core, the checkpoint
    /// adopted, `resume_at`, the first checkpoint when there is none, then
    /// `START_REPLICATION`.
    fn start(&mut self, tables: Tables) {
        let saved = self.disk.clone();
        let slot = self.slot.confirmed;
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
        let mut core = self.new_core(tables);
        // A new session's watch has verified nothing yet.
        self.limit = self.watch.then_some(Lsn(0));
        core.limit_position(self.limit);
        core.adopt_checkpoint(saved.clone());
        let resume = saved.filter(|cp| cp.lsn == start).and_then(|cp| cp.partial);
        core.resume_at(start, slot, resume);
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
                tables: std::collections::BTreeMap::new(),
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
            submitted: Vec::new(),
            stopping: false,
            replay: false,
            overshoot: 0,
        });
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
            Step::Verify(sel) => {
                if let Some(s) = self.session.as_mut().filter(|s| !s.replay)
                    && let Some(limit) = self.limit
                {
                    let mut ends = vec![self.log.created];
                    ends.extend(self.log.txns.iter().map(|t| t.end_lsn));
                    let to = limit.max(ends[usize::from(sel) % ends.len()]);
                    self.limit = Some(to);
                    s.core.limit_position(self.limit);
                }
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

    fn after_step(&mut self) {
        let Some(s) = &self.session else { return };
        // MEM.
        assert!(
            s.core.in_flight() <= self.params.max_in_flight,
            "MEM: {} events in flight, bound {}",
            s.core.in_flight(),
            self.params.max_in_flight
        );
        assert!(
            s.core.in_flight_bytes() < self.params.max_in_flight_bytes + s.overshoot,
            "MEM: {} bytes in flight, bound {} plus the last event read ({} bytes)",
            s.core.in_flight_bytes(),
            self.params.max_in_flight_bytes,
            s.overshoot
        );
        if (s.stopping || (s.replay && s.core.reached_end())) && s.core.idle() {
            let tables = s.tables;
            self.end_session(true);
            // A new `walbox run`.
            self.start(tables);
        }
    }

    /// The shell takes one message from the server; false when there is
    /// nothing to take (not reading, or the server sent everything and a
    /// keepalive with its WAL end).
    fn read_one(&mut self, pump_now: bool) -> bool {
        let wal_end = self.log.wal_end;
        let Some(s) = &mut self.session else {
            return false;
        };
        if !s.core.reading(s.stopping) {
            return false;
        }
        let (msg, more) = match s.stream.pop_front() {
            Some(m) => (m, true),
            None => (WalMessage::KeepAlive { wal_end }, false),
        };
        let before = s.core.in_flight_bytes();
        match s.core.on_wal(msg) {
            Ok(()) => {
                s.overshoot = s.core.in_flight_bytes().saturating_sub(before);
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
        self.end_session(true);
        self.start(tables);
    }

    /// `walbox replay --from <a position the slot still has>` (to the
    /// checkpoint), after walbox run stopped; walbox run starts again after it.
    fn replay(&mut self, sel: u8) {
        let Some(tables) = self.session.as_ref().map(|s| s.tables) else {
            return;
        };
        self.end_session(true);
        let (Some(cp), slot) = (self.disk.clone(), self.slot.confirmed) else {
            return self.start(tables);
        };
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
            self.after_step();
            let done = self.session.as_ref().is_some_and(|s| s.core.idle());
            if self.stopped.is_some() || (!more && done) {
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
