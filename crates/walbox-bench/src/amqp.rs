//! A plain AMQP client publishing the backlog's shape to the exchange walbox
//! publishes to: the RabbitMQ exchange contender's server-side ceiling. It
//! publishes as many persistent, mandatory messages as the backlog has events
//! (a ~300-byte JSON body, a uuid `message_id`, the headers an outbox event
//! carries) on one confirm-mode channel, with as many awaiting their confirm
//! as walbox's default `max_in_flight`, to a durable queue bound to the same
//! exchange, and times the first publish to the last confirm. The broker
//! does for these messages what it does for walbox's, so walbox's time over
//! this one says how much of the exchange contender's time is walbox's own.

use std::time::Instant;

use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};
use walbox_testkit::RabbitMq;

use crate::Error;
use crate::contenders::RABBITMQ_EXCHANGE;
use crate::report::Spread;

/// Messages awaiting their confirm at once: walbox's default
/// `sink.max_in_flight` in exchange mode.
pub const WINDOW: usize = 2_000;

/// The plain client's rounds.
pub struct PlainAmqp {
    pub events: u64,
    pub seconds: Vec<f64>,
}

impl PlainAmqp {
    pub fn seconds(&self) -> Spread {
        Spread::of(self.seconds.iter().copied())
    }
}

/// One round: `events` messages to a fresh queue, which is counted and
/// deleted after; the seconds from the first publish to the last confirm.
pub async fn publish_round(rabbitmq: &RabbitMq, events: u64, round: usize) -> Result<f64, Error> {
    let queue = format!("bench.plain.{round}");
    rabbitmq
        .declare_exchange(RABBITMQ_EXCHANGE, "topic")
        .await?;
    rabbitmq
        .bind_queue(&queue, RABBITMQ_EXCHANGE, &queue)
        .await?;
    let connection =
        Connection::connect(&rabbitmq.amqp_url(), ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let body = format!(
        "{{\"order_id\":\"{}\",\"customer\":\"c-0042\",\"lines\":[{}],\"total_cents\":12990}}",
        "0".repeat(36),
        (0..6)
            .map(|i| format!("{{\"sku\":\"sku-{i:04}\",\"qty\":1,\"price_cents\":2165}}"))
            .collect::<Vec<_>>()
            .join(",")
    )
    .into_bytes();
    let started = Instant::now();
    let mut awaiting = FuturesOrdered::new();
    for i in 0..events {
        if awaiting.len() >= WINDOW
            && let Some(r) = awaiting.next().await
        {
            confirmed(r)?;
        }
        let id = format!("00000000-0000-4000-8000-{i:012}");
        let mut headers = FieldTable::default();
        for (k, v) in [
            ("event_id", id.clone()),
            ("event_type", "OrderPlaced".to_owned()),
            ("aggregate_type", "order".to_owned()),
            ("aggregate_id", format!("order-{}", i % 1_000)),
            (
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
            ),
            ("walbox_key", format!("order-{}", i % 1_000)),
        ] {
            headers.insert(
                ShortString::from(k),
                AMQPValue::LongString(LongString::from(v.into_bytes())),
            );
        }
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(ShortString::from(id))
            .with_content_type(ShortString::from("application/json"))
            .with_headers(headers);
        let (channel, body, key) = (channel.clone(), body.clone(), queue.clone());
        awaiting.push_back(async move {
            let confirm = channel
                .basic_publish(
                    ShortString::from(RABBITMQ_EXCHANGE),
                    ShortString::from(key),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &body,
                    properties,
                )
                .await?;
            confirm.await
        });
    }
    while let Some(r) = awaiting.next().await {
        confirmed(r)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let _ = connection.close(200, ShortString::from("done")).await;
    let held = u64::from(rabbitmq.queue_messages(&queue).await?);
    rabbitmq.delete_queue(&queue).await?;
    if held != events {
        return Err(format!("the plain client's queue {queue} holds {held} of {events}").into());
    }
    Ok(seconds)
}

fn confirmed(r: Result<Confirmation, lapin::Error>) -> Result<(), Error> {
    match r? {
        Confirmation::Ack(None) => Ok(()),
        other => Err(format!("the plain client's message was not stored: {other:?}").into()),
    }
}

/// Prints the plain client's rounds beside walbox's exchange contender.
pub fn print(plain: Option<&PlainAmqp>, walbox_seconds: Option<f64>) {
    let Some(p) = plain else {
        return;
    };
    let s = p.seconds();
    println!();
    println!("### A plain AMQP client to the same exchange");
    println!();
    println!(
        "{} persistent mandatory messages of the backlog's shape on one confirm-mode \
         channel, {WINDOW} awaiting their confirm at once (lapin, as walbox), to a durable \
         queue bound to the exchange; {} rounds, median with the lowest and highest.",
        p.events, s.n
    );
    println!();
    println!("| client | seconds | events/s | walbox's rate of it |");
    println!("|---|---:|---:|---:|");
    println!(
        "| plain AMQP client, confirmed | {} | {:.0} | {} |",
        s.cell(2),
        p.events as f64 / s.median,
        walbox_seconds.map_or_else(|| "-".to_owned(), |w| format!("{:.2}", s.median / w))
    );
}
