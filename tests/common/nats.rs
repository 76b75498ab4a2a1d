//! The JetStream side of the NATS tests: a cluster with the outbox table and a
//! `nats-server -js` with walbox's configuration pointing at both, the stream's
//! messages read back, and waiting for the slot to catch up.

use std::collections::HashMap;
use std::time::Duration;

use walbox_sink::NatsSinkConfig;
use walbox_testkit::{NatsOptions, NatsServer, OUTBOX_DDL, PgCluster};

use super::{Walbox, checkpoint_path, config_file, confirmed_lsn, current_lsn};

pub const SUBJECT: &str = "outbox.order";

/// One stored message, as read back.
#[derive(Debug)]
pub struct Stored {
    pub sequence: i64,
    pub headers: HashMap<String, String>,
    pub value: serde_json::Value,
}

impl Stored {
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or_else(
            || panic!("no header {name} in {:?}", self.headers),
            String::as_str,
        )
    }
}

pub fn reader_config(nats: &NatsServer) -> NatsSinkConfig {
    NatsSinkConfig {
        servers: vec![nats.url()],
        ..NatsSinkConfig::default()
    }
}

/// Everything the stream holds of `subject`, in stream order.
pub async fn read_subject(nats: &NatsServer, subject: &str) -> Vec<Stored> {
    let mut out = Vec::new();
    let names = [
        "event_id",
        "event_type",
        "walbox_commit_lsn",
        "walbox_index",
        "walbox_xid",
        "walbox_key",
        "Nats-Msg-Id",
    ];
    walbox_sink::read_subject(
        &reader_config(nats),
        subject,
        Duration::from_secs(30),
        |r| {
            let headers = names
                .iter()
                .filter_map(|n| r.header(n).map(|v| ((*n).to_owned(), v.to_owned())))
                .collect();
            out.push(Stored {
                sequence: r.offset(),
                headers,
                value: serde_json::from_slice(r.value().unwrap_or_default())
                    .unwrap_or(serde_json::Value::Null),
            });
        },
    )
    .await
    .unwrap();
    out
}

/// A cluster with the outbox table, a JetStream server, and the environment
/// and configuration that point walbox at both.
pub async fn servers_nats(
    nats_table: &str,
) -> (
    PgCluster,
    NatsServer,
    tokio_postgres::Client,
    Vec<(&'static str, String)>,
) {
    servers_nats_with(NatsOptions::default(), nats_table).await
}

/// [`servers_nats`] with a server started with `options`.
pub async fn servers_nats_with(
    options: NatsOptions,
    nats_table: &str,
) -> (
    PgCluster,
    NatsServer,
    tokio_postgres::Client,
    Vec<(&'static str, String)>,
) {
    let pg = PgCluster::start().unwrap();
    let nats = NatsServer::start_with(options).unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let toml = format!(
        "[sink]\ntype = \"nats\"\n\n[sink.nats]\nservers = [\"{}\"]\n{nats_table}\n",
        nats.url()
    );
    let config = config_file(&pg, "walbox-nats.toml", &toml);
    let env = vec![
        ("WALBOX_DSN", pg.conninfo("postgres")),
        ("WALBOX_SLOT", "walbox".into()),
        ("WALBOX_PUBLICATION", "walbox_outbox".into()),
        (
            "WALBOX_CHECKPOINT",
            checkpoint_path(&pg).display().to_string(),
        ),
        ("WALBOX_CONFIG", config),
    ];
    (pg, nats, db, env)
}

/// Waits until the slot has confirmed everything committed so far; fails with
/// walbox's log.
pub async fn caught_up(db: &tokio_postgres::Client, walbox: &Walbox) {
    let last = current_lsn(db).await;
    walbox_testkit::wait_until_async(
        "the slot to confirm the last commit",
        Duration::from_secs(60),
        || async { (confirmed_lsn(db, "walbox").await >= last).then_some(()) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}; log:\n{}", walbox.log()));
}

pub const CREATE: &str =
    "create_stream = true\nsubjects = [\"outbox.>\"]\nduplicate_window_s = 600";

/// How often walbox logged that a session ended.
pub fn sessions_ended(walbox: &Walbox) -> usize {
    walbox.log().matches("session ended").count()
}
