//! `walbox verify`: audits the outbox table against what the topics (or, with
//! the NATS sink, the JetStream stream's subjects) hold, so an
//! operator can check a live system: events missing from the topics, events
//! published more than once (and whether as a replay of the same source
//! position), and events of one key out of commit order.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use walbox_outbox::{TableConfig, TopicTemplate, header, validate_topic};
use walbox_pgoutput::Lsn;

use crate::catalog::ident;
use crate::config::{Config, Overrides, SinkKind};
use crate::pg::ConnParams;

/// `walbox verify` arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    overrides: Overrides,
    /// A topic to read (repeatable). Default: every topic the table's rows map to.
    #[arg(long = "read-topic", value_name = "TOPIC")]
    topics: Vec<String>,
    /// Only audit rows matching this SQL condition, e.g. rows older than the
    /// relay's lag: "occurred_at < now() - interval '5 minutes'".
    #[arg(long = "where", value_name = "SQL")]
    filter: Option<String>,
    /// Print JSON, for scripts.
    #[arg(long)]
    json: bool,
    /// Give up reading a topic after this many seconds without a record.
    #[arg(long, default_value_t = 60)]
    timeout_s: u64,
}

/// What the audit found.
#[derive(Debug, Default, serde::Serialize)]
struct Report {
    table: String,
    topics: Vec<String>,
    rows: u64,
    records: u64,
    /// Event ids in the table found in no topic and no dead-letter topic.
    missing: u64,
    /// Event ids that went to a dead-letter topic.
    dead_lettered: u64,
    /// Event ids with more than one record.
    duplicated: u64,
    /// ... of which every copy carries the same source position (a replay).
    duplicated_as_replay: u64,
    /// Records of a key that arrived after a later event of that key.
    out_of_order: u64,
    /// Event ids in the topics that the (filtered) table does not have.
    not_in_table: u64,
    /// Up to ten examples of each problem (event ids only).
    examples: HashMap<&'static str, Vec<String>>,
}

impl Report {
    fn example(&mut self, kind: &'static str, id: &str) {
        let list = self.examples.entry(kind).or_default();
        if list.len() < 10 {
            list.push(id.to_owned());
        }
    }
}

/// The column a topic template field reads: a role's configured column, the
/// first of the format's default names for the role that the table has
/// (`existing`), or the field as a column name.
fn column_for<'a>(table: &'a TableConfig, field: &'a str, existing: &[String]) -> &'a str {
    let c = &table.columns;
    let configured = match field {
        "id" => c.id.as_deref(),
        "aggregate_type" => c.aggregate_type.as_deref(),
        "aggregate_id" => c.aggregate_id.as_deref(),
        "event_type" => c.event_type.as_deref(),
        "schema_version" => c.schema_version.as_deref(),
        _ => None,
    };
    configured
        .or_else(|| {
            table
                .formatting
                .format
                .default_columns(field)
                .iter()
                .copied()
                .find(|d| existing.iter().any(|e| e == d))
        })
        .unwrap_or(field)
}

fn where_clause(filter: Option<&str>) -> String {
    filter.map_or_else(String::new, |f| format!(" WHERE ({f})"))
}

/// The topics the table's rows map to. Rows that cannot form a valid topic name
/// (a NULL field or column, a name Kafka refuses) are left out: walbox
/// dead-letters them to the table's fallback dead-letter topic
/// ([`TopicTemplate::fallback_dead_letter_topic`]).
pub(crate) async fn topics_of(
    sql: &tokio_postgres::Client,
    table: &TableConfig,
    filter: Option<&str>,
) -> Result<Vec<String>> {
    let (schema, name) = table.qualified();
    let from = format!("{}.{}{}", ident(schema), ident(name), where_clause(filter));
    if let Some(col) = &table.topic_column {
        let rows = sql
            .query(
                &format!("SELECT DISTINCT {}::text FROM {from}", ident(col)),
                &[],
            )
            .await?;
        return Ok(rows
            .iter()
            .filter_map(|r| r.get::<_, Option<String>>(0))
            .filter(|t| validate_topic(t).is_ok())
            .collect());
    }
    let template = TopicTemplate::parse(&table.topic).context("topic template")?;
    if template.is_fixed() {
        return Ok(vec![table.topic.clone()]);
    }
    let existing: Vec<String> = sql
        .query(
            "SELECT attname::text FROM pg_attribute
             WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped",
            &[&format!("{}.{}", ident(schema), ident(name))],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let fields: Vec<&str> = template.fields().collect();
    let cols: Vec<String> = fields
        .iter()
        .map(|f| format!("{}::text", ident(column_for(table, f, &existing))))
        .collect();
    let rows = sql
        .query(
            &format!("SELECT DISTINCT {} FROM {from}", cols.join(", ")),
            &[],
        )
        .await?;
    let mut topics = Vec::new();
    for r in rows {
        let values: Vec<Option<String>> = (0..fields.len()).map(|i| r.get(i)).collect();
        let topic = template.render(|i, _| values.get(i).and_then(|v| v.as_deref()).ok_or(()));
        if let Ok(t) = topic
            && validate_topic(&t).is_ok()
        {
            topics.push(t);
        }
    }
    topics.sort();
    topics.dedup();
    Ok(topics)
}

/// Reads what `topic` holds: a Kafka topic, with the NATS sink the subject
/// in its JetStream stream, with the Redis sink the stream of that name.
async fn read_records(
    config: &Config,
    properties: &[(String, String)],
    topic: &str,
    timeout: Duration,
    each: impl FnMut(walbox_sink::RecordView<'_>),
) -> Result<u64, walbox_sink::SinkError> {
    match config.sink.kind {
        SinkKind::Nats => walbox_sink::read_subject(&config.sink.nats, topic, timeout, each).await,
        SinkKind::Redis => {
            let redis = config
                .sink
                .redis_sink(&config.source.slot)
                .map_err(|e| walbox_sink::SinkError::Config(e.to_string()))?;
            walbox_sink::read_stream(&redis, topic, timeout, each).await
        }
        SinkKind::RabbitMq if config.sink.rabbitmq.mode == walbox_sink::RabbitMqMode::Stream => {
            walbox_sink::read_rabbit_stream(&config.sink.rabbitmq, topic, timeout, each).await
        }
        SinkKind::RabbitMq => {
            let Some(queue) = config.sink.rabbitmq.verify_queue.as_deref() else {
                return Err(walbox_sink::SinkError::Config(
                    "sink.rabbitmq.verify_queue: name the durable queue bound to the exchange \
                     that walbox verify reads back"
                        .into(),
                ));
            };
            walbox_sink::read_queue(&config.sink.rabbitmq, queue, Some(topic), timeout, each).await
        }
        SinkKind::Kafka | SinkKind::Stdout => tokio::task::block_in_place(|| {
            walbox_sink::read_topic(properties, topic, timeout, each)
        }),
        SinkKind::PubSub => {
            let pubsub = config
                .sink
                .pubsub_sink()
                .map_err(|e| walbox_sink::SinkError::Config(e.to_string()))?;
            let Some(subscription) = pubsub.verify_subscription_of(topic) else {
                return Err(walbox_sink::SinkError::Config(
                    "sink.pubsub.verify_subscription: name the subscription ({topic} for the \
                     topic) that walbox verify reads back; made before the events were \
                     published, with message ordering, for audits only (verify acknowledges \
                     what it reads)"
                        .into(),
                ));
            };
            walbox_sink::read_subscription(&pubsub, &subscription, timeout, each).await
        }
        SinkKind::Kinesis => {
            let kinesis = config
                .sink
                .kinesis_sink()
                .map_err(|e| walbox_sink::SinkError::Config(e.to_string()))?;
            walbox_sink::read_kinesis_stream(&kinesis, topic, timeout, each)
                .await?
                .ok_or_else(|| walbox_sink::SinkError::MissingTopic(topic.to_owned()))
        }
        SinkKind::Sns => Err(walbox_sink::SinkError::Config(
            "an SNS topic keeps nothing to read back".into(),
        )),
        SinkKind::Sqs => Err(walbox_sink::SinkError::Config(
            "an SQS queue hands its messages to its consumers: reading it back would take them \
             away"
                .into(),
        )),
        SinkKind::Webhook => Err(walbox_sink::SinkError::Config(
            "an HTTP receiver keeps no record walbox can read back".into(),
        )),
    }
}

/// The event ids of the dead letters a Pub/Sub dead-letter topic's letters
/// subscription holds, read and handed back (left for `walbox dlq replay`).
async fn pubsub_letter_ids(config: &Config, dlq: &str, timeout: Duration) -> Result<Vec<String>> {
    let pubsub = config.sink.pubsub_sink()?;
    let Some(letters) = walbox_sink::SubscriptionLetters::read(&pubsub, dlq, timeout).await? else {
        return Ok(Vec::new());
    };
    let mut ids = Vec::new();
    letters.each(|r| ids.push(r.header(header::EVENT_ID).unwrap_or_default().to_owned()));
    letters.settle(|_| false).await?;
    Ok(ids)
}

/// Runs the audit; fails when events are missing or out of order.
pub async fn run(args: Args) -> Result<()> {
    let config = Config::load(&args.overrides)?;
    if config.sink.kind == SinkKind::Sns {
        bail!(
            "verify reads the events back from the destination, and an SNS topic keeps \
             nothing; audit a subscribed queue's consumers by event_id (the message attribute) \
             instead"
        );
    }
    if config.sink.kind == SinkKind::Sqs {
        bail!(
            "verify reads the events back from the destination, and reading an SQS queue \
             takes its messages away from its consumers; audit the consumers' own store by \
             event_id (the message attribute) instead"
        );
    }
    if config.sink.kind == SinkKind::Webhook {
        bail!(
            "verify reads the events back from the destination, and an HTTP receiver keeps \
             nothing walbox can read; audit the receiver's own store by webhook-id (the event \
             id) instead"
        );
    }
    if config.outbox.is_empty() && !config.messages.is_empty() {
        bail!(
            "verify cannot check logical decoding messages ([[messages]]): they are in no table \
             to compare the topics against; it audits one outbox table, named with --table"
        );
    }
    let [table] = config.outbox.as_slice() else {
        bail!("verify audits one outbox table: name it with --table");
    };
    let sql = ConnParams::parse(config.dsn()?)?.connect().await?;
    let (schema, name) = table.qualified();
    let id_col = table.columns.id.as_deref().unwrap_or("id");
    let rows = sql
        .query(
            &format!(
                "SELECT {}::text FROM {}.{}{}",
                ident(id_col),
                ident(schema),
                ident(name),
                where_clause(args.filter.as_deref())
            ),
            &[],
        )
        .await
        .with_context(|| format!("reading {schema}.{name}"))?;
    let mut report = Report {
        table: format!("{schema}.{name}"),
        ..Report::default()
    };
    let mut in_table: HashSet<String> = HashSet::with_capacity(rows.len());
    for r in &rows {
        if let Some(id) = r.get::<_, Option<String>>(0) {
            in_table.insert(id);
        }
    }
    report.rows = rows.len() as u64;
    drop(rows);
    let topics = if args.topics.is_empty() {
        topics_of(&sql, table, args.filter.as_deref()).await?
    } else {
        args.topics.clone()
    };
    report.topics.clone_from(&topics);
    let properties = config.sink.kafka_properties()?;
    let timeout = Duration::from_secs(args.timeout_s);
    let dead_letter = config.dead_letter.template()?;

    // Positions of each event id's records, and per key the latest position seen.
    let mut positions: HashMap<String, Vec<(Lsn, u64)>> = HashMap::new();
    let mut latest: HashMap<(String, Vec<u8>), (Lsn, u64)> = HashMap::new();
    let mut dead: HashSet<String> = HashSet::new();
    let mut out_of_order: Vec<String> = Vec::new();
    let mut dead_letter_topics: Vec<String> = Vec::new();
    for topic in &topics {
        let read = read_records(&config, &properties, topic, timeout, |r| {
            let id = r.event_id().unwrap_or_default();
            let pos = r
                .header(header::COMMIT_LSN)
                .and_then(|l| l.parse::<Lsn>().ok())
                .zip(r.header(header::INDEX).and_then(|i| i.parse::<u64>().ok()))
                .unwrap_or((Lsn(0), 0));
            let replay = positions.contains_key(&id);
            if let Some(key) = r.key() {
                let slot = latest.entry((topic.clone(), key.to_vec())).or_insert(pos);
                if pos < *slot && !replay {
                    out_of_order.push(id.clone());
                }
                *slot = (*slot).max(pos);
            }
            positions.entry(id).or_default().push(pos);
        })
        .await
        .with_context(|| format!("reading topic {topic}"))?;
        report.records += read;
        dead_letter_topics.push(dead_letter.dead_letter_topic(topic));
    }
    // The dead letters: of each topic, and of the rows that could not name one.
    dead_letter_topics.push(dead_letter.fallback_dead_letter_topic(&report.table));
    dead_letter_topics.sort();
    dead_letter_topics.dedup();
    for dlq in dead_letter_topics.iter().filter(|t| !topics.contains(t)) {
        if config.sink.kind == SinkKind::PubSub {
            dead.extend(pubsub_letter_ids(&config, dlq, timeout).await?);
            continue;
        }
        let mut ids = Vec::new();
        let ids = read_records(&config, &properties, dlq, timeout, |r| {
            ids.push(r.header(header::EVENT_ID).unwrap_or_default().to_owned());
        })
        .await
        .map(|_| ids);
        // A missing dead-letter topic means nothing was dead-lettered.
        if let Ok(ids) = ids {
            dead.extend(ids);
        }
    }
    for id in &out_of_order {
        report.example("out_of_order", id);
    }
    report.out_of_order = out_of_order.len() as u64;
    for id in &in_table {
        if !positions.contains_key(id) {
            if dead.contains(id) {
                report.dead_lettered += 1;
            } else {
                report.missing += 1;
                report.example("missing", id);
            }
        }
    }
    let mut examples = Vec::new();
    for (id, p) in &positions {
        if p.len() > 1 {
            report.duplicated += 1;
            if p.iter().all(|x| *x == p[0]) {
                report.duplicated_as_replay += 1;
            } else {
                examples.push(id.clone());
            }
        }
        if !in_table.contains(id) {
            report.not_in_table += 1;
        }
    }
    for id in examples {
        report.example("duplicated_from_other_positions", &id);
    }
    print(&report, args.json)?;
    if report.missing > 0 || report.out_of_order > 0 {
        bail!(
            "{} missing, {} out of order",
            report.missing,
            report.out_of_order
        );
    }
    Ok(())
}

#[allow(clippy::print_stdout)] // command output
fn print(r: &Report, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(r)?);
        return Ok(());
    }
    println!("table            {} ({} rows)", r.table, r.rows);
    println!(
        "topics           {} ({} records)",
        r.topics.join(", "),
        r.records
    );
    println!("missing          {}", r.missing);
    println!("dead-lettered    {}", r.dead_lettered);
    println!(
        "duplicated       {} ({} as replays of the same position)",
        r.duplicated, r.duplicated_as_replay
    );
    println!("out of order     {}", r.out_of_order);
    println!("not in the table {}", r.not_in_table);
    let mut kinds: Vec<_> = r.examples.iter().collect();
    kinds.sort();
    for (kind, ids) in kinds {
        println!("  {kind}: {}", ids.join(", "));
    }
    Ok(())
}
