//! Allocations per event: walbox with its global allocator counting
//! (`WALBOX_COUNT_ALLOCATIONS=1`, the release binary itself) drains
//! `--alloc-events` events once per path:
//! rows to the broker, messages to the broker and rows to JetStream. Its exit
//! line gives the allocations, reallocations and bytes the Rust side of the
//! process asked for, start-up included; librdkafka's and other C libraries'
//! `malloc`s are not seen. One run per path: the counts hardly vary.

use std::path::Path;

use crate::Error;
use crate::contenders::{Allocations, Contender};
use crate::messages;
use crate::scenarios::{Bench, backlog_load};

/// One path's counts.
pub struct Counted {
    pub path: &'static str,
    pub events: u64,
    pub counts: Allocations,
}

impl Bench {
    /// Drains `events` rows (to the broker and to JetStream) and `events`
    /// messages (to the broker) with the walbox at `counting`, counting.
    pub async fn allocations(&self, events: u64, counting: &Path) -> Result<Vec<Counted>, Error> {
        let rows = self
            .drain_slots_with(
                &[Contender::WalboxKafka, Contender::WalboxNats],
                &backlog_load(events),
                events,
                1,
                Some(counting),
            )
            .await?;
        let msgs = self
            .drain_slots_with(
                &[Contender::WalboxKafkaMessages],
                &messages::load(events),
                events,
                1,
                Some(counting),
            )
            .await?;
        let mut counted = Vec::new();
        for (path, c) in [
            ("rows to the broker", &rows.contenders[0]),
            ("rows to JetStream", &rows.contenders[1]),
            ("messages to the broker", &msgs.contenders[0]),
        ] {
            let counts = c
                .runs
                .first()
                .and_then(|r| r.allocations)
                .ok_or_else(|| format!("{path}: no allocation counts"))?;
            counted.push(Counted {
                path,
                events,
                counts,
            });
        }
        Ok(counted)
    }
}

/// The table of the scenario.
pub fn print(counted: &[Counted], counting: &Path) {
    if counted.is_empty() {
        return;
    }
    println!();
    println!("### Allocations per event");
    println!();
    println!(
        "{} (run with `WALBOX_COUNT_ALLOCATIONS=1`): one run per path, \
         start-up included; allocations by Rust code only (librdkafka's own `malloc`s \
         are not counted).",
        counting.display()
    );
    println!();
    println!(
        "| path | events | allocations per event | reallocations per event | bytes allocated per event |"
    );
    println!("|---|---:|---:|---:|---:|");
    for c in counted {
        let per = |n: u64| n as f64 / c.events as f64;
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.0} |",
            c.path,
            c.events,
            per(c.counts.allocations),
            per(c.counts.reallocations),
            per(c.counts.bytes)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exit_line_is_read_and_other_lines_are_not() {
        assert_eq!(
            Allocations::parse("allocations: 12 reallocations: 3 bytes: 4096"),
            Some(Allocations {
                allocations: 12,
                reallocations: 3,
                bytes: 4096
            })
        );
        assert_eq!(Allocations::parse("allocations: 12 bytes: 4096"), None);
        assert_eq!(Allocations::parse("WARN walbox: something"), None);
        assert_eq!(Allocations::parse(""), None);
    }
}
