//! A throwaway `nats-server -js` (Debian's `nats-server` package) on a free
//! port with a temporary store directory: paused (SIGSTOP) and resumed, stopped,
//! killed with SIGKILL and started again on the same port and store; killed when dropped. And a reader
//! of a subject's messages for the demo and assertions.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use tempfile::TempDir;

use crate::process::{self, log_tail, signal_group};
use crate::{Result, TestkitError, wait_until};

const NATS_TIMEOUT: Duration = Duration::from_secs(30);

/// Who may connect to a [`NatsServer`].
#[derive(Debug, Clone, Default)]
pub struct NatsOptions {
    /// A user and password every client must give.
    pub user: Option<(String, String)>,
    /// A token every client must give.
    pub token: Option<String>,
}

/// A running JetStream server.
#[derive(Debug)]
pub struct NatsServer {
    dir: TempDir,
    program: PathBuf,
    port: u16,
    options: NatsOptions,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts a server anyone may connect to.
    pub fn start() -> Result<Self> {
        Self::start_with(NatsOptions::default())
    }

    /// Starts a server with these options.
    pub fn start_with(options: NatsOptions) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("walbox-nats-")
            .tempdir()
            .map_err(TestkitError::io("creating", std::env::temp_dir()))?;
        let mut server = NatsServer {
            dir,
            program: nats_program()?,
            port: 0,
            options,
            child: None,
        };
        process::launch_on_free_port(|port| {
            server.port = port;
            server.launch()
        })?;
        Ok(server)
    }

    /// The server's URL for clients.
    #[must_use]
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Stops the server gracefully (SIGTERM) and waits until it is gone.
    pub fn stop(&mut self) -> Result<()> {
        self.end(Signal::SIGTERM)
    }

    /// Kills the server with SIGKILL and waits until it is gone.
    pub fn kill9(&mut self) -> Result<()> {
        self.end(Signal::SIGKILL)
    }

    /// Freezes the server (SIGSTOP): its connections stay open, it reads and
    /// answers nothing until [`NatsServer::resume`].
    pub fn pause(&mut self) -> Result<()> {
        match &self.child {
            Some(child) => signal_group(child, Signal::SIGSTOP),
            None => Ok(()),
        }
    }

    /// Lets a paused server run again (SIGCONT).
    pub fn resume(&mut self) -> Result<()> {
        match &self.child {
            Some(child) => signal_group(child, Signal::SIGCONT),
            None => Ok(()),
        }
    }

    /// Starts a stopped or killed server again on the same port and store.
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
        // A paused server takes SIGTERM only once it runs again.
        signal_group(&child, Signal::SIGCONT)?;
        signal_group(&child, signal)?;
        process::wait_group_gone(&mut child, "nats-server", NATS_TIMEOUT)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats.log")
    }

    fn launch(&mut self) -> Result<()> {
        let log_path = self.log_path();
        // What an earlier run logged is not this run's readiness.
        let _ = std::fs::remove_file(&log_path);
        let (log, log_err) = process::log_files(&log_path)?;
        let store = self.dir.path().join("store");
        let mut cmd = process::command(&self.program, None);
        cmd.args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string()])
            .arg("-sd")
            .arg(&store);
        if let Some((user, password)) = &self.options.user {
            cmd.args(["--user", user, "--pass", password]);
        }
        if let Some(token) = &self.options.token {
            cmd.args(["--auth", token]);
        }
        cmd.current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let child = cmd
            .spawn()
            .map_err(TestkitError::io("starting", &self.program))?;
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.port);
        let ready = wait_until("nats-server to be ready", NATS_TIMEOUT, || {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                return Some(Err(status));
            }
            let logged =
                std::fs::read_to_string(&log_path).is_ok_and(|t| t.contains("Server is ready"));
            (logged && TcpStream::connect(&addr).is_ok()).then_some(Ok(()))
        })?;
        if let Err(status) = ready {
            self.child = None;
            return Err(TestkitError::Exited {
                what: "nats-server".into(),
                status,
                log: log_tail(&log_path),
            });
        }
        Ok(())
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.end(Signal::SIGKILL);
    }
}

/// Reads at least `wanted` messages of `subject` from the stream that holds
/// it (an ephemeral consumer from its start), as [`crate::kafka::Record`]s:
/// partition 0, the stream sequence as offset, the key from the `walbox_key`
/// header.
pub async fn read_at_least(
    url: &str,
    subject: &str,
    wanted: usize,
    timeout: Duration,
) -> std::result::Result<Vec<crate::kafka::Record>, async_nats::Error> {
    use async_nats::jetstream::consumer;
    use futures_util::StreamExt;
    let js = async_nats::jetstream::new(async_nats::connect(url).await?);
    let deadline = tokio::time::Instant::now() + timeout;
    let name = loop {
        match js.stream_by_subject(subject).await {
            Ok(n) => break n,
            Err(e) if tokio::time::Instant::now() > deadline => return Err(e.into()),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let stream = js.get_stream(&name).await?;
    let reader = stream
        .create_consumer(consumer::pull::Config {
            filter_subject: subject.to_owned(),
            ack_policy: consumer::AckPolicy::None,
            ..Default::default()
        })
        .await?;
    let mut messages = reader.messages().await?;
    let mut out = Vec::new();
    while out.len() < wanted {
        let m = tokio::time::timeout_at(deadline, messages.next())
            .await
            .map_err(|_| format!("{} of {wanted} messages of {subject} read", out.len()))?
            .ok_or("the reader ended")??;
        let offset = m.info().map(|i| i.stream_sequence).unwrap_or(0);
        let headers: Vec<(String, Option<Vec<u8>>)> = m
            .headers
            .iter()
            .flat_map(|h| h.iter())
            .flat_map(|(k, vs)| {
                vs.iter().map(move |v| {
                    (
                        AsRef::<str>::as_ref(k).to_owned(),
                        Some(v.as_str().as_bytes().to_vec()),
                    )
                })
            })
            .collect();
        let key = headers
            .iter()
            .find(|(k, _)| k == "walbox_key")
            .and_then(|(_, v)| v.clone());
        out.push(crate::kafka::Record {
            topic: subject.to_owned(),
            partition: 0,
            offset: i64::try_from(offset).unwrap_or(i64::MAX),
            key,
            headers,
            value: Some(m.payload.to_vec()),
        });
    }
    Ok(out)
}

/// The nats-server executable: `WALBOX_NATS_SERVER`, else `nats-server` on
/// `PATH` or in `/usr/sbin` (where Debian puts it).
fn nats_program() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("WALBOX_NATS_SERVER") {
        return Ok(PathBuf::from(p));
    }
    let mut candidates: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("nats-server"))
                .collect()
        })
        .unwrap_or_default();
    candidates.push(PathBuf::from("/usr/sbin/nats-server"));
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| TestkitError::MissingProgram {
            program: "nats-server".into(),
            hint: "run `make deps` (apt-get install nats-server), or set WALBOX_NATS_SERVER \
                   to its path"
                .into(),
        })
}
