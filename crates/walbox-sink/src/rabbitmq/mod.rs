//! The RabbitMQ sink, in one of two modes (`[sink.rabbitmq] mode`):
//!
//! - [`exchange`]: AMQP 0-9-1 to an exchange, routing key = topic, acknowledged
//!   on the publisher confirm of a message some queue took (`mandatory`; a
//!   returned message fails its event). At least once: a resend after a crash
//!   is stored again, with the same `message_id`.
//! - [`stream`]: RabbitMQ Streams over the stream protocol, one stream per
//!   topic, each event published by a named producer under a publishing id
//!   taken from its position, so that the broker drops a resend after a crash
//!   (exactly once into the stream, with no time window).

mod config;
mod confirms;
mod exchange;
mod publishing_id;
mod reader;
mod stream;

use std::time::Duration;

use walbox_outbox::Event;

pub use config::{PASSWORD_ENV, RabbitMqMode, RabbitMqSinkConfig, USER_ENV};
pub(crate) use exchange::connect as connect_amqp;
pub use reader::{QueueLetters, StreamLetters, read_queue, read_stream};
pub(crate) use stream::connect as connect_streams;

use crate::{Deliveries, Sink, SinkError};

/// Publishes events to RabbitMQ.
#[derive(Debug)]
pub struct RabbitMqSink {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Exchange(Box<exchange::ExchangeSink>),
    Stream(Box<stream::StreamSink>),
}

impl RabbitMqSink {
    /// A sink with these settings; it connects on its first event. Returns the
    /// sink and the receiver of its deliveries.
    pub fn new(config: RabbitMqSinkConfig) -> Result<(Self, Deliveries), SinkError> {
        crate::install_crypto_provider();
        config.validate()?;
        match config.mode {
            RabbitMqMode::Exchange => {
                let (sink, rx) = exchange::ExchangeSink::new(config);
                Ok((
                    RabbitMqSink {
                        inner: Inner::Exchange(Box::new(sink)),
                    },
                    rx,
                ))
            }
            RabbitMqMode::Stream => {
                let (sink, rx) = stream::StreamSink::new(config);
                Ok((
                    RabbitMqSink {
                        inner: Inner::Stream(Box::new(sink)),
                    },
                    rx,
                ))
            }
        }
    }
}

impl Sink for RabbitMqSink {
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        match &mut self.inner {
            Inner::Exchange(s) => s.send(event, token).await,
            Inner::Stream(s) => s.send(event, token).await,
        }
    }

    fn end_batch(&mut self) {
        match &mut self.inner {
            Inner::Exchange(s) => s.end_batch(),
            Inner::Stream(s) => s.end_batch(),
        }
    }

    fn abort(&mut self) {
        match &mut self.inner {
            Inner::Exchange(s) => s.abort(),
            Inner::Stream(s) => s.abort(),
        }
    }

    async fn flush(&mut self, timeout: Duration) -> Result<(), SinkError> {
        match &mut self.inner {
            Inner::Exchange(s) => s.flush(timeout).await,
            Inner::Stream(s) => s.flush(timeout).await,
        }
    }

    fn duplicates(&self) -> u64 {
        match &self.inner {
            Inner::Exchange(s) => s.duplicates(),
            Inner::Stream(s) => s.duplicates(),
        }
    }
}
