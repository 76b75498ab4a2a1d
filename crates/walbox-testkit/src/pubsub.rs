//! Google's Pub/Sub emulator (the Debian package
//! `google-cloud-cli-pubsub-emulator`, a Java jar) on a free port of
//! 127.0.0.1, as the unprivileged user when run as root, with a heap of
//! 256 MB. It keeps everything in memory: [`PubSubEmulator::kill9`] then
//! [`PubSubEmulator::start_again`] is a server without any topic or
//! subscription, which is what a restart of it is. Ready once it answers
//! `GET /` with `Ok`. Clients find it through `PUBSUB_EMULATOR_HOST`
//! ([`PubSubEmulator::host`]); it speaks REST and gRPC on the same port.

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::User;
use tempfile::TempDir;

use crate::process::{self, give_to, log_tail, server_user, signal_group};
use crate::{Result, TestkitError, wait_until};

const START_TIMEOUT: Duration = Duration::from_secs(90);

/// Where the emulator's jar is on a machine with Google's package.
const JAR_DIR: &str = "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/lib";

/// A running emulator.
#[derive(Debug)]
pub struct PubSubEmulator {
    dir: TempDir,
    jar: PathBuf,
    port: u16,
    user: Option<User>,
    child: Option<Child>,
}

impl PubSubEmulator {
    /// Starts an emulator on a free port and waits until it answers.
    pub fn start() -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("walbox-pubsub-")
            .tempdir()
            .map_err(TestkitError::io("creating", std::env::temp_dir()))?;
        let user = server_user()?;
        give_to(user.as_ref(), dir.path())?;
        let mut emulator = PubSubEmulator {
            dir,
            jar: emulator_jar()?,
            port: 0,
            user,
            child: None,
        };
        process::launch_on_free_port(|port| {
            emulator.port = port;
            emulator.launch()
        })?;
        Ok(emulator)
    }

    /// `host:port`, what `PUBSUB_EMULATOR_HOST` holds.
    #[must_use]
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops the emulator (SIGTERM) and waits until it is gone.
    pub fn stop(&mut self) -> Result<()> {
        self.end(Signal::SIGTERM)
    }

    /// Kills the emulator with SIGKILL and waits until it is gone.
    pub fn kill9(&mut self) -> Result<()> {
        self.end(Signal::SIGKILL)
    }

    /// Starts a stopped or killed emulator again on the same port: empty.
    pub fn start_again(&mut self) -> Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        self.launch()
    }

    /// The emulator's log so far (its last part).
    #[must_use]
    pub fn log_tail(&self) -> String {
        log_tail(&self.log_path())
    }

    /// Makes sure the emulator goes when this process ends, however it ends
    /// (one kept in a `static` is never dropped): a watcher in a process
    /// group of its own waits for this process to exit, then kills the
    /// emulator's group.
    pub fn removed_when_this_process_ends(&self) -> Result<()> {
        let Some(child) = &self.child else {
            return Ok(());
        };
        let script = format!(
            "while kill -0 {me} 2>/dev/null; do sleep 1; done; kill -9 -{group} 2>/dev/null",
            me = std::process::id(),
            group = child.id(),
        );
        let mut cmd = std::process::Command::new("/bin/sh");
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        cmd.args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd.spawn()
            .map_err(TestkitError::io("starting", "/bin/sh"))?;
        Ok(())
    }

    /// Creates `topic` (one that exists is fine).
    pub fn create_topic(&self, topic: &str) -> Result<()> {
        self.put(&format!("topics/{topic}"), "{}")
    }

    /// Creates `subscription` to `topic` (and the topic), with message
    /// ordering when `ordered`; one that exists is fine. It holds what is
    /// published from now on.
    pub fn create_subscription(
        &self,
        subscription: &str,
        topic: &str,
        ordered: bool,
    ) -> Result<()> {
        self.create_topic(topic)?;
        let body = serde_json::json!({
            "topic": format!("projects/{}/topics/{topic}", Self::PROJECT),
            "enableMessageOrdering": ordered,
            "ackDeadlineSeconds": 600,
        });
        self.put(&format!("subscriptions/{subscription}"), &body.to_string())
    }

    /// The project the tests use.
    pub const PROJECT: &'static str = "walbox-test";

    /// Reads `subscription` until it gave at least `wanted` messages (or
    /// `timeout` passed), acknowledging them, as records of `topic`:
    /// partition 0, the read's order as offset, the ordering key as key,
    /// the attributes as headers.
    pub fn read_at_least(
        &self,
        subscription: &str,
        topic: &str,
        wanted: usize,
        timeout: Duration,
    ) -> Result<Vec<crate::kafka::Record>> {
        use base64::Engine as _;
        let url = |verb: &str| {
            format!(
                "http://{}/v1/projects/{}/subscriptions/{subscription}:{verb}",
                self.host(),
                Self::PROJECT
            )
        };
        let post = |verb: &str, body: serde_json::Value| -> Result<serde_json::Value> {
            let text = ureq::post(&url(verb))
                .header("content-type", "application/json")
                .send(body.to_string())
                .map_err(|e| TestkitError::Http(format!("POST {}: {e}", url(verb))))?
                .into_body()
                .read_to_string()
                .map_err(|e| TestkitError::Http(format!("reading {}: {e}", url(verb))))?;
            serde_json::from_str(&text)
                .map_err(|e| TestkitError::Http(format!("{}: not JSON ({e})", url(verb))))
        };
        let mut out = Vec::new();
        let deadline = std::time::Instant::now() + timeout;
        while out.len() < wanted && std::time::Instant::now() < deadline {
            let got = post(
                "pull",
                serde_json::json!({"maxMessages": 1000, "returnImmediately": true}),
            )?;
            let list = got["receivedMessages"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if list.is_empty() {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            let mut acks = Vec::new();
            for r in &list {
                let m = &r["message"];
                acks.push(r["ackId"].clone());
                out.push(crate::kafka::Record {
                    topic: topic.to_owned(),
                    partition: 0,
                    offset: i64::try_from(out.len()).unwrap_or(i64::MAX),
                    key: m["orderingKey"].as_str().map(|k| k.as_bytes().to_vec()),
                    headers: m["attributes"]
                        .as_object()
                        .map(|a| {
                            a.iter()
                                .map(|(k, v)| {
                                    (k.clone(), v.as_str().map(|v| v.as_bytes().to_vec()))
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                    value: m["data"]
                        .as_str()
                        .and_then(|d| base64::engine::general_purpose::STANDARD.decode(d).ok()),
                });
            }
            post("acknowledge", serde_json::json!({ "ackIds": acks }))?;
        }
        Ok(out)
    }

    fn put(&self, path: &str, body: &str) -> Result<()> {
        let url = format!(
            "http://{}/v1/projects/{}/{path}",
            self.host(),
            Self::PROJECT
        );
        let response = ureq::put(&url)
            .config()
            .http_status_as_error(false)
            .build()
            .header("content-type", "application/json")
            .send(body)
            .map_err(|e| TestkitError::Http(format!("PUT {url}: {e}")))?;
        match response.status().as_u16() {
            200..=299 | 409 => Ok(()),
            status => Err(TestkitError::Http(format!(
                "PUT {url}: {status} {}",
                response.into_body().read_to_string().unwrap_or_default()
            ))),
        }
    }

    fn end(&mut self, signal: Signal) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        signal_group(&child, signal)?;
        process::wait_group_gone(&mut child, "the pubsub emulator", START_TIMEOUT)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("emulator.log")
    }

    fn launch(&mut self) -> Result<()> {
        let log_path = self.log_path();
        let _ = std::fs::remove_file(&log_path);
        let (log, log_err) = process::log_files(&log_path)?;
        give_to(self.user.as_ref(), &log_path)?;
        let mut cmd = process::command(&java_program()?, self.user.as_ref());
        cmd.args([
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-jar",
        ])
        .arg(&self.jar)
        .args(["--host=127.0.0.1", &format!("--port={}", self.port)])
        .env("HOME", self.dir.path())
        .current_dir(self.dir.path())
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err);
        let child = cmd
            .spawn()
            .map_err(TestkitError::io("starting", &self.jar))?;
        self.child = Some(child);
        let url = format!("http://{}/", self.host());
        let ready = wait_until("the pubsub emulator to answer", START_TIMEOUT, || {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                return Some(Err(status));
            }
            crate::prometheus::get(&url)
                .ok()
                .filter(|body| body.trim() == "Ok")
                .map(|_| Ok(()))
        });
        match ready {
            Ok(Ok(())) => Ok(()),
            Ok(Err(status)) => {
                self.child = None;
                Err(TestkitError::Exited {
                    what: "the pubsub emulator".into(),
                    status,
                    log: log_tail(&log_path),
                })
            }
            Err(e) => {
                let _ = self.end(Signal::SIGKILL);
                Err(e)
            }
        }
    }
}

impl Drop for PubSubEmulator {
    fn drop(&mut self) {
        let _ = self.end(Signal::SIGKILL);
    }
}

/// `WALBOX_JAVA`, else `java` on `PATH`.
fn java_program() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("WALBOX_JAVA") {
        return Ok(PathBuf::from(p));
    }
    std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("java"))
                .find(|p| p.is_file())
        })
        .ok_or_else(|| TestkitError::MissingProgram {
            program: "java".into(),
            hint: "run `make deps` (apt-get install default-jre-headless), or set WALBOX_JAVA"
                .into(),
        })
}

/// `WALBOX_PUBSUB_EMULATOR_JAR`, else the `cloud-pubsub-emulator-*-all.jar`
/// of Google's package.
fn emulator_jar() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("WALBOX_PUBSUB_EMULATOR_JAR") {
        return Ok(PathBuf::from(p));
    }
    std::fs::read_dir(JAR_DIR)
        .ok()
        .and_then(|entries| {
            entries.filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                    n.starts_with("cloud-pubsub-emulator-") && n.ends_with("-all.jar")
                })
            })
        })
        .ok_or_else(|| TestkitError::MissingProgram {
            program: "the Pub/Sub emulator".into(),
            hint: format!(
                "install Google's package google-cloud-cli-pubsub-emulator (its jar goes to \
                 {JAR_DIR}), or set WALBOX_PUBSUB_EMULATOR_JAR to cloud-pubsub-emulator-*-all.jar"
            ),
        })
}
