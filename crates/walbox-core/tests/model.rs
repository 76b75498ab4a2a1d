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
use world::{Log, Tables, txns};

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
        checks::broker_holds_the_log(&log, &world.broker, &world.excused, log.txns.len());
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
        checks::broker_holds_the_log(&log, &world.broker, &world.excused, which);
    }
}
