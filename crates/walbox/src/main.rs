//! The `walbox` command line.
//!
//! - `walbox run`: the relay. Streams committed outbox inserts from a logical
//!   replication slot to the destination (every sink type:
//!   [`config::SinkKind::all`]) and confirms the slot's position only over
//!   events the sink has acknowledged.
//! - `walbox setup`: creates the publication and the slot, idempotently;
//!   `--snapshot` creates the slot with a snapshot and publishes the rows already
//!   in the outbox; with `snapshot.mode = "initial"` and a slot without one,
//!   `walbox run` publishes those rows first.
//! - `walbox replay --from X [--to Y]`: publishes a range again that the replay
//!   window kept (same event ids).
//! - `walbox slot create | drop | status | list`: the slot's lifecycle; `status`
//!   shows its position, the WAL it retains and its lag (`--json` for scripts).
//! - `walbox doctor`: checks a server before first use and says what to fix.
//! - `walbox inspect`: what a slot holds, decoded, without consuming it.
//! - `walbox verify`: the outbox table against what the destination holds
//!   (missing, duplicated, out-of-order events).
//! - `walbox dlq replay`: dead letters again to their destination after a fix.
//! - `walbox init`: a commented configuration for one sink type ([`init`]).
//!
//! Configuration comes from a TOML file, `WALBOX_*` variables and flags
//! ([`config`]). Row values are never logged.

mod admin;
mod alloc_count;
mod catalog;
mod config;
mod dlq;
mod doctor;
mod failover;
mod init;
mod inspect;
mod metrics;
mod pg;
mod privileges;
mod publication;
mod redact;
mod relay;
mod slot;
mod snapshot;
mod usage_error;
mod verify;

/// jemalloc instead of glibc's malloc, for Rust and for the C libraries in the
/// process alike (librdkafka copies every record and header with `malloc`). The
/// sinks' clients allocate and free several small buffers per event, some on
/// other threads than the ones that allocated them; with glibc that cost a
/// fifth to a third of the CPU (arena locks, consolidation), jemalloc's thread
/// caches take most of it away (docs/benchmarks.md, "Cost per event").
/// Settings: [`MALLOC_CONF`]. Counted for the benchmark when asked
/// (`WALBOX_COUNT_ALLOCATIONS=1`, [`alloc_count`]).
#[global_allocator]
static ALLOCATOR: alloc_count::Counting<tikv_jemallocator::Jemalloc> =
    alloc_count::Counting(tikv_jemallocator::Jemalloc);

/// jemalloc's settings, read when it starts (`MALLOC_CONF` in the environment
/// still overrides them): one arena, as walbox's work runs on one
/// runtime thread and the sinks' few threads, where the default (four per core)
/// only spreads memory over more arenas; freed pages returned after half a
/// second instead of ten, so that memory a burst took goes back soon after
/// (peak RSS stays under 64 MB in every benchmark scenario).
// jemalloc finds the setting by this symbol's name.
#[allow(unsafe_code)]
#[unsafe(export_name = "malloc_conf")]
pub static MALLOC_CONF: &[u8; 46] = b"narenas:1,dirty_decay_ms:500,muzzy_decay_ms:0\0";

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "walbox", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Stream outbox inserts to the destination the configuration names.
    Run(RunArgs),
    /// Create the publication and the replication slot (idempotent); with
    /// snapshot.mode = "initial", `run` then publishes the rows already in the
    /// outbox first (a snapshot from a temporary slot).
    Setup(SetupArgs),
    /// Publish again the outbox events committed in a range the replay window
    /// still holds (same event ids); the slot must not be in use.
    Replay(ReplayArgs),
    /// Manage the replication slot.
    Slot {
        #[command(subcommand)]
        action: SlotAction,
    },
    /// Check the PostgreSQL server and the destination before first use and say
    /// what to fix.
    Doctor(DoctorArgs),
    /// Show the changes a slot holds, without consuming them.
    Inspect(inspect::Args),
    /// Audit the outbox table against what the destination holds: missing,
    /// duplicated and out-of-order events (not for type = webhook: a receiver
    /// keeps nothing walbox can read back).
    Verify(verify::Args),
    /// Write a commented configuration for one sink type: every key it takes,
    /// its default and what it means (never over an existing file).
    Init(init::Args),
    /// Dead letters: where the destination keeps them (a topic, subject,
    /// stream or queue; a file for type = webhook).
    Dlq {
        #[command(subcommand)]
        action: DlqAction,
    },
}

#[derive(Debug, Subcommand)]
enum SlotAction {
    /// Create the slot (pgoutput), if it does not exist.
    Create(config::Overrides),
    /// Drop the slot (refused while a reader holds it).
    Drop(config::Overrides),
    /// Show the slot: position, WAL it retains, lag, publication tables.
    Status(SlotShow),
    /// List every logical slot of the server.
    List(SlotShow),
}

#[derive(Debug, Subcommand)]
enum DlqAction {
    /// Publish dead letters again to where they were meant for, after the cause
    /// was fixed; nothing is deleted from where the dead letters are kept.
    Replay(dlq::ReplayArgs),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    #[command(flatten)]
    overrides: config::Overrides,
    /// Start at this LSN (X/Y) instead of the checkpoint; it must not be before
    /// the slot's confirmed position, nor after the checkpoint (without one,
    /// the slot's position) unless --accept-skip.
    #[arg(long, value_name = "LSN")]
    from_lsn: Option<walbox_pgoutput::Lsn>,
    /// Start at --from-lsn even though it is after the checkpoint (without one,
    /// after the slot's position): accept that the events in between are not
    /// published by walbox.
    #[arg(long, requires = "from_lsn")]
    accept_skip: bool,
    /// If another reader holds the slot, wait and take over when it ends.
    #[arg(long)]
    wait_for_slot: bool,
    /// Start at the slot's position even though it is ahead of the checkpoint:
    /// accept that the events in between are not published by walbox.
    #[arg(long)]
    accept_slot_position: bool,
    /// Start although the server's WAL ends before walbox's checkpoint (a server
    /// restored from an older copy, or a standby promoted before it had
    /// everything): accept that transactions it commits below the checkpoint are
    /// not published.
    #[arg(long)]
    accept_wal_behind: bool,
}

#[derive(Debug, clap::Args)]
struct DoctorArgs {
    #[command(flatten)]
    overrides: config::Overrides,
    /// Also check this standby (connection string) for taking over with the
    /// slot after a failover: slot synchronization, and the primary waiting for it.
    #[arg(
        long,
        value_name = "DSN",
        env = "WALBOX_STANDBY_DSN",
        hide_env_values = true
    )]
    standby: Option<config::Secret>,
}

#[derive(Debug, clap::Args)]
struct SetupArgs {
    #[command(flatten)]
    overrides: config::Overrides,
    /// Create the slot with a snapshot and publish the rows already in the outbox
    /// (those matching --snapshot-where); `walbox run` then streams from there.
    #[arg(long)]
    snapshot: bool,
}

#[derive(Debug, clap::Args)]
struct ReplayArgs {
    #[command(flatten)]
    overrides: config::Overrides,
    /// First position (X/Y): transactions committing at or after it.
    #[arg(long, value_name = "LSN")]
    from: walbox_pgoutput::Lsn,
    /// Last position (X/Y), default the checkpoint: transactions committing before it.
    #[arg(long, value_name = "LSN")]
    to: Option<walbox_pgoutput::Lsn>,
}

#[derive(Debug, clap::Args)]
struct SlotShow {
    #[command(flatten)]
    overrides: config::Overrides,
    /// Print JSON, for scripts.
    #[arg(long)]
    json: bool,
}

/// The command line with every environment variable's value hidden from help
/// (`WALBOX_DSN` holds a password), in every command, also ones added later.
fn command_line() -> clap::Command {
    fn hide(cmd: clap::Command) -> clap::Command {
        cmd.mut_args(|a| a.hide_env_values(true))
            .mut_subcommands(hide)
    }
    hide(Cli::command().about(about()).long_about(long_about()))
}

/// The destinations in one phrase, from every sink type the configuration
/// accepts: "Kafka, NATS JetStream, ... or standard output (stdout)".
fn destinations() -> String {
    // Standard output, for a look at the events, last.
    let mut kinds = config::SinkKind::all().to_vec();
    kinds.sort_by_key(|k| *k == config::SinkKind::Stdout);
    let names: Vec<&str> = kinds.iter().map(|k| k.destination()).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => names.concat(),
    }
}

/// The one-line description: every destination.
fn about() -> String {
    format!(
        "Transactional-outbox relay from the PostgreSQL WAL to {}",
        destinations()
    )
}

/// `--help`'s description: every destination, and what "topic" means at each.
fn long_about() -> String {
    let topics: Vec<String> = config::SinkKind::all()
        .iter()
        .map(|k| format!("  {:<9} {}", k.name(), k.topic_names()))
        .collect();
    format!(
        "{}.\n\nEach outbox table's topic template names where an event goes; the \
         commands' \"topic\" is, by sink type ([sink] type, --sink):\n{}\n\n\
         Start with `walbox init --sink TYPE`, then `walbox doctor`, `walbox setup` \
         and `walbox run`.",
        about(),
        topics.join("\n")
    )
}

impl Cli {
    /// The configuration file the command names, if any.
    fn config_file(&self) -> Option<&std::path::Path> {
        let o = match &self.command {
            Command::Run(a) => &a.overrides,
            Command::Setup(a) => &a.overrides,
            Command::Replay(a) => &a.overrides,
            Command::Slot { action } => match action {
                SlotAction::Create(o) | SlotAction::Drop(o) => o,
                SlotAction::Status(s) | SlotAction::List(s) => &s.overrides,
            },
            Command::Doctor(d) => &d.overrides,
            Command::Inspect(_) | Command::Verify(_) | Command::Dlq { .. } | Command::Init(_) => {
                return None;
            }
        };
        o.config.as_deref()
    }
}

/// Log lines to stderr, as text or (`WALBOX_LOG_FORMAT=json`, `[log] format`)
/// one JSON object per line with the same fields; every secret the
/// configuration holds is replaced in them ([`redact`]).
fn init_logging(format: config::LogFormat) {
    let filter = log_filter(std::env::var("WALBOX_LOG").ok().as_deref());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(redact::RedactedStderr);
    match format {
        config::LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        config::LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
    }
}

/// The worker threads `WALBOX_WORKER_THREADS` asks the streaming commands to
/// run on: unset, empty or 0 is one thread (`None`), the default.
fn worker_threads(value: Option<&str>) -> Result<Option<usize>, String> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    match v.parse::<usize>() {
        Ok(0) => Ok(None),
        Ok(n) if n <= 64 => Ok(Some(n)),
        _ => Err(format!(
            "WALBOX_WORKER_THREADS must be a whole number from 0 to 64 (0: the streaming \
             commands run on one thread, the default), not {v:?}"
        )),
    }
}

/// The log filter `WALBOX_LOG` asks for (`info` when unset or invalid), with
/// tokio-postgres held at `info` unless the filter names it: at `debug` it logs
/// every statement's parameters, which are row values (the snapshot's keyset
/// bounds, for one); lapin likewise (its frames carry message bodies).
fn log_filter(spec: Option<&str>) -> tracing_subscriber::EnvFilter {
    let spec = spec.unwrap_or("info");
    let filter = tracing_subscriber::EnvFilter::try_new(spec)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let filter = if spec.contains("tokio_postgres") {
        filter
    } else {
        filter.add_directive("tokio_postgres=info".parse().expect("a valid directive"))
    };
    // lapin logs every frame at trace (message bodies included) and a
    // returned message whole at warn; walbox logs the return itself, by
    // event id.
    if spec.contains("lapin") {
        filter
    } else {
        filter
            .add_directive("lapin=info".parse().expect("a valid directive"))
            .add_directive(
                "lapin::returned_messages=error"
                    .parse()
                    .expect("a valid directive"),
            )
    }
}

/// The arguments as text, for finding an argument's position.
fn lossy(argv: &[std::ffi::OsString]) -> Vec<String> {
    argv.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

fn main() -> std::process::ExitCode {
    alloc_count::start_if_asked();
    // One rustls provider for every TLS client in the process (see the function).
    walbox_sink::install_crypto_provider();
    let argv_os: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cmd = command_line();
    let parsed = cmd
        .clone()
        .try_get_matches_from(&argv_os)
        .and_then(|m| Cli::from_arg_matches(&m));
    let cli = match parsed {
        Ok(cli) => cli,
        // clap's message would quote the argument, which may be a password.
        Err(e) => match usage_error::message(&cmd, &e, &lossy(&argv_os)) {
            Some(message) => {
                use std::io::Write as _;
                // Nothing to do when stderr is gone; the exit code tells.
                let _ = writeln!(std::io::stderr(), "{message}");
                return std::process::ExitCode::from(2);
            }
            None => e.exit(),
        },
    };
    let format = config::log_format(cli.config_file());
    init_logging(*format.as_ref().unwrap_or(&config::LogFormat::Text));
    if let Err(e) = format {
        tracing::error!("{e:#}");
        return std::process::ExitCode::FAILURE;
    }
    // The streaming commands run on one thread: the replication reader, the
    // relay and the SQL connections hand work to each other for every event, and
    // on one thread a hand-off is a queue push instead of a thread wakeup. The
    // producer, the checkpoint writer and the stdout writer have threads of their
    // own. The audit commands read topics with blocking calls and get workers.
    let streaming = matches!(
        cli.command,
        Command::Run(_) | Command::Setup(_) | Command::Replay(_)
    );
    // WALBOX_WORKER_THREADS=N runs them on N worker threads instead, for
    // measuring one against the other on a given machine.
    let workers = match worker_threads(std::env::var("WALBOX_WORKER_THREADS").ok().as_deref()) {
        Ok(w) => w,
        Err(e) => {
            tracing::error!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let mut builder = match (streaming, workers) {
        (true, None) => tokio::runtime::Builder::new_current_thread(),
        (true, Some(n)) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
        (false, _) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(2);
            b
        }
    };
    let runtime = match builder.enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the runtime");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(a) => {
                let options = relay::RunOptions {
                    from_lsn: a.from_lsn,
                    wait_for_slot: a.wait_for_slot,
                    accept_slot_position: a.accept_slot_position,
                    accept_wal_behind: a.accept_wal_behind,
                    accept_skip: a.accept_skip,
                    replay: false,
                };
                relay::run(config::Config::load(&a.overrides)?, options).await
            }
            Command::Setup(a) => {
                let config = config::Config::load(&a.overrides)?;
                admin::setup(&config, !a.snapshot).await?;
                // The slot holds every change from now on; with snapshot.mode =
                // "initial", `run` publishes the rows already there first.
                if config.snapshot.mode == config::SnapshotMode::Initial && !a.snapshot {
                    admin::say_run_takes_the_snapshot(&config)?;
                }
                if a.snapshot {
                    relay::setup_snapshot(&config).await?;
                }
                Ok(())
            }
            Command::Replay(a) => {
                relay::replay(&config::Config::load(&a.overrides)?, a.from, a.to).await
            }
            Command::Slot { action } => match action {
                SlotAction::Create(o) => admin::slot_create(&config::Config::load(&o)?).await,
                SlotAction::Drop(o) => admin::drop_slot(&config::Config::load(&o)?).await,
                SlotAction::Status(s) => {
                    admin::slot_status(&config::Config::load(&s.overrides)?, s.json).await
                }
                SlotAction::List(s) => {
                    admin::slot_list(&config::Config::load(&s.overrides)?, s.json).await
                }
            },
            Command::Doctor(a) => {
                doctor::run(
                    &config::Config::load(&a.overrides)?,
                    a.standby.as_ref().map(config::Secret::expose),
                )
                .await
            }
            Command::Inspect(args) => inspect::run(args).await,
            Command::Init(args) => init::run(&args),
            Command::Verify(args) => verify::run(args).await,
            Command::Dlq {
                action: DlqAction::Replay(args),
            } => dlq::replay(args).await,
        }
    });
    alloc_count::report();
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_command(cmd: &clap::Command, out: &mut Vec<clap::Command>) {
        out.push(cmd.clone());
        for sub in cmd.get_subcommands() {
            every_command(sub, out);
        }
    }

    #[test]
    fn worker_threads_takes_a_count_and_names_itself_when_wrong() {
        assert_eq!(worker_threads(None), Ok(None));
        assert_eq!(worker_threads(Some("")), Ok(None));
        assert_eq!(worker_threads(Some("0")), Ok(None));
        assert_eq!(worker_threads(Some(" 2 ")), Ok(Some(2)));
        for bad in ["two", "-1", "65", "1.5"] {
            let e = worker_threads(Some(bad)).unwrap_err();
            assert!(e.starts_with("WALBOX_WORKER_THREADS must be"), "{e}");
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn the_help_names_every_sink_type_the_configuration_accepts() {
        let kinds = config::SinkKind::all();
        assert!(kinds.len() >= 6, "{kinds:?}");
        let mut cmd = command_line();
        let help = cmd.render_long_help().to_string();
        let short = cmd.render_help().to_string();
        for &kind in kinds {
            // The configuration takes it...
            let c = config::Config::parse(
                &format!("[sink]\ntype = \"{}\"\n", kind.name()),
                std::path::Path::new("t.toml"),
            )
            .unwrap_or_else(|e| panic!("{kind:?}: {e:#}"));
            assert_eq!(c.sink.kind, kind);
            // ... and the help says so, and what a topic is there.
            assert!(short.contains(kind.destination()), "{kind:?}: {short}");
            assert!(help.contains(kind.topic_names()), "{kind:?}: {help}");
            let run = cmd
                .find_subcommand_mut("run")
                .unwrap()
                .render_long_help()
                .to_string();
            assert!(
                run.contains(&format!("- {}:", kind.name())),
                "{kind:?}: {run}"
            );
            let init = cmd
                .find_subcommand_mut("init")
                .unwrap()
                .render_long_help()
                .to_string();
            assert!(
                init.contains(&format!("- {}:", kind.name())),
                "{kind:?}: {init}"
            );
        }
        assert!(
            config::Config::parse(
                "[sink]\ntype = \"kafkaa\"\n",
                std::path::Path::new("t.toml")
            )
            .is_err()
        );
    }

    /// A help line that names one destination is about that sink type only
    /// when it says so (`type = kafka`), or names them all.
    #[test]
    fn no_help_text_speaks_of_one_destination_as_if_it_were_the_only_one() {
        let kinds = config::SinkKind::all();
        let mut all = Vec::new();
        every_command(&command_line(), &mut all);
        let mut checked = 0;
        for mut cmd in all {
            let help = cmd.render_long_help().to_string();
            for line in help.lines() {
                let trimmed = line.trim_start();
                // The --sink values and the topic list: one sink type a line,
                // by name.
                if kinds.iter().any(|k| {
                    trimmed.starts_with(&format!("- {}:", k.name()))
                        || trimmed.starts_with(&format!("{} ", k.name()))
                }) {
                    continue;
                }
                let named: Vec<_> = kinds
                    .iter()
                    .filter(|k| line.to_lowercase().contains(k.name()))
                    .collect();
                if named.is_empty() || named.len() == kinds.len() {
                    continue;
                }
                checked += 1;
                for k in named {
                    assert!(
                        line.contains(&format!("type = {}", k.name())),
                        "walbox {}: {line:?} names {} alone; say `type = {}` or name every \
                         destination",
                        cmd.get_name(),
                        k.destination(),
                        k.name()
                    );
                }
            }
        }
        assert!(checked > 0, "the rule was applied to no line");
    }

    #[test]
    fn tokio_postgres_stays_at_info_unless_named() {
        for spec in [
            None,
            Some("debug"),
            Some("trace"),
            Some("walbox=debug,debug"),
        ] {
            let f = log_filter(spec).to_string();
            assert!(f.contains("tokio_postgres=info"), "{spec:?}: {f}");
        }
        let f = log_filter(Some("debug,tokio_postgres=debug")).to_string();
        assert!(!f.contains("tokio_postgres=info"), "{f}");
    }

    #[test]
    fn every_environment_value_is_hidden_from_help() {
        let mut all = Vec::new();
        every_command(&command_line(), &mut all);
        let mut with_env = 0;
        for cmd in &all {
            for arg in cmd.get_arguments() {
                if arg.get_env().is_some() {
                    with_env += 1;
                    assert!(
                        arg.is_hide_env_values_set(),
                        "{} --{}",
                        cmd.get_name(),
                        arg.get_id()
                    );
                }
            }
        }
        assert!(with_env > 10, "{with_env} arguments read the environment");
    }
}
