//! Where libpq takes connection settings from besides the connection string: the
//! `PG*` environment variables, the connection service file (`service=name`) and
//! the password file (`~/.pgpass`), read the way libpq reads them.
//!
//! The environment is an explicit value ([`Env`]) so that the rules can be tested
//! without touching the process's environment. No error or log line here quotes
//! the content of a file or a variable: they name the file, the line, the variable.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The environment variables libpq reads for a setting, in libpq's pairing.
pub const ENV_KEYS: &[(&str, &str)] = &[
    ("PGHOST", "host"),
    ("PGHOSTADDR", "hostaddr"),
    ("PGPORT", "port"),
    ("PGDATABASE", "dbname"),
    ("PGUSER", "user"),
    ("PGPASSWORD", "password"),
    ("PGPASSFILE", "passfile"),
    ("PGOPTIONS", "options"),
    ("PGAPPNAME", "application_name"),
    ("PGCONNECT_TIMEOUT", "connect_timeout"),
    ("PGTARGETSESSIONATTRS", "target_session_attrs"),
    ("PGCHANNELBINDING", "channel_binding"),
    ("PGLOADBALANCEHOSTS", "load_balance_hosts"),
    ("PGSSLMODE", "sslmode"),
    ("PGSSLROOTCERT", "sslrootcert"),
    ("PGSSLCERT", "sslcert"),
    ("PGSSLKEY", "sslkey"),
    ("PGSERVICE", "service"),
];

/// Variables that locate files rather than set a key.
const FILE_VARS: &[&str] = &["PGSERVICEFILE", "PGSYSCONFDIR", "HOME"];

/// Security settings libpq reads from the environment that walbox does not act
/// on: the values that ask for what walbox does anyway, and what walbox does not
/// do. Any other value is refused by the variable's name rather than silently
/// ignored, as the same keys are in a connection string.
const UNSUPPORTED_VARS: &[(&str, &[&str], &str)] = &[
    (
        "PGREQUIREAUTH",
        &[],
        "walbox cannot restrict the authentication methods the server may ask for",
    ),
    (
        "PGGSSENCMODE",
        &["disable", "prefer"],
        "walbox has no GSSAPI encryption",
    ),
    (
        "PGSSLNEGOTIATION",
        &["postgres"],
        "walbox negotiates TLS only with the SSLRequest",
    ),
    (
        "PGSSLCRL",
        &[],
        "walbox does not check certificate revocation lists",
    ),
    (
        "PGSSLCRLDIR",
        &[],
        "walbox does not check certificate revocation lists",
    ),
    (
        "PGSSLCERTMODE",
        &["allow"],
        "walbox presents a client certificate whenever it has one",
    ),
    (
        "PGSSLMINPROTOCOLVERSION",
        &[],
        "walbox uses TLS 1.2 and 1.3, and cannot be set to other versions",
    ),
    (
        "PGSSLMAXPROTOCOLVERSION",
        &[],
        "walbox uses TLS 1.2 and 1.3, and cannot be set to other versions",
    ),
    (
        "PGREQUIREPEER",
        &[],
        "walbox connects over TCP only and cannot check a Unix socket's peer",
    ),
    (
        "PGKRBSRVNAME",
        &[],
        "walbox has no Kerberos (GSSAPI) authentication",
    ),
    ("PGGSSLIB", &[], "walbox has no GSSAPI library"),
];

/// The part of a process's environment that connection settings come from.
#[derive(Clone, Default)]
pub struct Env {
    vars: BTreeMap<String, String>,
    os_user: Option<String>,
}

impl fmt::Debug for Env {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Names only: PGPASSWORD is a secret.
        f.debug_struct("Env")
            .field("vars", &self.vars.keys().collect::<Vec<_>>())
            .field("os_user", &self.os_user)
            .finish()
    }
}

impl Env {
    /// An environment with no variables and no operating-system user.
    #[cfg(test)]
    pub fn empty() -> Self {
        Self::default()
    }

    /// This process's environment and the operating-system user it runs as.
    pub fn process() -> Self {
        let mut env = Self {
            vars: BTreeMap::new(),
            os_user: whoami::username().ok(),
        };
        let names = ENV_KEYS
            .iter()
            .map(|(v, _)| *v)
            .chain(FILE_VARS.iter().copied())
            .chain(UNSUPPORTED_VARS.iter().map(|(v, _, _)| *v));
        for name in names {
            // A variable set to the empty string counts as unset.
            if let Ok(value) = std::env::var(name)
                && !value.is_empty()
            {
                env.vars.insert(name.to_owned(), value);
            }
        }
        env
    }

    /// With `name` set to `value`.
    #[cfg(test)]
    pub fn with(mut self, name: &str, value: impl Into<String>) -> Self {
        self.vars.insert(name.to_owned(), value.into());
        self
    }

    /// With `user` as the operating-system user.
    #[cfg(test)]
    pub fn with_os_user(mut self, user: &str) -> Self {
        self.os_user = Some(user.to_owned());
        self
    }

    /// The variable `name`, when set and not empty.
    pub fn var(&self, name: &str) -> Option<&str> {
        self.vars.get(name).map(String::as_str)
    }

    /// The operating-system user name, libpq's default for `user`.
    pub fn os_user(&self) -> Option<&str> {
        self.os_user.as_deref()
    }

    /// Refuses a security setting of the environment walbox would not act on,
    /// naming the variable, never its value.
    pub fn refuse_unsupported(&self) -> Result<()> {
        for (name, accepted, why) in UNSUPPORTED_VARS {
            if let Some(value) = self.var(name)
                && !accepted.contains(&value)
            {
                let allowed = if accepted.is_empty() {
                    String::new()
                } else {
                    format!(" (or set it to {})", accepted.join(" or "))
                };
                bail!(
                    "{name} is set, but {why}; unset {name}{allowed} for walbox, or use a \
                     connection string setting walbox supports (docs/security.md)"
                );
            }
        }
        Ok(())
    }

    fn home(&self) -> Option<PathBuf> {
        self.var("HOME").map(PathBuf::from)
    }

    /// The password file: `passfile`, else `PGPASSFILE` (already merged into
    /// `passfile` by the caller), else `~/.pgpass`.
    pub fn passfile(&self, passfile: Option<&str>) -> Option<PathBuf> {
        passfile
            .map(PathBuf::from)
            .or_else(|| self.home().map(|h| h.join(".pgpass")))
    }
}

/// The settings of service `name`: the first service file that has a section
/// `[name]` (`PGSERVICEFILE` or `~/.pg_service.conf`, then
/// `PGSYSCONFDIR/pg_service.conf`), as libpq looks them up.
pub fn service(env: &Env, name: &str) -> Result<Vec<(&'static str, String)>> {
    let user_file = env
        .var("PGSERVICEFILE")
        .map(PathBuf::from)
        .or_else(|| env.home().map(|h| h.join(".pg_service.conf")));
    let system_file = env
        .var("PGSYSCONFDIR")
        .map(|d| Path::new(d).join("pg_service.conf"));
    let mut looked = Vec::new();
    for file in [user_file, system_file].into_iter().flatten() {
        let text = match std::fs::read_to_string(&file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                looked.push(file.display().to_string());
                continue;
            }
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("reading the service file {}", file.display()));
            }
        };
        if let Some(settings) = service_section(&text, name, &file)? {
            return Ok(settings);
        }
        looked.push(file.display().to_string());
    }
    bail!(
        "service {name:?} is not defined in any service file (looked in: {}); add a [{name}] \
         section, or point PGSERVICEFILE at the file that has it",
        if looked.is_empty() {
            "none, no home directory".to_owned()
        } else {
            looked.join(", ")
        }
    )
}

/// The `[name]` section of a service file's `text`, or `None` when it has none.
fn service_section(
    text: &str,
    name: &str,
    file: &Path,
) -> Result<Option<Vec<(&'static str, String)>>> {
    let mut found = None;
    let mut in_section = false;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(section) = line.strip_prefix('[') {
            if in_section {
                break;
            }
            in_section = section.strip_suffix(']') == Some(name);
            if in_section {
                found = Some(Vec::new());
            }
            continue;
        }
        if !in_section {
            continue;
        }
        let where_ = || format!("line {} of the service file {}", n + 1, file.display());
        let Some((key, value)) = line.split_once('=') else {
            bail!("{} has no \"=\"; write key=value", where_());
        };
        let key = key.trim();
        if key == "service" {
            bail!("{} names another service; a service cannot nest", where_());
        }
        let Some(key) = super::dsn::KEYS.iter().find(|k| **k == key) else {
            bail!(
                "{} sets a key walbox does not know; check its spelling",
                where_()
            );
        };
        if let Some(settings) = found.as_mut() {
            let settings: &mut Vec<(&'static str, String)> = settings;
            settings.push((key, value.trim().to_owned()));
        }
    }
    Ok(found)
}

/// One line of a password file.
#[derive(Clone, PartialEq, Eq)]
struct PassEntry {
    host: String,
    port: String,
    dbname: String,
    user: String,
    password: String,
}

/// The entries of a password file that passed libpq's checks.
#[derive(Clone, Default)]
pub struct PassFile {
    entries: Vec<PassEntry>,
}

impl fmt::Debug for PassFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PassFile({} entries)", self.entries.len())
    }
}

impl PassFile {
    /// Reads `path` as libpq does: a missing file is an empty one; a file that is
    /// not a regular file, or that its group or others may read, is ignored with
    /// a warning.
    pub fn load(path: &Path) -> Self {
        let meta = match std::fs::metadata(path) {
            Ok(meta) => meta,
            Err(_) => return Self::default(),
        };
        if !meta.is_file() {
            tracing::warn!(file = %path.display(), "password file is not a plain file; ignored");
            return Self::default();
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!(
                    file = %path.display(),
                    "password file has group or world access; ignored. Permissions should be \
                     u=rw (0600) or less: chmod 0600 the file"
                );
                return Self::default();
            }
        }
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let file = Self::parse(&text);
                for e in &file.entries {
                    crate::redact::keep_out(&e.password);
                }
                file
            }
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e.kind(), "password file could not be read; ignored");
                Self::default()
            }
        }
    }

    /// The entries of a password file's text.
    pub fn parse(text: &str) -> Self {
        let entries = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|line| {
                let line = line.strip_suffix('\r').unwrap_or(line);
                let mut fields = Vec::with_capacity(5);
                let mut field = String::new();
                let mut chars = line.chars();
                while let Some(c) = chars.next() {
                    match c {
                        '\\' if fields.len() < 4 => {
                            // Keep the escape so that "\*" stays a literal star.
                            field.push('\\');
                            if let Some(n) = chars.next() {
                                field.push(n);
                            }
                        }
                        '\\' => {
                            if let Some(n) = chars.next() {
                                field.push(n);
                            }
                        }
                        ':' if fields.len() < 4 => fields.push(std::mem::take(&mut field)),
                        // The password ends at an unescaped colon.
                        ':' => break,
                        c => field.push(c),
                    }
                }
                if fields.len() < 4 {
                    return None;
                }
                let mut f = fields.into_iter();
                Some(PassEntry {
                    host: f.next()?,
                    port: f.next()?,
                    dbname: f.next()?,
                    user: f.next()?,
                    password: field,
                })
            })
            .collect();
        Self { entries }
    }

    /// The password of the first entry matching `host`, `port`, `dbname` and
    /// `user`. A Unix-socket host (a path) matches `localhost`, as in libpq.
    pub fn lookup(&self, host: &str, port: u16, dbname: &str, user: &str) -> Option<&str> {
        let host = if host.is_empty() || host.starts_with('/') {
            "localhost"
        } else {
            host
        };
        let port = port.to_string();
        self.entries
            .iter()
            .find(|e| {
                matches(&e.host, host)
                    && matches(&e.port, &port)
                    && matches(&e.dbname, dbname)
                    && matches(&e.user, user)
            })
            .map(|e| e.password.as_str())
    }
}

/// libpq's field match: `*` matches anything; otherwise the escaped field equals
/// `value`.
fn matches(field: &str, value: &str) -> bool {
    if field == "*" {
        return true;
    }
    let mut unescaped = String::with_capacity(field.len());
    let mut chars = field.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(n) = chars.next() {
                unescaped.push(n);
            }
        } else {
            unescaped.push(c);
        }
    }
    unescaped == value
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pgpass_fields_wildcards_and_escapes() {
        let f = PassFile::parse(
            "# comment\n\
             db1:5432:app:walbox:first\n\
             *:*:*:walbox:any\\:where\\\\\n\
             a\\:b:6000:*:u:colon host\n\
             \\*:1:d:u:literal star\n\
             localhost:5433:d:u:socket\r\n\
             p:1:d:u:ends:here\n\
             short:line\n",
        );
        assert_eq!(f.lookup("db1", 5432, "app", "walbox"), Some("first"));
        assert_eq!(f.lookup("db2", 5432, "app", "walbox"), Some("any:where\\"));
        assert_eq!(f.lookup("a:b", 6000, "x", "u"), Some("colon host"));
        assert_eq!(f.lookup("*", 1, "d", "u"), Some("literal star"));
        assert_eq!(f.lookup("other", 1, "d", "u"), None);
        assert_eq!(f.lookup("p", 1, "d", "u"), Some("ends"));
        assert_eq!(
            f.lookup("/var/run/postgresql", 5433, "d", "u"),
            Some("socket")
        );
        assert_eq!(f.lookup("db1", 5432, "app", "nobody"), None);
        assert!(!format!("{f:?}").contains("first"));
    }

    #[test]
    fn pgpass_with_group_access_is_ignored() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pgpass");
        std::fs::write(&path, "*:*:*:*:pw\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(PassFile::load(&path).lookup("h", 1, "d", "u"), Some("pw"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert_eq!(PassFile::load(&path).lookup("h", 1, "d", "u"), None);
        assert_eq!(
            PassFile::load(&dir.path().join("none")).lookup("h", 1, "d", "u"),
            None
        );
    }

    #[test]
    fn service_sections() {
        let text = "# services\n[a]\nhost=h1\nport = 6000\n\n[b]\nhost=h2\ndbname=x y\n";
        let file = Path::new("f");
        let b = service_section(text, "b", file).unwrap().unwrap();
        assert_eq!(
            b,
            vec![("host", "h2".to_owned()), ("dbname", "x y".to_owned())]
        );
        let a = service_section(text, "a", file).unwrap().unwrap();
        assert_eq!(
            a,
            vec![("host", "h1".to_owned()), ("port", "6000".to_owned())]
        );
        assert!(service_section(text, "c", file).unwrap().is_none());
        let err = service_section("[a]\npassword secret\n", "a", file).unwrap_err();
        assert!(err.to_string().contains("line 2") && !err.to_string().contains("secret"));
    }

    #[test]
    fn security_variables_walbox_ignores_are_refused_by_name() {
        for (name, value) in [
            ("PGREQUIREAUTH", "scram-sha-256"),
            ("PGGSSENCMODE", "require"),
            ("PGSSLNEGOTIATION", "direct"),
            ("PGSSLCRL", "/etc/crl.pem"),
            ("PGSSLCERTMODE", "require"),
            ("PGSSLMINPROTOCOLVERSION", "TLSv1.3"),
        ] {
            let err = Env::empty()
                .with(name, value)
                .refuse_unsupported()
                .unwrap_err()
                .to_string();
            assert!(err.contains(name) && !err.contains(value), "{err}");
        }
        // Values that ask for what walbox does anyway.
        for (name, value) in [
            ("PGGSSENCMODE", "disable"),
            ("PGGSSENCMODE", "prefer"),
            ("PGSSLNEGOTIATION", "postgres"),
            ("PGSSLCERTMODE", "allow"),
        ] {
            Env::empty().with(name, value).refuse_unsupported().unwrap();
        }
        Env::empty().refuse_unsupported().unwrap();
    }

    #[test]
    fn env_debug_names_no_values() {
        let env = Env::empty().with("PGPASSWORD", "hunter2");
        assert!(!format!("{env:?}").contains("hunter2"));
        assert_eq!(env.var("PGPASSWORD"), Some("hunter2"));
    }
}
