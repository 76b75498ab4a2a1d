//! The targets table: every goal of the throughput and memory work, with this
//! run's figure, whether it is met and, where it is not, what limits it and the
//! profile that shows it. Only the rows whose scenarios ran are printed.

use crate::aws::AwsRun;
use crate::contenders::Contender;
use crate::messages::Messages;
use crate::pubsub::PubSubRun;
use crate::report::{Contended, ratio};
use crate::steady::Steady;
use crate::webhook::WebhookRun;

/// The peak RSS every walbox run is to stay under, MB.
const RSS_MB: f64 = 64.0;

/// What this run measured, by scenario (empty where a scenario did not run).
pub struct Figures<'a> {
    pub backlog: &'a [Contended],
    pub one_txn: &'a [Contended],
    pub messages: Option<&'a Messages>,
    pub steady: &'a [Steady],
    pub webhooks: &'a [WebhookRun],
    pub pubsub: Option<&'a PubSubRun>,
    pub aws: &'a [AwsRun],
    pub plain_amqp: Option<&'a crate::amqp::PlainAmqp>,
}

/// One row: a figure against its goal.
struct Row {
    target: String,
    goal: Goal,
    figure: f64,
    /// How the figure reads (`0.32`, `49.0 MB (Redis Streams, backlog)`).
    shown: String,
    /// What limits it when the goal is missed: the part that sets the pace
    /// and the profile or table that shows it.
    limit: &'static str,
}

#[derive(Clone, Copy)]
enum Goal {
    AtLeast(f64),
    AtMost(f64),
    /// Measured and written down, no goal.
    None,
}

impl Row {
    fn verdict(&self) -> &'static str {
        match self.goal {
            Goal::AtLeast(g) if self.figure >= g => "met",
            Goal::AtMost(g) if self.figure <= g => "met",
            Goal::None => "measured",
            _ => "not met",
        }
    }

    fn goal(&self) -> String {
        match self.goal {
            Goal::AtLeast(g) => format!(">= {g}"),
            Goal::AtMost(g) => format!("<= {g}"),
            Goal::None => "-".to_owned(),
        }
    }
}

fn find(runs: &[Contended], c: Contender) -> Option<&Contended> {
    runs.iter().find(|r| r.name == c.name())
}

/// The rows this run has figures for.
fn rows(f: &Figures<'_>) -> Vec<Row> {
    let mut rows = Vec::new();
    let backlog = f.backlog;
    let ceiling = find(backlog, Contender::TrueCeiling);
    let of_ceiling = |c: Contender| Some(ratio(ceiling?, find(backlog, c)?).0);
    if let Some(r) = of_ceiling(Contender::WalboxRedis) {
        rows.push(Row {
            target: "Redis Streams, of the ceiling's rate (backlog)".into(),
            goal: Goal::AtLeast(0.9),
            figure: r,
            shown: format!("{r:.2}"),
            limit: "redis-server: one thread writing and fsyncing its append-only file for \
                    every call (appendfsync always); docs/flame-redis.svg, and `redis-cli --pipe` \
                    alone in docs/benchmarks.md",
        });
    }
    if let (Some(kafka), Some(nats)) = (
        find(backlog, Contender::WalboxKafka),
        find(backlog, Contender::WalboxNats),
    ) {
        let r = kafka.seconds().median / nats.seconds().median;
        rows.push(Row {
            target: "JetStream, of walbox to the broker's rate (backlog)".into(),
            goal: Goal::AtLeast(0.9),
            figure: r,
            shown: format!("{r:.2}"),
            limit: "nats-server's CPU per event, about walbox's own, on the same cores; \
                    async-nats's HeaderMap a quarter of walbox's; docs/flame-jetstream.svg",
        });
    }
    if let Some(r) = of_ceiling(Contender::WalboxRabbitMqExchange) {
        rows.push(Row {
            target: "RabbitMQ exchange mode with confirms, of the ceiling's rate (backlog)".into(),
            goal: Goal::AtLeast(0.9),
            figure: r,
            shown: format!("{r:.2}"),
            limit: "the broker: one classic queue is one Erlang process, and a plain AMQP \
                    client publishing the same shape to the same exchange is held to about \
                    the same rate (its row below and table above); walbox is idle most of the \
                    run; docs/flame-rabbitmq-exchange.svg",
        });
    }
    if let (Some(plain), Some(walbox)) = (
        f.plain_amqp,
        find(backlog, Contender::WalboxRabbitMqExchange),
    ) {
        let r = plain.seconds().median / walbox.seconds().median;
        rows.push(Row {
            target: "RabbitMQ exchange mode, of a plain AMQP client's rate (same exchange, \
                     confirmed)"
                .into(),
            goal: Goal::AtLeast(0.9),
            figure: r,
            shown: format!("{r:.2}"),
            limit: "walbox's path per event beside the plain client's: \
                    docs/flame-rabbitmq-exchange.svg",
        });
    }
    if let Some(r) = of_ceiling(Contender::WalboxRabbitMq) {
        rows.push(Row {
            target: "RabbitMQ streams, of the ceiling's rate (backlog)".into(),
            goal: Goal::None,
            figure: r,
            shown: format!("{r:.2}"),
            limit: "",
        });
    }
    for w in f.webhooks {
        let r = w.plain_seconds / w.drain_seconds;
        let target = w.keys >= 256;
        rows.push(Row {
            target: format!(
                "webhooks at {} key{}, of the receiver's ceiling",
                w.keys,
                if w.keys == 1 { "" } else { "s" }
            ),
            goal: if target {
                Goal::AtLeast(0.8)
            } else {
                Goal::None
            },
            figure: r,
            shown: format!("{r:.2}"),
            limit: "one request per key in flight (per-key order): walbox's round trips per \
                    key against the plain client's; the webhook table in docs/benchmarks.md",
        });
    }
    if let (Some(kafka), Some(recv)) = (
        find(backlog, Contender::WalboxKafka),
        find(backlog, Contender::Ceiling),
    ) {
        let r = kafka.cpu_seconds().median / recv.cpu_seconds().median;
        rows.push(Row {
            target: "CPU per event, rows to the broker, of pg_recvlogical's (backlog)".into(),
            goal: Goal::AtMost(1.0),
            figure: r,
            shown: format!("{r:.2}"),
            limit: "librdkafka's producer (a copy and a header list per record, its own \
                    threads); docs/flame-rows-kafka.svg",
        });
    }
    if let (Some(one), Some(workers)) = (
        find(backlog, Contender::WalboxKafka),
        find(backlog, Contender::WalboxKafkaWorkers),
    ) {
        let r = one.seconds().median / workers.seconds().median;
        let cpu = workers.cpu_seconds().median / one.cpu_seconds().median;
        rows.push(Row {
            target: "2 runtime workers against one thread, to the broker: rate (CPU)".into(),
            goal: Goal::None,
            figure: r,
            shown: format!("{r:.2} ({cpu:.2})"),
            limit: "",
        });
    }
    // The highest peak RSS of any walbox run, and where.
    let mut peaks: Vec<(f64, String)> = Vec::new();
    let mut slot_runs = |scenario: &str, runs: &[Contended]| {
        for c in runs.iter().filter(|c| c.name.starts_with("walbox")) {
            if let Some(kb) = c.runs.iter().filter_map(|r| r.peak_rss_kb).max() {
                peaks.push((kb as f64 / 1024.0, format!("{}, {scenario}", c.name)));
            }
        }
    };
    slot_runs("backlog", backlog);
    slot_runs("one transaction", f.one_txn);
    if let Some(m) = f.messages {
        slot_runs("messages", &m.contenders);
    }
    for s in f.steady {
        peaks.push((
            s.peak_rss_kb as f64 / 1024.0,
            format!("steady {} events/s", s.rate),
        ));
    }
    for w in f.webhooks {
        peaks.push((
            w.peak_rss_kb as f64 / 1024.0,
            format!("webhooks, {} keys", w.keys),
        ));
    }
    if let Some(p) = f.pubsub {
        peaks.push((p.walbox_peak_rss_kb as f64 / 1024.0, "Pub/Sub".into()));
    }
    for a in f.aws {
        peaks.push((
            a.walbox_peak_rss_kb as f64 / 1024.0,
            format!("{:?}", a.service),
        ));
    }
    if let Some((mb, at)) = peaks.into_iter().max_by(|a, b| a.0.total_cmp(&b.0)) {
        rows.push(Row {
            target: "peak RSS of walbox, every scenario that ran".into(),
            goal: Goal::AtMost(RSS_MB),
            figure: mb,
            shown: format!("{mb:.1} MB ({at})"),
            limit: "the in-flight window against a destination slower than the WAL: up to \
                    sink.max_in_flight (10,000) events held at once, each as the relay's \
                    event and the sink's prepared message (RabbitMQ exchange mode: about \
                    4.9 KB per unconfirmed publication, so its default window is 2,000: \
                    42.7 MB at the rate of 10,000); RSS falls back once they are acknowledged, and about 18 MB \
                    of it is walbox's mapped code (docs/benchmarks.md, \"Peak RSS\" and \
                    \"Every scenario in one run\"; the RSS column of each table)",
        });
    }
    if let Some(p) = f.pubsub {
        let r = p.walbox_seconds / p.plain_seconds;
        rows.push(Row {
            target: "Pub/Sub, walbox's time of a plain client's".into(),
            goal: Goal::None,
            figure: r,
            shown: format!("{r:.2}"),
            limit: "",
        });
    }
    for a in f.aws {
        let r = a.walbox_seconds / a.plain_seconds;
        rows.push(Row {
            target: format!("{:?}, walbox's time of a plain SDK client's", a.service),
            goal: Goal::None,
            figure: r,
            shown: format!("{r:.2}"),
            limit: "",
        });
    }
    rows
}

/// Prints the targets this run has figures for.
pub fn print(f: &Figures<'_>) {
    let rows = rows(f);
    if rows.is_empty() {
        return;
    }
    println!();
    println!("### Targets");
    println!();
    println!("| target | goal | this run | | what limits it |");
    println!("|---|---|---:|---|---|");
    for r in &rows {
        let verdict = r.verdict();
        println!(
            "| {} | {} | {} | {verdict} | {} |",
            r.target,
            r.goal(),
            r.shown,
            if verdict == "not met" { r.limit } else { "" }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contenders::Run;

    fn contended(c: Contender, seconds: f64, cpu: f64, rss_kb: u64) -> Contended {
        Contended {
            name: c.name(),
            runs: vec![Run {
                seconds,
                peak_rss_kb: Some(rss_kb),
                cpu_seconds: cpu,
                switches: None,
                allocations: None,
            }],
            in_rounds: true,
            extra_wal_per_event: None,
        }
    }

    #[test]
    fn each_row_is_judged_against_its_goal_from_the_run_figures() {
        let backlog = [
            contended(Contender::TrueCeiling, 10.0, 3.0, 4_000),
            contended(Contender::Ceiling, 10.0, 4.0, 8_000),
            contended(Contender::WalboxKafka, 8.0, 4.4, 36_000),
            contended(Contender::WalboxNats, 16.0, 9.0, 70_000),
            contended(Contender::WalboxRedis, 10.5, 5.0, 40_000),
        ];
        let f = Figures {
            backlog: &backlog,
            one_txn: &[],
            messages: None,
            steady: &[],
            webhooks: &[],
            pubsub: None,
            aws: &[],
            plain_amqp: None,
        };
        let rows = rows(&f);
        let row = |prefix: &str| {
            rows.iter()
                .find(|r| r.target.starts_with(prefix))
                .unwrap_or_else(|| panic!("no row {prefix}"))
        };
        // 10 / 10.5 of the ceiling's rate.
        assert_eq!(row("Redis Streams").verdict(), "met");
        // 8 / 16 of the broker's rate.
        assert_eq!(row("JetStream").shown, "0.50");
        assert_eq!(row("JetStream").verdict(), "not met");
        // 4.4 / 4.0 of pg_recvlogical's CPU.
        assert_eq!(row("CPU per event").shown, "1.10");
        assert_eq!(row("CPU per event").verdict(), "not met");
        // The highest walbox RSS, named; the ceilings' are not walbox's.
        let rss = row("peak RSS");
        assert!(
            rss.shown
                .starts_with("68.4 MB (walbox to JetStream, backlog)"),
            "{}",
            rss.shown
        );
        assert_eq!(rss.verdict(), "not met");
        // No exchange-mode run, no row.
        assert!(!rows.iter().any(|r| r.target.contains("exchange")));
    }
}
