use std::io::Write;

use tokio::sync::mpsc;
use walbox_outbox::Event;

use crate::{Deliveries, Delivery, DeliveryError, Sink, SinkError};

/// Writes each event as one JSON line: `{"topic", "key", "headers", "value"}`.
///
/// The value is embedded as it is when it is JSON, else as a string. A writer
/// thread takes events as they come, writes every event waiting into a buffer,
/// flushes standard output once, then acknowledges them: one flush per batch
/// under load, one per event when events trickle in. An event is acknowledged
/// only after its line was flushed.
#[derive(Debug)]
pub struct StdoutSink {
    lines: std::sync::mpsc::Sender<(Event, usize)>,
}

impl StdoutSink {
    /// A sink and the receiver of its deliveries.
    #[must_use]
    pub fn new() -> (Self, Deliveries) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (lines, queue) = std::sync::mpsc::channel::<(Event, usize)>();
        std::thread::Builder::new()
            .name("walbox-stdout".into())
            .spawn(move || writer(&queue, &tx))
            .ok();
        (StdoutSink { lines }, rx)
    }
}

/// Most events written before a flush.
const BATCH: usize = 4096;

fn writer(
    queue: &std::sync::mpsc::Receiver<(Event, usize)>,
    acks: &mpsc::UnboundedSender<Delivery>,
) {
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(256 * 1024, stdout.lock());
    let mut batch: Vec<(String, String, usize)> = Vec::with_capacity(BATCH);
    while let Ok(first) = queue.recv() {
        let mut written = write_line(&mut out, &first.0);
        batch.push((first.0.event_id, first.0.topic, first.1));
        while batch.len() < BATCH {
            let Ok((event, token)) = queue.try_recv() else {
                break;
            };
            if written.is_ok() {
                written = write_line(&mut out, &event);
            }
            batch.push((event.event_id, event.topic, token));
        }
        let result = written.and_then(|()| out.flush());
        for (event_id, topic, token) in batch.drain(..) {
            let result = match &result {
                Ok(()) => Ok(()),
                Err(e) => Err(DeliveryError {
                    event_id,
                    topic,
                    class: "io_error",
                    reason: e.to_string(),
                    rejected: None,
                }),
            };
            if acks.send(Delivery { token, result }).is_err() {
                return;
            }
        }
    }
}

fn write_line(out: &mut impl Write, event: &Event) -> std::io::Result<()> {
    out.write_all(&json_line(event))
}

/// One event as a JSON line.
#[must_use]
pub fn json_line(event: &Event) -> Vec<u8> {
    let mut out = Vec::with_capacity(event.size() + 64);
    out.extend_from_slice(b"{\"topic\":");
    push_string(&mut out, &event.topic);
    out.extend_from_slice(b",\"key\":");
    match &event.key {
        Some(k) => push_string(&mut out, &String::from_utf8_lossy(k)),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b",\"headers\":{");
    for (i, (k, v)) in event.headers.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        push_string(&mut out, k);
        out.push(b':');
        push_string(&mut out, &String::from_utf8_lossy(v));
    }
    out.extend_from_slice(b"},\"value\":");
    // JSON values go in as they are (checked without building them); anything
    // else as a string.
    if serde_json::from_slice::<serde::de::IgnoredAny>(&event.value).is_ok() {
        out.extend_from_slice(event.value.trim_ascii());
    } else {
        push_string(&mut out, &String::from_utf8_lossy(&event.value));
    }
    out.extend_from_slice(b"}\n");
    out
}

fn push_string(out: &mut Vec<u8>, s: &str) {
    // serde_json escapes exactly as JSON requires; writing to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

impl Sink for StdoutSink {
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        self.lines
            .send((event, token))
            .map_err(|_| SinkError::Io(std::io::Error::other("the stdout writer stopped")))
    }

    async fn flush(&mut self, _timeout: std::time::Duration) -> Result<(), SinkError> {
        // Every event is flushed before it is acknowledged.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use walbox_outbox::Position;

    fn event(value: &[u8]) -> Event {
        Event {
            event_id: "e1".into(),
            topic: "outbox.order".into(),
            key: Some(Bytes::from_static(b"k\"1")),
            value: Bytes::copy_from_slice(value),
            headers: vec![("event_id".into(), Bytes::from_static(b"e1"))],
            position: Position {
                commit_lsn: walbox_pgoutput::Lsn(1),
                index: 0,
                xid: 7,
            },
        }
    }

    #[test]
    fn lines_are_json_with_the_value_embedded_when_it_is_json() {
        let line = json_line(&event(br#" {"a": [1, "x\u00e9"]} "#));
        let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(v["topic"], "outbox.order");
        assert_eq!(v["key"], "k\"1");
        assert_eq!(v["headers"]["event_id"], "e1");
        assert_eq!(v["value"]["a"][1], "x\u{e9}");
        assert_eq!(line.last(), Some(&b'\n'));
        let line = json_line(&event(b"not json \x01"));
        let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(v["value"], "not json \u{1}");
    }
}
