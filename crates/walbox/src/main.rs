//! The `walbox` command line.
//!
//! `walbox inspect` shows what a logical replication slot holds for walbox without
//! consuming it: the pending transactions and changes per table, decoded with
//! `walbox-pgoutput`, and the WAL range they span. Values are never printed; only
//! tables, kinds of change, counts and positions.

mod inspect;

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
    /// Show the changes a slot holds, without consuming them.
    Inspect(inspect::Args),
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("WALBOX_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Inspect(args) => inspect::run(args).await,
    }
}
