//! The settings of the RabbitMQ sink (`[sink.rabbitmq]`), their checks, and
//! the connections they describe: AMQP 0-9-1 for exchange mode, the stream
//! protocol for stream mode, both with the same host, virtual host,
//! credentials and TLS. Credentials come from the keys `user` and `password`
//! or from `WALBOX_RABBITMQ_USER` / `WALBOX_RABBITMQ_PASSWORD`; they are never
//! printed (the `Debug` form hides the password, and [`secrets`] hands them
//! to the log's redaction).
//!
//! [`secrets`]: RabbitMqSinkConfig::secrets

use std::path::PathBuf;

use serde::Deserialize;

use crate::SinkError;
use crate::secrets::Hidden;

/// How the RabbitMQ sink publishes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RabbitMqMode {
    /// AMQP 0-9-1: to an exchange, routing key = topic, publisher confirms.
    #[default]
    Exchange,
    /// The stream protocol: one stream per topic, a named producer whose
    /// publishing ids come from the event's position (deduplicated).
    Stream,
}

/// Settings of the RabbitMQ sink (`[sink.rabbitmq]`). Its `Debug` form hides
/// the password.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RabbitMqSinkConfig {
    /// `exchange` (AMQP 0-9-1) or `stream` (RabbitMQ Streams).
    #[serde(default)]
    pub mode: RabbitMqMode,
    /// The broker's host.
    #[serde(default = "default_host")]
    pub host: String,
    /// Its AMQP port (5672, or 5671 with TLS).
    #[serde(default)]
    pub port: Option<u16>,
    /// Its stream protocol port (5552, or 5551 with TLS).
    #[serde(default)]
    pub stream_port: Option<u16>,
    /// The virtual host.
    #[serde(default = "default_vhost")]
    pub vhost: String,
    /// User name (else `WALBOX_RABBITMQ_USER`, else `guest`).
    #[serde(default)]
    pub user: Option<String>,
    /// Password (else `WALBOX_RABBITMQ_PASSWORD`, else `guest`).
    #[serde(default)]
    pub password: Option<String>,
    /// Connect with TLS.
    #[serde(default)]
    pub tls: bool,
    /// CA certificates (PEM) that sign the server's certificate (TLS).
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM), with `client_key` (TLS).
    #[serde(default)]
    pub client_cert: Option<PathBuf>,
    /// Client private key (PEM, PKCS#8), with `client_cert` (TLS).
    #[serde(default)]
    pub client_key: Option<PathBuf>,
    /// Exchange mode: the exchange events are published to.
    #[serde(default = "default_exchange")]
    pub exchange: String,
    /// Exchange mode: the type of a declared exchange (`topic`, `direct`,
    /// `fanout`, `headers`).
    #[serde(default = "default_exchange_type")]
    pub exchange_type: String,
    /// Declare what is missing (exchange mode: the exchange, durable; stream
    /// mode: each topic's stream). Off: it must exist (checked passively).
    #[serde(default)]
    pub declare: bool,
    /// Exchange mode: a queue `walbox verify` reads back (bound by the user to
    /// the exchange, durable); its messages are taken back unacknowledged.
    #[serde(default)]
    pub verify_queue: Option<String>,
    /// Exchange mode: the queue `walbox dlq replay` reads dead letters from
    /// (bound by the user to the exchange for the `{topic}.dlq` routing keys,
    /// e.g. `#.dlq` on a topic exchange, durable).
    #[serde(default)]
    pub dead_letter_queue: Option<String>,
    /// Stream mode: the producer name's base; walbox appends the epoch of the
    /// position (see the sink's documentation). Default `walbox.{slot}`.
    #[serde(default)]
    pub producer: Option<String>,
    /// How long the oldest event waiting may go without a confirm, in ms:
    /// timed from its publishing or the confirm of the event before it,
    /// whichever is later.
    #[serde(default = "default_confirm_timeout_ms")]
    pub confirm_timeout_ms: u64,
    /// How long to wait for a connection, in ms.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Most events in flight (the relay's bound); set from `sink.max_in_flight`.
    #[serde(skip, default = "default_max_in_flight")]
    pub max_in_flight: usize,
}

fn default_host() -> String {
    "127.0.0.1".into()
}
fn default_vhost() -> String {
    "/".into()
}
fn default_exchange() -> String {
    "outbox".into()
}
fn default_exchange_type() -> String {
    "topic".into()
}
fn default_confirm_timeout_ms() -> u64 {
    10_000
}
fn default_connect_timeout_ms() -> u64 {
    5_000
}
fn default_max_in_flight() -> usize {
    10_000
}

impl Default for RabbitMqSinkConfig {
    fn default() -> Self {
        RabbitMqSinkConfig {
            mode: RabbitMqMode::default(),
            host: default_host(),
            port: None,
            stream_port: None,
            vhost: default_vhost(),
            user: None,
            password: None,
            tls: false,
            ca_file: None,
            client_cert: None,
            client_key: None,
            exchange: default_exchange(),
            exchange_type: default_exchange_type(),
            declare: false,
            verify_queue: None,
            dead_letter_queue: None,
            producer: None,
            confirm_timeout_ms: default_confirm_timeout_ms(),
            connect_timeout_ms: default_connect_timeout_ms(),
            max_in_flight: default_max_in_flight(),
        }
    }
}

impl std::fmt::Debug for RabbitMqSinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqSinkConfig")
            .field("mode", &self.mode)
            .field("host", &self.host)
            .field("port", &self.port)
            .field("stream_port", &self.stream_port)
            .field("vhost", &self.vhost)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| Hidden))
            .field("tls", &self.tls)
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("client_key", &self.client_key)
            .field("exchange", &self.exchange)
            .field("exchange_type", &self.exchange_type)
            .field("declare", &self.declare)
            .field("verify_queue", &self.verify_queue)
            .field("dead_letter_queue", &self.dead_letter_queue)
            .field("producer", &self.producer)
            .field("confirm_timeout_ms", &self.confirm_timeout_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("max_in_flight", &self.max_in_flight)
            .finish()
    }
}

/// The environment variable a user name may come from.
pub const USER_ENV: &str = "WALBOX_RABBITMQ_USER";
/// The environment variable a password may come from.
pub const PASSWORD_ENV: &str = "WALBOX_RABBITMQ_PASSWORD";

impl RabbitMqSinkConfig {
    /// Takes the user and password from the environment where the file gives
    /// none.
    pub fn apply_environment(&mut self) {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        if self.user.is_none() {
            self.user = var(USER_ENV);
        }
        if self.password.is_none() {
            self.password = var(PASSWORD_ENV);
        }
    }

    /// Checks the settings that need no server.
    pub fn validate(&self) -> Result<(), SinkError> {
        let bad = |m: &str| Err(SinkError::Config(format!("sink.rabbitmq.{m}")));
        if self.host.is_empty() {
            return bad("host: must not be empty");
        }
        if self.client_cert.is_some() != self.client_key.is_some() {
            return bad("client_cert and client_key: set both or neither");
        }
        if !self.tls
            && (self.ca_file.is_some() || self.client_cert.is_some() || self.client_key.is_some())
        {
            return bad("tls: ca_file, client_cert and client_key need tls = true");
        }
        if self.exchange.len() > 255 {
            return bad("exchange: at most 255 bytes");
        }
        if !["topic", "direct", "fanout", "headers"].contains(&self.exchange_type.as_str()) {
            return bad("exchange_type: topic, direct, fanout or headers");
        }
        if self.mode == RabbitMqMode::Exchange && self.exchange.is_empty() {
            return bad(
                "exchange: name an exchange (the default exchange routes by queue name and \
                 cannot be declared or checked)",
            );
        }
        if self
            .producer
            .as_deref()
            .is_some_and(|p| p.is_empty() || p.len() > 200)
        {
            return bad("producer: 1 to 200 bytes");
        }
        if self.confirm_timeout_ms == 0 {
            return bad("confirm_timeout_ms: must be at least 1");
        }
        Ok(())
    }

    /// The user name.
    #[must_use]
    pub fn user(&self) -> &str {
        self.user.as_deref().unwrap_or("guest")
    }

    /// The password (never print it).
    pub(crate) fn password(&self) -> &str {
        self.password.as_deref().unwrap_or("guest")
    }

    /// The AMQP port.
    #[must_use]
    pub fn amqp_port(&self) -> u16 {
        self.port.unwrap_or(if self.tls { 5671 } else { 5672 })
    }

    /// The stream protocol port.
    #[must_use]
    pub fn stream_port(&self) -> u16 {
        self.stream_port
            .unwrap_or(if self.tls { 5551 } else { 5552 })
    }

    /// Where walbox connects, as it may be printed (no credentials).
    #[must_use]
    pub fn describe(&self) -> String {
        let port = match self.mode {
            RabbitMqMode::Exchange => self.amqp_port(),
            RabbitMqMode::Stream => self.stream_port(),
        };
        format!(
            "{}://{}:{port} (vhost {:?}, user {:?})",
            if self.tls { "tls" } else { "tcp" },
            self.host,
            self.vhost,
            self.user()
        )
    }

    /// Every secret these settings hold, so that a log can keep them out.
    #[must_use]
    pub fn secrets(&self) -> Vec<String> {
        self.password
            .iter()
            .filter(|p| !p.is_empty())
            .cloned()
            .collect()
    }

    /// Reads a PEM file named by a setting.
    pub(crate) fn read(&self, key: &str, path: &PathBuf) -> Result<Vec<u8>, SinkError> {
        std::fs::read(path).map_err(|e| {
            SinkError::Config(format!(
                "sink.rabbitmq.{key}: reading {}: {e}",
                path.display()
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_never_shows_and_bad_settings_are_named() {
        let c = RabbitMqSinkConfig {
            password: Some("s3cret-pw".into()),
            user: Some("walbox".into()),
            ..Default::default()
        };
        let shown = format!("{c:?} {}", c.describe());
        assert!(!shown.contains("s3cret-pw"), "{shown}");
        assert!(shown.contains("walbox"), "{shown}");
        assert_eq!(c.secrets(), ["s3cret-pw"]);
        c.validate().unwrap();
        let no_tls = RabbitMqSinkConfig {
            ca_file: Some("/ca.pem".into()),
            ..Default::default()
        };
        let e = no_tls.validate().unwrap_err().to_string();
        assert!(e.contains("sink.rabbitmq.tls"), "{e}");
        let half = RabbitMqSinkConfig {
            tls: true,
            client_cert: Some("/c.pem".into()),
            ..Default::default()
        };
        assert!(
            half.validate()
                .unwrap_err()
                .to_string()
                .contains("client_key")
        );
        let empty = RabbitMqSinkConfig {
            exchange: String::new(),
            ..Default::default()
        };
        assert!(empty.validate().is_err());
        assert_eq!(RabbitMqSinkConfig::default().amqp_port(), 5672);
        let tls = RabbitMqSinkConfig {
            tls: true,
            ..Default::default()
        };
        assert_eq!((tls.amqp_port(), tls.stream_port()), (5671, 5551));
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e = toml::from_str::<RabbitMqSinkConfig>("exchnage = \"x\"").unwrap_err();
        assert!(e.to_string().contains("exchnage"), "{e}");
    }
}
