//! The report: the tables printed for docs/benchmarks.md, the median and spread
//! of repeated runs, and the charts of a full run.

use crate::Error;
use crate::contenders::{Contender, Run, Switches};
use crate::scenarios::order;
use crate::steady::Steady;
use crate::svg;

/// A contender's runs in one scenario.
pub struct Contended {
    pub name: &'static str,
    /// In round order (not in the order they ran).
    pub runs: Vec<Run>,
    /// Whether `runs[i]` ran in round `i`, next to the ceiling's `runs[i]`.
    pub in_rounds: bool,
    /// WAL the contender itself writes per event (the polling relay's UPDATEs).
    pub extra_wal_per_event: Option<f64>,
}

impl Contended {
    pub fn seconds(&self) -> Spread {
        Spread::of(self.runs.iter().map(|r| r.seconds))
    }

    pub fn cpu_seconds(&self) -> Spread {
        Spread::of(self.runs.iter().map(|r| r.cpu_seconds))
    }
}

/// The median, lowest and highest of some runs' figure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Spread {
    /// Of at least one value (no runs: all zero).
    pub fn of(values: impl IntoIterator<Item = f64>) -> Spread {
        let mut v: Vec<f64> = values.into_iter().collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = match n {
            0 => 0.0,
            _ if n % 2 == 1 => v[n / 2],
            _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        };
        Spread {
            median,
            min: v.first().copied().unwrap_or(0.0),
            max: v.last().copied().unwrap_or(0.0),
            n,
        }
    }

    /// Every figure times `k`.
    fn map(&self, k: f64) -> Spread {
        Spread {
            median: self.median * k,
            min: self.min * k,
            max: self.max * k,
            n: self.n,
        }
    }

    /// `median (min–max)` with `decimals`; a single run is just its value.
    pub fn cell(&self, decimals: usize) -> String {
        if self.n > 1 {
            format!(
                "{:.decimals$} ({:.decimals$}–{:.decimals$})",
                self.median, self.min, self.max
            )
        } else {
            format!("{:.decimals$}", self.median)
        }
    }
}

/// A contender's ratio to the ceiling: the ceiling's median time over the
/// contender's, and the range of each round's ceiling time over the same round's
/// contender time (`None` for a contender that did not run in the rounds).
pub fn ratio(ceiling: &Contended, c: &Contended) -> (f64, Option<Spread>) {
    let of_medians = ceiling.seconds().median / c.seconds().median;
    let paired =
        (c.in_rounds && ceiling.in_rounds && c.runs.len() == ceiling.runs.len()).then(|| {
            Spread::of(
                ceiling
                    .runs
                    .iter()
                    .zip(&c.runs)
                    .map(|(ceil, run)| ceil.seconds / run.seconds),
            )
        });
    (of_medians, paired)
}

/// How the slot contenders `all` ran: rounds and their order.
pub fn method(all: &[Contender], rounds: usize) -> String {
    let orders: Vec<String> = (0..rounds)
        .map(|r| {
            let names: Vec<&str> = order(all, r).iter().map(|c| c.short()).collect();
            format!("round {}: {}", r + 1, names.join(", "))
        })
        .collect();
    format!(
        "{rounds} round{} in rotating order ({}), each run on its own slot over the same WAL",
        if rounds == 1 { "" } else { "s" },
        orders.join("; ")
    )
}

/// A slot scenario's table (with the polling relay's rows, if any); `rounds` is
/// the slot contenders and their number of rounds, `None` when none ran.
pub fn print_table(
    title: &str,
    events: u64,
    wal_bytes: i64,
    rounds: Option<(&[Contender], usize)>,
    results: &[Contended],
) {
    println!();
    println!("### {title}");
    println!();
    if let Some((all, rounds)) = rounds {
        println!(
            "{}; figures are the median of the rounds, with the lowest and highest in \
             brackets; \"of ceiling\" is the ratio of the median times, bracketed: each \
             round's ceiling time over the same round's time. Peak RSS is the highest \
             of the rounds.",
            method(all, rounds)
        );
        println!();
    }
    println!(
        "| contender | runs | seconds | events/s | WAL MB/s | of ceiling | of pg_recvlogical | peak RSS MB | CPU s | CPU s per M events | CPU of ceiling's | context switches per 1k events (involuntary) | extra WAL per event |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    // The ceiling's row comes first when the slot scenario ran; pg_recvlogical
    // is shown beside it.
    let ceiling = results.first().filter(|r| r.name.contains("ceiling"));
    let recvlogical = results
        .iter()
        .find(|r| r.name.starts_with("pg_recvlogical"));
    let ratio_cell = |to: Option<&Contended>, r: &Contended| {
        to.map_or_else(
            || "-".to_owned(),
            |c| match ratio(c, r) {
                (m, Some(range)) if range.n > 1 => {
                    format!("{m:.2} ({:.2}–{:.2})", range.min, range.max)
                }
                (m, _) => format!("{m:.2}"),
            },
        )
    };
    for r in results {
        let seconds = r.seconds();
        let cpu = r.cpu_seconds();
        let of_ceiling = ratio_cell(ceiling, r);
        let of_recvlogical = ratio_cell(recvlogical, r);
        // CPU per event against the ceiling's (the same events, so of the
        // medians' CPU seconds).
        let cpu_of_ceiling = ceiling.map_or_else(
            || "-".to_owned(),
            |c| format!("{:.2}", cpu.median / c.cpu_seconds().median),
        );
        let peak_rss = r.runs.iter().map(|run| run.peak_rss_kb).max().flatten();
        // Switches of all the process's threads: hand-offs and wake-ups
        // (voluntary) and the scheduler taking the core (involuntary).
        let switches = if r.runs.iter().all(|run| run.switches.is_some()) {
            let per_k = |f: fn(&Switches) -> u64| {
                Spread::of(
                    r.runs
                        .iter()
                        .filter_map(|run| run.switches)
                        .map(|s| f(&s) as f64 * 1e3 / events as f64),
                )
            };
            format!(
                "{} ({})",
                per_k(|s| s.voluntary + s.involuntary).cell(1),
                per_k(|s| s.involuntary).cell(1)
            )
        } else {
            "-".to_owned()
        };
        println!(
            "| {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.name,
            r.runs.len(),
            seconds.cell(2),
            events as f64 / seconds.median,
            // Unknown when the load was not measured (polling alone).
            if wal_bytes > 0 {
                format!("{:.1}", wal_bytes as f64 / 1e6 / seconds.median)
            } else {
                "-".to_owned()
            },
            of_ceiling,
            of_recvlogical,
            peak_rss.map_or_else(
                || "(in the bench process)".to_owned(),
                |kb| format!("{:.1}", kb as f64 / 1024.0)
            ),
            cpu.cell(1),
            cpu.map(1e6 / events as f64).cell(1),
            cpu_of_ceiling,
            switches,
            r.extra_wal_per_event
                .map_or_else(|| "0".to_owned(), |b| format!("{b:.0} B"))
        );
    }
}

/// A percentile out of walbox's `p50=.. p95=..` summary.
pub fn percentile(summary: &str, name: &str) -> f64 {
    summary
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

pub fn print_steady(seconds: u64, runs: &[Steady]) {
    println!();
    println!(
        "### Steady load: single-row transactions at fixed rates for {seconds} s each, walbox to the broker"
    );
    println!();
    println!(
        "| target events/s | achieved events/s | commit-to-ack latency, ms | of which commit-to-read p50 / p99, ms | slot lag mid / end / max, kB | catch-up after, s | peak RSS MB | CPU s |"
    );
    println!("|---:|---:|---|---|---|---:|---:|---:|");
    for r in runs {
        println!(
            "| {} | {:.0} | {} | {:.1} / {:.1} | {} / {} / {} | {:.2} | {:.1} | {:.1} |",
            r.rate,
            r.achieved,
            r.latency,
            percentile(&r.read_latency, "p50"),
            percentile(&r.read_latency, "p99"),
            r.lag_mid / 1024,
            r.lag_end / 1024,
            r.lag_max / 1024,
            r.drain_seconds,
            r.peak_rss_kb as f64 / 1024.0,
            r.cpu_seconds
        );
    }
}

/// The throughput chart (median times) and the latency chart.
pub fn write_charts(
    dir: &std::path::Path,
    events: u64,
    backlog: &[Contended],
    steady: &[Steady],
) -> Result<(), Error> {
    let throughput: Vec<svg::Bar> = backlog
        .iter()
        .map(|r| {
            let rate = events as f64 / r.seconds().median;
            let of_ceiling = backlog.first().map_or(1.0, |c| ratio(c, r).0);
            svg::Bar {
                label: r.name.to_owned(),
                value: rate,
                note: format!("{rate:.0} events/s ({of_ceiling:.2} of ceiling)"),
            }
        })
        .collect();
    std::fs::write(
        dir.join("bench-throughput.svg"),
        svg::bars(
            &format!("Backlog drain, {events} events: events per second (median)"),
            &throughput,
            false,
        ),
    )?;
    let mut latency = Vec::new();
    for r in steady {
        for q in ["p50", "p95", "p99"] {
            let ms = percentile(&r.latency, q);
            latency.push(svg::Bar {
                label: format!("walbox at {}/s, {q}", r.rate),
                value: ms,
                note: format!("{ms:.1} ms (achieved {:.0}/s)", r.achieved),
            });
        }
    }
    std::fs::write(
        dir.join("bench-latency.svg"),
        svg::bars(
            "Steady load: commit-to-acknowledgement latency, ms (log scale)",
            &latency,
            true,
        ),
    )?;
    println!();
    println!(
        "charts: {0}/bench-throughput.svg, {0}/bench-latency.svg",
        dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contended(seconds: &[f64], in_rounds: bool) -> Contended {
        Contended {
            name: "x",
            runs: seconds
                .iter()
                .map(|&seconds| Run {
                    seconds,
                    peak_rss_kb: Some(1),
                    cpu_seconds: seconds / 2.0,
                    switches: None,
                    allocations: None,
                })
                .collect(),
            in_rounds,
            extra_wal_per_event: None,
        }
    }

    #[test]
    fn median_of_odd_and_even_counts_and_the_extremes() {
        let odd = Spread::of([3.0, 1.0, 2.0]);
        assert_eq!((odd.median, odd.min, odd.max, odd.n), (2.0, 1.0, 3.0, 3));
        let even = Spread::of([4.0, 1.0, 3.0, 2.0]);
        assert_eq!((even.median, even.min, even.max), (2.5, 1.0, 4.0));
        assert_eq!(Spread::of([7.0]).cell(2), "7.00");
        assert_eq!(odd.cell(1), "2.0 (1.0–3.0)");
    }

    #[test]
    fn the_ratio_pairs_each_round_with_the_same_rounds_ceiling() {
        // Half the ceiling's speed in one round, twice it in another: pairing by
        // round shows it, pairing the sorted times would give 1.0 throughout.
        let ceiling = contended(&[10.0, 20.0, 30.0], true);
        let c = contended(&[20.0, 10.0, 30.0], true);
        let (of_medians, range) = ratio(&ceiling, &c);
        assert!((of_medians - 1.0).abs() < 1e-9);
        let range = range.expect("paired by round");
        assert!((range.min - 0.5).abs() < 1e-9 && (range.max - 2.0).abs() < 1e-9);
        // A contender outside the rounds gets the ratio of medians only.
        let once = contended(&[40.0], false);
        let (of_medians, range) = ratio(&ceiling, &once);
        assert!((of_medians - 0.5).abs() < 1e-9);
        assert!(range.is_none());
    }
}
