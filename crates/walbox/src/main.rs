//! The `walbox` command line.
//!
//! - `walbox run`: the relay. Streams committed outbox inserts from a logical
//!   replication slot to Kafka (or stdout) and confirms the slot's position only
//!   over events the sink has acknowledged.
//! - `walbox setup`: creates the publication and the slot, idempotently.
//! - `walbox slot drop`: drops the slot.
//! - `walbox inspect`: what a slot holds, decoded, without consuming it.
//!
//! Configuration comes from a TOML file, `WALBOX_*` variables and flags
//! ([`config`]). Row values are never logged.

mod admin;
mod config;
mod inspect;
mod pg;
mod pg_tls;
mod relay;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "walbox",
    version,
    about = "Transactional-outbox relay from the PostgreSQL WAL to Kafka"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Stream outbox inserts to the sink.
    Run(config::Overrides),
    /// Create the publication and the replication slot (idempotent).
    Setup(config::Overrides),
    /// Manage the replication slot.
    Slot {
        #[command(subcommand)]
        action: SlotAction,
    },
    /// Show the changes a slot holds, without consuming them.
    Inspect(inspect::Args),
}

#[derive(Debug, Subcommand)]
enum SlotAction {
    /// Drop the slot (refused while a reader holds it).
    Drop(config::Overrides),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("WALBOX_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the runtime");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(o) => relay::run(config::Config::load(&o)?).await,
            Command::Setup(o) => admin::setup(&config::Config::load(&o)?).await,
            Command::Slot {
                action: SlotAction::Drop(o),
            } => admin::drop_slot(&config::Config::load(&o)?).await,
            Command::Inspect(args) => inspect::run(args).await,
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
