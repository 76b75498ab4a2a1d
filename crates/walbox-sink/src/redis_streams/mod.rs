//! The Redis Streams sink: each event becomes an entry of the stream its
//! topic names, at the id its source position gives (`<commit LSN>-<index>`,
//! [`entry`]), so that a resend after a crash finds its own entry there and
//! is counted as a duplicate, without a time window. Entries are written in
//! batches by one Lua script call each ([`script`]), which stops at the first
//! entry it cannot write: a batch is stored as a prefix, never with a gap, so
//! per-key order holds in the stream. An event counts as delivered only on
//! the script's answer, which Redis sends after writing (and, with
//! `appendfsync always`, fsyncing) the append-only file.
//!
//! Up to [`CALLS_IN_FLIGHT`] calls are in flight on the session's one
//! connection, sent in order: Redis runs them in that order, and writes and
//! fsyncs what one turn of its loop ran together. Each call names the call
//! sent before it, and the script writes nothing unless that call was stored
//! whole (it records each whole call in the writer's hash): so a call that
//! stopped, failed or never ran leaves every later call of the session
//! unwritten, and the session is still stored as a prefix. A call's answer
//! is awaited `ack_timeout_ms` from when the server reaches it (from its
//! sending, or the answer to the call before it, whichever is later), so the
//! calls queued ahead of it do not count against it; when one gets none, the
//! calls behind it fail with it. A replay's calls go one at a time, since
//! one may first read what earlier runs of the replay stored.
//!
//! Histories where positions do not grow (a retaken snapshot, whose rows sit
//! at the later consistent point; `walbox replay`) put an event below the
//! stream's top. Its own id is then empty, and the entry is appended after
//! the top instead, at an odd milliseconds part (`<top ms, made odd>-*`):
//! positions are WAL record LSNs, which are even, so no event written later
//! at its own id (the rest of the transaction at the top) finds its id taken
//! by an appended one. Stored, at least once for those events (a resend of
//! one after a crash is appended again). A replay always appends
//! (events of origin [`walbox_outbox::Origin::Replay`]): its point is to store the events again; a run of
//! the same replay again after a kill counts an event as a duplicate only
//! when the stream holds its copy from an earlier run ([`copies`]: the
//! replay's progress per stream is kept in a hash of its own, and the copies
//! are read back once per session), so an event the earlier run never wrote
//! (of a table or prefix added since) is stored.
//!
//! Trimming (`maxlen`, `minid_behind_bytes`) applies to the entries of
//! events, never to those of dead letters: a stream of dead letters
//! (`{topic}.dlq`) is never trimmed, so no letter goes before `walbox dlq
//! replay` reads it.
//!
//! Every entry names its writer (`walbox_writer`, the slot by default); the
//! first entry a batch writes to a stream checks that the stream's newest
//! entry is this writer's, so a second writer on the stream stops walbox
//! ([`DeliveryClass::DuplicateId`]), naming both. It also checks that the
//! stream's last-generated-id is no higher than the highest id this writer
//! generated there (recorded per stream in the hash `walbox:ids:<writer>`):
//! an entry another writer added and deleted leaves it higher, which would
//! put every later position below the top (each event appended, at least
//! once); walbox stops instead, naming the stream, the id and what to do.

mod config;
mod copies;
pub(crate) mod entry;
mod letters;
mod reader;
mod script;
mod writer;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tokio::sync::mpsc;
use walbox_outbox::Event;

pub use config::{RedisSinkConfig, shown_url};

pub use entry::{entry_id, event_entry_id, position_of};
pub use letters::StreamLetters;
pub use reader::{StreamEntry, read_stream};
use writer::Writer;

use crate::kit::{Close, Lifecycle, Reports, SessionTask};
use crate::{Deliveries, DeliveryClass, Sink, SinkError};

/// Most bytes of values and fields in one script call (at least one event).
const BATCH_BYTES: usize = 8 << 20;
/// Most entries in one script call: a script holds the server while it runs,
/// so calls stay short.
const BATCH_ENTRIES: usize = 1_000;

/// Most script calls in flight on a session's connection. Another call is
/// sent while one is in flight only when a whole batch waits, so a trickle
/// of events still goes one call at a time, at once.
const CALLS_IN_FLIGHT: usize = 4;

/// Most arguments of one XADD the script makes: Lua unpacks at most about
/// 8,000 values into a call ("too many results to unpack"), and that error
/// would fail the whole script call, in every session again.
const MAX_XADD_ARGS: usize = 7_900;

/// One event on its way.
struct Item {
    event: Event,
    token: usize,
    /// The replay it belongs to, if any (its event's origin's
    /// [`walbox_outbox::Origin::replay_name`]).
    replay: Option<String>,
}

/// A connected session: its writer task (which holds the connection) and
/// the queue into it.
struct Session {
    queue: mpsc::UnboundedSender<Item>,
    _writer: SessionTask,
}

// Closed at once, by dropping: nothing more of the session goes out.
impl Close for Session {}

/// Writes events to Redis streams, one stream per topic.
pub struct RedisSink {
    config: RedisSinkConfig,
    session: Lifecycle<Session>,
    reports: Reports,
    duplicates: Arc<AtomicU64>,
    durability_checked: bool,
}

impl std::fmt::Debug for RedisSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSink")
            .field("url", &shown_url(&self.config.url))
            .field("writer", &self.config.writer_name())
            .finish_non_exhaustive()
    }
}

/// Connects with `config`'s settings; refused credentials are final.
pub(crate) async fn connect(config: &RedisSinkConfig) -> Result<MultiplexedConnection, SinkError> {
    connect_behind(config, 0).await
}

/// Connects for a session that keeps up to `behind` script calls in flight
/// ahead of a request ([`RedisSinkConfig::connection_config`]).
async fn connect_behind(
    config: &RedisSinkConfig,
    behind: usize,
) -> Result<MultiplexedConnection, SinkError> {
    let client = config.client()?;
    client
        .get_multiplexed_async_connection_with_config(&config.connection_config(behind))
        .await
        .map_err(|e| connect_error(&e, config))
}

fn connect_error(e: &redis::RedisError, config: &RedisSinkConfig) -> SinkError {
    let text = error_text(e);
    if e.kind() == redis::ErrorKind::AuthenticationFailed
        || text.contains("WRONGPASS")
        || text.contains("NOAUTH")
    {
        SinkError::RedisAuthentication {
            user: config
                .username
                .clone()
                .or_else(|| {
                    redis::IntoConnectionInfo::into_connection_info(config.url.as_str())
                        .ok()?
                        .redis_settings()
                        .username()
                        .map(str::to_owned)
                })
                .unwrap_or_else(|| "default".into()),
            reason: text,
        }
    } else {
        SinkError::Redis(format!("connecting to {}: {text}", shown_url(&config.url)))
    }
}

/// An error's text: its kind, code and the server's words (never the
/// connection's settings).
fn error_text(e: &redis::RedisError) -> String {
    let mut t = e.to_string();
    if t.is_empty() {
        t = format!("{:?}", e.kind());
    }
    t
}

impl RedisSink {
    /// A sink with these settings; it connects on its first event. Returns the
    /// sink and the receiver of its deliveries.
    pub fn new(config: RedisSinkConfig) -> Result<(Self, Deliveries), SinkError> {
        crate::install_crypto_provider();
        config.validate()?;
        let (reports, rx) = Reports::new();
        Ok((
            RedisSink {
                config,
                session: Lifecycle::default(),
                reports,
                duplicates: Arc::new(AtomicU64::new(0)),
                durability_checked: false,
            },
            rx,
        ))
    }

    async fn session(&mut self) -> Result<&Session, SinkError> {
        self.reports.check()?;
        let config = &self.config;
        let reports = &self.reports;
        let duplicates = &self.duplicates;
        let checked = &mut self.durability_checked;
        let session = self
            .session
            .open_with(|| async {
                let mut con = connect_behind(config, CALLS_IN_FLIGHT).await?;
                if !*checked {
                    check_durability(&mut con, config).await?;
                    *checked = true;
                }
                let (queue, rx) = mpsc::unbounded_channel();
                let writer = Writer::new(con, config, reports, duplicates);
                Ok(Session {
                    queue,
                    _writer: reports.spawn("Redis writer", writer.run(rx)),
                })
            })
            .await?;
        Ok(session)
    }
}

/// What a Redis server says of its durability.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Durability {
    /// `appendonly yes` and `appendfsync always`: an acknowledged entry is on
    /// disk.
    Synced,
    /// Other settings (the values of `appendonly` and `appendfsync`).
    Unsynced(String, String),
    /// `appendonly yes` and `appendfsync always`, but
    /// `no-appendfsync-on-rewrite yes`: no fsync while a background save or
    /// AOF rewrite runs.
    UnsyncedOnRewrite,
    /// The server does not let walbox read them (CONFIG GET refused), with
    /// what it said.
    Unknown(String),
}

impl Durability {
    /// What these settings mean, for a log line or a check.
    #[must_use]
    pub fn describe(&self) -> String {
        match self {
            Durability::Synced => "appendonly yes and appendfsync always: an acknowledged \
                                   event is on disk"
                .into(),
            Durability::Unsynced(aof, fsync) => format!(
                "the Redis server runs with appendonly {aof} and appendfsync {fsync}: an event \
                 it acknowledged can be lost when it crashes, after walbox moved its position \
                 past it"
            ),
            Durability::UnsyncedOnRewrite => "the Redis server runs with appendfsync always but \
                                   no-appendfsync-on-rewrite yes: while it saves or rewrites \
                                   its append-only file in the background it does not fsync, \
                                   so an event it acknowledged can be lost when it crashes, \
                                   after walbox moved its position past it"
                .into(),
            Durability::Unknown(why) => format!(
                "cannot read the server's appendonly and appendfsync (CONFIG GET: {why}): \
                 acknowledged events are durable only if Redis runs with appendonly yes and \
                 appendfsync always; make sure it does"
            ),
        }
    }
}

/// Connects and reads the server's `appendonly` and `appendfsync`.
pub async fn server_durability(config: &RedisSinkConfig) -> Result<Durability, SinkError> {
    let mut con = connect(config).await?;
    durability(&mut con, config).await
}

/// What the server says of its durability. A server that refuses the read
/// (a managed Redis without `CONFIG`) is [`Durability::Unknown`]; a read that
/// got no answer (a lost connection, no answer within `ack_timeout_ms`) is an
/// error, retried like an unreachable server: it says nothing of the server.
async fn durability(
    con: &mut MultiplexedConnection,
    config: &RedisSinkConfig,
) -> Result<Durability, SinkError> {
    let within = Duration::from_millis(config.ack_timeout_ms);
    let mut cmd = redis::cmd("CONFIG");
    cmd.arg("GET")
        .arg("appendonly")
        .arg("appendfsync")
        .arg("no-appendfsync-on-rewrite");
    let query = cmd.query_async::<HashMap<String, String>>(con);
    let unread = |why: String| {
        SinkError::Redis(format!(
            "reading the server's appendonly and appendfsync (CONFIG GET) on {}: {why}",
            shown_url(&config.url)
        ))
    };
    let read = tokio::time::timeout(within, query)
        .await
        .map_err(|_| unread(format!("no answer within {} ms", config.ack_timeout_ms)))?;
    Ok(match read {
        Ok(settings) => {
            let aof = settings.get("appendonly").cloned().unwrap_or_default();
            let fsync = settings.get("appendfsync").cloned().unwrap_or_default();
            let on_rewrite = settings
                .get("no-appendfsync-on-rewrite")
                .map_or("no", String::as_str);
            if aof == "yes" && fsync == "always" && on_rewrite != "no" {
                Durability::UnsyncedOnRewrite
            } else if aof == "yes" && fsync == "always" {
                Durability::Synced
            } else {
                Durability::Unsynced(aof, fsync)
            }
        }
        // The server refused the command for good (no CONFIG on a managed
        // Redis, an ACL without it): it will not say.
        Err(e)
            if matches!(e.kind(), redis::ErrorKind::Server(_))
                && matches!(e.retry_method(), redis::RetryMethod::NoRetry) =>
        {
            Durability::Unknown(error_text(&e))
        }
        // No answer, or a busy or loading server: nothing was learnt.
        Err(e) => return Err(unread(error_text(&e))),
    })
}

/// An acknowledged entry is on disk only with `appendonly yes`,
/// `appendfsync always` and `no-appendfsync-on-rewrite no`. Otherwise walbox refuses to start unless
/// `allow_unsynced`; a server that does not let walbox read them (a managed
/// Redis without CONFIG) is used with a warning.
async fn check_durability(
    con: &mut MultiplexedConnection,
    config: &RedisSinkConfig,
) -> Result<(), SinkError> {
    match durability(con, config).await? {
        Durability::Synced => Ok(()),
        d @ Durability::Unknown(_) => {
            tracing::warn!("{}", d.describe());
            Ok(())
        }
        d @ (Durability::Unsynced(..) | Durability::UnsyncedOnRewrite) if config.allow_unsynced => {
            tracing::warn!(
                "{}; going on (sink.redis.allow_unsynced = true)",
                d.describe()
            );
            Ok(())
        }
        d => Err(SinkError::Config(format!(
            "sink.redis: {}; set appendonly yes, appendfsync always and \
             no-appendfsync-on-rewrite no on the server (CONFIG SET, and in redis.conf), or \
             accept the loss with allow_unsynced = true",
            d.describe()
        ))),
    }
}

/// The hash in which a replay named `name` records, per stream, the position
/// of the last event it appended.
#[must_use]
pub fn replay_progress_key(writer: &str, name: &str) -> String {
    format!("walbox:replay:{writer}:{name}")
}

/// The hash in which writer `writer` records, per stream, the highest id it
/// generated there: a stream whose last-generated-id is above it had another
/// writer.
#[must_use]
pub fn own_ids_key(writer: &str) -> String {
    format!("walbox:ids:{writer}")
}

/// The class of a refusal by its error text.
#[must_use]
pub(crate) fn classify(text: &str) -> DeliveryClass {
    let code = text.split_whitespace().next().unwrap_or("");
    match code {
        "WRONGTYPE" => DeliveryClass::InvalidTopic,
        "NOPERM" => DeliveryClass::Authorization,
        "NOAUTH" | "WRONGPASS" => DeliveryClass::Authentication,
        _ if text.contains("WRONGTYPE") => DeliveryClass::InvalidTopic,
        _ => DeliveryClass::BrokerError,
    }
}

impl Sink for RedisSink {
    fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::SeqCst)
    }

    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        if self.session.aborted() {
            return Ok(());
        }
        let replay = event.origin.replay_name();
        let reports = self.reports.clone();
        let session = self.session().await?;
        let item = Item {
            event,
            token,
            replay,
        };
        reports.sent();
        if session.queue.send(item).is_err() {
            reports.withdrawn();
        }
        Ok(())
    }

    fn abort(&mut self) {
        // Nothing more is written in this session; what was queued is not
        // reported.
        self.session.abort();
    }

    async fn flush(&mut self, timeout: Duration) -> Result<(), SinkError> {
        self.session.flush(&self.reports, timeout).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_classed_by_the_servers_code() {
        assert_eq!(
            classify("WRONGTYPE Operation against a key holding the wrong kind of value"),
            DeliveryClass::InvalidTopic
        );
        assert_eq!(
            classify("NOPERM this user has no permissions to run the 'xadd' command"),
            DeliveryClass::Authorization
        );
        assert_eq!(
            classify("OOM command not allowed when used memory > 'maxmemory'."),
            DeliveryClass::BrokerError
        );
        assert!(!classify("OOM").is_final());
    }
}
