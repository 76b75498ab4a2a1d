//! Configuration: a TOML file, then `WALBOX_*` environment variables and flags on
//! top. Unknown keys and bad values are refused with the key's name. The
//! connection string and secret Kafka properties never appear in a `Debug`
//! form ([`Secret`], [`walbox_sink::is_secret_property`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use walbox_outbox::{MessageConfig, TableConfig};

mod errors;
mod secret;
mod sink;
#[cfg(test)]
mod tests;

pub use secret::Secret;
pub use sink::{SinkConfig, SinkKind};

/// The whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Name of this relay in event envelopes (`producer`).
    #[serde(default = "default_producer")]
    pub producer: String,
    /// Where the WAL comes from.
    #[serde(default)]
    pub source: SourceConfig,
    /// The outbox tables (`[[outbox]]`); one `public.outbox` with defaults if
    /// neither tables nor messages are configured.
    #[serde(default)]
    pub outbox: Vec<TableConfig>,
    /// The table-less outbox (`[[messages]]`): prefixes of logical decoding
    /// messages whose JSON content is an event.
    #[serde(default)]
    pub messages: Vec<MessageConfig>,
    /// Where events go.
    #[serde(default)]
    pub sink: SinkConfig,
    /// Shutdown behaviour.
    #[serde(default)]
    pub shutdown: ShutdownConfig,
    /// What happens to rows that cannot become events.
    #[serde(default)]
    pub dead_letter: DeadLetterConfig,
    /// Where walbox keeps its own record of the acknowledged position.
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// Publishing the rows that exist when the slot is created.
    #[serde(default)]
    pub snapshot: SnapshotConfig,
    /// The Prometheus endpoint with `/healthz` and `/readyz`.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// Log lines; read by [`log_format`] before logging starts (and here so
    /// the section is checked with the rest).
    #[serde(default)]
    #[allow(dead_code)]
    pub log: LogConfig,
}

/// The metrics endpoint.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Address and port serving `/metrics`, `/healthz` and `/readyz`, e.g.
    /// `127.0.0.1:9187`; none when unset.
    pub listen: Option<String>,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, with the same fields.
    Json,
}

impl LogFormat {
    /// Parses `text` or `json` (`WALBOX_LOG_FORMAT`).
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "text" | "" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => bail!("WALBOX_LOG_FORMAT={other:?}: unknown log format; use text or json"),
        }
    }
}

/// Log lines.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// `text` (default) or `json`; `WALBOX_LOG_FORMAT` overrides it.
    #[serde(default)]
    pub format: LogFormat,
}

/// The log format for a run with configuration file `file` (if any):
/// `WALBOX_LOG_FORMAT`, else the file's `[log] format`, else text. Read before
/// logging starts, so an unreadable file is left to [`Config::load`] to report.
pub fn log_format(file: Option<&Path>) -> Result<LogFormat> {
    if let Ok(v) = std::env::var("WALBOX_LOG_FORMAT") {
        return LogFormat::parse(&v);
    }
    let Some(text) = file.and_then(|p| std::fs::read_to_string(p).ok()) else {
        return Ok(LogFormat::Text);
    };
    #[derive(Deserialize)]
    struct Only {
        #[serde(default)]
        log: LogConfig,
    }
    // A file that does not parse is reported by Config::load, with the key.
    Ok(toml::from_str::<Only>(&text).map_or(LogFormat::Text, |o| o.log.format))
}

/// The checkpoint store.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// The checkpoint file; default `walbox-<slot>.checkpoint.json` in the working
    /// directory. Keep it on storage that outlives the process (a volume).
    pub path: Option<PathBuf>,
}

/// When the initial snapshot is taken.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotMode {
    /// Only `walbox setup --snapshot` takes one.
    #[default]
    Never,
    /// `walbox run` creates a missing slot with a snapshot of the outbox.
    Initial,
}

/// The initial snapshot.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotConfig {
    /// `never` or `initial`.
    #[serde(default)]
    pub mode: SnapshotMode,
    /// SQL condition selecting the rows to publish, e.g. `published_at IS NULL`.
    #[serde(rename = "where", default)]
    pub filter: Option<String>,
    /// Columns giving the order rows are published in (default: the primary key).
    /// Per-aggregate order follows it: use a sequence or commit-ordered column
    /// when the key is random (uuid v4).
    #[serde(default)]
    pub order_by: Vec<String>,
    /// Rows fetched per round trip.
    #[serde(default = "default_chunk_rows")]
    pub chunk_rows: u32,
}

fn default_chunk_rows() -> u32 {
    1_000
}

impl Default for SnapshotConfig {
    fn default() -> Self {
        SnapshotConfig {
            mode: SnapshotMode::default(),
            filter: None,
            order_by: Vec::new(),
            chunk_rows: default_chunk_rows(),
        }
    }
}

pub use walbox_core::ReplayWindow;

/// Parses `source.replay_window`: `0`, a duration (`500ms`, `90s`, `15min`,
/// `2h`, `7d`) or a size with Postgres' units (`64kB`, `512MB`, `2GB`, `1TB`;
/// powers of 1024).
pub fn parse_replay_window(text: &str) -> Result<ReplayWindow> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: u64 = number
        .parse()
        .with_context(|| format!("{text:?}: expected a number and a unit, like 15min or 1GB"))?;
    let unit = unit.trim();
    let secs = |k: u64| ReplayWindow::Time(std::time::Duration::from_secs(n.saturating_mul(k)));
    let window = match unit {
        "" if n == 0 => ReplayWindow::None,
        "ms" => ReplayWindow::Time(std::time::Duration::from_millis(n)),
        "s" => secs(1),
        "min" => secs(60),
        "h" => secs(3_600),
        "d" => secs(86_400),
        "B" => ReplayWindow::Bytes(n),
        "kB" => ReplayWindow::Bytes(n.saturating_mul(1 << 10)),
        "MB" => ReplayWindow::Bytes(n.saturating_mul(1 << 20)),
        "GB" => ReplayWindow::Bytes(n.saturating_mul(1 << 30)),
        "TB" => ReplayWindow::Bytes(n.saturating_mul(1 << 40)),
        _ => {
            bail!("{text:?}: unknown unit {unit:?}; use ms, s, min, h, d or B, kB, MB, GB, TB")
        }
    };
    Ok(match window {
        ReplayWindow::Time(d) if d.is_zero() => ReplayWindow::None,
        ReplayWindow::Bytes(0) => ReplayWindow::None,
        w => w,
    })
}

/// What happens to an outbox row that cannot become an event (payload not JSON,
/// event id or key NULL, invalid topic, ...).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLetterConfig {
    /// `topic`: publish it to a dead-letter topic and go on; `stop`: stop with an
    /// error naming the row's event id and position.
    #[serde(default)]
    pub policy: DeadLetterPolicy,
    /// Dead-letter topic; `{topic}` is the topic the event was meant for.
    #[serde(default = "default_dead_letter_topic")]
    pub topic: String,
}

/// Dead-letter policies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeadLetterPolicy {
    /// Publish to the dead-letter topic and go on.
    #[default]
    Topic,
    /// Stop.
    Stop,
}

fn default_dead_letter_topic() -> String {
    "{topic}.dlq".into()
}

impl Default for DeadLetterConfig {
    fn default() -> Self {
        DeadLetterConfig {
            policy: DeadLetterPolicy::default(),
            topic: default_dead_letter_topic(),
        }
    }
}

impl DeadLetterConfig {
    /// The topic template, checked: `{topic}` is its only placeholder.
    pub fn template(&self) -> Result<walbox_outbox::TopicTemplate> {
        let t = walbox_outbox::TopicTemplate::parse(&self.topic)
            .with_context(|| "dead_letter.topic".to_owned())?;
        if let Some(other) = t.fields().find(|f| *f != "topic") {
            bail!(
                "dead_letter.topic: unknown placeholder {{{other}}}; only {{topic}} is available"
            );
        }
        Ok(t)
    }
}

fn default_producer() -> String {
    "walbox".into()
}

/// The PostgreSQL side.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// Connection string, libpq key=value or URI form.
    pub dsn: Option<Secret>,
    /// Logical replication slot (pgoutput).
    #[serde(default = "default_slot")]
    pub slot: String,
    /// Publication containing the outbox table(s).
    #[serde(default = "default_publication")]
    pub publication: String,
    /// Most often the position is reported to the server, in milliseconds.
    #[serde(default = "default_status_interval_ms")]
    pub status_interval_ms: u64,
    /// How far the slot stays behind the acknowledged position (`0`, `15min`,
    /// `1GB`): the range `walbox replay` can publish again. Costs that much WAL.
    #[serde(default = "default_replay_window")]
    pub replay_window: String,
    /// After this long without a message from the server while waiting for one,
    /// walbox checks whether the walsender still runs and reconnects if it does
    /// not (a silently stalled connection), in milliseconds; 0 turns it off.
    #[serde(default = "default_stall_timeout_ms")]
    pub stall_timeout_ms: u64,
    /// Published tables (`schema.name`) whose changes are not walbox's to relay
    /// (another relay's outbox, say): counted and logged by name, never published.
    /// An insert from any other published table that is no `[[outbox]]` stops
    /// walbox before its position.
    #[serde(default)]
    pub ignore_tables: Vec<String>,
    /// Make the slot a failover slot (PostgreSQL 17 and later): standbys with
    /// `sync_replication_slots = on` keep it in sync, so walbox resumes on a
    /// promoted standby. Created so, or turned on for an existing slot.
    #[serde(default)]
    pub failover: bool,
}

fn default_stall_timeout_ms() -> u64 {
    30_000
}

fn default_replay_window() -> String {
    "0".into()
}

fn default_slot() -> String {
    "walbox".into()
}
fn default_publication() -> String {
    "walbox_outbox".into()
}
fn default_status_interval_ms() -> u64 {
    1_000
}

impl Default for SourceConfig {
    fn default() -> Self {
        SourceConfig {
            dsn: None,
            slot: default_slot(),
            publication: default_publication(),
            status_interval_ms: default_status_interval_ms(),
            replay_window: default_replay_window(),
            stall_timeout_ms: default_stall_timeout_ms(),
            ignore_tables: Vec::new(),
            failover: false,
        }
    }
}

/// How walbox stops.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownConfig {
    /// How long a stop waits for in-flight events to be acknowledged, in ms.
    #[serde(default = "default_shutdown_ms")]
    pub timeout_ms: u64,
}

fn default_shutdown_ms() -> u64 {
    30_000
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig {
            timeout_ms: default_shutdown_ms(),
        }
    }
}

/// Flags (and their `WALBOX_*` variables) that override the file.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Overrides {
    /// Configuration file (TOML).
    #[arg(long, short = 'c', env = "WALBOX_CONFIG")]
    pub config: Option<PathBuf>,
    /// PostgreSQL connection string (libpq key=value or URI).
    #[arg(long, env = "WALBOX_DSN", hide_env_values = true)]
    pub dsn: Option<Secret>,
    /// Replication slot.
    #[arg(long, env = "WALBOX_SLOT")]
    pub slot: Option<String>,
    /// Publication.
    #[arg(long, env = "WALBOX_PUBLICATION")]
    pub publication: Option<String>,
    /// Outbox table (`schema.name`), when the file names none.
    #[arg(long, env = "WALBOX_TABLE")]
    pub table: Option<String>,
    /// Topic template for that table, e.g. `outbox.{aggregate_type}`: the
    /// Kafka topic, NATS subject, RabbitMQ routing key or stream, Redis stream
    /// key, the webhook URL's {topic}, the Pub/Sub (pubsub) topic, the Kinesis
    /// stream, the SQS queue, the SNS topic or the stdout line's topic.
    #[arg(long, env = "WALBOX_TOPIC")]
    pub topic: Option<String>,
    /// Sink type: where events go.
    #[arg(long, env = "WALBOX_SINK", value_enum)]
    pub sink: Option<SinkKind>,
    /// Kafka bootstrap servers (type = kafka).
    #[arg(long, env = "WALBOX_BOOTSTRAP_SERVERS")]
    pub bootstrap_servers: Option<String>,
    /// Create missing Kafka topics (type = kafka).
    #[arg(long, env = "WALBOX_CREATE_TOPICS")]
    pub create_topics: Option<bool>,
    /// Producer name in envelopes.
    #[arg(long, env = "WALBOX_PRODUCER")]
    pub producer: Option<String>,
    /// Checkpoint file.
    #[arg(long, env = "WALBOX_CHECKPOINT")]
    pub checkpoint: Option<PathBuf>,
    /// Rows the initial snapshot publishes: an SQL condition, e.g.
    /// "published_at IS NULL".
    #[arg(long, env = "WALBOX_SNAPSHOT_WHERE")]
    pub snapshot_where: Option<String>,
    /// Make the slot a failover slot, kept in sync on standbys (PostgreSQL 17+).
    #[arg(long, env = "WALBOX_FAILOVER", num_args = 0..=1, default_missing_value = "true")]
    pub failover: Option<bool>,
    /// Serve /metrics, /healthz and /readyz on this address:port (relaying
    /// commands only), e.g. 127.0.0.1:9187.
    #[arg(long, env = "WALBOX_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
}

impl Config {
    /// Parses a TOML document. An error names the line, column and problem but
    /// does not quote the line: it may hold a password.
    pub fn parse(text: &str, origin: &Path) -> Result<Self> {
        let mut c: Config =
            toml::from_str(text).map_err(|e| errors::parse_error(text, origin, &e))?;
        c.bind_formats();
        Ok(c)
    }

    /// Gives every table's and prefix's format the CloudEvents binding of the
    /// sink's protocol.
    fn bind_formats(&mut self) {
        let binding = self.sink.kind.protocol().cloudevents();
        for t in &mut self.outbox {
            t.formatting.binding = binding;
        }
        for m in &mut self.messages {
            m.formatting.binding = binding;
        }
    }

    /// Loads the file (if any) and applies the overrides.
    pub fn load(o: &Overrides) -> Result<Self> {
        let mut c = match &o.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading configuration {}", path.display()))?;
                Config::parse(&text, path)?
            }
            None => Config::parse("", Path::new("(defaults)"))?,
        };
        if let Some(v) = &o.dsn {
            c.source.dsn = Some(v.clone());
        }
        if let Some(v) = &o.slot {
            c.source.slot = v.clone();
        }
        if let Some(v) = &o.publication {
            c.source.publication = v.clone();
        }
        if let Some(v) = o.sink {
            c.sink.kind = v;
        }
        if let Some(v) = &o.bootstrap_servers {
            c.sink
                .kafka
                .insert("bootstrap.servers".into(), toml::Value::String(v.clone()));
        }
        if let Some(v) = o.create_topics {
            c.sink.create_topics = v;
        }
        if let Some(v) = &o.producer {
            c.producer = v.clone();
        }
        if let Some(v) = &o.checkpoint {
            c.checkpoint.path = Some(v.clone());
        }
        if let Some(v) = &o.snapshot_where {
            c.snapshot.filter = Some(v.clone());
        }
        if let Some(v) = o.failover {
            c.source.failover = v;
        }
        if let Some(v) = &o.metrics_listen {
            c.metrics.listen = Some(v.clone()).filter(|l| !l.is_empty());
        }
        if c.outbox.is_empty() && (c.messages.is_empty() || o.table.is_some()) {
            c.outbox.push(TableConfig::new(
                o.table.as_deref().unwrap_or("public.outbox"),
            ));
        } else if o.table.is_some() {
            bail!("--table (WALBOX_TABLE) cannot be combined with [[outbox]] tables in the file");
        }
        if let Some(t) = &o.topic {
            if c.outbox.len() != 1 {
                bail!("--topic (WALBOX_TOPIC) needs exactly one outbox table");
            }
            if let Some(table) = c.outbox.first_mut() {
                table.topic = t.clone();
            }
        }
        c.bind_formats();
        c.sink.rabbitmq.apply_environment();
        c.keep_secrets_out_of_the_log();
        c.validate()?;
        Ok(c)
    }

    /// Registers every secret the sink settings hold with the log's redaction
    /// (the connection string's password is registered as it is parsed).
    fn keep_secrets_out_of_the_log(&self) {
        if let Ok(properties) = self.sink.kafka_properties() {
            for (k, v) in properties {
                if walbox_sink::is_secret_property(&k) {
                    crate::redact::keep_out(&v);
                }
            }
        }
        for secret in self.sink.nats.secrets() {
            crate::redact::keep_out(&secret);
        }
        for secret in self.sink.webhook.secrets() {
            crate::redact::keep_out(&secret);
        }
        if let Ok(redis) = self.sink.redis_sink(&self.source.slot) {
            for secret in redis.secrets() {
                crate::redact::keep_out(&secret);
            }
        }
        for secret in self.sink.rabbitmq.secrets() {
            crate::redact::keep_out(&secret);
        }
    }

    fn validate(&self) -> Result<()> {
        let slot = &self.source.slot;
        if slot.is_empty()
            || slot.len() > 63
            || !slot
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            bail!("source.slot: {slot:?} is not a valid slot name (1-63 of a-z, 0-9 and _)");
        }
        self.replay_window()?;
        if self.snapshot.chunk_rows == 0 {
            bail!("snapshot.chunk_rows: must be at least 1");
        }
        if self
            .snapshot
            .filter
            .as_deref()
            .is_some_and(|f| f.trim().is_empty())
        {
            bail!("snapshot.where: must not be empty");
        }
        if self.source.publication.is_empty() {
            bail!("source.publication: must not be empty");
        }
        if self.sink.max_in_flight == Some(0) {
            bail!("sink.max_in_flight: must be at least 1");
        }
        if self.sink.max_in_flight_bytes == 0 {
            bail!("sink.max_in_flight_bytes: must be at least 1");
        }
        if self.source.status_interval_ms == 0 {
            bail!("source.status_interval_ms: must be at least 1");
        }
        self.sink.kafka_properties()?;
        if self.sink.kind == SinkKind::Nats {
            self.sink.nats_sink()?;
        }
        if self.sink.kind == SinkKind::Webhook {
            self.webhook_sink()?;
        }
        if self.sink.kind == SinkKind::Redis {
            self.sink.redis_sink(&self.source.slot)?;
        }
        if self.sink.kind == SinkKind::RabbitMq {
            self.sink.rabbitmq_sink(&self.source.slot)?;
        }
        if self.sink.kind == SinkKind::PubSub {
            self.sink.pubsub_sink()?;
        }
        self.dead_letter.template()?;
        walbox_outbox::check_prefixes(&self.messages)
            .map_err(|e| anyhow::anyhow!("[[messages]]: {e}"))?;
        for (i, m) in self.messages.iter().enumerate() {
            for prefix in &m.prefixes {
                walbox_outbox::MessageMapper::compile(m, prefix, &self.producer)
                    .with_context(|| format!("messages (section {} of [[messages]])", i + 1))?;
            }
        }
        for t in &self.outbox {
            // The format's settings, which need no table to check.
            walbox_outbox::Formatter::new(
                &t.formatting,
                &t.table,
                &self.producer,
                Default::default(),
            )?;
        }
        Ok(())
    }

    /// `source.replay_window`, parsed.
    pub fn replay_window(&self) -> Result<ReplayWindow> {
        parse_replay_window(&self.source.replay_window).context("source.replay_window")
    }

    /// The webhook sink's settings, with the in-flight bound and the dead-letter
    /// file (default `walbox-<slot>.dead-letters.jsonl`, beside the default
    /// checkpoint).
    pub fn webhook_sink(&self) -> Result<walbox_sink::WebhookSinkConfig> {
        let mut c = self.sink.webhook.clone();
        c.max_in_flight = self.sink.max_in_flight();
        if c.dead_letter_file.is_none() {
            c.dead_letter_file = Some(PathBuf::from(format!(
                "walbox-{}.dead-letters.jsonl",
                self.source.slot
            )));
        }
        c.validate()?;
        Ok(c)
    }

    /// The checkpoint store.
    pub fn checkpoint_store(&self) -> walbox_core::CheckpointFile {
        walbox_core::CheckpointFile::new(self.checkpoint.path.clone().unwrap_or_else(|| {
            PathBuf::from(format!("walbox-{}.checkpoint.json", self.source.slot))
        }))
    }

    /// The connection string, or an error saying how to give one.
    pub fn dsn(&self) -> Result<&str> {
        self.source
            .dsn
            .as_ref()
            .map(Secret::expose)
            .context("no PostgreSQL connection string: set source.dsn, --dsn or WALBOX_DSN")
    }
}
