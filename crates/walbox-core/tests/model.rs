//! A model-based property test of [`walbox_core::Core`]: generated histories of
//! a server, a slot, a broker, the checkpoint writer, crashes and configuration
//! changes drive the core the way the `walbox` shell does, and every history is
//! checked against the invariants of the fault catalogue (NL, DUP, ORD, LSN,
//! MEM). The model is plain data: a log of committed transactions, partitions
//! holding records, a checkpoint on disk and a slot position.
//!
//! Cases: `PROPTEST_CASES` (default 2000).

#[path = "model/broker.rs"]
mod broker;
#[path = "model/checks.rs"]
mod checks;
#[path = "model/driver.rs"]
mod driver;
#[path = "model/world.rs"]
mod world;

use proptest::prelude::*;
use walbox_core::CoreError;

use driver::{World, params, steps};
use world::{Log, Tables, swap, txns};

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(2000);
    ProptestConfig::with_cases(cases)
}

fn first_tables() -> impl Strategy<Value = Tables> {
    prop_oneof![3 => Just(Tables::Both), 1 => Just(Tables::OnlyA)]
}

proptest! {
    #![proptest_config(config())]

    /// Any history of faults, then a clean run to the end of the log: nothing
    /// lost, duplicates identical, per-key order kept, no position past an
    /// unacknowledged event, in-flight bounds kept.
    #[test]
    fn every_history_keeps_the_invariants(
        specs in txns(),
        params in params(),
        steps in steps(),
        tables in first_tables(),
    ) {
        let log = Log::build(&specs, None);
        let mut world = World::new(&log, params, tables);
        for step in &steps {
            world.step(step);
            prop_assert!(world.stopped.is_none(), "walbox stopped: {:?}", world.stopped);
        }
        world.finish();
        prop_assert!(world.stopped.is_none(), "walbox stopped: {:?}", world.stopped);
        checks::broker_holds_the_log(
            &log,
            &world.broker,
            &world.excused,
            &world.snapshot_copies,
            &world.reordered,
            log.txns.len(),
        );
    }

    /// An insert into a published table that is no outbox stops walbox before
    /// the transaction's position, in every session that reaches it; every
    /// event before it is published.
    #[test]
    fn an_insert_into_a_published_table_that_is_no_outbox_stops_walbox(
        specs in txns(),
        params in params(),
        steps in steps(),
        at in any::<prop::sample::Index>(),
    ) {
        let spec = at.index(specs.len());
        let log = Log::build(&specs, Some(spec));
        // The log also holds non-transactional messages: the transaction's place.
        let which = log
            .txns
            .iter()
            .position(|t| !t.unordered && t.xid == 700 + u32::try_from(spec).expect("small"))
            .expect("the transaction");
        let txn = &log.txns[which];
        let mut world = World::new(&log, params, Tables::Both);
        world.barrier = Some(txn.end_lsn);
        for step in &steps {
            world.step(step);
        }
        world.finish();
        match &world.stopped {
            Some(CoreError::Unmapped { table, commit_lsn, .. }) => {
                prop_assert_eq!(table.as_str(), "public.audit");
                prop_assert_eq!(*commit_lsn, Some(txn.commit_lsn));
            }
            other => prop_assert!(false, "expected a stop at the audit insert, got {:?}", other),
        }
        checks::broker_holds_the_log(
            &log,
            &world.broker,
            &world.excused,
            &world.snapshot_copies,
            &world.reordered,
            which,
        );
    }

    /// `outbox_b` is swapped for a new table of the same name (another oid)
    /// while walbox runs: the session stops before the swap (the publication
    /// check fails once the new table is in no publication), the user adds the
    /// new table to the publication, and walbox starts again: it streams up to
    /// the new table's first insert, marks its snapshot due, takes it (the
    /// rows the table has then), and streams on; with crashes, stops, broker
    /// faults and the server writing on anywhere in between. Nothing is lost
    /// but the new table's rows written before it joined the publication and
    /// deleted before the snapshot; duplicates identical (a snapshot's copy
    /// carries the snapshot's position); per-key first copies in commit
    /// order; no position past an unacknowledged event; in-flight bounds kept.
    #[test]
    fn a_table_swapped_between_sessions_is_caught_up_by_a_snapshot(
        specs in txns(),
        swap in swap(),
        params in params(),
        steps in steps(),
        written in any::<prop::sample::Index>(),
    ) {
        let log = Log::build_swapped(&specs, &swap);
        let mut world = World::new_at(&log, params, written.index(log.txns.len() + 1));
        for step in &steps {
            world.step(step);
            prop_assert!(world.stopped.is_none(), "walbox stopped: {:?}", world.stopped);
        }
        world.finish();
        prop_assert!(world.stopped.is_none(), "walbox stopped: {:?}", world.stopped);
        checks::broker_holds_the_log(
            &log,
            &world.broker,
            &world.excused,
            &world.snapshot_copies,
            &world.reordered,
            log.txns.len(),
        );
        // Only rows no stream has, deleted before the snapshot, are excused.
        for id in &world.excused {
            let row = log
                .txns
                .iter()
                .flat_map(|t| t.rows())
                .find(|(_, r)| r.id == *id)
                .map(|(_, r)| r);
            prop_assert!(
                row.is_some_and(|r| r.hidden && log.deleted.contains_key(id)),
                "{} excused, but a stream or the snapshot has it",
                id
            );
        }
        prop_assert!(world.snapshots_taken >= 1, "no snapshot of the swapped-in table completed");
    }
}
