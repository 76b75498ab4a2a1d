use std::io::Write;

use tokio::sync::mpsc;
use walbox_outbox::Event;

use crate::{Deliveries, Delivery, Sink, SinkError};

/// Writes each event as one JSON line: `{"topic", "key", "headers", "value"}`.
///
/// The value is embedded as JSON when it is JSON, else as a string. An event is
/// acknowledged once its line is written and standard output flushed.
#[derive(Debug)]
pub struct StdoutSink {
    deliveries: mpsc::UnboundedSender<Delivery>,
}

impl StdoutSink {
    /// A sink and the receiver of its deliveries.
    #[must_use]
    pub fn new() -> (Self, Deliveries) {
        let (tx, rx) = mpsc::unbounded_channel();
        (StdoutSink { deliveries: tx }, rx)
    }
}

/// One event as a JSON line.
#[must_use]
pub fn json_line(event: &Event) -> Vec<u8> {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let headers: serde_json::Map<String, serde_json::Value> = event
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::String(text(v))))
        .collect();
    let value = serde_json::from_slice::<serde_json::Value>(&event.value)
        .unwrap_or_else(|_| serde_json::Value::String(text(&event.value)));
    let line = serde_json::json!({
        "topic": event.topic,
        "key": event.key.as_deref().map(text),
        "headers": headers,
        "value": value,
    });
    let mut out = line.to_string().into_bytes();
    out.push(b'\n');
    out
}

impl Sink for StdoutSink {
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        let line = json_line(&event);
        let mut out = std::io::stdout().lock();
        out.write_all(&line)?;
        out.flush()?;
        let _ = self.deliveries.send(Delivery {
            token,
            result: Ok(()),
        });
        Ok(())
    }

    async fn flush(&mut self, _timeout: std::time::Duration) -> Result<(), SinkError> {
        std::io::stdout().lock().flush()?;
        Ok(())
    }
}
