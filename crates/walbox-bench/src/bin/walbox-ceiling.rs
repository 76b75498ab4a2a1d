//! The bench's true ceiling: walbox's replication client (the same
//! pgwire-replication, with the read-ahead bounds `walbox run` uses by
//! default, and the status interval the bench gives walbox) reading a slot's stream and confirming each
//! commit as soon as it arrives, with nothing decoded, mapped or sent. What the
//! server hands out, at no cost above the socket; the bench stops it (SIGTERM)
//! once the slot has confirmed the load's last commit.
//!
//! `walbox-ceiling HOST PORT USER DATABASE SLOT PUBLICATION STATUS_INTERVAL_MS`

#![allow(clippy::print_stderr)] // the only output is an error

use std::time::Duration;

use pgwire_replication::{ReplicationClient, ReplicationConfig, ReplicationEvent};

/// `walbox run`'s read-ahead: messages (relay/stream.rs `READ_AHEAD_EVENTS`)
/// and bytes (a quarter of the default `sink.max_in_flight_bytes`).
const READ_AHEAD_EVENTS: usize = 256;
const READ_AHEAD_BYTES: usize = 16 * 1024 * 1024;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main(flavor = "current_thread")] // as `walbox run` streams
async fn main() {
    if let Err(e) = drain().await {
        eprintln!("walbox-ceiling: {e}");
        std::process::exit(1);
    }
}

async fn drain() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [host, port, user, database, slot, publication, interval_ms] = args.as_slice() else {
        return Err(
            "usage: walbox-ceiling HOST PORT USER DATABASE SLOT PUBLICATION STATUS_INTERVAL_MS"
                .into(),
        );
    };
    let interval = Duration::from_millis(interval_ms.parse()?);
    let cfg = ReplicationConfig::new(host, user, "", database, slot, publication.as_str())
        .with_port(port.parse()?)
        .with_status_interval(interval)
        .with_wakeup_interval(interval)
        .with_buffer_size(READ_AHEAD_EVENTS)
        .with_buffer_bytes(READ_AHEAD_BYTES)
        .with_application_name("walbox-ceiling");
    let mut client = ReplicationClient::connect(cfg).await?;
    let mut commits = 0u64;
    while let Some(event) = client.recv().await? {
        match event {
            // The commit's end: everything up to it has been read.
            ReplicationEvent::Commit { end_lsn, .. } => {
                client.update_applied_lsn(end_lsn);
                commits += 1;
            }
            ReplicationEvent::StoppedAt { .. } => break,
            _ => {}
        }
    }
    Err(format!("the stream ended after {commits} commits").into())
}
