//! Exchange mode: AMQP 0-9-1 with lapin. One connection and one channel per
//! session, in confirm mode; each event is published to the configured
//! exchange with routing key = its topic (a dead letter's topic is already
//! `{topic}.dlq`), `mandatory`, persistent (delivery mode 2), `message_id` =
//! the event id, the record's headers as AMQP headers and the key in
//! `walbox_key` (a header name past AMQP 0-9-1's 255 bytes is never dropped
//! without a word: see [`headers_of`]). The publisher confirm is the
//! acknowledgement, reported in publish order ([`super::confirms`]); a message
//! the broker sends back (no queue took it) or nacks fails its event, which is
//! retried, never dead-lettered. Publications are started by the reporter
//! task in publish order, without waiting for each one's frames to be
//! written; after a failure nothing more of the session is started: later
//! events fail unsent, and [`Sink::abort`] closes the channel.
//!
//! A resend after a crash is stored again (AMQP 0-9-1 has no deduplication):
//! at least once, every copy with the same `message_id`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use lapin::message::BasicReturnMessage;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::{AMQPAuthority, AMQPQueryString, AMQPScheme, AMQPUri, AMQPUserInfo};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use tokio::sync::mpsc;
use walbox_outbox::Event;

use super::RabbitMqSinkConfig;
use super::confirms::{Answer, Confirms, Outcome, Returned};
use crate::kit::{self, Close, FailRest, Lifecycle, Reports, SessionTask};
use crate::nats::{DROPPED_HEADERS_HEADER, KEY_HEADER, is_dead_letter, percent_encode};
use crate::{Deliveries, DeliveryClass, RejectedRecord, Sink, SinkError};

/// What one publication came to: the broker's answer, and the messages it
/// sent back that lapin handed over with it (each with its `message_id`),
/// whichever publication they belong to.
struct Confirmed {
    answer: Answer,
    returns: Vec<(Option<String>, Returned)>,
}

impl Confirmed {
    fn failed(class: DeliveryClass, reason: String) -> Self {
        Confirmed {
            answer: Answer::Failed(class, reason),
            returns: Vec::new(),
        }
    }
}

/// A publication not yet started: `basic.publish` and then its confirm. The
/// reporter starts it (its first poll writes nothing yet but registers the
/// publication with lapin and queues its frames), so that it knows of every
/// publication before the broker can answer it.
type Publish = Pin<Box<dyn Future<Output = Confirmed> + Send>>;

/// A publication to start, and the flag it sets once its frames are written.
struct Start {
    publish: Publish,
    written: Arc<AtomicBool>,
}

/// One publication on its way to the reporter.
struct Published {
    token: usize,
    event_id: String,
    topic: String,
    /// The publication, unless the event failed before it (`answer`).
    publish: Option<Start>,
    answer: Option<Answer>,
    rejected: RejectedRecord,
    sent_at: Instant,
}

/// What a report needs besides the answer.
struct Item {
    token: usize,
    event_id: String,
    topic: String,
    /// The publication, until it has its answer.
    publish: Option<Start>,
    /// Started, and counted among the unwritten until its frames are.
    started: bool,
    unwritten: bool,
    /// Wakes the reporter naming this publication.
    waker: Waker,
    rejected: RejectedRecord,
    sent_at: Instant,
}

/// The publications whose futures woke since the reporter last looked (by
/// sequence number, in the order they woke), and the reporter's waker.
#[derive(Default)]
struct Woken(Mutex<(Vec<u64>, Option<Waker>)>);

impl Woken {
    fn lock(&self) -> std::sync::MutexGuard<'_, (Vec<u64>, Option<Waker>)> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The reporter is about to wait: wake `waker`.
    fn register(&self, waker: &Waker) {
        let mut g = self.lock();
        if !g.1.as_ref().is_some_and(|w| w.will_wake(waker)) {
            g.1 = Some(waker.clone());
        }
    }

    /// Moves the woken sequence numbers into `into`.
    fn take(&self, into: &mut Vec<u64>) {
        into.append(&mut self.lock().0);
    }
}

/// The waker of one publication: records its sequence number and wakes the
/// reporter. lapin resolves every promise from its one I/O loop, so the
/// order of these records is the order the promises were resolved in.
struct Wakes {
    seq: u64,
    woken: Arc<Woken>,
}

impl Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let mut g = self.woken.lock();
        g.0.push(self.seq);
        if let Some(w) = &g.1 {
            w.wake_by_ref();
        }
    }
}

struct Session {
    connection: Connection,
    channel: Channel,
    published: mpsc::UnboundedSender<Published>,
    /// The task reporting confirms in publish order.
    _reporter: SessionTask,
}

impl Close for Session {
    async fn close(self) {
        // Nothing more goes out on this channel; what it still awaits is not
        // reported.
        drop(self._reporter);
        let _ = self
            .channel
            .close(200, ShortString::from("walbox: session ended"))
            .await;
        let _ = self
            .connection
            .close(200, ShortString::from("walbox: session ended"))
            .await;
    }
}

/// Publishes events to an exchange.
pub(super) struct ExchangeSink {
    config: RabbitMqSinkConfig,
    session: Lifecycle<Session>,
    reports: Reports,
}

impl std::fmt::Debug for ExchangeSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExchangeSink")
            .field("exchange", &self.config.exchange)
            .finish_non_exhaustive()
    }
}

/// The failure of a connection or setup step, with what it was.
fn amqp(what: &str, e: &lapin::Error) -> SinkError {
    SinkError::RabbitMq(format!("{what}: {e}"))
}

/// Whether an error is the broker refusing walbox's credentials.
fn refused_credentials(e: &lapin::Error) -> bool {
    let text = e.to_string().to_ascii_lowercase();
    text.contains("access_refused") || text.contains("access-refused") || text.contains("403")
}

/// Connects with the settings (TLS, credentials) and opens a channel.
pub(crate) async fn connect(
    config: &RabbitMqSinkConfig,
) -> Result<(Connection, Channel), SinkError> {
    let uri = AMQPUri {
        scheme: if config.tls {
            AMQPScheme::AMQPS
        } else {
            AMQPScheme::AMQP
        },
        authority: AMQPAuthority {
            userinfo: AMQPUserInfo {
                username: config.user().to_owned(),
                password: config.password().to_owned(),
            },
            host: config.host.clone(),
            port: config.amqp_port(),
        },
        vhost: config.vhost.clone(),
        query: AMQPQueryString {
            connection_timeout: Some(config.connect_timeout_ms),
            heartbeat: Some(10),
            ..Default::default()
        },
    };
    let mut tls = OwnedTLSConfig::default();
    if let Some(ca) = &config.ca_file {
        let pem = config.read("ca_file", ca)?;
        tls.cert_chain = Some(String::from_utf8_lossy(&pem).into_owned());
    }
    if let (Some(cert), Some(key)) = (&config.client_cert, &config.client_key) {
        tls.identity = Some(OwnedIdentity::PKCS8 {
            pem: config.read("client_cert", cert)?,
            key: config.read("client_key", key)?,
        });
    }
    let runtime = lapin::runtime::default_runtime()
        .map_err(|e| amqp("starting the AMQP client's runtime", &e))?;
    let connect =
        Connection::connect_uri_with_config(uri, ConnectionProperties::default(), tls, runtime);
    let connection = tokio::time::timeout(
        Duration::from_millis(config.connect_timeout_ms.saturating_add(1_000)),
        connect,
    )
    .await
    .map_err(|_| {
        SinkError::RabbitMq(format!(
            "connecting to {}: no answer within {} ms",
            config.describe(),
            config.connect_timeout_ms
        ))
    })?
    .map_err(|e| {
        if refused_credentials(&e) {
            SinkError::RabbitMqAuthentication {
                user: config.user().to_owned(),
                reason: e.to_string(),
            }
        } else {
            amqp(&format!("connecting to {}", config.describe()), &e)
        }
    })?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| amqp("opening a channel", &e))?;
    Ok((connection, channel))
}

impl ExchangeSink {
    pub(super) fn new(config: RabbitMqSinkConfig) -> (Self, Deliveries) {
        let (reports, rx) = Reports::new();
        (
            ExchangeSink {
                config,
                session: Lifecycle::default(),
                reports,
            },
            rx,
        )
    }

    async fn session(&mut self) -> Result<&Session, SinkError> {
        self.reports.check()?;
        let config = &self.config;
        let reports = &self.reports;
        let session = self
            .session
            .open_with(|| async {
                let (connection, channel) = connect(config).await?;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .map_err(|e| amqp("turning on publisher confirms", &e))?;
                let exchange = ShortString::from(self.config.exchange.clone());
                let kind = match self.config.exchange_type.as_str() {
                    "direct" => ExchangeKind::Direct,
                    "fanout" => ExchangeKind::Fanout,
                    "headers" => ExchangeKind::Headers,
                    _ => ExchangeKind::Topic,
                };
                let options = ExchangeDeclareOptions {
                    passive: !self.config.declare,
                    durable: true,
                    ..Default::default()
                };
                if let Err(e) = channel
                    .exchange_declare(exchange, kind, options, FieldTable::default())
                    .await
                {
                    let text = e.to_string();
                    return Err(if text.contains("NOT_FOUND") || text.contains("404") {
                        SinkError::MissingExchange(self.config.exchange.clone())
                    } else {
                        amqp(
                            &format!(
                                "{} exchange {:?}",
                                if self.config.declare {
                                    "declaring"
                                } else {
                                    "checking"
                                },
                                self.config.exchange
                            ),
                            &e,
                        )
                    });
                }
                tracing::info!(
                    exchange = self.config.exchange,
                    server = self.config.describe(),
                    "publishing to the exchange with publisher confirms"
                );
                let (published, rx) = mpsc::unbounded_channel();
                let reporter = reports.spawn(
                    "confirm reporter",
                    report(
                        rx,
                        reports.clone(),
                        Duration::from_millis(config.confirm_timeout_ms),
                    ),
                );
                Ok(Session {
                    connection,
                    channel,
                    published,
                    _reporter: reporter,
                })
            })
            .await?;
        Ok(session)
    }

    fn queue(&self, p: Published) {
        self.reports.sent();
        if let Some(s) = self.session.get()
            && s.published.send(p).is_ok()
        {
            return;
        }
        self.reports.withdrawn();
    }
}

/// The event's headers as an AMQP table: the record's headers (bytes, as
/// long strings) and the key; and the byte lengths of the names left out.
///
/// An AMQP 0-9-1 header name is a short string: at most 255 bytes. As the
/// NATS sink does with a header it cannot carry, an event with a longer name
/// is refused (`Err` says why, with the name's length; the event goes to a
/// dead letter, whose reason tells the row's author what to shorten), rather
/// than published without it: a consumer would not know it is missing. A
/// dead letter must go out, so it leaves such headers out instead and names
/// them in [`DROPPED_HEADERS_HEADER`]: their number, then their names
/// percent-encoded and separated by `,` (`1 very-long-name`); the caller
/// warns.
fn headers_of(event: &Event) -> Result<(FieldTable, Vec<usize>), String> {
    let dead_letter = is_dead_letter(event);
    let mut table = FieldTable::default();
    let mut dropped = Vec::new();
    for (name, value) in &event.headers {
        match ShortString::try_new(name.as_ref()) {
            Ok(name) => {
                table.insert(
                    name,
                    AMQPValue::LongString(LongString::from(value.to_vec())),
                );
            }
            Err(_) if dead_letter => dropped.push(name.as_ref()),
            Err(_) => {
                return Err(format!(
                    "a header name of {} bytes: an AMQP header name holds at most 255; shorten \
                     it in the row's headers",
                    name.len()
                ));
            }
        }
    }
    if let Some(key) = &event.key {
        table.insert(
            ShortString::from(KEY_HEADER),
            AMQPValue::LongString(LongString::from(key.to_vec())),
        );
    }
    if !dropped.is_empty() {
        let names: Vec<String> = dropped.iter().map(|n| percent_encode(n)).collect();
        table.insert(
            ShortString::from(DROPPED_HEADERS_HEADER),
            AMQPValue::LongString(LongString::from(
                format!("{} {}", dropped.len(), names.join(",")).into_bytes(),
            )),
        );
    }
    Ok((table, dropped.iter().map(|n| n.len()).collect()))
}

impl Sink for ExchangeSink {
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        if self.session.aborted() {
            return Ok(());
        }
        let mut p = Published {
            token,
            event_id: event.event_id.clone(),
            topic: event.topic.clone(),
            publish: None,
            answer: None,
            rejected: kit::rejected(&event),
            sent_at: Instant::now(),
        };
        self.session().await?;
        let Ok(routing_key) = ShortString::try_new(event.topic.as_str()) else {
            p.answer = Some(Answer::Failed(
                DeliveryClass::InvalidTopic,
                format!(
                    "a routing key holds at most 255 bytes, the topic has {}",
                    event.topic.len()
                ),
            ));
            self.queue(p);
            return Ok(());
        };
        let Ok(message_id) = ShortString::try_new(event.event_id.as_str()) else {
            p.answer = Some(Answer::Failed(
                DeliveryClass::InvalidRecord,
                format!(
                    "a message_id holds at most 255 bytes, the event id has {}",
                    event.event_id.len()
                ),
            ));
            self.queue(p);
            return Ok(());
        };
        let headers = match headers_of(&event) {
            Ok((headers, dropped)) => {
                if !dropped.is_empty() {
                    tracing::warn!(
                        event_id = event.event_id,
                        topic = event.topic,
                        name_bytes = ?dropped,
                        "dead letter published without the headers whose names pass AMQP's 255 \
                         bytes (named in walbox_dropped_headers)"
                    );
                }
                headers
            }
            Err(reason) => {
                p.answer = Some(Answer::Failed(DeliveryClass::InvalidRecord, reason));
                self.queue(p);
                return Ok(());
            }
        };
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(message_id)
            .with_headers(headers);
        let content_type = event
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
            .and_then(|v| ShortString::try_new(v).ok());
        if let Some(ct) = content_type {
            properties = properties.with_content_type(ct);
        } else if event.json_value {
            properties = properties.with_content_type(ShortString::from("application/json"));
        }
        let channel = self.session().await?.channel.clone();
        let exchange = ShortString::from(self.config.exchange.clone());
        let value = event.value.clone();
        let written = Arc::new(AtomicBool::new(false));
        let done = Arc::clone(&written);
        p.publish = Some(Start {
            written,
            publish: Box::pin(async move {
                let confirm = match channel
                    .basic_publish(
                        exchange,
                        routing_key,
                        BasicPublishOptions {
                            mandatory: true,
                            ..Default::default()
                        },
                        &value,
                        properties,
                    )
                    .await
                {
                    Ok(confirm) => confirm,
                    Err(e) => {
                        return Confirmed::failed(
                            DeliveryClass::BrokerError,
                            format!("publishing: {e}"),
                        );
                    }
                };
                done.store(true, Ordering::Release);
                confirmed(confirm.await)
            }),
        });
        self.queue(p);
        Ok(())
    }

    fn abort(&mut self) {
        self.session.abort();
    }

    async fn flush(&mut self, timeout: Duration) -> Result<(), SinkError> {
        self.session.flush(&self.reports, timeout).await
    }
}

/// What lapin's confirm says, with the messages it handed over.
fn confirmed(r: Result<Confirmation, lapin::Error>) -> Confirmed {
    let (answer, returned) = match r {
        Ok(Confirmation::Ack(ret)) => (Answer::Ack, ret),
        Ok(Confirmation::Nack(ret)) => (Answer::Nack, ret),
        Ok(Confirmation::NotRequested) => (
            Answer::Failed(
                DeliveryClass::BrokerError,
                "the channel is not in confirm mode".into(),
            ),
            None,
        ),
        Err(e) => (
            Answer::Failed(
                DeliveryClass::BrokerError,
                format!("no confirm: the channel or connection failed ({e})"),
            ),
            None,
        ),
    };
    let returns = returned
        .into_iter()
        .map(|r: BasicReturnMessage| {
            (
                r.delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|m| m.to_string()),
                Returned {
                    code: r.reply_code,
                    text: r.reply_text.to_string(),
                    exchange: r.delivery.exchange.to_string(),
                    routing_key: r.delivery.routing_key.to_string(),
                },
            )
        })
        .collect();
    Confirmed { answer, returns }
}

/// Publications started whose frames are not yet written, at most: the rest
/// wait unstarted, so that a broker slower than the WAL holds few frames in
/// lapin's queue (each a copy of its message), not `max_in_flight` of them.
const MAX_UNWRITTEN: usize = 256;

/// Starts each publication and reports them in publish order as their
/// confirms come.
///
/// lapin hands each returned message to the next confirm it resolves, which
/// may be another publication's (see [`super::confirms`]): when one ack
/// (`multiple`) resolves a batch, it walks the batch in its `HashMap`'s order
/// and the first confirms it resolves take the returns waiting, oldest first.
/// The return of a publication P is the i-th waiting, where i - 1 returns
/// of publications before P wait with it; every one of those i publications
/// is in the batch, so the last of them (or P) that lapin resolves is resolved
/// at or after the confirm carrying P's return. An entry is reported only when
/// it and every entry before it are answered, so it is enough that whatever
/// round sees a confirm resolved has seen every one resolved before it.
///
/// That holds without polling every awaited confirm at each wake:
/// - the reporter starts every publication itself (in publish order, with at
///   most [`MAX_UNWRITTEN`] started and not yet written), so none can be
///   answered before it is known here;
/// - each publication has its own waker ([`Wakes`]), which lapin calls once
///   the promise's outcome is set, and lapin resolves a publication's write
///   before its confirm (the ack comes after the frames are written), so a
///   confirm not yet armed belongs to a publication whose write woke it;
/// - each round takes the woken list and polls what it names, again and
///   again until a take finds it empty, and only then reports: a confirm
///   resolved before anything the round saw woke before that last take.
///
/// After a publication fails (a failed write, a nack, a return, a lost
/// channel, a timeout), nothing later that is not yet started is published:
/// it fails unsent ([`FailRest`]). A timeout fails every entry not reported,
/// answered or not: a return for one of them may ride on a confirm not yet
/// seen.
async fn report(mut rx: mpsc::UnboundedReceiver<Published>, reports: Reports, timeout: Duration) {
    let mut confirms: Confirms<Item> = Confirms::default();
    let woken = Arc::new(Woken::default());
    let mut due: Vec<u64> = Vec::new();
    let mut unsent = FailRest::default();
    // The sequence number of the next publication, of the oldest one
    // awaiting its report, and of the first not started; how many started
    // are unwritten.
    let mut next: u64 = 0;
    let mut front: u64 = 0;
    let mut started: u64 = 0;
    let mut unwritten: usize = 0;
    let mut closed = false;
    loop {
        if closed && confirms.len() == 0 {
            return;
        }
        let oldest = confirms
            .entries()
            .find(|e| e.answer.is_none())
            .map(|e| e.item.sent_at);
        let sleep = tokio::time::sleep_until(tokio::time::Instant::from_std(
            oldest.unwrap_or_else(Instant::now) + timeout,
        ));
        let progressed = std::future::poll_fn(|cx| {
            woken.register(cx.waker());
            let mut progressed = false;
            while !closed {
                match rx.poll_recv(cx) {
                    Poll::Ready(Some(p)) => {
                        let seq = next;
                        next += 1;
                        let item = Item {
                            token: p.token,
                            event_id: p.event_id.clone(),
                            topic: p.topic,
                            publish: if p.answer.is_none() { p.publish } else { None },
                            started: false,
                            unwritten: false,
                            waker: Waker::from(Arc::new(Wakes {
                                seq,
                                woken: woken.clone(),
                            })),
                            rejected: p.rejected,
                            sent_at: p.sent_at,
                        };
                        confirms.push(item, p.event_id, p.answer);
                        progressed = true;
                    }
                    Poll::Ready(None) => {
                        closed = true;
                        progressed = true;
                    }
                    Poll::Pending => break,
                }
            }
            // Start publications, in order, while few are unwritten.
            started = started.max(front);
            while unwritten < MAX_UNWRITTEN && started < next {
                let Some(e) = confirms.get_mut((started - front) as usize) else {
                    break;
                };
                started += 1;
                if e.answer.is_some() {
                    continue;
                }
                progressed = true;
                if let Some((class, reason)) = unsent.get() {
                    e.item.publish = None;
                    e.answer = Some(Answer::Failed(class, reason));
                    continue;
                }
                e.item.started = true;
                e.item.unwritten = true;
                unwritten += 1;
                if let Some(c) = advance(&mut e.item, &mut unwritten) {
                    record(&mut confirms, front, started - 1, c, &mut unsent);
                }
            }
            // What woke, until nothing more has.
            loop {
                woken.take(&mut due);
                if due.is_empty() {
                    break;
                }
                for seq in due.drain(..) {
                    let Some(e) = seq
                        .checked_sub(front)
                        .and_then(|i| confirms.get_mut(i as usize))
                    else {
                        continue;
                    };
                    if e.answer.is_some() || !e.item.started {
                        continue;
                    }
                    if let Some(c) = advance(&mut e.item, &mut unwritten) {
                        record(&mut confirms, front, seq, c, &mut unsent);
                        progressed = true;
                    }
                }
            }
            if progressed {
                Poll::Ready(true)
            } else {
                Poll::Pending
            }
        });
        let progressed = tokio::select! {
            biased;
            p = progressed => p,
            () = sleep, if oldest.is_some() => false,
        };
        if !progressed && confirms.front_waiting() {
            let reason = format!("no publisher confirm within {} ms", timeout.as_millis());
            unsent.after(
                DeliveryClass::Timeout,
                format!(
                    "not sent: an earlier event of this session got {reason}; walbox \
                     publishes again from its acknowledged position"
                ),
            );
            for e in confirms.entries() {
                if e.item.unwritten {
                    e.item.unwritten = false;
                    unwritten -= 1;
                }
                e.item.publish = None;
                if matches!(e.answer, None | Some(Answer::Ack)) {
                    e.answer = Some(Answer::Failed(DeliveryClass::Timeout, reason.clone()));
                }
            }
        }
        let ready = confirms.ready();
        front += ready.len() as u64;
        for (item, outcome) in ready {
            let result = match outcome {
                Outcome::Stored => Ok(()),
                Outcome::Failed(class, reason) => Err(kit::refused(
                    item.event_id,
                    item.topic,
                    class,
                    reason,
                    item.rejected,
                )),
            };
            reports.report(item.token, result);
        }
    }
}

/// Polls a started publication with its own waker; what it came to, once
/// it has. `unwritten` counts the started publications whose frames are not
/// yet written: one written is taken off.
fn advance(item: &mut Item, unwritten: &mut usize) -> Option<Confirmed> {
    let start = item.publish.as_mut()?;
    let mut cx = Context::from_waker(&item.waker);
    let r = start.publish.as_mut().poll(&mut cx);
    if item.unwritten && (r.is_ready() || start.written.load(Ordering::Acquire)) {
        item.unwritten = false;
        *unwritten -= 1;
    }
    let Poll::Ready(c) = r else {
        return None;
    };
    item.publish = None;
    Some(c)
}

/// Records what publication `seq` came to: its answer, and the returns it
/// carried (each for the publication it names). A failure of any kind, or a
/// return, leaves every later publication not yet started unsent.
fn record(
    confirms: &mut Confirms<Item>,
    front: u64,
    seq: u64,
    c: Confirmed,
    unsent: &mut FailRest,
) {
    for (id, r) in c.returns {
        tracing::warn!(
            event_id = id.as_deref().unwrap_or("(none)"),
            exchange = r.exchange.as_str(),
            routing_key = r.routing_key.as_str(),
            code = r.code,
            "the broker returned a message: no queue took it"
        );
        unsent.after(
            DeliveryClass::BrokerError,
            format!(
                "not sent: event {} of this session came back unroutable; walbox publishes \
                 again from its acknowledged position",
                id.as_deref().unwrap_or("(none)")
            ),
        );
        confirms.returned(id, r);
    }
    let Some(e) = seq
        .checked_sub(front)
        .and_then(|i| confirms.get_mut(i as usize))
    else {
        return;
    };
    match &c.answer {
        Answer::Ack => {}
        Answer::Nack => unsent.after(
            DeliveryClass::BrokerError,
            format!(
                "not sent: event {} of this session was refused (basic.nack); walbox \
                 publishes again from its acknowledged position",
                e.item.event_id
            ),
        ),
        Answer::Failed(class, reason) => unsent.after(
            *class,
            format!(
                "not sent: event {} of this session failed ({reason}); walbox publishes \
                 again from its acknowledged position",
                e.item.event_id
            ),
        ),
    }
    e.answer = Some(c.answer);
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use walbox_outbox::Position;

    fn event(headers: Vec<(&str, &str)>) -> Event {
        Event {
            event_id: "e1".into(),
            topic: "outbox.Order".into(),
            key: Some(Bytes::from_static(b"order-1")),
            value: Bytes::from_static(b"{}"),
            json_value: true,
            headers: headers
                .into_iter()
                .map(|(k, v)| (k.to_owned().into(), Bytes::from(v.to_owned())))
                .collect(),
            position: Position {
                commit_lsn: walbox_pgoutput::Lsn(1),
                index: 0,
                xid: 7,
            },
            origin: walbox_outbox::Origin::Stream,
        }
    }

    /// A publication handed to the reporter, whose outcome is `publish`.
    fn published(token: usize, id: &str, publish: Publish, written: bool) -> Published {
        Published {
            token,
            event_id: id.into(),
            topic: "outbox.order".into(),
            publish: Some(Start {
                publish,
                written: Arc::new(AtomicBool::new(written)),
            }),
            answer: None,
            rejected: kit::rejected(&event(vec![])),
            sent_at: Instant::now(),
        }
    }

    fn ack() -> Confirmed {
        Confirmed {
            answer: Answer::Ack,
            returns: Vec::new(),
        }
    }

    fn no_route(id: &str) -> (Option<String>, Returned) {
        (
            Some(id.into()),
            Returned {
                code: 312,
                text: "NO_ROUTE".into(),
                exchange: "outbox".into(),
                routing_key: "outbox.order".into(),
            },
        )
    }

    /// Each delivery's class (`None`: stored) and reason, by token.
    async fn outcomes(
        deliveries: &mut crate::Deliveries,
        n: usize,
    ) -> Vec<Option<(DeliveryClass, String)>> {
        let mut out = vec![None; n];
        let mut seen = 0;
        while seen < n {
            let d = tokio::time::timeout(Duration::from_secs(10), deliveries.recv())
                .await
                .expect("a delivery in time")
                .expect("the reporter is alive");
            out[d.token] = d.result.err().map(|e| (e.class, e.reason));
            seen += 1;
        }
        out
    }

    /// lapin resolves W's confirm (an ack without the return) after V's,
    /// which carries W's return, and V's waker fires while the round that
    /// polls W is under way: W is reported only once V is seen, so it fails
    /// as returned, never as stored.
    #[tokio::test]
    async fn a_return_carried_by_a_confirm_that_wakes_mid_round_fails_its_own_event() {
        let (reports, mut deliveries) = Reports::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(report(rx, reports.clone(), Duration::from_secs(30)));
        let (w_tx, w_rx) = tokio::sync::oneshot::channel::<Confirmed>();
        let (v_tx, v_rx) = tokio::sync::oneshot::channel::<Confirmed>();
        let w = Box::pin(async move {
            let c = w_rx.await.expect("answered");
            // lapin's I/O loop resolves V (carrying W's return) as W's own
            // confirm comes out: V's waker fires after this round's take.
            let _ = v_tx.send(Confirmed {
                answer: Answer::Ack,
                returns: vec![no_route("w")],
            });
            c
        });
        let v = Box::pin(async move { v_rx.await.expect("answered") });
        reports.sent();
        tx.send(published(0, "w", w, true)).unwrap();
        reports.sent();
        tx.send(published(1, "v", v, true)).unwrap();
        // Both are started (and wait) before W is answered.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        w_tx.send(ack()).ok().expect("W waits");
        let got = outcomes(&mut deliveries, 2).await;
        assert_eq!(
            got[0].as_ref().map(|o| o.0),
            Some(DeliveryClass::UnknownTopic),
            "{got:?}"
        );
        assert_eq!(got[1], None, "{got:?}");
        drop(tx);
        task.await.unwrap();
    }

    /// A timeout fails every publication not reported, and what is sent
    /// after it fails unsent at once: none is left waiting for a start that
    /// would never come.
    #[tokio::test]
    async fn after_a_timeout_later_publications_fail_unsent_and_none_is_started() {
        let (reports, mut deliveries) = Reports::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(report(rx, reports.clone(), Duration::from_millis(50)));
        let n = MAX_UNWRITTEN + 44;
        for i in 0..n {
            reports.sent();
            let never = Box::pin(std::future::pending::<Confirmed>());
            tx.send(published(i, &format!("e{i}"), never, false))
                .unwrap();
        }
        let got = outcomes(&mut deliveries, n).await;
        assert!(
            got.iter()
                .all(|o| o.as_ref().is_some_and(|o| o.0 == DeliveryClass::Timeout)),
            "{got:?}"
        );
        // A publication after the timeout is never started (its future
        // panics if polled) and fails at once, saying why.
        reports.sent();
        let polled = Box::pin(async { panic!("started after the session failed") });
        tx.send(published(0, "late", polled, false)).unwrap();
        let late = tokio::time::timeout(Duration::from_millis(40), deliveries.recv())
            .await
            .expect("failed before a timeout of its own")
            .expect("the reporter is alive");
        let reason = late.result.unwrap_err().reason;
        assert!(reason.contains("not sent"), "{reason}");
        drop(tx);
        task.await.unwrap();
    }

    /// A nack stops the session: a publication handed over after it is never
    /// started and fails unsent, so nothing of a key lands after an earlier
    /// event that did not.
    #[tokio::test]
    async fn after_a_nack_a_publication_not_yet_started_fails_unsent() {
        let (reports, mut deliveries) = Reports::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(report(rx, reports.clone(), Duration::from_secs(30)));
        reports.sent();
        let nacked = Box::pin(async {
            Confirmed {
                answer: Answer::Nack,
                returns: Vec::new(),
            }
        });
        tx.send(published(0, "a", nacked, true)).unwrap();
        let got = outcomes(&mut deliveries, 1).await;
        assert_eq!(
            got[0].as_ref().map(|o| o.0),
            Some(DeliveryClass::BrokerError)
        );
        reports.sent();
        let polled = Box::pin(async { panic!("started after the session failed") });
        tx.send(published(1, "b", polled, false)).unwrap();
        let d = tokio::time::timeout(Duration::from_secs(10), deliveries.recv())
            .await
            .expect("a delivery in time")
            .expect("the reporter is alive");
        assert_eq!(d.token, 1);
        let reason = d.result.unwrap_err().reason;
        assert!(reason.contains("not sent: event a"), "{reason}");
        drop(tx);
        task.await.unwrap();
    }

    fn text(table: &FieldTable, name: &str) -> Option<String> {
        match table.inner().get(name)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            _ => None,
        }
    }

    #[test]
    fn a_header_name_past_255_bytes_is_never_dropped_without_a_word() {
        let long = "n".repeat(256);
        let fits = "f".repeat(255);
        let class = walbox_outbox::dead_letter_header::ERROR_CLASS;
        // A dead letter goes out without it, and names it.
        let letter = event(vec![
            (long.as_str(), "v"),
            (fits.as_str(), "w"),
            (class, "invalid_record"),
        ]);
        let (table, dropped) = headers_of(&letter).expect("a dead letter goes out");
        assert_eq!(dropped, [256]);
        assert!(!table.contains_key(&long));
        assert_eq!(text(&table, &fits).as_deref(), Some("w"));
        assert_eq!(text(&table, KEY_HEADER).as_deref(), Some("order-1"));
        assert_eq!(
            text(&table, DROPPED_HEADERS_HEADER),
            Some(format!("1 {long}")),
            "the dropped header is named"
        );
        // Any other event is refused, about itself (it is dead-lettered).
        let e = event(vec![(long.as_str(), "v"), (fits.as_str(), "w")]);
        let why = headers_of(&e).expect_err("a name past 255 bytes");
        assert!(why.contains("256 bytes") && why.contains("255"), "{why}");
        let (table, dropped) = headers_of(&event(vec![(fits.as_str(), "w")])).unwrap();
        assert!(dropped.is_empty() && !table.contains_key(DROPPED_HEADERS_HEADER));
    }
}
