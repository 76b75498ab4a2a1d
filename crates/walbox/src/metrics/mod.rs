//! Prometheus metrics, `/healthz` and `/readyz`: the registry and every metric
//! handle ([`Metrics`]), the relay's liveness and readiness ([`health`]), the
//! HTTP endpoint ([`server`]) and the slot's gauges sampled on an SQL connection
//! of their own ([`slot_sampler`]). The relay shell updates the handles; the
//! endpoint runs on a thread of its own, so a scrape never takes a turn of the
//! relay loop. Metric names are listed in the README ("Operating walbox").

pub mod health;
pub mod server;
pub mod slot_sampler;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use walbox_core::{Core, Provenance};
use walbox_outbox::Event;

pub use health::{Health, State};

type Labels = Vec<(&'static str, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// The `wal_status` values a slot can show.
pub const WAL_STATUSES: [&str; 4] = ["reserved", "extended", "unreserved", "lost"];

/// Latency buckets, in seconds: 1 ms to 5 min.
const LATENCY_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// The reasons `walbox_sessions_ended_total` counts sessions by.
pub const END_REASONS: &[&str] = &[
    "stopped",
    "server_restart",
    "connection_lost",
    "broker_timeout",
    "broker_error",
    "stall",
    "slot_lost",
    "error",
    "snapshot_due",
];

/// Every metric walbox exports, with its registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub(crate) health: Health,
    events_read: Family<Labels, Counter>,
    events_published: Family<Labels, Counter>,
    events_dead_lettered: Family<Labels, Counter>,
    published_bytes: Family<Labels, Counter>,
    sink_retries: Family<Labels, Counter>,
    pub(crate) in_flight_events: Gauge,
    pub(crate) in_flight_bytes: Gauge,
    pub(crate) in_flight_events_limit: Gauge,
    pub(crate) in_flight_bytes_limit: Gauge,
    pub(crate) reported_flush_lsn: Gauge,
    pub(crate) checkpoint_lsn: Gauge,
    pub(crate) server_wal_end_lsn: Gauge,
    pub(crate) slot_retained_wal_bytes: Gauge,
    pub(crate) slot_confirmed_lag_bytes: Gauge,
    pub(crate) slot_safe_wal_size_bytes: Gauge,
    pub(crate) slot_wal_status: Family<Labels, Gauge>,
    pub(crate) slot_active: Gauge,
    pub(crate) commit_to_ack: Histogram,
    pub(crate) commit_to_read: Histogram,
    pub(crate) sessions_started: Counter,
    sessions_ended: Family<Labels, Counter>,
    pub(crate) stall_probes: Counter,
    seconds_since_last_ack: FloatGauge,
    seconds_since_last_server_message: FloatGauge,
    pub(crate) snapshot_rows_done: Gauge,
    pub(crate) snapshot_rows_total: Gauge,
    ready: Gauge,
    build_info: Family<Labels, Gauge>,
    postgres_version: std::sync::Mutex<String>,
}

impl Metrics {
    /// A registry with every metric at zero.
    pub fn new() -> Arc<Self> {
        let histogram = || Histogram::new(LATENCY_BUCKETS);
        let m = Metrics {
            registry: Registry::default(),
            health: Health::new(),
            events_read: Family::default(),
            events_published: Family::default(),
            events_dead_lettered: Family::default(),
            published_bytes: Family::default(),
            sink_retries: Family::default(),
            in_flight_events: Gauge::default(),
            in_flight_bytes: Gauge::default(),
            in_flight_events_limit: Gauge::default(),
            in_flight_bytes_limit: Gauge::default(),
            reported_flush_lsn: Gauge::default(),
            checkpoint_lsn: Gauge::default(),
            server_wal_end_lsn: Gauge::default(),
            slot_retained_wal_bytes: Gauge::default(),
            slot_confirmed_lag_bytes: Gauge::default(),
            slot_safe_wal_size_bytes: Gauge::default(),
            slot_wal_status: Family::default(),
            slot_active: Gauge::default(),
            commit_to_ack: histogram(),
            commit_to_read: histogram(),
            sessions_started: Counter::default(),
            sessions_ended: Family::default(),
            stall_probes: Counter::default(),
            seconds_since_last_ack: FloatGauge::default(),
            seconds_since_last_server_message: FloatGauge::default(),
            snapshot_rows_done: Gauge::default(),
            snapshot_rows_total: Gauge::default(),
            ready: Gauge::default(),
            build_info: Family::default(),
            postgres_version: std::sync::Mutex::new(String::new()),
        };
        let mut m = m;
        // Every reason from the start at 0, so that a rule's increase() sees the
        // first end of each kind and the family is there before any session ends.
        for reason in END_REASONS {
            let _ = m
                .sessions_ended
                .get_or_create(&vec![("reason", (*reason).to_owned())]);
        }
        m.register_all();
        m.set_build_info("");
        Arc::new(m)
    }

    fn register_all(&mut self) {
        let r = &mut self.registry;
        // Counters are named without `_total`: the encoder adds it.
        r.register(
            "walbox_events_read",
            "Outbox events decoded from the WAL (or read by the snapshot), by table",
            self.events_read.clone(),
        );
        r.register(
            "walbox_events_published",
            "Events the broker acknowledged, by table and topic (dead letters apart)",
            self.events_published.clone(),
        );
        r.register(
            "walbox_events_dead_lettered",
            "Dead letters the broker acknowledged, by source table and dead-letter topic",
            self.events_dead_lettered.clone(),
        );
        r.register(
            "walbox_published_bytes",
            "Bytes (key, value, headers) the broker acknowledged, by topic",
            self.published_bytes.clone(),
        );
        r.register(
            "walbox_sink_retries",
            "Attempts the sink made again after a failure (a webhook's 408, 425, 429, 5xx, \
             timeout or connection error; a Pub/Sub publish that failed), by topic",
            self.sink_retries.clone(),
        );
        let gauges: [(&str, &str, &Gauge); 13] = [
            (
                "walbox_in_flight_events",
                "Events sent and not yet acknowledged",
                &self.in_flight_events,
            ),
            (
                "walbox_in_flight_bytes",
                "Bytes sent and not yet acknowledged",
                &self.in_flight_bytes,
            ),
            (
                "walbox_in_flight_events_limit",
                "sink.max_in_flight",
                &self.in_flight_events_limit,
            ),
            (
                "walbox_in_flight_bytes_limit",
                "sink.max_in_flight_bytes",
                &self.in_flight_bytes_limit,
            ),
            (
                "walbox_reported_flush_lsn",
                "Position last reported to the server (LSN as bytes)",
                &self.reported_flush_lsn,
            ),
            (
                "walbox_checkpoint_lsn",
                "Position of the checkpoint on disk (LSN as bytes)",
                &self.checkpoint_lsn,
            ),
            (
                "walbox_server_wal_end_lsn",
                "The server's WAL end as last heard (LSN as bytes)",
                &self.server_wal_end_lsn,
            ),
            (
                "walbox_slot_retained_wal_bytes",
                "WAL the slot keeps: pg_current_wal_lsn() - restart_lsn",
                &self.slot_retained_wal_bytes,
            ),
            (
                "walbox_slot_confirmed_lag_bytes",
                "pg_current_wal_lsn() - confirmed_flush_lsn",
                &self.slot_confirmed_lag_bytes,
            ),
            (
                "walbox_slot_safe_wal_size_bytes",
                "WAL that can still be written before the slot is lost (safe_wal_size)",
                &self.slot_safe_wal_size_bytes,
            ),
            (
                "walbox_slot_active",
                "1 while a walsender reads the slot",
                &self.slot_active,
            ),
            (
                "walbox_snapshot_rows_done",
                "Rows the initial snapshot has read",
                &self.snapshot_rows_done,
            ),
            (
                "walbox_snapshot_rows_total",
                "Rows the initial snapshot has to read",
                &self.snapshot_rows_total,
            ),
        ];
        for (name, help, g) in gauges {
            r.register(name, help, g.clone());
        }
        r.register(
            "walbox_slot_wal_status",
            "1 for the slot's current wal_status, 0 for the others",
            self.slot_wal_status.clone(),
        );
        for s in WAL_STATUSES {
            self.slot_wal_status
                .get_or_create(&vec![("status", s.to_owned())])
                .set(0);
        }
        r.register(
            "walbox_commit_to_ack_seconds",
            "From a transaction's commit to the broker's acknowledgement of each of its events",
            self.commit_to_ack.clone(),
        );
        r.register(
            "walbox_commit_to_read_seconds",
            "From a transaction's commit to walbox reading it",
            self.commit_to_read.clone(),
        );
        r.register(
            "walbox_sessions_started",
            "Replication sessions started",
            self.sessions_started.clone(),
        );
        r.register(
            "walbox_sessions_ended",
            "Sessions ended, by reason",
            self.sessions_ended.clone(),
        );
        r.register(
            "walbox_stall_probes",
            "Probes of a quiet replication connection",
            self.stall_probes.clone(),
        );
        r.register(
            "walbox_seconds_since_last_ack",
            "Seconds since the broker last acknowledged an event",
            self.seconds_since_last_ack.clone(),
        );
        r.register(
            "walbox_seconds_since_last_server_message",
            "Seconds since the server last sent a message",
            self.seconds_since_last_server_message.clone(),
        );
        r.register(
            "walbox_ready",
            "1 while /readyz answers 200",
            self.ready.clone(),
        );
        r.register(
            "walbox_build_info",
            "walbox's version, the librdkafka and PostgreSQL server versions",
            self.build_info.clone(),
        );
    }

    /// Sets `walbox_build_info` with the server's version (empty until known).
    pub fn set_build_info(&self, postgres_version: &str) {
        let mut known = self
            .postgres_version
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let labels = |pg: &str| -> Labels {
            vec![
                ("version", env!("CARGO_PKG_VERSION").to_owned()),
                ("librdkafka_version", walbox_sink::librdkafka_version()),
                ("postgres_version", pg.to_owned()),
            ]
        };
        if *known != postgres_version {
            self.build_info.remove(&labels(&known));
        }
        *known = postgres_version.to_owned();
        self.build_info
            .get_or_create(&labels(postgres_version))
            .set(1);
    }

    /// A session ended for `reason` (one of [`END_REASONS`]).
    pub fn session_ended(&self, reason: &str) {
        debug_assert!(END_REASONS.contains(&reason), "{reason}");
        self.sessions_ended
            .get_or_create(&vec![("reason", reason.to_owned())])
            .inc();
    }

    /// Sets the slot's `wal_status` gauges.
    pub fn set_wal_status(&self, status: Option<&str>) {
        for s in WAL_STATUSES {
            self.slot_wal_status
                .get_or_create(&vec![("status", s.to_owned())])
                .set(i64::from(status == Some(s)));
        }
    }

    /// The relay's state as the core shows it; called a few times a second.
    pub fn sample_core(&self, core: &Core) {
        let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.in_flight_events.set(n(core.in_flight()));
        self.in_flight_bytes.set(n(core.in_flight_bytes() as u64));
        self.reported_flush_lsn.set(n(core.reported().as_u64()));
        if let Some(cp) = core.checkpoint() {
            self.checkpoint_lsn.set(n(cp.lsn.as_u64()));
        }
    }

    /// The exposition, in the OpenMetrics text format; the time-derived
    /// gauges and the readiness are computed now.
    pub fn encode(&self) -> String {
        let now = std::time::Instant::now();
        self.seconds_since_last_ack
            .set(self.health.since_last_ack(now).as_secs_f64());
        self.seconds_since_last_server_message
            .set(self.health.since_last_server_message(now).as_secs_f64());
        for (topic, n) in walbox_sink::retries_by_topic() {
            let c = self.sink_retries.get_or_create(&vec![("topic", topic)]);
            c.inc_by(n.saturating_sub(c.get()));
        }
        let (ready, _, _) = self.health.readiness(now);
        self.ready.set(i64::from(ready));
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "encoding the metrics");
        }
        out
    }
}

/// The counters an acknowledged event adds to: its family's series and the
/// bytes of its topic.
#[derive(Debug)]
struct Handles {
    done: Counter,
    bytes: Counter,
}

/// The label lookups of the events in flight, by sink token: one lookup per
/// (table, topic) when it changes, none when an event is acknowledged.
#[derive(Debug)]
pub struct SendCounters {
    metrics: Arc<Metrics>,
    /// Every (table, topic, dead letter) seen, by index into `handles`.
    known: std::collections::HashMap<(Arc<str>, String, bool), usize>,
    handles: Vec<Handles>,
    /// Index into `handles` and size, by token.
    by_token: Vec<Option<(usize, u64)>>,
    /// The last (table, topic, dead letter) seen, its index and its table's
    /// read counter.
    last: Option<(Arc<str>, String, bool, usize, Counter)>,
}

impl SendCounters {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        SendCounters {
            metrics,
            known: std::collections::HashMap::new(),
            handles: Vec::new(),
            by_token: Vec::new(),
            last: None,
        }
    }

    /// `event` from `origin` was handed to the sink with `token`.
    pub fn sent(&mut self, token: usize, event: &Event, origin: &Provenance) {
        let hit = matches!(&self.last, Some((t, topic, dead, ..))
            if Arc::ptr_eq(t, &origin.table) && *topic == event.topic && *dead == origin.dead_letter);
        if !hit {
            self.look_up(event, origin);
        }
        let Some((_, _, _, index, read)) = &self.last else {
            return;
        };
        if !origin.replaces {
            read.inc();
        }
        if self.by_token.len() <= token {
            self.by_token.resize(token + 1, None);
        }
        self.by_token[token] = Some((*index, event.size() as u64));
    }

    fn look_up(&mut self, event: &Event, origin: &Provenance) {
        let m = &self.metrics;
        let key = (
            Arc::clone(&origin.table),
            event.topic.clone(),
            origin.dead_letter,
        );
        let index = match self.known.get(&key) {
            Some(i) => *i,
            None => {
                let pair = vec![
                    ("table", origin.table.to_string()),
                    ("topic", event.topic.clone()),
                ];
                let family = if origin.dead_letter {
                    &m.events_dead_lettered
                } else {
                    &m.events_published
                };
                self.handles.push(Handles {
                    done: family.get_or_create(&pair).clone(),
                    bytes: m
                        .published_bytes
                        .get_or_create(&vec![("topic", event.topic.clone())])
                        .clone(),
                });
                self.known.insert(key.clone(), self.handles.len() - 1);
                self.handles.len() - 1
            }
        };
        let read = m
            .events_read
            .get_or_create(&vec![("table", origin.table.to_string())])
            .clone();
        self.last = Some((key.0, key.1, key.2, index, read));
    }

    /// The event of `token` was settled: acknowledged (`acked`) or not.
    pub fn settled(&mut self, token: usize, acked: bool) {
        if let Some((index, size)) = self.by_token.get_mut(token).and_then(Option::take)
            && acked
            && let Some(h) = self.handles.get(index)
        {
            h.done.inc();
            h.bytes.inc_by(size);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(topic: &str) -> Event {
        Event {
            event_id: "e1".into(),
            topic: topic.into(),
            key: Some(bytes::Bytes::from_static(b"k")),
            value: bytes::Bytes::from_static(b"{}"),
            json_value: true,
            headers: Vec::new(),
            position: walbox_outbox::Position {
                commit_lsn: walbox_pgoutput::Lsn(16),
                index: 0,
                xid: 1,
            },
            origin: walbox_outbox::Origin::Stream,
        }
    }

    #[test]
    fn counts_by_table_and_topic_when_acknowledged() {
        let m = Metrics::new();
        let mut c = SendCounters::new(Arc::clone(&m));
        let table: Arc<str> = Arc::from("public.outbox");
        let origin = |dead_letter, replaces| Provenance {
            table: Arc::clone(&table),
            dead_letter,
            replaces,
        };
        c.sent(0, &event("orders"), &origin(false, false));
        c.sent(1, &event("orders"), &origin(false, false));
        c.settled(0, true);
        c.settled(1, false); // refused: its dead letter takes its place
        c.sent(1, &event("orders.dlq"), &origin(true, true));
        c.settled(1, true);
        let text = m.encode();
        for line in [
            "walbox_events_read_total{table=\"public.outbox\"} 2",
            "walbox_events_published_total{table=\"public.outbox\",topic=\"orders\"} 1",
            "walbox_events_dead_lettered_total{table=\"public.outbox\",topic=\"orders.dlq\"} 1",
            "walbox_published_bytes_total{topic=\"orders\"} 9",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
    }

    #[test]
    fn exports_every_name_of_the_contract() {
        let m = Metrics::new();
        m.session_ended("stopped");
        let mut c = SendCounters::new(Arc::clone(&m));
        let origin = Provenance {
            table: Arc::from("public.outbox"),
            dead_letter: false,
            replaces: false,
        };
        c.sent(0, &event("orders"), &origin);
        c.sent(
            1,
            &event("orders.dlq"),
            &Provenance {
                dead_letter: true,
                ..origin.clone()
            },
        );
        let text = m.encode();
        for name in [
            "walbox_events_read_total",
            "walbox_events_published_total",
            "walbox_events_dead_lettered_total",
            "walbox_published_bytes_total",
            "walbox_in_flight_events",
            "walbox_in_flight_bytes",
            "walbox_in_flight_events_limit",
            "walbox_in_flight_bytes_limit",
            "walbox_reported_flush_lsn",
            "walbox_checkpoint_lsn",
            "walbox_server_wal_end_lsn",
            "walbox_slot_retained_wal_bytes",
            "walbox_slot_confirmed_lag_bytes",
            "walbox_slot_safe_wal_size_bytes",
            "walbox_slot_wal_status",
            "walbox_slot_active",
            "walbox_commit_to_ack_seconds",
            "walbox_commit_to_read_seconds",
            "walbox_sessions_started_total",
            "walbox_sessions_ended_total",
            "walbox_stall_probes_total",
            "walbox_seconds_since_last_ack",
            "walbox_seconds_since_last_server_message",
            "walbox_snapshot_rows_done",
            "walbox_snapshot_rows_total",
            "walbox_ready",
            "walbox_build_info",
        ] {
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("# TYPE {name} "))
                        || l.starts_with(&format!("{name}{{"))
                        || l.starts_with(&format!("{name} "))),
                "{name} missing from\n{text}"
            );
        }
        assert!(
            text.contains("walbox_slot_wal_status{status=\"lost\"} 0"),
            "{text}"
        );
        assert!(!text.contains("walbox_up"), "{text}");
    }
}
