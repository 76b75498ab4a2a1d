//! The replay window: the position reported to the server stays behind the
//! acknowledged one, by WAL bytes or by time, so `walbox replay` can publish that
//! range again from the slot.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use walbox_pgoutput::Lsn;

/// How far the reported position stays behind the acknowledged one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplayWindow {
    /// The reported position follows the acknowledged one.
    #[default]
    None,
    /// Positions acknowledged at least this long ago.
    Time(Duration),
    /// This many bytes of WAL behind.
    Bytes(u64),
}

/// Most samples a time window keeps: at most one per `window / MAX_SAMPLES`, so
/// a window of days holds a few kilobytes, at the price of reporting up to that
/// much later than the window alone would.
pub const MAX_SAMPLES: usize = 1024;

/// Keeps the reported position `window` behind the acknowledged one.
#[derive(Debug)]
pub struct Holdback {
    window: ReplayWindow,
    /// (when acknowledged, position), oldest first, positions increasing.
    samples: VecDeque<(Instant, Lsn)>,
    /// When the newest sample was added (not moved).
    last_added: Option<Instant>,
}

impl Holdback {
    /// A holdback for `window`.
    #[must_use]
    pub fn new(window: ReplayWindow) -> Self {
        Holdback {
            window,
            samples: VecDeque::new(),
            last_added: None,
        }
    }

    /// Samples held (bounded by [`MAX_SAMPLES`] plus one).
    #[must_use]
    pub fn samples(&self) -> usize {
        self.samples.len()
    }

    /// The position to report when `acked` is acknowledged at `now` (read only
    /// for a time window).
    pub fn target(&mut self, now: impl FnOnce() -> Instant, acked: Lsn) -> Option<Lsn> {
        match self.window {
            ReplayWindow::None => Some(acked),
            ReplayWindow::Bytes(n) => Some(Lsn(acked.as_u64().saturating_sub(n))),
            ReplayWindow::Time(d) => {
                let now = now();
                let spacing = d / u32::try_from(MAX_SAMPLES).unwrap_or(u32::MAX);
                let newer = self.samples.back().is_none_or(|(_, l)| *l < acked);
                if newer {
                    let recent = self
                        .last_added
                        .is_some_and(|t| now.saturating_duration_since(t) < spacing);
                    match self.samples.back_mut() {
                        // Within `spacing` of the last sample added: the newest
                        // sample becomes this one (a later time and position, so
                        // it is still reported no earlier than its window allows).
                        Some(back) if recent => *back = (now, acked),
                        _ => {
                            self.samples.push_back((now, acked));
                            self.last_added = Some(now);
                        }
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_holds_the_reported_position_back() {
        let t0 = Instant::now();
        let mut h = Holdback::new(ReplayWindow::Bytes(100));
        assert_eq!(h.target(|| t0, Lsn(1000)), Some(Lsn(900)));
        assert_eq!(h.target(|| t0, Lsn(50)), Some(Lsn(0)));
        let mut h = Holdback::new(ReplayWindow::Time(Duration::from_secs(10)));
        assert_eq!(h.target(|| t0, Lsn(100)), None);
        assert_eq!(h.target(|| t0 + Duration::from_secs(5), Lsn(200)), None);
        assert_eq!(
            h.target(|| t0 + Duration::from_secs(10), Lsn(300)),
            Some(Lsn(100))
        );
        assert_eq!(
            h.target(|| t0 + Duration::from_secs(16), Lsn(300)),
            Some(Lsn(200))
        );
        let mut h = Holdback::new(ReplayWindow::None);
        assert_eq!(h.target(|| t0, Lsn(7)), Some(Lsn(7)));
    }

    #[test]
    fn a_long_time_window_keeps_a_bounded_number_of_samples() {
        let week = Duration::from_secs(7 * 86_400);
        let mut h = Holdback::new(ReplayWindow::Time(week));
        let t0 = Instant::now();
        // One acknowledgement every 100 ms for a day: 864,000 positions.
        let mut reported = None;
        for i in 0..864_000u64 {
            let at = t0 + Duration::from_millis(100 * i);
            if let Some(l) = h.target(|| at, Lsn(i + 1)) {
                reported = Some(l);
            }
            assert!(h.samples() <= MAX_SAMPLES + 1, "{} samples", h.samples());
        }
        assert_eq!(reported, None, "nothing is a week old yet");
        // A week after the first: only what was acknowledged a week ago or
        // earlier is reported.
        let later = t0 + week + Duration::from_secs(3_600);
        let l = h
            .target(|| later, Lsn(900_000))
            .expect("some position is a week old");
        // Acknowledged by t0 + 1 h: positions up to 36,000.
        assert!(l <= Lsn(36_001), "{l} reported before its window passed");
        // ... and not much less: at most one sample spacing (about 10 min) behind.
        assert!(l >= Lsn(30_000), "{l} held back far longer than the window");
    }
}
