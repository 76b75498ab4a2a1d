//! What one event becomes in a stream: its entry id, taken from its source
//! position (`<commit LSN>-<index>`, so ids grow with commit order; 2 below
//! the LSN for a snapshot row, see [`event_entry_id`]), and its
//! fields (`value`, `key`, `event_id`, `walbox_writer`, `header:<name>` per
//! header, `walbox_replay` in a replay).

use walbox_outbox::{Event, Origin, Position};

/// The field holding the event id.
pub const EVENT_ID_FIELD: &str = "event_id";
/// The field naming the walbox that wrote the entry.
pub const WRITER_FIELD: &str = "walbox_writer";
/// The field holding the record value.
pub const VALUE_FIELD: &str = "value";
/// The field holding the key, when the event has one.
pub const KEY_FIELD: &str = "key";
/// The field holding the replay's name, on entries a replay appended.
pub const REPLAY_FIELD: &str = "walbox_replay";
/// What precedes a header's name in its field's name.
pub const HEADER_PREFIX: &str = "header:";

/// The entry id of a source position: milliseconds part = commit LSN (as a
/// 64-bit number), sequence part = the event's index in its transaction.
/// Redis' smallest id is `0-1`; a commit LSN is never 0.
#[must_use]
pub fn entry_id(commit_lsn: u64, index: u32) -> String {
    format!("{commit_lsn}-{index}")
}

/// The entry id of an event at `position`, read as `origin` says: [`entry_id`]
/// for an event in commit order. An event outside it
/// ([`Origin::outside_commit_order`]: a snapshot row, at the snapshot's
/// consistent point; a non-transactional message, at its LSN) takes the
/// milliseconds part 2 below its LSN. Positions are WAL record
/// LSNs, multiples of 4 at least (8 on 64-bit builds), and the commit record
/// of a transaction the snapshot does not show can start right at the
/// consistent point: at `<point>-<index>` its events would meet the rows'
/// ids. 2 below keeps them apart, still before every later position and
/// after every earlier one, and even (odd ones are for appended entries).
#[must_use]
pub fn event_entry_id(position: &Position, origin: &Origin) -> String {
    let lsn = position.commit_lsn.0;
    if origin.outside_commit_order() && lsn > 2 {
        entry_id(lsn - 2, position.index)
    } else {
        entry_id(lsn, position.index)
    }
}

/// The position an entry id stands for, when it is one of walbox's.
#[must_use]
pub fn position_of(id: &str) -> Option<(u64, u32)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

/// How many fields [`for_each_field`] gives `event`'s entry.
#[must_use]
pub fn field_count(event: &Event, replay: bool) -> usize {
    3 + usize::from(replay) + usize::from(event.key.is_some()) + event.headers.len()
}

/// Calls `f(prefix, name, value)` for each field of `event`'s entry, in
/// order (the field's name is `prefix` then `name`), without copying them.
pub fn for_each_field(
    event: &Event,
    writer: &str,
    replay: Option<&str>,
    mut f: impl FnMut(&str, &str, &[u8]),
) {
    f("", EVENT_ID_FIELD, event.event_id.as_bytes());
    f("", WRITER_FIELD, writer.as_bytes());
    if let Some(name) = replay {
        f("", REPLAY_FIELD, name.as_bytes());
    }
    if let Some(k) = &event.key {
        f("", KEY_FIELD, k);
    }
    for (name, v) in &event.headers {
        f(HEADER_PREFIX, name, v);
    }
    f("", VALUE_FIELD, &event.value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_grow_with_commit_order_and_map_back() {
        let ids = [(1u64, 0u32), (1, 1), (1, 10), (2, 0), (u64::MAX, u32::MAX)];
        let parsed: Vec<(u64, u32)> = ids
            .iter()
            .map(|(l, i)| position_of(&entry_id(*l, *i)).expect("maps back"))
            .collect();
        assert_eq!(parsed, ids);
        // Redis orders ids by (ms, seq) as numbers, which is commit order.
        let mut sorted = parsed.clone();
        sorted.sort();
        assert_eq!(sorted, parsed);
        assert_eq!(entry_id(0x16B_3748, 2), "23803720-2");
        let e = Event {
            event_id: "e".into(),
            topic: "t".into(),
            key: Some(bytes::Bytes::from_static(b"k")),
            value: bytes::Bytes::from_static(b"{}"),
            json_value: true,
            headers: vec![("a".into(), bytes::Bytes::from_static(b"1"))],
            position: Position {
                commit_lsn: walbox_pgoutput::Lsn(8),
                index: 0,
                xid: 3,
            },
            origin: Origin::Stream,
        };
        for replay in [None, Some("0/8")] {
            let mut fields = 0;
            for_each_field(&e, "w", replay, |_, _, _| fields += 1);
            assert_eq!(field_count(&e, replay.is_some()), fields);
        }
        assert_eq!(position_of("1700000000000-*"), None);
        assert_eq!(position_of("abc"), None);
    }

    #[test]
    fn rows_of_a_snapshot_and_a_transaction_committed_at_its_point_never_share_an_id() {
        let at = |lsn: u64, index: u32, xid: u32| {
            // xid 0 stands for a snapshot row here; the id follows the
            // origin, never the transaction id.
            let origin = if xid == 0 {
                Origin::Snapshot {
                    point: walbox_pgoutput::Lsn(lsn),
                }
            } else {
                Origin::Stream
            };
            event_entry_id(
                &Position {
                    commit_lsn: walbox_pgoutput::Lsn(lsn),
                    index,
                    xid,
                },
                &origin,
            )
        };
        // Rows at the consistent point 4096, a transaction committed at it,
        // one committed before it (at least 8 bytes of WAL earlier).
        let rows = [at(4096, 0, 0), at(4096, 1, 0)];
        let txn = [at(4096, 0, 9), at(4096, 1, 9)];
        let before = at(4088, 5, 8);
        for r in &rows {
            assert!(!txn.contains(r), "{r}");
            let p = position_of(r).expect("an id");
            assert!(p > position_of(&before).expect("an id"));
            assert!(p < position_of(&txn[0]).expect("an id"));
            assert_eq!(p.0 % 2, 0, "odd milliseconds are for appended entries");
        }
        assert_eq!(txn[1], entry_id(4096, 1));
    }

    /// A snapshot row's dead letter, replayed by `walbox dlq replay`, goes
    /// to the row's own id outside commit order (2 below the point), never
    /// to the id of a transaction's event committed at the point.
    #[test]
    fn a_snapshot_rows_letter_replayed_keeps_its_place_outside_commit_order() {
        let p = walbox_pgoutput::Lsn(4096);
        let at = |xid: u32, origin: Origin| {
            event_entry_id(
                &Position {
                    commit_lsn: p,
                    index: 0,
                    xid,
                },
                &origin,
            )
        };
        let letter = at(
            0,
            Origin::DeadLetterReplay {
                letter: "dlq.s.dlq.0".into(),
                snapshot: Some(p),
            },
        );
        let row = at(0, Origin::Snapshot { point: p });
        let txn = at(9, Origin::Stream);
        assert_eq!(letter, row);
        assert_ne!(letter, txn);
        let streamed_letter = at(
            9,
            Origin::DeadLetterReplay {
                letter: "dlq.s.dlq.1".into(),
                snapshot: None,
            },
        );
        assert_eq!(streamed_letter, txn);
    }

    #[test]
    fn two_tables_in_one_slot_share_one_order_of_positions() {
        // Positions come from one slot's WAL, so events of two tables (or
        // prefixes) committed together or apart never share an id and keep
        // commit order in one stream.
        let table_a = [entry_id(100, 0), entry_id(100, 2), entry_id(300, 0)];
        let table_b = [entry_id(100, 1), entry_id(200, 0)];
        let mut merged: Vec<(u64, u32)> = table_a
            .iter()
            .chain(table_b.iter())
            .filter_map(|i| position_of(i))
            .collect();
        merged.sort();
        merged.dedup();
        assert_eq!(merged, [(100, 0), (100, 1), (100, 2), (200, 0), (300, 0)]);
    }
}
