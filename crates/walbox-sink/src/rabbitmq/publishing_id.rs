//! Stream mode's publishing ids: each event's position `(commit LSN, index)`
//! becomes a producer name and a 64-bit publishing id, deterministically, so
//! that a resend after a crash carries the same name and id and the broker
//! drops it (it keeps, per producer name and stream, the highest id stored
//! and drops any id at or below it).
//!
//! - The name's **epoch** is the commit LSN's top 24 bits (`lsn >> 40`: one
//!   epoch per TiB of WAL): name = `{base}.{epoch:x}`.
//! - Within the epoch, id = `((lsn & (2^40 - 1)) << 23 | index) + 1`: the
//!   LSN's low 40 bits, then 23 bits of index (8,388,608 events per
//!   transaction), plus one (0 means "none" to the broker). Ids grow with
//!   commit order within an epoch, and a new epoch is a new name (a new
//!   producer, sequence 0), so ids never need to wrap: `LSN << 16 | index`
//!   would overflow after 256 TiB of WAL, which a busy primary writes in its
//!   lifetime, and 16 bits of index would not hold a 1M-event transaction.
//! - An index past 23 bits never wraps into the next position: such an event
//!   goes under a name of its transaction's own, `{base}.{epoch:x}.x{lsn:x}`,
//!   with id = index + 1, so its ids still grow in publish order (the stream
//!   keeps a name per such transaction; see [`Slot`]).
//! - A snapshot row (origin [`walbox_outbox::Origin::Snapshot`]: the rows of
//!   a snapshot, all at its consistent point) goes under the snapshot's own
//!   name,
//!   `{base}.s{lsn:x}`, with id = index + 1. A snapshot taken again while the
//!   slot resumes from an earlier position publishes its rows at its new
//!   consistent point P2, then the stream's events from before P2: under one
//!   name those would sit below the rows' ids and be dropped (lost); under
//!   names of their own neither touches the other's sequence.
//! - A non-transactional message's dead letter (transaction id 0 too, but in
//!   WAL order with the commits around it) goes under the epoch's name, with
//!   the id of `(LSN - 2, 0)` ([`message_slot`]): the commit record of a
//!   transaction right after the message can start where the message ends,
//!   so the two can share an LSN; 2 below keeps the message's id apart from
//!   that commit's events and above every earlier commit's (WAL records
//!   start at multiples of 8). The sink reads which kind an event is from its
//!   origin, never from its transaction id.
//!
//! Limits: 2^24 epochs (the whole 64-bit LSN range); 255 names kept per
//! stream by the broker, oldest dropped, so an epoch's name stays as long as
//! fewer than 254 other names (epochs, replays, transactions over 8M events)
//! were written to the stream after it.

/// Bits of the index in an epoch's id.
pub(super) const INDEX_BITS: u32 = 23;
/// Bits of the LSN in an epoch's id.
pub(super) const LSN_BITS: u32 = 40;

/// The producer name and publishing id of one position.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Slot {
    /// The producer name.
    pub(super) name: String,
    /// The publishing id (at least 1).
    pub(super) id: u64,
}

/// The name and id of the event at `(lsn, index)` for producers named from
/// `base`.
pub(super) fn slot(base: &str, lsn: u64, index: u32, snapshot_row: bool) -> Slot {
    if snapshot_row {
        return Slot {
            name: format!("{base}.s{lsn:x}"),
            id: u64::from(index) + 1,
        };
    }
    let epoch = lsn >> LSN_BITS;
    let low = lsn & ((1u64 << LSN_BITS) - 1);
    if index >= 1 << INDEX_BITS {
        return Slot {
            name: format!("{base}.{epoch:x}.x{lsn:x}"),
            id: u64::from(index) + 1,
        };
    }
    Slot {
        name: format!("{base}.{epoch:x}"),
        id: ((low << INDEX_BITS) | u64::from(index)) + 1,
    }
}

/// The name and id of a non-transactional message's dead letter at `lsn`:
/// the epoch's name and the id of `(lsn - 2, 0)`, between every earlier
/// commit's events and those of a commit at `lsn`.
pub(super) fn message_slot(base: &str, lsn: u64) -> Slot {
    slot(base, lsn.saturating_sub(2), 0, false)
}

/// The position an id of an epoch's name stands for: `(lsn, index)`.
#[cfg(test)]
pub(super) fn position(epoch: u64, id: u64) -> Option<(u64, u32)> {
    let v = id.checked_sub(1)?;
    let low = v >> INDEX_BITS;
    let index = u32::try_from(v & ((1 << INDEX_BITS) - 1)).ok()?;
    Some(((epoch << LSN_BITS) | low, index))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_grow_with_the_position_and_come_back_to_it() {
        let positions = [
            (0x16B_3748u64, 0u32),
            (0x16B_3748, 1),
            (0x16B_3748, (1 << INDEX_BITS) - 1),
            (0x16B_3749, 0),
            ((1 << LSN_BITS) - 1, 7),
        ];
        let mut last = 0;
        for (lsn, index) in positions {
            let s = slot("walbox.s", lsn, index, false);
            assert_eq!(s.name, "walbox.s.0");
            assert!(s.id > last, "{lsn:x} {index}");
            assert!(s.id >= 1);
            last = s.id;
            assert_eq!(position(0, s.id), Some((lsn, index)));
        }
        assert_eq!(position(0, 0), None);
    }

    #[test]
    fn a_new_epoch_is_a_new_name_and_the_top_lsn_fits() {
        let before = slot("b", (1 << LSN_BITS) - 1, 5, false);
        let after = slot("b", 1 << LSN_BITS, 0, false);
        assert_eq!(after.name, "b.1");
        assert_ne!(before.name, after.name);
        assert_eq!(after.id, 1);
        // 256 TiB of WAL and more: no overflow, a name per TiB.
        let far = slot("b", u64::MAX, (1 << INDEX_BITS) - 1, false);
        assert_eq!(far.name, "b.ffffff");
        assert_eq!(far.id, 1 << 63);
        assert_eq!(
            position(0xff_ffff, far.id),
            Some((u64::MAX, (1 << INDEX_BITS) - 1))
        );
    }

    #[test]
    fn an_index_past_the_field_goes_under_its_transaction_s_own_name_never_wrapping() {
        let lsn = 0x2_0000_0000u64;
        let last_in_field = slot("b", lsn, (1 << INDEX_BITS) - 1, false);
        let first_past = slot("b", lsn, 1 << INDEX_BITS, false);
        let next = slot("b", lsn, (1 << INDEX_BITS) + 1, false);
        assert_eq!(first_past.name, "b.0.x200000000");
        assert_ne!(first_past.name, last_in_field.name);
        assert_eq!(next.name, first_past.name);
        assert!(next.id > first_past.id);
        // The next transaction's ids are above every id of this one's epoch name.
        assert!(slot("b", lsn + 1, 0, false).id > last_in_field.id);
        // A 1M-event transaction stays under the epoch's name.
        assert_eq!(slot("b", lsn, 1_000_000, false).name, "b.0");
    }

    #[test]
    fn snapshot_rows_go_under_their_snapshot_s_name_apart_from_the_stream_s_events() {
        let p2 = 0x300_0000u64;
        let row = slot("b", p2, 5, true);
        assert_eq!((row.name.as_str(), row.id), ("b.s3000000", 6));
        // A stream event from before the snapshot's point, published after
        // its rows, is not under the rows' name: not below their ids.
        let earlier = slot("b", p2 - 0x100, 0, false);
        assert_ne!(earlier.name, row.name);
    }
}
