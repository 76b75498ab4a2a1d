//! The configured sink, and the sink's errors and outcomes in the core's terms.

use std::time::Duration;

use anyhow::anyhow;
use walbox_outbox::Event;
use walbox_sink::{
    Deliveries, DeliveryError, KafkaSink, KinesisSink, NatsSink, PubSubSink, RabbitMqSink,
    RedisSink, Sink, SinkError, SnsSink, SqsSink, StdoutSink, WebhookSink,
};

use super::transient;
use crate::config::{Config, SinkKind};

/// The configured sink.
pub(super) enum AnySink {
    Kafka(KafkaSink),
    Nats(Box<NatsSink>),
    Redis(Box<RedisSink>),
    RabbitMq(Box<RabbitMqSink>),
    PubSub(Box<PubSubSink>),
    Stdout(StdoutSink),
    Webhook(Box<WebhookSink>),
    Kinesis(Box<KinesisSink>),
    Sqs(Box<SqsSink>),
    Sns(Box<SnsSink>),
}

/// Calls the same method on whichever sink `AnySink` holds.
macro_rules! each_sink {
    ($any:expr, $s:ident => $call:expr) => {
        match $any {
            AnySink::Kafka($s) => $call,
            AnySink::Nats($s) => $call,
            AnySink::Redis($s) => $call,
            AnySink::RabbitMq($s) => $call,
            AnySink::PubSub($s) => $call,
            AnySink::Stdout($s) => $call,
            AnySink::Webhook($s) => $call,
            AnySink::Kinesis($s) => $call,
            AnySink::Sqs($s) => $call,
            AnySink::Sns($s) => $call,
        }
    };
}

impl Sink for AnySink {
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        each_sink!(self, s => s.send(event, token).await)
    }

    fn end_batch(&mut self) {
        each_sink!(self, s => s.end_batch());
    }

    fn abort(&mut self) {
        each_sink!(self, s => s.abort());
    }

    async fn flush(&mut self, timeout: Duration) -> Result<(), SinkError> {
        each_sink!(self, s => s.flush(timeout).await)
    }

    fn duplicates(&self) -> u64 {
        each_sink!(self, s => s.duplicates())
    }
}

pub(super) fn make_sink(config: &Config) -> anyhow::Result<(AnySink, Deliveries)> {
    Ok(match config.sink.kind {
        SinkKind::Kafka => {
            let (sink, deliveries) = KafkaSink::new(config.sink.kafka_sink()?)?;
            (AnySink::Kafka(sink), deliveries)
        }
        SinkKind::Nats => {
            let (sink, deliveries) = NatsSink::new(config.sink.nats_sink()?)?;
            (AnySink::Nats(Box::new(sink)), deliveries)
        }
        SinkKind::Redis => {
            let (sink, deliveries) = RedisSink::new(config.sink.redis_sink(&config.source.slot)?)?;
            (AnySink::Redis(Box::new(sink)), deliveries)
        }
        SinkKind::RabbitMq => {
            let (sink, deliveries) =
                RabbitMqSink::new(config.sink.rabbitmq_sink(&config.source.slot)?)?;
            (AnySink::RabbitMq(Box::new(sink)), deliveries)
        }
        SinkKind::PubSub => {
            let (sink, deliveries) = PubSubSink::new(config.sink.pubsub_sink()?)?;
            (AnySink::PubSub(Box::new(sink)), deliveries)
        }
        SinkKind::Stdout => {
            let (sink, deliveries) = StdoutSink::new();
            (AnySink::Stdout(sink), deliveries)
        }
        SinkKind::Webhook => {
            let (sink, deliveries) = WebhookSink::new(config.webhook_sink()?)?;
            (AnySink::Webhook(Box::new(sink)), deliveries)
        }
        SinkKind::Kinesis => {
            let (sink, deliveries) = KinesisSink::new(config.sink.kinesis_sink()?)?;
            (AnySink::Kinesis(Box::new(sink)), deliveries)
        }
        SinkKind::Sqs => {
            let (sink, deliveries) = SqsSink::new(config.sink.sqs_sink()?)?;
            (AnySink::Sqs(Box::new(sink)), deliveries)
        }
        SinkKind::Sns => {
            let (sink, deliveries) = SnsSink::new(config.sink.sns_sink()?)?;
            (AnySink::Sns(Box::new(sink)), deliveries)
        }
    })
}

/// A sink that could not take an event: a Kafka client error or an unreachable
/// NATS, Redis, RabbitMQ or Pub/Sub server may pass (a new session retries), anything else (a
/// missing topic or stream, refused credentials, configuration) would repeat.
pub(super) fn sink_error(e: SinkError) -> anyhow::Error {
    match e {
        SinkError::Kafka(_)
        | SinkError::Nats(_)
        | SinkError::Redis(_)
        | SinkError::RabbitMq(_)
        | SinkError::PubSub(_)
        | SinkError::Aws(_)
        | SinkError::TaskDied(_) => transient(e),
        other => anyhow!(other),
    }
}

/// A failed delivery in the core's terms.
pub(super) fn failure(e: DeliveryError) -> walbox_core::Failure {
    walbox_core::Failure {
        about_message: e.is_about_the_message(),
        lasting: e.is_final(),
        event_id: e.event_id,
        topic: e.topic,
        class: e.class.as_str(),
        reason: e.reason,
        rejected: e.rejected.map(|r| walbox_core::Rejected {
            key: r.key,
            headers: r.headers,
            value_len: r.value_len,
            attempts: r.attempts,
        }),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_core_knows_the_sinks_class_of_a_refusal_for_size() {
        assert_eq!(
            walbox_sink::DeliveryClass::MessageTooLarge.as_str(),
            walbox_core::TOO_LARGE
        );
    }
}
