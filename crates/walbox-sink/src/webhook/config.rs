//! The settings of the webhook sink (`[sink.webhook]`), their checks, the
//! signing secrets (from the file or the environment, never shown) and the
//! HTTP client they describe (timeouts, redirects, TLS).

use std::path::PathBuf;
use std::time::Duration;

use base64::Engine as _;
use serde::Deserialize;
use walbox_outbox::TopicTemplate;

use crate::SinkError;
use crate::secrets::Hidden;

/// Settings of the webhook sink (`[sink.webhook]`). Its `Debug` form hides the
/// secrets.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookSinkConfig {
    /// The URL each event is POSTed to: fixed, or a template whose fields are
    /// `{topic}`, `{key}` or the name of one of the record's headers
    /// (`https://hooks.example.com/{aggregate_type}`); values are
    /// percent-encoded.
    pub url: String,
    /// Signing secrets (`whsec_` + base64), newest first: every request is
    /// signed with each (rotation).
    #[serde(default)]
    pub secrets: Vec<String>,
    /// Environment variables holding more secrets (read at start).
    #[serde(default)]
    pub secret_env: Vec<String>,
    /// How long to wait for a connection, in ms.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// How long one attempt may take, response included, in ms.
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// The first retry's delay, in ms; it doubles per attempt, with jitter.
    #[serde(default = "default_retry_initial_ms")]
    pub retry_initial_ms: u64,
    /// The longest delay between attempts, in ms.
    #[serde(default = "default_retry_max_ms")]
    pub retry_max_ms: u64,
    /// How long an event is retried before it is dead-lettered, in seconds.
    #[serde(default = "default_max_retry_duration_s")]
    pub max_retry_duration_s: u64,
    /// Follow 307 and 308 redirects (up to 5), which resend the POST as it
    /// was. Off, and for any other 3xx: walbox stops.
    #[serde(default)]
    pub follow_redirects: bool,
    /// Most requests open at once (connections under HTTP/1.1).
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// CA certificates (PEM) trusted besides the system's.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM), with `client_key`.
    #[serde(default)]
    pub client_cert: Option<PathBuf>,
    /// Client private key (PEM), with `client_cert`.
    #[serde(default)]
    pub client_key: Option<PathBuf>,
    /// The append-only file dead letters go to (JSON lines, fsynced before
    /// they count as delivered). Default: `walbox-<slot>.dead-letters.jsonl`.
    #[serde(default)]
    pub dead_letter_file: Option<PathBuf>,
    /// Most events in flight (the relay's bound); set from `sink.max_in_flight`.
    #[serde(skip, default = "default_max_in_flight")]
    pub max_in_flight: usize,
}

fn default_connect_timeout_ms() -> u64 {
    5_000
}
fn default_request_timeout_ms() -> u64 {
    30_000
}
fn default_retry_initial_ms() -> u64 {
    1_000
}
fn default_retry_max_ms() -> u64 {
    60_000
}
/// One hour: past the Standard Webhooks schedule's first steps, short enough
/// that a held key does not grow the slot's retained WAL for days.
fn default_max_retry_duration_s() -> u64 {
    3_600
}
fn default_max_connections() -> usize {
    64
}
fn default_max_in_flight() -> usize {
    10_000
}

impl Default for WebhookSinkConfig {
    fn default() -> Self {
        WebhookSinkConfig {
            url: String::new(),
            secrets: Vec::new(),
            secret_env: Vec::new(),
            connect_timeout_ms: default_connect_timeout_ms(),
            request_timeout_ms: default_request_timeout_ms(),
            retry_initial_ms: default_retry_initial_ms(),
            retry_max_ms: default_retry_max_ms(),
            max_retry_duration_s: default_max_retry_duration_s(),
            follow_redirects: false,
            max_connections: default_max_connections(),
            ca_file: None,
            client_cert: None,
            client_key: None,
            dead_letter_file: None,
            max_in_flight: default_max_in_flight(),
        }
    }
}

impl std::fmt::Debug for WebhookSinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden: Vec<Hidden> = self.secrets.iter().map(|_| Hidden).collect();
        f.debug_struct("WebhookSinkConfig")
            .field(
                "url",
                &match self.url_password_range() {
                    Some(r) => format!("{}<hidden>{}", &self.url[..r.start], &self.url[r.end..]),
                    None => self.url.clone(),
                },
            )
            .field("secrets", &hidden)
            .field("secret_env", &self.secret_env)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("request_timeout_ms", &self.request_timeout_ms)
            .field("retry_initial_ms", &self.retry_initial_ms)
            .field("retry_max_ms", &self.retry_max_ms)
            .field("max_retry_duration_s", &self.max_retry_duration_s)
            .field("follow_redirects", &self.follow_redirects)
            .field("max_connections", &self.max_connections)
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("client_key", &self.client_key)
            .field("dead_letter_file", &self.dead_letter_file)
            .field("max_in_flight", &self.max_in_flight)
            .finish()
    }
}

/// The prefix of a Standard Webhooks symmetric secret.
const SECRET_PREFIX: &str = "whsec_";

impl WebhookSinkConfig {
    /// Checks the settings that need no receiver.
    pub fn validate(&self) -> Result<(), SinkError> {
        let bad = |m: String| Err(SinkError::Config(format!("sink.webhook.{m}")));
        self.template()?;
        if !(self.url.starts_with("http://") || self.url.starts_with("https://")) {
            return bad(format!(
                "url: {:?} is not an http:// or https:// URL",
                self.url
            ));
        }
        if self.keys()?.is_empty() {
            return bad(
                "secrets: give at least one signing secret (whsec_...), in secrets or through \
                 secret_env"
                    .into(),
            );
        }
        if self.client_cert.is_some() != self.client_key.is_some() {
            return bad("client_cert and client_key: set both or neither".into());
        }
        if self.max_connections == 0 {
            return bad("max_connections: must be at least 1".into());
        }
        if self.request_timeout_ms == 0 || self.connect_timeout_ms == 0 {
            return bad("request_timeout_ms and connect_timeout_ms: must be at least 1".into());
        }
        if self.retry_initial_ms == 0 || self.retry_max_ms < self.retry_initial_ms {
            return bad("retry_initial_ms: must be at least 1 and at most retry_max_ms".into());
        }
        Ok(())
    }

    /// The URL template.
    pub(super) fn template(&self) -> Result<TopicTemplate, SinkError> {
        TopicTemplate::parse(&self.url)
            .map_err(|e| SinkError::Config(format!("sink.webhook.url: {e}")))
    }

    /// Every secret's text, as given (for the log's redaction): the signing
    /// secrets, and the password of the URL's user information (sent as
    /// basic authentication).
    #[must_use]
    pub fn secrets(&self) -> Vec<String> {
        let mut all = self.signing_secrets();
        if let Some(password) = self.url_password() {
            // And as the Authorization header carries it.
            let user = self
                .url_password_range()
                .and_then(|r| {
                    let start = self.url.find("://")? + 3;
                    self.url.get(start..r.start - 1)
                })
                .map(|u| {
                    percent_encoding::percent_decode_str(u)
                        .decode_utf8_lossy()
                        .into_owned()
                })
                .unwrap_or_default();
            all.push(
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}")),
            );
            all.push(password);
        }
        all
    }

    /// The signing secrets' text, as given.
    fn signing_secrets(&self) -> Vec<String> {
        let mut all = self.secrets.clone();
        all.extend(
            self.secret_env
                .iter()
                .filter_map(|name| std::env::var(name).ok()),
        );
        all
    }

    /// The password in the URL's user information (`https://user:password@host/`).
    fn url_password(&self) -> Option<String> {
        self.url_password_as_written().map(|p| {
            percent_encoding::percent_decode_str(p)
                .decode_utf8_lossy()
                .into_owned()
        })
    }

    /// [`Self::url_password`] as the URL writes it (percent-encoded).
    fn url_password_as_written(&self) -> Option<&str> {
        self.url_password_range().map(|r| &self.url[r])
    }

    /// Where the URL holds its password.
    fn url_password_range(&self) -> Option<std::ops::Range<usize>> {
        let start = self.url.find("://")? + 3;
        let rest = &self.url[start..];
        let authority = rest.split(['/', '?', '#']).next()?;
        let at = authority.rfind('@')?;
        let colon = authority[..at].find(':')?;
        (colon + 1 < at).then(|| start + colon + 1..start + at)
    }

    /// The signing keys: each secret without `whsec_`, base64-decoded.
    pub(super) fn keys(&self) -> Result<Vec<Vec<u8>>, SinkError> {
        for name in &self.secret_env {
            if std::env::var_os(name).is_none() {
                return Err(SinkError::Config(format!(
                    "sink.webhook.secret_env: the environment variable {name} is not set"
                )));
            }
        }
        self.signing_secrets()
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let b64 = s.strip_prefix(SECRET_PREFIX).unwrap_or(s);
                let key = base64::engine::general_purpose::STANDARD
                    .decode(b64.trim_end_matches('='))
                    .or_else(|_| {
                        base64::engine::general_purpose::STANDARD_NO_PAD
                            .decode(b64.trim_end_matches('='))
                    })
                    .map_err(|_| {
                        SinkError::Config(format!(
                            "sink.webhook.secrets: secret {} is not whsec_ followed by base64",
                            i + 1
                        ))
                    })?;
                if key.is_empty() {
                    return Err(SinkError::Config(format!(
                        "sink.webhook.secrets: secret {} is empty",
                        i + 1
                    )));
                }
                Ok(key)
            })
            .collect()
    }

    /// The longest an event is retried.
    pub(super) fn max_retry_duration(&self) -> Duration {
        Duration::from_secs(self.max_retry_duration_s)
    }

    /// The HTTP client: connection reuse, HTTP/2 where the server offers it
    /// (ALPN), the configured timeouts, redirects and TLS, no proxy.
    pub(super) fn client(&self) -> Result<reqwest::Client, SinkError> {
        let read = |p: &PathBuf| {
            std::fs::read(p).map_err(|e| {
                SinkError::Config(format!("sink.webhook: reading {}: {e}", p.display()))
            })
        };
        let mut b = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_millis(self.connect_timeout_ms))
            .timeout(Duration::from_millis(self.request_timeout_ms))
            .pool_max_idle_per_host(self.max_connections)
            .redirect(if self.follow_redirects {
                // Only 307 and 308 resend the POST with its body: a 301, 302
                // or 303 would turn it into a GET without the event, whose
                // 2xx would read as delivered. Those are returned (and stop
                // walbox as a moved endpoint).
                reqwest::redirect::Policy::custom(|attempt| {
                    let keeps_the_post = matches!(attempt.status().as_u16(), 307 | 308);
                    if keeps_the_post && attempt.previous().len() <= 5 {
                        attempt.follow()
                    } else {
                        attempt.stop()
                    }
                })
            } else {
                reqwest::redirect::Policy::none()
            })
            .user_agent(concat!("walbox/", env!("CARGO_PKG_VERSION")));
        if let Some(ca) = &self.ca_file {
            let pem = read(ca)?;
            for cert in reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
                SinkError::Config(format!("sink.webhook.ca_file {}: {e}", ca.display()))
            })? {
                b = b.add_root_certificate(cert);
            }
        }
        if let (Some(cert), Some(key)) = (&self.client_cert, &self.client_key) {
            let mut pem = read(cert)?;
            pem.push(b'\n');
            pem.extend(read(key)?);
            let identity = reqwest::Identity::from_pem(&pem).map_err(|e| {
                SinkError::Config(format!(
                    "sink.webhook.client_cert/client_key {}: {e}",
                    cert.display()
                ))
            })?;
            b = b.identity(identity);
        }
        b.build()
            .map_err(|e| SinkError::Config(format!("sink.webhook: building the client: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(url: &str, secret: &str) -> WebhookSinkConfig {
        WebhookSinkConfig {
            url: url.into(),
            secrets: vec![secret.into()],
            ..Default::default()
        }
    }

    #[test]
    fn secrets_are_whsec_base64_and_never_shown() {
        let c = config(
            "https://h.example/{topic}",
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        );
        c.validate().unwrap();
        assert_eq!(c.keys().unwrap()[0].len(), 24);
        assert!(!format!("{c:?}").contains("MfKQ9r8"));
        assert!(config("https://h.example/", "whsec_!!").validate().is_err());
        assert!(config("https://h.example/", "whsec_").validate().is_err());
        assert!(
            config("ftp://h.example/", "whsec_aGVsbG8=")
                .validate()
                .is_err()
        );
        assert!(
            config("https://h.example/{", "whsec_aGVsbG8=")
                .validate()
                .is_err()
        );
        let basic = config(
            "https://walbox:s3cr%2Ft@h.example/{topic}",
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        );
        basic.validate().unwrap();
        assert!(
            basic.secrets().contains(&"s3cr/t".to_owned()),
            "{:?}",
            basic.secrets()
        );
        assert!(!format!("{basic:?}").contains("s3cr"));
        assert!(format!("{basic:?}").contains("https://walbox:<hidden>@h.example/"));
        let none = WebhookSinkConfig {
            url: "https://h.example/".into(),
            ..Default::default()
        };
        assert!(none.validate().is_err());
    }
}
