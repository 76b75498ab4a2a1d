//! The drain scenarios: the slot contenders in rounds over one load, and the
//! polling relay over the rows that load left in the table.

use std::path::Path;
use std::process::Stdio;
use std::time::Instant;

use walbox_testkit::{Broker, NatsServer, PgCluster, RabbitMq, RedisServer};

use crate::Error;
use crate::cli::Args;
use crate::contenders::{
    Allocations, Contender, Run, checkpoint_file, drain, drop_slot, lsn, reset_stream, usage,
    wal_between,
};
use crate::delivered::Destination;
use crate::polling;
use crate::report::Contended;

/// One outbox row like a real service writes it, for row number `n` (an SQL
/// expression) of transaction `t`.
pub const ROW_SELECT: &str = "
    SELECT 'order', 'order-' || (n % 1000), 'OrderPlaced',
           jsonb_build_object(
             'order_id', 'ord-' || n, 'customer_id', 'cus-' || (n * 7 % 5000),
             'currency', 'EUR', 'total_cents', n * 13 % 100000,
             'lines', jsonb_build_array(
               jsonb_build_object('sku', 'SKU-' || (n % 977), 'qty', 2, 'unit_cents', 1299),
               jsonb_build_object('sku', 'SKU-' || (n * 3 % 977), 'qty', 1, 'unit_cents', 4550)),
             'shipping', jsonb_build_object('method', 'standard', 'country', 'DE'),
             'note', 'leave at the door'),
           jsonb_build_object('traceparent', '00-' || md5(n::text) || '-00f067aa0ba902b7-01'),
           1";

pub const INSERT: &str = "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, schema_version)";

/// The backlog: `events` rows in transactions of 10, committed in one go.
pub fn backlog_load(events: u64) -> String {
    format!(
        "DO $$
         BEGIN
           FOR t IN 0..{last} LOOP
             {INSERT} {ROW_SELECT} FROM generate_series(t * 10, t * 10 + 9) n;
             COMMIT;
           END LOOP;
         END $$;",
        last = events / 10 - 1
    )
}

/// What every scenario shares.
pub struct Bench {
    pub a: Args,
    pub pg: PgCluster,
    pub broker: Broker,
    /// The JetStream server of the JetStream contender.
    pub nats: NatsServer,
    /// The Redis server of the Redis Streams contender.
    pub redis: RedisServer,
    /// The RabbitMQ node of the RabbitMQ contender.
    pub rabbitmq: RabbitMq,
    pub db: tokio_postgres::Client,
}

/// The order of the slot contenders `all` in `round` (0-based): the list rotated
/// by one place per round, so no contender always runs first or last (with as
/// many rounds as contenders each runs once in each place).
pub fn order(all: &[Contender], round: usize) -> Vec<Contender> {
    let mut order = all.to_vec();
    order.rotate_left(round % all.len());
    order
}

/// What a slot scenario measured.
pub struct SlotDrain {
    /// One per contender, the ceiling first; runs in round order.
    pub contenders: Vec<Contended>,
    /// WAL the load wrote, bytes.
    pub wal_bytes: i64,
}

impl Bench {
    /// The slot contenders of the backlog (and big-txn) scenario: all, and with
    /// `--baseline` the baseline build's beside them; with `--contenders`, the
    /// ceiling and those named.
    pub fn slot_contenders(&self) -> Vec<Contender> {
        let mut all = Contender::ALL.to_vec();
        if self.a.baseline.is_some() {
            all.extend(Contender::BASELINE);
        }
        if let Some(named) = &self.a.contenders {
            all.retain(|c| *c == Contender::TrueCeiling || named.iter().any(|n| n == c.short()));
        }
        all
    }

    /// The contenders of the messages scenario, likewise.
    pub fn messages_contenders(&self) -> Vec<Contender> {
        let mut all = Contender::MESSAGES.to_vec();
        if self.a.baseline.is_some() {
            all.extend(Contender::BASELINE_MESSAGES);
        }
        all
    }

    /// The walbox build contender `c` runs: the counting build when counting,
    /// the baseline build for a baseline contender, else `--walbox`.
    fn build<'a>(&'a self, c: Contender, counting: Option<&'a Path>) -> Result<&'a Path, Error> {
        Ok(match counting {
            Some(counting) => counting,
            None if c.is_baseline() => self
                .a
                .baseline
                .as_deref()
                .ok_or("a baseline contender without --baseline")?,
            None => &self.a.walbox,
        })
    }

    /// Creates a slot per contender of `all` and round, runs `load` (`events`
    /// events) once, then lets each contender drain its slot, `--repeat` rounds
    /// in rotating order. A contender whose destination can be counted must have
    /// added `events` to it, else the scenario fails.
    ///
    /// All slots exist before the one load, so every run drains the very same WAL
    /// (the same records, not just the same kind). Loading again per round would
    /// write other rows (new uuids and times), leave the table larger for each
    /// round, and have a round pay for the checkpoint of the one before. The cost
    /// of one load is that its WAL stays on disk until the last round's slots are
    /// done: that is one copy of it (about 650 MB for 1,000,000 backlog events),
    /// however many rounds, since the slots share it, where re-loading would write
    /// a copy per round. Each slot goes as soon as its run is done.
    pub async fn drain_slots(
        &self,
        all: &[Contender],
        load: &str,
        events: u64,
    ) -> Result<SlotDrain, Error> {
        self.drain_slots_with(all, load, events, self.a.repeat, None)
            .await
    }

    /// [`Bench::drain_slots`] in `rounds` rounds; with `counting`, the walbox
    /// contenders run that walbox counting its allocations
    /// (`WALBOX_COUNT_ALLOCATIONS=1`) and each run's allocations are read from
    /// its exit line.
    pub async fn drain_slots_with(
        &self,
        all: &[Contender],
        load: &str,
        events: u64,
        rounds: usize,
        counting: Option<&Path>,
    ) -> Result<SlotDrain, Error> {
        let db = &self.db;
        for round in 0..rounds {
            for &c in all {
                db.execute(
                    "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                    &[&c.slot(round)],
                )
                .await?;
            }
        }
        db.batch_execute("CHECKPOINT").await?;
        let start_lsn = lsn(db, "SELECT pg_current_wal_lsn()::text").await?;
        let loading = Instant::now();
        db.batch_execute(load).await?;
        let target = lsn(db, "SELECT pg_current_wal_lsn()::text").await?;
        let wal_bytes = wal_between(db, &start_lsn, &target).await?;
        println!(
            "loaded in {:.1} s: {:.1} MB of WAL",
            loading.elapsed().as_secs_f64(),
            wal_bytes as f64 / 1e6
        );
        // The load's dirty pages are written now, not by a checkpoint in the
        // middle of some run but not of the others.
        db.batch_execute("CHECKPOINT").await?;
        let mut runs: Vec<Vec<Run>> = vec![Vec::with_capacity(rounds); all.len()];
        let bootstrap = self.broker.bootstrap();
        for round in 0..rounds {
            let mut this_round = vec![None; all.len()];
            for c in order(all, round) {
                let slot = c.slot(round);
                if c.base() == Contender::WalboxNats {
                    reset_stream(&self.nats).await?;
                }
                let destination = c.destination(&slot);
                if let Some(d) = &destination {
                    d.prepare(&self.rabbitmq).await?;
                }
                let started = Instant::now();
                let mut child = c.spawn(
                    &self.pg,
                    &self.broker,
                    &self.nats,
                    &self.redis,
                    &self.rabbitmq,
                    self.build(c, counting)?,
                    &slot,
                    destination.as_ref().and_then(Destination::topic),
                    &target,
                    if counting.is_some() {
                        Stdio::piped()
                    } else {
                        Stdio::inherit()
                    },
                    counting.is_some(),
                )?;
                let summary = child.stderr.take().map(read_allocations);
                let mut run = drain(c.name(), db, &slot, &target, child, started).await?;
                if let Some(summary) = summary {
                    run.allocations = summary.join().map_err(|_| "the stderr reader panicked")?;
                    if run.allocations.is_none() {
                        return Err(format!(
                            "{}: no allocation counts on exit: does {} count them \
                             (WALBOX_COUNT_ALLOCATIONS=1)?",
                            c.name(),
                            counting.unwrap_or(&self.a.walbox).display()
                        )
                        .into());
                    }
                }
                println!(
                    "round {}/{rounds}: {} {:.2} s, {:.1} CPU s",
                    round + 1,
                    c.name(),
                    run.seconds,
                    run.cpu_seconds
                );
                if let Some(d) = &destination {
                    d.check(&bootstrap, &self.nats, &self.redis, &self.rabbitmq, events)
                        .await
                        .map_err(|e| format!("{}: {e}", c.name()))?;
                }
                // Done: the slot goes, so it holds no WAL for what follows.
                drop_slot(db, &slot).await?;
                let _ = std::fs::remove_file(checkpoint_file(&self.pg, &slot));
                if c.base() == Contender::WalboxNats {
                    // Its messages go, so they take no memory from what follows.
                    reset_stream(&self.nats).await?;
                }
                this_round[index(all, c)] = Some(run);
            }
            for (i, run) in this_round.into_iter().enumerate() {
                runs[i].push(run.ok_or("a contender did not run in a round")?);
            }
        }
        let contenders = all
            .iter()
            .zip(runs)
            .map(|(c, runs)| Contended {
                name: c.name(),
                runs,
                in_rounds: true,
                extra_wal_per_event: None,
            })
            .collect();
        Ok(SlotDrain {
            contenders,
            wal_bytes,
        })
    }

    /// The polling relay, both variants, over the rows in the table; one run each.
    pub async fn polling(&self, events: u64) -> Result<Vec<Contended>, Error> {
        let db = &self.db;
        polling::prepare(db).await?;
        let mut poller = self.pg.connect("postgres").await?;
        let mut results = Vec::new();
        for (name, marking) in [
            ("polling relay, UPDATE per row", polling::Marking::PerRow),
            (
                "polling relay, UPDATE per batch",
                polling::Marking::PerBatch,
            ),
        ] {
            db.batch_execute(
                "UPDATE outbox SET published_at = NULL WHERE published_at IS NOT NULL",
            )
            .await?;
            db.batch_execute("VACUUM ANALYZE outbox").await?;
            let before = lsn(db, "SELECT pg_current_wal_lsn()::text").await?;
            let cpu_before = usage(std::process::id()).1;
            let started = Instant::now();
            let published = polling::drain(&mut poller, &self.broker.bootstrap(), marking).await?;
            let seconds = started.elapsed().as_secs_f64();
            if published != events {
                return Err(format!("{name} published {published} of {events} events").into());
            }
            let after = lsn(db, "SELECT pg_current_wal_lsn()::text").await?;
            let written = wal_between(db, &before, &after).await?;
            results.push(Contended {
                name,
                runs: vec![Run {
                    seconds,
                    peak_rss_kb: None,
                    cpu_seconds: usage(std::process::id()).1 - cpu_before,
                    switches: None,
                    allocations: None,
                }],
                in_rounds: false,
                extra_wal_per_event: Some(written as f64 / published as f64),
            });
        }
        Ok(results)
    }
}

/// Reads a counting build's stderr on a thread of its own until it closes:
/// its other lines go to the bench's stderr, its exit line is the result.
#[allow(clippy::print_stderr)] // walbox's own lines, passed on
fn read_allocations(
    stderr: std::process::ChildStderr,
) -> std::thread::JoinHandle<Option<Allocations>> {
    std::thread::spawn(move || {
        let mut found = None;
        for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)) {
            let Ok(line) = line else { break };
            match Allocations::parse(&line) {
                Some(a) => found = Some(a),
                None => eprintln!("{line}"),
            }
        }
        found
    })
}

/// The place of `c` in `all`.
fn index(all: &[Contender], c: Contender) -> usize {
    all.iter().position(|&x| x == c).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn as_many_rounds_as_contenders_put_each_once_in_each_place() {
        for all in [&Contender::ALL[..], &Contender::MESSAGES[..]] {
            let n = all.len();
            let rounds: Vec<Vec<Contender>> = (0..n).map(|r| order(all, r)).collect();
            for place in 0..n {
                let mut at: Vec<Contender> = rounds.iter().map(|r| r[place]).collect();
                at.sort_by_key(|&c| index(all, c));
                at.dedup();
                assert_eq!(at.len(), n, "place {place}: {rounds:?}");
            }
            for r in &rounds {
                let mut sorted = r.clone();
                sorted.sort_by_key(|&c| index(all, c));
                assert_eq!(sorted, all.to_vec(), "every round runs each once");
            }
        }
    }
}
