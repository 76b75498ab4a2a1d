//! Commit-to-acknowledgement and commit-to-read latency percentiles.

/// Commit-to-acknowledgement latency: from the commit time the server gives a
/// transaction to the broker's acknowledgement of each of its events (both
/// clocks are this machine's when walbox runs beside the primary). Beside it, the
/// commit-to-read latency (the commit time to walbox reading the transaction's
/// Begin) says how much of it is spent before walbox has the change at all.
pub(super) struct Latency {
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
    pub(super) fn new() -> Self {
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
    pub(super) fn new_turn(&mut self) {
        self.now = None;
    }

    /// Microseconds since `committed` (Postgres microseconds), at least 1; the
    /// clock is read once per turn.
    pub(super) fn since(&mut self, committed: i64) -> u64 {
        let now = *self.now.get_or_insert_with(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        });
        u64::try_from(now - PG_EPOCH_MICROS - committed)
            .unwrap_or(1)
            .max(1)
    }

    /// An event of a transaction committed at `committed` was acknowledged
    /// now; returns the latency in microseconds (none for snapshot rows).
    pub(super) fn record(&mut self, committed: i64) -> Option<u64> {
        if committed == 0 {
            return None; // snapshot rows have no commit time
        }
        let micros = self.since(committed);
        self.window.saturating_record(micros);
        self.total.saturating_record(micros);
        Some(micros)
    }

    /// A transaction committed at `committed` was read now; returns the
    /// latency in microseconds.
    pub(super) fn record_read(&mut self, committed: i64) -> Option<u64> {
        if committed == 0 {
            return None;
        }
        let micros = self.since(committed);
        self.read.saturating_record(micros);
        Some(micros)
    }

    pub(super) fn summary(h: &hdrhistogram::Histogram<u64>) -> String {
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
    pub(super) fn window_summary(&mut self) -> String {
        let s = Self::summary(&self.window);
        self.window.reset();
        s
    }

    /// Percentiles of the whole session.
    pub(super) fn total_summary(&self) -> String {
        Self::summary(&self.total)
    }

    /// Commit-to-read percentiles of the whole session.
    pub(super) fn read_summary(&self) -> String {
        Self::summary(&self.read)
    }
}
