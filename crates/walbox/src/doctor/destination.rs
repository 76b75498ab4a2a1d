//! `walbox doctor`'s checks of the destination the configuration names
//! ([`walbox_sink::probe`]): it answers, takes walbox's credentials, what
//! walbox publishes to exists or may be created, and what the sink requires
//! of it is set. Every sink type has its arm; one that cannot be asked
//! anything says so.

use super::{Report, Verdict};
use crate::config::{Config, SinkKind};
use walbox_sink::probe::{self, Finding};

/// The topics the configuration names outright (a topic template without
/// fields) and their dead-letter topics; names that come from rows cannot be
/// known before the rows.
fn fixed_topics(config: &Config) -> (Vec<String>, Vec<String>) {
    let dead_letters = config.dead_letter.template().ok();
    let mut fixed = Vec::new();
    let mut from_rows = Vec::new();
    for t in &config.outbox {
        let template = walbox_outbox::TopicTemplate::parse(&t.topic).ok();
        match template {
            Some(template) if t.topic_column.is_none() && template.is_fixed() => {
                fixed.push(t.topic.clone());
                if let Some(d) = &dead_letters {
                    fixed.push(d.dead_letter_topic(&t.topic));
                }
            }
            _ => from_rows.push(
                t.topic_column
                    .as_ref()
                    .map_or_else(|| t.topic.clone(), |c| format!("column {c}")),
            ),
        }
    }
    (fixed, from_rows)
}

fn add(r: &mut Report, findings: Vec<Finding>) {
    for f in findings {
        let verdict = match f.verdict {
            probe::Verdict::Ok => Verdict::Ok,
            probe::Verdict::Warn => Verdict::Warn,
            probe::Verdict::Fail => Verdict::Fail,
        };
        r.add(verdict, f.text);
    }
}

/// Adds the destination's lines to `r`.
pub(super) async fn check(r: &mut Report, config: &Config) {
    let (fixed, from_rows) = fixed_topics(config);
    let sink = &config.sink;
    let kind = sink.kind;
    if !from_rows.is_empty()
        && matches!(
            kind,
            SinkKind::Kafka
                | SinkKind::RabbitMq
                | SinkKind::Kinesis
                | SinkKind::Sqs
                | SinkKind::Sns
        )
    {
        r.add(
            Verdict::Ok,
            format!(
                "topics named by rows ({}) are checked when walbox first publishes to them",
                from_rows.join(", ")
            ),
        );
    }
    match kind {
        SinkKind::Kafka => match sink.kafka_sink() {
            Ok(k) if !k.properties.iter().any(|(p, _)| p == "bootstrap.servers") => r.add(
                Verdict::Warn,
                "sink.kafka \"bootstrap.servers\" is not set, so the destination was not \
                 checked: set it (or --bootstrap-servers, WALBOX_BOOTSTRAP_SERVERS); walbox run \
                 needs it",
            ),
            Ok(k) => add(r, probe::kafka(&k, &fixed).await),
            Err(e) => r.add(Verdict::Fail, format!("{e:#}")),
        },
        SinkKind::Nats => match sink.nats_sink() {
            Ok(n) => add(r, probe::nats(&n).await),
            Err(e) => r.add(Verdict::Fail, format!("{e:#}")),
        },
        SinkKind::RabbitMq => match sink.rabbitmq_sink(&config.source.slot) {
            Ok(c) => add(r, probe::rabbitmq(&c, &fixed).await),
            Err(e) => r.add(Verdict::Fail, format!("{e:#}")),
        },
        SinkKind::Webhook => match config.webhook_sink() {
            Ok(w) => add(r, probe::webhook(&w.url).await),
            Err(e) => r.add(Verdict::Fail, format!("{e:#}")),
        },
        SinkKind::Kinesis => match sink.kinesis_sink() {
            Ok(k) => add(r, probe::kinesis(&k, &fixed).await),
            Err(e) => r.add(Verdict::Fail, format!("{e:#}")),
        },
        SinkKind::Sns => match sink.sns_sink() {
            Ok(c) => add(r, probe::sns(&c, &fixed).await),
            Err(e) => r.add(Verdict::Fail, format!("{e:#}")),
        },
        SinkKind::Sqs => match sink.sqs_sink() {
            Ok(q) => add(r, probe::sqs(&q, &fixed).await),
            Err(e) => r.add(Verdict::Fail, format!("{e:#}")),
        },
        // The durability check (doctor.rs) connects with the credentials.
        SinkKind::Redis => {}
        // doctor.rs says where it publishes and with which credentials.
        SinkKind::PubSub => {}
        SinkKind::Stdout => r.add(
            Verdict::Ok,
            "sink type stdout: events go to standard output, nothing to reach",
        ),
    }
}
