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

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use redis::aio::MultiplexedConnection;
use tokio::sync::mpsc;
use walbox_outbox::Event;

pub use config::{RedisSinkConfig, shown_url};

pub use entry::{entry_id, event_entry_id, position_of};
pub use letters::StreamLetters;
pub use reader::{StreamEntry, read_stream};
use script::{Reply, Stop, Written};

use crate::kit::{self, Close, FailRest, Lifecycle, Reports, SessionTask};
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
                let writer = Writer {
                    con,
                    config: config.clone(),
                    reports: reports.clone(),
                    duplicates: Arc::clone(duplicates),
                    failed: FailRest::default(),
                    copies: HashMap::new(),
                    script: redis::Script::new(script::APPEND),
                    loaded: false,
                    chain: Chain::new(),
                };
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

/// The task that writes a session's entries, one batch per script call.
struct Writer {
    con: MultiplexedConnection,
    config: RedisSinkConfig,
    reports: Reports,
    duplicates: Arc<AtomicU64>,
    /// An entry of this session was not stored: every later one fails
    /// unsent, with this class and reason.
    failed: FailRest,
    /// What earlier runs of a replay stored, by progress hash and stream.
    copies: HashMap<(String, String), copies::Copies>,
    script: redis::Script,
    /// Whether this session loaded the script (`SCRIPT LOAD`): calls are
    /// `EVALSHA` only, since a call sent again after `NOSCRIPT` could pass
    /// the ones behind it.
    loaded: bool,
    /// The session's calls, each naming the one before it.
    chain: Chain,
}

/// The marks that chain a session's calls, per flow (the relay's events,
/// or one replay's): `<session>:<n>` for its n-th call of the flow,
/// recorded by the script in the flow's field when the call was stored
/// whole. Flows chain apart, so that a `dlq replay` run beside the relay
/// (same writer) does not break the relay's chain, nor the relay its.
struct Chain {
    session: String,
    /// Calls made so far, by the flow's field.
    calls: HashMap<String, u64>,
}

impl Chain {
    fn new() -> Self {
        Chain {
            session: format!("{:016x}", fastrand::u64(..)),
            calls: HashMap::new(),
        }
    }

    /// The field of the writer's hash holding the last mark of the flow of
    /// `replay` (none: the relay's events).
    fn field(replay: Option<&str>) -> String {
        match replay {
            None => "walbox:session".to_owned(),
            Some(name) => format!("walbox:session:{name}"),
        }
    }

    /// For the next call of the flow in `field`: the mark of the call before
    /// it (empty for the session's first of the flow, which follows
    /// nothing), and its own.
    fn next(&mut self, field: &str) -> (String, String) {
        let calls = self.calls.entry(field.to_owned()).or_insert(0);
        let before = if *calls == 0 {
            String::new()
        } else {
            format!("{}:{}", self.session, calls)
        };
        *calls += 1;
        (before, format!("{}:{}", self.session, calls))
    }
}

/// A script call's answer, once it comes.
type Answer = Pin<Box<dyn Future<Output = redis::RedisResult<redis::Value>> + Send>>;

/// A script call in flight, with its batch.
struct Call {
    batch: Vec<Item>,
    answer: Answer,
    /// When it was sent.
    sent: Instant,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Item>) {
        let cap = self.config.max_in_flight.clamp(1, BATCH_ENTRIES);
        // Events taken from the queue, not yet in a call.
        let mut waiting: VecDeque<Item> = VecDeque::new();
        let mut waiting_bytes = 0usize;
        let mut in_flight: VecDeque<Call> = VecDeque::new();
        // When the last answer came: the server has reached the oldest call
        // in flight since then, or since its sending.
        let mut answered_at = Instant::now();
        let wait = Duration::from_millis(self.config.ack_timeout_ms);
        let mut open = true;
        loop {
            while let Ok(item) = rx.try_recv() {
                waiting_bytes += item.event.size();
                waiting.push_back(item);
            }
            // A call goes out at once when none is in flight; beside others
            // only with a whole batch, so that calls stay large, and never a
            // replay's: its batch may first read what earlier runs stored,
            // and the calls' timer does not run while `send` waits for that.
            while in_flight.len() < CALLS_IN_FLIGHT
                && !waiting.is_empty()
                && (in_flight.is_empty()
                    || (waiting.front().is_some_and(|i| i.replay.is_none())
                        && (waiting.len() >= cap || waiting_bytes >= BATCH_BYTES)))
            {
                let batch = cut_batch(&mut waiting, &mut waiting_bytes, cap);
                if let Some((class, reason)) = self.failed.get() {
                    for item in batch {
                        self.report(&item, Err((class, reason.clone())));
                    }
                    continue;
                }
                if let Some(call) = self.send(batch).await {
                    in_flight.push_back(call);
                }
            }
            if !open && waiting.is_empty() && in_flight.is_empty() {
                break;
            }
            let due = in_flight.front().map(|c| c.sent.max(answered_at) + wait);
            tokio::select! {
                biased;
                answer = async { (&mut in_flight.front_mut().expect("checked").answer).await },
                    if !in_flight.is_empty() =>
                {
                    let call = in_flight.pop_front().expect("checked");
                    answered_at = Instant::now();
                    self.answered(call.batch, answer);
                }
                () = tokio::time::sleep_until(due.unwrap_or(answered_at)), if due.is_some() => {
                    // The server reached the call and has not answered it in
                    // time; what it does with it, and with the calls after it,
                    // is found out when walbox writes again. Those fail now,
                    // whatever their answers would say.
                    let call = in_flight.pop_front().expect("checked");
                    let cause = format!(
                        "no answer within {} ms of the server reaching it",
                        self.config.ack_timeout_ms
                    );
                    self.unanswered(call.batch, DeliveryClass::Timeout, &cause);
                    let failed = self.failed.get().expect("set by unanswered");
                    for call in in_flight.drain(..) {
                        for item in call.batch {
                            self.report(&item, Err(failed.clone()));
                        }
                    }
                }
                item = rx.recv(), if open => match item {
                    Some(item) => {
                        waiting_bytes += item.event.size();
                        waiting.push_back(item);
                    }
                    None => open = false,
                },
            }
        }
    }

    /// Sends `batch` as one script call (after what it needs read first in a
    /// replay); `None` when nothing was sent (every entry refused alone, or
    /// the batch failed).
    async fn send(&mut self, batch: Vec<Item>) -> Option<Call> {
        let writer = self.config.writer_name().to_owned();
        // An entry with more fields than one XADD can take is refused alone
        // (it goes to a dead letter), as a key of another type is.
        let (batch, wide): (Vec<Item>, Vec<Item>) = batch.into_iter().partition(|item| {
            let e = &item.event;
            let trim = trim_args(&self.config, e).len();
            let fields = entry::field_count(e, item.replay.is_some());
            3 + trim + 2 * fields <= MAX_XADD_ARGS
        });
        for item in wide {
            let reason = format!(
                "event {} has {} headers: its entry would have more fields than one XADD \
                 in walbox's script can take (at most {} arguments)",
                item.event.event_id,
                item.event.headers.len(),
                MAX_XADD_ARGS
            );
            self.report(&item, Err((DeliveryClass::MessageTooLarge, reason)));
        }
        if batch.is_empty() {
            return None;
        }
        if !self.loaded {
            if let Err(e) = self.script.load_async(&mut self.con).await {
                self.unanswered_error(batch, &e);
                return None;
            }
            self.loaded = true;
        }
        // One batch belongs to one replay or none (`cut_batch` cuts there).
        let progress = batch
            .first()
            .and_then(|i| i.replay.as_deref())
            .map_or_else(String::new, |name| replay_progress_key(&writer, name));
        // For an event at or below what an earlier run of its replay
        // appended: the entry that held its copy, if any.
        let mut held = Vec::with_capacity(batch.len());
        for item in &batch {
            match &item.replay {
                Some(name) => match self.copy_of(&progress, name, &writer, &item.event).await {
                    Ok(copy) => held.push(copy),
                    Err(e) => {
                        self.unanswered_error(batch, &e);
                        return None;
                    }
                },
                None => held.push(String::new()),
            }
        }
        let field = Chain::field(batch.first().and_then(|i| i.replay.as_deref()));
        let (before, mark) = self.chain.next(&field);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.script.get_hash()).arg(batch.len());
        for item in &batch {
            cmd.arg(item.event.topic.as_str());
        }
        cmd.arg(&writer)
            .arg(&progress)
            .arg(own_ids_key(&writer))
            .arg(&before)
            .arg(&mark)
            .arg(&field);
        let mut name = String::new();
        for (item, copy) in batch.iter().zip(&held) {
            let e = &item.event;
            let id = entry::event_entry_id(&e.position, &e.origin);
            let trim = trim_args(&self.config, e);
            cmd.arg(if item.replay.is_some() { "a" } else { "n" })
                .arg(e.event_id.as_str())
                .arg(copy)
                .arg(trim.len())
                .arg(entry::field_count(e, item.replay.is_some()) * 2);
            for t in &trim {
                cmd.arg(t);
            }
            cmd.arg(&id);
            entry::for_each_field(
                e,
                &writer,
                item.replay.as_deref(),
                |prefix, field, value| {
                    name.clear();
                    name.push_str(prefix);
                    name.push_str(field);
                    cmd.arg(name.as_str()).arg(value);
                },
            );
        }
        let mut con = self.con.clone();
        let mut answer: Answer =
            Box::pin(async move { cmd.query_async::<redis::Value>(&mut con).await });
        // Polled once now, so that the call is queued on the connection
        // before the next one is made: calls go out in the order sent.
        if let std::task::Poll::Ready(r) =
            std::future::poll_fn(|cx| std::task::Poll::Ready(answer.as_mut().poll(cx))).await
        {
            answer = Box::pin(std::future::ready(r));
        }
        Some(Call {
            batch,
            answer,
            sent: Instant::now(),
        })
    }

    /// What became of a call's batch, by its answer.
    fn answered(&mut self, batch: Vec<Item>, answer: redis::RedisResult<redis::Value>) {
        if let Some(failed) = self.failed.get() {
            // A call before this one failed: whatever this one did, its
            // events fail (a resend finds those it stored, as duplicates).
            for item in batch {
                self.report(&item, Err(failed.clone()));
            }
            return;
        }
        let reply = match answer {
            Ok(v) => script::parse_reply(&v).unwrap_or_else(|| Reply {
                written: Vec::new(),
                stop: Some((0, Stop::Error("an answer walbox cannot read".into()))),
            }),
            Err(e) => return self.unanswered_error(batch, &e),
        };
        let mut appended = 0usize;
        let mut items = batch.into_iter().enumerate();
        for (i, item) in items.by_ref() {
            if let Some(w) = reply.written.get(i) {
                match w {
                    Written::Stored => {}
                    Written::Duplicate => {
                        self.duplicates.fetch_add(1, Ordering::SeqCst);
                    }
                    Written::Refused(text) => {
                        self.report(&item, Err((classify(text), text.clone())));
                        continue;
                    }
                    Written::Appended(id) => {
                        appended += 1;
                        tracing::debug!(
                            stream = item.event.topic,
                            event_id = item.event.event_id,
                            id,
                            "appended after the top of the stream"
                        );
                    }
                }
                self.report(&item, Ok(()));
                continue;
            }
            let (class, reason) = match &reply.stop {
                Some((at, stop)) if *at == i => self.refusal(&item.event, stop),
                _ => (
                    DeliveryClass::BrokerError,
                    "the server's answer does not cover this entry".into(),
                ),
            };
            self.failed.after(
                class,
                format!(
                    "not sent: event {} of this session was not stored, and a later entry \
                     must not be stored before it; walbox writes again from its \
                     acknowledged position",
                    item.event.event_id
                ),
            );
            self.report(&item, Err((class, reason)));
            break;
        }
        for (_, item) in items {
            let failed = self.failed.get().expect("set above");
            self.report(&item, Err(failed));
        }
        if appended > 0 {
            tracing::info!(
                appended,
                "events whose position is below their stream's top (a retaken snapshot, a \
                 replay) appended after the top"
            );
        }
    }

    /// The batch got no answer (or what it needs could not be read): it
    /// fails, and so does every later entry of the session.
    fn unanswered_error(&mut self, batch: Vec<Item>, e: &redis::RedisError) {
        let class = if e.is_timeout() {
            DeliveryClass::Timeout
        } else {
            DeliveryClass::BrokerError
        };
        self.unanswered(batch, class, &error_text(e));
    }

    /// The batch got no answer, for `cause`: it fails with `class`, and so
    /// does every later entry of the session.
    fn unanswered(&mut self, batch: Vec<Item>, class: DeliveryClass, cause: &str) {
        let reason = format!(
            "the batch of {} entries got no answer ({cause}); whether it was stored is \
             checked when walbox writes again from its acknowledged position",
            batch.len(),
        );
        self.failed
            .after(DeliveryClass::BrokerError, reason.clone());
        for item in batch {
            self.report(&item, Err((class, reason.clone())));
        }
    }

    /// The entry that held the copy of `event` an earlier run of replay
    /// `name` (progress hash `progress`) appended, when `event` lies at or
    /// below that replay's mark in its stream; empty otherwise. The copies
    /// are read once per session and stream, on the first such event.
    async fn copy_of(
        &mut self,
        progress: &str,
        name: &str,
        writer: &str,
        event: &Event,
    ) -> redis::RedisResult<String> {
        let stream = event.topic.as_str();
        let key = (progress.to_owned(), stream.to_owned());
        if !self.copies.contains_key(&key) {
            let p = copies::progress(&mut self.con, progress, stream).await?;
            self.copies.insert(
                key.clone(),
                copies::Copies {
                    progress: p,
                    held: None,
                },
            );
        }
        let c = self.copies.get_mut(&key).expect("inserted above");
        let Some(p) = &c.progress else {
            return Ok(String::new());
        };
        let at = entry::position_of(&entry::event_entry_id(&event.position, &event.origin));
        if at.is_none_or(|at| at > p.mark) {
            return Ok(String::new());
        }
        if c.held.is_none() {
            c.held = Some(copies::read_copies(&mut self.con, stream, p, writer, name).await?);
        }
        Ok(c.entry_of(&event.event_id).cloned().unwrap_or_default())
    }

    fn refusal(&self, event: &Event, stop: &Stop) -> (DeliveryClass, String) {
        let me = self.config.writer_name();
        match stop {
            Stop::OtherWriter {
                id,
                writer,
                event_id,
            } => (
                DeliveryClass::DuplicateId,
                format!(
                    "stream {:?} has another writer: its newest entry {id} was written by \
                     {} (event {}), not by this walbox (writer {me:?}, event {}); give each \
                     walbox its own streams (or its own sink.redis.writer if that entry is \
                     this walbox's under an earlier name)",
                    event.topic,
                    if writer.is_empty() {
                        "a writer that is no walbox".to_owned()
                    } else {
                        format!("walbox writer {writer:?}")
                    },
                    if event_id.is_empty() {
                        "id unknown"
                    } else {
                        event_id
                    },
                    event.event_id
                ),
            ),
            Stop::LastId { last, own } => (
                DeliveryClass::DuplicateId,
                format!(
                    "stream {:?} has had another writer: its last-generated-id {last} is \
                     above every id this walbox (writer {me:?}) generated there (the \
                     highest is {own}), so an entry was added there by another writer and \
                     deleted since; every later event (event {} now) would be refused at \
                     its own id and only appended after it, stored at least once instead \
                     of exactly once. Point walbox at a stream of its own (the topic \
                     template), or, once nothing else writes to it, set the stream's last \
                     id back with XSETID {} {own}",
                    event.topic, event.event_id, event.topic
                ),
            ),
            Stop::Taken {
                id,
                writer,
                event_id,
                other_key,
            } => (
                DeliveryClass::DuplicateId,
                format!(
                    "entry {id} of stream {:?} holds event {event_id:?}{} (writer {writer:?}), \
                     not event {:?} of this walbox (writer {me:?}), at the same position",
                    event.topic,
                    if *other_key { " with another key" } else { "" },
                    event.event_id
                ),
            ),
            Stop::Behind => (
                DeliveryClass::BrokerError,
                "not written: a call sent before this one in the session was not stored \
                 whole; walbox writes again from its acknowledged position"
                    .into(),
            ),
            Stop::Error(text) => (classify(text), text.clone()),
        }
    }

    fn report(&self, item: &Item, result: Result<(), (DeliveryClass, String)>) {
        let result = result.map_err(|(class, reason)| kit::failure(&item.event, class, reason));
        self.reports.report(item.token, result);
    }
}

/// The next batch from `waiting`: at most `cap` entries and about
/// [`BATCH_BYTES`] (at least one), all of one replay or of none (a batch
/// records one replay's progress).
fn cut_batch(waiting: &mut VecDeque<Item>, bytes: &mut usize, cap: usize) -> Vec<Item> {
    let mut batch: Vec<Item> = Vec::with_capacity(waiting.len().min(cap));
    let mut size = 0usize;
    while let Some(item) = waiting.front() {
        let first = batch.first();
        if first
            .is_some_and(|f| batch.len() >= cap || size >= BATCH_BYTES || item.replay != f.replay)
        {
            break;
        }
        let item = waiting.pop_front().expect("a front");
        size += item.event.size();
        batch.push(item);
    }
    *bytes = bytes.saturating_sub(size);
    batch
}

/// Whether `event` is a dead letter (it carries walbox's error class).
fn is_dead_letter(event: &Event) -> bool {
    event
        .headers
        .iter()
        .any(|(k, _)| k.as_ref() == walbox_outbox::dead_letter_header::ERROR_CLASS)
}

/// The trimming arguments of `event`'s entry: none for a dead letter, so
/// that a stream of dead letters is never trimmed (a letter trimmed away
/// before `walbox dlq replay` runs would be lost); the configured ones
/// otherwise.
fn trim_args(config: &RedisSinkConfig, event: &Event) -> Vec<String> {
    if is_dead_letter(event) {
        Vec::new()
    } else {
        config.trim_args(event.position.commit_lsn.0)
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
