//! The NATS JetStream sink: each event is published to the subject its topic
//! names (topics are `.`-separated, as subjects are) with `Nats-Msg-Id` = the
//! event id, so that the stream drops a replay within its duplicate window; an
//! event counts as delivered only on the server's PubAck (a duplicate PubAck
//! included: the stream already holds it).
//!
//! Publications are chained: each one carries `Nats-Expected-Last-Msg-Id`, the
//! id of the one published before it to the same stream in this session, so
//! that when one is lost (a connection dropped under it) no later one is
//! stored before it; the session fails and the relay publishes again from its
//! acknowledged position. The server checks duplicates before the chain, so a
//! replay passes. walbox must be the only publisher on its stream. A message
//! larger than the stream's `max_msg_size` or the server's `max_payload` is
//! refused here, before it is sent (it goes to a dead letter), so that no
//! message the stream refuses ever stands in the chain.

use std::collections::HashMap;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, context::PublishAckFuture, context::PublishErrorKind};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;
use serde::Deserialize;
use tokio::sync::mpsc;
use walbox_outbox::Event;

use crate::secrets::Hidden;
use crate::{Deliveries, Delivery, DeliveryClass, DeliveryError, RejectedRecord, Sink, SinkError};

/// The header that carries the record key (NATS messages have no key).
pub const KEY_HEADER: &str = "walbox_key";

/// Where JetStream keeps a created stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NatsStorage {
    /// On disk.
    #[default]
    File,
    /// In memory.
    Memory,
}

/// Settings of the NATS sink (`[sink.nats]`). Its `Debug` form hides the
/// password, the token and the NKey seed.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsSinkConfig {
    /// Server URLs (`nats://host:4222`, `tls://host:4222`).
    #[serde(default = "default_servers")]
    pub servers: Vec<String>,
    /// The stream that holds walbox's subjects.
    #[serde(default = "default_stream")]
    pub stream: String,
    /// Create the stream when it does not exist, with `subjects`, `storage`,
    /// `replicas` and `duplicate_window_s`.
    #[serde(default)]
    pub create_stream: bool,
    /// Subjects of a created stream; they must cover every topic and dead-letter
    /// topic walbox publishes to.
    #[serde(default = "default_subjects")]
    pub subjects: Vec<String>,
    /// Storage of a created stream.
    #[serde(default)]
    pub storage: NatsStorage,
    /// Replicas of a created stream.
    #[serde(default = "default_replicas")]
    pub replicas: usize,
    /// The duplicate window, in seconds: a created stream gets it, an existing
    /// one must keep message ids at least this long. Exactly once into the
    /// stream holds for outages shorter than it.
    #[serde(default = "default_duplicate_window_s")]
    pub duplicate_window_s: u64,
    /// How long to wait for a PubAck, in ms.
    #[serde(default = "default_ack_timeout_ms")]
    pub ack_timeout_ms: u64,
    /// How long to wait for a connection, in ms.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Refuse a connection without TLS.
    #[serde(default)]
    pub tls_required: bool,
    /// CA certificates (PEM) that sign the server's certificate.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM), with `client_key`.
    #[serde(default)]
    pub client_cert: Option<PathBuf>,
    /// Client private key (PEM), with `client_cert`.
    #[serde(default)]
    pub client_key: Option<PathBuf>,
    /// User name, with `password`.
    #[serde(default)]
    pub user: Option<String>,
    /// Password, with `user`.
    #[serde(default)]
    pub password: Option<String>,
    /// Token.
    #[serde(default)]
    pub token: Option<String>,
    /// NKey seed (`SU...`).
    #[serde(default)]
    pub nkey_seed: Option<String>,
    /// A credentials file (JWT and NKey seed).
    #[serde(default)]
    pub creds_file: Option<PathBuf>,
    /// Most events in flight (the relay's bound); set from `sink.max_in_flight`.
    #[serde(skip, default = "default_max_in_flight")]
    pub max_in_flight: usize,
}

fn default_servers() -> Vec<String> {
    vec!["nats://127.0.0.1:4222".into()]
}
fn default_stream() -> String {
    "OUTBOX".into()
}
fn default_subjects() -> Vec<String> {
    vec!["outbox.>".into()]
}
fn default_replicas() -> usize {
    1
}
fn default_duplicate_window_s() -> u64 {
    120
}
fn default_ack_timeout_ms() -> u64 {
    10_000
}
fn default_connect_timeout_ms() -> u64 {
    5_000
}
fn default_max_in_flight() -> usize {
    10_000
}

impl Default for NatsSinkConfig {
    fn default() -> Self {
        NatsSinkConfig {
            servers: default_servers(),
            stream: default_stream(),
            create_stream: false,
            subjects: default_subjects(),
            storage: NatsStorage::default(),
            replicas: default_replicas(),
            duplicate_window_s: default_duplicate_window_s(),
            ack_timeout_ms: default_ack_timeout_ms(),
            connect_timeout_ms: default_connect_timeout_ms(),
            tls_required: false,
            ca_file: None,
            client_cert: None,
            client_key: None,
            user: None,
            password: None,
            token: None,
            nkey_seed: None,
            creds_file: None,
            max_in_flight: default_max_in_flight(),
        }
    }
}

impl std::fmt::Debug for NatsSinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hide = |s: &Option<String>| s.as_ref().map(|_| Hidden);
        f.debug_struct("NatsSinkConfig")
            .field("servers", &self.servers)
            .field("stream", &self.stream)
            .field("create_stream", &self.create_stream)
            .field("subjects", &self.subjects)
            .field("storage", &self.storage)
            .field("replicas", &self.replicas)
            .field("duplicate_window_s", &self.duplicate_window_s)
            .field("ack_timeout_ms", &self.ack_timeout_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("tls_required", &self.tls_required)
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("client_key", &self.client_key)
            .field("user", &self.user)
            .field("password", &hide(&self.password))
            .field("token", &hide(&self.token))
            .field("nkey_seed", &hide(&self.nkey_seed))
            .field("creds_file", &self.creds_file)
            .field("max_in_flight", &self.max_in_flight)
            .finish()
    }
}

impl NatsSinkConfig {
    /// Checks the settings that need no server.
    pub fn validate(&self) -> Result<(), SinkError> {
        let bad = |m: &str| Err(SinkError::Config(format!("sink.nats.{m}")));
        if self.servers.is_empty() {
            return bad("servers: name at least one server (nats://host:4222)");
        }
        if self.stream.is_empty() || self.stream.contains(['.', ' ', '*', '>']) {
            return bad("stream: a stream name without '.', ' ', '*' or '>'");
        }
        if self.duplicate_window_s == 0 {
            return bad(
                "duplicate_window_s: must be at least 1 (without it a replay is stored twice)",
            );
        }
        if self.client_cert.is_some() != self.client_key.is_some() {
            return bad("client_cert and client_key: set both or neither");
        }
        if self.user.is_some() != self.password.is_some() {
            return bad("user and password: set both or neither");
        }
        let methods = [
            self.user.is_some(),
            self.token.is_some(),
            self.nkey_seed.is_some(),
            self.creds_file.is_some(),
        ];
        if methods.into_iter().filter(|m| *m).count() > 1 {
            return bad("user/password, token, nkey_seed and creds_file: set one of them");
        }
        if self.create_stream && self.subjects.is_empty() {
            return bad("subjects: a created stream needs subjects (e.g. [\"outbox.>\"])");
        }
        Ok(())
    }

    fn duplicate_window(&self) -> Duration {
        Duration::from_secs(self.duplicate_window_s)
    }

    /// The user the credentials name, for errors: never a secret.
    fn who(&self) -> String {
        if let Some(u) = &self.user {
            format!("user {u:?}")
        } else if self.token.is_some() {
            "a token".into()
        } else if self.nkey_seed.is_some() {
            "an NKey".into()
        } else if let Some(f) = &self.creds_file {
            format!("credentials file {}", f.display())
        } else {
            "no credentials".into()
        }
    }

    /// Connects to the servers with the configured TLS and credentials.
    pub async fn connect(&self) -> Result<async_nats::Client, SinkError> {
        self.validate()?;
        let mut options = async_nats::ConnectOptions::new()
            .name("walbox")
            .connection_timeout(Duration::from_millis(self.connect_timeout_ms))
            .require_tls(self.tls_required);
        if let Some(ca) = &self.ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&self.client_cert, &self.client_key) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        if let (Some(user), Some(password)) = (&self.user, &self.password) {
            options = options.user_and_password(user.clone(), password.clone());
        }
        if let Some(token) = &self.token {
            options = options.token(token.clone());
        }
        if let Some(seed) = &self.nkey_seed {
            options = options.nkey(seed.clone());
        }
        if let Some(file) = &self.creds_file {
            options = options.credentials_file(file).await.map_err(|e| {
                SinkError::Config(format!(
                    "sink.nats.creds_file: reading {}: {e}",
                    file.display()
                ))
            })?;
        }
        let servers = self
            .servers
            .iter()
            .map(|s| s.parse::<async_nats::ServerAddr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| SinkError::Config(format!("sink.nats.servers: {e}")))?;
        options.connect(servers).await.map_err(|e| {
            use async_nats::ConnectErrorKind as K;
            match e.kind() {
                K::AuthorizationViolation | K::Authentication => SinkError::NatsAuthentication {
                    who: self.who(),
                    reason: e.to_string(),
                },
                K::Tls => SinkError::Config(format!(
                    "nats TLS: {e}; check tls_required, ca_file, client_cert and client_key in \
                     [sink.nats]"
                )),
                K::ServerParse => SinkError::Config(format!("sink.nats.servers: {e}")),
                _ => SinkError::Nats(format!("connecting to {}: {e}", self.servers.join(", "))),
            }
        })
    }
}

/// One publication waiting for its outcome, in publishing order.
struct Pending {
    token: usize,
    event_id: String,
    subject: String,
    outcome: Outcome,
    /// The record without its value, for a dead letter.
    key: Option<Bytes>,
    headers: Vec<(String, Vec<u8>)>,
    value_len: usize,
}

enum Outcome {
    Wait(PublishAckFuture),
    Failed(DeliveryClass, String),
}

/// A connected session.
struct Session {
    js: jetstream::Context,
    acks: mpsc::UnboundedSender<Pending>,
}

/// Publishes events to JetStream, one subject per topic.
pub struct NatsSink {
    config: NatsSinkConfig,
    session: Option<Session>,
    deliveries: mpsc::UnboundedSender<Delivery>,
    /// The stream of each subject checked so far.
    subjects: HashMap<String, String>,
    /// The largest message each stream takes (negative: no limit).
    max_size: HashMap<String, i32>,
    /// Per stream, the id of the last event published to it in this session.
    last_id: HashMap<String, String>,
    /// Sent, not yet reported.
    in_flight: Arc<AtomicUsize>,
    aborted: bool,
}

impl std::fmt::Debug for NatsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSink")
            .field("stream", &self.config.stream)
            .field("subjects", &self.subjects)
            .finish_non_exhaustive()
    }
}

impl NatsSink {
    /// A sink with these settings; it connects on its first event. Returns the
    /// sink and the receiver of its deliveries.
    pub fn new(config: NatsSinkConfig) -> Result<(Self, Deliveries), SinkError> {
        config.validate()?;
        let (tx, rx) = mpsc::unbounded_channel();
        Ok((
            NatsSink {
                config,
                session: None,
                deliveries: tx,
                subjects: HashMap::new(),
                max_size: HashMap::new(),
                last_id: HashMap::new(),
                in_flight: Arc::new(AtomicUsize::new(0)),
                aborted: false,
            },
            rx,
        ))
    }

    async fn session(&mut self) -> Result<&Session, SinkError> {
        if self.session.is_none() {
            let client = self.config.connect().await?;
            let js = jetstream::ContextBuilder::new()
                .timeout(Duration::from_millis(self.config.ack_timeout_ms))
                .max_ack_inflight(self.config.max_in_flight.max(1))
                .build(client);
            ensure_stream(&js, &self.config).await?;
            let (acks, rx) = mpsc::unbounded_channel();
            tokio::spawn(report(rx, self.deliveries.clone(), self.in_flight.clone()));
            self.session = Some(Session { js, acks });
        }
        Ok(self.session.as_ref().expect("connected above"))
    }

    /// The stream that holds `subject`, checked once.
    async fn stream_of(&mut self, subject: &str) -> Result<String, SinkError> {
        if let Some(s) = self.subjects.get(subject) {
            return Ok(s.clone());
        }
        let config = self.config.clone();
        let js = self.session().await?.js.clone();
        let name = js.stream_by_subject(subject).await.map_err(|e| {
            use jetstream::context::GetStreamByNameErrorKind as K;
            match e.kind() {
                K::NotFound => SinkError::MissingStream {
                    subject: subject.to_owned(),
                    stream: config.stream.clone(),
                },
                _ => SinkError::Nats(format!("looking up the stream of {subject}: {e}")),
            }
        })?;
        if !self.max_size.contains_key(&name) {
            let max = check_window(&js, &name, &config).await?;
            self.max_size.insert(name.clone(), max);
        }
        self.subjects.insert(subject.to_owned(), name.clone());
        Ok(name)
    }

    fn queue(&self, p: Pending) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        if let Some(s) = &self.session
            && s.acks.send(p).is_ok()
        {
            return;
        }
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Checks the configured stream, or creates it.
async fn ensure_stream(js: &jetstream::Context, config: &NatsSinkConfig) -> Result<(), SinkError> {
    match js.get_stream(&config.stream).await {
        Ok(_) => check_window(js, &config.stream, config).await.map(drop),
        Err(e)
            if matches!(
                e.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(ref j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            if !config.create_stream {
                return Err(SinkError::MissingStream {
                    subject: config.subjects.join(", "),
                    stream: config.stream.clone(),
                });
            }
            js.create_stream(jetstream::stream::Config {
                name: config.stream.clone(),
                subjects: config.subjects.clone(),
                storage: match config.storage {
                    NatsStorage::File => jetstream::stream::StorageType::File,
                    NatsStorage::Memory => jetstream::stream::StorageType::Memory,
                },
                num_replicas: config.replicas,
                duplicate_window: config.duplicate_window(),
                ..Default::default()
            })
            .await
            .map_err(|e| SinkError::CreateTopic {
                topic: config.stream.clone(),
                reason: e.to_string(),
            })?;
            tracing::info!(
                stream = config.stream,
                subjects = ?config.subjects,
                duplicate_window_s = config.duplicate_window_s,
                "created stream"
            );
            Ok(())
        }
        Err(e) => Err(SinkError::Nats(format!(
            "looking up stream {}: {e}",
            config.stream
        ))),
    }
}

/// Checks that stream `name` keeps message ids at least as long as configured;
/// returns its largest message size (negative: no limit).
async fn check_window(
    js: &jetstream::Context,
    name: &str,
    config: &NatsSinkConfig,
) -> Result<i32, SinkError> {
    let mut stream = js
        .get_stream(name)
        .await
        .map_err(|e| SinkError::Nats(format!("looking up stream {name}: {e}")))?;
    let info = stream
        .info()
        .await
        .map_err(|e| SinkError::Nats(format!("reading stream {name}'s settings: {e}")))?;
    let window = info.config.duplicate_window;
    if window < config.duplicate_window() {
        return Err(SinkError::Config(format!(
            "stream {name} keeps message ids for {} s, less than sink.nats.duplicate_window_s = \
             {}: a replay after a longer outage would be stored twice; raise the stream's \
             duplicate window (nats stream edit {name} --dupe-window {}s) or lower \
             duplicate_window_s",
            window.as_secs(),
            config.duplicate_window_s,
            config.duplicate_window_s
        )));
    }
    Ok(info.config.max_message_size)
}

/// Whether `subject` is a subject one can publish to: non-empty tokens
/// separated by `.`, without wildcards or white space.
fn valid_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|t| {
            !t.is_empty() && t != "*" && t != ">" && !t.contains(|c: char| c.is_whitespace())
        })
}

/// The event's headers, its key and its id as NATS headers; `Err` names what
/// a NATS header cannot hold.
fn headers_of(event: &Event, expected_last: Option<&str>) -> Result<HeaderMap, String> {
    let mut h = HeaderMap::new();
    let mut put = |name: &str, value: &[u8]| -> Result<(), String> {
        let value =
            std::str::from_utf8(value).map_err(|_| format!("header {name} is not UTF-8 text"))?;
        let n =
            HeaderName::from_str(name).map_err(|_| format!("header name {name:?} is not valid"))?;
        let v = HeaderValue::from_str(value)
            .map_err(|_| format!("header {name} holds a line break"))?;
        h.append(n, v);
        Ok(())
    };
    for (k, v) in &event.headers {
        put(k, v)?;
    }
    if let Some(key) = &event.key {
        put(KEY_HEADER, key)?;
    }
    put("Nats-Msg-Id", event.event_id.as_bytes())?;
    if let Some(last) = expected_last {
        put("Nats-Expected-Last-Msg-Id", last.as_bytes())?;
    }
    Ok(h)
}

/// The size of the header block NATS sends for `h`: `NATS/1.0`, a line per
/// value, an empty line.
fn wire_len(h: &HeaderMap) -> usize {
    let mut n = "NATS/1.0\r\n".len() + 2;
    for (name, values) in h.iter() {
        for v in values {
            n += AsRef::<str>::as_ref(name).len() + 2 + v.as_str().len() + 2;
        }
    }
    n
}

/// The class of a failed publication.
fn classify(kind: PublishErrorKind, text: &str) -> DeliveryClass {
    match kind {
        PublishErrorKind::MaxPayloadExceeded => DeliveryClass::MessageTooLarge,
        PublishErrorKind::TimedOut => DeliveryClass::Timeout,
        PublishErrorKind::StreamNotFound => DeliveryClass::UnknownTopic,
        _ if text.contains("message size exceeds maximum") => DeliveryClass::MessageTooLarge,
        _ if text.contains("ermission") || text.contains("authorization") => {
            DeliveryClass::Authorization
        }
        _ => DeliveryClass::BrokerError,
    }
}

/// Reports outcomes in publishing order.
async fn report(
    mut rx: mpsc::UnboundedReceiver<Pending>,
    tx: mpsc::UnboundedSender<Delivery>,
    in_flight: Arc<AtomicUsize>,
) {
    while let Some(p) = rx.recv().await {
        let failed = match p.outcome {
            Outcome::Wait(fut) => match fut.await {
                Ok(ack) => {
                    if ack.duplicate {
                        tracing::debug!(
                            event_id = p.event_id,
                            subject = p.subject,
                            "already stored"
                        );
                    }
                    None
                }
                Err(e) => {
                    let text = match std::error::Error::source(&e) {
                        Some(s) => format!("{e}: {s}"),
                        None => e.to_string(),
                    };
                    Some((classify(e.kind(), &text), text))
                }
            },
            Outcome::Failed(class, reason) => Some((class, reason)),
        };
        let result = match failed {
            None => Ok(()),
            Some((class, reason)) => {
                let rejected = class.is_about_the_message().then(|| RejectedRecord {
                    key: p.key.map(|k| k.to_vec()),
                    headers: p.headers,
                    value_len: p.value_len,
                });
                Err(DeliveryError {
                    event_id: p.event_id,
                    topic: p.subject,
                    class,
                    reason,
                    rejected,
                })
            }
        };
        let _ = tx.send(Delivery {
            token: p.token,
            result,
        });
        in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Sink for NatsSink {
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        if self.aborted {
            return Ok(());
        }
        let subject = event.topic.clone();
        let mut pending = Pending {
            token,
            event_id: event.event_id.clone(),
            subject: subject.clone(),
            outcome: Outcome::Failed(DeliveryClass::BrokerError, String::new()),
            key: event.key.clone(),
            headers: event
                .headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_vec()))
                .collect(),
            value_len: event.value.len(),
        };
        if !valid_subject(&subject) {
            self.session().await?;
            pending.outcome = Outcome::Failed(
                DeliveryClass::InvalidTopic,
                "not a NATS subject (empty token, wildcard or white space)".into(),
            );
            self.queue(pending);
            return Ok(());
        }
        let stream = self.stream_of(&subject).await?;
        let headers = match headers_of(&event, self.last_id.get(&stream).map(String::as_str)) {
            Ok(h) => h,
            Err(reason) => {
                pending.outcome = Outcome::Failed(DeliveryClass::InvalidRecord, reason);
                self.queue(pending);
                return Ok(());
            }
        };
        let size = wire_len(&headers) + event.value.len();
        let max_payload = self.session().await?.js.client().server_info().max_payload;
        let limit = match self.max_size.get(&stream) {
            Some(m) if *m >= 0 => max_payload.min(usize::try_from(*m).unwrap_or(usize::MAX)),
            _ => max_payload,
        };
        if size > limit {
            pending.outcome = Outcome::Failed(
                DeliveryClass::MessageTooLarge,
                format!(
                    "{size} bytes (headers and value) is more than stream {stream} or the server \
                     takes ({limit} bytes)"
                ),
            );
            self.queue(pending);
            return Ok(());
        }
        let js = self.session().await?.js.clone();
        let publish = jetstream::message::PublishMessage::build()
            .payload(event.value.clone())
            .headers(headers);
        pending.outcome = match js.send_publish(subject, publish).await {
            Ok(fut) => {
                self.last_id.insert(stream, event.event_id.clone());
                Outcome::Wait(fut)
            }
            Err(e) => {
                let text = e.to_string();
                Outcome::Failed(classify(e.kind(), &text), text)
            }
        };
        self.queue(pending);
        Ok(())
    }

    fn abort(&mut self) {
        // Nothing more is published in this session; what was sent is
        // reported as the server answers.
        self.aborted = true;
    }

    async fn flush(&mut self, timeout: Duration) -> Result<(), SinkError> {
        let deadline = Instant::now() + timeout;
        if let Some(s) = &self.session {
            let client = s.js.client();
            let _ = tokio::time::timeout(timeout, client.flush()).await;
        }
        while self.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_print_no_secret_and_conflicts_are_named() {
        let c = NatsSinkConfig {
            user: Some("walbox".into()),
            password: Some("pw-51c3e0".into()),
            ..NatsSinkConfig::default()
        };
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("pw-51c3e0") && shown.contains("walbox"),
            "{shown}"
        );
        let c = NatsSinkConfig {
            token: Some("tk-77d1".into()),
            nkey_seed: Some("SUAB-9f".into()),
            ..NatsSinkConfig::default()
        };
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("tk-77d1") && !shown.contains("SUAB-9f"),
            "{shown}"
        );
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("set one of them"), "{err}");
        assert!(!err.contains("tk-77d1"), "{err}");
        let c = NatsSinkConfig {
            duplicate_window_s: 0,
            ..NatsSinkConfig::default()
        };
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("duplicate_window_s")
        );
    }

    #[test]
    fn the_header_size_is_what_nats_sends() {
        let mut h = HeaderMap::new();
        h.append("event_id", "e1");
        h.append("Nats-Msg-Id", "e1");
        // NATS/1.0\r\n event_id: e1\r\n Nats-Msg-Id: e1\r\n \r\n
        assert_eq!(wire_len(&h), 10 + 14 + 17 + 2);
    }

    #[test]
    fn subjects_and_failures_are_classified() {
        assert!(valid_subject("outbox.order"));
        assert!(valid_subject("outbox.order.dlq"));
        for s in ["", "a..b", ".a", "a.", "a.*", "a.>", "a b"] {
            assert!(!valid_subject(s), "{s}");
        }
        assert_eq!(
            classify(PublishErrorKind::MaxPayloadExceeded, ""),
            DeliveryClass::MessageTooLarge
        );
        assert_eq!(
            classify(
                PublishErrorKind::Other,
                "publish failed: message size exceeds maximum allowed"
            ),
            DeliveryClass::MessageTooLarge
        );
        assert_eq!(
            classify(PublishErrorKind::TimedOut, ""),
            DeliveryClass::Timeout
        );
        assert_eq!(
            classify(PublishErrorKind::WrongLastMessageId, ""),
            DeliveryClass::BrokerError
        );
    }
}
