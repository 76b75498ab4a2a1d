//! Liveness and readiness: what `/healthz` and `/readyz` answer. The relay sets
//! its [`State`] at each transition and beats a heartbeat on every turn of its
//! loop; the answers are computed when asked, from those and the clock.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What the relay is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Opening a session: connections, slot and checkpoint checks.
    Connecting,
    /// Publishing the initial snapshot.
    Snapshot,
    /// Streaming from the slot.
    Streaming,
    /// Waiting before the next session after one ended.
    BackingOff,
    /// The last session ended because the replication connection stalled.
    Stalled,
    /// The slot is gone or invalidated; walbox cannot continue by itself.
    SlotLost,
    /// Stopping on a signal.
    Stopping,
    /// Stopped relaying after an error that a new session would repeat.
    Failed,
}

impl State {
    /// Its name in the JSON bodies.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Connecting => "connecting",
            State::Snapshot => "snapshot",
            State::Streaming => "streaming",
            State::BackingOff => "backing_off",
            State::Stalled => "stalled",
            State::SlotLost => "slot_lost",
            State::Stopping => "stopping",
            State::Failed => "failed",
        }
    }

    /// Whether the relay loop turns in this state (so its heartbeat counts).
    fn looping(self) -> bool {
        matches!(self, State::Snapshot | State::Streaming)
    }
}

/// `/healthz` answers 503 once the relay loop has not turned for this long.
pub const WEDGED_AFTER: Duration = Duration::from_secs(30);

/// `/readyz` answers 503 once events are in flight and the broker has
/// acknowledged none for this long.
pub const BROKER_SILENT_AFTER: Duration = Duration::from_secs(30);

/// The relay's state, heartbeat and last acknowledgement, shared with the endpoint.
#[derive(Debug)]
pub struct Health {
    base: Instant,
    state: Mutex<(State, String)>,
    /// Milliseconds since `base` of the last turn of the relay loop.
    heartbeat: AtomicU64,
    /// ... of the last acknowledgement.
    last_ack: AtomicU64,
    /// ... of the last message from the server.
    last_server_message: AtomicU64,
    /// ... of the last change of state.
    entered: AtomicU64,
    /// Events in flight as last sampled.
    in_flight: AtomicU64,
    /// The slot sampler's finding when the slot is gone or lost.
    slot_problem: Mutex<Option<String>>,
    wedged_after: Duration,
}

impl Health {
    pub fn new() -> Self {
        Health {
            base: Instant::now(),
            state: Mutex::new((State::Connecting, "starting".to_owned())),
            heartbeat: AtomicU64::new(0),
            last_ack: AtomicU64::new(0),
            last_server_message: AtomicU64::new(0),
            entered: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            slot_problem: Mutex::new(None),
            wedged_after: WEDGED_AFTER,
        }
    }

    fn ms(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_millis()).unwrap_or(u64::MAX)
    }

    fn since(&self, stamp: &AtomicU64, now: Instant) -> Duration {
        Duration::from_millis(self.ms(now).saturating_sub(stamp.load(Ordering::Relaxed)))
    }

    /// The relay is now in `state`, for `reason`.
    pub fn set(&self, state: State, reason: impl Into<String>) {
        self.set_at(state, reason, Instant::now());
    }

    /// The relay entered `state` at `now`.
    fn set_at(&self, state: State, reason: impl Into<String>, now: Instant) {
        let mut s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *s = (state, reason.into());
        self.entered.store(self.ms(now), Ordering::Relaxed);
        if state.looping() {
            // Entering the loop counts as its first turn.
            self.heartbeat.store(self.ms(now), Ordering::Relaxed);
        }
    }

    /// The current state.
    pub fn state(&self) -> (State, String) {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// A turn of the relay loop at `now`.
    pub fn beat(&self, now: Instant) {
        self.heartbeat.store(self.ms(now), Ordering::Relaxed);
    }

    /// The broker acknowledged something by `now`.
    pub fn acked(&self, now: Instant) {
        self.last_ack.store(self.ms(now), Ordering::Relaxed);
    }

    /// The server sent something by `now`.
    pub fn heard(&self, now: Instant) {
        self.last_server_message
            .store(self.ms(now), Ordering::Relaxed);
    }

    /// Events in flight now.
    pub fn set_in_flight(&self, n: u64) {
        self.in_flight.store(n, Ordering::Relaxed);
    }

    /// What the slot sampler found wrong with the slot (`None`: nothing).
    pub fn set_slot_problem(&self, problem: Option<String>) {
        *self
            .slot_problem
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = problem;
    }

    pub fn since_last_ack(&self, now: Instant) -> Duration {
        self.since(&self.last_ack, now)
    }

    pub fn since_last_server_message(&self, now: Instant) -> Duration {
        self.since(&self.last_server_message, now)
    }

    /// `/healthz`: healthy, the state and why.
    pub fn liveness(&self, now: Instant) -> (bool, State, String) {
        let (state, reason) = self.state();
        let quiet = self.since(&self.heartbeat, now);
        if state.looping() && quiet > self.wedged_after {
            return (
                false,
                state,
                format!(
                    "wedged: the relay loop has not turned for {} s",
                    quiet.as_secs()
                ),
            );
        }
        (true, state, reason)
    }

    /// `/readyz`: ready, the state and why.
    pub fn readiness(&self, now: Instant) -> (bool, State, String) {
        let (state, reason) = self.state();
        if let Some(problem) = self
            .slot_problem
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
        {
            return (false, State::SlotLost, problem);
        }
        if !state.looping() {
            return (false, state, reason);
        }
        let (alive, _, why) = self.liveness(now);
        if !alive {
            return (false, state, why);
        }
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        // Since the last acknowledgement, or since streaming began.
        let silent = self.since_last_ack(now).min(self.since(&self.entered, now));
        if in_flight > 0 && silent > BROKER_SILENT_AFTER {
            return (
                false,
                state,
                format!(
                    "broker unreachable: no acknowledgement for {} s with {in_flight} events in \
                     flight",
                    silent.as_secs()
                ),
            );
        }
        (true, state, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_while_relaying_and_acknowledged() {
        let h = Health::new();
        let t0 = Instant::now();
        assert!(!h.readiness(t0).0, "connecting");
        h.set(State::Streaming, "streaming from 0/1");
        h.acked(t0);
        h.beat(t0);
        let (ready, state, reason) = h.readiness(t0);
        assert!(ready && state == State::Streaming && reason == "streaming from 0/1");
        // In flight, no acknowledgement for longer than the bound: not ready.
        h.set_in_flight(3);
        let later = t0 + BROKER_SILENT_AFTER + Duration::from_secs(1);
        h.beat(later);
        let (ready, _, reason) = h.readiness(later);
        assert!(
            !ready && reason.starts_with("broker unreachable"),
            "{reason}"
        );
        // Nothing in flight: a quiet broker is an idle one.
        h.set_in_flight(0);
        assert!(h.readiness(later).0);
        h.set(State::BackingOff, "connection lost");
        let (ready, state, reason) = h.readiness(later);
        assert!(!ready && state == State::BackingOff && reason == "connection lost");
        h.set(State::Streaming, "again");
        h.set_slot_problem(Some("slot lost".into()));
        let (ready, state, _) = h.readiness(Instant::now());
        assert!(!ready && state == State::SlotLost);
    }

    #[test]
    fn a_new_session_is_not_blamed_for_the_silence_before_it() {
        let h = Health::new();
        // The last acknowledgement long ago (an outage, a backoff); events in
        // flight right after streaming began again.
        h.set_in_flight(5);
        let now = Instant::now() + BROKER_SILENT_AFTER * 3;
        h.set_at(State::Streaming, "streaming", now);
        assert!(h.since_last_ack(now) > BROKER_SILENT_AFTER);
        assert!(h.readiness(now).0);
        // Still nothing acknowledged long after it began: not ready.
        let later = now + BROKER_SILENT_AFTER + Duration::from_secs(1);
        h.beat(later);
        assert!(!h.readiness(later).0);
    }

    #[test]
    fn unhealthy_once_the_loop_stops_turning() {
        let h = Health::new();
        h.set(State::Streaming, "");
        let t0 = Instant::now();
        h.beat(t0);
        assert!(h.liveness(t0 + WEDGED_AFTER).0);
        let (alive, _, reason) = h.liveness(t0 + WEDGED_AFTER + Duration::from_secs(2));
        assert!(!alive && reason.starts_with("wedged"), "{reason}");
        assert!(!h.readiness(t0 + WEDGED_AFTER + Duration::from_secs(2)).0);
        // Waiting between sessions is no wedge: the loop does not run then.
        h.set(State::BackingOff, "");
        assert!(h.liveness(t0 + WEDGED_AFTER * 3).0);
    }
}
