//! The invariants of the fault catalogue, as checks over the model's state.
//!
//! NL: every committed event is in the broker (its topic or the dead-letter
//! topic). DUP: every copy of an event carries its event id and the position
//! its session gives it (commit LSN, index among the configured tables' inserts,
//! xid): copies from sessions with the same tables are identical. ORD: in every
//! partition of an event topic, a key's events first appear in commit order.
//! LSN: no position reported and no checkpoint written passes an event that the
//! broker has not acknowledged.

use std::collections::{HashMap, HashSet};

use walbox_core::Checkpoint;
use walbox_outbox::Position;
use walbox_pgoutput::Lsn;

use crate::broker::Broker;
use crate::world::{Log, Tables};

/// Events of a table moved out of the publication whose transaction a session
/// without that table saved a position past: never sent, by the operator's choice.
pub type Excused = HashSet<String>;

/// The positions snapshots gave rows, by event id: a snapshot publishes each
/// row it reads as an event at its own point (`(point, n, xid 0)`).
pub type SnapshotCopies = HashMap<String, Vec<(Lsn, u32)>>;

/// Rows whose only copy comes from the stream after a snapshot that may hold
/// later rows of their key: committed after the position the stream resumes
/// from, deleted before the snapshot read the table (docs/guarantees.md,
/// "First copies in commit order after a snapshot taken while the slot
/// streams from an earlier position"). Their first copies are not held to
/// commit order; they must still arrive.
pub type Reordered = HashSet<String>;

/// LSN: confirming `lsn` to a session with `tables` passes no event of those
/// tables that the broker has not acknowledged (in this or an earlier session).
pub fn passes_only_acked(
    log: &Log,
    broker: &Broker,
    excused: &Excused,
    lsn: Lsn,
    tables: Tables,
    what: &str,
) {
    // Rows no stream has (written while their table was in no publication)
    // are the snapshot's to bring: nothing lost checks them at the end.
    for t in log.txns.iter().filter(|t| t.end_lsn <= lsn) {
        for (table, row) in t.streamed_rows() {
            assert!(
                !tables.has(table) || broker.acked.contains(&row.id) || excused.contains(&row.id),
                "LSN: {what} {lsn} passes event {} of the transaction committing at {}, which \
                 the broker has not acknowledged",
                row.id,
                t.commit_lsn
            );
        }
    }
}

/// LSN for a checkpoint: its position, and the acknowledged prefix it records.
pub fn checkpoint_claims_only_acked(
    log: &Log,
    broker: &Broker,
    excused: &Excused,
    cp: &Checkpoint,
    tables: Tables,
) {
    passes_only_acked(log, broker, excused, cp.lsn, tables, "checkpoint");
    if let Some(p) = &cp.partial {
        let txn = log.txn_at(p.commit_lsn).unwrap_or_else(|| {
            panic!(
                "LSN: checkpoint's partial names {}, where no transaction commits",
                p.commit_lsn
            )
        });
        let next = log.txns.iter().find(|t| t.end_lsn > cp.lsn);
        assert_eq!(
            next.map(|t| t.commit_lsn),
            Some(p.commit_lsn),
            "the checkpoint at {} records progress in the transaction at {}, which is not the \
             one a restart there resumes in",
            cp.lsn,
            p.commit_lsn
        );
        let counted = Tables::from_names(&p.tables)
            .unwrap_or_else(|| panic!("partial counted over unknown tables {:?}", p.tables));
        let first = txn.first_events(counted, p.events);
        assert_eq!(
            first.len() as u64,
            p.events,
            "LSN: the checkpoint claims {} events of the transaction at {}, which has fewer",
            p.events,
            p.commit_lsn
        );
        for id in first {
            assert!(
                broker.acked.contains(id),
                "LSN: the checkpoint claims the first {} events of the transaction at {} \
                 acknowledged, but {id} is not",
                p.events,
                p.commit_lsn
            );
        }
    }
}

/// NL, DUP and ORD over the broker's logs; events of transactions from
/// `upto` on are not required (walbox stopped before them).
pub fn broker_holds_the_log(
    log: &Log,
    broker: &Broker,
    excused: &Excused,
    snapshots: &SnapshotCopies,
    reordered: &Reordered,
    upto: usize,
) {
    let events = log.events();
    let by_id: HashMap<&str, _> = events.iter().map(|e| (e.row.id.as_str(), e)).collect();
    let mut seen: HashSet<&str> = HashSet::new();
    for (part, records) in &broker.logs {
        // ORD: per key, the rank of the newest event seen so far.
        let mut newest: HashMap<&[u8], usize> = HashMap::new();
        let mut first_copies: HashSet<&str> = HashSet::new();
        for r in records {
            let e = by_id
                .get(r.event_id.as_str())
                .unwrap_or_else(|| panic!("{part:?} holds {}, which no row has", r.event_id));
            seen.insert(e.row.id.as_str());
            let txn = &log.txns[e.txn];
            // DUP: id and position as its session numbers the transaction,
            // or as a snapshot that read the row numbers it.
            let Position {
                commit_lsn,
                index,
                xid,
            } = r.position;
            let from_snapshot = xid == 0
                && !txn.unordered
                && snapshots
                    .get(&r.event_id)
                    .is_some_and(|at| at.contains(&(commit_lsn, index)));
            if !from_snapshot {
                let expected = (
                    txn.commit_lsn,
                    log.index_of(e.txn, &e.row.id, r.tables),
                    txn.xid,
                );
                assert_eq!(
                    (commit_lsn, index, xid),
                    expected,
                    "DUP: {} in {part:?} carries another position than its row's",
                    r.event_id
                );
            }
            assert_eq!(
                r.key.as_deref(),
                Some(e.row.key.as_bytes()),
                "{} in {part:?} has another key",
                r.event_id
            );
            let dead = e.row.dead();
            let topic = if dead {
                format!("{}.dlq", e.row.topic())
            } else {
                e.row.topic()
            };
            assert_eq!(
                (&part.0, r.dead_letter),
                (&topic, dead),
                "{} is in the wrong topic",
                r.event_id
            );
            // Dead letters are made when the broker refuses a record, after
            // later events of its key were read; an excused event first
            // reaches the broker when a replay publishes its range again.
            if r.dead_letter
                || excused.contains(&e.row.id)
                || reordered.contains(&e.row.id)
                || !first_copies.insert(e.row.id.as_str())
            {
                continue;
            }
            let key = r.key.as_deref().unwrap_or_default();
            if let Some(prev) = newest.get(key) {
                assert!(
                    *prev < e.rank,
                    "ORD: in {part:?}, {} (key {}) first appears after a later event of its key",
                    r.event_id,
                    e.row.key
                );
            }
            newest.insert(key, e.rank);
        }
    }
    for e in events.iter().filter(|e| e.txn < upto) {
        assert!(
            seen.contains(e.row.id.as_str()) || excused.contains(&e.row.id),
            "NL: event {} of the transaction committing at {} never reached the broker",
            e.row.id,
            log.txns[e.txn].commit_lsn
        );
    }
}
