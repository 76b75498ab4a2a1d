//! Property tests: the decoder is total, exact and frugal.
//!
//! - Every valid message survives encode -> decode unchanged.
//! - Every strict prefix of a valid message is refused (only Stream Abort has a
//!   shorter valid form) and never panics.
//! - Arbitrary bytes and single-byte corruptions of valid messages never panic; when
//!   they decode, re-encoding gives back the same bytes (nothing is lost or invented).
//! - Decoding never allocates more than a small multiple of the input size.
//!
//! Failures print a seed; `PROPTEST_CASES` raises the case count for a longer run.

#![allow(unsafe_code)] // the counting allocator below

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use walbox_pgoutput::*;

// ---- allocation accounting (per thread, so parallel tests do not interfere) ----

struct Counting;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| a.set(a.get() + layout.size()));
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| a.set(a.get() + new_size));
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocated_by<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = ALLOCATED.with(Cell::get);
    let out = f();
    (out, ALLOCATED.with(Cell::get) - before)
}

/// The most a decode may allocate for `input_len` bytes: a fixed allowance for the
/// message value plus a bounded number of bytes per input byte (one tuple slot per
/// one-byte column, names copied once).
fn allocation_budget(input_len: usize) -> usize {
    512 + 48 * input_len
}

// ---- generators of valid messages ----

fn lsn() -> impl Strategy<Value = Lsn> {
    any::<u64>().prop_map(Lsn)
}

fn ts() -> impl Strategy<Value = PgTimestamp> {
    any::<i64>().prop_map(PgTimestamp)
}

fn name() -> impl Strategy<Value = String> {
    // Any text without NUL, including multi-byte characters.
    "[^\u{0}]{0,12}"
}

fn value() -> impl Strategy<Value = TupleValue> {
    prop_oneof![
        Just(TupleValue::Null),
        Just(TupleValue::UnchangedToast),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(|v| TupleValue::Text(v.into())),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(|v| TupleValue::Binary(v.into())),
    ]
}

fn tuple() -> impl Strategy<Value = Tuple> {
    proptest::collection::vec(value(), 0..8)
}

fn old_tuple() -> impl Strategy<Value = OldTuple> {
    (
        prop_oneof![Just(OldTupleKind::Key), Just(OldTupleKind::Full)],
        tuple(),
    )
        .prop_map(|(kind, tuple)| OldTuple { kind, tuple })
}

fn identity() -> impl Strategy<Value = ReplicaIdentity> {
    prop_oneof![
        Just(ReplicaIdentity::Default),
        Just(ReplicaIdentity::Nothing),
        Just(ReplicaIdentity::Full),
        Just(ReplicaIdentity::Index),
    ]
}

/// A valid message and whether it belongs inside a streamed block.
fn message() -> impl Strategy<Value = (LogicalMessage, bool)> {
    let xid = any::<Option<u32>>();
    let column = (any::<u8>(), name(), any::<u32>(), any::<i32>()).prop_map(
        |(flags, name, type_oid, type_modifier)| RelationColumn {
            flags,
            name,
            type_oid,
            type_modifier,
        },
    );
    let streamable = prop_oneof![
        (
            xid.clone(),
            any::<u32>(),
            name(),
            name(),
            identity(),
            proptest::collection::vec(column, 0..6)
        )
            .prop_map(|(xid, oid, namespace, name, replica_identity, columns)| {
                LogicalMessage::Relation(Relation {
                    xid,
                    oid,
                    namespace,
                    name,
                    replica_identity,
                    columns,
                })
            }),
        (xid.clone(), any::<u32>(), name(), name()).prop_map(|(xid, oid, namespace, name)| {
            LogicalMessage::Type(TypeMessage {
                xid,
                oid,
                namespace,
                name,
            })
        }),
        (xid.clone(), any::<u32>(), tuple()).prop_map(|(xid, relation_oid, new)| {
            LogicalMessage::Insert(Insert {
                xid,
                relation_oid,
                new,
            })
        }),
        (
            xid.clone(),
            any::<u32>(),
            proptest::option::of(old_tuple()),
            tuple()
        )
            .prop_map(
                |(xid, relation_oid, old, new)| LogicalMessage::Update(Update {
                    xid,
                    relation_oid,
                    old,
                    new
                })
            ),
        (xid.clone(), any::<u32>(), old_tuple()).prop_map(|(xid, relation_oid, old)| {
            LogicalMessage::Delete(Delete {
                xid,
                relation_oid,
                old,
            })
        }),
        (
            xid.clone(),
            any::<u8>(),
            proptest::collection::vec(any::<u32>(), 0..6)
        )
            .prop_map(
                |(xid, options, relation_oids)| LogicalMessage::Truncate(Truncate {
                    xid,
                    options,
                    relation_oids
                })
            ),
        (
            xid,
            any::<u8>(),
            lsn(),
            name(),
            proptest::collection::vec(any::<u8>(), 0..64)
        )
            .prop_map(
                |(xid, flags, lsn, prefix, content)| LogicalMessage::Message(DecodingMessage {
                    xid,
                    flags,
                    lsn,
                    prefix,
                    content: content.into()
                })
            ),
    ]
    .prop_map(|m| {
        let streamed = match &m {
            LogicalMessage::Relation(r) => r.xid.is_some(),
            LogicalMessage::Type(t) => t.xid.is_some(),
            LogicalMessage::Insert(i) => i.xid.is_some(),
            LogicalMessage::Update(u) => u.xid.is_some(),
            LogicalMessage::Delete(d) => d.xid.is_some(),
            LogicalMessage::Truncate(t) => t.xid.is_some(),
            LogicalMessage::Message(m) => m.xid.is_some(),
            _ => false,
        };
        (m, streamed)
    });
    let prepare = || {
        (any::<u8>(), lsn(), lsn(), ts(), any::<u32>(), name()).prop_map(
            |(flags, prepare_lsn, end_lsn, timestamp, xid, gid)| Prepare {
                flags,
                prepare_lsn,
                end_lsn,
                timestamp,
                xid,
                gid,
            },
        )
    };
    let control =
        prop_oneof![
            (lsn(), ts(), any::<u32>()).prop_map(|(final_lsn, timestamp, xid)| {
                LogicalMessage::Begin(Begin {
                    final_lsn,
                    timestamp,
                    xid,
                })
            }),
            (any::<u8>(), lsn(), lsn(), ts()).prop_map(
                |(flags, commit_lsn, end_lsn, timestamp)| {
                    LogicalMessage::Commit(Commit {
                        flags,
                        commit_lsn,
                        end_lsn,
                        timestamp,
                    })
                }
            ),
            (lsn(), name())
                .prop_map(|(commit_lsn, name)| LogicalMessage::Origin(Origin { commit_lsn, name })),
            (any::<u32>(), any::<bool>()).prop_map(|(xid, first_segment)| {
                LogicalMessage::StreamStart(StreamStart { xid, first_segment })
            }),
            Just(LogicalMessage::StreamStop),
            (any::<u32>(), any::<u8>(), lsn(), lsn(), ts()).prop_map(
                |(xid, flags, commit_lsn, end_lsn, timestamp)| {
                    LogicalMessage::StreamCommit(StreamCommit {
                        xid,
                        flags,
                        commit_lsn,
                        end_lsn,
                        timestamp,
                    })
                }
            ),
            (
                any::<u32>(),
                any::<u32>(),
                proptest::option::of((lsn(), ts()))
            )
                .prop_map(|(xid, subxid, abort)| LogicalMessage::StreamAbort(
                    StreamAbort { xid, subxid, abort }
                )),
            (lsn(), lsn(), ts(), any::<u32>(), name()).prop_map(
                |(prepare_lsn, end_lsn, timestamp, xid, gid)| {
                    LogicalMessage::BeginPrepare(BeginPrepare {
                        prepare_lsn,
                        end_lsn,
                        timestamp,
                        xid,
                        gid,
                    })
                }
            ),
            prepare().prop_map(LogicalMessage::Prepare),
            prepare().prop_map(LogicalMessage::StreamPrepare),
            (any::<u8>(), lsn(), lsn(), ts(), any::<u32>(), name()).prop_map(
                |(flags, commit_lsn, end_lsn, timestamp, xid, gid)| {
                    LogicalMessage::CommitPrepared(CommitPrepared {
                        flags,
                        commit_lsn,
                        end_lsn,
                        timestamp,
                        xid,
                        gid,
                    })
                }
            ),
            (any::<u8>(), lsn(), lsn(), ts(), ts(), any::<u32>(), name()).prop_map(
                |(
                    flags,
                    prepare_end_lsn,
                    rollback_end_lsn,
                    prepare_timestamp,
                    rollback_timestamp,
                    xid,
                    gid,
                )| {
                    LogicalMessage::RollbackPrepared(RollbackPrepared {
                        flags,
                        prepare_end_lsn,
                        rollback_end_lsn,
                        prepare_timestamp,
                        rollback_timestamp,
                        xid,
                        gid,
                    })
                }
            ),
        ]
        .prop_map(|m| (m, false));
    prop_oneof![streamable, control]
}

fn wire(msg: &LogicalMessage) -> Bytes {
    let mut out = BytesMut::new();
    encode(msg, &mut out);
    out.freeze()
}

/// Decodes and, on success, checks that re-encoding reproduces the input.
fn decode_checked(buf: &Bytes, in_stream: bool) -> Result<LogicalMessage, DecodeError> {
    let (result, allocated) = allocated_by(|| decode(buf, in_stream));
    assert!(
        allocated <= allocation_budget(buf.len()),
        "decoding {} bytes allocated {allocated} bytes",
        buf.len()
    );
    if let Ok(msg) = &result {
        assert_eq!(
            &wire(msg)[..],
            &buf[..],
            "decoded {msg:?} does not re-encode to its input"
        );
    }
    result
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn valid_messages_round_trip((msg, streamed) in message()) {
        let buf = wire(&msg);
        prop_assert_eq!(decode_checked(&buf, streamed)?, msg);
    }

    #[test]
    fn every_truncation_is_refused((msg, streamed) in message()) {
        let buf = wire(&msg);
        for cut in 0..buf.len() {
            let prefix = buf.slice(..cut);
            match decode_checked(&prefix, streamed) {
                Err(e) => {
                    if cut == 0 {
                        prop_assert_eq!(e.kind, DecodeErrorKind::Empty);
                    } else {
                        prop_assert!(
                            matches!(e.kind, DecodeErrorKind::UnexpectedEnd { .. } | DecodeErrorKind::UnterminatedString),
                            "prefix {} of {:?}: {}", cut, msg, e
                        );
                        prop_assert!(e.offset <= cut);
                    }
                }
                // Stream Abort without the optional abort LSN/time is itself valid.
                Ok(LogicalMessage::StreamAbort(a)) => {
                    prop_assert!(a.abort.is_none() && cut == 9, "prefix {} decoded as {:?}", cut, a);
                }
                Ok(other) => prop_assert!(false, "prefix {} of {:?} decoded as {:?}", cut, msg, other),
            }
        }
    }

    #[test]
    fn corrupted_messages_never_panic((msg, streamed) in message(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut raw = wire(&msg).to_vec();
        let i = at.index(raw.len());
        raw[i] = byte;
        let _ = decode_checked(&Bytes::from(raw), streamed);
    }

    #[test]
    fn random_bytes_never_panic(raw in proptest::collection::vec(any::<u8>(), 0..256), in_stream in any::<bool>()) {
        let _ = decode_checked(&Bytes::from(raw), in_stream);
    }

    #[test]
    fn random_bytes_after_a_known_tag_never_panic(
        tag in prop::sample::select(b"BCORYIUDTMSEcAbPKrp".to_vec()),
        rest in proptest::collection::vec(any::<u8>(), 0..256),
        in_stream in any::<bool>(),
    ) {
        let mut raw = vec![tag];
        raw.extend(rest);
        let _ = decode_checked(&Bytes::from(raw), in_stream);
    }
}

#[test]
fn huge_announced_counts_allocate_nothing_extra() {
    // Insert announcing 32767 one-byte NULL columns but carrying 3.
    let mut raw = vec![b'I', 0, 0, 0, 1, b'N'];
    raw.extend_from_slice(&i16::MAX.to_be_bytes());
    raw.extend_from_slice(b"nnn");
    let buf = Bytes::from(raw);
    let (r, allocated) = allocated_by(|| decode(&buf, false));
    assert!(r.is_err());
    assert!(allocated <= allocation_budget(buf.len()), "{allocated}");
}
