//! A session's writer: the task that cuts the queued events into batches,
//! sends each as one script call (up to [`CALLS_IN_FLIGHT`] in flight, each
//! naming the call before it), times each call from when the server reaches
//! it, and reports every event by the script's answer.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tokio::sync::mpsc;
use tokio::time::Instant;
use walbox_outbox::Event;

use super::script::{self, Reply, Stop, Written};
use super::{
    BATCH_BYTES, BATCH_ENTRIES, CALLS_IN_FLIGHT, Item, MAX_XADD_ARGS, RedisSinkConfig, classify,
    copies, entry, error_text, own_ids_key, replay_progress_key,
};
use crate::DeliveryClass;
use crate::kit::{self, AnswerTimer, FailRest, Reports};

/// The task that writes a session's entries, one batch per script call.
pub(super) struct Writer {
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
    pub(super) fn new(
        con: MultiplexedConnection,
        config: &RedisSinkConfig,
        reports: &Reports,
        duplicates: &Arc<AtomicU64>,
    ) -> Self {
        Writer {
            con,
            config: config.clone(),
            reports: reports.clone(),
            duplicates: Arc::clone(duplicates),
            failed: FailRest::default(),
            copies: HashMap::new(),
            script: redis::Script::new(script::APPEND),
            loaded: false,
            chain: Chain::new(),
        }
    }

    pub(super) async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Item>) {
        let cap = self.config.max_in_flight.clamp(1, BATCH_ENTRIES);
        // Events taken from the queue, not yet in a call.
        let mut waiting: VecDeque<Item> = VecDeque::new();
        let mut waiting_bytes = 0usize;
        let mut in_flight: VecDeque<Call> = VecDeque::new();
        // The oldest call in flight is timed from when the server reached
        // it: its sending, or the last answer if that came later.
        let mut timer = AnswerTimer::new(Duration::from_millis(self.config.ack_timeout_ms));
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
            let due = in_flight.front().map(|c| timer.due(c.sent));
            tokio::select! {
                biased;
                answer = async { (&mut in_flight.front_mut().expect("checked").answer).await },
                    if !in_flight.is_empty() =>
                {
                    let call = in_flight.pop_front().expect("checked");
                    timer.answered();
                    self.answered(call.batch, answer);
                }
                () = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {
                    // The server reached the call and has not answered it in
                    // time; what it does with it, and with the calls after it,
                    // is found out when walbox writes again. Those fail now,
                    // whatever their answers would say.
                    let call = in_flight.pop_front().expect("checked");
                    let cause = format!(
                        "no answer within {} ms of the server reaching it",
                        timer.timeout().as_millis()
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
