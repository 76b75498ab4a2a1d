//! The settings of the Redis Streams sink (`[sink.redis]`), their checks, and
//! the connection they describe. The password may come in the URL
//! (`redis://user:password@host:6379/0`), in `password`, or in the
//! environment (`WALBOX_REDIS_PASSWORD`, read by the binary), never from two
//! of them; no `Debug` form or error shows it, whatever it holds (the URL's
//! user information is taken to run to its last `@`, so a password written
//! with `/`, `?`, `#` or `@` unencoded is hidden whole).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::SinkError;
use crate::secrets::{Hidden, url_password, url_userinfo};

/// Settings of the Redis Streams sink (`[sink.redis]`).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisSinkConfig {
    /// `redis://[user[:password]@]host[:port][/db]`, or `rediss://` for TLS.
    #[serde(default = "default_url")]
    pub url: String,
    /// ACL user name (overrides one in the URL).
    #[serde(default)]
    pub username: Option<String>,
    /// Password (or set `WALBOX_REDIS_PASSWORD`); not with one in the URL.
    #[serde(default)]
    pub password: Option<String>,
    /// CA certificates (PEM) that sign the server's certificate (`rediss://`);
    /// without it the system's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM), with `client_key`.
    #[serde(default)]
    pub client_cert: Option<PathBuf>,
    /// Client private key (PEM), with `client_cert`.
    #[serde(default)]
    pub client_key: Option<PathBuf>,
    /// The name this walbox writes into every entry (`walbox_writer`); an
    /// entry of another writer at the top of a stream stops walbox. Default:
    /// the replication slot's name.
    #[serde(default)]
    pub writer: Option<String>,
    /// Trim each stream of events to about this many entries (`XADD MAXLEN
    /// ~`); off when unset. Dead letters are written without trimming: a
    /// stream of dead letters (`{topic}.dlq`) is never trimmed.
    #[serde(default)]
    pub maxlen: Option<u64>,
    /// Trim entries whose commit LSN is more than this many bytes of WAL
    /// below the entry written (`XADD MINID ~`); off when unset. Dead
    /// letters are written without trimming: a stream of dead letters
    /// (`{topic}.dlq`) is never trimmed.
    #[serde(default)]
    pub minid_behind_bytes: Option<u64>,
    /// Go on, with a warning, when the server does not fsync every write
    /// (`appendonly yes`, `appendfsync always`): an acknowledged event may
    /// then be lost when Redis crashes.
    #[serde(default)]
    pub allow_unsynced: bool,
    /// How long to wait for a connection, in ms.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// How long to wait for the server's answer to a batch once it has
    /// reached the batch (the calls before it on the connection answered),
    /// in ms.
    #[serde(default = "default_ack_timeout_ms")]
    pub ack_timeout_ms: u64,
    /// Most events in flight (the relay's bound, and at most 1,000 in one
    /// script call); set from `sink.max_in_flight`.
    #[serde(skip, default = "default_max_in_flight")]
    pub max_in_flight: usize,
}

fn default_url() -> String {
    "redis://127.0.0.1:6379".into()
}
fn default_connect_timeout_ms() -> u64 {
    5_000
}
fn default_ack_timeout_ms() -> u64 {
    10_000
}
fn default_max_in_flight() -> usize {
    10_000
}

impl Default for RedisSinkConfig {
    fn default() -> Self {
        RedisSinkConfig {
            url: default_url(),
            username: None,
            password: None,
            ca_file: None,
            client_cert: None,
            client_key: None,
            writer: None,
            maxlen: None,
            minid_behind_bytes: None,
            allow_unsynced: false,
            connect_timeout_ms: default_connect_timeout_ms(),
            ack_timeout_ms: default_ack_timeout_ms(),
            max_in_flight: default_max_in_flight(),
        }
    }
}

impl std::fmt::Debug for RedisSinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSinkConfig")
            .field("url", &shown_url(&self.url))
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| Hidden))
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("client_key", &self.client_key)
            .field("writer", &self.writer)
            .field("maxlen", &self.maxlen)
            .field("minid_behind_bytes", &self.minid_behind_bytes)
            .field("allow_unsynced", &self.allow_unsynced)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("ack_timeout_ms", &self.ack_timeout_ms)
            .field("max_in_flight", &self.max_in_flight)
            .finish()
    }
}

/// `url` with its user information (all between `://` and the URL's last
/// `@`, whatever the password holds) replaced, and the value of a `pass` or
/// `password` query parameter (a Unix socket's URL gives its password there):
/// what logs and errors may show.
#[must_use]
pub fn shown_url(url: &str) -> String {
    let (head, rest) = match url_userinfo(url) {
        Some(info) => (format!("{}***", &url[..info.start]), &url[info.end..]),
        None => (String::new(), url),
    };
    match rest.split_once('?') {
        Some((before, query)) => format!("{head}{before}?{}", hidden_query(query)),
        None => format!("{head}{rest}"),
    }
}

/// A URL's query with the values of `pass` and `password` replaced.
fn hidden_query(query: &str) -> String {
    query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((k, _))
                if k.eq_ignore_ascii_case("pass") || k.eq_ignore_ascii_case("password") =>
            {
                format!("{k}=***")
            }
            _ => pair.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("&")
}

impl RedisSinkConfig {
    /// Checks the settings that need no server.
    pub fn validate(&self) -> Result<(), SinkError> {
        let bad = |m: &str| Err(SinkError::Config(format!("sink.redis.{m}")));
        let info = self.connection_info()?;
        if info.redis_settings().password().is_some()
            && self.password.is_some()
            && url_has_password(&self.url)
        {
            return bad("password: the URL holds a password too; give it in one place");
        }
        if self.client_cert.is_some() != self.client_key.is_some() {
            return bad("client_cert and client_key: set both or neither");
        }
        let tls = matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. });
        if (self.ca_file.is_some() || self.client_cert.is_some()) && !tls {
            return bad("ca_file, client_cert: TLS settings need a rediss:// URL");
        }
        if self.maxlen.is_some() && self.minid_behind_bytes.is_some() {
            return bad("maxlen and minid_behind_bytes: set one or neither");
        }
        if self.maxlen == Some(0) {
            return bad("maxlen: must be at least 1");
        }
        if self.writer.as_deref().is_some_and(str::is_empty) {
            return bad("writer: must not be empty");
        }
        Ok(())
    }

    /// The secrets these settings hold (the password, one in the URL: as
    /// the client reads it, and as written up to the URL's last `@`), for the
    /// log's redaction.
    #[must_use]
    pub fn secrets(&self) -> Vec<String> {
        let mut out: Vec<String> = self.password.iter().cloned().collect();
        if let Ok(info) = redis::IntoConnectionInfo::into_connection_info(self.url.as_str())
            && let Some(p) = info.redis_settings().password()
        {
            out.push(p.to_owned());
        }
        if let Some(range) = url_password(&self.url) {
            let written = &self.url[range];
            out.push(written.to_owned());
            out.push(
                percent_encoding::percent_decode_str(written)
                    .decode_utf8_lossy()
                    .into_owned(),
            );
        }
        out.retain(|s| !s.is_empty());
        out.sort();
        out.dedup();
        out
    }

    /// The writer name entries carry.
    #[must_use]
    pub fn writer_name(&self) -> &str {
        self.writer.as_deref().unwrap_or("walbox")
    }

    fn connection_info(&self) -> Result<redis::ConnectionInfo, SinkError> {
        let info =
            redis::IntoConnectionInfo::into_connection_info(self.url.as_str()).map_err(|e| {
                SinkError::Config(format!(
                    "sink.redis.url: {:?} is not a Redis URL ({:?})",
                    shown_url(&self.url),
                    e.kind()
                ))
            })?;
        let mut settings = info.redis_settings().clone();
        if let Some(u) = &self.username {
            settings = settings.set_username(u);
        }
        if let Some(p) = &self.password {
            settings = settings.set_password(p);
        }
        Ok(info.set_redis_settings(settings))
    }

    /// A client for these settings (TLS files read here).
    pub(crate) fn client(&self) -> Result<redis::Client, SinkError> {
        let info = self.connection_info()?;
        let read = |p: &PathBuf, what: &str| {
            std::fs::read(p).map_err(|e| {
                SinkError::Config(format!("sink.redis.{what}: reading {}: {e}", p.display()))
            })
        };
        let tls = matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. });
        if tls && (self.ca_file.is_some() || self.client_cert.is_some()) {
            let root_cert = self
                .ca_file
                .as_ref()
                .map(|p| read(p, "ca_file"))
                .transpose()?;
            let client_tls = match (&self.client_cert, &self.client_key) {
                (Some(c), Some(k)) => Some(redis::ClientTlsConfig {
                    client_cert: read(c, "client_cert")?,
                    client_key: read(k, "client_key")?,
                }),
                _ => None,
            };
            redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls,
                    root_cert,
                },
            )
            .map_err(|e| {
                SinkError::Config(format!(
                    "sink.redis TLS settings (ca_file, client_cert, client_key): {e}"
                ))
            })
        } else {
            redis::Client::open(info)
                .map_err(|e| SinkError::Config(format!("sink.redis.url: {:?}", e.kind())))
        }
    }

    /// The connection's timeouts, for a connection where a request may
    /// queue behind `behind` script calls: a request's answer may take its
    /// own `ack_timeout_ms` and theirs. (The writer times each script call
    /// itself, from when the server reaches it.)
    pub(crate) fn connection_config(&self, behind: usize) -> redis::AsyncConnectionConfig {
        let calls = u64::try_from(behind).unwrap_or(u64::MAX).saturating_add(1);
        redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(self.connect_timeout_ms)))
            .set_response_timeout(Some(Duration::from_millis(
                self.ack_timeout_ms.saturating_mul(calls),
            )))
    }

    /// The trimming arguments of an event's entry whose commit LSN is `lsn`
    /// (a dead letter's entry has none).
    pub(crate) fn trim_args(&self, lsn: u64) -> Vec<String> {
        if let Some(n) = self.maxlen {
            vec!["MAXLEN".into(), "~".into(), n.to_string()]
        } else if let Some(behind) = self.minid_behind_bytes {
            match lsn.checked_sub(behind) {
                Some(min) if min > 0 => vec!["MINID".into(), "~".into(), min.to_string()],
                _ => Vec::new(),
            }
        } else {
            Vec::new()
        }
    }
}

/// Whether `url` holds credentials of its own (user information).
fn url_has_password(url: &str) -> bool {
    url_userinfo(url).is_some_and(|info| !info.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<RedisSinkConfig, String> {
        toml::from_str::<RedisSinkConfig>(text).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_parse_and_unknown_keys_are_refused() {
        let c = parse("").expect("empty");
        assert_eq!(c.url, "redis://127.0.0.1:6379");
        assert!(c.maxlen.is_none() && c.minid_behind_bytes.is_none());
        assert!(!c.allow_unsynced);
        c.validate().expect("defaults are valid");
        let e = parse("urll = \"redis://x\"").expect_err("unknown key");
        assert!(e.contains("urll"), "{e}");
    }

    #[test]
    fn the_password_never_shows_in_debug_or_errors() {
        let c = parse("url = \"redis://app:s3cret-pw@db:6380/2\"\npassword = \"other-pw\"")
            .expect("parses");
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("s3cret-pw") && !shown.contains("other-pw"),
            "{shown}"
        );
        assert!(shown.contains("***@db:6380/2"), "{shown}");
        let e = c.validate().expect_err("two passwords").to_string();
        assert!(!e.contains("s3cret-pw") && !e.contains("other-pw"), "{e}");
        let mut secrets = c.secrets();
        secrets.sort();
        assert_eq!(secrets, ["other-pw", "s3cret-pw"]);
        // A Unix socket's URL gives its password in the query (`pass`).
        let unix = parse("url = \"redis+unix:///run/redis.sock?db=1&pass=sock-pw&user=app\"")
            .expect("parses");
        let shown = format!("{unix:?}");
        assert!(!shown.contains("sock-pw"), "{shown}");
        assert!(
            shown.contains("/run/redis.sock?db=1&pass=***&user=app"),
            "{shown}"
        );
        assert_eq!(unix.secrets(), ["sock-pw"]);
        let bad = parse("url = \"http://u:pw-in-bad-url@h\"").expect("parses");
        let e = bad.validate().expect_err("not redis").to_string();
        assert!(!e.contains("pw-in-bad-url"), "{e}");
    }

    #[test]
    fn a_password_holding_slashes_question_marks_hashes_or_ats_never_shows() {
        // Written unencoded, such a password ends the authority early for a
        // URL parser: the user information runs to the URL's last `@`.
        for (url, password) in [
            ("redis://user:Ab1/Cd2@host:6379/0", "Ab1/Cd2"),
            ("redis://:Ab1?Cd2@host", "Ab1?Cd2"),
            ("redis://user:Ab1#Cd2@host:6379", "Ab1#Cd2"),
            ("rediss://user:Ab1@Cd2@host:6380/1", "Ab1@Cd2"),
            (
                "redis://user:Ab1/Cd2?Ef3#@host/0?db=1&pass=Gh4",
                "Ab1/Cd2?Ef3#",
            ),
        ] {
            let c = RedisSinkConfig {
                url: url.into(),
                ..Default::default()
            };
            let hidden = |text: &str| {
                for part in ["Ab1", "Cd2", "Ef3", "Gh4"] {
                    assert!(!text.contains(part), "{url}: {text}");
                }
            };
            hidden(&shown_url(url));
            hidden(&format!("{c:?}"));
            if let Err(e) = c.validate() {
                hidden(&e.to_string());
            }
            if let Err(e) = c.client() {
                hidden(&e.to_string());
            }
            assert!(
                c.secrets().iter().any(|s| s == password),
                "{url}: the password is kept out of the log"
            );
        }
        assert_eq!(
            shown_url("redis://user:Ab1/Cd2@host:6379/0"),
            "redis://***@host:6379/0"
        );
    }

    #[test]
    fn settings_that_do_not_go_together_are_refused() {
        for (text, needle) in [
            ("client_cert = \"c.pem\"", "client_cert and client_key"),
            ("ca_file = \"ca.pem\"", "rediss://"),
            ("maxlen = 10\nminid_behind_bytes = 5", "one or neither"),
            ("maxlen = 0", "at least 1"),
            ("writer = \"\"", "writer"),
        ] {
            let e = parse(text).expect("parses").validate().expect_err(text);
            assert!(e.to_string().contains(needle), "{text}: {e}");
        }
        parse("url = \"rediss://h:6380\"\nca_file = \"ca.pem\"")
            .expect("parses")
            .validate()
            .expect("TLS with a CA");
    }

    #[test]
    fn trimming_is_off_by_default_and_minid_counts_in_wal_bytes() {
        let mut c = RedisSinkConfig::default();
        assert!(c.trim_args(1 << 30).is_empty());
        c.minid_behind_bytes = Some(1000);
        assert_eq!(c.trim_args(5000), ["MINID", "~", "4000"]);
        assert!(c.trim_args(500).is_empty());
        c.minid_behind_bytes = None;
        c.maxlen = Some(7);
        assert_eq!(c.trim_args(5000), ["MAXLEN", "~", "7"]);
    }
}
