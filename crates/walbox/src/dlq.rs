//! `walbox dlq replay`: publishes dead letters again to the topic they were meant
//! for, after the cause was fixed (the row updated, the mapping or the broker's
//! limits changed), with their event ids and source positions. Nothing is
//! deleted from the dead-letter topic; progress is kept by the broker: with
//! Kafka as a consumer group's offsets on the dead-letter topic (stopping, per
//! partition, before the first letter that still fails), with NATS JetStream as
//! the acknowledgements of a durable consumer on the dead-letter subject (a
//! letter that still fails is handed back, the others are done), with the
//! webhook sink as the dead-letter file's lines done, kept beside it
//! (`<file>.replayed`, stopping before the first letter that still fails,
//! applied only to the same file still holding the same bytes up to there,
//! else the file is replayed from its first letter),
//! with Redis Streams as a consumer group on the dead-letter stream (a letter
//! that still fails stays pending; a pending letter whose entry was deleted
//! or trimmed since is reported as an error on every run, never passed
//! over), with RabbitMQ (exchange mode) as the
//! acknowledgements of the messages of the dead-letter queue the user bound (`sink.rabbitmq.dead_letter_queue`), with RabbitMQ
//! streams as an offset the broker stores per dead-letter stream (each
//! letter's event published as a replay of its own, under producer names
//! apart from the stream's), with Google Cloud Pub/Sub as the
//! acknowledgements of the dead-letter topic's letters subscription (taken
//! in commit order; a letter that still fails is handed back).
//!
//! A letter's event is published under its own event id (a dead letter holds
//! `{id}.dlq` on NATS), so a run again after a kill, before its progress was
//! recorded, is dropped by a destination that deduplicates: such a drop is
//! checked to be the same event and reported as already stored, never as
//! replayed.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use walbox_outbox::{Mapper, MessageMapper, Position, TableConfig, dead_letter_header, header};
use walbox_pgoutput::{Lsn, TupleValue};
use walbox_sink::{
    DurableLetters, KafkaSink, KinesisLetters, KinesisSink, NatsSink, PubSubSink, QueueLetters,
    RabbitMqSink, RabbitStreamLetters, RedisSink, Sink, SnsSink, SqsLetters, SqsSink,
    StreamLetters, SubscriptionLetters, WebhookSink,
};

use crate::catalog::{self, ident};
use crate::config::{Config, Overrides, SinkKind};
use crate::pg::ConnParams;

/// `walbox dlq replay` arguments.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    overrides: Overrides,
    /// Dead-letter topic to replay (repeatable). Default: the dead-letter topics
    /// of every topic the outbox table's rows map to, and the table's fallback
    /// dead-letter topic (`walbox.<schema>.<table>` through the dead-letter
    /// template) of rows that could not name a valid topic.
    #[arg(long = "dlq-topic", value_name = "TOPIC")]
    topics: Vec<String>,
    /// Take each row as the outbox table holds it now (after an UPDATE fixed
    /// it), not as the dead letter recorded it. Rows whose value was not kept
    /// (refused for their size) are always read from the table.
    #[arg(long)]
    from_table: bool,
    /// Show what would be published; publish and record nothing.
    #[arg(long)]
    dry_run: bool,
}

/// One dead letter read back.
#[derive(Debug)]
struct DeadLetter {
    partition: i32,
    offset: i64,
    event_id: String,
    table: Option<String>,
    position: Position,
    /// The row's columns as the dead letter recorded them, when it did.
    columns: Option<serde_json::Map<String, serde_json::Value>>,
    /// For a logical decoding message's dead letter: its prefix, and its content
    /// when the letter holds it as text.
    message: Option<(String, Option<String>)>,
    /// Why it was dead-lettered (`walbox_error_class`).
    class: Option<String>,
    /// The letter's key: its event's, by which later letters of the key
    /// wait behind one that still fails.
    key: Option<Vec<u8>>,
}

impl DeadLetter {
    /// Why this letter can never become its event again, whatever is fixed: a
    /// non-transactional message has no commit order (its transaction may even
    /// have rolled back), and a message is in no table, so a letter that does
    /// not hold its content has nothing to rebuild it from.
    fn never_replayable(&self) -> Option<&'static str> {
        let (_, content) = self.message.as_ref()?;
        let non_transactional = walbox_outbox::MessageError::NonTransactional.class();
        if self.class.as_deref() == Some(non_transactional) || self.position.xid == 0 {
            Some("a non-transactional message: it has no commit order and is never an event")
        } else if content.is_none() {
            Some("a message whose content the letter does not hold (too large, or not UTF-8)")
        } else {
            None
        }
    }

    fn offset_key(&self) -> (i32, i64) {
        (self.partition, self.offset)
    }
}

fn parse(r: &walbox_sink::RecordView<'_>) -> DeadLetter {
    let value: Option<serde_json::Value> = r.value().and_then(|v| serde_json::from_slice(v).ok());
    let position = Position {
        commit_lsn: r
            .header(header::COMMIT_LSN)
            .and_then(|v| v.parse().ok())
            .unwrap_or(Lsn(0)),
        index: r
            .header(header::INDEX)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        xid: r
            .header(header::XID)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    };
    let table = r
        .header(dead_letter_header::SOURCE_TABLE)
        .map(str::to_owned)
        .or_else(|| value.as_ref()?.get("table")?.as_str().map(str::to_owned));
    let prefix = r
        .header(walbox_outbox::SOURCE_MESSAGE_PREFIX)
        .map(str::to_owned)
        .or_else(|| value.as_ref()?.get("prefix")?.as_str().map(str::to_owned))
        .filter(|_| table.is_none());
    let message = prefix.map(|prefix| {
        let content = value
            .as_ref()
            .filter(|v| v.get("content_encoding").is_none())
            .and_then(|v| v.get("content")?.as_str().map(str::to_owned));
        (prefix, content)
    });
    DeadLetter {
        partition: r.partition(),
        offset: r.offset(),
        event_id: r.header(header::EVENT_ID).unwrap_or_default().to_owned(),
        table,
        position,
        columns: value.and_then(|v| v.get("columns")?.as_object().cloned()),
        message,
        class: r.header(dead_letter_header::ERROR_CLASS).map(str::to_owned),
        key: r.key().map(<[u8]>::to_vec),
    }
}

/// A compiled mapping with its table, for rebuilding rows.
struct Target<'a> {
    config: &'a TableConfig,
    table: catalog::Table,
    mapper: Mapper,
}

/// Runs the replay.
pub async fn replay(args: ReplayArgs) -> Result<()> {
    let config = Config::load(&args.overrides)?;
    if config.sink.kind == SinkKind::Stdout {
        return Err(nothing_stored());
    }
    let sql = ConnParams::parse(config.dsn()?)?.connect().await?;
    let mut targets: HashMap<String, Target<'_>> = HashMap::new();
    for t in &config.outbox {
        let (schema, name) = t.qualified();
        let table = catalog::table(&sql, schema, name)
            .await?
            .with_context(|| format!("outbox table {schema}.{name} does not exist"))?;
        let mapper = Mapper::compile(t, &config.producer, &table.relation)?;
        targets.insert(
            format!("{schema}.{name}"),
            Target {
                config: t,
                table,
                mapper,
            },
        );
    }
    let template = config.dead_letter.template()?;
    let topics = if args.topics.is_empty() {
        let mut all = Vec::new();
        for t in &config.outbox {
            for topic in crate::verify::topics_of(&sql, t, None).await? {
                all.push(template.dead_letter_topic(&topic));
            }
            // Rows that could not name their topic.
            let (schema, name) = t.qualified();
            all.push(template.fallback_dead_letter_topic(&format!("{schema}.{name}")));
        }
        all.sort();
        all.dedup();
        all
    } else {
        args.topics.clone()
    };
    if topics.is_empty() {
        bail!("no dead-letter topic to replay: name one with --dlq-topic");
    }
    let group = format!("walbox-dlq-replay.{}", config.source.slot);
    let mut messages = HashMap::new();
    for m in &config.messages {
        for prefix in &m.prefixes {
            messages.insert(
                prefix.clone(),
                MessageMapper::compile(m, prefix, &config.producer)?,
            );
        }
    }
    let mut run = Run {
        sql: &sql,
        targets: &targets,
        messages: &messages,
        args: &args,
        replayed: 0,
        already: 0,
        failing: 0,
        kept: 0,
        gone: 0,
        held: HashSet::new(),
        hand_back_unreplayable: match config.sink.kind {
            SinkKind::PubSub | SinkKind::Sqs | SinkKind::Sns => true,
            SinkKind::RabbitMq => config.sink.rabbitmq.mode != walbox_sink::RabbitMqMode::Stream,
            _ => false,
        },
    };
    match config.sink.kind {
        SinkKind::Kafka => {
            let sink_config = config.sink.kafka_sink()?;
            let properties = sink_config.properties.clone();
            let (mut sink, mut deliveries) = KafkaSink::new(sink_config)?;
            for dlq in &topics {
                let mut letters = Vec::new();
                let read = tokio::task::block_in_place(|| {
                    walbox_sink::read_topic_from_group(&properties, dlq, &group, TIMEOUT, |r| {
                        letters.push(parse(&r));
                    })
                });
                match read {
                    Ok(_) => {}
                    // A dead-letter topic that was never created has nothing to replay.
                    Err(walbox_sink::SinkError::Read { .. }) => continue,
                    Err(e) => return Err(e).with_context(|| format!("reading {dlq}")),
                }
                let failed = run
                    .publish(&mut sink, &mut deliveries, dlq, &letters)
                    .await?;
                if args.dry_run {
                    continue;
                }
                // Per partition: the offset after the last letter done, stopping
                // before the first one that still fails.
                let mut next: HashMap<i32, (i64, bool)> = HashMap::new();
                for letter in &letters {
                    let entry = next
                        .entry(letter.partition)
                        .or_insert((letter.offset, false));
                    if failed.contains(&letter.offset_key()) {
                        entry.1 = true;
                    } else if !entry.1 {
                        entry.0 = letter.offset + 1;
                    }
                }
                let done: Vec<(i32, i64)> = next.iter().map(|(p, (o, _))| (*p, *o)).collect();
                tokio::task::block_in_place(|| {
                    walbox_sink::commit_group(&properties, dlq, &group, &done)
                })
                .with_context(|| format!("recording progress on {dlq}"))?;
            }
        }
        SinkKind::Nats => {
            let sink_config = config.sink.nats_sink()?;
            let (mut sink, mut deliveries) = NatsSink::new(sink_config.clone())?;
            for dlq in &topics {
                // One durable consumer per dead-letter subject keeps the progress.
                let durable = format!("{group}.{dlq}").replace(['.', ' ', '*', '>'], "_");
                let Some(read) = DurableLetters::read(&sink_config, dlq, &durable, TIMEOUT)
                    .await
                    .with_context(|| format!("reading {dlq}"))?
                else {
                    // No stream holds the subject: nothing was dead-lettered there.
                    continue;
                };
                let mut letters = Vec::new();
                read.each(|r| letters.push(parse(&r)));
                let published = run.publish(&mut sink, &mut deliveries, dlq, &letters).await;
                // Letters that still fail (all of them on a dry run or an error)
                // are handed back for the next run; the others are done.
                let done = |sequence: u64| {
                    let key = (0, i64::try_from(sequence).unwrap_or(i64::MAX));
                    matches!(&published, Ok(failed) if !args.dry_run && !failed.contains(&key))
                };
                read.settle(done)
                    .await
                    .with_context(|| format!("recording progress on {dlq}"))?;
                published?;
            }
        }
        SinkKind::Webhook => {
            let sink_config = config.webhook_sink()?;
            let file = sink_config
                .dead_letter_file
                .clone()
                .context("sink.webhook.dead_letter_file")?;
            let read = walbox_sink::DeadLetterFile::read(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let start = read.replay_start()?;
            if let Some(why) = &start.not_applied {
                println_out(&format!(
                    "replaying {} from its first letter: the progress recorded in {} does not \
                     apply to it ({why})",
                    file.display(),
                    walbox_sink::replayed_path(&file).display()
                ));
            }
            let (done, lines) = (start.line, read.letters());
            let (mut sink, mut deliveries) = WebhookSink::new(sink_config)?;
            // Letters of the named topics (all of them by default).
            let taken = |l: &walbox_sink::LetterLine| {
                args.topics.is_empty() || args.topics.contains(&l.topic)
            };
            let letters: Vec<DeadLetter> = lines
                .iter()
                .filter(|(n, l)| *n >= done && taken(l))
                .map(|(n, l)| parse(&walbox_sink::RecordView::letter(l, *n)))
                .collect();
            let failed = run
                .publish(
                    &mut sink,
                    &mut deliveries,
                    &file.display().to_string(),
                    &letters,
                )
                .await?;
            if !args.dry_run {
                let next = letters_done(lines, done, taken, |n| {
                    failed.contains(&(0, i64::try_from(n).unwrap_or(i64::MAX)))
                });
                read.record_replayed(next).with_context(|| {
                    format!(
                        "recording progress in {}",
                        walbox_sink::replayed_path(&file).display()
                    )
                })?;
            }
        }
        SinkKind::Redis => {
            let sink_config = config.sink.redis_sink(&config.source.slot)?;
            let (mut sink, mut deliveries) = RedisSink::new(sink_config.clone())?;
            for dlq in &topics {
                // The dead-letter stream's consumer group keeps the progress.
                let Some(read) = StreamLetters::read(&sink_config, dlq, &group, TIMEOUT)
                    .await
                    .with_context(|| format!("reading {dlq}"))?
                else {
                    continue;
                };
                // Letters pending in the group whose entries are gone: never
                // passed over in silence; they stay pending.
                for id in read.gone() {
                    tracing::error!(
                        "dead letter {id} of stream {dlq} is pending in consumer group \
                         {group}, but the stream no longer holds its entry (deleted or \
                         trimmed): its event cannot be replayed from it; store the event \
                         otherwise (walbox replay over its position), then acknowledge \
                         the letter with XACK {dlq} {group} {id}"
                    );
                    run.gone += 1;
                }
                let mut letters = Vec::new();
                read.each(|r| letters.push(parse(&r)));
                let published = run.publish(&mut sink, &mut deliveries, dlq, &letters).await;
                let done = |offset: i64| matches!(&published, Ok(failed) if !args.dry_run && !failed.contains(&(0, offset)));
                read.settle(done)
                    .await
                    .with_context(|| format!("recording progress on {dlq}"))?;
                published?;
            }
        }
        SinkKind::Kinesis => {
            let sink_config = config.sink.kinesis_sink()?;
            let (mut sink, mut deliveries) = KinesisSink::new(sink_config.clone())?;
            for dlq in &topics {
                // Kinesis keeps no consumer position: the replay's progress is
                // a marker record in each shard of the dead-letter stream.
                let Some(read) = KinesisLetters::read(&sink_config, dlq, &group, TIMEOUT)
                    .await
                    .with_context(|| format!("reading {dlq}"))?
                else {
                    continue;
                };
                let mut letters = Vec::new();
                read.each(|r| letters.push(parse(&r)));
                let published = run.publish(&mut sink, &mut deliveries, dlq, &letters).await;
                let done = |offset: i64| matches!(&published, Ok(failed) if !args.dry_run && !failed.contains(&(0, offset)));
                read.settle(done)
                    .await
                    .with_context(|| format!("recording progress on {dlq}"))?;
                published?;
            }
        }
        SinkKind::Sqs => {
            let sink_config = config.sink.sqs_sink()?;
            let (mut sink, mut deliveries) = SqsSink::new(sink_config.clone())?;
            for dlq in &topics {
                let Some(mut read) = SqsLetters::open(&sink_config, dlq)
                    .await
                    .with_context(|| format!("reading {dlq}"))?
                else {
                    continue;
                };
                run.queue_rounds(&mut sink, &mut deliveries, &mut read, dlq)
                    .await?;
            }
        }
        SinkKind::Sns => {
            let sink_config = config.sink.sns_sink()?;
            let Some(queue) = sink_config.dead_letter_queue.clone() else {
                bail!(
                    "sink.sns.dead_letter_queue: name the SQS queue subscribed (raw delivery) to \
                     the dead-letter topics, which walbox dlq replay reads; an SNS topic keeps \
                     nothing itself"
                );
            };
            if !args.topics.is_empty() {
                bail!(
                    "--dlq-topic: the SNS sink's dead letters of every topic reach one queue \
                     (sink.sns.dead_letter_queue = {queue:?}) and are replayed together; run \
                     walbox dlq replay without --dlq-topic"
                );
            }
            let (mut sink, mut deliveries) = SnsSink::new(sink_config.clone())?;
            // One queue holds the letters of every dead-letter topic.
            for dlq in [queue.as_str()] {
                let Some(mut read) = SqsLetters::open_queue(&sink_config.letters_connection(), dlq)
                    .await
                    .with_context(|| format!("reading queue {dlq}"))?
                else {
                    continue;
                };
                run.queue_rounds(&mut sink, &mut deliveries, &mut read, dlq)
                    .await?;
            }
        }
        SinkKind::RabbitMq if config.sink.rabbitmq.mode == walbox_sink::RabbitMqMode::Stream => {
            let sink_config = config.sink.rabbitmq_sink(&config.source.slot)?;
            let (mut sink, mut deliveries) = RabbitMqSink::new(sink_config.clone())?;
            for dlq in &topics {
                // The progress is an offset stored under this name, per stream.
                let Some(read) = RabbitStreamLetters::read(&sink_config, dlq, &group, TIMEOUT)
                    .await
                    .with_context(|| format!("reading {dlq}"))?
                else {
                    continue;
                };
                let mut letters = Vec::new();
                read.each(|r| letters.push(parse(&r)));
                let published = run.publish(&mut sink, &mut deliveries, dlq, &letters).await;
                let done = |offset: i64| matches!(&published, Ok(failed) if !args.dry_run && !failed.contains(&(0, offset)));
                read.settle(done)
                    .await
                    .with_context(|| format!("recording progress on {dlq}"))?;
                published?;
            }
        }
        SinkKind::RabbitMq => {
            let sink_config = config.sink.rabbitmq_sink(&config.source.slot)?;
            let Some(queue) = sink_config.dead_letter_queue.clone() else {
                bail!(
                    "sink.rabbitmq.dead_letter_queue: name the durable queue bound to exchange \
                     {:?} for the dead letters' routing keys ({{topic}}.dlq, e.g. binding key \
                     #.dlq), which walbox dlq replay reads",
                    sink_config.exchange
                );
            };
            let (mut sink, mut deliveries) = RabbitMqSink::new(sink_config.clone())?;
            let read = QueueLetters::read(&sink_config, &queue, TIMEOUT)
                .await
                .with_context(|| format!("reading queue {queue}"))?;
            let mut failed_all = HashSet::new();
            let mut handled = HashSet::new();
            let mut result = Ok(());
            for dlq in &topics {
                let mut letters = Vec::new();
                read.each(dlq, |r| letters.push(parse(&r)));
                handled.extend(letters.iter().map(|l| l.offset));
                match run.publish(&mut sink, &mut deliveries, dlq, &letters).await {
                    Ok(failed) => failed_all.extend(failed.into_iter().map(|(_, o)| o)),
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            // Letters done leave the queue; those still failing, those of other
            // topics, and all of them on a dry run or an error go back.
            let ok = result.is_ok();
            read.settle(|offset| {
                ok && !args.dry_run && handled.contains(&offset) && !failed_all.contains(&offset)
            })
            .await
            .with_context(|| format!("recording progress on {queue}"))?;
            result?;
        }
        SinkKind::PubSub => {
            let sink_config = config.sink.pubsub_sink()?;
            let (mut sink, mut deliveries) = PubSubSink::new(sink_config.clone())?;
            for dlq in &topics {
                // The letters subscription keeps the progress: a letter
                // replayed is acknowledged, one that still fails handed back.
                let Some(read) = SubscriptionLetters::read(&sink_config, dlq, TIMEOUT)
                    .await
                    .with_context(|| format!("reading {dlq}"))?
                else {
                    continue;
                };
                let mut letters = Vec::new();
                read.each(|r| letters.push(parse(&r)));
                let published = run.publish(&mut sink, &mut deliveries, dlq, &letters).await;
                let done = |offset: i64| matches!(&published, Ok(failed) if !args.dry_run && !failed.contains(&(0, offset)));
                read.settle(done)
                    .await
                    .with_context(|| format!("recording progress on {dlq}"))?;
                published?;
            }
        }
        SinkKind::Stdout => return Err(nothing_stored()),
    }
    let (replayed, already, failing, kept, gone) =
        (run.replayed, run.already, run.failing, run.kept, run.gone);
    println_out(&format!(
        "{} {} dead letters; {failing} still failing (left in place); {kept} not replayable \
         (left in place){}{}",
        if args.dry_run {
            "would replay"
        } else {
            "replayed"
        },
        replayed.saturating_sub(already),
        if already > 0 {
            format!(
                "; {already} already stored by an earlier run (its event id within the \
                 destination's duplicate window), not stored again"
            )
        } else {
            String::new()
        },
        if gone > 0 {
            format!(
                "; {gone} pending whose entries are gone (deleted or trimmed; left pending, \
                 see the errors above)"
            )
        } else {
            String::new()
        }
    ));
    let mut wrong = Vec::new();
    if failing > 0 {
        wrong.push(format!("{failing} dead letters still fail"));
    }
    if gone > 0 {
        wrong.push(format!(
            "{gone} pending dead letters are gone from their stream"
        ));
    }
    if !wrong.is_empty() {
        bail!("{}", wrong.join("; "));
    }
    Ok(())
}

/// How many lines of a webhook dead-letter file are done after a replay that
/// started at line `done`, took the letters `taken` says (those of the named
/// topics) and saw `failed` ones still fail: the lines before the first one
/// that still fails or was not taken. A letter of another topic is never
/// passed over: a later replay of every topic sends it.
fn letters_done(
    lines: &[(u64, walbox_sink::LetterLine)],
    done: u64,
    taken: impl Fn(&walbox_sink::LetterLine) -> bool,
    failed: impl Fn(u64) -> bool,
) -> u64 {
    lines
        .iter()
        .filter(|(n, _)| *n >= done)
        .find(|(n, l)| !taken(l) || failed(*n))
        .map_or_else(
            || lines.last().map_or(done, |(n, _)| (n + 1).max(done)),
            |(n, _)| *n,
        )
}

/// Waits until the destination acknowledged the `waiting` publications sent
/// last (handing on what the sink gathers first); an error when one failed.
async fn acknowledged<S: Sink>(
    sink: &mut S,
    deliveries: &mut walbox_sink::Deliveries,
    dlq: &str,
    waiting: usize,
) -> Result<()> {
    sink.end_batch();
    for _ in 0..waiting {
        let d = tokio::time::timeout(TIMEOUT * 5, deliveries.recv())
            .await
            .context("waiting for the broker's acknowledgements")?
            .context("the producer stopped")?;
        if let Err(e) = d.result {
            bail!("{e}; nothing recorded as replayed for {dlq}, run again");
        }
    }
    Ok(())
}

/// Why there is nothing to replay with `[sink] type = "stdout"`.
fn nothing_stored() -> anyhow::Error {
    anyhow::anyhow!(
        "walbox dlq replay reads dead letters back from where they were stored, and [sink] \
         type = \"stdout\" stores none (they went to standard output with the events); set \
         [sink] type = \"kafka\", \"nats\", \"redis\", \"rabbitmq\", \"pubsub\", \"kinesis\", \
         \"sqs\" or \"webhook\" (or --sink) to replay the dead letters it stored"
    )
}

/// How long to wait for the broker while reading and publishing.
const TIMEOUT: Duration = Duration::from_secs(60);

/// One replay: the table and mappings letters are rebuilt with, and counts.
struct Run<'a> {
    sql: &'a tokio_postgres::Client,
    targets: &'a HashMap<String, Target<'a>>,
    messages: &'a HashMap<String, MessageMapper>,
    args: &'a ReplayArgs,
    /// Letters published (acknowledged), those below included.
    replayed: u64,
    /// Letters whose event the destination already held from an earlier run.
    already: u64,
    failing: u64,
    /// Letters that can never be replayed: done, and left in place.
    kept: u64,
    /// Letters pending in a Redis consumer group whose entries the stream
    /// no longer holds: left pending, and reported.
    gone: u64,
    /// Keys with a letter that still fails, in any dead-letter topic: their
    /// later letters are not published before it, so the key's events
    /// reach the destination in their order.
    held: HashSet<Vec<u8>>,
    /// Whether settling a letter removes it (a queue's or a subscription's
    /// acknowledgement): a letter that can never be replayed is then handed
    /// back with those that still fail, not removed.
    hand_back_unreplayable: bool,
}

impl Run<'_> {
    /// Replays the letters of SQS queue `dlq` round by round: a FIFO queue
    /// hands out a group's next letter once the one before it is deleted.
    /// A round with a letter that still fails (or a dry run) ends the
    /// replay of this queue: its letters go back.
    async fn queue_rounds<S: Sink>(
        &mut self,
        sink: &mut S,
        deliveries: &mut walbox_sink::Deliveries,
        read: &mut SqsLetters,
        dlq: &str,
    ) -> Result<()> {
        let dry_run = self.args.dry_run;
        while read
            .next_round()
            .await
            .with_context(|| format!("reading {dlq}"))?
            > 0
        {
            let mut letters = Vec::new();
            read.each(|r| letters.push(parse(&r)));
            // A letter that can never be replayed stays in the queue
            // (deleting it would lose it): handed back, and the replay of
            // this queue ends with the round.
            let kept: HashSet<i64> = letters
                .iter()
                .filter(|l| l.never_replayable().is_some())
                .map(|l| l.offset)
                .collect();
            let published = self.publish(sink, deliveries, dlq, &letters).await;
            let clean = kept.is_empty() && matches!(&published, Ok(failed) if failed.is_empty());
            let done = |offset: i64| {
                !kept.contains(&offset)
                    && matches!(&published, Ok(failed) if !dry_run && !failed.contains(&(0, offset)))
            };
            read.settle(done)
                .await
                .with_context(|| format!("recording progress on {dlq}"))?;
            published?;
            if !clean || dry_run {
                break;
            }
        }
        Ok(())
    }

    /// Rebuilds and publishes the letters of `dlq` (prints them on a dry run)
    /// and waits until the broker acknowledged every publication. Returns the
    /// (partition, offset) of the letters that still fail. Each event goes
    /// with the origin [`walbox_outbox::Origin::DeadLetterReplay`] naming its
    /// letter (`dlq.{dlq}.{offset}`): a destination whose ids come from the
    /// position (RabbitMQ streams) stores it under ids apart from the
    /// stream's, and drops only a copy an earlier run stored.
    async fn publish<S: Sink>(
        &mut self,
        sink: &mut S,
        deliveries: &mut walbox_sink::Deliveries,
        dlq: &str,
        letters: &[DeadLetter],
    ) -> Result<HashSet<(i32, i64)>> {
        let mut failed = HashSet::new();
        let mut sent = 0usize;
        // Sent and not yet acknowledged, and the keys among them: a key's
        // next letter waits until its last one is acknowledged, so a letter
        // the destination refuses never has a later one of its key stored
        // past it.
        let mut waiting = 0usize;
        let mut out_keys: HashSet<Vec<u8>> = HashSet::new();
        let duplicates = sink.duplicates();
        for letter in letters {
            if let Some(why) = letter.never_replayable() {
                println_out(&format!(
                    "not replayable, left in place: event {} ({dlq} offset {}:{}): {why}",
                    letter.event_id, letter.partition, letter.offset
                ));
                self.kept += 1;
                if self.hand_back_unreplayable {
                    failed.insert(letter.offset_key());
                }
                continue;
            }
            if letter.key.as_ref().is_some_and(|k| self.held.contains(k)) {
                println_out(&format!(
                    "held back: event {} ({dlq} offset {}:{}): an earlier dead letter of its \
                     key still fails, and goes first",
                    letter.event_id, letter.partition, letter.offset
                ));
                failed.insert(letter.offset_key());
                self.failing += 1;
                continue;
            }
            match rebuild(
                self.sql,
                self.targets,
                self.messages,
                letter,
                self.args.from_table,
            )
            .await
            {
                Ok(mut event) => {
                    // A copy of the letter's event: a sink whose ids come
                    // from the position (RabbitMQ streams) names it apart.
                    // A snapshot row's letter (transaction id 0 in the
                    // letter's position) keeps its place outside commit order.
                    event.origin = walbox_outbox::Origin::DeadLetterReplay {
                        letter: format!("dlq.{dlq}.{}", letter.offset).into(),
                        snapshot: (letter.position.xid == 0).then_some(letter.position.commit_lsn),
                    };
                    println_out(&format!(
                        "{} event {} to {} (from {dlq} offset {}:{})",
                        if self.args.dry_run {
                            "would publish"
                        } else {
                            "publishing"
                        },
                        letter.event_id,
                        event.topic,
                        letter.partition,
                        letter.offset
                    ));
                    if !self.args.dry_run {
                        if let Some(key) = &letter.key
                            && !out_keys.insert(key.clone())
                        {
                            acknowledged(sink, deliveries, dlq, waiting).await?;
                            waiting = 0;
                            out_keys.clear();
                            out_keys.insert(key.clone());
                        }
                        sink.send(event, sent).await?;
                        sent += 1;
                        waiting += 1;
                    }
                    self.replayed += 1;
                }
                Err(e) => {
                    println_out(&format!(
                        "still failing: event {} ({dlq} offset {}:{}): {e:#}",
                        letter.event_id, letter.partition, letter.offset
                    ));
                    failed.insert(letter.offset_key());
                    self.failing += 1;
                    self.held.extend(letter.key.clone());
                }
            }
        }
        // Every publication acknowledged before progress is recorded.
        acknowledged(sink, deliveries, dlq, waiting).await?;
        self.already += sink.duplicates() - duplicates;
        Ok(failed)
    }
}

/// The event a dead letter stands for, mapped again with the current mapping.
async fn rebuild(
    sql: &tokio_postgres::Client,
    targets: &HashMap<String, Target<'_>>,
    messages: &HashMap<String, MessageMapper>,
    letter: &DeadLetter,
    from_table: bool,
) -> Result<walbox_outbox::Event> {
    if let Some((prefix, content)) = &letter.message {
        return rebuild_message(messages, prefix, content.as_deref(), letter);
    }
    let table = match &letter.table {
        Some(t) => t.clone(),
        None if targets.len() == 1 => targets.keys().next().cloned().unwrap_or_default(),
        None => bail!("the dead letter does not name its table"),
    };
    let target = targets
        .get(&table)
        .with_context(|| format!("table {table} is not a configured outbox table"))?;
    let columns = &target.table.relation.columns;
    let row: Vec<TupleValue> = match (&letter.columns, from_table) {
        (Some(recorded), false) => columns
            .iter()
            .map(|c| match recorded.get(&c.name) {
                Some(serde_json::Value::String(s)) => TupleValue::Text(Bytes::from(s.clone())),
                _ => TupleValue::Null,
            })
            .collect(),
        _ => {
            let id_col = target.config.columns.id.as_deref().unwrap_or("id");
            let select: Vec<String> = columns
                .iter()
                .map(|c| format!("{}::text", ident(&c.name)))
                .collect();
            let row = sql
                .query_opt(
                    &format!(
                        "SELECT {} FROM {} WHERE {}::text = $1",
                        select.join(", "),
                        target.table.quoted(),
                        ident(id_col)
                    ),
                    &[&letter.event_id],
                )
                .await?
                .with_context(|| format!("the row is no longer in {table}"))?;
            (0..columns.len())
                .map(|i| match row.get::<_, Option<String>>(i) {
                    Some(s) => TupleValue::Text(Bytes::from(s)),
                    None => TupleValue::Null,
                })
                .collect()
        }
    };
    target
        .mapper
        .map(&row, letter.position)
        .map_err(|e| anyhow::anyhow!("{} ({})", e, e.class()))
}

/// The event a logical decoding message's dead letter stands for, mapped again
/// from the content it recorded with the prefix's current mapping. A message is
/// in no table: without its content in the letter there is nothing to rebuild.
fn rebuild_message(
    messages: &HashMap<String, MessageMapper>,
    prefix: &str,
    content: Option<&str>,
    letter: &DeadLetter,
) -> Result<walbox_outbox::Event> {
    let mapper = messages
        .get(prefix)
        .with_context(|| format!("prefix {prefix:?} is not a configured [[messages]] prefix"))?;
    let content = content.with_context(|| {
        format!(
            "the dead letter does not hold the message's content as text (left out as too \
             large, or not UTF-8); a message of prefix {prefix:?} is in no table to read it \
             from"
        )
    })?;
    mapper
        .map(&Bytes::from(content.to_owned()), letter.position, None)
        .map_err(|e| anyhow::anyhow!("{} ({})", e, e.class()))
}

#[allow(clippy::print_stdout)] // command output
fn println_out(line: &str) {
    println!("{line}");
}

#[cfg(test)]
mod webhook_tests {
    use super::letters_done;
    use walbox_sink::LetterLine;

    fn line(n: u64, topic: &str) -> (u64, LetterLine) {
        (
            n,
            LetterLine {
                topic: topic.into(),
                key: None,
                key_base64: None,
                headers: vec![],
                value: String::new(),
            },
        )
    }

    #[test]
    fn a_replay_of_one_topic_never_passes_over_the_letters_of_another() {
        let lines = [line(0, "a.dlq"), line(1, "b.dlq"), line(2, "a.dlq")];
        let only_a = |l: &LetterLine| l.topic == "a.dlq";
        // b's letter (line 1) was not sent: a replay of every topic must
        // still find it.
        assert_eq!(letters_done(&lines, 0, only_a, |_| false), 1);
        assert_eq!(letters_done(&lines, 0, |_| true, |_| false), 3);
        assert_eq!(letters_done(&lines, 0, |_| true, |n| n == 2), 2);
        assert_eq!(letters_done(&lines, 3, |_| true, |_| false), 3);
        assert_eq!(letters_done(&[], 5, |_| true, |_| false), 5);
    }
}
