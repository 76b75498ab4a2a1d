//! A throwaway Kinesis: kinesalite (npm, `scripts/aws.sh` installs it) on a
//! free port with its own data directory (`--path`, which keeps every
//! acknowledged record through a SIGKILL), as an unprivileged user when the
//! caller is root; stopped, killed and started again on the same port and
//! directory; killed and removed when dropped.
//!
//! Clients sign their requests with any credentials (kinesalite checks
//! none): [`Kinesalite::client_env`] gives the variables the AWS chain reads.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::User;
use tempfile::TempDir;

use crate::process::{self, give_to, log_tail, server_user, signal_group};
use crate::{Result, TestkitError, wait_until};

const TIMEOUT: Duration = Duration::from_secs(30);

/// The pinned kinesalite (`scripts/aws.sh`).
pub const KINESALITE_VERSION: &str = "3.3.3";

/// A running kinesalite.
#[derive(Debug)]
pub struct Kinesalite {
    dir: TempDir,
    cli: PathBuf,
    port: u16,
    user: Option<User>,
    child: Option<Child>,
}

impl Kinesalite {
    /// Starts a server on a free port with an empty data directory.
    pub fn start() -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("walbox-kinesis-")
            .tempdir()
            .map_err(TestkitError::io("creating", std::env::temp_dir()))?;
        let user = server_user()?;
        std::fs::create_dir(dir.path().join("data"))
            .map_err(TestkitError::io("creating", dir.path()))?;
        give_to(user.as_ref(), dir.path())?;
        let mut server = Kinesalite {
            dir,
            cli: kinesalite_cli()?,
            port: 0,
            user,
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

    /// The variables an AWS client needs to sign its requests here: a
    /// region and credentials kinesalite takes (it checks none).
    #[must_use]
    pub fn client_env() -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", "walbox-test".into()),
            ("AWS_SECRET_ACCESS_KEY", "walbox-test-secret".into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_EC2_METADATA_DISABLED", "true".into()),
        ]
    }

    /// The same credentials as [`Kinesalite::client_env`], for a client of
    /// the test process itself.
    #[must_use]
    pub fn credentials() -> aws_credential_types::Credentials {
        aws_credential_types::Credentials::new(
            "walbox-test",
            "walbox-test-secret",
            None,
            None,
            "walbox-testkit",
        )
    }

    /// Stops the server (SIGTERM) and waits until it is gone.
    pub fn stop(&mut self) -> Result<()> {
        self.end(Signal::SIGTERM)
    }

    /// Kills the server with SIGKILL and waits until it is gone.
    pub fn kill9(&mut self) -> Result<()> {
        self.end(Signal::SIGKILL)
    }

    /// Starts a stopped or killed server again on the same port and data.
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
        self.dir.path().join("kinesalite.log")
    }

    fn end(&mut self, signal: Signal) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        signal_group(&child, signal)?;
        process::wait_group_gone(&mut child, "kinesalite", TIMEOUT)
    }

    fn launch(&mut self) -> Result<()> {
        let log_path = self.log_path();
        let _ = std::fs::remove_file(&log_path);
        let (log, log_err) = process::log_files(&log_path)?;
        give_to(self.user.as_ref(), &log_path)?;
        let node = node_program()?;
        let mut cmd = process::command(&node, self.user.as_ref());
        cmd.arg(&self.cli)
            .args(["--port", &self.port.to_string()])
            .arg("--path")
            .arg(self.dir.path().join("data"))
            // Streams become active at once, as the tests want.
            .args([
                "--createStreamMs",
                "0",
                "--deleteStreamMs",
                "0",
                "--updateStreamMs",
                "0",
            ])
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let child = cmd.spawn().map_err(TestkitError::io("starting", &node))?;
        self.child = Some(child);
        let port = self.port;
        let pid = self.child.as_ref().map_or(0, Child::id);
        // Ready once this child listens on the port and answers there:
        // kinesalite binds every interface, so another server could hold the
        // port (and answer) while this one failed to bind it.
        let ready = wait_until("kinesalite to be ready", TIMEOUT, || {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                return Some(Err(status));
            }
            (listens(pid, port) && answers(port)).then_some(Ok(()))
        })?;
        if let Err(status) = ready {
            self.child = None;
            return Err(TestkitError::Exited {
                what: "kinesalite".into(),
                status,
                log: log_tail(&log_path),
            });
        }
        Ok(())
    }
}

impl Drop for Kinesalite {
    fn drop(&mut self) {
        let _ = self.end(Signal::SIGKILL);
    }
}

/// Whether process `pid` holds the socket listening on TCP `port` (read
/// from `/proc`).
pub(crate) fn listens(pid: u32, port: u16) -> bool {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(state), Some(inode)) =
                (fields.get(1), fields.get(3), fields.get(9))
            else {
                continue;
            };
            let listening = *state == "0A";
            let on_port = local
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok())
                == Some(port);
            if listening && on_port {
                inodes.push(format!("socket:[{inode}]"));
            }
        }
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .is_ok_and(|target| inodes.iter().any(|i| target.as_os_str() == i.as_str()))
    })
}

/// Whether kinesalite on `port` answers an HTTP request (any status).
fn answers(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let request = "POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: \
                   application/x-amz-json-1.1\r\nX-Amz-Target: Kinesis_20131202.ListStreams\r\n\
                   Content-Length: 2\r\nConnection: close\r\n\r\n{}";
    if s.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut buf = [0u8; 16];
    let n = s.read(&mut buf).unwrap_or(0);
    buf[..n].starts_with(b"HTTP/1.1")
}

/// Where `scripts/aws.sh` put the packages: `WALBOX_AWS_CACHE`, else
/// `/var/cache/walbox` as root, else `~/.cache/walbox`.
pub(crate) fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("WALBOX_AWS_CACHE") {
        return PathBuf::from(dir);
    }
    if nix::unistd::Uid::effective().is_root() {
        return PathBuf::from("/var/cache/walbox");
    }
    let home = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    home.join("walbox")
}

fn kinesalite_cli() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("WALBOX_KINESALITE") {
        return Ok(PathBuf::from(p));
    }
    let cli = cache_dir()
        .join(format!("kinesalite-{KINESALITE_VERSION}"))
        .join("node_modules/kinesalite/cli.js");
    if cli.is_file() {
        return Ok(cli);
    }
    Err(TestkitError::MissingProgram {
        program: format!("kinesalite {KINESALITE_VERSION} ({})", cli.display()),
        hint: "run `scripts/aws.sh` (or `make deps`), or set WALBOX_KINESALITE to its cli.js"
            .into(),
    })
}

fn node_program() -> Result<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("node"))
        .chain([
            PathBuf::from("/usr/bin/node"),
            PathBuf::from("/usr/local/bin/node"),
        ])
        .find(|p| p.is_file())
        .ok_or_else(|| TestkitError::MissingProgram {
            program: "node".into(),
            hint: "run `scripts/aws.sh` (it installs Node.js with npm)".into(),
        })
}

/// The hours stream `stream` on the stand-in at `endpoint` keeps its
/// records.
pub async fn retention_hours(endpoint: &str, stream: &str) -> std::result::Result<i32, String> {
    let client = aws_sdk_kinesis::Client::new(&sdk_config(endpoint).await);
    let out = client
        .describe_stream_summary()
        .stream_name(stream)
        .send()
        .await
        .map_err(|e| format!("describing {stream}: {e}"))?;
    out.stream_description_summary()
        .map(|s| s.retention_period_hours())
        .ok_or_else(|| format!("no summary of {stream}"))
}

/// A client of the test process for the stand-in at `endpoint`.
pub async fn sdk_config(endpoint: &str) -> aws_config::SdkConfig {
    aws_config::defaults(aws_config::BehaviorVersion::latest())
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .credentials_provider(Kinesalite::credentials())
        .load()
        .await
}

/// A record walbox wrote (its data's JSON object: `event_id`, `key`,
/// `headers`, `value`) as a [`crate::kafka::Record`].
pub(crate) fn record_of(
    topic: &str,
    partition: i32,
    offset: i64,
    data: &[u8],
) -> Option<crate::kafka::Record> {
    let v: serde_json::Value = serde_json::from_slice(data).ok()?;
    v.get("event_id")?;
    Some(crate::kafka::Record {
        topic: topic.to_owned(),
        partition,
        offset,
        key: v["key"].as_str().map(|k| k.as_bytes().to_vec()),
        headers: v["headers"]
            .as_object()
            .map(|h| {
                h.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().map(|s| s.as_bytes().to_vec())))
                    .collect()
            })
            .unwrap_or_default(),
        value: Some(v["value"].to_string().into_bytes()),
    })
}

/// Every record walbox wrote to `stream` on the stand-in at `endpoint`,
/// shard by shard from its start (a shard's index as partition).
pub async fn read_stream(
    endpoint: &str,
    stream: &str,
) -> std::result::Result<Vec<crate::kafka::Record>, String> {
    use aws_sdk_kinesis::types::ShardIteratorType;
    let client = aws_sdk_kinesis::Client::new(&sdk_config(endpoint).await);
    let shards = client
        .list_shards()
        .stream_name(stream)
        .send()
        .await
        .map_err(|e| format!("listing the shards of {stream}: {e}"))?;
    let mut out = Vec::new();
    for (index, shard) in shards.shards().iter().enumerate() {
        let partition = i32::try_from(index).unwrap_or(i32::MAX);
        let mut iterator = client
            .get_shard_iterator()
            .stream_name(stream)
            .shard_id(shard.shard_id())
            .shard_iterator_type(ShardIteratorType::TrimHorizon)
            .send()
            .await
            .map_err(|e| format!("reading {stream}: {e}"))?
            .shard_iterator()
            .map(str::to_owned);
        let mut offset = 0;
        while let Some(it) = iterator.take() {
            let page = client
                .get_records()
                .shard_iterator(it)
                .send()
                .await
                .map_err(|e| format!("reading {stream}: {e}"))?;
            for r in page.records() {
                if let Some(record) = record_of(stream, partition, offset, r.data().as_ref()) {
                    out.push(record);
                }
                offset += 1;
            }
            if !(page.records().is_empty() && page.millis_behind_latest().unwrap_or(0) == 0) {
                iterator = page.next_shard_iterator().map(str::to_owned);
            }
        }
    }
    Ok(out)
}
