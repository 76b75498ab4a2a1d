//! `walbox init --sink TYPE`: a configuration to start from, for one sink
//! type. Every key walbox takes for that destination, with its default and
//! what it means (a commented-out key shows its default); the server
//! addresses are walbox's defaults, to be filled in. The text is checked with
//! the configuration's own parser before it is written, and an existing file
//! is never overwritten.
//!
//! The templates are `init/*.toml`: `head.toml` (PostgreSQL, the outbox table,
//! dead letters, the checkpoint, ..., and `[sink]`'s keys that every sink
//! takes), then the sink type's own ([`sink_part`]). Their tests check that
//! each names every key the configuration accepts there, that a commented key
//! shows its default, and that the whole, every key uncommented, still loads.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::config::{Config, Secret, SinkKind};

/// `walbox init` arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The sink type: where events go.
    #[arg(long, value_enum)]
    sink: SinkKind,
    /// PostgreSQL connection string to write as source.dsn; without it the
    /// file shows where one goes (WALBOX_DSN or --dsn may give it later).
    #[arg(long, value_name = "DSN")]
    dsn: Option<Secret>,
    /// The outbox table (`schema.name`).
    #[arg(long, value_name = "TABLE", default_value = "public.outbox")]
    table: String,
    /// The file to write (never overwritten); `-` prints it instead.
    #[arg(long, short = 'o', value_name = "FILE", default_value = "walbox.toml")]
    output: PathBuf,
}

const HEAD: &str = include_str!("init/head.toml");

/// The part of the template that is the sink type's own: `[sink]` keys only
/// it takes and its `[sink.<type>]` table. A new sink type adds its file.
fn sink_part(kind: SinkKind) -> &'static str {
    match kind {
        SinkKind::Kafka => include_str!("init/kafka.toml"),
        SinkKind::Stdout => include_str!("init/stdout.toml"),
        SinkKind::Nats => include_str!("init/nats.toml"),
        SinkKind::Webhook => include_str!("init/webhook.toml"),
        SinkKind::Redis => include_str!("init/redis.toml"),
        SinkKind::RabbitMq => include_str!("init/rabbitmq.toml"),
        SinkKind::Kinesis => include_str!("init/kinesis.toml"),
        SinkKind::Sqs => include_str!("init/sqs.toml"),
        SinkKind::PubSub => include_str!("init/pubsub.toml"),
        SinkKind::Sns => include_str!("init/sns.toml"),
    }
}

/// A TOML string holding `text`.
fn toml_string(text: &str) -> String {
    toml::Value::String(text.to_owned()).to_string()
}

/// A new webhook signing secret: `whsec_` and 32 random bytes in base64.
fn new_webhook_secret() -> Result<String> {
    use std::io::Read as _;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom for a webhook secret")?;
    use base64::Engine as _;
    Ok(format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    ))
}

/// The configuration text for `kind`, naming `file` in its instructions.
pub fn render(
    kind: SinkKind,
    dsn: Option<&str>,
    table: &str,
    file: &str,
    webhook_secret: &str,
) -> String {
    let dsn_line = match dsn {
        Some(dsn) => format!("dsn = {}", toml_string(dsn)),
        None => "# dsn = \"host=localhost user=walbox dbname=app\"   # example".to_owned(),
    };
    let text = format!("{HEAD}{}", sink_part(kind));
    // The sink's own default bound (its template's mode, for RabbitMQ).
    let max_in_flight = crate::config::SinkConfig {
        kind,
        ..Default::default()
    }
    .max_in_flight();
    text.replace("@MAX_IN_FLIGHT@", &max_in_flight.to_string())
        .replace("@DESTINATION@", kind.destination())
        .replace("@NAME@", kind.name())
        .replace("@FILE@", file)
        .replace("@DSN@", &dsn_line)
        .replace("@TABLE@", &toml_string(table))
        .replace("@TOPIC_NAMES@", kind.topic_names())
        .replace("@SECRET@", &toml_string(webhook_secret))
}

/// The addresses in `kind`'s configuration to fill in, as a sentence.
fn addresses(kind: SinkKind) -> &'static str {
    match kind {
        SinkKind::Kafka => "sink.kafka's \"bootstrap.servers\"",
        SinkKind::Stdout => "nothing of the destination's",
        SinkKind::Nats => "sink.nats.servers",
        SinkKind::Webhook => "sink.webhook.url (and give the receiver the secret)",
        SinkKind::Redis => "sink.redis.url",
        SinkKind::RabbitMq => "sink.rabbitmq.host and port (and user and password)",
        SinkKind::Kinesis => {
            "sink.kinesis.region (credentials come from the AWS chain: AWS_ACCESS_KEY_ID and \
             AWS_SECRET_ACCESS_KEY, AWS_PROFILE, web identity or instance metadata)"
        }
        SinkKind::Sqs => {
            "sink.sqs.region (credentials come from the AWS chain: AWS_ACCESS_KEY_ID and \
             AWS_SECRET_ACCESS_KEY, AWS_PROFILE, web identity or instance metadata)"
        }
        SinkKind::Sns => {
            "sink.sns.region and dead_letter_queue (credentials come from the AWS chain: \
             AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, web identity or instance \
             metadata)"
        }
        SinkKind::PubSub => {
            "sink.pubsub.project and endpoint (credentials come from Application Default \
             Credentials: GOOGLE_APPLICATION_CREDENTIALS, gcloud's, or the metadata server)"
        }
    }
}

/// `walbox init`.
#[allow(clippy::print_stdout)] // command output
pub fn run(args: &Args) -> Result<()> {
    let to_stdout = args.output == Path::new("-");
    let file = args.output.display().to_string();
    let secret = if args.sink == SinkKind::Webhook {
        new_webhook_secret()?
    } else {
        String::new()
    };
    let text = render(
        args.sink,
        args.dsn.as_ref().map(Secret::expose),
        &args.table,
        if to_stdout { "walbox.toml" } else { &file },
        &secret,
    );
    // Never write what walbox itself would refuse.
    Config::parse(&text, &args.output).context("the configuration walbox init made")?;
    if to_stdout {
        print!("{text}");
        return Ok(());
    }
    let mut out = match open_new(&args.output) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => bail!(
            "{file} exists: walbox init never overwrites a file; move it away or name \
             another with --output"
        ),
        Err(e) => return Err(e).with_context(|| format!("creating {file}")),
    };
    out.write_all(text.as_bytes())
        .and_then(|()| out.sync_all())
        .with_context(|| format!("writing {file}"))?;
    println!(
        "wrote {file}: a configuration for {} (sink type {}).\nFill in {}{}, then:\n  \
         walbox setup --config {file}\n  walbox doctor --config {file}\n  walbox run --config {file}",
        args.sink.destination(),
        args.sink.name(),
        addresses(args.sink),
        if args.dsn.is_none() {
            ", and source.dsn (or set WALBOX_DSN)"
        } else {
            ""
        },
    );
    Ok(())
}

/// Creates `path`, refusing one that exists, readable by its owner only: it
/// may hold a password (the connection string) or a signing secret.
fn open_new(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

#[cfg(test)]
mod tests;
