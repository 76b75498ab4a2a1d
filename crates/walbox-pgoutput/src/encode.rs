//! [`LogicalMessage`] to bytes, exactly as pgoutput writes them.
//!
//! The inverse of [`decode`](crate::decode): used to build test streams and
//! benchmark input, and to check the decoder by round trip.

use bytes::{BufMut, BytesMut};

use crate::message::*;

/// Appends the wire form of `msg` to `out`.
///
/// Messages with an `xid: Some(_)` are written in the streamed form (transaction id
/// first), as pgoutput does between Stream Start and Stream Stop.
///
/// # Panics
/// When a count does not fit its wire field (more than 32767 columns, more than
/// 2^31-1 tables or bytes): pgoutput can never send such a message.
pub fn encode(msg: &LogicalMessage, out: &mut BytesMut) {
    out.put_u8(msg.tag());
    match msg {
        LogicalMessage::Begin(m) => {
            out.put_u64(m.final_lsn.0);
            out.put_i64(m.timestamp.0);
            out.put_u32(m.xid);
        }
        LogicalMessage::Commit(m) => {
            out.put_u8(m.flags);
            out.put_u64(m.commit_lsn.0);
            out.put_u64(m.end_lsn.0);
            out.put_i64(m.timestamp.0);
        }
        LogicalMessage::Origin(m) => {
            out.put_u64(m.commit_lsn.0);
            string(out, &m.name);
        }
        LogicalMessage::Relation(m) => {
            xid(out, m.xid);
            out.put_u32(m.oid);
            string(out, &m.namespace);
            string(out, &m.name);
            out.put_u8(m.replica_identity.as_byte());
            out.put_i16(i16::try_from(m.columns.len()).expect("column count fits Int16"));
            for c in &m.columns {
                out.put_u8(c.flags);
                string(out, &c.name);
                out.put_u32(c.type_oid);
                out.put_i32(c.type_modifier);
            }
        }
        LogicalMessage::Type(m) => {
            xid(out, m.xid);
            out.put_u32(m.oid);
            string(out, &m.namespace);
            string(out, &m.name);
        }
        LogicalMessage::Insert(m) => {
            xid(out, m.xid);
            out.put_u32(m.relation_oid);
            out.put_u8(b'N');
            tuple(out, &m.new);
        }
        LogicalMessage::Update(m) => {
            xid(out, m.xid);
            out.put_u32(m.relation_oid);
            if let Some(old) = &m.old {
                old_tuple(out, old);
            }
            out.put_u8(b'N');
            tuple(out, &m.new);
        }
        LogicalMessage::Delete(m) => {
            xid(out, m.xid);
            out.put_u32(m.relation_oid);
            old_tuple(out, &m.old);
        }
        LogicalMessage::Truncate(m) => {
            xid(out, m.xid);
            out.put_i32(len32(m.relation_oids.len()));
            out.put_u8(m.options);
            for oid in &m.relation_oids {
                out.put_u32(*oid);
            }
        }
        LogicalMessage::Message(m) => {
            xid(out, m.xid);
            out.put_u8(m.flags);
            out.put_u64(m.lsn.0);
            string(out, &m.prefix);
            out.put_i32(len32(m.content.len()));
            out.put_slice(&m.content);
        }
        LogicalMessage::StreamStart(m) => {
            out.put_u32(m.xid);
            out.put_u8(u8::from(m.first_segment));
        }
        LogicalMessage::StreamStop => {}
        LogicalMessage::StreamCommit(m) => {
            out.put_u32(m.xid);
            out.put_u8(m.flags);
            out.put_u64(m.commit_lsn.0);
            out.put_u64(m.end_lsn.0);
            out.put_i64(m.timestamp.0);
        }
        LogicalMessage::StreamAbort(m) => {
            out.put_u32(m.xid);
            out.put_u32(m.subxid);
            if let Some((lsn, ts)) = m.abort {
                out.put_u64(lsn.0);
                out.put_i64(ts.0);
            }
        }
        LogicalMessage::BeginPrepare(m) => {
            out.put_u64(m.prepare_lsn.0);
            out.put_u64(m.end_lsn.0);
            out.put_i64(m.timestamp.0);
            out.put_u32(m.xid);
            string(out, &m.gid);
        }
        LogicalMessage::Prepare(m) | LogicalMessage::StreamPrepare(m) => {
            out.put_u8(m.flags);
            out.put_u64(m.prepare_lsn.0);
            out.put_u64(m.end_lsn.0);
            out.put_i64(m.timestamp.0);
            out.put_u32(m.xid);
            string(out, &m.gid);
        }
        LogicalMessage::CommitPrepared(m) => {
            out.put_u8(m.flags);
            out.put_u64(m.commit_lsn.0);
            out.put_u64(m.end_lsn.0);
            out.put_i64(m.timestamp.0);
            out.put_u32(m.xid);
            string(out, &m.gid);
        }
        LogicalMessage::RollbackPrepared(m) => {
            out.put_u8(m.flags);
            out.put_u64(m.prepare_end_lsn.0);
            out.put_u64(m.rollback_end_lsn.0);
            out.put_i64(m.prepare_timestamp.0);
            out.put_i64(m.rollback_timestamp.0);
            out.put_u32(m.xid);
            string(out, &m.gid);
        }
    }
}

fn xid(out: &mut BytesMut, xid: Option<Xid>) {
    if let Some(x) = xid {
        out.put_u32(x);
    }
}

fn len32(n: usize) -> i32 {
    i32::try_from(n).expect("length fits Int32")
}

fn string(out: &mut BytesMut, s: &str) {
    out.put_slice(s.as_bytes());
    out.put_u8(0);
}

fn old_tuple(out: &mut BytesMut, old: &OldTuple) {
    out.put_u8(match old.kind {
        OldTupleKind::Key => b'K',
        OldTupleKind::Full => b'O',
    });
    tuple(out, &old.tuple);
}

fn tuple(out: &mut BytesMut, values: &Tuple) {
    out.put_i16(i16::try_from(values.len()).expect("column count fits Int16"));
    for v in values {
        match v {
            TupleValue::Null => out.put_u8(b'n'),
            TupleValue::UnchangedToast => out.put_u8(b'u'),
            TupleValue::Text(b) | TupleValue::Binary(b) => {
                out.put_u8(if matches!(v, TupleValue::Text(_)) {
                    b't'
                } else {
                    b'b'
                });
                out.put_i32(len32(b.len()));
                out.put_slice(b);
            }
        }
    }
}
