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
//! reader), a line in `cells!` below, and a row in the README's table of
//! destinations and in docs/guarantees.md's (checked below against
//! [`CELLS`] and the sink types the configuration accepts).

mod common;

#[path = "conformance/destination.rs"]
mod destination;
#[path = "conformance/format.rs"]
mod format;
#[path = "conformance/history.rs"]
mod history;

use destination::{Promise, Sink};
use format::Format;

/// The cells of one sink: a module of tests named after it; [`CELLS`] lists
/// them.
macro_rules! cells {
    ($($module:ident => $sink:expr,)*) => {
        /// Every sink the suite runs, by its cells' module.
        const CELLS: &[(&str, Sink)] = &[$((stringify!($module), $sink),)*];
        $(
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
    )*
    };
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
    sqs => Sink::Sqs,
    sns => Sink::Sns,
}

/// The rows of the markdown table that follows `marker` in `text`, each its
/// cells trimmed.
fn table_after(text: &str, marker: &str) -> Vec<Vec<String>> {
    let start = text.find(marker).unwrap_or_else(|| panic!("no {marker:?}"));
    text[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|l| {
            l.trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_owned())
                .collect()
        })
        .collect()
}

fn repository_file(path: &str) -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    std::fs::read_to_string(root.join(path)).unwrap()
}

/// The sink types the configuration accepts: `walbox init --sink`'s values.
fn accepted_sink_types() -> Vec<String> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_walbox"))
        .args(["init", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    let types: Vec<String> = help
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- "))
        .filter_map(|l| l.split(':').next())
        .map(str::to_owned)
        .collect();
    assert!(types.len() >= 6, "{help}");
    types
}

/// The README's first screen names every destination as the cells check
/// it: one row per sink of the suite, its delivery as its promise (exactly
/// once, with its window, or at least once), per-key commit order, and a
/// demo command the demo runs; every sink type the configuration accepts
/// has a row; and docs/guarantees.md's table says the same.
#[test]
fn the_readme_names_every_destination_as_its_cells_check_it() {
    let readme = repository_file("README.md");
    let marker = "<!-- destinations:";
    let opening = &readme[..readme.find(marker).expect("the table's marker")];
    for word in ["Kafka", "broker", "NATS", "RabbitMQ", "Redis", "webhook"] {
        assert!(
            !opening.contains(word),
            "the README's opening speaks of {word}, not of the destination"
        );
    }
    let rows = table_after(&readme, marker);
    assert_eq!(
        rows.len(),
        CELLS.len(),
        "one row per sink of the suite: {rows:?}"
    );
    for (module, sink) in CELLS {
        let (kind, mode) = sink.sink_type();
        let type_cell = match mode {
            None => format!("`{kind}`"),
            Some(m) => format!("`{kind}`, `mode = \"{m}\"`"),
        };
        let row = rows
            .iter()
            .find(|r| r[1] == type_cell)
            .unwrap_or_else(|| panic!("{module}: no README row with type {type_cell}"));
        let delivery = &row[2];
        match sink.promise() {
            Promise::ExactlyOnce => {
                assert!(
                    delivery.starts_with("**exactly once**"),
                    "{module}: {delivery}"
                );
                if let Some(window) = sink.window() {
                    assert!(
                        delivery.contains(window),
                        "{module}: {delivery} without its window"
                    );
                } else {
                    assert!(
                        !delivery.contains("window") || delivery.contains("no time window"),
                        "{module}: {delivery}"
                    );
                }
            }
            Promise::AtLeastOnce => {
                assert!(
                    delivery.starts_with("at least once, the same"),
                    "{module}: {delivery}"
                );
                assert!(delivery.contains(" id"), "{module}: {delivery}: which id");
            }
        }
        assert!(
            row[3].starts_with("in commit order"),
            "{module}: {}",
            row[3]
        );
        let demo = if sink.demo() == "kafka" {
            "`make demo`".to_owned()
        } else {
            format!("`make demo SINK={}`", sink.demo())
        };
        assert_eq!(row[4], demo, "{module}");
        assert!(
            walbox_testkit::demo::SINKS.contains(&sink.demo()),
            "{module}"
        );
    }
    for kind in accepted_sink_types() {
        assert!(
            CELLS.iter().any(|(_, s)| s.sink_type().0 == kind),
            "sink type {kind}: the configuration accepts it, the suite has no cells of it"
        );
        assert!(
            rows.iter().any(|r| r[1].starts_with(&format!("`{kind}`"))),
            "sink type {kind}: no row in the README's table of destinations"
        );
    }

    let guarantees = repository_file("docs/guarantees.md");
    let rows = table_after(&guarantees, "## Every sink, cell by cell");
    assert_eq!(rows.len(), CELLS.len(), "{rows:?}");
    for (module, sink) in CELLS {
        let cells = format!("`conformance::{module}::*`");
        let row = rows
            .iter()
            .find(|r| r.last() == Some(&cells))
            .unwrap_or_else(|| panic!("docs/guarantees.md: no row of {cells}"));
        assert_eq!(
            row[1].starts_with("**exactly once**"),
            sink.promise() == Promise::ExactlyOnce,
            "docs/guarantees.md, {module}: {}",
            row[1]
        );
        if let Some(window) = sink.window() {
            assert!(row[1].contains(window), "{module}: {}", row[1]);
        }
    }
}
