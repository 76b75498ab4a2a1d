//! The event a mapped row becomes: key, topic, value, headers and its source
//! position, plus the names of the headers walbox sets.

use std::borrow::Cow;

use bytes::Bytes;
use walbox_pgoutput::{Lsn, Xid};

/// A header name: walbox's own names are static (no allocation per event); names
/// from a row's headers column are owned.
pub type HeaderName = Cow<'static, str>;

/// Names of the Kafka headers walbox sets on every event.
pub mod header {
    /// The event id.
    pub const EVENT_ID: &str = "event_id";
    /// The event type.
    pub const EVENT_TYPE: &str = "event_type";
    /// The schema version, when the row has one.
    pub const SCHEMA_VERSION: &str = "schema_version";
    /// The aggregate type, when the row has one.
    pub const AGGREGATE_TYPE: &str = "aggregate_type";
    /// Commit LSN of the source transaction (`X/Y`).
    pub const COMMIT_LSN: &str = "walbox_commit_lsn";
    /// Index of the event among the changes of its transaction.
    pub const INDEX: &str = "walbox_index";
    /// Transaction id of the source transaction.
    pub const XID: &str = "walbox_xid";
}

/// Where an event came from in the WAL.
///
/// Several messages of one transaction can share an LSN, so an event's identity in
/// the stream is `(commit_lsn, index)`, never an LSN alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    /// LSN of the transaction's commit record.
    pub commit_lsn: Lsn,
    /// Index of the event within its transaction, from 0.
    pub index: u32,
    /// Transaction id.
    pub xid: Xid,
}

/// An event ready for a sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The event id (stable across re-publication).
    pub event_id: String,
    /// Destination topic.
    pub topic: String,
    /// Partitioning key (the aggregate id), when the row has one.
    pub key: Option<Bytes>,
    /// The record value.
    pub value: Bytes,
    /// The value is JSON walbox built itself (the envelope, a dead letter), so a
    /// sink that embeds JSON need not check it.
    pub json_value: bool,
    /// Record headers in order.
    pub headers: Vec<(HeaderName, Bytes)>,
    /// Source position.
    pub position: Position,
}

impl Event {
    /// Bytes this event holds (key, value, headers), for in-flight accounting.
    #[must_use]
    pub fn size(&self) -> usize {
        self.key.as_ref().map_or(0, Bytes::len)
            + self.value.len()
            + self.topic.len()
            + self
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
    }
}
