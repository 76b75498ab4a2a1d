//! The JetStream side of the NATS tests: a cluster with the outbox table and a
//! `nats-server -js` with walbox's configuration pointing at both, the stream's
//! messages read back, and waiting for the slot to catch up.

use std::collections::{HashMap, HashSet};
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
    let env = nats_env(&pg, &toml);
    (pg, nats, db, env)
}

/// Waits until the slot has confirmed everything committed so far; fails with
/// walbox's log.
pub async fn caught_up(db: &tokio_postgres::Client, walbox: &Walbox) {
    let last = current_lsn(db).await;
    // A wait on the condition, with room for a backlog drained on a machine
    // that runs other test binaries beside this one.
    walbox_testkit::wait_until_async(
        "the slot to confirm the last commit",
        Duration::from_secs(180),
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

/// Each key's `seq` grows by one from 0 in stream order: no gap, no repeat.
pub fn assert_per_key_order_once(messages: &[Stored]) {
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut last_sequence = 0;
    for m in messages {
        assert!(m.sequence > last_sequence, "stream order");
        last_sequence = m.sequence;
        let key = m.header("walbox_key").to_owned();
        let seq = m.value["payload"]["seq"].as_i64().unwrap();
        let expected = next.entry(key.clone()).or_insert(0);
        assert_eq!(
            seq, *expected,
            "key {key}: seq {seq} where {expected} was expected"
        );
        *expected += 1;
    }
}

/// No two messages with one event id, and each carries it as `Nats-Msg-Id`.
pub fn assert_each_event_once(messages: &[Stored], ids: &HashSet<String>) {
    let mut seen = HashSet::new();
    for m in messages {
        let id = m.header("event_id");
        assert_eq!(m.header("Nats-Msg-Id"), id);
        assert!(seen.insert(id.to_owned()), "event {id} stored twice");
    }
    assert_eq!(&seen, ids, "the stream holds exactly the table's events");
}

/// Creates the operator's stream `EVENTS` on `outbox.>` with a largest message
/// size (-1: none) and a duplicate window; returns the context and its settings.
pub async fn events_stream(
    nats: &NatsServer,
    max_message_size: i32,
    duplicate_window_s: u64,
) -> (
    async_nats::jetstream::Context,
    async_nats::jetstream::stream::Config,
) {
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let config = async_nats::jetstream::stream::Config {
        name: "EVENTS".into(),
        subjects: vec!["outbox.>".into()],
        max_message_size,
        duplicate_window: Duration::from_secs(duplicate_window_s),
        ..Default::default()
    };
    js.create_stream(config.clone()).await.unwrap();
    (js, config)
}

/// Environment for `walbox` against `pg` with the configuration `toml`.
pub fn nats_env(pg: &PgCluster, toml: &str) -> Vec<(&'static str, String)> {
    vec![
        ("WALBOX_DSN", pg.conninfo("postgres")),
        ("WALBOX_SLOT", "walbox".into()),
        ("WALBOX_PUBLICATION", "walbox_outbox".into()),
        (
            "WALBOX_CHECKPOINT",
            checkpoint_path(pg).display().to_string(),
        ),
        ("WALBOX_CONFIG", config_file(pg, "walbox-nats.toml", toml)),
    ]
}
