//! PostgreSQL connections: parsing libpq connection strings (key=value or URI),
//! the SQL connection, and the replication connection's settings. TLS for both
//! connections lives in [`tls`], which depends on nothing here.

mod tls;

#[cfg(test)]
mod connect_tests;

use std::str::FromStr;

use anyhow::{Context, Result, bail};
use pgwire_replication::{ReplicationConfig, TlsConfig};

pub use tls::SslMode;

/// Settings that change how the server writes a value as text, pinned on every
/// connection walbox opens (replication and SQL), so that a value renders the
/// same in the stream, the snapshot and a dead-letter replay whatever the
/// server's, database's or role's defaults say. Given as startup options, which
/// take precedence over `ALTER DATABASE ... SET` and `ALTER ROLE ... SET`.
pub const SESSION_OPTIONS: &str = "-c TimeZone=UTC -c DateStyle=ISO,YMD -c IntervalStyle=postgres \
     -c bytea_output=hex -c extra_float_digits=3 -c lc_monetary=C";

/// The connection string's own `options`, then [`SESSION_OPTIONS`] (the later
/// setting wins).
fn session_options(own: Option<&str>) -> String {
    match own.map(str::trim) {
        Some(own) if !own.is_empty() => format!("{own} {SESSION_OPTIONS}"),
        _ => SESSION_OPTIONS.to_owned(),
    }
}

/// A parsed connection string.
#[derive(Clone)]
pub struct ConnParams {
    /// Everything but the TLS settings, as tokio-postgres reads it.
    pub pg: tokio_postgres::Config,
    /// `sslmode`.
    pub sslmode: SslMode,
    /// `sslrootcert`: CA certificate file.
    pub sslrootcert: Option<String>,
    /// `sslcert`: client certificate file.
    pub sslcert: Option<String>,
    /// `sslkey`: client key file.
    pub sslkey: Option<String>,
}

impl std::fmt::Debug for ConnParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.write_str(&self.describe())
    }
}

const TLS_KEYS: &[&str] = &["sslmode", "sslrootcert", "sslcert", "sslkey"];

impl ConnParams {
    /// Parses a libpq connection string in key=value or URI form.
    pub fn parse(dsn: &str) -> Result<Self> {
        let (rest, tls) = if dsn.starts_with("postgres://") || dsn.starts_with("postgresql://") {
            split_uri(dsn)
        } else {
            split_key_value(dsn)?
        };
        // tokio-postgres errors do not echo the string, so no password leaks here.
        let pg = tokio_postgres::Config::from_str(&rest)
            .context("invalid PostgreSQL connection string")?;
        let get = |k: &str| tls.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        let sslrootcert = get("sslrootcert");
        Ok(ConnParams {
            pg,
            sslmode: SslMode::resolve(
                get("sslmode").map(|m| m.parse()).transpose()?,
                sslrootcert.as_deref(),
            )?,
            sslrootcert,
            sslcert: get("sslcert"),
            sslkey: get("sslkey"),
        })
    }

    /// The first TCP host, or the Unix socket directory.
    pub fn host(&self) -> Result<String> {
        match self.pg.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => Ok(h.clone()),
            Some(tokio_postgres::config::Host::Unix(p)) => Ok(p.display().to_string()),
            None => Ok("localhost".into()),
        }
    }

    /// The port (5432 when not given).
    pub fn port(&self) -> u16 {
        self.pg.get_ports().first().copied().unwrap_or(5432)
    }

    /// `user@host:port/dbname`, for logs and errors.
    pub fn describe(&self) -> String {
        format!(
            "{}@{}:{}/{}",
            self.pg.get_user().unwrap_or("?"),
            self.host().unwrap_or_default(),
            self.port(),
            self.pg.get_dbname().unwrap_or("?")
        )
    }

    /// Opens the SQL connection; its driver runs on the current runtime. TLS as
    /// `sslmode` says, with the same client configuration as the replication
    /// connection.
    pub async fn connect(&self) -> Result<tokio_postgres::Client> {
        use tokio_postgres::config::SslMode as Pg;
        let context = || format!("connecting to {}", self.describe());
        let mut pg = self.pg.clone();
        pg.options(session_options(self.pg.get_options()));
        let client = match self.sslmode {
            SslMode::Disable => Ok(connect_plain(&pg).await?),
            SslMode::Allow => match connect_plain(&pg).await {
                // Refused by the server (not a network error): as libpq, once
                // more over TLS.
                Err(e) if e.as_db_error().is_some() => self.connect_tls(&mut pg, Pg::Require).await,
                other => Ok(other?),
            },
            SslMode::Prefer => self.connect_tls(&mut pg, Pg::Prefer).await,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                self.connect_tls(&mut pg, Pg::Require).await
            }
        };
        client.with_context(context)
    }

    /// The SQL connection over TLS (`Prefer`: plaintext when the server
    /// answers the SSLRequest with `N`).
    async fn connect_tls(
        &self,
        pg: &mut tokio_postgres::Config,
        mode: tokio_postgres::config::SslMode,
    ) -> Result<tokio_postgres::Client> {
        pg.ssl_mode(mode);
        let tls = tokio_postgres_rustls::MakeRustlsConnect::new(self.tls_config()?);
        let (client, connection) = pg.connect(tls).await?;
        drive(connection);
        Ok(client)
    }

    /// The rustls client configuration both connections use.
    fn tls_config(&self) -> Result<rustls::ClientConfig> {
        tls::client_config(
            self.sslmode,
            self.sslrootcert.as_deref(),
            self.sslcert.as_deref(),
            self.sslkey.as_deref(),
        )
    }

    /// Settings of the replication connection for `slot` and `publication`.
    pub fn replication(&self, slot: &str, publication: &str) -> Result<ReplicationConfig> {
        let password = self
            .pg
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default();
        let host = self.host()?;
        let cfg = ReplicationConfig::new(
            host,
            self.pg.get_user().unwrap_or("postgres"),
            password,
            self.pg.get_dbname().unwrap_or("postgres"),
            slot,
            publication,
        )
        .with_port(self.port())
        .with_options(session_options(self.pg.get_options()));
        // The client negotiates as the mode says; the certificate checks and the
        // client certificate are the SQL connection's, from the same
        // configuration. The server name is the host, so an IP address is
        // checked against the certificate's IP addresses.
        let tls = TlsConfig {
            mode: self.sslmode.replication(),
            ..TlsConfig::default()
        };
        let tls = match self.sslmode {
            SslMode::Disable => tls,
            _ => tls.with_rustls_config(std::sync::Arc::new(self.tls_config()?)),
        };
        Ok(cfg.with_tls(tls))
    }
}

/// The SQL connection without TLS.
async fn connect_plain(
    pg: &tokio_postgres::Config,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = pg.connect(tokio_postgres::NoTls).await?;
    drive(connection);
    Ok(client)
}

/// Runs a connection's I/O on the current runtime until it closes.
fn drive<S, T>(connection: tokio_postgres::Connection<S, T>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %e, "SQL connection closed");
        }
    });
}

/// Splits the TLS keys out of a key=value string; returns the rest re-joined.
fn split_key_value(dsn: &str) -> Result<(String, Vec<(String, String)>)> {
    let mut rest = Vec::new();
    let mut tls = Vec::new();
    let mut chars = dsn.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') {
            bail!("invalid connection string: missing '=' after {key:?}");
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut raw = String::new();
        if chars.peek() == Some(&'\'') {
            raw.push('\'');
            chars.next();
            let mut closed = false;
            while let Some(c) = chars.next() {
                raw.push(c);
                if c == '\\' {
                    if let Some(n) = chars.next() {
                        raw.push(n);
                    }
                } else if c == '\'' {
                    closed = true;
                    break;
                }
            }
            if !closed {
                bail!("invalid connection string: unterminated quote in the value of {key:?}");
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                raw.push(c);
                chars.next();
            }
        }
        if TLS_KEYS.contains(&key.as_str()) {
            tls.push((key, unquote(&raw)));
        } else {
            rest.push(format!("{key}={raw}"));
        }
    }
    Ok((rest.join(" "), tls))
}

fn unquote(raw: &str) -> String {
    let Some(inner) = raw.strip_prefix('\'').and_then(|r| r.strip_suffix('\'')) else {
        return raw.to_owned();
    };
    let mut out = String::new();
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(n) = chars.next() {
                out.push(n);
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Splits the TLS keys out of a URI's query string.
fn split_uri(dsn: &str) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = dsn.split_once('?') else {
        return (dsn.to_owned(), Vec::new());
    };
    let mut keep = Vec::new();
    let mut tls = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if TLS_KEYS.contains(&k) {
            tls.push((k.to_owned(), percent_decode(v)));
        } else {
            keep.push(pair);
        }
    }
    if keep.is_empty() {
        (base.to_owned(), tls)
    } else {
        (format!("{base}?{}", keep.join("&")), tls)
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match (bytes.get(i), bytes.get(i + 1..i + 3)) {
            (Some(b'%'), Some(hex)) => {
                if let Some(b) = std::str::from_utf8(hex)
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    out.push(b);
                    i += 3;
                    continue;
                }
                out.push(b'%');
            }
            (Some(b), _) => out.push(*b),
            (None, _) => {}
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_value_form_with_tls_and_quotes() {
        let c = ConnParams::parse(
            "host=db.internal port=6543 user=walbox password='s3 \\'cret' dbname=app sslmode=verify-full sslrootcert='/etc/ca dir/ca.crt'",
        )
        .unwrap();
        assert_eq!(c.host().unwrap(), "db.internal");
        assert_eq!(c.port(), 6543);
        assert_eq!(c.pg.get_password(), Some(&b"s3 'cret"[..]));
        assert_eq!(c.sslmode, SslMode::VerifyFull);
        assert_eq!(c.sslrootcert.as_deref(), Some("/etc/ca dir/ca.crt"));
        assert_eq!(c.describe(), "walbox@db.internal:6543/app");
        assert!(!format!("{c:?}").contains("cret"), "no password in Debug");
    }

    #[test]
    fn value_formats_are_pinned_after_the_strings_own_options() {
        let own = ConnParams::parse("host=a options='-c search_path=app'").unwrap();
        let plain = ConnParams::parse("host=a").unwrap();
        for (c, first) in [
            (own, "-c search_path=app -c TimeZone=UTC"),
            (plain, "-c TimeZone=UTC"),
        ] {
            let options = c.replication("s", "p").unwrap().options.unwrap();
            assert!(options.starts_with(first), "{options}");
            for pinned in [
                "bytea_output=hex",
                "IntervalStyle=postgres",
                "extra_float_digits=3",
                "DateStyle=ISO,YMD",
            ] {
                assert!(options.contains(pinned), "{options}");
            }
        }
    }

    #[test]
    fn uri_form_with_tls_params() {
        let c = ConnParams::parse(
            "postgresql://walbox:p%40ss@10.0.0.5:5433/app?sslmode=require&application_name=x&sslrootcert=%2Ftmp%2Fca.crt",
        )
        .unwrap();
        assert_eq!(c.host().unwrap(), "10.0.0.5");
        assert_eq!(c.port(), 5433);
        assert_eq!(c.pg.get_password(), Some(&b"p@ss"[..]));
        assert_eq!(c.pg.get_application_name(), Some("x"));
        assert_eq!(c.sslmode, SslMode::Require);
        assert_eq!(c.sslrootcert.as_deref(), Some("/tmp/ca.crt"));
    }

    #[test]
    fn bad_strings_are_refused_without_echoing_secrets() {
        let err = ConnParams::parse("host=a sslmode=sometimes").unwrap_err();
        assert!(err.to_string().contains("sometimes"));
        let err = ConnParams::parse("host=a password='unterminated").unwrap_err();
        assert!(err.to_string().contains("unterminated quote"), "{err}");
        let err = ConnParams::parse("host=a bogus_key=1 password=hunter2").unwrap_err();
        assert!(!format!("{err:#}").contains("hunter2"), "{err:#}");
    }
}
