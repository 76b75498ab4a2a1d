//! Throwaway PostgreSQL clusters.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::User;
use tempfile::TempDir;

mod standby;

use crate::process::{self, command, give_to, log_tail, server_user};
use crate::{Result, TestkitError, TlsFiles, wait_until};

/// How long a server may take to start or stop before the kit gives up.
const SERVER_TIMEOUT: Duration = Duration::from_secs(60);

/// Superuser created by `initdb`.
pub const SUPERUSER: &str = "postgres";

/// Settings for a [`PgCluster`].
#[derive(Debug, Clone, Default)]
pub struct PgOptions {
    /// `max_slot_wal_keep_size` (e.g. `"64MB"`); unlimited when `None`.
    pub max_slot_wal_keep_size: Option<String>,
    /// `wal_sender_timeout`; the server default (60 s) when `None`.
    pub wal_sender_timeout: Option<Duration>,
    /// Serve TLS with a generated certificate and accept only TLS connections over TCP.
    pub tls: bool,
    /// With `tls`: also accept plaintext TCP connections.
    pub plaintext_too: bool,
    /// With `tls`: TCP connections must present a client certificate signed by
    /// the test CA whose common name is the user (`cert` for databases,
    /// `clientcert=verify-full` for replication).
    pub client_cert: bool,
    /// With `tls`: the names and addresses the server certificate is issued
    /// for; `localhost` and `127.0.0.1` when empty.
    pub server_cert_names: Vec<String>,
    /// Require SCRAM-SHA-256 passwords over TCP; the superuser gets this password.
    pub password: Option<String>,
    /// Further `name = value` settings for `postgresql.conf`.
    pub settings: Vec<(String, String)>,
}

impl PgOptions {
    /// Adds a `postgresql.conf` setting.
    #[must_use]
    pub fn setting(mut self, name: &str, value: &str) -> Self {
        self.settings.push((name.to_owned(), value.to_owned()));
        self
    }
}

/// How to stop a running server (`pg_ctl stop -m ...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Wait for clients to disconnect (SIGTERM).
    Smart,
    /// Disconnect clients, checkpoint, exit (SIGINT).
    Fast,
    /// Exit at once without a checkpoint; crash recovery runs at the next start (SIGQUIT).
    Immediate,
}

/// A PostgreSQL cluster in a temp dir, with `wal_level = logical`, listening on
/// `127.0.0.1` at a free port. Dropping it stops the server and deletes the files.
#[derive(Debug)]
pub struct PgCluster {
    dir: TempDir,
    bindir: PathBuf,
    port: u16,
    user: Option<User>,
    options: PgOptions,
    tls: Option<TlsFiles>,
    child: Option<Child>,
    /// The physical slot on the primary, for a standby.
    primary_slot: Option<String>,
}

impl PgCluster {
    /// Creates and starts a cluster with default options.
    pub fn start() -> Result<Self> {
        Self::start_with(PgOptions::default())
    }

    /// Creates and starts a cluster.
    pub fn start_with(options: PgOptions) -> Result<Self> {
        let bindir = bindir()?;
        let user = server_user()?;
        let dir = tempfile::Builder::new()
            .prefix("walbox-pg-")
            .tempdir()
            .map_err(TestkitError::io("creating", std::env::temp_dir()))?;
        let data = dir.path().join("data");
        give_to(user.as_ref(), dir.path())?;

        let pwfile = dir.path().join("pwfile");
        let mut initdb = command(&bindir.join("initdb"), user.as_ref());
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", SUPERUSER, "-E", "UTF8", "--locale=C", "--no-sync"])
            .args(["--auth-local=trust", "--auth-host=trust"]);
        if let Some(password) = &options.password {
            std::fs::write(&pwfile, password).map_err(TestkitError::io("writing", &pwfile))?;
            give_to(user.as_ref(), &pwfile)?;
            initdb.arg("--pwfile").arg(&pwfile);
        }
        process::run(initdb)?;
        let _ = std::fs::remove_file(&pwfile);
        Self::configure_and_launch(dir, bindir, user, options)
    }

    /// Writes the configuration of the data directory `dir/data` (with a
    /// generated certificate when TLS is asked for) and starts the server on a
    /// free port.
    fn configure_and_launch(
        dir: TempDir,
        bindir: PathBuf,
        user: Option<User>,
        options: PgOptions,
    ) -> Result<Self> {
        let tls = if options.tls {
            let certs = dir.path().join("certs");
            std::fs::create_dir(&certs).map_err(TestkitError::io("creating", &certs))?;
            if options.server_cert_names.is_empty() {
                Some(TlsFiles::generate(&certs, SUPERUSER)?)
            } else {
                let names: Vec<&str> = options
                    .server_cert_names
                    .iter()
                    .map(String::as_str)
                    .collect();
                Some(TlsFiles::generate_for(&certs, SUPERUSER, &names)?)
            }
        } else {
            None
        };

        let mut cluster = PgCluster {
            dir,
            bindir,
            port: 0,
            user,
            options,
            tls,
            child: None,
            primary_slot: None,
        };
        cluster.write_config()?;
        give_to(cluster.user.as_ref(), cluster.dir.path())?;
        let client = cluster.client_dir();
        std::fs::create_dir(&client).map_err(TestkitError::io("creating", &client))?;
        // A free port can be taken by someone else before the server binds it; try
        // a few before giving up.
        let mut last = None;
        for _ in 0..5 {
            cluster.port = process::free_port()?;
            cluster.write_port()?;
            match cluster.launch() {
                Ok(()) => return Ok(cluster),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(TestkitError::Timeout {
            what: "a free port".into(),
            after: SERVER_TIMEOUT,
        }))
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    fn write_config(&self) -> Result<()> {
        let o = &self.options;
        let mut conf = String::new();
        let mut set = |k: &str, v: &str| {
            let _ = writeln!(conf, "{k} = '{}'", v.replace('\'', "''"));
        };
        set("listen_addresses", "127.0.0.1");
        set(
            "unix_socket_directories",
            &self.dir.path().display().to_string(),
        );
        set("wal_level", "logical");
        set("max_replication_slots", "20");
        set("max_wal_senders", "20");
        set("max_connections", "100");
        set("max_prepared_transactions", "10");
        // Test data is disposable: skip fsync. Committed data still survives a kill of
        // the server, which only takes the processes, not the OS page cache.
        set("fsync", "off");
        set("full_page_writes", "off");
        set("shared_buffers", "64MB");
        set("log_min_messages", "warning");
        set("log_connections", "off");
        if let Some(size) = &o.max_slot_wal_keep_size {
            set("max_slot_wal_keep_size", size);
        }
        if let Some(t) = o.wal_sender_timeout {
            set("wal_sender_timeout", &format!("{}ms", t.as_millis()));
        }
        if o.password.is_some() {
            set("password_encryption", "scram-sha-256");
        }
        if let Some(tls) = &self.tls {
            set("ssl", "on");
            set("ssl_cert_file", &tls.server_cert.display().to_string());
            set("ssl_key_file", &tls.server_key.display().to_string());
            set("ssl_ca_file", &tls.ca_cert.display().to_string());
        }
        for (k, v) in &o.settings {
            set(k, v);
        }
        let path = self.data_dir().join("postgresql.auto.conf");
        std::fs::write(&path, conf).map_err(TestkitError::io("writing", &path))?;

        // Local socket: trust (the kit's own admin access). TCP: trust, SCRAM, or
        // SCRAM over TLS only, for normal and replication connections alike.
        let method = if o.password.is_some() {
            "scram-sha-256"
        } else {
            "trust"
        };
        let host = if o.tls && !o.plaintext_too {
            "hostssl"
        } else {
            "host"
        };
        let mut hba = String::from("local all all trust\nlocal replication all trust\n");
        for db in ["all", "replication"] {
            if o.tls && o.client_cert {
                // Both spellings of "a verified client certificate for this user".
                let line = if db == "all" {
                    "cert".to_owned()
                } else {
                    format!("{method} clientcert=verify-full")
                };
                let _ = writeln!(hba, "hostssl {db} all 127.0.0.1/32 {line}");
            } else {
                let _ = writeln!(hba, "{host} {db} all 127.0.0.1/32 {method}");
            }
        }
        if o.tls && !o.plaintext_too {
            for db in ["all", "replication"] {
                let _ = writeln!(hba, "hostnossl {db} all 127.0.0.1/32 reject");
            }
        }
        let path = self.data_dir().join("pg_hba.conf");
        std::fs::write(&path, hba).map_err(TestkitError::io("writing", &path))
    }

    fn write_port(&self) -> Result<()> {
        let path = self.data_dir().join("port.conf");
        std::fs::write(&path, format!("port = {}\n", self.port))
            .map_err(TestkitError::io("writing", &path))?;
        let conf = self.data_dir().join("postgresql.conf");
        let text = std::fs::read_to_string(&conf).map_err(TestkitError::io("reading", &conf))?;
        if !text.contains("include_if_exists = 'port.conf'") {
            std::fs::write(&conf, format!("{text}\ninclude_if_exists = 'port.conf'\n"))
                .map_err(TestkitError::io("writing", &conf))?;
        }
        give_to(self.user.as_ref(), &path)
    }

    fn launch(&mut self) -> Result<()> {
        let log_path = self.log_path();
        let (log, log_err) = process::log_files(&log_path)?;
        give_to(self.user.as_ref(), &log_path)?;
        let mut cmd = command(&self.bindir.join("postgres"), self.user.as_ref());
        cmd.arg("-D")
            .arg(self.data_dir())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let child = cmd
            .spawn()
            .map_err(TestkitError::io("starting", self.bindir.join("postgres")))?;
        let pid = child.id();
        self.child = Some(child);
        let pidfile = self.data_dir().join("postmaster.pid");
        let result = wait_until("postgres to accept connections", SERVER_TIMEOUT, || {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                return Some(Err(status));
            }
            // postmaster.pid: line 1 is the pid (a file left by a killed server
            // names another), line 8 the server's status.
            let text = std::fs::read_to_string(&pidfile).ok()?;
            let mut lines = text.lines().map(str::trim);
            let ours = lines.next() == Some(pid.to_string().as_str());
            (ours && lines.nth(6) == Some("ready")).then_some(Ok(()))
        })?;
        match result {
            Ok(()) => Ok(()),
            Err(status) => {
                self.child = None;
                Err(TestkitError::Exited {
                    what: "postgres".into(),
                    status,
                    log: log_tail(&log_path),
                })
            }
        }
    }

    /// The TCP port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The host to connect to over TCP.
    #[must_use]
    pub fn host(&self) -> &'static str {
        "127.0.0.1"
    }

    /// Directory of the server's Unix socket.
    #[must_use]
    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    /// A directory for a client's files (a checkpoint), removed with the
    /// cluster: state that belongs to this cluster dies with it.
    #[must_use]
    pub fn client_dir(&self) -> PathBuf {
        self.dir.path().join("client")
    }

    /// The superuser's name.
    #[must_use]
    pub fn user(&self) -> &'static str {
        SUPERUSER
    }

    /// The superuser's password, when SCRAM is on.
    #[must_use]
    pub fn password(&self) -> Option<&str> {
        self.options.password.as_deref()
    }

    /// The certificate files, when TLS is on.
    #[must_use]
    pub fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    /// Directory of the server binaries in use.
    #[must_use]
    pub fn bindir(&self) -> &Path {
        &self.bindir
    }

    /// The server's major version (15, 16, 17, 18), from `postgres --version`.
    pub fn major(&self) -> Result<u32> {
        server_major(&self.bindir)
    }

    /// A libpq key=value connection string for `database` over TCP as the superuser
    /// (with the password and `sslmode=verify-full` when those are on).
    #[must_use]
    pub fn conninfo(&self, database: &str) -> String {
        let mut s = format!(
            "host={} port={} user={} dbname={database}",
            self.host(),
            self.port,
            SUPERUSER
        );
        if let Some(p) = &self.options.password {
            let _ = write!(s, " password={}", quote(p));
        }
        if let Some(tls) = &self.tls {
            let _ = write!(
                s,
                " sslmode=verify-full sslrootcert={}",
                quote(&tls.ca_cert.display().to_string())
            );
        }
        s
    }

    /// A libpq connection string over the Unix socket, which always trusts the
    /// superuser: for the kit's own administration, whatever TCP requires.
    #[must_use]
    pub fn socket_conninfo(&self, database: &str) -> String {
        format!(
            "host={} port={} user={SUPERUSER} dbname={database}",
            self.dir.path().display(),
            self.port
        )
    }

    /// Connects as the superuser over the Unix socket; the connection task runs on
    /// the current tokio runtime.
    pub async fn connect(&self, database: &str) -> Result<tokio_postgres::Client> {
        let (client, connection) =
            tokio_postgres::connect(&self.socket_conninfo(database), tokio_postgres::NoTls).await?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "test connection closed");
            }
        });
        Ok(client)
    }

    /// Whether the server is running (as far as this handle knows).
    #[must_use]
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Stops the server and waits until all its processes are gone.
    pub fn stop(&mut self, mode: StopMode) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let signal = match mode {
            StopMode::Smart => Signal::SIGTERM,
            StopMode::Fast => Signal::SIGINT,
            StopMode::Immediate => Signal::SIGQUIT,
        };
        // Only the postmaster gets the stop signal, as pg_ctl does; it stops the rest.
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
        let _ = nix::sys::signal::kill(pid, signal);
        process::wait_group_gone(&mut child, "postgres", SERVER_TIMEOUT)
    }

    /// Kills the postmaster and every backend with SIGKILL at once, like a crash of
    /// the machine's database processes, and waits until they are gone. The next
    /// [`start_again`](Self::start_again) runs crash recovery.
    pub fn kill9(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        process::kill_tree(&mut child, "postgres", SERVER_TIMEOUT)
    }

    /// Starts a stopped or killed server again on the same port.
    pub fn start_again(&mut self) -> Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        self.launch()
    }

    /// Stops the server in `mode` and starts it again.
    pub fn restart(&mut self, mode: StopMode) -> Result<()> {
        self.stop(mode)?;
        self.start_again()
    }

    /// Copies the stopped server's data directory to the copy `name` (kept
    /// beside it): a disk snapshot to restore later with
    /// [`restore_data`](Self::restore_data).
    pub fn copy_data(&self, name: &str) -> Result<()> {
        self.copy_tree(&self.data_dir(), &self.dir.path().join(name))
    }

    /// Replaces the stopped server's data directory with the copy `name` made by
    /// [`copy_data`](Self::copy_data): the server as it was when copied.
    pub fn restore_data(&mut self, name: &str) -> Result<()> {
        let data = self.data_dir();
        std::fs::remove_dir_all(&data).map_err(|source| TestkitError::Io {
            action: "removing",
            path: data.clone(),
            source,
        })?;
        self.copy_tree(&self.dir.path().join(name), &data)
    }

    /// `cp -a from to`: keeps owners and modes (the server refuses a data
    /// directory that is not its own or is open to others).
    fn copy_tree(&self, from: &Path, to: &Path) -> Result<()> {
        if self.child.is_some() {
            return Err(TestkitError::Io {
                action: "copying the data directory of a running server (stop it first):",
                path: from.to_path_buf(),
                source: std::io::Error::other("server running"),
            });
        }
        let out = std::process::Command::new("cp")
            .arg("-a")
            .arg(from)
            .arg(to)
            .output()
            .map_err(|source| TestkitError::Io {
                action: "running cp for",
                path: from.to_path_buf(),
                source,
            })?;
        if !out.status.success() {
            return Err(TestkitError::CommandFailed {
                command: format!("cp -a {} {}", from.display(), to.display()),
                status: out.status,
                output: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        Ok(())
    }

    /// The server log so far (its last part), for diagnosing a failed test.
    #[must_use]
    pub fn log_tail(&self) -> String {
        log_tail(&self.log_path())
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let segment = shared_memory_id(&self.data_dir());
        if let Some(mut child) = self.child.take() {
            let _ = process::kill_tree(&mut child, "postgres", SERVER_TIMEOUT);
        }
        // A killed server leaves its System V segment behind, and the
        // kernel holds a few thousand at most (SHMMNI): once they are used
        // up, no cluster starts on this machine again.
        if let Some(id) = segment {
            let _ = std::process::Command::new("ipcrm")
                .args(["-m", &id])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        // TempDir removes the files.
    }
}

/// The id of the System V shared memory segment of the server of `data`:
/// the second field of `postmaster.pid`'s seventh line (`key id`), while
/// the server runs or after it was killed.
fn shared_memory_id(data: &Path) -> Option<String> {
    let pid = std::fs::read_to_string(data.join("postmaster.pid")).ok()?;
    let id = pid.lines().nth(6)?.split_whitespace().nth(1)?;
    id.parse::<u64>().ok()?;
    Some(id.to_owned())
}

/// A libpq key=value value, quoted and escaped.
fn quote(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// Directory of the PostgreSQL server binaries: `WALBOX_PG_BINDIR`, else the
/// major version `WALBOX_PG_VERSION` names (see [`major_bindir`]), else
/// `pg_config --bindir` when it holds `initdb`, else the newest
/// `/usr/lib/postgresql/<version>/bin` (Debian's layout).
fn bindir() -> Result<PathBuf> {
    if let Ok(dir) = std::env::var("WALBOX_PG_BINDIR") {
        return Ok(PathBuf::from(dir));
    }
    if let Ok(major) = std::env::var("WALBOX_PG_VERSION") {
        let major = major.trim();
        if !major.is_empty() {
            return major_bindir(major);
        }
    }
    if let Ok(out) = std::process::Command::new("pg_config")
        .arg("--bindir")
        .output()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && dir.join("initdb").is_file() {
            return Ok(dir);
        }
    }
    for version in (13..=18).rev() {
        let dir = PathBuf::from(format!("/usr/lib/postgresql/{version}/bin"));
        if dir.join("initdb").is_file() {
            return Ok(dir);
        }
    }
    Err(TestkitError::MissingProgram {
        program: "PostgreSQL server (initdb, postgres)".into(),
        hint: "run `make deps`, or set WALBOX_PG_BINDIR".into(),
    })
}

/// The major version of the server binaries in `bindir`, from `postgres --version`
/// (`postgres (PostgreSQL) 17.10` -> 17).
pub fn server_major(bindir: &Path) -> Result<u32> {
    let program = bindir.join("postgres");
    let out = std::process::Command::new(&program)
        .arg("--version")
        .output()
        .map_err(TestkitError::io("running", &program))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.rsplit(' ')
        .next()
        .and_then(|v| v.trim().split('.').next())
        .and_then(|m| m.parse().ok())
        .ok_or_else(|| TestkitError::MissingProgram {
            program: format!(
                "a PostgreSQL server that reports its version ({})",
                program.display()
            ),
            hint: "set WALBOX_PG_BINDIR or WALBOX_PG_VERSION".into(),
        })
}

/// The server binaries of one major version: Debian's
/// `/usr/lib/postgresql/<major>/bin`, else the build `scripts/pg-major.sh`
/// unpacked into its cache (`WALBOX_PG_CACHE`, `/var/cache/walbox/postgresql`,
/// `~/.cache/walbox/postgresql`), in a directory named `<major>.<minor>...`.
pub fn major_bindir(major: &str) -> Result<PathBuf> {
    let debian = PathBuf::from(format!("/usr/lib/postgresql/{major}/bin"));
    if debian.join("initdb").is_file() {
        return Ok(debian);
    }
    let mut caches = Vec::new();
    if let Ok(dir) = std::env::var("WALBOX_PG_CACHE") {
        caches.push(PathBuf::from(dir));
    }
    caches.push(PathBuf::from("/var/cache/walbox/postgresql"));
    if let Some(home) = std::env::var_os("XDG_CACHE_HOME").or_else(|| {
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").into_os_string())
    }) {
        caches.push(PathBuf::from(home).join("walbox").join("postgresql"));
    }
    for cache in &caches {
        let Ok(entries) = std::fs::read_dir(cache) else {
            continue;
        };
        let mut found: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.split('.').next() == Some(major))
                    && p.join(".complete").is_file()
                    && p.join("native/bin/initdb").is_file()
            })
            .collect();
        found.sort();
        if let Some(dir) = found.pop() {
            return Ok(dir.join("native/bin"));
        }
    }
    Err(TestkitError::MissingProgram {
        program: format!("PostgreSQL {major} server (initdb, postgres)"),
        hint: format!("run `scripts/pg-major.sh {major}` (or `make deps PG_VERSIONS={major}`)"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether System V shared memory segment `id` exists (`ipcs` exits 0
    /// either way; it describes the segment only when there is one).
    fn segment_exists(id: &str) -> bool {
        std::process::Command::new("ipcs")
            .args(["-m", "-i", id])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(&format!("shmid={id}")))
    }

    #[test]
    fn a_cluster_dropped_leaves_no_shared_memory_segment_behind() {
        let pg = PgCluster::start().unwrap();
        let id = shared_memory_id(&pg.data_dir()).expect("postmaster.pid names its segment");
        assert!(segment_exists(&id), "segment {id} while the server runs");
        drop(pg);
        // Removed once the last of the killed processes has let go of it.
        crate::wait_until("the segment to go", Duration::from_secs(30), || {
            (!segment_exists(&id)).then_some(())
        })
        .unwrap_or_else(|e| panic!("segment {id} left behind: {e}"));
    }
}
