//! `make bench`: how fast walbox drains a backlog and one huge transaction, next to
//! how fast PostgreSQL can hand the same changes out at all, and next to the
//! polling relay it replaces.
//!
//! One machine. Rows like a real service writes them (uuid id, aggregate type, one
//! of 1,000 aggregate ids, event type, a ~300-byte jsonb payload, a headers jsonb
//! with a traceparent). The slot scenarios have these contenders
//! (`contenders.rs`):
//!
//! - `walbox-ceiling` (src/bin): walbox's replication client reading the slot
//!   and confirming every commit, nothing decoded: the ceiling, what the server
//!   hands out at no cost above the socket;
//! - `pg_recvlogical` (pgoutput, protocol 1) to /dev/null, beside it;
//! - `walbox run --sink stdout` to /dev/null: walbox without a broker;
//! - `walbox run` to the broker;
//! - `walbox run` to the broker with `--metrics-listen`, its `/metrics` scraped
//!   every 100 ms: what the metrics cost, beside the line above;
//! - `walbox run` to the broker with `WALBOX_WORKER_THREADS=2`: a runtime of
//!   two worker threads against walbox's one thread (with `--busy N`, on
//!   cores that N spinning threads want too);
//! - `walbox run` to NATS JetStream (`nats-server -js` from the test kit, a
//!   memory stream that walbox creates, deleted after each run so that the
//!   next one finds neither its messages nor their ids);
//! - `walbox run` to Redis Streams (`redis-server` from the test kit with its
//!   append-only file fsynced on every write; each run its own stream, counted
//!   and deleted after it);
//! - `walbox run` to RabbitMQ streams (stream mode, the test kit's node, a
//!   stream of the run's own that walbox creates, deleted once counted);
//! - `walbox run` to a RabbitMQ exchange (exchange mode: persistent, mandatory
//!   messages with publisher confirms), routed to a durable classic queue of
//!   the run's own that the bench binds first, counted and deleted after it.
//!
//! Each runs `--repeat` times (default 3) in rounds, the order rotating from round
//! to round, each run on its own slot created before the one load, so every run
//! drains the same WAL (`scenarios.rs`). A run is timed from its start until its
//! slot's `confirmed_flush_lsn` reaches the last commit; peak RSS (VmHWM), CPU
//! seconds and the context switches of all its threads come from /proc. walbox confirms a position only once the broker
//! (Kafka's acks or JetStream's PubAcks) acknowledged every event before it, so
//! a walbox run is done when all its events are acknowledged. The report (`report.rs`) gives each contender's median
//! and the spread (min–max) across rounds, and its ratio to the ceiling from the
//! medians, with the range of the per-round ratios. Scenarios:
//!
//! 1. Backlog drain: `--events` (default 1,000,000) in transactions of 10; then the
//!    polling relay (`polling.rs`), both variants, publishes the same rows once,
//!    with the extra WAL its UPDATEs write per event.
//! 2. Messages (`messages.rs`): the backlog's events, from the same generator,
//!    as transactional `pg_logical_emit_message` calls in transactions of 10,
//!    drained in rounds by the ceiling, by `pg_recvlogical` with `messages=true` and by walbox to the
//!    broker with a `[[messages]]` section (a publication without tables); the
//!    event size and WAL per event of both loads, each against its ceiling.
//!    Then allocations per event (`allocations.rs`): a build of walbox with a
//!    counting global allocator drains `--alloc-events` rows to the broker and
//!    to JetStream and as many messages to the broker, once each.
//! 3. One transaction of `--big-txn` rows (default 1,000,000).
//! 4. Steady load (`steady.rs`): four writers commit single-row transactions at
//!    1,000, 5,000 and 20,000 events/s for `--steady-seconds` (default 60) while
//!    walbox streams to the broker; walbox reports commit-to-acknowledgement
//!    latency (the server's commit time to the broker's acknowledgement,
//!    p50/p95/p99/max) and, of it, the commit-to-read latency (to walbox reading
//!    the transaction); the bench samples the slot's lag every second.
//!
//! 5. Webhooks (`webhook.rs`): `--webhook-events` (default 20,000) POSTed by
//!    `walbox run` to the test kit's HTTP receiver, the events spread over 1, 16
//!    and 256 keys (so as many requests in flight), one run each, each next to
//!    its ceiling: a plain client sending the same requests to the same
//!    receiver with as many in flight.
//!
//! 6. Google Cloud Pub/Sub (`pubsub.rs`): `--pubsub-events` (default 20,000)
//!    published by `walbox run` to the test kit's Pub/Sub emulator, then the
//!    same messages published by a plain client the way walbox does (one
//!    request in flight per ordering key); the ratio of their times.
//!
//! 7. AWS (`aws.rs`): `--aws-events` (default 10,000) sent by `walbox run` to
//!    Kinesis (kinesalite), SQS FIFO and SNS FIFO (LocalStack), each followed
//!    by a plain AWS SDK client sending the same messages in the same per-key
//!    order (one call per key in flight); the ratio of their times.
//!
//! A contender that writes to the broker or JetStream must have added every event
//! to it by the end of its run (`delivered.rs`), else the bench fails.
//!
//! `--only backlog,polling,messages,big-txn,steady,webhook,pubsub,aws` runs some of them and `--rates` picks
//! the steady rates; only a full run writes the charts. Figures are printed with
//! the setup they came from.

#![allow(clippy::print_stdout)] // the report is the output

mod allocations;
mod amqp;
mod aws;
mod cli;
mod cloud;
mod contenders;
mod delivered;
mod messages;
mod polling;
mod pubsub;
mod report;
mod scenarios;
mod steady;
mod svg;
mod targets;
mod webhook;

use walbox_testkit::{Broker, NatsServer, OUTBOX_DDL, PgCluster, PgOptions, RabbitMq, RedisServer};

use crate::cli::Scenario;
use crate::contenders::{Contender, MESSAGES_PUBLICATION, lsn};
use crate::scenarios::{Bench, INSERT, ROW_SELECT, backlog_load};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let Some(a) = cli::args()? else {
        return Ok(());
    };
    // A slot per contender and round, and one for the steady load.
    let slots = (a.repeat * (Contender::ALL.len() + Contender::BASELINE.len()) + 1).max(20);
    let pg = PgCluster::start_with(
        PgOptions::default()
            .setting("timezone", "UTC")
            .setting("max_wal_size", "8GB")
            .setting("shared_buffers", "256MB")
            .setting("max_replication_slots", &slots.to_string()),
    )?;
    let broker = Broker::start()?;
    let nats = NatsServer::start()?;
    let redis = RedisServer::start()?;
    let rabbitmq = RabbitMq::start()?;
    let db = pg.connect("postgres").await?;
    let version: String = lsn(&db, "SHOW server_version").await?;
    db.batch_execute(&format!(
        "{OUTBOX_DDL}; CREATE PUBLICATION walbox_outbox FOR TABLE outbox;
         CREATE PUBLICATION {MESSAGES_PUBLICATION};"
    ))
    .await?;
    let bench = Bench {
        a,
        pg,
        broker,
        nats,
        redis,
        rabbitmq,
        db,
    };
    let events = bench.a.events;
    let big = bench.a.big_txn;
    // Spinning threads, for figures of a machine whose cores are wanted by
    // something else too; they stop with the bench.
    for _ in 0..bench.a.busy {
        std::thread::spawn(|| {
            loop {
                std::hint::spin_loop();
            }
        });
    }

    let runs = |s: Scenario| bench.a.only.contains(&s);

    // 1. Backlog drain: transactions of 10 rows, committed before anyone reads;
    //    the polling relay then publishes the same rows.
    let backlog_load = backlog_load(events);
    let mut with_polling = Vec::new();
    let mut backlog_wal = 0;
    let mut plain_amqp = None;
    if runs(Scenario::Backlog) {
        println!("scenario 1: backlog of {events} events in transactions of 10");
        let drained = bench
            .drain_slots(&bench.slot_contenders(), &backlog_load, events)
            .await?;
        with_polling = drained.contenders;
        backlog_wal = drained.wal_bytes;
        if bench
            .slot_contenders()
            .contains(&Contender::WalboxRabbitMqExchange)
        {
            let mut plain = amqp::PlainAmqp {
                events,
                seconds: Vec::new(),
            };
            for round in 1..=bench.a.repeat {
                let s = amqp::publish_round(&bench.rabbitmq, events, round).await?;
                println!(
                    "round {round}/{}: plain AMQP client to the exchange, confirmed {s:.2} s",
                    bench.a.repeat
                );
                plain.seconds.push(s);
            }
            plain_amqp = Some(plain);
        }
    }
    if runs(Scenario::Polling) {
        if !runs(Scenario::Backlog) {
            println!("loading {events} events in transactions of 10 for the polling relay");
            bench.db.batch_execute(&backlog_load).await?;
        }
        // The topic walbox would have created (6 partitions, its default):
        // walbox's own runs each write a topic of their own.
        walbox_testkit::kafka::create_topic(&bench.broker.bootstrap(), "outbox.order", 6).await?;
        with_polling.extend(bench.polling(events).await?);
    }

    // 2. The same events as logical decoding messages, while the table still
    //    holds the backlog's rows (their size is measured on them).
    let mut messages = None;
    if runs(Scenario::Messages) {
        messages = Some(bench.messages(events, backlog_wal).await?);
    }

    // Allocations per event, by the counting build.
    let mut counted = Vec::new();
    if runs(Scenario::Allocations) {
        let n = bench.a.alloc_events;
        println!("allocations: {n} events per path, walbox counting its allocations");
        counted = bench.allocations(n, bench.a.counting()).await?;
    }

    // 3. One transaction of `big` rows.
    let mut one_txn = Vec::new();
    let mut one_txn_wal = 0;
    if runs(Scenario::BigTxn) {
        bench.db.batch_execute("TRUNCATE outbox").await?;
        println!("scenario 3: one transaction of {big} events");
        let drained = bench
            .drain_slots(
                &bench.slot_contenders(),
                &format!(
                    "{INSERT} {ROW_SELECT} FROM generate_series(0, {last}) n",
                    last = big - 1
                ),
                big,
            )
            .await?;
        one_txn = drained.contenders;
        one_txn_wal = drained.wal_bytes;
    }

    // 4. Steady load at fixed rates.
    let mut steady = Vec::new();
    if runs(Scenario::Steady) {
        bench.db.batch_execute("TRUNCATE outbox").await?;
        for rate in bench.a.rates.clone() {
            // Each rate starts from a quiet server: the checkpoint of what earlier
            // scenarios wrote does not land in the middle of this one.
            bench.db.batch_execute("CHECKPOINT").await?;
            println!(
                "scenario 4: {rate} events/s for {} s",
                bench.a.steady_seconds
            );
            steady.push(bench.steady(rate, bench.a.steady_seconds).await?);
        }
    }

    // 5. A backlog POSTed to a local HTTP receiver.
    let mut webhooks = Vec::new();
    if runs(Scenario::Webhook) {
        let n = bench.a.webhook_events;
        println!("scenario 5: {n} events to a webhook receiver at 1, 16 and 256 keys");
        webhooks = bench.webhook(n).await?;
    }

    // 6. A backlog published to Pub/Sub's emulator, next to a plain client.
    let mut pubsub_run = None;
    if runs(Scenario::PubSub) {
        let n = bench.a.pubsub_events;
        println!("scenario 6: {n} events to the Pub/Sub emulator, then a plain client");
        pubsub_run = Some(bench.pubsub(n).await?);
    }

    // 7. A backlog sent to each AWS stand-in, next to a plain SDK client.
    let mut aws_runs = Vec::new();
    if runs(Scenario::Aws) {
        let n = bench.a.aws_events;
        for service in aws::Service::ALL {
            println!("scenario 7: {n} events to {service:?}, then a plain SDK client");
            aws_runs.push(bench.aws(service, n).await?);
        }
    }

    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_gb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse::<f64>()
                .ok()
        })
        .map_or(0.0, |kb| kb / 1024.0 / 1024.0);
    println!();
    println!(
        "setup: {cores} cores, {mem_gb:.0} GiB RAM, PostgreSQL {version} (fsync off, one cluster), broker {}, \
         JetStream nats-server -js (memory stream), redis-server 7 (append-only file, \
         appendfsync always), \
         RabbitMQ 3.10 streams (one node, stream mode), \
         walbox {} (release){}{}; rows like a real service writes them (uuid id, one of 1,000 \
         aggregate ids, ~300-byte jsonb payload, traceparent header){}{}",
        if bench.broker.is_external() {
            "external Kafka"
        } else {
            "tansu 0.6.0 (memory storage)"
        },
        bench.a.walbox.display(),
        bench
            .a
            .baseline
            .as_ref()
            .map_or_else(String::new, |b| format!(", baseline build {}", b.display())),
        if bench.a.busy > 0 {
            format!(
                "; {} threads of the bench spinning on the CPU throughout",
                bench.a.busy
            )
        } else {
            String::new()
        },
        if runs(Scenario::Backlog) || runs(Scenario::BigTxn) {
            format!(
                "; slot contenders: {}",
                report::method(&bench.slot_contenders(), bench.a.repeat)
            )
        } else {
            String::new()
        },
        if runs(Scenario::Polling) {
            "; the polling relay: one run per variant"
        } else {
            ""
        }
    );
    let slot_contenders = bench.slot_contenders();
    let messages_contenders = bench.messages_contenders();
    let rounds = |s: Scenario| runs(s).then_some((&slot_contenders[..], bench.a.repeat));
    if !with_polling.is_empty() {
        report::print_table(
            &format!("Backlog drain: {events} events in transactions of 10"),
            events,
            backlog_wal,
            rounds(Scenario::Backlog),
            &with_polling,
        );
    }
    if let Some(m) = &messages {
        report::print_table(
            &format!("Transactional messages: {events} events in transactions of 10"),
            events,
            m.wal_bytes,
            Some((&messages_contenders[..], bench.a.repeat)),
            &m.contenders,
        );
        let backlog = if runs(Scenario::Backlog) {
            &with_polling[..]
        } else {
            &[]
        };
        messages::print_comparison(events, m, backlog);
    }
    amqp::print(
        plain_amqp.as_ref(),
        with_polling
            .iter()
            .find(|c| c.name == Contender::WalboxRabbitMqExchange.name())
            .map(|c| c.seconds().median),
    );
    allocations::print(&counted, bench.a.counting());
    if !one_txn.is_empty() {
        report::print_table(
            &format!("One transaction of {big} events"),
            big,
            one_txn_wal,
            rounds(Scenario::BigTxn),
            &one_txn,
        );
    }
    if !steady.is_empty() {
        report::print_steady(bench.a.steady_seconds, &steady);
    }
    webhook::print(&webhooks);
    pubsub::print(pubsub_run.as_ref());
    aws::print(&aws_runs);
    targets::print(&targets::Figures {
        backlog: &with_polling,
        one_txn: &one_txn,
        messages: messages.as_ref(),
        steady: &steady,
        webhooks: &webhooks,
        pubsub: pubsub_run.as_ref(),
        aws: &aws_runs,
        plain_amqp: plain_amqp.as_ref(),
    });
    // The charts compare all contenders: only a full run writes them.
    if let Some(dir) = &bench.a.svg_dir
        && bench.a.only.len() == Scenario::ALL.len()
    {
        report::write_charts(dir, events, &with_polling, &steady)?;
    }
    Ok(())
}
