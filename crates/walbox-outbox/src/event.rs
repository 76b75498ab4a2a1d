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

/// Which read of the source an event comes from. The position says where in
/// the WAL; the origin says how walbox came to it, which is what a sink needs
/// to name a copy (a snapshot's rows and a replay's events must not take the
/// ids of the stream's). A sink reads it from here, never from a transaction
/// id or from the record's headers.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum Origin {
    /// Read from the slot in commit order (`walbox run`): the event's position
    /// is its transaction's commit LSN and its index there, the same on every
    /// read of the WAL.
    #[default]
    Stream,
    /// A row of the snapshot taken at `point` (its consistent point): every row
    /// of it sits at `point`, index = the row's place in the snapshot. A
    /// snapshot taken again has another point.
    Snapshot {
        /// The snapshot's consistent point.
        point: Lsn,
    },
    /// A logical decoding message written outside any transaction: no commit
    /// order, its own unit at its LSN (index 0), which the commit of a
    /// transaction right after it can share as its commit LSN. It only ever
    /// reaches a sink as a dead letter.
    Message {
        /// Read by `walbox replay` of the range from this position (a
        /// replay's copy), or by the stream (`None`).
        replay: Option<Lsn>,
    },
    /// `walbox replay` of the range that starts at `from`: read from the WAL
    /// again, positions as the stream gave them.
    Replay {
        /// Where the replay starts (its name).
        from: Lsn,
    },
    /// `walbox dlq replay` of one dead letter, named by where the letter is
    /// (`dlq.<letters>.<offset>`); its position is the original event's.
    DeadLetterReplay {
        /// The letter's place.
        letter: std::sync::Arc<str>,
        /// The letter's event was a row of the snapshot taken at this point
        /// (its position is that snapshot's, outside commit order).
        snapshot: Option<Lsn>,
    },
}

impl Origin {
    /// The name of `walbox replay`'s run this event belongs to (its start
    /// position), if it is one: a destination that deduplicates stores it
    /// under an id of that replay's own (the crate `walbox-sink`'s rules). A
    /// dead-letter replay is not one: its event is published under its own
    /// id, so a run of it again after a kill is dropped.
    #[must_use]
    pub fn replay_name(&self) -> Option<String> {
        match self {
            Origin::Replay { from } | Origin::Message { replay: Some(from) } => {
                Some(from.to_string())
            }
            _ => None,
        }
    }

    /// Whether the position is outside commit order: a snapshot row (at its
    /// snapshot's point, also as a dead letter replayed) or a
    /// non-transactional message (at its own LSN). Such a position can share
    /// its LSN with a transaction's commit, so a sink that derives ids from
    /// positions keeps them apart.
    #[must_use]
    pub fn outside_commit_order(&self) -> bool {
        matches!(
            self,
            Origin::Snapshot { .. }
                | Origin::Message { .. }
                | Origin::DeadLetterReplay {
                    snapshot: Some(_),
                    ..
                }
        )
    }

    /// Whether the event is a snapshot's row (also as a dead letter
    /// replayed): its position is its snapshot's.
    #[must_use]
    pub fn snapshot_row(&self) -> bool {
        matches!(
            self,
            Origin::Snapshot { .. }
                | Origin::DeadLetterReplay {
                    snapshot: Some(_),
                    ..
                }
        )
    }

    /// Whether every read of the WAL gives this event the same position (a
    /// streamed or replayed event, or a dead letter of one replayed), so two
    /// copies of one event can be compared by position. A snapshot row's
    /// position is its snapshot's, another for a snapshot taken again.
    #[must_use]
    pub fn position_is_stable(&self) -> bool {
        !self.outside_commit_order()
    }

    /// A short stable text form (logs, a sink's own origin field).
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Origin::Stream => "stream",
            Origin::Snapshot { .. } => "snapshot",
            Origin::Message { .. } => "message",
            Origin::Replay { .. } => "replay",
            Origin::DeadLetterReplay { snapshot: None, .. } => "dlq_replay",
            Origin::DeadLetterReplay {
                snapshot: Some(_), ..
            } => "dlq_replay_snapshot",
        }
    }
}

/// An event ready for a sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The event id (stable across re-publication). A sink writes it into a
    /// field of its own (a message id, an entry field, a property) and reads
    /// it back from there, never from a format's header: where a format puts
    /// the id (`event_id`, `id`, `ce_id`, a structured CloudEvent's body) is
    /// for consumers.
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
    /// Which read of the source the event comes from.
    pub origin: Origin,
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
