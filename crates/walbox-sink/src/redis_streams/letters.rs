//! Dead letters read for `walbox dlq replay` through a consumer group of the
//! dead-letter stream, which keeps the progress: a letter is acknowledged
//! (XACK) once replayed; one that still fails stays pending and is read
//! again, before any new one, by the next run.
//!
//! A pending letter whose entry the stream no longer holds (deleted, or
//! trimmed by hand: walbox never trims a stream of dead letters) comes back
//! from the group as an id without fields: it is named
//! ([`StreamLetters::gone`]), never passed over, and stays pending.

use std::time::Duration;

use redis::Value;
use redis::aio::MultiplexedConnection;

use super::reader::{StreamEntry, entries};
use super::{RedisSinkConfig, connect, error_text};
use crate::{RecordView, SinkError};

/// The consumer within the group.
const CONSUMER: &str = "walbox";

/// The letters one run read from a dead-letter stream.
pub struct StreamLetters {
    con: MultiplexedConnection,
    stream: String,
    group: String,
    entries: Vec<StreamEntry>,
    gone: Vec<String>,
}

impl std::fmt::Debug for StreamLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamLetters")
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("entries", &self.entries.len())
            .field("gone", &self.gone.len())
            .finish_non_exhaustive()
    }
}

impl StreamLetters {
    /// Reads every letter of `stream` the group `group` has not acknowledged:
    /// those read before and left pending, then the new ones. `None` when the
    /// stream does not exist (nothing was dead-lettered there).
    pub async fn read(
        config: &RedisSinkConfig,
        stream: &str,
        group: &str,
        timeout: Duration,
    ) -> Result<Option<Self>, SinkError> {
        let fail = |reason: String| SinkError::Read {
            topic: stream.to_owned(),
            reason,
        };
        let mut con = tokio::time::timeout(timeout, connect(config))
            .await
            .map_err(|_| fail("no connection within the timeout".into()))??;
        let exists: i64 = redis::cmd("EXISTS")
            .arg(stream)
            .query_async(&mut con)
            .await
            .map_err(|e| fail(error_text(&e)))?;
        if exists == 0 {
            return Ok(None);
        }
        let created: redis::RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg(group)
            .arg("0")
            .query_async(&mut con)
            .await;
        if let Err(e) = created
            && e.code() != Some("BUSYGROUP")
        {
            return Err(fail(error_text(&e)));
        }
        let mut all = Vec::new();
        let mut gone = Vec::new();
        let mut offset = 0i64;
        // Pending letters first (from id 0 on), then new ones (`>`).
        let mut from = "0".to_owned();
        loop {
            let reply: Value = tokio::time::timeout(
                timeout,
                redis::cmd("XREADGROUP")
                    .arg("GROUP")
                    .arg(group)
                    .arg(CONSUMER)
                    .arg("COUNT")
                    .arg(1_000)
                    .arg("STREAMS")
                    .arg(stream)
                    .arg(&from)
                    .query_async(&mut con),
            )
            .await
            .map_err(|_| fail("no answer within the timeout".into()))?
            .map_err(|e| fail(error_text(&e)))?;
            let part = stream_part(&reply);
            let (without_fields, last) = ids_without_fields(&part);
            // Paged by the last id the group handed back, with fields or
            // not: a page of gone letters never ends the pending ones.
            match (last, from.as_str()) {
                (None, ">") => break,
                (None, _) => from = ">".into(),
                (Some(last), f) if f != ">" => from = last,
                _ => {}
            }
            all.extend(entries(&part, &mut offset));
            gone.extend(without_fields);
        }
        Ok(Some(StreamLetters {
            con,
            stream: stream.to_owned(),
            group: group.to_owned(),
            entries: all,
            gone,
        }))
    }

    /// The ids of letters pending in the group whose entries the stream no
    /// longer holds (deleted or trimmed): nothing is left to replay them
    /// from. They stay pending, so every run names them again until they
    /// are acknowledged by hand (`XACK <stream> <group> <id>`).
    #[must_use]
    pub fn gone(&self) -> &[String] {
        &self.gone
    }

    /// Hands every letter read to `each`, in order.
    pub fn each(&self, mut each: impl FnMut(RecordView<'_>)) {
        for e in &self.entries {
            each(RecordView::redis(e));
        }
    }

    /// Acknowledges the letters `done` says are done (by offset); the others
    /// stay pending for the next run.
    pub async fn settle(mut self, done: impl Fn(i64) -> bool) -> Result<(), SinkError> {
        let ids: Vec<&str> = self
            .entries
            .iter()
            .filter(|e| done(e.offset))
            .map(|e| e.id.as_str())
            .collect();
        for chunk in ids.chunks(1_000) {
            let _: i64 = redis::cmd("XACK")
                .arg(&self.stream)
                .arg(&self.group)
                .arg(chunk)
                .query_async(&mut self.con)
                .await
                .map_err(|e| SinkError::Read {
                    topic: self.stream.clone(),
                    reason: error_text(&e),
                })?;
        }
        Ok(())
    }
}

/// The ids of the entries in an XREADGROUP reply's entries that come without
/// fields (pending, but deleted from the stream since), and the last id of
/// all.
fn ids_without_fields(v: &Value) -> (Vec<String>, Option<String>) {
    let Value::Array(items) = v else {
        return (Vec::new(), None);
    };
    let mut gone = Vec::new();
    let mut last = None;
    for item in items {
        let Value::Array(parts) = item else { continue };
        let id = match parts.first() {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) => s.clone(),
            _ => continue,
        };
        if !matches!(parts.get(1), Some(Value::Array(_))) {
            gone.push(id.clone());
        }
        last = Some(id);
    }
    (gone, last)
}

/// The entries of the one stream in an XREADGROUP reply (`[[name, entries]]`,
/// or a map of name to entries in RESP3; nil when there is nothing).
fn stream_part(v: &Value) -> Value {
    match v {
        Value::Array(streams) => match streams.first() {
            Some(Value::Array(pair)) => pair.get(1).cloned().unwrap_or(Value::Nil),
            _ => Value::Nil,
        },
        Value::Map(m) => m.first().map(|(_, e)| e.clone()).unwrap_or(Value::Nil),
        _ => Value::Nil,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn pending_entries_without_fields_are_named_and_count_for_paging() {
        // XREADGROUP hands back a pending entry deleted since as [id, nil].
        let page = Value::Array(vec![
            Value::Array(vec![bulk("1-0"), Value::Array(vec![bulk("a"), bulk("1")])]),
            Value::Array(vec![bulk("2-0"), Value::Nil]),
            Value::Array(vec![bulk("3-0"), Value::Nil]),
        ]);
        assert_eq!(
            ids_without_fields(&page),
            (
                vec!["2-0".to_owned(), "3-0".to_owned()],
                Some("3-0".to_owned())
            )
        );
        let mut offset = 0;
        let read = entries(&page, &mut offset);
        assert_eq!(read.len(), 1);
        assert_eq!(read[0].id, "1-0");
        assert_eq!(ids_without_fields(&Value::Nil), (Vec::new(), None));
    }
}
