//! What `walbox doctor` asks a destination before first use, without
//! writing to it: whether it answers, whether it takes walbox's credentials,
//! whether what walbox publishes to exists or may be created, and what the
//! sink requires of it. Each finding that is a problem says what to fix.
//!
//! `names` are the topics (and dead-letter topics) the configuration names
//! outright; names that come from rows (a template with fields) cannot be
//! checked before the rows exist.

use std::time::Duration;

use crate::{KafkaSinkConfig, NatsSinkConfig, RabbitMqMode, RabbitMqSinkConfig, SinkError};

/// How a finding reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// As walbox needs it.
    Ok,
    /// Works, with a risk the text names.
    Warn,
    /// walbox run would stop on it; the text says what to fix.
    Fail,
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// How it reads.
    pub verdict: Verdict,
    /// What was found, and for a problem what to do.
    pub text: String,
}

fn ok(text: impl Into<String>) -> Finding {
    Finding {
        verdict: Verdict::Ok,
        text: text.into(),
    }
}

fn fail(text: impl Into<String>) -> Finding {
    Finding {
        verdict: Verdict::Fail,
        text: text.into(),
    }
}

/// How long a destination has to answer the doctor.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// Kafka: the brokers answer (with the configured security), and each of
/// `names` exists or `create_topics` creates it.
pub async fn kafka(config: &KafkaSinkConfig, names: &[String]) -> Vec<Finding> {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let bootstrap = config
        .properties
        .iter()
        .find(|(k, _)| k == "bootstrap.servers")
        .map_or("(unset)", |(_, v)| v.as_str())
        .to_owned();
    let mut client = rdkafka::ClientConfig::new();
    for (k, v) in &config.properties {
        client.set(k, v);
    }
    // A consumer's properties only: the producer's would be refused here.
    for producer_only in [
        "compression.type",
        "linger.ms",
        "acks",
        "enable.idempotence",
        "queue.buffering.max.messages",
        "queue.buffering.max.kbytes",
        "message.timeout.ms",
        "partitioner",
    ] {
        client.remove(producer_only);
    }
    let auth = crate::secrets::AuthFailure::default();
    let consumer: BaseConsumer<AuthWatch> =
        match client.create_with_context(AuthWatch(auth.clone())) {
            Ok(c) => c,
            // Through SinkError, which names the property, never its value.
            Err(e) => {
                return vec![fail(format!(
                    "sink.kafka: {}: fix the property it names",
                    SinkError::from(e)
                ))];
            }
        };
    let metadata = tokio::task::spawn_blocking(move || {
        let found = consumer.fetch_metadata(None, ANSWER_WITHIN).map(|m| {
            m.topics()
                .iter()
                .filter(|t| t.error().is_none())
                .map(|t| t.name().to_owned())
                .collect::<Vec<_>>()
        });
        if found.is_err() {
            // The client's errors (a refusal of the credentials among them)
            // reach its context when it is polled.
            for _ in 0..10 {
                if consumer.poll(Duration::from_millis(100)).is_none() && auth_seen(&consumer) {
                    break;
                }
            }
        }
        found
    })
    .await;
    let topics = match metadata {
        Ok(Ok(topics)) => topics,
        Ok(Err(_)) if auth.get().is_some() => {
            let e = crate::secrets::authentication_error(
                &config.properties,
                auth.get().unwrap_or_default(),
            );
            return vec![fail(format!(
                "{e}: check sasl.username, sasl.password and sasl.mechanism in sink.kafka"
            ))];
        }
        Ok(Err(e)) => {
            let e = SinkError::from(e);
            return vec![fail(format!(
                "no Kafka broker answered at bootstrap.servers = {bootstrap} within {} s ({e}): \
                 check the addresses and that the brokers run, and security.protocol and the \
                 sasl.* properties if they require TLS or credentials",
                ANSWER_WITHIN.as_secs()
            ))];
        }
        Err(e) => return vec![fail(format!("asking the Kafka brokers: {e}"))],
    };
    let mut out = vec![ok(format!(
        "Kafka at {bootstrap} answers ({} topics)",
        topics.len()
    ))];
    for name in names {
        if topics.iter().any(|t| t == name) {
            out.push(ok(format!("topic {name} exists")));
        } else if config.create_topics {
            out.push(ok(format!(
                "topic {name} does not exist yet; walbox creates it (create_topics = true, {} \
                 partitions, replication {})",
                config.topic_partitions, config.topic_replication
            )));
        } else {
            out.push(fail(format!(
                "topic {name} does not exist: create it (kafka-topics.sh --create --topic \
                 {name}) or set sink.create_topics = true"
            )));
        }
    }
    out
}

fn auth_seen(consumer: &rdkafka::consumer::BaseConsumer<AuthWatch>) -> bool {
    use rdkafka::consumer::Consumer as _;
    consumer.context().0.get().is_some()
}

/// The probe's Kafka client: notes a refusal of the credentials.
struct AuthWatch(crate::secrets::AuthFailure);

impl rdkafka::ClientContext for AuthWatch {
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        self.0.observe(&error, reason);
    }
}

impl rdkafka::consumer::ConsumerContext for AuthWatch {}

/// NATS: the servers answer and take the credentials, JetStream is on, and
/// the stream exists or `create_stream` creates it.
pub async fn nats(config: &NatsSinkConfig) -> Vec<Finding> {
    let servers = config.servers.join(", ");
    let client = match tokio::time::timeout(ANSWER_WITHIN, config.connect()).await {
        Err(_) => {
            return vec![fail(format!(
                "no NATS server answered at {servers} within {} s: check sink.nats.servers and \
                 that the server runs",
                ANSWER_WITHIN.as_secs()
            ))];
        }
        Ok(Err(e @ SinkError::NatsAuthentication { .. })) => {
            return vec![fail(format!(
                "{e}: check sink.nats's user and password, token, nkey_seed or creds_file"
            ))];
        }
        Ok(Err(e)) => {
            return vec![fail(format!(
                "{e}: check sink.nats.servers and that the server runs"
            ))];
        }
        Ok(Ok(c)) => c,
    };
    let mut out = vec![ok(format!(
        "NATS at {servers} answers and takes the credentials"
    ))];
    let js = async_nats::jetstream::new(client);
    let stream = &config.stream;
    match tokio::time::timeout(ANSWER_WITHIN, js.get_stream(stream)).await {
        Ok(Ok(mut s)) => match s.info().await {
            Ok(info) => {
                let window = info.config.duplicate_window;
                let wanted = config.duplicate_window_s();
                if window.as_secs() >= wanted {
                    out.push(ok(format!(
                        "stream {stream} exists (subjects {}), duplicate window {} s",
                        info.config.subjects.join(", "),
                        window.as_secs()
                    )));
                } else {
                    out.push(Finding {
                        verdict: if config.duplicate_window_s.is_some() {
                            Verdict::Fail
                        } else {
                            Verdict::Warn
                        },
                        text: format!(
                            "stream {stream} keeps message ids for {} s, less than {wanted} s: \
                             exactly once holds only for shorter outages; raise it (nats stream \
                             edit {stream} --dupe-window {wanted}s)",
                            window.as_secs()
                        ),
                    });
                }
            }
            Err(e) => out.push(fail(format!("reading stream {stream}'s settings: {e}"))),
        },
        Ok(Err(e))
            if matches!(
                e.kind(),
                async_nats::jetstream::context::GetStreamErrorKind::JetStream(ref j)
                    if j.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            if config.create_stream {
                out.push(ok(format!(
                    "stream {stream} does not exist yet; walbox creates it (create_stream = \
                     true, subjects {})",
                    config.subjects.join(", ")
                )));
            } else {
                out.push(fail(format!(
                    "stream {stream} does not exist: create it (nats stream add {stream} \
                     --subjects '{}') or set sink.nats.create_stream = true",
                    config.subjects.join(" ")
                )));
            }
        }
        Ok(Err(e)) => out.push(fail(format!(
            "asking for stream {stream}: {e}: is JetStream on (nats-server -js)?"
        ))),
        Err(_) => out.push(fail(format!(
            "JetStream did not answer within {} s: is it on (nats-server -js)?",
            ANSWER_WITHIN.as_secs()
        ))),
    }
    out
}

/// RabbitMQ: the broker answers and takes the credentials; in exchange mode
/// the exchange exists or is declared and the queues walbox reads are there
/// and durable; in stream mode each of `names` is a stream or is declared.
pub async fn rabbitmq(config: &RabbitMqSinkConfig, names: &[String]) -> Vec<Finding> {
    match config.mode {
        RabbitMqMode::Exchange => rabbitmq_exchange(config).await,
        RabbitMqMode::Stream => rabbitmq_streams(config, names).await,
    }
}

fn rabbitmq_connect_failure(config: &RabbitMqSinkConfig, e: &SinkError) -> Finding {
    match e {
        SinkError::RabbitMqAuthentication { user, .. } => fail(format!(
            "RabbitMQ at {} refused user {user:?}: check sink.rabbitmq.user and password (or \
             WALBOX_RABBITMQ_USER, WALBOX_RABBITMQ_PASSWORD); guest may connect from localhost \
             only",
            config.describe()
        )),
        e => fail(format!(
            "{e}: check sink.rabbitmq.host and port and that the broker runs"
        )),
    }
}

async fn rabbitmq_exchange(config: &RabbitMqSinkConfig) -> Vec<Finding> {
    use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
    use lapin::types::{FieldTable, ShortString};
    let (connection, _) = match crate::rabbitmq::connect_amqp(config).await {
        Ok(c) => c,
        Err(e) => return vec![rabbitmq_connect_failure(config, &e)],
    };
    let mut out = vec![ok(format!(
        "RabbitMQ at {} answers and takes user {:?}",
        config.describe(),
        config.user()
    ))];
    // A passive declaration that fails closes its channel: one each.
    let exchange = &config.exchange;
    let found = match connection.create_channel().await {
        Ok(ch) => ch
            .exchange_declare(
                ShortString::from(exchange.as_str()),
                lapin::ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match found {
        Ok(()) => out.push(ok(format!("exchange {exchange} exists"))),
        Err(_) if config.declare => out.push(ok(format!(
            "exchange {exchange} does not exist yet; walbox declares it (declare = true, type {}, \
             durable)",
            config.exchange_type
        ))),
        Err(e) if e.contains("NOT_FOUND") || e.contains("404") => out.push(fail(format!(
            "exchange {exchange} does not exist: declare it (durable, type {}) and bind a \
             durable queue to it, or set sink.rabbitmq.declare = true",
            config.exchange_type
        ))),
        Err(e) => out.push(fail(format!("asking for exchange {exchange}: {e}"))),
    }
    for (key, queue, what) in [
        ("verify_queue", &config.verify_queue, "walbox verify reads"),
        (
            "dead_letter_queue",
            &config.dead_letter_queue,
            "walbox dlq replay reads",
        ),
    ] {
        let Some(queue) = queue else { continue };
        let passive = match connection.create_channel().await {
            Ok(ch) => ch
                .queue_declare(
                    ShortString::from(queue.as_str()),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map(drop)
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = passive {
            out.push(if e.contains("NOT_FOUND") || e.contains("404") {
                fail(format!(
                    "queue {queue} (sink.rabbitmq.{key}, which {what}) does not exist: declare \
                     it durable and bind it to exchange {exchange}"
                ))
            } else {
                fail(format!("asking for queue {queue}: {e}"))
            });
            continue;
        }
        // Declared again as durable: a no-op for a durable queue, refused
        // (406) for one that is not.
        let durable = match connection.create_channel().await {
            Ok(ch) => ch
                .queue_declare(
                    ShortString::from(queue.as_str()),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map(drop)
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match durable {
            Ok(()) => out.push(ok(format!("queue {queue} ({key}) exists and is durable"))),
            Err(e) if e.contains("'durable'") => out.push(fail(format!(
                "queue {queue} (sink.rabbitmq.{key}) is not durable: what it holds is lost when \
                 the broker restarts; declare it again durable"
            ))),
            Err(_) => out.push(ok(format!("queue {queue} ({key}) exists"))),
        }
    }
    let _ = connection
        .close(200, ShortString::from("walbox doctor"))
        .await;
    out
}

async fn rabbitmq_streams(config: &RabbitMqSinkConfig, names: &[String]) -> Vec<Finding> {
    let (environment, client) = match crate::rabbitmq::connect_streams(config).await {
        Ok(c) => c,
        Err(e) => return vec![rabbitmq_connect_failure(config, &e)],
    };
    let mut out = vec![ok(format!(
        "RabbitMQ streams at {} answer and take user {:?}",
        config.describe(),
        config.user()
    ))];
    for name in names {
        let exists = client
            .metadata(vec![name.clone()])
            .await
            .map(|m| m.contains_key(name.as_str()));
        match exists {
            Ok(true) => out.push(ok(format!("stream {name} exists"))),
            Ok(false) if config.declare => out.push(ok(format!(
                "stream {name} does not exist yet; walbox declares it (declare = true)"
            ))),
            Ok(false) => out.push(fail(format!(
                "stream {name} does not exist: declare it (a durable queue of type stream: \
                 rabbitmqadmin declare queue name={name} durable=true queue_type=stream) or set \
                 sink.rabbitmq.declare = true"
            ))),
            Err(e) => out.push(fail(format!("asking for stream {name}: {e}"))),
        }
    }
    let _ = client.close().await;
    drop(environment);
    out
}

/// Redis: covered by [`crate::server_durability`], which connects with the
/// credentials and reads the settings the sink requires.
///
/// Webhooks: something answers at the URL's host and port (a TCP
/// connection; nothing is POSTed, since a receiver takes any POST for an
/// event).
pub async fn webhook(url_template: &str) -> Vec<Finding> {
    // The template's fields filled with a word, to parse the fixed part.
    let mut url = String::new();
    let mut in_field = false;
    for c in url_template.chars() {
        match c {
            '{' => in_field = true,
            '}' if in_field => {
                in_field = false;
                url.push('x');
            }
            c if !in_field => url.push(c),
            _ => {}
        }
    }
    let parsed = match reqwest::Url::parse(&url) {
        Ok(u) => u,
        Err(e) => return vec![fail(format!("sink.webhook.url: {e}"))],
    };
    let (Some(host), Some(port)) = (parsed.host_str(), parsed.port_or_known_default()) else {
        return vec![fail("sink.webhook.url names no host".to_owned())];
    };
    let host = host.trim_matches(|c| c == '[' || c == ']').to_owned();
    let at = format!("{}://{host}:{port}", parsed.scheme());
    match tokio::time::timeout(
        ANSWER_WITHIN,
        tokio::net::TcpStream::connect((host.as_str(), port)),
    )
    .await
    {
        Ok(Ok(_)) => vec![ok(format!("the receiver at {at} accepts connections"))],
        Ok(Err(e)) => vec![fail(format!(
            "nothing answers at {at} ({e}): check sink.webhook.url and that the receiver runs"
        ))],
        Err(_) => vec![fail(format!(
            "no answer from {at} within {} s: check sink.webhook.url, the receiver and the \
             network between",
            ANSWER_WITHIN.as_secs()
        ))],
    }
}

/// Kinesis: the credentials the AWS chain finds, and each stream `names`
/// names exists and is active (or may be created).
pub async fn kinesis(config: &crate::KinesisSinkConfig, names: &[String]) -> Vec<Finding> {
    let sdk = match tokio::time::timeout(
        ANSWER_WITHIN,
        config.connection().sdk_config("sink.kinesis"),
    )
    .await
    {
        Err(_) => return vec![fail("the AWS credential chain gave no answer in time")],
        Ok(Err(e)) => return vec![fail(format!("{e}"))],
        Ok(Ok(sdk)) => sdk,
    };
    let client = aws_sdk_kinesis::Client::new(&sdk);
    let mut out = vec![ok("the AWS credential chain gives credentials for Kinesis")];
    // Each stream also keeps its records a week or more.
    for name in names {
        let asked = tokio::time::timeout(
            ANSWER_WITHIN,
            client.describe_stream_summary().stream_name(name).send(),
        )
        .await;
        out.push(match asked {
            Err(_) => fail(format!(
                "Kinesis did not answer within {} s: check sink.kinesis.region and \
                 endpoint_url",
                ANSWER_WITHIN.as_secs()
            )),
            Ok(Ok(found)) => {
                let hours = found
                    .stream_description_summary()
                    .map_or(24, |s| s.retention_period_hours());
                kept_long_enough(
                    format!("Kinesis stream {name} exists"),
                    &format!("Kinesis stream {name}"),
                    i64::from(hours) * 3600,
                    "raise it with IncreaseStreamRetentionPeriod",
                )
            }
            Ok(Err(e))
                if e.as_service_error()
                    .is_some_and(|se| se.is_resource_not_found_exception()) =>
            {
                if config.create_streams {
                    ok(format!(
                        "Kinesis stream {name} does not exist; walbox creates it (create_topics)"
                    ))
                } else {
                    fail(format!(
                        "Kinesis stream {name} does not exist: create it, or set \
                         create_topics = true in [sink]"
                    ))
                }
            }
            Ok(Err(e)) => fail(format!(
                "{}: check the AWS credentials and walbox's rights \
                 (kinesis:DescribeStreamSummary, kinesis:PutRecords)",
                crate::aws::setup_error(&e, "kinesis", &format!("describing {name}"))
            )),
        });
    }
    out
}

/// The least a destination walbox writes to should keep what it holds: a
/// week, so that a consumer stopped over a weekend, or a dead letter found
/// on Monday, is still there.
const KEEP_AT_LEAST_S: i64 = 7 * 24 * 3600;

/// `fine` when `what` keeps messages `seconds` or more than
/// [`KEEP_AT_LEAST_S`], else a warning saying how to raise it.
fn kept_long_enough(fine: String, what: &str, seconds: i64, raise: &str) -> Finding {
    if seconds >= KEEP_AT_LEAST_S {
        return ok(fine);
    }
    Finding {
        verdict: Verdict::Warn,
        text: format!(
            "{what} keeps what it holds {} h: an event or a dead letter nobody took in that \
             time is gone; {raise}",
            seconds / 3600
        ),
    }
}

/// SQS: the credentials the AWS chain finds, and each queue `names` names
/// exists (or may be created) and keeps its messages a week or more.
pub async fn sqs(config: &crate::SqsSinkConfig, names: &[String]) -> Vec<Finding> {
    let sdk = match tokio::time::timeout(ANSWER_WITHIN, config.connection().sdk_config("sink.sqs"))
        .await
    {
        Err(_) => return vec![fail("the AWS credential chain gave no answer in time")],
        Ok(Err(e)) => return vec![fail(format!("{e}"))],
        Ok(Ok(sdk)) => sdk,
    };
    let client = aws_sdk_sqs::Client::new(&sdk);
    let mut out = vec![ok("the AWS credential chain gives credentials for SQS")];
    for topic in names {
        let name = config.queue_name(topic);
        let asked = tokio::time::timeout(
            ANSWER_WITHIN,
            client.get_queue_url().queue_name(&name).send(),
        )
        .await;
        out.push(match asked {
            Err(_) => fail(format!(
                "SQS did not answer within {} s: check sink.sqs.region and endpoint_url",
                ANSWER_WITHIN.as_secs()
            )),
            Ok(Ok(found)) => {
                let kept = client
                    .get_queue_attributes()
                    .queue_url(found.queue_url().unwrap_or_default())
                    .attribute_names(aws_sdk_sqs::types::QueueAttributeName::MessageRetentionPeriod)
                    .send()
                    .await
                    .ok()
                    .and_then(|a| {
                        a.attributes()?
                            .get(&aws_sdk_sqs::types::QueueAttributeName::MessageRetentionPeriod)?
                            .parse::<i64>()
                            .ok()
                    });
                match kept {
                    Some(seconds) => kept_long_enough(
                        format!("SQS queue {name} exists (topic {topic})"),
                        &format!("SQS queue {name}"),
                        seconds,
                        "set its MessageRetentionPeriod up to 1209600 (14 days)",
                    ),
                    None => ok(format!("SQS queue {name} exists (topic {topic})")),
                }
            }
            Ok(Err(e)) if e.as_service_error().is_some_and(crate::aws::no_such_queue) => {
                if config.create_queues {
                    ok(format!(
                        "SQS queue {name} (topic {topic}) does not exist; walbox creates it \
                         (create_topics)"
                    ))
                } else {
                    fail(format!(
                        "SQS queue {name} (topic {topic}) does not exist: create it{}, or set \
                         create_topics = true in [sink]",
                        if config.fifo { " as a FIFO queue" } else { "" }
                    ))
                }
            }
            Ok(Err(e)) => fail(format!(
                "{}: check the AWS credentials and walbox's rights (sqs:GetQueueUrl, \
                 sqs:SendMessage)",
                crate::aws::setup_error(&e, "sqs", &format!("finding queue {name}"))
            )),
        });
    }
    if let Some(why) = config.window_warning() {
        out.push(Finding {
            verdict: Verdict::Warn,
            text: why,
        });
    }
    out
}

/// SNS: the credentials the AWS chain finds, each topic `names` names
/// exists (or may be created) and has a subscription (SNS keeps nothing: a
/// message published to a topic without one is gone), and the dead-letter
/// queue `dlq replay` reads exists.
pub async fn sns(config: &crate::SnsSinkConfig, names: &[String]) -> Vec<Finding> {
    let sdk = match tokio::time::timeout(ANSWER_WITHIN, config.connection().sdk_config("sink.sns"))
        .await
    {
        Err(_) => return vec![fail("the AWS credential chain gave no answer in time")],
        Ok(Err(e)) => return vec![fail(format!("{e}"))],
        Ok(Ok(sdk)) => sdk,
    };
    let client = aws_sdk_sns::Client::new(&sdk);
    let mut out = vec![ok("the AWS credential chain gives credentials for SNS")];
    for topic in names {
        let name = config.topic_name(topic);
        let found = tokio::time::timeout(
            ANSWER_WITHIN,
            crate::aws::sns::topic_arn(&client, &name, false, config.fifo),
        )
        .await;
        out.push(match found {
            Err(_) => fail(format!(
                "SNS did not answer within {} s: check sink.sns.region and endpoint_url",
                ANSWER_WITHIN.as_secs()
            )),
            Ok(Err(SinkError::MissingTopic(_))) if config.create_topics => ok(format!(
                "SNS topic {name} (topic {topic}) does not exist; walbox creates it \
                 (create_topics), and stops until it has a subscription"
            )),
            Ok(Err(SinkError::MissingTopic(_))) => fail(format!(
                "SNS topic {name} (topic {topic}) does not exist: create it{}, or set \
                 create_topics = true in [sink]",
                if config.fifo { " as a FIFO topic" } else { "" }
            )),
            Ok(Err(e)) => fail(format!(
                "{e}: check the AWS credentials and walbox's rights (sns:ListTopics, \
                 sns:Publish)"
            )),
            Ok(Ok(arn)) => match crate::aws::sns::subscriptions(&client, &arn).await {
                Ok(0) if !config.allow_no_subscription => fail(format!(
                    "SNS topic {name} has no subscription: SNS would drop every message \
                     published to it; subscribe its consumers first"
                )),
                Ok(n) => ok(format!(
                    "SNS topic {name} exists, with {n} subscription{}",
                    if n == 1 { "" } else { "s" }
                )),
                Err(e) => fail(format!("{e}")),
            },
        });
    }
    if let Some(why) = config.window_warning() {
        out.push(Finding {
            verdict: Verdict::Warn,
            text: why,
        });
    }
    if config.dead_letter_queue.is_none() {
        out.push(Finding {
            verdict: Verdict::Warn,
            text: "sink.sns.dead_letter_queue is not set: walbox dlq replay has no queue to \
                   read the dead letters back from"
                .to_owned(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destination_keeping_less_than_a_week_is_warned_of_with_how_to_raise_it() {
        let four_days = kept_long_enough("fine".into(), "SQS queue q.fifo", 345_600, "raise it");
        assert_eq!(four_days.verdict, Verdict::Warn);
        assert!(four_days.text.contains("96 h") && four_days.text.contains("raise it"));
        let week = kept_long_enough("fine".into(), "Kinesis stream s", 168 * 3600, "raise it");
        assert_eq!(week.verdict, Verdict::Ok);
        assert_eq!(week.text, "fine");
    }
}
