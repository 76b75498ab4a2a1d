//! What an earlier run of a replay stored in a stream: the replay's progress
//! hash (`walbox:replay:<writer>:<name>`) records per stream its mark (the
//! highest position of an event it appended) and the first and last ids of
//! its copies. A run of the same replay again reads the copies back once per
//! session (every entry from the first id to the last that carries the
//! replay's name and this writer), so that an event at or below the mark
//! counts as already stored only when the stream holds its copy: the script
//! checks, in the call that writes, that the entry named still holds it.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use redis::Value;
use redis::aio::MultiplexedConnection;

use super::entry::{EVENT_ID_FIELD, REPLAY_FIELD, WRITER_FIELD, position_of};
use super::reader::entries;

/// Entries read per round trip.
const PAGE: usize = 1_000;

/// A replay's record of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Progress {
    /// The highest position of an event the replay appended.
    pub mark: (u64, u32),
    /// The first id of its copies (`0-0` when an earlier form did not say).
    pub first: String,
    /// The last id of its copies.
    pub last: String,
}

/// Reads a progress hash's value: `<mark> <first> <last>`, or the earlier
/// form `<position> <copy id> <event id>` (its copy the last, the first
/// unknown).
pub(crate) fn parse_progress(v: &str) -> Option<Progress> {
    let mut parts = v.splitn(3, ' ');
    let (mark, second, third) = (parts.next()?, parts.next()?, parts.next()?);
    let mark = position_of(mark)?;
    position_of(second)?;
    let (first, last) = if position_of(third).is_some() {
        (second.to_owned(), third.to_owned())
    } else {
        ("0-0".to_owned(), second.to_owned())
    };
    Some(Progress { mark, first, last })
}

/// What a session knows of a replay's copies in one stream.
#[derive(Debug, Default)]
pub(crate) struct Copies {
    /// The replay's record of the stream; none: nothing appended there.
    pub progress: Option<Progress>,
    /// The entry holding each copy, by digest of its event id; read on the
    /// first event at or below the mark.
    pub held: Option<HashMap<u64, String>>,
}

impl Copies {
    /// The entry that held `event_id`'s copy when it was read (the script
    /// checks it still does).
    pub fn entry_of(&self, event_id: &str) -> Option<&String> {
        self.held.as_ref()?.get(&digest(event_id))
    }
}

/// A digest of an event id: two ids sharing one only cost an event stored
/// again (the script finds the other event in the entry named).
fn digest(event_id: &str) -> u64 {
    let mut h = DefaultHasher::new();
    event_id.hash(&mut h);
    h.finish()
}

/// The replay's record of `stream` in hash `progress`.
pub(crate) async fn progress(
    con: &mut MultiplexedConnection,
    progress: &str,
    stream: &str,
) -> redis::RedisResult<Option<Progress>> {
    let v: Option<String> = redis::cmd("HGET")
        .arg(progress)
        .arg(stream)
        .query_async(con)
        .await?;
    Ok(v.as_deref().and_then(parse_progress))
}

/// The copies replay `name` of `writer` appended to `stream` between the
/// ids `p` records: the entry of each, by digest of its event id.
pub(crate) async fn read_copies(
    con: &mut MultiplexedConnection,
    stream: &str,
    p: &Progress,
    writer: &str,
    name: &str,
) -> redis::RedisResult<HashMap<u64, String>> {
    let mut held = HashMap::new();
    let mut start = p.first.clone();
    let mut offset = 0i64;
    loop {
        let page: redis::RedisResult<Value> = redis::cmd("XRANGE")
            .arg(stream)
            .arg(&start)
            .arg(&p.last)
            .arg("COUNT")
            .arg(PAGE)
            .query_async(con)
            .await;
        let page = match page {
            Ok(v) => v,
            // A key of another type holds no copy (the script refuses the
            // entry).
            Err(e) if e.code() == Some("WRONGTYPE") => return Ok(held),
            Err(e) => return Err(e),
        };
        let got = entries(&page, &mut offset);
        for e in &got {
            if e.field(REPLAY_FIELD) == Some(name.as_bytes())
                && e.field(WRITER_FIELD) == Some(writer.as_bytes())
                && let Some(id) = e.field(EVENT_ID_FIELD)
            {
                held.insert(digest(&String::from_utf8_lossy(id)), e.id.clone());
            }
        }
        match got.last() {
            Some(last) if got.len() == PAGE => start = format!("({}", last.id),
            _ => return Ok(held),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_reads_both_forms() {
        assert_eq!(
            parse_progress("300-0 301-0 301-2"),
            Some(Progress {
                mark: (300, 0),
                first: "301-0".into(),
                last: "301-2".into(),
            })
        );
        // The earlier form: position, its copy's id, its event id.
        assert_eq!(
            parse_progress("300-0 301-2 a b c"),
            Some(Progress {
                mark: (300, 0),
                first: "0-0".into(),
                last: "301-2".into(),
            })
        );
        assert_eq!(parse_progress("garbage"), None);
        assert_eq!(parse_progress("300-0 x y"), None);
    }
}
