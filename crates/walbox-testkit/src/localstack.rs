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

    /// Makes sure LocalStack goes when this process ends, however it ends
    /// (one kept in a `static` is never dropped): a watcher in a process
    /// group of its own waits for this process to exit, then kills
    /// LocalStack's group.
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

/// Takes every message queue `queue` of the LocalStack at `endpoint` hands
/// out now (deleting each), as [`crate::kafka::Record`]s: the group id as
/// key, the attributes as headers (those in `walbox_headers` in their own
/// names), the body as value. Nothing while the queue does not exist yet.
pub async fn drain(
    endpoint: &str,
    queue: &str,
) -> std::result::Result<Vec<crate::kafka::Record>, String> {
    use aws_sdk_sqs::types::MessageSystemAttributeName;
    let client = aws_sdk_sqs::Client::new(&crate::kinesis::sdk_config(endpoint).await);
    let url = match client.get_queue_url().queue_name(queue).send().await {
        Ok(out) => out.queue_url().unwrap_or_default().to_owned(),
        Err(e) => {
            use aws_sdk_sqs::error::ProvideErrorMetadata as _;
            let missing = e.as_service_error().is_some_and(|se| {
                se.is_queue_does_not_exist()
                    || matches!(
                        se.code(),
                        Some("QueueDoesNotExist" | "AWS.SimpleQueueService.NonExistentQueue")
                    )
            });
            if missing {
                return Ok(Vec::new());
            }
            return Err(format!("finding {queue}: {e:?}"));
        }
    };
    let mut out = Vec::new();
    loop {
        let got = client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
            .send()
            .await
            .map_err(|e| format!("receiving from {queue}: {e}"))?;
        if got.messages().is_empty() {
            return Ok(out);
        }
        for m in got.messages() {
            let mut headers: Vec<(String, Option<Vec<u8>>)> = Vec::new();
            for (name, v) in m.message_attributes().into_iter().flatten() {
                let text = v.string_value().unwrap_or_default();
                if name == "walbox_headers" {
                    if let Ok(serde_json::Value::Object(more)) = serde_json::from_str(text) {
                        for (k, v) in more {
                            headers.push((k, v.as_str().map(|s| s.as_bytes().to_vec())));
                        }
                    }
                } else {
                    headers.push((name.clone(), Some(text.as_bytes().to_vec())));
                }
            }
            out.push(crate::kafka::Record {
                topic: queue.to_owned(),
                partition: 0,
                offset: i64::try_from(out.len()).unwrap_or(i64::MAX),
                key: m
                    .attributes()
                    .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
                    .map(|g| g.as_bytes().to_vec()),
                headers,
                value: m.body().map(|b| b.as_bytes().to_vec()),
            });
            if let Some(handle) = m.receipt_handle() {
                client
                    .delete_message()
                    .queue_url(&url)
                    .receipt_handle(handle)
                    .send()
                    .await
                    .map_err(|e| format!("deleting from {queue}: {e}"))?;
            }
        }
    }
}

/// Deletes FIFO topic `topic` on the LocalStack at `endpoint` and makes it
/// again: the same ARN, and no subscription (what replacing a topic by
/// hand or by a deployment tool leaves).
pub async fn make_topic_again(endpoint: &str, topic: &str) -> std::result::Result<(), String> {
    let sns = aws_sdk_sns::Client::new(&crate::kinesis::sdk_config(endpoint).await);
    let make = || {
        sns.create_topic()
            .name(topic)
            .attributes("FifoTopic", "true")
            .attributes("ContentBasedDeduplication", "false")
            .send()
    };
    let arn = make()
        .await
        .map_err(|e| format!("finding topic {topic}: {e:?}"))?
        .topic_arn()
        .unwrap_or_default()
        .to_owned();
    sns.delete_topic()
        .topic_arn(&arn)
        .send()
        .await
        .map_err(|e| format!("deleting topic {topic}: {e:?}"))?;
    make()
        .await
        .map_err(|e| format!("making topic {topic} again: {e:?}"))?;
    Ok(())
}

/// Attribute `name` (as SQS spells it: `MessageRetentionPeriod`) of queue
/// `queue` on the LocalStack at `endpoint`.
pub async fn queue_attribute(
    endpoint: &str,
    queue: &str,
    name: &str,
) -> std::result::Result<Option<String>, String> {
    let sqs = aws_sdk_sqs::Client::new(&crate::kinesis::sdk_config(endpoint).await);
    let url = sqs
        .get_queue_url()
        .queue_name(queue)
        .send()
        .await
        .map_err(|e| format!("finding {queue}: {e:?}"))?
        .queue_url()
        .unwrap_or_default()
        .to_owned();
    let name = aws_sdk_sqs::types::QueueAttributeName::from(name);
    let out = sqs
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(name.clone())
        .send()
        .await
        .map_err(|e| format!("the attributes of {queue}: {e:?}"))?;
    Ok(out.attributes().and_then(|a| a.get(&name)).cloned())
}

/// Makes FIFO queue `queue` on the LocalStack at `endpoint` (deduplicating by
/// the ids it is given, not by content), as walbox makes one; its URL.
pub async fn create_fifo_queue(endpoint: &str, queue: &str) -> std::result::Result<String, String> {
    let sqs = aws_sdk_sqs::Client::new(&crate::kinesis::sdk_config(endpoint).await);
    Ok(sqs
        .create_queue()
        .queue_name(queue)
        .attributes(aws_sdk_sqs::types::QueueAttributeName::FifoQueue, "true")
        .attributes(
            aws_sdk_sqs::types::QueueAttributeName::ContentBasedDeduplication,
            "false",
        )
        .send()
        .await
        .map_err(|e| format!("creating queue {queue}: {e:?}"))?
        .queue_url()
        .unwrap_or_default()
        .to_owned())
}

/// Makes the FIFO topic `topic` and the FIFO queue `queue` on the LocalStack
/// at `endpoint` (as walbox makes them: deduplicating by the ids it gives,
/// not by content), and subscribes the queue to the topic with raw
/// delivery (the message's body and attributes as they were published).
pub async fn subscribe_queue(
    endpoint: &str,
    topic: &str,
    queue: &str,
) -> std::result::Result<(), String> {
    let sdk = crate::kinesis::sdk_config(endpoint).await;
    let sns = aws_sdk_sns::Client::new(&sdk);
    let sqs = aws_sdk_sqs::Client::new(&sdk);
    let topic_arn = sns
        .create_topic()
        .name(topic)
        .attributes("FifoTopic", "true")
        .attributes("ContentBasedDeduplication", "false")
        .send()
        .await
        .map_err(|e| format!("creating topic {topic}: {e:?}"))?
        .topic_arn()
        .unwrap_or_default()
        .to_owned();
    let url = create_fifo_queue(endpoint, queue).await?;
    let queue_arn = sqs
        .get_queue_attributes()
        .queue_url(&url)
        .attribute_names(aws_sdk_sqs::types::QueueAttributeName::QueueArn)
        .send()
        .await
        .map_err(|e| format!("the ARN of {queue}: {e:?}"))?
        .attributes()
        .and_then(|a| a.get(&aws_sdk_sqs::types::QueueAttributeName::QueueArn))
        .cloned()
        .unwrap_or_default();
    sns.subscribe()
        .topic_arn(&topic_arn)
        .protocol("sqs")
        .endpoint(&queue_arn)
        .attributes("RawMessageDelivery", "true")
        .send()
        .await
        .map_err(|e| format!("subscribing {queue} to {topic}: {e:?}"))?;
    Ok(())
}
