//! The sink contract: one suite that every sink runs. Each cell is a sink x
//! an envelope format x a history, over both sources (outbox rows and
//! transactional `[[messages]]`, alternating per key), and is checked in the
//! destination: nothing missing, each key's events first stored in commit
//! order, nothing stored twice where the sink promises exactly once, the
//! same event id and source position on every copy, and the sink's own id
//! field naming the event.
//!
//! The default profile (`make test`) runs every sink x format cell through
//! kill -9 rounds under concurrent writers and a SIGTERM restart, and each
//! other history (a broker restart, a replay run twice, dead letters then
//! `dlq replay` twice, an interrupted snapshot taken again) in one format per
//! sink, rotating so each format is seen. `WALBOX_CONFORMANCE=full` (`make
//! test-conformance`) runs every history in every format with more rounds.
//!
//! Adding a sink: implement `walbox_sink::Sink`, give it an arm in
//! `conformance/destination.rs` (its server, its `[sink]` table, its
//! reader), and a line in `every_sink!` below.

mod common;

#[path = "conformance/destination.rs"]
mod destination;
#[path = "conformance/format.rs"]
mod format;
#[path = "conformance/history.rs"]
mod history;

use destination::Sink;
use format::Format;

/// The cells of one sink: a module of tests named after it.
macro_rules! cells {
    ($($module:ident => $sink:expr,)*) => {$(
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn kill_and_restart_walbox() {
                history::kill_and_restart($sink, Format::Walbox).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn kill_and_restart_debezium() {
                history::kill_and_restart($sink, Format::Debezium).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn kill_and_restart_cloudevents_binary() {
                history::kill_and_restart($sink, Format::CloudEventsBinary).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn kill_and_restart_cloudevents_structured() {
                history::kill_and_restart($sink, Format::CloudEventsStructured).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[allow(clippy::print_stderr)] // says when the history does not apply
            async fn broker_restart() {
                if !$sink.has_server() {
                    eprintln!("{:?}: no server to restart", $sink);
                    return;
                }
                for format in history::formats_for($sink, 0) {
                    history::broker_restart($sink, format).await;
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn replay_run_twice() {
                for format in history::formats_for($sink, 1) {
                    history::replay_twice($sink, format).await;
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[allow(clippy::print_stderr)] // says when the history does not apply
            async fn dead_letters_then_dlq_replay_twice() {
                if !$sink.dead_letters_replayable() {
                    eprintln!("{:?}: dead letters are printed, not kept to replay", $sink);
                    return;
                }
                for format in history::formats_for($sink, 2) {
                    history::dead_letters_then_replay($sink, format).await;
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn interrupted_snapshot_taken_again() {
                for format in history::formats_for($sink, 3) {
                    history::interrupted_snapshot($sink, format).await;
                }
            }
        }
    )*};
}

// Every sink the suite runs: one line each.
cells! {
    kafka => Sink::Kafka,
    nats => Sink::Nats,
    rabbitmq_exchange => Sink::RabbitExchange,
    rabbitmq_stream => Sink::RabbitStream,
    redis => Sink::Redis,
    pubsub => Sink::PubSub,
    webhook => Sink::Webhook,
    stdout => Sink::Stdout,
    kinesis => Sink::Kinesis,
}
