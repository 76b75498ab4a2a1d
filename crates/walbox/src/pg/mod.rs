//! PostgreSQL connections: the settings of a connection as libpq gathers them
//! (connection string, service file, environment, password file), the SQL
//! connection, and the replication connection's settings. The string's syntax
//! lives in [`dsn`], the other sources in [`sources`], TLS for both connections
//! in [`tls`], the choice among several servers in [`resolve`]; none of the first
//! three depends on this module.

mod dsn;
#[cfg(test)]
mod properties;
mod resolve;
mod sources;
mod tls;

#[cfg(test)]
mod connect_tests;

use std::collections::BTreeMap;
use std::str::FromStr;

use anyhow::{Context, Result, anyhow, bail};
use pgwire_replication::{ReplicationConfig, TlsConfig};

pub use resolve::{NoServer, TargetSession, TwoPrimaries};
pub use sources::Env;
use sources::PassFile;
pub use tls::SslMode;

/// Settings that change how the server writes a value as text, pinned on every
/// connection walbox opens (replication and SQL), so that a value renders the
/// same in the stream, the snapshot and a dead-letter replay whatever the
/// server's, database's or role's defaults say. Given as startup options, which
/// take precedence over `ALTER DATABASE ... SET` and `ALTER ROLE ... SET`.
///
/// `row_security=off` too: a read of a table whose row-level security policies
/// apply to the role fails with PostgreSQL's error instead of returning fewer
/// rows, so that a snapshot, a replay from the table or `verify` never misses
/// events silently.
pub const SESSION_OPTIONS: &str = "-c TimeZone=UTC -c DateStyle=ISO,YMD -c IntervalStyle=postgres \
     -c bytea_output=hex -c extra_float_digits=3 -c lc_monetary=C -c row_security=off";

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
    /// The home directory, where libpq's default certificate files are.
    home: Option<std::path::PathBuf>,
    /// The password file's entries, read when no password was given.
    passfile: PassFile,
    /// `target_session_attrs`: which of several servers a session uses (see
    /// [`ConnParams::resolve`]).
    pub target: TargetSession,
}

impl std::fmt::Debug for ConnParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.write_str(&self.describe())
    }
}

/// Settings walbox reads itself; the others go to tokio-postgres.
/// `target_session_attrs` is among them because tokio-postgres knows only part of
/// libpq's values.
const OWN_KEYS: &[&str] = &[
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "service",
    "passfile",
    "fallback_application_name",
    "target_session_attrs",
];

impl ConnParams {
    /// Parses a libpq connection string in key=value or URI form, completed from
    /// this process's environment and files as libpq would.
    pub fn parse(dsn: &str) -> Result<Self> {
        Self::parse_with(dsn, &Env::process())
    }

    /// Parses a libpq connection string completed from `env`: a setting in the
    /// string wins over the service file (`service=`), which wins over the `PG*`
    /// variables, which win over libpq's defaults (`user`: the operating-system
    /// user; `dbname`: the user). The password file is read when no password was
    /// given, and consulted per host by [`ConnParams::password_for`].
    ///
    /// One difference from libpq: without `host` or `PGHOST` walbox connects to
    /// `localhost` over TCP, not to a Unix socket, because the replication
    /// connection speaks TCP only.
    pub fn parse_with(dsn: &str, env: &Env) -> Result<Self> {
        env.refuse_unsupported()?;
        let mut settings: BTreeMap<&'static str, String> = BTreeMap::new();
        for (key, value) in dsn::parse(dsn)? {
            // An empty value counts as not given, so the next source applies.
            if value.is_empty() {
                settings.remove(key);
            } else {
                settings.insert(key, value);
            }
        }
        let service = settings
            .get("service")
            .cloned()
            .or_else(|| env.var("PGSERVICE").map(str::to_owned));
        if let Some(name) = service {
            for (key, value) in sources::service(env, &name)? {
                if !value.is_empty() {
                    settings.entry(key).or_insert(value);
                }
            }
        }
        for (var, key) in sources::ENV_KEYS {
            if let Some(value) = env.var(var) {
                settings.entry(key).or_insert_with(|| value.to_owned());
            }
        }
        if !settings.contains_key("user")
            && let Some(user) = env.os_user()
        {
            settings.insert("user", user.to_owned());
        }
        if !settings.contains_key("dbname")
            && let Some(user) = settings.get("user").cloned()
        {
            settings.insert("dbname", user);
        }
        if !settings.contains_key("host") && !settings.contains_key("hostaddr") {
            settings.insert("host", "localhost".to_owned());
        }
        if !settings.contains_key("application_name")
            && let Some(name) = settings.get("fallback_application_name").cloned()
        {
            settings.insert("application_name", name);
        }

        if settings.get("channel_binding").map(String::as_str) == Some("require") {
            bail!(
                "channel_binding=require (in the connection string, the service file or \
                 PGCHANNELBINDING) cannot be honoured: the replication connection does not \
                 authenticate with SCRAM-SHA-256-PLUS yet, so it would not be bound to its TLS \
                 session. To make sure walbox talks to the real server, use \
                 sslmode=verify-full with sslrootcert set to the server's CA, and set \
                 channel_binding to prefer or disable"
            );
        }
        let mut rest = Vec::new();
        for (&key, value) in &settings {
            if OWN_KEYS.contains(&key) {
                continue;
            }
            // libpq's name, tokio-postgres's name.
            let key = if key == "keepalives_count" {
                "keepalives_retries"
            } else {
                key
            };
            let pair = format!("{key}={}", dsn::quote(value));
            // One key at a time, so that the error names the key; tokio-postgres's
            // own message is not passed on.
            tokio_postgres::Config::from_str(&pair).map_err(|_| {
                anyhow!("invalid connection string: the value of {key} is not valid; see libpq's documentation of {key}")
            })?;
            rest.push(pair);
        }
        let pg = tokio_postgres::Config::from_str(&rest.join(" "))
            .map_err(|_| anyhow!("invalid connection string: its settings do not fit together"))?;
        let get = |k: &str| settings.get(k).cloned();
        let sslmode = match settings.get("sslmode") {
            Some(mode) => mode.parse().map_err(|_| {
                anyhow!(
                    "invalid connection string: sslmode must be one of disable, allow, prefer, \
                     require, verify-ca, verify-full"
                )
            })?,
            None => SslMode::default(),
        };
        let sslrootcert = get("sslrootcert");
        let sslmode = SslMode::resolve(
            settings.contains_key("sslmode").then_some(sslmode),
            sslrootcert.as_deref(),
        )?;
        let passfile = match pg.get_password() {
            Some(password) => {
                crate::redact::keep_out(&String::from_utf8_lossy(password));
                PassFile::default()
            }
            None => env
                .passfile(settings.get("passfile").map(String::as_str))
                .map(|path| PassFile::load(&path))
                .unwrap_or_default(),
        };
        let target: TargetSession = settings
            .get("target_session_attrs")
            .map(|t| t.parse())
            .transpose()?
            .unwrap_or_default();
        let mut pg = pg;
        pg.target_session_attrs(target.driver());
        Ok(ConnParams {
            target,
            pg,
            sslmode,
            sslrootcert,
            sslcert: get("sslcert"),
            sslkey: get("sslkey"),
            home: env.var("HOME").map(std::path::PathBuf::from),
            passfile,
        })
    }

    /// The password for connecting to `host` (a name, an address or a Unix
    /// socket directory) on `port`: the one given in the connection string,
    /// service or environment, else the password file's entry for this host,
    /// port, database and user.
    pub fn password_for(&self, host: &str, port: u16) -> Option<Vec<u8>> {
        if let Some(password) = self.pg.get_password() {
            return Some(password.to_vec());
        }
        self.passfile
            .lookup(
                host,
                port,
                self.pg.get_dbname().unwrap_or_default(),
                self.pg.get_user().unwrap_or_default(),
            )
            .map(|p| p.as_bytes().to_vec())
    }

    /// The first TCP host, or the Unix socket directory; with only `hostaddr`
    /// given, that address.
    pub fn host(&self) -> Result<String> {
        match self.pg.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => Ok(h.clone()),
            Some(tokio_postgres::config::Host::Unix(p)) => Ok(p.display().to_string()),
            None => Ok(self
                .pg
                .get_hostaddrs()
                .first()
                .map_or_else(|| "localhost".into(), ToString::to_string)),
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
        if let Some(password) = self.password_for(&self.host()?, self.port()) {
            pg.password(password);
        }
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
            &tls::CertFiles {
                rootcert: self.sslrootcert.clone(),
                cert: self.sslcert.clone(),
                key: self.sslkey.clone(),
                home: self.home.clone(),
            },
        )
    }

    /// Settings of the replication connection for `slot` and `publication`.
    ///
    /// With `hostaddr`, the connection goes to that address, the one the SQL
    /// connection uses, and the server's certificate is verified against the
    /// host name when one is given (as libpq does).
    pub fn replication(&self, slot: &str, publication: &str) -> Result<ReplicationConfig> {
        let host = self.host()?;
        let password = self
            .password_for(&host, self.port())
            .map(|p| String::from_utf8_lossy(&p).into_owned())
            .unwrap_or_default();
        let address = self.pg.get_hostaddrs().first().map(ToString::to_string);
        let named = matches!(
            self.pg.get_hosts().first(),
            Some(tokio_postgres::config::Host::Tcp(_))
        );
        let sni_hostname = address.as_ref().filter(|_| named).map(|_| host.clone());
        let cfg = ReplicationConfig::new(
            address.unwrap_or(host),
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
            sni_hostname,
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
                "row_security=off",
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
    fn an_unencoded_at_in_a_uri_password_is_not_shown_as_the_host() {
        let c = ConnParams::parse("postgresql://walbox:p@ss@db/app").unwrap();
        assert_eq!(c.host().unwrap(), "db");
        assert_eq!(c.pg.get_password(), Some(&b"p@ss"[..]));
        assert!(!c.describe().contains("ss"), "{}", c.describe());
        assert!(!format!("{c:?}").contains("ss"), "{c:?}");
    }

    #[test]
    fn bad_strings_are_refused_without_echoing_secrets() {
        let err = ConnParams::parse("host=a sslmode=sometimes").unwrap_err();
        assert!(err.to_string().contains("sslmode must be one of"), "{err}");
        assert!(!err.to_string().contains("sometimes"), "{err}");
        let err = ConnParams::parse("host=a password='unterminated").unwrap_err();
        assert!(err.to_string().contains("no closing quote"), "{err}");
        assert!(!err.to_string().contains("unterminated"), "{err}");
        let err = ConnParams::parse("host=a password=ab cd").unwrap_err();
        assert!(!format!("{err:#}").contains("cd"), "{err:#}");
        let err = ConnParams::parse("host=a port=hunter2").unwrap_err();
        assert!(format!("{err:#}").contains("port"), "{err:#}");
        assert!(!format!("{err:#}").contains("hunter2"), "{err:#}");
        let err = ConnParams::parse("host=a bogus_key=1 password=hunter2").unwrap_err();
        assert!(!format!("{err:#}").contains("hunter2"), "{err:#}");
        let err = ConnParams::parse("host=a target_session_attrs=hunter2").unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("target_session_attrs"), "{text}");
        assert!(text.contains("read-write"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
    }

    #[test]
    fn channel_binding_require_is_refused_from_the_string_and_the_environment() {
        for (dsn, env) in [
            ("host=a channel_binding=require", Env::empty()),
            ("postgresql://u@a/app?channel_binding=require", Env::empty()),
            ("host=a", Env::empty().with("PGCHANNELBINDING", "require")),
        ] {
            let err = ConnParams::parse_with(dsn, &env).unwrap_err().to_string();
            assert!(
                err.contains("channel_binding=require")
                    && err.contains("replication connection")
                    && err.contains("SCRAM-SHA-256-PLUS")
                    && err.contains("verify-full"),
                "{dsn}: {err}"
            );
        }
        // prefer and disable stay accepted; the string wins over the environment.
        for value in ["prefer", "disable"] {
            ConnParams::parse_with(&format!("host=a channel_binding={value}"), &Env::empty())
                .unwrap();
        }
        let env = Env::empty().with("PGCHANNELBINDING", "require");
        ConnParams::parse_with("host=a channel_binding=prefer", &env).unwrap();
    }

    #[test]
    fn an_unsupported_security_variable_stops_the_parse() {
        let env = Env::empty().with("PGSSLCRL", "/etc/crl.pem");
        let err = ConnParams::parse_with("host=a", &env).unwrap_err();
        assert!(err.to_string().contains("PGSSLCRL"), "{err}");
    }

    #[test]
    fn the_string_wins_over_the_service_which_wins_over_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let services = dir.path().join("services.conf");
        std::fs::write(
            &services,
            "[orders]\nhost=svc-host\nport=6001\ndbname=svc-db\n",
        )
        .unwrap();
        let env = Env::empty()
            .with_os_user("osuser")
            .with("PGSERVICEFILE", services.display().to_string())
            .with("PGHOST", "env-host")
            .with("PGPORT", "7000")
            .with("PGUSER", "env-user")
            .with("PGDATABASE", "env-db")
            .with("PGPASSWORD", "env-pw")
            .with("PGSSLMODE", "verify-full")
            .with("PGSSLROOTCERT", "/env/ca.crt")
            .with("PGAPPNAME", "env-app")
            .with("PGCONNECT_TIMEOUT", "7")
            .with("PGTARGETSESSIONATTRS", "read-write");
        let c =
            ConnParams::parse_with("service=orders dbname=dsn-db sslmode=require", &env).unwrap();
        assert_eq!(c.host().unwrap(), "svc-host", "service over environment");
        assert_eq!(c.port(), 6001);
        assert_eq!(c.pg.get_dbname(), Some("dsn-db"), "string over service");
        assert_eq!(
            c.pg.get_user(),
            Some("env-user"),
            "environment over default"
        );
        assert_eq!(c.pg.get_password(), Some(&b"env-pw"[..]));
        assert_eq!(c.sslmode, SslMode::Require, "string over environment");
        assert_eq!(c.sslrootcert.as_deref(), Some("/env/ca.crt"));
        assert_eq!(c.pg.get_application_name(), Some("env-app"));
        assert_eq!(
            c.pg.get_connect_timeout(),
            Some(&std::time::Duration::from_secs(7))
        );
        assert_eq!(
            c.pg.get_target_session_attrs(),
            tokio_postgres::config::TargetSessionAttrs::ReadWrite
        );
        // PGSERVICE names the service when the string does not.
        let c = ConnParams::parse_with("", &env.clone().with("PGSERVICE", "orders")).unwrap();
        assert_eq!(c.host().unwrap(), "svc-host");
        let err = ConnParams::parse_with("service=nosuch", &env).unwrap_err();
        assert!(
            err.to_string().contains("nosuch") && err.to_string().contains("services.conf"),
            "{err}"
        );
    }

    #[test]
    fn libpq_defaults_user_from_the_os_and_dbname_from_the_user() {
        let c = ConnParams::parse_with("", &Env::empty().with_os_user("osuser")).unwrap();
        assert_eq!(c.pg.get_user(), Some("osuser"));
        assert_eq!(c.pg.get_dbname(), Some("osuser"));
        assert_eq!(c.host().unwrap(), "localhost");
        let c = ConnParams::parse_with("user=u", &Env::empty().with_os_user("osuser")).unwrap();
        assert_eq!(c.pg.get_dbname(), Some("u"));
        // An empty value counts as not given.
        let env = Env::empty().with("PGHOST", "env-host");
        let c = ConnParams::parse_with("host=''", &env).unwrap();
        assert_eq!(c.host().unwrap(), "env-host");
    }

    #[test]
    fn the_password_file_answers_per_host_only_without_a_password() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let pgpass = dir.path().join("pgpass");
        std::fs::write(&pgpass, "a:5432:app:walbox:pw-a\nb:6000:app:walbox:pw-b\n").unwrap();
        std::fs::set_permissions(&pgpass, std::fs::Permissions::from_mode(0o600)).unwrap();
        let env = Env::empty().with("PGPASSFILE", pgpass.display().to_string());
        let c =
            ConnParams::parse_with("host=a,b port=5432,6000 user=walbox dbname=app", &env).unwrap();
        assert_eq!(c.password_for("a", 5432), Some(b"pw-a".to_vec()));
        assert_eq!(c.password_for("b", 6000), Some(b"pw-b".to_vec()));
        assert_eq!(c.password_for("b", 5432), None);
        assert!(!format!("{c:?}").contains("pw-"));
        // A given password wins; the file is not consulted.
        let c =
            ConnParams::parse_with("host=a user=walbox dbname=app password=given", &env).unwrap();
        assert_eq!(c.password_for("b", 6000), Some(b"given".to_vec()));
        // passfile= in the string, and ~/.pgpass through HOME.
        let other = dir.path().join("other");
        std::fs::write(&other, "*:*:*:*:from-passfile\n").unwrap();
        std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o600)).unwrap();
        let s = format!("host=a user=walbox dbname=app passfile={}", other.display());
        let c = ConnParams::parse_with(&s, &env).unwrap();
        assert_eq!(c.password_for("a", 5432), Some(b"from-passfile".to_vec()));
        std::fs::copy(&pgpass, dir.path().join(".pgpass")).unwrap();
        let home = Env::empty().with("HOME", dir.path().display().to_string());
        let c = ConnParams::parse_with("host=a user=walbox dbname=app", &home).unwrap();
        assert_eq!(c.password_for("a", 5432), Some(b"pw-a".to_vec()));
    }
}
