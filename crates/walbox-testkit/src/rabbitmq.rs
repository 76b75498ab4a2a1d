//! A throwaway RabbitMQ node (Debian's `rabbitmq-server`, the scripts in
//! `/usr/lib/rabbitmq/bin`) with the `rabbitmq_stream` plugin: its own node
//! name, data directory, AMQP, stream, distribution and epmd ports, run as
//! the unprivileged test user with a clean environment and a HOME of its own
//! (the Erlang cookie's). Stopped (SIGTERM), killed with SIGKILL and started
//! again on the same data directory and node name; killed when dropped. Its
//! epmd (on a port of its own) runs in the node's process group: the one the
//! node would start itself leaves the group and outlives it.
//!
//! Also a few AMQP helpers for tests: declaring a durable queue bound to an
//! exchange, and reading a queue back without consuming it.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use nix::sys::signal::Signal;
use nix::unistd::User;
use tempfile::TempDir;

use crate::process::{self, log_tail, signal_group};
use crate::{Result, TestkitError, wait_until};

const START_TIMEOUT: Duration = Duration::from_secs(90);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
const SCRIPTS: &str = "/usr/lib/rabbitmq/bin";

/// A running RabbitMQ node.
#[derive(Debug)]
pub struct RabbitMq {
    dir: TempDir,
    user: Option<User>,
    amqp_port: u16,
    stream_port: u16,
    amqps_port: u16,
    stream_tls_port: u16,
    tls: crate::TlsFiles,
    dist_port: u16,
    epmd_port: u16,
    child: Option<Child>,
}

impl RabbitMq {
    /// Starts a node that takes `guest`/`guest` from anywhere.
    pub fn start() -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("walbox-rabbitmq-")
            .tempdir()
            .map_err(TestkitError::io("creating", std::env::temp_dir()))?;
        let program = PathBuf::from(SCRIPTS).join("rabbitmq-server");
        if !program.exists() {
            return Err(TestkitError::MissingProgram {
                program: program.display().to_string(),
                hint: "install Debian's rabbitmq-server (make deps)".into(),
            });
        }
        let user = process::server_user()?;
        let tls_dir = dir.path().join("tls");
        std::fs::create_dir_all(&tls_dir).map_err(TestkitError::io("creating", &tls_dir))?;
        let tls = crate::TlsFiles::generate(&tls_dir, "walbox")?;
        let mut node = RabbitMq {
            dir,
            user,
            amqp_port: 0,
            stream_port: 0,
            amqps_port: 0,
            stream_tls_port: 0,
            tls,
            dist_port: 0,
            epmd_port: 0,
            child: None,
        };
        for sub in ["home", "mnesia", "log"] {
            let p = node.dir.path().join(sub);
            std::fs::create_dir_all(&p).map_err(TestkitError::io("creating", &p))?;
        }
        // Every port anew on each try: any of them can be taken between
        // being found free and the node binding it.
        process::launch_on_free_port(|port| {
            node.amqp_port = port;
            node.other_ports()?;
            node.write_config()?;
            node.launch()
        })?;
        Ok(node)
    }

    /// Free ports for the node's listeners besides AMQP, all different.
    fn other_ports(&mut self) -> Result<()> {
        let mut taken = vec![self.amqp_port];
        let mut next = || -> Result<u16> {
            loop {
                let p = process::free_port()?;
                if !taken.contains(&p) {
                    taken.push(p);
                    return Ok(p);
                }
            }
        };
        self.stream_port = next()?;
        self.amqps_port = next()?;
        self.stream_tls_port = next()?;
        self.dist_port = next()?;
        self.epmd_port = next()?;
        Ok(())
    }

    /// Makes sure the node, its epmd and its directory go when this process
    /// ends, however it ends (a node kept in a `static` is never dropped): a
    /// watcher in a process group of its own waits for this process to exit,
    /// then kills the node's group, stops its epmd and removes its directory.
    pub fn removed_when_this_process_ends(&self) -> Result<()> {
        let script = format!(
            "while kill -0 {me} 2>/dev/null; do sleep 1; done; \
             kill -9 -$(cat '{dir}/group') 2>/dev/null; ERL_EPMD_PORT={epmd} /usr/bin/epmd -kill >/dev/null 2>&1; \
             rm -rf '{dir}'",
            me = std::process::id(),
            epmd = self.epmd_port,
            dir = self.dir.path().display(),
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

    /// The AMQP port.
    #[must_use]
    pub fn amqp_port(&self) -> u16 {
        self.amqp_port
    }

    /// The stream protocol port.
    #[must_use]
    pub fn stream_port(&self) -> u16 {
        self.stream_port
    }

    /// The AMQP port with TLS (a client certificate signed by
    /// [`RabbitMq::tls`]'s CA required).
    #[must_use]
    pub fn amqps_port(&self) -> u16 {
        self.amqps_port
    }

    /// The stream protocol port with TLS (a client certificate required).
    #[must_use]
    pub fn stream_tls_port(&self) -> u16 {
        self.stream_tls_port
    }

    /// The CA, server and client certificates of the TLS listeners (the
    /// server's for `localhost` and `127.0.0.1`).
    #[must_use]
    pub fn tls(&self) -> &crate::TlsFiles {
        &self.tls
    }

    /// The AMQP URL, with `guest`/`guest`.
    #[must_use]
    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp_port)
    }

    /// The node's name.
    #[must_use]
    pub fn node_name(&self) -> String {
        format!("walbox{}@localhost", self.amqp_port)
    }

    /// Stops the node gracefully (SIGTERM) and waits until it is gone.
    pub fn stop(&mut self) -> Result<()> {
        self.end(Signal::SIGTERM)
    }

    /// Kills the node with SIGKILL and waits until it is gone.
    pub fn kill9(&mut self) -> Result<()> {
        self.end(Signal::SIGKILL)
    }

    /// Starts a stopped or killed node again on the same data directory,
    /// node name and ports.
    pub fn start_again(&mut self) -> Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        self.launch()
    }

    /// The node's log so far (its last part).
    #[must_use]
    pub fn log_tail(&self) -> String {
        log_tail(&self.log_path())
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("console.log")
    }

    fn write_config(&self) -> Result<()> {
        let conf = format!(
            "listeners.tcp.default = {amqp}\n\
             stream.listeners.tcp.1 = {stream}\n\
             stream.advertised_host = 127.0.0.1\n\
             stream.advertised_port = {stream}\n\
             loopback_users = none\n\
             listeners.ssl.default = {amqps}\n\
             stream.listeners.ssl.1 = {stream_tls}\n\
             ssl_options.cacertfile = {ca}\n\
             ssl_options.certfile = {cert}\n\
             ssl_options.keyfile = {key}\n\
             ssl_options.verify = verify_peer\n\
             ssl_options.fail_if_no_peer_cert = true\n\
             log.console = true\n\
             log.file = false\n",
            amqp = self.amqp_port,
            stream = self.stream_port,
            amqps = self.amqps_port,
            stream_tls = self.stream_tls_port,
            ca = self.tls.ca_cert.display(),
            cert = self.tls.server_cert.display(),
            key = self.tls.server_key.display(),
        );
        let path = self.dir.path().join("rabbitmq.conf");
        std::fs::write(&path, conf).map_err(TestkitError::io("writing", &path))?;
        let plugins = self.dir.path().join("enabled_plugins");
        std::fs::write(&plugins, "[rabbitmq_stream].\n")
            .map_err(TestkitError::io("writing", &plugins))?;
        process::give_to(self.user.as_ref(), self.dir.path())
    }

    /// The environment every script of this node runs with.
    fn env(&self) -> Vec<(&'static str, String)> {
        let d = self.dir.path();
        let at = |s: &str| d.join(s).display().to_string();
        vec![
            ("PATH", format!("{SCRIPTS}:/usr/bin:/bin:/usr/sbin:/sbin")),
            ("HOME", at("home")),
            ("LANG", "C.UTF-8".into()),
            ("RABBITMQ_NODENAME", self.node_name()),
            ("RABBITMQ_MNESIA_BASE", at("mnesia")),
            ("RABBITMQ_LOG_BASE", at("log")),
            ("RABBITMQ_PID_FILE", at("rabbitmq.pid")),
            ("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1".into()),
            ("RABBITMQ_NODE_PORT", self.amqp_port.to_string()),
            ("RABBITMQ_DIST_PORT", self.dist_port.to_string()),
            ("ERL_EPMD_PORT", self.epmd_port.to_string()),
            ("RABBITMQ_CONFIG_FILE", at("rabbitmq")),
            ("RABBITMQ_ENABLED_PLUGINS_FILE", at("enabled_plugins")),
            ("RABBITMQ_CONF_ENV_FILE", at("no-rabbitmq-env.conf")),
        ]
    }

    fn launch(&mut self) -> Result<()> {
        let log_path = self.log_path();
        let _ = std::fs::remove_file(&log_path);
        let (log, log_err) = process::log_files(&log_path)?;
        let program = PathBuf::from("/bin/sh");
        let mut cmd = process::command(&program, self.user.as_ref());
        // epmd runs in the node's process group, started before it (the node
        // would start one as a daemon, outside the group, which outlives it),
        // so that stopping or killing the group ends both.
        cmd.env_clear()
            .envs(self.env())
            .arg("-c")
            .arg(
                "/usr/bin/epmd & \
                 while ! /usr/bin/epmd -names >/dev/null 2>&1; do sleep 0.1; done; \
                 exec rabbitmq-server",
            )
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let child = cmd
            .spawn()
            .map_err(TestkitError::io("starting", &program))?;
        let group = self.dir.path().join("group");
        std::fs::write(&group, child.id().to_string())
            .map_err(TestkitError::io("writing", &group))?;
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.amqp_port);
        let stream = format!("127.0.0.1:{}", self.stream_port);
        let ready = wait_until("rabbitmq-server to be ready", START_TIMEOUT, || {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                return Some(Err(status));
            }
            (TcpStream::connect(&addr).is_ok() && TcpStream::connect(&stream).is_ok())
                .then_some(Ok(()))
        });
        match ready {
            Ok(Ok(())) => Ok(()),
            Ok(Err(status)) => {
                self.child = None;
                self.kill_epmd();
                Err(TestkitError::Exited {
                    what: "rabbitmq-server".into(),
                    status,
                    log: log_tail(&log_path),
                })
            }
            Err(e) => {
                let _ = self.end(Signal::SIGKILL);
                self.kill_epmd();
                Err(e)
            }
        }
    }

    fn end(&mut self, signal: Signal) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        signal_group(&child, signal)?;
        process::wait_group_gone(&mut child, "rabbitmq-server", STOP_TIMEOUT)
    }

    /// Stops the epmd the node started on its own port.
    fn kill_epmd(&self) {
        let mut cmd = process::command(&PathBuf::from("/usr/bin/epmd"), self.user.as_ref());
        cmd.env_clear()
            .envs(self.env())
            .arg("-kill")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let _ = cmd.status();
    }

    /// Runs `rabbitmqctl` against this node with `args`.
    pub fn ctl(&self, args: &[&str]) -> Result<()> {
        let program = PathBuf::from(SCRIPTS).join("rabbitmqctl");
        let mut cmd = process::command(&program, self.user.as_ref());
        cmd.env_clear()
            .envs(self.env())
            .current_dir(self.dir.path())
            .arg("-n")
            .arg(self.node_name())
            .args(args);
        process::run(cmd)
    }

    /// Adds a user with `password` and every permission on the virtual host `/`.
    pub fn add_user(&self, name: &str, password: &str) -> Result<()> {
        self.ctl(&["add_user", name, password])?;
        self.ctl(&["set_permissions", "-p", "/", name, ".*", ".*", ".*"])
    }

    /// Publishes `body` to `stream` (created if missing) as producer `name`
    /// with publishing id `id`, and waits for the confirm: another producer
    /// for tests.
    pub async fn publish_to_stream(
        &self,
        stream: &str,
        name: &str,
        id: u64,
        body: &[u8],
    ) -> std::result::Result<(), Box<dyn std::error::Error + Send + Sync>> {
        use rabbitmq_stream_client::Environment;
        use rabbitmq_stream_client::types::Message;
        // The stream listener takes a moment after the port opens.
        let mut tries = 0;
        let env = loop {
            match Environment::builder()
                .host("127.0.0.1")
                .port(self.stream_port)
                .build()
                .await
            {
                Ok(env) => break env,
                Err(_) if tries < 20 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let _ = env.stream_creator().create(stream).await;
        let mut producer = env.producer().name(name).build(stream).await?;
        producer
            .send_with_confirm(
                Message::builder()
                    .body(body.to_vec())
                    .publising_id(id)
                    .build(),
            )
            .await?;
        producer.close().await?;
        Ok(())
    }

    async fn stream_environment(
        &self,
    ) -> std::result::Result<
        rabbitmq_stream_client::Environment,
        Box<dyn std::error::Error + Send + Sync>,
    > {
        Ok(rabbitmq_stream_client::Environment::builder()
            .host("127.0.0.1")
            .port(self.stream_port)
            .build()
            .await?)
    }

    /// How many messages `stream` holds (read from its first until nothing
    /// came for 2 s).
    pub async fn stream_messages(
        &self,
        stream: &str,
    ) -> std::result::Result<u64, Box<dyn std::error::Error + Send + Sync>> {
        use futures_util::StreamExt;
        use rabbitmq_stream_client::types::OffsetSpecification;
        let env = self.stream_environment().await?;
        let mut consumer = env
            .consumer()
            .offset(OffsetSpecification::First)
            .build(stream)
            .await?;
        let mut n = 0u64;
        while let Ok(Some(d)) = tokio::time::timeout(Duration::from_secs(2), consumer.next()).await
        {
            d?;
            n += 1;
        }
        let _ = consumer.handle().close().await;
        Ok(n)
    }

    /// The messages of `stream` from its first, as [`crate::kafka::Record`]s
    /// (offset = the stream's, application properties as headers, the key
    /// from `walbox_key`), once at least `wanted` came or `limit` passed.
    pub async fn read_stream(
        &self,
        stream: &str,
        wanted: usize,
        limit: Duration,
    ) -> std::result::Result<Vec<crate::kafka::Record>, Box<dyn std::error::Error + Send + Sync>>
    {
        use futures_util::StreamExt;
        use rabbitmq_stream_client::types::{OffsetSpecification, SimpleValue};
        let env = self.stream_environment().await?;
        let mut consumer = env
            .consumer()
            .offset(OffsetSpecification::First)
            .build(stream)
            .await?;
        let deadline = tokio::time::Instant::now() + limit;
        let mut out = Vec::new();
        while out.len() < wanted {
            let Ok(Some(d)) = tokio::time::timeout_at(deadline, consumer.next()).await else {
                break;
            };
            let d = d?;
            let m = d.message();
            let headers: Vec<(String, Option<Vec<u8>>)> = m
                .application_properties()
                .map(|p| {
                    p.iter()
                        .filter_map(|(k, v)| match v {
                            SimpleValue::String(s) => {
                                Some((k.clone(), Some(s.clone().into_bytes())))
                            }
                            SimpleValue::Binary(b) => Some((k.clone(), Some(b.clone()))),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default();
            let key = headers
                .iter()
                .find(|(k, _)| k == "walbox_key")
                .and_then(|(_, v)| v.clone());
            out.push(crate::kafka::Record {
                topic: stream.to_owned(),
                partition: 0,
                offset: i64::try_from(d.offset()).unwrap_or(i64::MAX),
                key,
                headers,
                value: m.data().map(<[u8]>::to_vec),
            });
        }
        let _ = consumer.handle().close().await;
        Ok(out)
    }

    /// Deletes `stream`.
    pub async fn delete_stream(
        &self,
        stream: &str,
    ) -> std::result::Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.stream_environment()
            .await?
            .delete_stream(stream)
            .await?;
        Ok(())
    }

    async fn connect(&self) -> std::result::Result<Connection, lapin::Error> {
        Connection::connect(&self.amqp_url(), ConnectionProperties::default()).await
    }

    /// Declares a durable `exchange` of `kind` (`topic`, `direct`, ...).
    pub async fn declare_exchange(
        &self,
        exchange: &str,
        kind: &str,
    ) -> std::result::Result<(), lapin::Error> {
        let conn = self.connect().await?;
        let ch = conn.create_channel().await?;
        let kind = match kind {
            "direct" => ExchangeKind::Direct,
            "fanout" => ExchangeKind::Fanout,
            _ => ExchangeKind::Topic,
        };
        ch.exchange_declare(
            ShortString::from(exchange),
            kind,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        conn.close(200, ShortString::from("done")).await
    }

    /// Declares a durable classic `queue` bound to `exchange` with
    /// `binding_key` (the exchange must exist).
    pub async fn bind_queue(
        &self,
        queue: &str,
        exchange: &str,
        binding_key: &str,
    ) -> std::result::Result<(), lapin::Error> {
        let conn = self.connect().await?;
        let ch = conn.create_channel().await?;
        ch.queue_declare(
            ShortString::from(queue),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        ch.queue_bind(
            ShortString::from(queue),
            ShortString::from(exchange),
            ShortString::from(binding_key),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        conn.close(200, ShortString::from("done")).await
    }

    /// Declares a classic `queue` that is not durable (it is lost when the
    /// node restarts), bound to nothing.
    pub async fn declare_transient_queue(
        &self,
        queue: &str,
    ) -> std::result::Result<(), lapin::Error> {
        let conn = self.connect().await?;
        let ch = conn.create_channel().await?;
        ch.queue_declare(
            ShortString::from(queue),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
        conn.close(200, ShortString::from("done")).await
    }

    /// How many messages `queue` holds (a passive declare: it must exist).
    pub async fn queue_messages(&self, queue: &str) -> std::result::Result<u32, lapin::Error> {
        let conn = self.connect().await?;
        let ch = conn.create_channel().await?;
        let q = ch
            .queue_declare(
                ShortString::from(queue),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        conn.close(200, ShortString::from("done")).await?;
        Ok(q.message_count())
    }

    /// Deletes `queue` with the messages it holds.
    pub async fn delete_queue(&self, queue: &str) -> std::result::Result<(), lapin::Error> {
        let conn = self.connect().await?;
        let ch = conn.create_channel().await?;
        ch.queue_delete(ShortString::from(queue), QueueDeleteOptions::default())
            .await?;
        conn.close(200, ShortString::from("done")).await
    }

    /// Every message `queue` holds, in order, as [`crate::kafka::Record`]s
    /// (topic = routing key, partition 0, offset = place in the queue, key
    /// from the `walbox_key` header); the messages stay in the queue.
    pub async fn read_queue(
        &self,
        queue: &str,
    ) -> std::result::Result<Vec<crate::kafka::Record>, lapin::Error> {
        let conn = self.connect().await?;
        let ch = conn.create_channel().await?;
        let mut out = Vec::new();
        while let Some(m) = ch
            .basic_get(ShortString::from(queue), BasicGetOptions { no_ack: false })
            .await?
        {
            let headers: Vec<(String, Option<Vec<u8>>)> = m
                .delivery
                .properties
                .headers()
                .iter()
                .flat_map(|t| t.inner().iter())
                .map(|(k, v)| {
                    let bytes = match v {
                        AMQPValue::LongString(s) => s.as_bytes().to_vec(),
                        other => format!("{other:?}").into_bytes(),
                    };
                    (k.to_string(), Some(bytes))
                })
                .collect();
            let key = headers
                .iter()
                .find(|(k, _)| k == "walbox_key")
                .and_then(|(_, v)| v.clone());
            let mut headers = headers;
            if let Some(id) = m.delivery.properties.message_id() {
                headers.push(("message_id".into(), Some(id.as_str().as_bytes().to_vec())));
            }
            out.push(crate::kafka::Record {
                topic: m.delivery.routing_key.to_string(),
                partition: 0,
                offset: i64::try_from(out.len()).unwrap_or(i64::MAX),
                key,
                headers,
                value: Some(m.delivery.data.clone()),
            });
        }
        // Unacknowledged, the messages go back to the queue in their order.
        conn.close(200, ShortString::from("done")).await?;
        Ok(out)
    }
}

impl Drop for RabbitMq {
    fn drop(&mut self) {
        let _ = self.end(Signal::SIGKILL);
        self.kill_epmd();
    }
}
