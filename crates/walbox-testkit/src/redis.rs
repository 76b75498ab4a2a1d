//! A throwaway `redis-server` (Debian's `redis-server` package) as an
//! unprivileged user on a free port, with its own data directory, the
//! append-only file on and fsynced on every write (`appendfsync always`), no
//! RDB snapshots: stopped, killed with SIGKILL and started again on the same
//! port and directory; killed and removed when dropped.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::User;
use tempfile::TempDir;

use crate::process::{self, give_to, log_tail, server_user, signal_group};
use crate::{Result, TestkitError, wait_until};

const REDIS_TIMEOUT: Duration = Duration::from_secs(30);

/// Who may connect to a [`RedisServer`].
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// A password every client must give (`requirepass`, the default user's).
    pub password: Option<String>,
    /// Also listen with TLS on a port of its own ([`RedisServer::tls_url`]),
    /// with generated certificates ([`RedisServer::tls_files`]); clients must
    /// show a certificate the CA signed.
    pub tls: bool,
}

/// A running Redis server.
#[derive(Debug)]
pub struct RedisServer {
    dir: TempDir,
    program: PathBuf,
    port: u16,
    user: Option<User>,
    options: RedisOptions,
    tls: Option<(crate::TlsFiles, u16)>,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server anyone may connect to.
    pub fn start() -> Result<Self> {
        Self::start_with(RedisOptions::default())
    }

    /// Starts a server with these options.
    pub fn start_with(options: RedisOptions) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("walbox-redis-")
            .tempdir()
            .map_err(TestkitError::io("creating", std::env::temp_dir()))?;
        let user = server_user()?;
        std::fs::create_dir(dir.path().join("data"))
            .map_err(TestkitError::io("creating", dir.path()))?;
        let tls = if options.tls {
            let certs = dir.path().join("tls");
            std::fs::create_dir(&certs).map_err(TestkitError::io("creating", &certs))?;
            Some((
                crate::TlsFiles::generate(&certs, "walbox")?,
                process::free_port()?,
            ))
        } else {
            None
        };
        give_to(user.as_ref(), dir.path())?;
        let mut server = RedisServer {
            dir,
            program: redis_program()?,
            port: 0,
            user,
            options,
            tls,
            child: None,
        };
        process::launch_on_free_port(|port| {
            server.port = port;
            server.launch()
        })?;
        Ok(server)
    }

    /// The server's URL for clients (without credentials).
    #[must_use]
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The TLS URL (`rediss://127.0.0.1:<tls port>`), with TLS on.
    #[must_use]
    pub fn tls_url(&self) -> Option<String> {
        self.tls
            .as_ref()
            .map(|(_, port)| format!("rediss://127.0.0.1:{port}"))
    }

    /// The certificates, with TLS on.
    #[must_use]
    pub fn tls_files(&self) -> Option<&crate::TlsFiles> {
        self.tls.as_ref().map(|(files, _)| files)
    }

    /// The port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The data directory (the append-only file is under it).
    #[must_use]
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Stops the server gracefully (SIGTERM) and waits until it is gone.
    pub fn stop(&mut self) -> Result<()> {
        self.end(Signal::SIGTERM)
    }

    /// Kills the server with SIGKILL and waits until it is gone.
    pub fn kill9(&mut self) -> Result<()> {
        self.end(Signal::SIGKILL)
    }

    /// Starts a stopped or killed server again on the same port and data
    /// directory; returns once it has loaded its append-only file.
    pub fn start_again(&mut self) -> Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        self.launch()
    }

    /// The server's log so far (its last part).
    #[must_use]
    pub fn log_tail(&self) -> String {
        log_tail(&self.log_path())
    }

    fn end(&mut self, signal: Signal) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        signal_group(&child, signal)?;
        process::wait_group_gone(&mut child, "redis-server", REDIS_TIMEOUT)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    fn launch(&mut self) -> Result<()> {
        let log_path = self.log_path();
        let _ = std::fs::remove_file(&log_path);
        let (log, log_err) = process::log_files(&log_path)?;
        give_to(self.user.as_ref(), &log_path)?;
        let mut cmd = process::command(&self.program, self.user.as_ref());
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(self.data_dir())
            .args([
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--daemonize",
                "no",
                "--protected-mode",
                "no",
            ]);
        if let Some((files, port)) = &self.tls {
            cmd.args(["--tls-port", &port.to_string(), "--tls-auth-clients", "yes"])
                .arg("--tls-cert-file")
                .arg(&files.server_cert)
                .arg("--tls-key-file")
                .arg(&files.server_key)
                .arg("--tls-ca-cert-file")
                .arg(&files.ca_cert);
        }
        if let Some(p) = &self.options.password {
            cmd.args(["--requirepass", p]);
        }
        cmd.current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let child = cmd
            .spawn()
            .map_err(TestkitError::io("starting", &self.program))?;
        self.child = Some(child);
        let port = self.port;
        let ready = wait_until("redis-server to be ready", REDIS_TIMEOUT, || {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                return Some(Err(status));
            }
            answers_ping(port).then_some(Ok(()))
        })?;
        if let Err(status) = ready {
            self.child = None;
            return Err(TestkitError::Exited {
                what: "redis-server".into(),
                status,
                log: log_tail(&log_path),
            });
        }
        Ok(())
    }
}

/// Whether the server on `port` answers PING (`+PONG`, or `-NOAUTH` when it
/// wants a password): it is up and has loaded its data (while loading it
/// answers `-LOADING`).
fn answers_ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).unwrap_or(0);
    let answer = &buf[..n];
    answer.starts_with(b"+PONG") || answer.starts_with(b"-NOAUTH")
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.end(Signal::SIGKILL);
    }
}

fn redis_program() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("WALBOX_REDIS_SERVER") {
        return Ok(PathBuf::from(p));
    }
    let mut candidates: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("redis-server"))
                .collect()
        })
        .unwrap_or_default();
    candidates.push(PathBuf::from("/usr/bin/redis-server"));
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| TestkitError::MissingProgram {
            program: "redis-server".into(),
            hint: "run `make deps` (apt-get install redis-server), or set WALBOX_REDIS_SERVER \
                   to its path"
                .into(),
        })
}

/// Whether `path` is a Redis data directory with an append-only file.
#[must_use]
pub fn has_aof(path: &Path) -> bool {
    path.join("appendonlydir").is_dir() || path.join("appendonly.aof").is_file()
}

/// An entry's fields, in order.
type Fields = Vec<(String, Vec<u8>)>;

/// Reads at least `wanted` entries of stream `key` (waiting up to `timeout`
/// for them), as [`crate::kafka::Record`]s: partition 0, the entry's place as
/// offset, the key from its `key` field, headers from its `header:<name>`
/// fields, the value from `value`.
pub async fn read_at_least(
    url: &str,
    key: &str,
    wanted: usize,
    timeout: Duration,
) -> std::result::Result<Vec<crate::kafka::Record>, String> {
    let client = ::redis::Client::open(url).map_err(|e| e.to_string())?;
    let mut con = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let entries: Vec<(String, Fields)> = ::redis::cmd("XRANGE")
            .arg(key)
            .arg("-")
            .arg("+")
            .query_async(&mut con)
            .await
            .map_err(|e| e.to_string())?;
        if entries.len() >= wanted || tokio::time::Instant::now() > deadline {
            return Ok(entries
                .into_iter()
                .enumerate()
                .map(|(i, (_, fields))| {
                    let field =
                        |n: &str| fields.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
                    crate::kafka::Record {
                        topic: key.to_owned(),
                        partition: 0,
                        offset: i64::try_from(i).unwrap_or(i64::MAX),
                        key: field("key"),
                        headers: fields
                            .iter()
                            .filter_map(|(k, v)| {
                                k.strip_prefix("header:")
                                    .map(|n| (n.to_owned(), Some(v.clone())))
                            })
                            .collect(),
                        value: field("value"),
                    }
                })
                .collect());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
