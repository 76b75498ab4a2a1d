//! Bytes to [`LogicalMessage`].

use bytes::Bytes;

use crate::Lsn;
use crate::error::{DecodeError, DecodeErrorKind};
use crate::message::*;
use crate::reader::Reader;

/// Decodes one pgoutput message (the payload of one XLogData).
///
/// `in_stream` says whether the message arrived between Stream Start and Stream
/// Stop: inside such a block, Relation, Type, Insert, Update, Delete, Truncate and
/// Message carry the transaction id first. Use [`Decoder`] to have that tracked.
///
/// Total: any input gives a message or a [`DecodeError`]; the whole input must be
/// one message. Column values and message contents are views into `buf`, not copies.
pub fn decode(buf: &Bytes, in_stream: bool) -> Result<LogicalMessage, DecodeError> {
    let mut r = Reader::new(buf);
    if buf.is_empty() {
        return Err(r.error("tag", DecodeErrorKind::Empty));
    }
    let tag = r.u8("tag")?;
    r.set_tag(tag);
    let streamed_xid = |r: &mut Reader<'_>| -> Result<Option<Xid>, DecodeError> {
        if in_stream {
            Ok(Some(r.u32("xid")?))
        } else {
            Ok(None)
        }
    };
    let msg = match tag {
        b'B' => LogicalMessage::Begin(Begin {
            final_lsn: lsn(&mut r, "final_lsn")?,
            timestamp: ts(&mut r, "timestamp")?,
            xid: r.u32("xid")?,
        }),
        b'C' => LogicalMessage::Commit(Commit {
            flags: r.u8("flags")?,
            commit_lsn: lsn(&mut r, "commit_lsn")?,
            end_lsn: lsn(&mut r, "end_lsn")?,
            timestamp: ts(&mut r, "timestamp")?,
        }),
        b'O' => LogicalMessage::Origin(Origin {
            commit_lsn: lsn(&mut r, "commit_lsn")?,
            name: r.string("name")?,
        }),
        b'R' => {
            let xid = streamed_xid(&mut r)?;
            let oid = r.u32("oid")?;
            let namespace = r.string("namespace")?;
            let name = r.string("name")?;
            let replica_identity = replica_identity(&mut r)?;
            let count = r.count16("column count")?;
            // flags (1) + name (at least its NUL, 1) + type oid (4) + typmod (4)
            let mut columns = Vec::with_capacity(r.capacity_for(count, 10));
            for _ in 0..count {
                columns.push(RelationColumn {
                    flags: r.u8("column flags")?,
                    name: r.string("column name")?,
                    type_oid: r.u32("column type oid")?,
                    type_modifier: r.i32("column type modifier")?,
                });
            }
            LogicalMessage::Relation(Relation {
                xid,
                oid,
                namespace,
                name,
                replica_identity,
                columns,
            })
        }
        b'Y' => LogicalMessage::Type(TypeMessage {
            xid: streamed_xid(&mut r)?,
            oid: r.u32("oid")?,
            namespace: r.string("namespace")?,
            name: r.string("name")?,
        }),
        b'I' => {
            let xid = streamed_xid(&mut r)?;
            let relation_oid = r.u32("relation oid")?;
            one_of(&mut r, "new tuple marker", b"N", "'N'")?;
            LogicalMessage::Insert(Insert {
                xid,
                relation_oid,
                new: tuple(&mut r)?,
            })
        }
        b'U' => {
            let xid = streamed_xid(&mut r)?;
            let relation_oid = r.u32("relation oid")?;
            let marker = one_of(&mut r, "tuple marker", b"KON", "'K', 'O' or 'N'")?;
            let old = match marker {
                b'N' => None,
                _ => {
                    let old = old_tuple(&mut r, marker)?;
                    one_of(&mut r, "new tuple marker", b"N", "'N'")?;
                    Some(old)
                }
            };
            LogicalMessage::Update(Update {
                xid,
                relation_oid,
                old,
                new: tuple(&mut r)?,
            })
        }
        b'D' => {
            let xid = streamed_xid(&mut r)?;
            let relation_oid = r.u32("relation oid")?;
            let marker = one_of(&mut r, "old tuple marker", b"KO", "'K' or 'O'")?;
            LogicalMessage::Delete(Delete {
                xid,
                relation_oid,
                old: old_tuple(&mut r, marker)?,
            })
        }
        b'T' => {
            let xid = streamed_xid(&mut r)?;
            let count = r.count32("relation count")?;
            let options = r.u8("options")?;
            let mut relation_oids = Vec::with_capacity(r.capacity_for(count, 4));
            for _ in 0..count {
                relation_oids.push(r.u32("relation oid")?);
            }
            LogicalMessage::Truncate(Truncate {
                xid,
                options,
                relation_oids,
            })
        }
        b'M' => {
            let xid = streamed_xid(&mut r)?;
            let flags = r.u8("flags")?;
            let lsn = lsn(&mut r, "lsn")?;
            let prefix = r.string("prefix")?;
            let len = r.count32("content length")?;
            LogicalMessage::Message(DecodingMessage {
                xid,
                flags,
                lsn,
                prefix,
                content: r.bytes("content", len)?,
            })
        }
        b'S' => LogicalMessage::StreamStart(StreamStart {
            xid: r.u32("xid")?,
            first_segment: boolean(&mut r, "first segment")?,
        }),
        b'E' => LogicalMessage::StreamStop,
        b'c' => LogicalMessage::StreamCommit(StreamCommit {
            xid: r.u32("xid")?,
            flags: r.u8("flags")?,
            commit_lsn: lsn(&mut r, "commit_lsn")?,
            end_lsn: lsn(&mut r, "end_lsn")?,
            timestamp: ts(&mut r, "timestamp")?,
        }),
        b'A' => {
            let xid = r.u32("xid")?;
            let subxid = r.u32("subxid")?;
            // Protocol 4 with parallel streaming appends the abort LSN and time.
            let abort = if r.remaining() == 0 {
                None
            } else {
                Some((lsn(&mut r, "abort_lsn")?, ts(&mut r, "abort timestamp")?))
            };
            LogicalMessage::StreamAbort(StreamAbort { xid, subxid, abort })
        }
        b'b' => LogicalMessage::BeginPrepare(BeginPrepare {
            prepare_lsn: lsn(&mut r, "prepare_lsn")?,
            end_lsn: lsn(&mut r, "end_lsn")?,
            timestamp: ts(&mut r, "timestamp")?,
            xid: r.u32("xid")?,
            gid: r.string("gid")?,
        }),
        b'P' | b'p' => {
            let prepare = Prepare {
                flags: r.u8("flags")?,
                prepare_lsn: lsn(&mut r, "prepare_lsn")?,
                end_lsn: lsn(&mut r, "end_lsn")?,
                timestamp: ts(&mut r, "timestamp")?,
                xid: r.u32("xid")?,
                gid: r.string("gid")?,
            };
            if tag == b'P' {
                LogicalMessage::Prepare(prepare)
            } else {
                LogicalMessage::StreamPrepare(prepare)
            }
        }
        b'K' => LogicalMessage::CommitPrepared(CommitPrepared {
            flags: r.u8("flags")?,
            commit_lsn: lsn(&mut r, "commit_lsn")?,
            end_lsn: lsn(&mut r, "end_lsn")?,
            timestamp: ts(&mut r, "timestamp")?,
            xid: r.u32("xid")?,
            gid: r.string("gid")?,
        }),
        b'r' => LogicalMessage::RollbackPrepared(RollbackPrepared {
            flags: r.u8("flags")?,
            prepare_end_lsn: lsn(&mut r, "prepare_end_lsn")?,
            rollback_end_lsn: lsn(&mut r, "rollback_end_lsn")?,
            prepare_timestamp: ts(&mut r, "prepare timestamp")?,
            rollback_timestamp: ts(&mut r, "rollback timestamp")?,
            xid: r.u32("xid")?,
            gid: r.string("gid")?,
        }),
        other => {
            return Err(r.error_at("tag", 0, DecodeErrorKind::UnknownTag(other)));
        }
    };
    r.finish()?;
    Ok(msg)
}

/// Decodes a sequence of messages, tracking Stream Start / Stream Stop so that
/// messages inside a streamed block are read with their transaction id.
#[derive(Debug, Default, Clone)]
pub struct Decoder {
    in_stream: bool,
}

impl Decoder {
    /// A decoder outside any streamed block.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the decoder is between Stream Start and Stream Stop.
    #[must_use]
    pub fn in_stream(&self) -> bool {
        self.in_stream
    }

    /// Decodes the next message of the stream.
    pub fn decode(&mut self, buf: &Bytes) -> Result<LogicalMessage, DecodeError> {
        let msg = decode(buf, self.in_stream)?;
        match msg {
            LogicalMessage::StreamStart(_) => self.in_stream = true,
            LogicalMessage::StreamStop => self.in_stream = false,
            _ => {}
        }
        Ok(msg)
    }
}

fn lsn(r: &mut Reader<'_>, field: &'static str) -> Result<Lsn, DecodeError> {
    Ok(Lsn(r.u64(field)?))
}

fn ts(r: &mut Reader<'_>, field: &'static str) -> Result<PgTimestamp, DecodeError> {
    Ok(PgTimestamp(r.i64(field)?))
}

fn boolean(r: &mut Reader<'_>, field: &'static str) -> Result<bool, DecodeError> {
    Ok(one_of(r, field, &[0, 1], "0 or 1")? == 1)
}

/// Reads one byte and fails unless it is one of `allowed`.
fn one_of(
    r: &mut Reader<'_>,
    field: &'static str,
    allowed: &[u8],
    expected: &'static str,
) -> Result<u8, DecodeError> {
    let at = r.offset();
    let found = r.u8(field)?;
    if allowed.contains(&found) {
        Ok(found)
    } else {
        Err(r.error_at(
            field,
            at,
            DecodeErrorKind::UnexpectedByte { found, expected },
        ))
    }
}

fn replica_identity(r: &mut Reader<'_>) -> Result<ReplicaIdentity, DecodeError> {
    let byte = one_of(r, "replica identity", b"dnfi", "'d', 'n', 'f' or 'i'")?;
    Ok(match byte {
        b'd' => ReplicaIdentity::Default,
        b'n' => ReplicaIdentity::Nothing,
        b'f' => ReplicaIdentity::Full,
        _ => ReplicaIdentity::Index,
    })
}

fn old_tuple(r: &mut Reader<'_>, marker: u8) -> Result<OldTuple, DecodeError> {
    let kind = if marker == b'K' {
        OldTupleKind::Key
    } else {
        OldTupleKind::Full
    };
    Ok(OldTuple {
        kind,
        tuple: tuple(r)?,
    })
}

fn tuple(r: &mut Reader<'_>) -> Result<Tuple, DecodeError> {
    let count = r.count16("tuple column count")?;
    let mut values = Vec::with_capacity(r.capacity_for(count, 1));
    for _ in 0..count {
        let at = r.offset();
        let value = match r.u8("column kind")? {
            b'n' => TupleValue::Null,
            b'u' => TupleValue::UnchangedToast,
            b't' => {
                let len = r.count32("column length")?;
                TupleValue::Text(r.bytes("column value", len)?)
            }
            b'b' => {
                let len = r.count32("column length")?;
                TupleValue::Binary(r.bytes("column value", len)?)
            }
            found => {
                return Err(r.error_at(
                    "column kind",
                    at,
                    DecodeErrorKind::UnexpectedByte {
                        found,
                        expected: "'n', 'u', 't' or 'b'",
                    },
                ));
            }
        };
        values.push(value);
    }
    Ok(values)
}
