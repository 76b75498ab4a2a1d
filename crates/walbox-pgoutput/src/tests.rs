//! Byte-level examples for every message, written from the protocol documentation
//! rather than through [`encode`](crate::encode), so the two cannot share a mistake.

use bytes::{Bytes, BytesMut};

use crate::*;

/// Builds a message from big-endian pieces.
#[derive(Default)]
struct Wire(Vec<u8>);

impl Wire {
    fn tag(t: u8) -> Self {
        Wire(vec![t])
    }
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn i16(mut self, v: i16) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn i32(mut self, v: i32) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn str(mut self, s: &str) -> Self {
        self.0.extend_from_slice(s.as_bytes());
        self.0.push(0);
        self
    }
    fn text(self, s: &str) -> Self {
        let mut w = self.u8(b't').i32(s.len() as i32);
        w.0.extend_from_slice(s.as_bytes());
        w
    }
    fn bytes(self) -> Bytes {
        Bytes::from(self.0)
    }
}

fn ok(w: Wire) -> LogicalMessage {
    let buf = w.bytes();
    let msg = decode(&buf, false).unwrap();
    // The encoder must reproduce the exact bytes.
    let mut again = BytesMut::new();
    encode(&msg, &mut again);
    assert_eq!(&again[..], &buf[..], "re-encoding {msg:?}");
    msg
}

fn ok_streamed(w: Wire) -> LogicalMessage {
    let buf = w.bytes();
    let msg = decode(&buf, true).unwrap();
    let mut again = BytesMut::new();
    encode(&msg, &mut again);
    assert_eq!(&again[..], &buf[..], "re-encoding {msg:?}");
    msg
}

fn err(w: Wire) -> DecodeError {
    decode(&w.bytes(), false).unwrap_err()
}

#[test]
fn begin_and_commit() {
    let m = ok(Wire::tag(b'B').u64(0x1_0000_0100).i64(786_000_000).u32(733));
    assert_eq!(
        m,
        LogicalMessage::Begin(Begin {
            final_lsn: Lsn(0x1_0000_0100),
            timestamp: PgTimestamp(786_000_000),
            xid: 733
        })
    );
    let m = ok(Wire::tag(b'C').u8(0).u64(0x100).u64(0x130).i64(5));
    assert_eq!(
        m,
        LogicalMessage::Commit(Commit {
            flags: 0,
            commit_lsn: Lsn(0x100),
            end_lsn: Lsn(0x130),
            timestamp: PgTimestamp(5)
        })
    );
}

#[test]
fn origin() {
    let m = ok(Wire::tag(b'O').u64(42).str("node_a"));
    assert_eq!(
        m,
        LogicalMessage::Origin(Origin {
            commit_lsn: Lsn(42),
            name: "node_a".into()
        })
    );
}

#[test]
fn relation_with_key_column() {
    let m = ok(Wire::tag(b'R')
        .u32(16_384)
        .str("public")
        .str("outbox")
        .u8(b'd')
        .i16(2)
        .u8(1)
        .str("id")
        .u32(2950)
        .i32(-1)
        .u8(0)
        .str("payload")
        .u32(3802)
        .i32(-1));
    let LogicalMessage::Relation(r) = m else {
        panic!("not a relation: {m:?}")
    };
    assert_eq!(r.xid, None);
    assert_eq!(r.oid, 16_384);
    assert_eq!(
        (r.namespace.as_str(), r.name.as_str()),
        ("public", "outbox")
    );
    assert_eq!(r.replica_identity, ReplicaIdentity::Default);
    assert_eq!(r.columns.len(), 2);
    assert!(r.columns[0].is_key());
    assert!(!r.columns[1].is_key());
    assert_eq!(r.columns[1].name, "payload");
    assert_eq!(r.columns[1].type_oid, 3802);
}

#[test]
fn relation_replica_identities() {
    for (b, want) in [
        (b'd', ReplicaIdentity::Default),
        (b'n', ReplicaIdentity::Nothing),
        (b'f', ReplicaIdentity::Full),
        (b'i', ReplicaIdentity::Index),
    ] {
        let LogicalMessage::Relation(r) = ok(Wire::tag(b'R').u32(1).str("").str("t").u8(b).i16(0))
        else {
            panic!()
        };
        assert_eq!(r.replica_identity, want);
    }
    let e = err(Wire::tag(b'R').u32(1).str("").str("t").u8(b'x').i16(0));
    assert_eq!(e.field, "replica identity");
    assert_eq!(e.offset, 8);
    assert!(matches!(
        e.kind,
        DecodeErrorKind::UnexpectedByte { found: b'x', .. }
    ));
}

#[test]
fn type_message() {
    let m = ok(Wire::tag(b'Y').u32(70_000).str("public").str("mood"));
    assert_eq!(
        m,
        LogicalMessage::Type(TypeMessage {
            xid: None,
            oid: 70_000,
            namespace: "public".into(),
            name: "mood".into()
        })
    );
}

#[test]
fn insert_with_every_column_kind() {
    let m = ok(Wire::tag(b'I')
        .u32(16_384)
        .u8(b'N')
        .i16(4)
        .u8(b'n')
        .u8(b'u')
        .text("héllo")
        .u8(b'b')
        .i32(4)
        .u32(0xDEAD_BEEF));
    let LogicalMessage::Insert(i) = m else {
        panic!()
    };
    assert_eq!(i.relation_oid, 16_384);
    assert_eq!(i.new[0], TupleValue::Null);
    assert_eq!(i.new[1], TupleValue::UnchangedToast);
    assert_eq!(i.new[2].as_text(), Some("héllo"));
    assert_eq!(
        i.new[3],
        TupleValue::Binary(Bytes::from_static(&[0xDE, 0xAD, 0xBE, 0xEF]))
    );
    assert_eq!(i.new[3].as_text(), None);
}

#[test]
fn update_forms() {
    // No old tuple.
    let LogicalMessage::Update(u) = ok(Wire::tag(b'U').u32(7).u8(b'N').i16(1).text("x")) else {
        panic!()
    };
    assert_eq!(u.old, None);
    assert_eq!(u.new[0].as_text(), Some("x"));
    // Old key, then new.
    let LogicalMessage::Update(u) = ok(Wire::tag(b'U')
        .u32(7)
        .u8(b'K')
        .i16(1)
        .text("1")
        .u8(b'N')
        .i16(1)
        .text("2"))
    else {
        panic!()
    };
    let old = u.old.unwrap();
    assert_eq!(old.kind, OldTupleKind::Key);
    assert_eq!(old.tuple[0].as_text(), Some("1"));
    // Old full row.
    let LogicalMessage::Update(u) = ok(Wire::tag(b'U')
        .u32(7)
        .u8(b'O')
        .i16(1)
        .u8(b'n')
        .u8(b'N')
        .i16(1)
        .u8(b'u'))
    else {
        panic!()
    };
    assert_eq!(u.old.unwrap().kind, OldTupleKind::Full);
    // Old tuple but no new one.
    let e = err(Wire::tag(b'U').u32(7).u8(b'K').i16(0).u8(b'X'));
    assert_eq!(e.field, "new tuple marker");
    assert_eq!(e.offset, 8);
}

#[test]
fn delete_forms() {
    let LogicalMessage::Delete(d) = ok(Wire::tag(b'D').u32(9).u8(b'K').i16(1).text("5")) else {
        panic!()
    };
    assert_eq!(d.old.kind, OldTupleKind::Key);
    let LogicalMessage::Delete(d) = ok(Wire::tag(b'D').u32(9).u8(b'O').i16(0)) else {
        panic!()
    };
    assert_eq!(d.old.kind, OldTupleKind::Full);
    let e = err(Wire::tag(b'D').u32(9).u8(b'N').i16(0));
    assert_eq!(e.field, "old tuple marker");
}

#[test]
fn truncate() {
    let LogicalMessage::Truncate(t) = ok(Wire::tag(b'T').i32(2).u8(3).u32(10).u32(11)) else {
        panic!()
    };
    assert_eq!(t.relation_oids, vec![10, 11]);
    assert!(t.cascade() && t.restart_identity());
}

#[test]
fn logical_decoding_message() {
    let LogicalMessage::Message(m) = ok(Wire::tag(b'M')
        .u8(1)
        .u64(0x50)
        .str("walbox")
        .i32(3)
        .u8(1)
        .u8(2)
        .u8(3))
    else {
        panic!()
    };
    assert!(m.transactional());
    assert_eq!(m.prefix, "walbox");
    assert_eq!(&m.content[..], &[1, 2, 3]);
    let LogicalMessage::Message(m) = ok(Wire::tag(b'M').u8(0).u64(0x50).str("").i32(0)) else {
        panic!()
    };
    assert!(!m.transactional());
    assert!(m.content.is_empty());
}

#[test]
fn streamed_messages_carry_xid() {
    let LogicalMessage::Insert(i) = ok_streamed(Wire::tag(b'I').u32(900).u32(5).u8(b'N').i16(0))
    else {
        panic!()
    };
    assert_eq!(i.xid, Some(900));
    let LogicalMessage::Relation(r) = ok_streamed(
        Wire::tag(b'R')
            .u32(900)
            .u32(5)
            .str("s")
            .str("t")
            .u8(b'f')
            .i16(0),
    ) else {
        panic!()
    };
    assert_eq!((r.xid, r.oid), (Some(900), 5));
    let LogicalMessage::Message(m) =
        ok_streamed(Wire::tag(b'M').u32(900).u8(1).u64(1).str("p").i32(0))
    else {
        panic!()
    };
    assert_eq!(m.xid, Some(900));
    // Begin has no xid prefix even inside a stream.
    assert!(matches!(
        ok_streamed(Wire::tag(b'B').u64(1).i64(2).u32(3)),
        LogicalMessage::Begin(_)
    ));
}

#[test]
fn stream_control_messages() {
    assert_eq!(
        ok(Wire::tag(b'S').u32(77).u8(1)),
        LogicalMessage::StreamStart(StreamStart {
            xid: 77,
            first_segment: true
        })
    );
    assert_eq!(ok(Wire::tag(b'E')), LogicalMessage::StreamStop);
    let e = err(Wire::tag(b'S').u32(77).u8(2));
    assert_eq!(e.field, "first segment");
    assert_eq!(
        ok(Wire::tag(b'c').u32(77).u8(0).u64(10).u64(20).i64(30)),
        LogicalMessage::StreamCommit(StreamCommit {
            xid: 77,
            flags: 0,
            commit_lsn: Lsn(10),
            end_lsn: Lsn(20),
            timestamp: PgTimestamp(30)
        })
    );
    assert_eq!(
        ok(Wire::tag(b'A').u32(77).u32(78)),
        LogicalMessage::StreamAbort(StreamAbort {
            xid: 77,
            subxid: 78,
            abort: None
        })
    );
    assert_eq!(
        ok(Wire::tag(b'A').u32(77).u32(78).u64(99).i64(100)),
        LogicalMessage::StreamAbort(StreamAbort {
            xid: 77,
            subxid: 78,
            abort: Some((Lsn(99), PgTimestamp(100)))
        })
    );
    let e = err(Wire::tag(b'A').u32(77).u32(78).u32(1));
    assert!(matches!(
        e.kind,
        DecodeErrorKind::UnexpectedEnd {
            needed: 8,
            available: 4
        }
    ));
}

#[test]
fn two_phase_messages() {
    assert_eq!(
        ok(Wire::tag(b'b').u64(1).u64(2).i64(3).u32(4).str("gid-1")),
        LogicalMessage::BeginPrepare(BeginPrepare {
            prepare_lsn: Lsn(1),
            end_lsn: Lsn(2),
            timestamp: PgTimestamp(3),
            xid: 4,
            gid: "gid-1".into()
        })
    );
    let prepare = Prepare {
        flags: 0,
        prepare_lsn: Lsn(1),
        end_lsn: Lsn(2),
        timestamp: PgTimestamp(3),
        xid: 4,
        gid: "g".into(),
    };
    assert_eq!(
        ok(Wire::tag(b'P').u8(0).u64(1).u64(2).i64(3).u32(4).str("g")),
        LogicalMessage::Prepare(prepare.clone())
    );
    assert_eq!(
        ok(Wire::tag(b'p').u8(0).u64(1).u64(2).i64(3).u32(4).str("g")),
        LogicalMessage::StreamPrepare(prepare)
    );
    assert_eq!(
        ok(Wire::tag(b'K').u8(0).u64(5).u64(6).i64(7).u32(8).str("g")),
        LogicalMessage::CommitPrepared(CommitPrepared {
            flags: 0,
            commit_lsn: Lsn(5),
            end_lsn: Lsn(6),
            timestamp: PgTimestamp(7),
            xid: 8,
            gid: "g".into()
        })
    );
    assert_eq!(
        ok(Wire::tag(b'r')
            .u8(0)
            .u64(5)
            .u64(6)
            .i64(7)
            .i64(8)
            .u32(9)
            .str("g")),
        LogicalMessage::RollbackPrepared(RollbackPrepared {
            flags: 0,
            prepare_end_lsn: Lsn(5),
            rollback_end_lsn: Lsn(6),
            prepare_timestamp: PgTimestamp(7),
            rollback_timestamp: PgTimestamp(8),
            xid: 9,
            gid: "g".into()
        })
    );
}

#[test]
fn errors_name_message_field_and_offset() {
    let e = decode(&Bytes::new(), false).unwrap_err();
    assert_eq!(e.kind, DecodeErrorKind::Empty);

    let e = err(Wire::tag(b'Z'));
    assert_eq!(e.kind, DecodeErrorKind::UnknownTag(b'Z'));
    assert_eq!(e.offset, 0);

    let e = err(Wire::tag(b'B').u64(1).u32(0));
    assert_eq!(e.field, "timestamp");
    assert_eq!(e.offset, 9);
    assert_eq!(
        e.to_string(),
        "pgoutput Begin: timestamp at byte 9: message ends early: needs 8 more bytes, 4 left"
    );

    let e = err(Wire::tag(b'O').u64(1).u8(b'a'));
    assert_eq!(e.kind, DecodeErrorKind::UnterminatedString);

    let e = err(Wire::tag(b'O').u64(1).u8(0xFF).u8(0));
    assert_eq!(e.kind, DecodeErrorKind::InvalidUtf8);

    let e = err(Wire::tag(b'I').u32(1).u8(b'N').i16(-1));
    assert_eq!(e.kind, DecodeErrorKind::NegativeLength(-1));
    assert_eq!(e.field, "tuple column count");

    let e = err(Wire::tag(b'I')
        .u32(1)
        .u8(b'N')
        .i16(1)
        .u8(b't')
        .i32(100)
        .u8(b'x'));
    assert_eq!(e.field, "column value");
    assert_eq!(
        e.kind,
        DecodeErrorKind::UnexpectedEnd {
            needed: 100,
            available: 1
        }
    );

    let e = err(Wire::tag(b'I').u32(1).u8(b'N').i16(1).u8(b'q'));
    assert_eq!(e.field, "column kind");
    assert_eq!(e.offset, 8);

    let e = err(Wire::tag(b'E').u8(0));
    assert_eq!(e.kind, DecodeErrorKind::TrailingBytes(1));
}

#[test]
fn forged_counts_do_not_reserve_memory() {
    // 32767 columns announced, none present: must fail, not reserve 32767 slots.
    let e = err(Wire::tag(b'I').u32(1).u8(b'N').i16(i16::MAX));
    assert!(matches!(e.kind, DecodeErrorKind::UnexpectedEnd { .. }));
    let e = err(Wire::tag(b'T').i32(i32::MAX).u8(0));
    assert!(matches!(e.kind, DecodeErrorKind::UnexpectedEnd { .. }));
}

#[test]
fn decoder_tracks_stream_blocks() {
    let mut d = Decoder::new();
    let insert_streamed = Wire::tag(b'I').u32(900).u32(5).u8(b'N').i16(0).bytes();
    let insert_plain = Wire::tag(b'I').u32(5).u8(b'N').i16(0).bytes();
    d.decode(&Wire::tag(b'S').u32(900).u8(1).bytes()).unwrap();
    assert!(d.in_stream());
    assert!(matches!(
        d.decode(&insert_streamed).unwrap(),
        LogicalMessage::Insert(Insert { xid: Some(900), .. })
    ));
    d.decode(&Wire::tag(b'E').bytes()).unwrap();
    assert!(!d.in_stream());
    assert!(matches!(
        d.decode(&insert_plain).unwrap(),
        LogicalMessage::Insert(Insert { xid: None, .. })
    ));
}

#[test]
fn timestamps_convert_to_unix_time() {
    assert_eq!(PgTimestamp(0).unix_micros(), 946_684_800_000_000);
    assert_eq!(
        PgTimestamp::from_unix_micros(946_684_800_000_001),
        PgTimestamp(1)
    );
    let t = PgTimestamp(0).to_system_time();
    assert_eq!(
        t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs(),
        946_684_800
    );
}
