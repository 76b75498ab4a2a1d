//! The messages pgoutput sends, as Rust values.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::Lsn;

/// Object identifier of a relation or type.
pub type Oid = u32;
/// Transaction id.
pub type Xid = u32;

/// Microseconds between the Unix epoch and PostgreSQL's epoch (2000-01-01 00:00 UTC).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// A server timestamp: microseconds since 2000-01-01 00:00:00 UTC.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PgTimestamp(pub i64);

impl PgTimestamp {
    /// Microseconds since the Unix epoch.
    #[must_use]
    pub const fn unix_micros(self) -> i64 {
        self.0.saturating_add(PG_EPOCH_OFFSET_MICROS)
    }

    /// The same instant as a [`SystemTime`].
    #[must_use]
    pub fn to_system_time(self) -> SystemTime {
        let micros = self.unix_micros();
        if micros >= 0 {
            UNIX_EPOCH + Duration::from_micros(micros.unsigned_abs())
        } else {
            UNIX_EPOCH - Duration::from_micros(micros.unsigned_abs())
        }
    }

    /// The instant given as microseconds since the Unix epoch.
    #[must_use]
    pub const fn from_unix_micros(micros: i64) -> Self {
        PgTimestamp(micros.saturating_sub(PG_EPOCH_OFFSET_MICROS))
    }
}

/// One decoded pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogicalMessage {
    /// `B`: a transaction starts.
    Begin(Begin),
    /// `C`: the transaction started by the last [`Begin`] committed.
    Commit(Commit),
    /// `O`: the transaction came from another node through replication origin `name`.
    Origin(Origin),
    /// `R`: the shape of a table; sent before the first change to it in a session and
    /// again after it changes.
    Relation(Relation),
    /// `Y`: a non-built-in data type used by a following Relation.
    Type(TypeMessage),
    /// `I`: a row was inserted.
    Insert(Insert),
    /// `U`: a row was updated.
    Update(Update),
    /// `D`: a row was deleted.
    Delete(Delete),
    /// `T`: tables were truncated.
    Truncate(Truncate),
    /// `M`: a message written with `pg_logical_emit_message`.
    Message(DecodingMessage),
    /// `S`: the following changes belong to the in-progress transaction `xid`
    /// (protocol 2 and later).
    StreamStart(StreamStart),
    /// `E`: the current block of streamed changes ends.
    StreamStop,
    /// `c`: a streamed transaction committed.
    StreamCommit(StreamCommit),
    /// `A`: a streamed (sub)transaction aborted.
    StreamAbort(StreamAbort),
    /// `b`: a prepared (two-phase) transaction starts (protocol 3 and later).
    BeginPrepare(BeginPrepare),
    /// `P`: the transaction started by Begin Prepare was prepared.
    Prepare(Prepare),
    /// `K`: a prepared transaction was committed.
    CommitPrepared(CommitPrepared),
    /// `r`: a prepared transaction was rolled back.
    RollbackPrepared(RollbackPrepared),
    /// `p`: a streamed transaction was prepared.
    StreamPrepare(Prepare),
}

impl LogicalMessage {
    /// The tag byte this message has on the wire.
    #[must_use]
    pub fn tag(&self) -> u8 {
        match self {
            Self::Begin(_) => b'B',
            Self::Commit(_) => b'C',
            Self::Origin(_) => b'O',
            Self::Relation(_) => b'R',
            Self::Type(_) => b'Y',
            Self::Insert(_) => b'I',
            Self::Update(_) => b'U',
            Self::Delete(_) => b'D',
            Self::Truncate(_) => b'T',
            Self::Message(_) => b'M',
            Self::StreamStart(_) => b'S',
            Self::StreamStop => b'E',
            Self::StreamCommit(_) => b'c',
            Self::StreamAbort(_) => b'A',
            Self::BeginPrepare(_) => b'b',
            Self::Prepare(_) => b'P',
            Self::CommitPrepared(_) => b'K',
            Self::RollbackPrepared(_) => b'r',
            Self::StreamPrepare(_) => b'p',
        }
    }
}

/// `B`: start of a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Begin {
    /// LSN of the transaction's commit record.
    pub final_lsn: Lsn,
    /// Commit time.
    pub timestamp: PgTimestamp,
    /// Transaction id.
    pub xid: Xid,
}

/// `C`: end of a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    /// Flags; currently always zero.
    pub flags: u8,
    /// LSN of the commit record.
    pub commit_lsn: Lsn,
    /// End of the commit record: the position a client confirms once it has the
    /// whole transaction.
    pub end_lsn: Lsn,
    /// Commit time.
    pub timestamp: PgTimestamp,
}

/// `O`: the replication origin of the current transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// Commit LSN on the origin server.
    pub commit_lsn: Lsn,
    /// Origin name.
    pub name: String,
}

/// Replica identity setting of a table: which old values Update and Delete carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplicaIdentity {
    /// `d`: the primary key.
    Default,
    /// `n`: nothing.
    Nothing,
    /// `f`: all columns.
    Full,
    /// `i`: the columns of a chosen unique index.
    Index,
}

impl ReplicaIdentity {
    /// The setting's byte on the wire.
    #[must_use]
    pub fn as_byte(self) -> u8 {
        match self {
            Self::Default => b'd',
            Self::Nothing => b'n',
            Self::Full => b'f',
            Self::Index => b'i',
        }
    }
}

/// `R`: a table's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// Transaction id, present for messages inside a streamed block.
    pub xid: Option<Xid>,
    /// Table OID; changes refer to the table by it.
    pub oid: Oid,
    /// Schema name (`pg_catalog` is sent as an empty string).
    pub namespace: String,
    /// Table name.
    pub name: String,
    /// Replica identity setting.
    pub replica_identity: ReplicaIdentity,
    /// Published columns in order.
    pub columns: Vec<RelationColumn>,
}

/// One column of a [`Relation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationColumn {
    /// Flags; bit 1 marks a column of the replica identity key.
    pub flags: u8,
    /// Column name.
    pub name: String,
    /// OID of the column's data type.
    pub type_oid: Oid,
    /// Type modifier (`atttypmod`), -1 when none.
    pub type_modifier: i32,
}

impl RelationColumn {
    /// Whether the column is part of the replica identity key.
    #[must_use]
    pub fn is_key(&self) -> bool {
        self.flags & 1 != 0
    }
}

/// `Y`: a data type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeMessage {
    /// Transaction id, present for messages inside a streamed block.
    pub xid: Option<Xid>,
    /// Type OID.
    pub oid: Oid,
    /// Schema name (`pg_catalog` is sent as an empty string).
    pub namespace: String,
    /// Type name.
    pub name: String,
}

/// One column value of a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TupleValue {
    /// `n`: SQL NULL.
    Null,
    /// `u`: a TOASTed value that did not change; the server does not send it.
    UnchangedToast,
    /// `t`: the value in the type's text output format.
    Text(Bytes),
    /// `b`: the value in the type's binary send format.
    Binary(Bytes),
}

impl TupleValue {
    /// The value's bytes, when it has any.
    #[must_use]
    pub fn bytes(&self) -> Option<&Bytes> {
        match self {
            Self::Text(b) | Self::Binary(b) => Some(b),
            Self::Null | Self::UnchangedToast => None,
        }
    }

    /// The value as text, when it was sent as valid UTF-8 text.
    #[must_use]
    pub fn as_text(&self) -> Option<&str> {
        match self {
            Self::Text(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }
}

/// A row: one value per published column, in [`Relation`] order.
pub type Tuple = Vec<TupleValue>;

/// Which old values an Update or Delete carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OldTupleKind {
    /// `K`: the replica identity key columns (others are null).
    Key,
    /// `O`: the whole old row (replica identity full).
    Full,
}

/// The old row sent with an Update or Delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OldTuple {
    /// Key only, or the whole row.
    pub kind: OldTupleKind,
    /// The values.
    pub tuple: Tuple,
}

/// `I`: an inserted row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    /// Transaction id, present for messages inside a streamed block.
    pub xid: Option<Xid>,
    /// OID of the table, as announced by a [`Relation`].
    pub relation_oid: Oid,
    /// The new row.
    pub new: Tuple,
}

/// `U`: an updated row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    /// Transaction id, present for messages inside a streamed block.
    pub xid: Option<Xid>,
    /// OID of the table.
    pub relation_oid: Oid,
    /// The old key or row, when the replica identity makes the server send it.
    pub old: Option<OldTuple>,
    /// The new row.
    pub new: Tuple,
}

/// `D`: a deleted row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    /// Transaction id, present for messages inside a streamed block.
    pub xid: Option<Xid>,
    /// OID of the table.
    pub relation_oid: Oid,
    /// The old key or row.
    pub old: OldTuple,
}

/// `T`: truncated tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    /// Transaction id, present for messages inside a streamed block.
    pub xid: Option<Xid>,
    /// Option bits: 1 = `CASCADE`, 2 = `RESTART IDENTITY`.
    pub options: u8,
    /// OIDs of the truncated tables.
    pub relation_oids: Vec<Oid>,
}

impl Truncate {
    /// Whether `TRUNCATE ... CASCADE` was used.
    #[must_use]
    pub fn cascade(&self) -> bool {
        self.options & 1 != 0
    }

    /// Whether `TRUNCATE ... RESTART IDENTITY` was used.
    #[must_use]
    pub fn restart_identity(&self) -> bool {
        self.options & 2 != 0
    }
}

/// `M`: a logical decoding message (`pg_logical_emit_message`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodingMessage {
    /// Transaction id, present for messages inside a streamed block.
    pub xid: Option<Xid>,
    /// Flags; bit 1 marks a transactional message.
    pub flags: u8,
    /// LSN of the message.
    pub lsn: Lsn,
    /// The prefix given by the writer.
    pub prefix: String,
    /// The content.
    pub content: Bytes,
}

impl DecodingMessage {
    /// Whether the message belongs to a transaction (and so arrives with it).
    #[must_use]
    pub fn transactional(&self) -> bool {
        self.flags & 1 != 0
    }
}

/// `S`: start of a block of changes of an in-progress transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamStart {
    /// The streamed transaction.
    pub xid: Xid,
    /// Whether this is the first block of that transaction.
    pub first_segment: bool,
}

/// `c`: a streamed transaction committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamCommit {
    /// The transaction.
    pub xid: Xid,
    /// Flags; currently always zero.
    pub flags: u8,
    /// LSN of the commit record.
    pub commit_lsn: Lsn,
    /// End of the commit record.
    pub end_lsn: Lsn,
    /// Commit time.
    pub timestamp: PgTimestamp,
}

/// `A`: a streamed transaction or subtransaction aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamAbort {
    /// The top-level transaction.
    pub xid: Xid,
    /// The aborted subtransaction (equal to `xid` when the whole transaction aborted).
    pub subxid: Xid,
    /// Abort LSN and time; sent only with protocol 4 when streaming is `parallel`.
    pub abort: Option<(Lsn, PgTimestamp)>,
}

/// `b`: start of a prepared transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BeginPrepare {
    /// LSN of the prepare record.
    pub prepare_lsn: Lsn,
    /// End of the prepared transaction.
    pub end_lsn: Lsn,
    /// Prepare time.
    pub timestamp: PgTimestamp,
    /// Transaction id.
    pub xid: Xid,
    /// Global transaction identifier given to `PREPARE TRANSACTION`.
    pub gid: String,
}

/// `P` and `p`: a transaction was prepared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepare {
    /// Flags; currently always zero.
    pub flags: u8,
    /// LSN of the prepare record.
    pub prepare_lsn: Lsn,
    /// End of the prepared transaction.
    pub end_lsn: Lsn,
    /// Prepare time.
    pub timestamp: PgTimestamp,
    /// Transaction id.
    pub xid: Xid,
    /// Global transaction identifier.
    pub gid: String,
}

/// `K`: a prepared transaction was committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitPrepared {
    /// Flags; currently always zero.
    pub flags: u8,
    /// LSN of the commit-prepared record.
    pub commit_lsn: Lsn,
    /// End of the commit-prepared record.
    pub end_lsn: Lsn,
    /// Commit time.
    pub timestamp: PgTimestamp,
    /// Transaction id.
    pub xid: Xid,
    /// Global transaction identifier.
    pub gid: String,
}

/// `r`: a prepared transaction was rolled back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RollbackPrepared {
    /// Flags; currently always zero.
    pub flags: u8,
    /// End of the prepared transaction.
    pub prepare_end_lsn: Lsn,
    /// End of the rollback-prepared record.
    pub rollback_end_lsn: Lsn,
    /// Prepare time.
    pub prepare_timestamp: PgTimestamp,
    /// Rollback time.
    pub rollback_timestamp: PgTimestamp,
    /// Transaction id.
    pub xid: Xid,
    /// Global transaction identifier.
    pub gid: String,
}
