//! A Kafka-protocol broker for tests: tansu on a free port, or a real Kafka.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use tempfile::TempDir;

use crate::process::{self, log_tail, signal_group};
use crate::{Result, TestkitError, wait_until};

/// Pinned broker version; `make deps` installs exactly this.
pub const TANSU_VERSION: &str = "0.6.0";

/// How long the broker may take to start or stop.
const BROKER_TIMEOUT: Duration = Duration::from_secs(60);

/// Where a tansu broker keeps its data.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BrokerStorage {
    /// In memory: fastest; everything is gone when the broker stops.
    #[default]
    Memory,
    /// A SQLite file in the broker's directory: acknowledged messages survive a
    /// restart and a SIGKILL.
    Sqlite,
}

/// A SASL/SCRAM mechanism of a broker user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scram {
    /// `SCRAM-SHA-256`.
    Sha256,
    /// `SCRAM-SHA-512`.
    Sha512,
}

impl Scram {
    /// The mechanism's name as clients set it (`sasl.mechanism`).
    #[must_use]
    pub const fn mechanism(self) -> &'static str {
        match self {
            Scram::Sha256 => "SCRAM-SHA-256",
            Scram::Sha512 => "SCRAM-SHA-512",
        }
    }

    const fn tansu_name(self) -> &'static str {
        match self {
            Scram::Sha256 => "scram256",
            Scram::Sha512 => "scram512",
        }
    }
}

/// A user of a broker that requires authentication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerUser {
    /// User name (`sasl.username`).
    pub name: String,
    /// Password (`sasl.password`).
    pub password: String,
    /// Mechanism its credentials are stored for.
    pub scram: Scram,
}

impl BrokerUser {
    /// A user with a SCRAM credential.
    #[must_use]
    pub fn new(name: &str, password: &str, scram: Scram) -> Self {
        BrokerUser {
            name: name.into(),
            password: password.into(),
            scram,
        }
    }

    /// The client properties that authenticate as this user over plaintext
    /// (`SASL_PLAINTEXT`).
    #[must_use]
    pub fn client_properties(&self) -> Vec<(String, String)> {
        [
            ("security.protocol", "SASL_PLAINTEXT"),
            ("sasl.mechanism", self.scram.mechanism()),
            ("sasl.username", &self.name),
            ("sasl.password", &self.password),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }
}

/// Settings for a [`Broker`].
#[derive(Debug, Clone, Copy, Default)]
pub struct BrokerOptions {
    /// Storage of a tansu broker (ignored for an external Kafka).
    pub storage: BrokerStorage,
}

/// A running Kafka-protocol broker.
///
/// When `WALBOX_TEST_KAFKA` holds a bootstrap address, that (real) Kafka is used and
/// the lifecycle methods report an error: tests that stop or kill the broker need
/// the local one.
#[derive(Debug)]
pub struct Broker {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    External(String),
    Tansu(Tansu),
}

#[derive(Debug)]
struct Tansu {
    dir: TempDir,
    program: PathBuf,
    port: u16,
    storage: BrokerStorage,
    users: Vec<BrokerUser>,
    child: Option<Child>,
}

impl Broker {
    /// Starts a broker with in-memory storage (or uses `WALBOX_TEST_KAFKA`).
    pub fn start() -> Result<Self> {
        Self::start_with(BrokerOptions::default())
    }

    /// Starts a broker (or uses `WALBOX_TEST_KAFKA`).
    pub fn start_with(options: BrokerOptions) -> Result<Self> {
        Self::start_tansu_or_external(options, Vec::new())
    }

    /// Starts a tansu broker that requires SASL authentication
    /// (`tansu broker --authentication`) and knows these users. tansu creates
    /// users only while authentication is off, so the broker starts once without
    /// it to create them, then again with it, on SQLite storage. Always a local
    /// tansu, also with `WALBOX_TEST_KAFKA` set.
    pub fn start_authenticated(users: &[BrokerUser]) -> Result<Self> {
        assert!(!users.is_empty(), "an authenticated broker needs a user");
        Self::start_tansu_or_external(
            BrokerOptions {
                storage: BrokerStorage::Sqlite,
            },
            users.to_vec(),
        )
    }

    fn start_tansu_or_external(options: BrokerOptions, users: Vec<BrokerUser>) -> Result<Self> {
        if let Some(addr) = std::env::var("WALBOX_TEST_KAFKA")
            .ok()
            .filter(|a| !a.is_empty() && users.is_empty())
        {
            return Ok(Broker {
                inner: Inner::External(addr),
            });
        }
        let dir = tempfile::Builder::new()
            .prefix("walbox-broker-")
            .tempdir()
            .map_err(TestkitError::io("creating", std::env::temp_dir()))?;
        let mut tansu = Tansu {
            dir,
            program: tansu_program()?,
            port: 0,
            storage: options.storage,
            users,
            child: None,
        };
        process::launch_on_free_port(|port| {
            tansu.port = port;
            tansu.launch_with_users()
        })?;
        Ok(Broker {
            inner: Inner::Tansu(tansu),
        })
    }

    /// The bootstrap address for clients.
    #[must_use]
    pub fn bootstrap(&self) -> String {
        match &self.inner {
            Inner::External(addr) => addr.clone(),
            Inner::Tansu(t) => format!("127.0.0.1:{}", t.port),
        }
    }

    /// Whether this is an external Kafka from `WALBOX_TEST_KAFKA`.
    #[must_use]
    pub fn is_external(&self) -> bool {
        matches!(self.inner, Inner::External(_))
    }

    fn local(&mut self, action: &str) -> Result<&mut Tansu> {
        match &mut self.inner {
            Inner::Tansu(t) => Ok(t),
            Inner::External(addr) => Err(TestkitError::MissingProgram {
                program: format!("a local broker to {action}"),
                hint: format!(
                    "the external Kafka at {addr} (WALBOX_TEST_KAFKA) cannot be controlled"
                ),
            }),
        }
    }

    /// Stops the broker gracefully (SIGTERM) and waits until it is gone.
    pub fn stop(&mut self) -> Result<()> {
        let t = self.local("stop")?;
        let Some(mut child) = t.child.take() else {
            return Ok(());
        };
        signal_group(&child, Signal::SIGTERM)?;
        process::wait_group_gone(&mut child, "broker", BROKER_TIMEOUT)
    }

    /// Kills the broker with SIGKILL and waits until it is gone.
    pub fn kill9(&mut self) -> Result<()> {
        let t = self.local("kill")?;
        let Some(mut child) = t.child.take() else {
            return Ok(());
        };
        signal_group(&child, Signal::SIGKILL)?;
        process::wait_group_gone(&mut child, "broker", BROKER_TIMEOUT)
    }

    /// Starts a stopped or killed broker again on the same port and storage.
    pub fn start_again(&mut self) -> Result<()> {
        let t = self.local("start")?;
        if t.child.is_some() {
            return Ok(());
        }
        let authentication = !t.users.is_empty();
        t.launch(authentication)
    }

    /// Stops and starts the broker.
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        self.start_again()
    }

    /// The broker's log so far (its last part).
    #[must_use]
    pub fn log_tail(&self) -> String {
        match &self.inner {
            Inner::Tansu(t) => log_tail(&t.log_path()),
            Inner::External(addr) => format!("(external Kafka at {addr})"),
        }
    }
}

impl Tansu {
    fn log_path(&self) -> PathBuf {
        self.dir.path().join("broker.log")
    }

    /// Launches the broker; with users, first without authentication to create
    /// them, then with it.
    fn launch_with_users(&mut self) -> Result<()> {
        if self.users.is_empty() {
            return self.launch(false);
        }
        self.launch(false)?;
        let url = format!("tcp://127.0.0.1:{}", self.port);
        for user in &self.users {
            let output = process::command(&self.program, None)
                .args(["user", "create", "--broker", &url])
                .args(["--mechanism", user.scram.tansu_name()])
                .args([&user.name, &user.password])
                .current_dir(self.dir.path())
                .stdin(Stdio::null())
                .output()
                .map_err(TestkitError::io("starting", &self.program))?;
            if !output.status.success() {
                return Err(TestkitError::Exited {
                    what: format!("tansu user create {}", user.name),
                    status: output.status,
                    log: String::from_utf8_lossy(&output.stderr).into_owned(),
                });
            }
        }
        if let Some(mut child) = self.child.take() {
            signal_group(&child, Signal::SIGTERM)?;
            process::wait_group_gone(&mut child, "broker", BROKER_TIMEOUT)?;
        }
        self.launch(true)
    }

    fn launch(&mut self, authentication: bool) -> Result<()> {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let storage = match self.storage {
            BrokerStorage::Memory => "memory://tansu/".to_owned(),
            // Relative to the working directory, which is the broker's temp dir.
            BrokerStorage::Sqlite => "sqlite://broker.db".to_owned(),
        };
        let log_path = self.log_path();
        let (log, log_err) = process::log_files(&log_path)?;
        let mut cmd = process::command(&self.program, None);
        cmd.arg("broker")
            .args(["--listener-url", &url, "--advertised-listener-url", &url])
            .args(["--storage-engine", &storage])
            .args(authentication.then_some("--authentication"))
            .current_dir(self.dir.path())
            .env_remove("LISTENER_URL")
            .env_remove("ADVERTISED_LISTENER_URL")
            .env_remove("STORAGE_ENGINE")
            .env(
                "RUST_LOG",
                std::env::var("WALBOX_BROKER_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let child = cmd
            .spawn()
            .map_err(TestkitError::io("starting", &self.program))?;
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.port);
        let listening = wait_until("the broker to listen", BROKER_TIMEOUT, || {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                return Some(Err(status));
            }
            TcpStream::connect(&addr).ok().map(|_| Ok(()))
        })
        .inspect_err(|_| self.abandon())?;
        if let Err(status) = listening {
            self.child = None;
            return Err(TestkitError::Exited {
                what: "tansu broker".into(),
                status,
                log: log_tail(&log_path),
            });
        }
        // Listening is not serving: wait for a metadata answer.
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &addr).set("log_level", "3");
        if let Some(user) = self.users.first().filter(|_| authentication) {
            for (k, v) in user.client_properties() {
                config.set(k, v);
            }
        }
        let consumer: BaseConsumer = config.create().inspect_err(|_| self.abandon())?;
        wait_until(
            "the broker to answer metadata requests",
            BROKER_TIMEOUT,
            || consumer.fetch_metadata(None, Duration::from_secs(2)).ok(),
        )
        .inspect_err(|_| self.abandon())?;
        Ok(())
    }

    /// Kills a broker that did not come up, so that a retry on another port
    /// never runs beside it on the same storage.
    fn abandon(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = signal_group(&child, Signal::SIGKILL);
            let _ = process::wait_group_gone(&mut child, "tansu broker", BROKER_TIMEOUT);
        }
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = signal_group(&child, Signal::SIGKILL);
            let _ = process::wait_group_gone(&mut child, "broker", BROKER_TIMEOUT);
        }
    }
}

/// The tansu executable: `WALBOX_TANSU`, else `tansu` on `PATH`, else cargo's bin dir.
fn tansu_program() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("WALBOX_TANSU") {
        return Ok(PathBuf::from(p));
    }
    let mut candidates: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("tansu")).collect())
        .unwrap_or_default();
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    if let Some(home) = cargo_home {
        candidates.push(home.join("bin").join("tansu"));
    }
    candidates.into_iter().find(|p| p.is_file()).ok_or_else(|| TestkitError::MissingProgram {
        program: "tansu".into(),
        hint: format!(
            "run `make deps` (cargo install tansu --version {TANSU_VERSION} --locked --features dynostore,libsql), \
             or set WALBOX_TEST_KAFKA to a Kafka bootstrap address"
        ),
    })
}
