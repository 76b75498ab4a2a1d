//! A throwaway LocalStack (SQS and SNS; `scripts/aws.sh` installs it into a
//! Python venv) on a free port of 127.0.0.1, with its directories in a temp
//! dir; stopped and started again on the same port (it keeps nothing across
//! a restart), killed and removed when dropped.
//!
//! Clients sign their requests with any credentials (LocalStack checks
//! none): [`crate::Kinesalite::client_env`] and
//! [`crate::Kinesalite::credentials`] serve here too.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use tempfile::TempDir;

use crate::process::{self, log_tail, signal_group};
use crate::{Result, TestkitError, wait_until};

const TIMEOUT: Duration = Duration::from_secs(90);

/// The pinned LocalStack (`scripts/aws.sh`).
pub const LOCALSTACK_VERSION: &str = "2026.3.0";

/// A running LocalStack.
#[derive(Debug)]
pub struct LocalStack {
    dir: TempDir,
    python: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl LocalStack {
    /// Starts LocalStack with SQS and SNS on a free port.
    pub fn start() -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("walbox-localstack-")
            .tempdir()
            .map_err(TestkitError::io("creating", std::env::temp_dir()))?;
        for sub in ["fs", "tmp", "volume"] {
            std::fs::create_dir(dir.path().join(sub))
                .map_err(TestkitError::io("creating", dir.path()))?;
        }
        let mut server = LocalStack {
            dir,
            python: localstack_python()?,
            port: 0,
            child: None,
        };
        process::launch_on_free_port(|port| {
            server.port = port;
            server.launch()
        })?;
        Ok(server)
    }

    /// The endpoint URL clients use (`endpoint_url`).
    #[must_use]
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills the server with SIGKILL and waits until it is gone.
    pub fn kill9(&mut self) -> Result<()> {
        self.end(Signal::SIGKILL)
    }

    /// Starts a killed server again on the same port (empty: LocalStack
    /// keeps nothing across a restart).
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

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("localstack.log")
    }

    fn end(&mut self, signal: Signal) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        signal_group(&child, signal)?;
        process::wait_group_gone(&mut child, "localstack", TIMEOUT)
    }

    fn launch(&mut self) -> Result<()> {
        let log_path = self.log_path();
        let _ = std::fs::remove_file(&log_path);
        let (log, log_err) = process::log_files(&log_path)?;
        let mut cmd = process::command(&self.python, None);
        let root = self.dir.path();
        cmd.args(["-m", "localstack.runtime.main"])
            .env("GATEWAY_LISTEN", format!("127.0.0.1:{}", self.port))
            .env("SERVICES", "sqs,sns")
            .env("DNS_ADDRESS", "0")
            .env("DISABLE_EVENTS", "1")
            .env("SKIP_SSL_CERT_DOWNLOAD", "1")
            .env("FILESYSTEM_ROOT", root.join("fs"))
            .env("LOCALSTACK_VOLUME_DIR", root.join("volume"))
            .env("TMPDIR", root.join("tmp"))
            .env("HOME", root)
            .current_dir(root)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let child = cmd
            .spawn()
            .map_err(TestkitError::io("starting", &self.python))?;
        self.child = Some(child);
        let port = self.port;
        let pid = self.child.as_ref().map_or(0, Child::id);
        let ready = wait_until("localstack to be ready", TIMEOUT, || {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                return Some(Err(status));
            }
            (crate::kinesis::listens(pid, port) && services_up(port)).then_some(Ok(()))
        })?;
        if let Err(status) = ready {
            self.child = None;
            return Err(TestkitError::Exited {
                what: "localstack".into(),
                status,
                log: log_tail(&log_path),
            });
        }
        Ok(())
    }
}

impl Drop for LocalStack {
    fn drop(&mut self) {
        let _ = self.end(Signal::SIGKILL);
    }
}

/// Whether LocalStack on `port` says SQS and SNS are up.
fn services_up(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let request =
        "GET /_localstack/health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if s.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    let up = |service: &str| {
        answer.contains(&format!("\"{service}\": \"available\""))
            || answer.contains(&format!("\"{service}\": \"running\""))
    };
    answer.starts_with("HTTP/1.1 200") && up("sqs") && up("sns")
}

fn localstack_python() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("WALBOX_LOCALSTACK_PYTHON") {
        return Ok(PathBuf::from(p));
    }
    let python = crate::kinesis::cache_dir()
        .join(format!("localstack-{LOCALSTACK_VERSION}"))
        .join("bin/python");
    if python.is_file() {
        return Ok(python);
    }
    Err(TestkitError::MissingProgram {
        program: format!("LocalStack {LOCALSTACK_VERSION} ({})", python.display()),
        hint: "run `scripts/aws.sh` (or `make deps`), or set WALBOX_LOCALSTACK_PYTHON to the \
               python of a venv holding localstack-core"
            .into(),
    })
}
