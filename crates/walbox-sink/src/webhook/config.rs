//! The settings of the webhook sink (`[sink.webhook]`), their checks, the
//! signing secrets (from the file or the environment, never shown) and the
//! HTTP client they describe (timeouts, redirects, TLS).
//!
//! A password in the URL (basic authentication) is never shown, whatever it
//! holds: the URL's user information is taken to run to its last `@`, so a
//! password written with `/`, `?`, `#` or `@` unencoded is hidden whole.
//! The URL, a template, is checked with its fields filled in by a plain value
//! (`x`, or `0` where a number is wanted): one that does not parse so is
//! refused at start, not found out event by event.

use std::path::PathBuf;
use std::time::Duration;

use base64::Engine as _;
use serde::Deserialize;
use walbox_outbox::{TemplateError, TopicTemplate};

use crate::SinkError;
use crate::secrets::{Hidden, url_password};

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
            .field("url", &self.shown_url())
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
        let template = self.template()?;
        if !(self.url.starts_with("http://") || self.url.starts_with("https://")) {
            return bad(format!(
                "url: {:?} is not an http:// or https:// URL",
                self.shown_url()
            ));
        }
        self.check_filled_in(&template)?;
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

    /// The URL template. Its error does not quote the URL (the template
    /// error would): it may hold a password.
    pub(super) fn template(&self) -> Result<TopicTemplate, SinkError> {
        TopicTemplate::parse(&self.url).map_err(|e| {
            let why = match e {
                TemplateError::Unclosed(_) => "a '{' without its '}'",
                TemplateError::EmptyField(_) => "an empty '{}'",
                TemplateError::StrayClose(_) => "a '}' without its '{'",
                TemplateError::Empty => "empty",
            };
            SinkError::Config(format!("sink.webhook.url: {why}"))
        })
    }

    /// Checks that `template` gives a URL once its fields are filled in (by
    /// `x`, or else `0`, for a field that stands for a port). The error says
    /// what is wrong, never the URL.
    fn check_filled_in(&self, template: &TopicTemplate) -> Result<(), SinkError> {
        let mut first = None;
        for fill in ["x", "0"] {
            let url = template
                .render(|_, _| Ok::<_, std::convert::Infallible>(fill))
                .unwrap_or_else(|never| match never {});
            match reqwest::Url::parse(&url) {
                Ok(_) => return Ok(()),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        let why = first.map_or_else(String::new, |e| format!(" ({e})"));
        // An `@` past the authority a parser sees: a password holding `/`,
        // `?` or `#` as it is, most likely.
        let hint = if url_password(&self.url) != self.parsed_password_range() {
            "; a password holding '/', '?', '#' or '@' is written percent-encoded (%2F, %3F, \
             %23, %40)"
        } else {
            ""
        };
        Err(SinkError::Config(format!(
            "sink.webhook.url: not a valid URL with its fields filled in{why}{hint}"
        )))
    }

    /// The URL as logs and errors may show it: its password hidden.
    fn shown_url(&self) -> String {
        match url_password(&self.url) {
            Some(r) => format!("{}<hidden>{}", &self.url[..r.start], &self.url[r.end..]),
            None => self.url.clone(),
        }
    }

    /// Every secret's text, as given (for the log's redaction): the signing
    /// secrets, and the password of the URL's user information (sent as
    /// basic authentication): as written up to the URL's last `@`, and as a
    /// URL parser reads it (up to the last `@` before the first `/`, `?` or
    /// `#`), each percent-decoded too and in the Authorization header's form.
    #[must_use]
    pub fn secrets(&self) -> Vec<String> {
        let mut all = self.signing_secrets();
        let decode = |t: &str| {
            percent_encoding::percent_decode_str(t)
                .decode_utf8_lossy()
                .into_owned()
        };
        let start = self.url.find("://").map_or(0, |i| i + 3);
        for range in [url_password(&self.url), self.parsed_password_range()]
            .into_iter()
            .flatten()
        {
            let written = &self.url[range.clone()];
            let password = decode(written);
            let user = self
                .url
                .get(start..range.start.saturating_sub(1))
                .map(decode)
                .unwrap_or_default();
            // And as the Authorization header carries it.
            all.push(
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}")),
            );
            all.push(written.to_owned());
            all.push(password);
        }
        let mut seen = std::collections::HashSet::new();
        all.retain(|s| !s.is_empty() && seen.insert(s.clone()));
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

    /// Where a URL parser finds the password (the authority ending at the
    /// first `/`, `?` or `#`): what basic authentication sends.
    fn parsed_password_range(&self) -> Option<std::ops::Range<usize>> {
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

    #[test]
    fn a_password_holding_slashes_question_marks_hashes_or_ats_never_shows() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        for (url, password, parses) in [
            ("https://user:Ab1/Cd2@example.com/hook", "Ab1/Cd2", false),
            ("https://user:Ab1?Cd2@example.com/{topic}", "Ab1?Cd2", false),
            ("https://user:Ab1#Cd2@example.com/", "Ab1#Cd2", false),
            ("https://user:Ab1@Cd2@example.com/{key}", "Ab1@Cd2", true),
            ("ftp://user:Ab1/Cd2@example.com/", "Ab1/Cd2", false),
            ("https://user:Ab1-Cd2@example.com/{", "Ab1-Cd2", false),
        ] {
            let c = config(url, secret);
            let hidden = |text: &str| {
                for part in ["Ab1", "Cd2"] {
                    assert!(!text.contains(part), "{url}: {text}");
                }
            };
            hidden(&format!("{c:?}"));
            hidden(&c.shown_url());
            match c.validate() {
                Ok(()) => assert!(parses, "{url}: a URL that does not parse passed"),
                Err(e) => {
                    let e = e.to_string();
                    hidden(&e);
                    assert!(!parses, "{url}: {e}");
                    assert!(e.contains("sink.webhook.url: "), "{url}: {e}");
                }
            }
            assert!(
                c.secrets().iter().any(|s| s == password),
                "{url}: the password is kept out of the log"
            );
        }
    }

    #[test]
    fn a_url_that_does_not_parse_once_filled_in_is_refused_by_key() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        for url in [
            "https://exa mple.com/{topic}",
            "https://h.example:99999/{topic}",
            "https://[::1/{topic}",
            "https://{tenant} x.example/",
        ] {
            let e = config(url, secret).validate().expect_err(url).to_string();
            assert!(e.contains("sink.webhook.url: "), "{url}: {e}");
        }
        for url in [
            "https://h.example/in/{topic}/{key}?tenant={tenant}",
            "https://{tenant}.hooks.example/{topic}",
            "http://127.0.0.1:8080/{aggregate_type}",
        ] {
            config(url, secret).validate().expect(url);
        }
    }
}
