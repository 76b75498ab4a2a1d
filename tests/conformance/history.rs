//! The histories every sink goes through, and the checks made in the
//! destination after each: nothing missing, each key's events first stored
//! in commit order, nothing stored twice where the sink promises exactly
//! once, and the same event id (and source position) on every copy.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use walbox_testkit::{OUTBOX_DDL, PgCluster};

use crate::common::{
    Walbox, caught_up, checkpoint, checkpoint_path, config_file, current_lsn, message_id,
    random_below, row_or_message, setup, wait_slot_released, walbox_cmd,
};
use crate::destination::{Copy, Destination, Promise, Sink};
use crate::format::Format;

/// How long the suite runs: `WALBOX_CONFORMANCE=full` (`make
/// test-conformance`) runs every history in every format with more kill
/// rounds; the default profile runs every sink x format cell through a kill
/// and a restart, and each other history in one format per sink.
pub fn full() -> bool {
    std::env::var("WALBOX_CONFORMANCE").is_ok_and(|v| v == "full")
}

/// The formats a history other than the kill rounds runs `sink` in: all of
/// them in the full profile, one otherwise (rotating over the sinks and
/// histories so that each format is seen).
pub fn formats_for(sink: Sink, history: usize) -> Vec<Format> {
    if full() {
        Format::ALL.to_vec()
    } else {
        vec![Format::rotated(sink as usize + history)]
    }
}

/// One cell: a sink, a format, a PostgreSQL cluster with the outbox table,
/// the destination, and walbox's environment.
pub struct Cell {
    pub sink: Sink,
    pub format: Format,
    pub dest: Destination,
    pub pg: PgCluster,
    pub db: tokio_postgres::Client,
    pub env: Vec<(&'static str, String)>,
    /// The configuration file's text, but for lines the `[sink]` table
    /// takes (at the marker).
    toml: String,
}

/// Where a cell's configuration takes lines of its `[sink]` table.
const SINK_LINES: &str = "#sink-lines\n";

impl Cell {
    /// A cell named after its sink, format and history. `extra` goes at the
    /// top of the configuration file, `sink_lines` into its `[sink]` table.
    pub async fn new(sink: Sink, format: Format, history: &str, extra: &str) -> Cell {
        let name = format!("{}_{}_{history}", sink_name(sink), format.short());
        let dest = Destination::start(sink, &name, history == "brokerrestart").await;
        let pg = PgCluster::start().expect("starting PostgreSQL");
        let db = pg.connect("postgres").await.unwrap();
        db.batch_execute(OUTBOX_DDL).await.unwrap();
        let (sink_toml, sink_env) = dest.config(&pg).await;
        let sink_toml = sink_toml.replacen('\n', &format!("\n{SINK_LINES}"), 1);
        let fmt = format.lines();
        let toml = format!(
            "{extra}\n{sink_toml}\n[[outbox]]\ntable = \"public.outbox\"\n\
             topic = \"{name}.{{aggregate_type}}\"\n{fmt}\n[[messages]]\nprefix = \"walbox\"\n\
             topic = \"{name}.{{aggregate_type}}\"\n{fmt}\n[dead_letter]\ntopic = \"{name}.dlq\"\n"
        );
        let mut env = vec![
            ("WALBOX_DSN", pg.conninfo("postgres")),
            ("WALBOX_SLOT", "walbox".into()),
            ("WALBOX_PUBLICATION", "walbox_outbox".into()),
            (
                "WALBOX_CHECKPOINT",
                checkpoint_path(&pg).display().to_string(),
            ),
            (
                "WALBOX_CONFIG",
                config_file(&pg, "walbox.toml", &toml.replace(SINK_LINES, "")),
            ),
        ];
        env.extend(sink_env);
        Cell {
            sink,
            format,
            dest,
            pg,
            db,
            env,
            toml,
        }
    }

    /// The environment of a run whose `[sink]` table takes `lines` besides.
    pub fn env_with_sink_lines(&self, lines: &str) -> Vec<(&'static str, String)> {
        let path = config_file(
            &self.pg,
            "walbox-variant.toml",
            &self.toml.replace(SINK_LINES, lines),
        );
        let mut env = self.env.clone();
        for (k, v) in &mut env {
            if *k == "WALBOX_CONFIG" {
                v.clone_from(&path);
            }
        }
        env
    }

    /// Starts `walbox run`.
    pub fn run(&self) -> Walbox {
        Walbox::spawn(&["run"], &self.env)
    }

    /// Ends a run: keeps what it printed (the stdout sink's destination).
    pub fn ended(&self, walbox: &Walbox) {
        self.dest.printed(walbox.log());
    }

    /// Waits until the checkpoint passes `after` (walbox made progress),
    /// showing walbox's log if it does not.
    pub fn wait_progress(&self, walbox: &Walbox, after: Option<walbox_pgoutput::Lsn>) {
        // Room for a destination that takes one call per key at a time
        // (Kinesis, SQS) on a machine running other test binaries.
        walbox_testkit::wait_until("the checkpoint to move", Duration::from_secs(240), || {
            checkpoint(&self.pg)
                .filter(|c| after.is_none_or(|a| c.lsn > a))
                .map(|_| ())
        })
        .unwrap_or_else(|e| panic!("{e}; log:\n{}", walbox.log()));
    }

    /// Runs walbox until the slot has confirmed everything committed, then
    /// stops it with SIGTERM.
    pub async fn drain(&self) {
        let mut walbox = self.run();
        caught_up(&self.db, &walbox).await;
        walbox.stop();
        self.ended(&walbox);
    }

    /// The events the outbox table and the writers' messages hold: id ->
    /// (key, seq).
    pub async fn expected(
        &self,
        messages: &BTreeMap<String, i64>,
    ) -> HashMap<String, (String, i64)> {
        let mut out = HashMap::new();
        for row in self
            .db
            .query(
                "SELECT id::text, aggregate_id, (payload->>'seq')::bigint FROM outbox \
                 WHERE aggregate_type = 'order'",
                &[],
            )
            .await
            .unwrap()
        {
            out.insert(row.get(0), (row.get(1), row.get(2)));
        }
        for (key, n) in messages {
            for seq in (0..*n).filter(|s| s % 2 == 0) {
                out.insert(message_id(key, seq), (key.clone(), seq));
            }
        }
        out
    }

    /// Every copy of the cell's topic, checked against `expected`; returns
    /// the number of copies per event id.
    pub async fn check(
        &self,
        expected: &HashMap<String, (String, i64)>,
        once: bool,
    ) -> HashMap<String, usize> {
        let topic = self.dest.topic();
        let copies = self.dest.read(&topic).await;
        assert!(
            copies.iter().all(|c| c.topic == topic),
            "copies of another topic"
        );
        check_copies(self.sink, self.format, &copies, expected, once)
    }
}

/// The suite's name of a sink, in cell names.
pub fn sink_name(sink: Sink) -> &'static str {
    match sink {
        Sink::Kafka => "kafka",
        Sink::Nats => "nats",
        Sink::RabbitExchange => "amqpx",
        Sink::RabbitStream => "amqps",
        Sink::Redis => "redis",
        Sink::PubSub => "pubsub",
        Sink::Webhook => "webhook",
        Sink::Stdout => "stdout",
        Sink::Kinesis => "kinesis",
        Sink::Sqs => "sqs",
        Sink::Sns => "sns",
    }
}

/// Writers committing until stopped: writer `w` on keys `w{w}-k0`..`k4`,
/// transactions of five events, each key's events alternating between a
/// transactional logical decoding message (even seq) and an outbox row (odd
/// seq), so both sources are in one order per key.
pub struct Writers {
    stop: Arc<AtomicBool>,
    handles: Vec<tokio::task::JoinHandle<BTreeMap<String, i64>>>,
}

impl Writers {
    pub async fn start(pg: &PgCluster, writers: usize) -> Writers {
        Writers::start_with(pg, writers, "w", row_or_message, 10).await
    }

    /// [`Writers::start`], a transaction every `pace_ms` per writer.
    pub async fn paced(pg: &PgCluster, writers: usize, pace_ms: u64) -> Writers {
        Writers::start_with(pg, writers, "w", row_or_message, pace_ms).await
    }

    /// [`Writers::paced`], on keys `{prefix}{w}-k{k}`.
    pub async fn paced_prefixed(
        pg: &PgCluster,
        writers: usize,
        prefix: &'static str,
        pace_ms: u64,
    ) -> Writers {
        Writers::start_with(pg, writers, prefix, row_or_message, pace_ms).await
    }

    /// Writers of outbox rows only, on keys `{prefix}{w}-k{k}`, a
    /// transaction every `pace_ms` per writer.
    pub async fn rows(
        pg: &PgCluster,
        writers: usize,
        prefix: &'static str,
        pace_ms: u64,
    ) -> Writers {
        Writers::start_with(
            pg,
            writers,
            prefix,
            |key, seq| row_sql("order", key, seq),
            pace_ms,
        )
        .await
    }

    async fn start_with(
        pg: &PgCluster,
        writers: usize,
        prefix: &'static str,
        event: fn(&str, i64) -> String,
        pace_ms: u64,
    ) -> Writers {
        let stop = Arc::new(AtomicBool::new(false));
        let mut handles = Vec::new();
        for w in 0..writers {
            let db = pg.connect("postgres").await.unwrap();
            let stop = Arc::clone(&stop);
            handles.push(tokio::spawn(async move {
                let mut seq: BTreeMap<String, i64> =
                    (0..5).map(|k| (format!("{prefix}{w}-k{k}"), 0)).collect();
                while !stop.load(Ordering::Relaxed) {
                    let mut sql = String::from("BEGIN;");
                    for k in 0..5 {
                        let key = format!("{prefix}{w}-k{k}");
                        let n = seq.get_mut(&key).unwrap();
                        sql.push_str(&event(&key, *n));
                        *n += 1;
                    }
                    sql.push_str("COMMIT;");
                    db.batch_execute(&sql).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(pace_ms)).await;
                }
                seq
            }));
        }
        Writers { stop, handles }
    }

    /// Stops them; returns each key's number of events.
    pub async fn stop(self) -> BTreeMap<String, i64> {
        self.stop.store(true, Ordering::Relaxed);
        let mut out = BTreeMap::new();
        for h in self.handles {
            out.extend(h.await.unwrap());
        }
        out
    }
}

/// An outbox insert of aggregate type `kind`.
pub fn row_sql(kind: &str, key: &str, seq: i64) -> String {
    format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('{kind}', '{key}', 'OrderPlaced', '{{\"seq\": {seq}}}');"
    )
}

/// The checks of one topic's copies. `once`: no event stored twice.
pub fn check_copies(
    sink: Sink,
    format: Format,
    copies: &[Copy],
    expected: &HashMap<String, (String, i64)>,
    once: bool,
) -> HashMap<String, usize> {
    check_copies_of(sink, format, copies, expected, |_| true, once)
}

/// [`check_copies`], where only the events of keys `required` takes must
/// all be there (the others may be missing: a destination that lost what
/// it held); every copy is checked all the same.
#[allow(clippy::print_stderr)] // prints what the cell held
pub fn check_copies_of(
    sink: Sink,
    format: Format,
    copies: &[Copy],
    expected: &HashMap<String, (String, i64)>,
    required: impl Fn(&str) -> bool,
    once: bool,
) -> HashMap<String, usize> {
    let cell = format!("{sink:?} x {format:?}");
    let mut count: HashMap<String, usize> = HashMap::new();
    let mut positions: HashMap<String, (Option<String>, Option<String>)> = HashMap::new();
    // A snapshot row's position is its snapshot's (transaction id 0): a
    // snapshot taken again gives it another; streamed copies keep theirs.
    let mut lanes: HashMap<String, i64> = HashMap::new();
    // Per key, the seqs in stored order (lane by lane: a key has one lane).
    let mut order: HashMap<String, Vec<i64>> = HashMap::new();
    let mut sorted: Vec<&Copy> = copies.iter().collect();
    sorted.sort_by_key(|c| (c.lane, c.offset));
    for c in sorted {
        let id =
            c.id.clone()
                .unwrap_or_else(|| panic!("{cell}: a copy without an event id: {c:?}"));
        if let Some(own) = &c.sink_id {
            assert!(
                own == &id
                    || own.starts_with(&format!("{id}."))
                    || own.starts_with(&format!("{id}_")),
                "{cell}: the sink's own id field {own:?} is not event {id}'s"
            );
        }
        let Some((key, seq)) = expected.get(&id) else {
            panic!("{cell}: event {id} was never written (copy {c:?})");
        };
        assert_eq!(c.key.as_deref(), Some(key.as_str()), "{cell}: key of {id}");
        assert_eq!(
            format.seq(&c.value),
            Some(*seq),
            "{cell}: the payload of {id} where {format:?} puts it: {}",
            c.value
        );
        let lane = *lanes.entry(key.clone()).or_insert(c.lane);
        assert_eq!(lane, c.lane, "{cell}: key {key} in two partitions");
        if c.position.2.as_deref() != Some("0") {
            let position = (c.position.0.clone(), c.position.1.clone());
            let first = positions
                .entry(id.clone())
                .or_insert_with(|| position.clone());
            assert_eq!(
                *first, position,
                "{cell}: copies of {id} from other source positions"
            );
        }
        let n = count.entry(id).or_default();
        *n += 1;
        if *n == 1 {
            order.entry(key.clone()).or_default().push(*seq);
        }
    }
    let missing: Vec<&String> = expected
        .iter()
        .filter(|(id, (key, _))| required(key) && !count.contains_key(*id))
        .map(|(id, _)| id)
        .collect();
    assert!(
        missing.is_empty(),
        "{cell}: {} of {} events missing, e.g. {:?}",
        missing.len(),
        expected.len(),
        &missing[..missing.len().min(5)]
    );
    for (key, seqs) in &order {
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "{cell}: key {key}'s events first stored out of commit order: {seqs:?}"
        );
    }
    if once {
        let twice: Vec<(&String, &usize)> = count.iter().filter(|(_, n)| **n > 1).collect();
        assert!(
            twice.is_empty(),
            "{cell}: {} events stored more than once where exactly once is promised, e.g. {:?}",
            twice.len(),
            &twice[..twice.len().min(5)]
        );
    }
    eprintln!(
        "{cell}: {} events, {} copies, {} stored more than once",
        expected.len(),
        copies.len(),
        count.values().filter(|n| **n > 1).count()
    );
    count
}

/// Kill -9 rounds under two concurrent writers, then a SIGTERM restart,
/// then a last run that drains: every event there, each key in order, once
/// where the sink promises it.
pub async fn kill_and_restart(sink: Sink, format: Format) {
    let rounds = if full() { 4 } else { 1 };
    let cell = Cell::new(sink, format, "kill", "").await;
    setup(&cell.env);
    // A sink that moves a key's events one round trip each gets writers it
    // can keep up with on a loaded machine.
    let writers = Writers::paced(&cell.pg, 2, sink.writer_pace_ms()).await;
    for _ in 0..rounds {
        let before = checkpoint(&cell.pg).map(|c| c.lsn);
        let mut walbox = cell.run();
        cell.wait_progress(&walbox, before);
        tokio::time::sleep(Duration::from_millis(random_below(400))).await;
        walbox.kill9();
        cell.ended(&walbox);
        wait_slot_released(&cell.db, "walbox").await;
    }
    // A restart by SIGTERM while the writers go on.
    let before = checkpoint(&cell.pg).map(|c| c.lsn);
    let mut walbox = cell.run();
    cell.wait_progress(&walbox, before);
    walbox.stop();
    cell.ended(&walbox);
    let written = writers.stop().await;
    cell.drain().await;
    let expected = cell.expected(&written).await;
    cell.check(&expected, sink.promise() == Promise::ExactlyOnce)
        .await;
    assert!(
        cell.dest.letters(&cell.pg).await.is_empty(),
        "{sink:?} x {format:?}: dead letters where every event fits"
    );
}

/// The destination's server killed -9 while walbox streams and writers
/// write, back after a while: walbox goes on by itself, nothing is lost.
#[allow(clippy::print_stderr)] // says when the history does not apply
pub async fn broker_restart(sink: Sink, format: Format) {
    if sink == Sink::Sns {
        return broker_restart_unsubscribed(format).await;
    }
    if !sink.keeps_data_across_restart() {
        return broker_restart_empty(sink, format).await;
    }
    let mut cell = Cell::new(sink, format, "brokerrestart", "").await;
    setup(&cell.env);
    let start = current_lsn(&cell.db).await;
    // Paced: what piles up while the server is away is read back in time.
    let writers = Writers::paced(&cell.pg, 2, 40).await;
    let mut walbox = cell.run();
    // Streaming in earnest: events acknowledged, not just a checkpoint.
    cell.wait_progress(&walbox, Some(start));
    cell.dest
        .restart_server(Duration::from_secs(2), || async {})
        .await;
    let restarted = current_lsn(&cell.db).await;
    cell.wait_progress(&walbox, Some(restarted));
    let written = writers.stop().await;
    caught_up(&cell.db, &walbox).await;
    walbox.stop();
    cell.ended(&walbox);
    let expected = cell.expected(&written).await;
    cell.check(&expected, sink.promise() == Promise::ExactlyOnce)
        .await;
}

/// [`broker_restart`] for a server that keeps nothing across its restart
/// (the Pub/Sub emulator): walbox notices the server is back empty,
/// creates its topic again and goes on. What it had published is gone with
/// the server; every event committed once the server is back (keys
/// `v*`) must be there, in order, and every copy of the others is checked.
async fn broker_restart_empty(sink: Sink, format: Format) {
    let mut cell = Cell::new(sink, format, "brokerrestart", "").await;
    setup(&cell.env);
    let start = current_lsn(&cell.db).await;
    let pace = sink.writer_pace_ms().max(40);
    let writers = Writers::paced(&cell.pg, 2, pace).await;
    let mut walbox = cell.run();
    cell.wait_progress(&walbox, Some(start));
    cell.dest
        .restart_server(Duration::from_secs(2), || async {})
        .await;
    let mut written = writers.stop().await;
    let after = Writers::paced_prefixed(&cell.pg, 2, "v", pace).await;
    let restarted = current_lsn(&cell.db).await;
    cell.wait_progress(&walbox, Some(restarted));
    written.extend(after.stop().await);
    caught_up(&cell.db, &walbox).await;
    walbox.stop();
    cell.ended(&walbox);
    // The Pub/Sub sink creates the topic again and sends again within its
    // session; the SQS sink's session ends on the vanished queue, and the
    // next one creates it again.
    assert!(
        walbox.log().contains("sent again")
            || walbox
                .log()
                .contains("session ended; resuming from the checkpoint"),
        "{sink:?} x {format:?}: walbox noticed the server was away; log:\n{}",
        walbox.log()
    );
    let expected = cell.expected(&written).await;
    let copies = cell.dest.read(&cell.dest.topic()).await;
    let count = check_copies_of(
        sink,
        format,
        &copies,
        &expected,
        |key| key.starts_with('v'),
        false,
    );
    assert!(count.keys().any(|id| expected[id].0.starts_with('v')));
}

/// SNS keeps nothing, subscriptions included: LocalStack killed -9 while
/// walbox publishes comes back with no topic and no subscription. walbox
/// must not publish into a topic nobody reads: it stops, naming the topic
/// and what to do. The user subscribes the consumers' queues again, as the
/// message says, and runs walbox again; every event committed from the
/// restart on (while walbox was stopped too) is then in the queue, exactly
/// once, each key in order.
async fn broker_restart_unsubscribed(format: Format) {
    let sink = Sink::Sns;
    let mut cell = Cell::new(sink, format, "brokerrestart", "").await;
    setup(&cell.env);
    let start = current_lsn(&cell.db).await;
    let pace = sink.writer_pace_ms().max(40);
    let before = Writers::paced(&cell.pg, 2, pace).await;
    let mut walbox = cell.run();
    cell.wait_progress(&walbox, Some(start));
    cell.dest
        .restart_server(Duration::from_secs(2), || async {})
        .await;
    let mut written = before.stop().await;
    // Written while walbox finds the topic gone, makes it again, and stops.
    let during = Writers::paced_prefixed(&cell.pg, 2, "v", pace).await;
    let status = walbox.wait(Duration::from_secs(240));
    let log = walbox.log();
    cell.ended(&walbox);
    assert!(
        !status.success(),
        "{sink:?} x {format:?}: walbox went on publishing to a topic without a subscription; \
         log:\n{log}"
    );
    assert!(
        log.contains("has no subscription") && log.contains("subscribe its consumers"),
        "{sink:?} x {format:?}: walbox's message says the topic has no subscription and what \
         to do; log:\n{log}"
    );
    // The recovery the message advises: the consumers' queues subscribed
    // again, then walbox run again.
    cell.dest.subscribe_again().await;
    let resumed = current_lsn(&cell.db).await;
    let mut walbox = cell.run();
    cell.wait_progress(&walbox, Some(resumed));
    written.extend(during.stop().await);
    caught_up(&cell.db, &walbox).await;
    walbox.stop();
    cell.ended(&walbox);
    let expected = cell.expected(&written).await;
    let copies = cell.dest.read(&cell.dest.topic()).await;
    let count = check_copies_of(
        sink,
        format,
        &copies,
        &expected,
        |key| key.starts_with('v'),
        true,
    );
    assert!(count.keys().any(|id| expected[id].0.starts_with('v')));
}

/// `walbox replay` of a range, then the same replay again: the range is
/// stored again once (a second copy with the same id and position), and a
/// destination that deduplicates drops the second replay's copies.
pub async fn replay_twice(sink: Sink, format: Format) {
    let cell = Cell::new(sink, format, "replay", "[source]\nreplay_window = \"1h\"\n").await;
    setup(&cell.env);
    let from = current_lsn(&cell.db).await;
    let writers = Writers::start(&cell.pg, 2).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let written = writers.stop().await;
    let end = current_lsn(&cell.db).await;
    let mut walbox = cell.run();
    walbox_testkit::wait_until_async(
        "the checkpoint to pass the writes",
        Duration::from_secs(60),
        || async { checkpoint(&cell.pg).filter(|c| c.lsn >= end).map(|_| ()) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}; log:\n{}", walbox.log()));
    walbox.stop();
    cell.ended(&walbox);
    let expected = cell.expected(&written).await;
    for run in 0..2 {
        let (code, out, err) = walbox_cmd(&["replay", "--from", &from.to_string()], &cell.env);
        assert_eq!(code, Some(0), "replay run {run}: {out}\n{err}");
        cell.dest.printed(out);
    }
    let count = cell.check(&expected, false).await;
    for (id, n) in &count {
        assert!(
            *n >= 2,
            "{sink:?} x {format:?}: event {id} not stored again by the replay"
        );
        if sink.promise() == Promise::ExactlyOnce {
            assert_eq!(
                *n, 2,
                "{sink:?} x {format:?}: event {id} stored {n} times: the second run of the same \
                 replay stored it again"
            );
        }
    }
}

/// Rows that cannot become events (a topic no destination takes) go to
/// dead letters with the reason; after the rows are fixed, `walbox dlq
/// replay --from-table` publishes them, and a second run adds nothing where
/// the destination deduplicates.
pub async fn dead_letters_then_replay(sink: Sink, format: Format) {
    let cell = Cell::new(sink, format, "dlq", "").await;
    setup(&cell.env);
    let writers = Writers::start(&cell.pg, 1).await;
    let mut poison = Vec::new();
    for i in 0..3 {
        let key = format!("poison-{i}");
        cell.db
            .batch_execute(&row_sql("bad type", &key, 0))
            .await
            .unwrap();
        poison.push(key);
    }
    let written = writers.stop().await;
    cell.drain().await;
    let letters = cell.dest.letters(&cell.pg).await;
    assert_eq!(
        letters.len(),
        3,
        "{sink:?} x {format:?}: one dead letter per poison row: {letters:?}"
    );
    for l in &letters {
        assert_eq!(
            l.header("walbox_error_class"),
            Some("invalid_topic"),
            "{sink:?} x {format:?}: the letter says why: {l:?}"
        );
    }
    cell.db
        .batch_execute(
            "UPDATE outbox SET aggregate_type = 'order' WHERE aggregate_type = 'bad type'",
        )
        .await
        .unwrap();
    let letters_topic = cell.dest.dead_letter_topic();
    // SNS's letters of every topic reach one queue: replayed together, and
    // `--dlq-topic` refused.
    let mut args = vec!["dlq", "replay", "--from-table"];
    if sink.dead_letters_by_topic() {
        args.extend(["--dlq-topic", &letters_topic]);
    }
    for run in 0..2 {
        let (code, out, err) = walbox_cmd(&args, &cell.env);
        assert_eq!(code, Some(0), "dlq replay run {run}: {out}\n{err}");
    }
    let expected = cell.expected(&written).await;
    let count = cell
        .check(&expected, sink.promise() == Promise::ExactlyOnce)
        .await;
    let fixed = expected
        .values()
        .filter(|(k, _)| k.starts_with("poison-"))
        .count();
    assert_eq!(fixed, 3);
    assert!(count.len() >= fixed);
}

/// An initial snapshot killed part way, taken again by the next run, with
/// writers writing meanwhile: every row (snapshot and stream) there, each
/// key in order, every copy with its id.
pub async fn interrupted_snapshot(sink: Sink, format: Format) {
    let cell = Cell::new(
        sink,
        format,
        "snapshot",
        "[snapshot]\nmode = \"initial\"\norder_by = [\"seq\"]\n",
    )
    .await;
    // Rows before the slot: only a snapshot brings them, in the order of
    // `seq` (their commit order).
    cell.db
        .batch_execute("ALTER TABLE outbox ADD COLUMN seq bigserial")
        .await
        .unwrap();
    let mut sql = String::from("BEGIN;");
    // Fewer rows for a sink that moves a key's events one round trip each.
    let rows_per_key = if sink.one_round_trip_per_event_of_a_key() {
        60
    } else {
        300
    };
    for seq in 0..rows_per_key {
        for k in 0..10 {
            sql.push_str(&row_sql("order", &format!("s-k{k}"), seq * 2 + 1));
        }
    }
    sql.push_str("COMMIT;");
    cell.db.batch_execute(&sql).await.unwrap();
    cell.db
        .batch_execute("CREATE PUBLICATION walbox_outbox FOR TABLE outbox")
        .await
        .unwrap();
    // Killed once part of the snapshot was handed to the sink (walbox's
    // own debug line per event: the same for every sink, and cheap to read).
    // Two events in flight at most: the snapshot is still being published
    // when the kill comes.
    let mut env = cell.env_with_sink_lines("max_in_flight = 2\n");
    env.push(("WALBOX_LOG", "info,walbox_core=debug".into()));
    let mut walbox = Walbox::spawn(&["run"], &env);
    walbox_testkit::wait_until(
        "part of the snapshot to be sent",
        Duration::from_secs(60),
        || (walbox.log().matches("sent to the sink").count() >= 20).then_some(()),
    )
    .unwrap_or_else(|e| panic!("{e}; log:\n{}", walbox.log()));
    walbox.kill9();
    cell.ended(&walbox);
    assert!(
        checkpoint(&cell.pg).is_some_and(|c| c.snapshot_interrupted()),
        "{sink:?} x {format:?}: the checkpoint says the snapshot did not finish"
    );
    wait_slot_released(&cell.db, "walbox").await;
    // Rows committed while the snapshot is taken again: the new snapshot
    // holds them, and the stream, from the slot's older point, again.
    // (Only rows: a key whose events mix rows and messages would see its
    // rows first, from the snapshot, and its messages after, from the
    // stream; see docs/guarantees.md.)
    let rows = Writers::rows(&cell.pg, 1, "r", sink.writer_pace_ms()).await;
    let mut walbox = cell.run();
    walbox_testkit::wait_until(
        "the snapshot taken again to complete",
        Duration::from_secs(90),
        || {
            checkpoint(&cell.pg)
                .and_then(|c| c.snapshot)
                .filter(|s| s.complete)
        },
    )
    .unwrap_or_else(|e| panic!("{sink:?} x {format:?}: {e}; log:\n{}", walbox.log()));
    // (The rows' ids come from the table.)
    rows.stop().await;
    // Then both sources, streamed.
    let writers = Writers::paced(&cell.pg, 1, sink.writer_pace_ms()).await;
    let at = current_lsn(&cell.db).await;
    cell.wait_progress(&walbox, Some(at));
    let written = writers.stop().await;
    caught_up(&cell.db, &walbox).await;
    walbox.stop();
    cell.ended(&walbox);
    // The snapshot's rows carry odd seqs of keys of their own; a key's seqs
    // need only grow.
    let expected = cell.expected(&written).await;
    cell.check(&expected, false).await;
}
