//! Reading back what a stream holds, for audits (`walbox verify`) and
//! dead-letter replays: every entry from the start, in id order.

use std::time::Duration;

use redis::Value;

use super::{RedisSinkConfig, connect, error_text};
use crate::{RecordView, SinkError};

/// Entries fetched per round trip.
const PAGE: usize = 1_000;

/// One stream entry as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamEntry {
    /// Its id.
    pub id: String,
    /// Its place in what was read, from 0.
    pub offset: i64,
    /// Its fields, in order.
    pub fields: Vec<(String, Vec<u8>)>,
}

impl StreamEntry {
    /// The first field called `name`.
    #[must_use]
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }
}

fn bytes(v: &Value) -> Vec<u8> {
    match v {
        Value::BulkString(b) => b.clone(),
        Value::SimpleString(s) => s.clone().into_bytes(),
        _ => Vec::new(),
    }
}

/// Parses an XRANGE reply.
pub(crate) fn entries(v: &Value, offset: &mut i64) -> Vec<StreamEntry> {
    let Value::Array(items) = v else {
        return Vec::new();
    };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let Value::Array(parts) = item else { continue };
        let (Some(id), Some(Value::Array(kv))) = (parts.first(), parts.get(1)) else {
            continue;
        };
        let fields = kv
            .chunks(2)
            .filter_map(|c| match c {
                [k, v] => Some((String::from_utf8_lossy(&bytes(k)).into_owned(), bytes(v))),
                _ => None,
            })
            .collect();
        out.push(StreamEntry {
            id: String::from_utf8_lossy(&bytes(id)).into_owned(),
            offset: *offset,
            fields,
        });
        *offset += 1;
    }
    out
}

/// Reads stream `key` from its first entry to its last, calling `each` for
/// every entry; returns how many were read (0 for a missing stream).
pub async fn read_stream(
    config: &RedisSinkConfig,
    key: &str,
    timeout: Duration,
    mut each: impl FnMut(RecordView<'_>),
) -> Result<u64, SinkError> {
    let fail = |reason: String| SinkError::Read {
        topic: key.to_owned(),
        reason,
    };
    let mut con = tokio::time::timeout(timeout, connect(config))
        .await
        .map_err(|_| fail("no connection within the timeout".into()))??;
    let mut start = "-".to_owned();
    let mut offset = 0i64;
    loop {
        let page: Value = tokio::time::timeout(
            timeout,
            redis::cmd("XRANGE")
                .arg(key)
                .arg(&start)
                .arg("+")
                .arg("COUNT")
                .arg(PAGE)
                .query_async(&mut con),
        )
        .await
        .map_err(|_| fail("no answer within the timeout".into()))?
        .map_err(|e| fail(error_text(&e)))?;
        let got = entries(&page, &mut offset);
        let Some(last) = got.last().map(|e| e.id.clone()) else {
            break;
        };
        let full = got.len() == PAGE;
        for e in &got {
            each(RecordView::redis(e));
        }
        if !full {
            break;
        }
        start = format!("({last}");
    }
    Ok(u64::try_from(offset).unwrap_or(u64::MAX))
}
