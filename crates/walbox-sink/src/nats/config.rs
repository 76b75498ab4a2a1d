//! The settings of the NATS sink (`[sink.nats]`), their checks, and the
//! connection they describe (TLS and credentials). Credentials may come in a
//! server URL (`nats://user:password@host:4222`, `nats://token@host:4222`, as
//! the NATS clients and CLI take them) or in the keys of `[sink.nats]`, not
//! both; the client is given the URLs without them, so that nothing it logs
//! holds them.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::SinkError;
use crate::secrets::Hidden;

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
    /// Server URLs (`nats://host:4222`, `tls://host:4222`); credentials in a
    /// URL (`nats://user:password@host`, `nats://token@host`) apply to every
    /// server.
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
    /// stream holds for outages shorter than it. The default, 600 s, covers a
    /// crash-looping Kubernetes pod's longest restart delay (300 s) and the
    /// systemd unit's (5 s), with as long again to catch up. Unset, a stream
    /// that exists with a shorter window is used with a warning (streams made
    /// before the default grew); set, it is refused.
    #[serde(default)]
    pub duplicate_window_s: Option<u64>,
    /// How long the oldest publication waiting may go without a PubAck, in
    /// ms: timed from its hand-over or the PubAck of the publication before
    /// it, whichever is later.
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
/// The duplicate window when `duplicate_window_s` is unset, in seconds.
pub const DEFAULT_DUPLICATE_WINDOW_S: u64 = 600;
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
            duplicate_window_s: None,
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
            .field("servers", &self.shown_servers())
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
        if self.duplicate_window_s == Some(0) {
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
        if self.servers()?.credentials.is_some() && methods.into_iter().any(|m| m) {
            return bad(
                "servers: a server URL carries credentials and [sink.nats] sets user/password, \
                 token, nkey_seed or creds_file too; give them in one place (the URL, or the \
                 keys and a URL without user:password@)",
            );
        }
        Ok(())
    }

    /// The servers parsed, without the credentials they carry, and those
    /// credentials (percent-decoded). No error quotes a URL: it may hold a
    /// password.
    fn servers(&self) -> Result<Servers, SinkError> {
        let bad = |m: &str| SinkError::Config(format!("sink.nats.servers: {m}"));
        let mut addrs = Vec::new();
        let mut credentials: Option<UrlCredentials> = None;
        for server in &self.servers {
            let addr: async_nats::ServerAddr = server
                .parse()
                .map_err(|e: std::io::Error| bad(&format!("server {}: {e}", addrs.len() + 1)))?;
            let mut url = addr.into_inner();
            let decode = |s: &str| {
                percent_encoding::percent_decode_str(s)
                    .decode_utf8()
                    .map(|c| c.into_owned())
                    .map_err(|_| {
                        bad("the credentials of a server URL are not UTF-8 once percent-decoded")
                    })
            };
            let found = match (url.username(), url.password()) {
                ("", None) => None,
                ("", Some(_)) => return Err(bad("a server URL has a password without a user")),
                (user, Some(password)) => Some(UrlCredentials::UserPassword(
                    decode(user)?,
                    decode(password)?,
                )),
                (token, None) => Some(UrlCredentials::Token(decode(token)?)),
            };
            if let Some(found) = found {
                match &credentials {
                    Some(c) if *c != found => {
                        return Err(bad(
                            "the server URLs carry different credentials; walbox gives every \
                             server the same: put the same in each URL, or in one",
                        ));
                    }
                    _ => credentials = Some(found),
                }
                let stripped = url.set_username("").is_ok() && url.set_password(None).is_ok();
                if !stripped {
                    return Err(bad("a server URL with credentials has no host"));
                }
            }
            addrs.push(
                async_nats::ServerAddr::from_url(url)
                    .map_err(|e| bad(&format!("server {}: {e}", addrs.len() + 1)))?,
            );
        }
        Ok(Servers { addrs, credentials })
    }

    /// The server URLs as they may be printed: credentials replaced by
    /// `<hidden>`.
    fn shown_servers(&self) -> Vec<String> {
        self.servers
            .iter()
            .map(|s| match s.rsplit_once('@') {
                Some((before, host)) => match before.split_once("://") {
                    Some((scheme, _)) => format!("{scheme}://<hidden>@{host}"),
                    None => format!("<hidden>@{host}"),
                },
                None => s.clone(),
            })
            .collect()
    }

    /// Every secret these settings hold, as given and as a server URL holds
    /// it (percent-encoded), so that a log can keep them out.
    #[must_use]
    pub fn secrets(&self) -> Vec<String> {
        let mut out: Vec<String> = [&self.password, &self.token, &self.nkey_seed]
            .into_iter()
            .flatten()
            .cloned()
            .collect();
        for server in &self.servers {
            if let Some((before, _)) = server.rsplit_once('@') {
                let userinfo = before.split_once("://").map_or(before, |(_, u)| u);
                match userinfo.split_once(':') {
                    Some((_, password)) => out.push(password.to_owned()),
                    None => out.push(userinfo.to_owned()),
                }
            }
        }
        if let Ok(Servers {
            credentials: Some(c),
            ..
        }) = self.servers()
        {
            match c {
                UrlCredentials::UserPassword(_, password) => out.push(password),
                UrlCredentials::Token(token) => out.push(token),
            }
        }
        out.retain(|s| !s.is_empty());
        out.sort();
        out.dedup();
        out
    }

    pub(super) fn duplicate_window(&self) -> Duration {
        Duration::from_secs(self.duplicate_window_s())
    }

    /// The duplicate window asked for, in seconds (the default when unset).
    #[must_use]
    pub fn duplicate_window_s(&self) -> u64 {
        self.duplicate_window_s
            .unwrap_or(DEFAULT_DUPLICATE_WINDOW_S)
    }

    /// The user the credentials name, for errors: never a secret.
    fn who(&self, from_url: Option<&UrlCredentials>) -> String {
        if let Some(c) = from_url {
            match c {
                UrlCredentials::UserPassword(u, _) => format!("user {u:?} of the server URL"),
                UrlCredentials::Token(_) => "the token of the server URL".into(),
            }
        } else if let Some(u) = &self.user {
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
        // The session's PubAcks arrive on one subscription: room for every
        // event in flight, so that none is dropped as a slow consumer's.
        let replies = self.max_in_flight.saturating_add(1024).max(64 * 1024);
        let mut options = async_nats::ConnectOptions::new()
            .name("walbox")
            .connection_timeout(Duration::from_millis(self.connect_timeout_ms))
            .subscription_capacity(replies)
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
        let Servers { addrs, credentials } = self.servers()?;
        match &credentials {
            Some(UrlCredentials::UserPassword(user, password)) => {
                options = options.user_and_password(user.clone(), password.clone());
            }
            Some(UrlCredentials::Token(token)) => options = options.token(token.clone()),
            None => {}
        }
        options.connect(addrs).await.map_err(|e| {
            use async_nats::ConnectErrorKind as K;
            match e.kind() {
                K::AuthorizationViolation | K::Authentication => SinkError::NatsAuthentication {
                    who: self.who(credentials.as_ref()),
                    reason: e.to_string(),
                },
                K::Tls => SinkError::Config(format!(
                    "nats TLS: {e}; check tls_required, ca_file, client_cert and client_key in \
                     [sink.nats]"
                )),
                K::ServerParse => SinkError::Config(format!("sink.nats.servers: {e}")),
                _ => SinkError::Nats(format!(
                    "connecting to {}: {e}",
                    self.shown_servers().join(", ")
                )),
            }
        })
    }
}

/// Credentials a server URL carries, percent-decoded: `user:password@`, or
/// `token@` (a user without a password, as the NATS clients read it).
#[derive(Clone, PartialEq, Eq)]
enum UrlCredentials {
    UserPassword(String, String),
    Token(String),
}

/// The configured servers without credentials, and the credentials they carry.
struct Servers {
    addrs: Vec<async_nats::ServerAddr>,
    credentials: Option<UrlCredentials>,
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
            duplicate_window_s: Some(0),
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
    fn credentials_in_a_url_are_taken_out_of_it_and_never_shown() {
        let c = NatsSinkConfig {
            servers: vec![
                "nats://walbox:p%40ss-8e1f@127.0.0.1:4222".into(),
                "nats://127.0.0.1:4223".into(),
            ],
            ..NatsSinkConfig::default()
        };
        c.validate().unwrap();
        let servers = c.servers().unwrap();
        assert!(
            servers.credentials
                == Some(UrlCredentials::UserPassword(
                    "walbox".into(),
                    "p@ss-8e1f".into()
                ))
        );
        for a in &servers.addrs {
            assert!(!a.as_url_str().contains('@'), "{}", a.as_url_str());
            assert!(!a.has_user_pass());
        }
        let shown = format!("{c:?}");
        assert!(!shown.contains("8e1f"), "{shown}");
        assert!(shown.contains("nats://<hidden>@127.0.0.1:4222"), "{shown}");
        let secrets = c.secrets();
        assert!(secrets.contains(&"p@ss-8e1f".to_owned()), "{secrets:?}");
        assert!(secrets.contains(&"p%40ss-8e1f".to_owned()), "{secrets:?}");
        assert_eq!(
            c.who(servers.credentials.as_ref()),
            "user \"walbox\" of the server URL"
        );

        // A user without a password is a token, as the NATS clients read it.
        let c = NatsSinkConfig {
            servers: vec!["nats://tok-51d2@127.0.0.1:4222".into()],
            ..NatsSinkConfig::default()
        };
        assert!(c.servers().unwrap().credentials == Some(UrlCredentials::Token("tok-51d2".into())));
        assert!(!format!("{c:?}").contains("tok-51d2"));
        assert_eq!(c.secrets(), vec!["tok-51d2".to_owned()]);
    }

    #[test]
    fn credentials_in_a_url_and_in_the_keys_are_refused_naming_both() {
        let url = NatsSinkConfig {
            servers: vec!["nats://walbox:pw-0c4d@127.0.0.1:4222".into()],
            ..NatsSinkConfig::default()
        };
        for c in [
            NatsSinkConfig {
                user: Some("walbox".into()),
                password: Some("pw-0c4d".into()),
                ..url.clone()
            },
            NatsSinkConfig {
                token: Some("tk-3a".into()),
                ..url.clone()
            },
        ] {
            let err = c.validate().unwrap_err().to_string();
            assert!(
                err.contains("sink.nats.servers") && err.contains("user/password"),
                "{err}"
            );
            assert!(!err.contains("pw-0c4d") && !err.contains("tk-3a"), "{err}");
        }
        let two = NatsSinkConfig {
            servers: vec![
                "nats://walbox:pw-0c4d@127.0.0.1:4222".into(),
                "nats://walbox:pw-other@127.0.0.1:4223".into(),
            ],
            ..NatsSinkConfig::default()
        };
        let err = two.validate().unwrap_err().to_string();
        assert!(err.contains("different credentials"), "{err}");
        assert!(!err.contains("pw-"), "{err}");
        let bad = NatsSinkConfig {
            servers: vec!["nats://walbox:pw-%ff@127.0.0.1:4222".into()],
            ..NatsSinkConfig::default()
        };
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("not UTF-8") && !err.contains("pw-"), "{err}");
    }
}
