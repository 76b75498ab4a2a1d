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
//! task ([`report`]) in publish order, without waiting for each one's frames to be
//! written; after a failure nothing more of the session is started: later
//! events fail unsent, and [`Sink::abort`] closes the channel.
//!
//! A resend after a crash is stored again (AMQP 0-9-1 has no deduplication):
//! at least once, every copy with the same `message_id`.

mod report;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::{AMQPAuthority, AMQPQueryString, AMQPScheme, AMQPUri, AMQPUserInfo};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::mpsc;
use walbox_outbox::Event;

use super::RabbitMqSinkConfig;
use super::confirms::Answer;
use crate::kit::{self, Close, Lifecycle, Reports, SessionTask};
use crate::nats::{DROPPED_HEADERS_HEADER, KEY_HEADER, is_dead_letter, percent_encode};
use crate::{Deliveries, DeliveryClass, Sink, SinkError};
use report::{Confirmed, Published, Start, confirmed, report};

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

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use walbox_outbox::Position;

    pub(super) fn event(headers: Vec<(&str, &str)>) -> Event {
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
