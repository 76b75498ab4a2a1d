//! The stdout sink: events as JSON lines, written and flushed in batches by a
//! thread of its own, each acknowledged after the flush that wrote it.

use std::io::Write;

use tokio::sync::mpsc;
use walbox_outbox::Event;

use crate::{Deliveries, Delivery, DeliveryClass, DeliveryError, Sink, SinkError};

/// Writes each event as one JSON line: `{"topic", "key", "headers", "value"}`.
///
/// The value is embedded as it is when it is JSON, else as a string. Events are
/// gathered on the caller's side and handed to a writer thread in batches (when
/// [`BATCH`] are waiting, and at [`Sink::end_batch`]); the thread writes each
/// batch, flushes standard output once, then acknowledges its events. An event is
/// acknowledged only after its line was flushed: handed to the pipe or file, not
/// read by anyone. The thread keeps slow output off the caller's thread, which
/// goes on answering the server meanwhile. When the reader of a pipe goes away
/// (EPIPE), the batch's deliveries fail as final ([`DeliveryError::is_final`]).
#[derive(Debug)]
pub struct StdoutSink {
    lines: std::sync::mpsc::Sender<Vec<(Event, usize)>>,
    pending: Vec<(Event, usize)>,
}

impl StdoutSink {
    /// A sink and the receiver of its deliveries.
    #[must_use]
    pub fn new() -> (Self, Deliveries) {
        Self::to_output(std::io::stdout())
    }

    /// The same sink writing to `output` instead of standard output.
    #[must_use]
    pub fn to_output(output: impl Write + Send + 'static) -> (Self, Deliveries) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (lines, queue) = std::sync::mpsc::channel::<Vec<(Event, usize)>>();
        std::thread::Builder::new()
            .name("walbox-stdout".into())
            .spawn(move || writer(output, &queue, &tx))
            .ok();
        (
            StdoutSink {
                lines,
                pending: Vec::with_capacity(BATCH),
            },
            rx,
        )
    }

    fn hand_on(&mut self) -> Result<(), SinkError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let batch = std::mem::replace(&mut self.pending, Vec::with_capacity(BATCH));
        self.lines
            .send(batch)
            .map_err(|_| SinkError::Io(std::io::Error::other("the stdout writer stopped")))
    }
}

/// Most events handed to the writer at once.
const BATCH: usize = 1024;

fn writer(
    output: impl Write,
    queue: &std::sync::mpsc::Receiver<Vec<(Event, usize)>>,
    acks: &mpsc::UnboundedSender<Delivery>,
) {
    let mut out = std::io::BufWriter::with_capacity(256 * 1024, output);
    while let Ok(mut batch) = queue.recv() {
        // Everything else waiting goes out with the same flush.
        while let Ok(more) = queue.try_recv() {
            batch.extend(more);
        }
        let mut written = Ok(());
        for (event, _) in &batch {
            written = write_line(&mut out, event);
            if written.is_err() {
                break;
            }
        }
        let result = written.and_then(|()| out.flush());
        for (event, token) in batch {
            let result = match &result {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(DeliveryError {
                    event_id: event.event_id,
                    topic: event.topic,
                    class: DeliveryClass::OutputClosed,
                    reason: format!(
                        "the reader of standard output closed it ({e}); nothing after the \
                         last line written is confirmed"
                    ),
                    rejected: None,
                }),
                Err(e) => Err(DeliveryError {
                    event_id: event.event_id,
                    topic: event.topic,
                    class: DeliveryClass::IoError,
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

/// Writes one event as a JSON line.
fn write_line(out: &mut impl Write, event: &Event) -> std::io::Result<()> {
    out.write_all(b"{\"topic\":")?;
    write_string(out, &event.topic)?;
    out.write_all(b",\"key\":")?;
    match &event.key {
        Some(k) => write_string(out, &String::from_utf8_lossy(k))?,
        None => out.write_all(b"null")?,
    }
    out.write_all(b",\"headers\":{")?;
    for (i, (k, v)) in event.headers.iter().enumerate() {
        if i > 0 {
            out.write_all(b",")?;
        }
        write_string(out, k)?;
        out.write_all(b":")?;
        write_string(out, &String::from_utf8_lossy(v))?;
    }
    out.write_all(b"},\"value\":")?;
    // JSON values go in as they are (checked without building them unless walbox
    // built them); anything else as a string.
    if event.json_value || serde_json::from_slice::<serde::de::IgnoredAny>(&event.value).is_ok() {
        out.write_all(event.value.trim_ascii())?;
    } else {
        write_string(out, &String::from_utf8_lossy(&event.value))?;
    }
    out.write_all(b"}\n")
}

/// One event as a JSON line.
#[cfg(test)]
fn json_line(event: &Event) -> Vec<u8> {
    let mut out = Vec::with_capacity(event.size() + 64);
    // Writing to a Vec cannot fail.
    let _ = write_line(&mut out, event);
    out
}

fn write_string(out: &mut impl Write, s: &str) -> std::io::Result<()> {
    // serde_json escapes exactly as JSON requires.
    serde_json::to_writer(out, s).map_err(std::io::Error::from)
}

impl Sink for StdoutSink {
    async fn send(&mut self, event: Event, token: usize) -> Result<(), SinkError> {
        self.pending.push((event, token));
        if self.pending.len() >= BATCH {
            self.hand_on()?;
        }
        Ok(())
    }

    fn end_batch(&mut self) {
        // A stopped writer shows as delivery reports that never come; the relay's
        // shutdown and flush timeouts report it.
        let _ = self.hand_on();
    }

    fn abort(&mut self) {
        self.pending.clear();
    }

    async fn flush(&mut self, _timeout: std::time::Duration) -> Result<(), SinkError> {
        // Every event is flushed before it is acknowledged; what is gathered goes
        // to the writer now.
        self.hand_on()
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
            json_value: false,
            headers: vec![("event_id".into(), Bytes::from_static(b"e1"))],
            position: Position {
                commit_lsn: walbox_pgoutput::Lsn(1),
                index: 0,
                xid: 7,
            },
            origin: walbox_outbox::Origin::Stream,
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

    /// An output whose reader is gone after `left` bytes.
    struct ClosedAfter {
        left: usize,
    }

    impl Write for ClosedAfter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.left == 0 {
                return Err(std::io::ErrorKind::BrokenPipe.into());
            }
            let n = buf.len().min(self.left);
            self.left -= n;
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_closed_pipe_fails_deliveries_for_good_and_acknowledges_only_what_was_written() {
        let left = json_line(&event(b"{}")).len();
        let (mut sink, mut deliveries) = StdoutSink::to_output(ClosedAfter { left });
        sink.send(event(b"{}"), 0).await.unwrap();
        sink.end_batch();
        let d = deliveries.recv().await.unwrap();
        assert!(d.result.is_ok(), "written before the reader left");
        for token in 1..3 {
            sink.send(event(b"{}"), token).await.unwrap();
        }
        sink.end_batch();
        for token in 1..3 {
            let d = deliveries.recv().await.unwrap();
            assert_eq!(d.token, token);
            let e = d.result.unwrap_err();
            assert!(e.is_final(), "{e}");
            assert!(!e.is_about_the_message());
            assert!(e.reason.contains("closed"), "{e}");
        }
        // Other write errors are not final.
        let e = DeliveryError {
            event_id: "e1".into(),
            topic: "t".into(),
            class: DeliveryClass::IoError,
            reason: String::new(),
            rejected: None,
        };
        assert!(!e.is_final());
    }

    #[tokio::test]
    async fn gathered_events_are_written_and_acknowledged_in_order_at_end_batch() {
        let (mut sink, mut deliveries) = StdoutSink::to_output(std::io::sink());
        for token in 0..3 {
            sink.send(event(b"{}"), token).await.unwrap();
        }
        assert_eq!(sink.pending.len(), 3, "held until the caller waits");
        sink.end_batch();
        assert!(sink.pending.is_empty());
        for token in 0..3 {
            let d = deliveries.recv().await.unwrap();
            assert_eq!(d.token, token);
            assert!(d.result.is_ok());
        }
        // A full batch goes on at once.
        for token in 0..BATCH {
            sink.send(event(b"{}"), token).await.unwrap();
        }
        assert!(sink.pending.is_empty());
        for token in 0..BATCH {
            assert_eq!(deliveries.recv().await.unwrap().token, token);
        }
    }
}
