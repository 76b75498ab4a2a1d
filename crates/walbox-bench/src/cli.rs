//! The command line: which scenarios run, how large they are, and how many rounds
//! the slot contenders drain.

use std::path::PathBuf;

use crate::Error;

const USAGE: &str = "\
usage: walbox-bench [--events N] [--big-txn N] [--repeat N] [--steady-seconds N]
                    [--rates LIST] [--only LIST] [--svg-dir DIR] [--walbox PATH]
                    [--webhook-events N] [--pubsub-events N] [--aws-events N]
                    [--alloc-events N]
                    [--walbox-counting PATH]
                    [--baseline PATH] [--contenders LIST] [--busy N]

  --events N          backlog size, a multiple of 10 (default 1000000)
  --big-txn N         rows in the one big transaction (default 1000000)
  --repeat N          rounds of the slot contenders in the backlog, messages and
                      big-txn scenarios, in rotating order (default 3)
  --steady-seconds N  seconds of writing per steady rate (default 60)
  --rates LIST        steady rates in events/s (default 1000,5000,20000)
  --only LIST         scenarios to run: backlog, polling, messages, allocations,
                      big-txn, steady, webhook, pubsub, aws (default all)
  --webhook-events N  events of each webhook run, a multiple of 10 (default 20000)
  --pubsub-events N   events of the Pub/Sub run, a multiple of 10 (default 20000)
  --aws-events N      events of each AWS run (Kinesis, SQS, SNS), a multiple of 10
                      (default 10000)
  --alloc-events N    events of each allocations run, a multiple of 10 (default 100000)
  --svg-dir DIR       where a full run writes its charts
  --walbox PATH       the walbox binary (default: next to this one)
  --walbox-counting PATH
                      the walbox that counts its allocations (run with
                      WALBOX_COUNT_ALLOCATIONS=1) in the allocations scenario
                      (default: --walbox)
  --baseline PATH     another walbox build (say, the previous release) to run
                      beside this one: its runs to the broker and to JetStream join
                      the backlog's rounds (and to Redis Streams), its [[messages]]
                      run the messages'
  --contenders LIST   the slot contenders of the backlog and big-txn scenarios,
                      by the short names the rounds print (walbox-redis,
                      baseline-redis, ...); the ceiling always runs (default all)
  --busy N            N threads of the bench spin on the CPU for the whole run, at
                      the contenders' priority: figures of a machine whose cores
                      something else wants too (default 0)";

pub struct Args {
    pub events: u64,
    pub big_txn: u64,
    /// Rounds of the slot contenders per slot scenario.
    pub repeat: usize,
    pub steady_seconds: u64,
    pub svg_dir: Option<PathBuf>,
    pub walbox: PathBuf,
    /// Scenarios to run (all by default).
    pub only: Vec<Scenario>,
    /// Rates of the steady-load scenario, events/s.
    pub rates: Vec<u64>,
    /// Events of each run of the webhook scenario.
    pub webhook_events: u64,
    /// Events of the Pub/Sub scenario's run.
    pub pubsub_events: u64,
    /// Events of each run of the AWS scenario.
    pub aws_events: u64,
    /// Events of each run of the allocations scenario.
    pub alloc_events: u64,
    /// The walbox that counts its allocations (`--walbox-counting`), when it
    /// is not `--walbox`.
    pub walbox_counting: Option<PathBuf>,
    /// Another build of walbox to compare with.
    pub baseline: Option<PathBuf>,
    /// The slot contenders to run (short names), when not all.
    pub contenders: Option<Vec<String>>,
    /// Threads spinning for the whole run (`--busy`).
    pub busy: usize,
}

/// A part of the run that `--only` can pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    Backlog,
    Polling,
    /// The backlog's events as logical decoding messages.
    Messages,
    BigTxn,
    Steady,
    /// A backlog POSTed to a local HTTP receiver at 1, 16 and 256 keys.
    Webhook,
    /// Allocations per event, counted by a counting build of walbox.
    Allocations,
    /// A backlog published to the Pub/Sub emulator, next to a plain client.
    PubSub,
    /// Kinesis, SQS and SNS on their stand-ins, each next to a plain SDK client.
    Aws,
}

impl Scenario {
    pub const ALL: [Scenario; 9] = [
        Scenario::Backlog,
        Scenario::Polling,
        Scenario::Messages,
        Scenario::Allocations,
        Scenario::BigTxn,
        Scenario::Steady,
        Scenario::Webhook,
        Scenario::PubSub,
        Scenario::Aws,
    ];

    fn parse(s: &str) -> Result<Self, Error> {
        Ok(match s {
            "backlog" => Scenario::Backlog,
            "polling" => Scenario::Polling,
            "messages" => Scenario::Messages,
            "big-txn" => Scenario::BigTxn,
            "steady" => Scenario::Steady,
            "webhook" => Scenario::Webhook,
            "pubsub" => Scenario::PubSub,
            "aws" => Scenario::Aws,
            "allocations" => Scenario::Allocations,
            other => {
                return Err(format!(
                    "--only: unknown scenario {other:?} (backlog, polling, messages, allocations, big-txn, steady, webhook, pubsub, aws)"
                )
                .into());
            }
        })
    }
}

/// The arguments, or `None` when `--help` asked for the usage (printed).
pub fn args() -> Result<Option<Args>, Error> {
    let here = std::env::current_exe()?;
    let beside = |name: &str| {
        here.parent()
            .map(|d| d.join(name))
            .unwrap_or_else(|| PathBuf::from(name))
    };
    let mut a = Args {
        events: 1_000_000,
        big_txn: 1_000_000,
        repeat: 3,
        steady_seconds: 60,
        svg_dir: None,
        walbox: beside("walbox"),
        walbox_counting: None,
        alloc_events: 100_000,
        baseline: None,
        contenders: None,
        busy: 0,
        only: Scenario::ALL.to_vec(),
        rates: vec![1_000, 5_000, 20_000],
        webhook_events: 20_000,
        pubsub_events: 20_000,
        aws_events: 10_000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--help" | "-h" => {
                println!("{USAGE}");
                return Ok(None);
            }
            "--events" => a.events = it.next().ok_or("--events needs a number")?.parse()?,
            "--big-txn" => a.big_txn = it.next().ok_or("--big-txn needs a number")?.parse()?,
            "--repeat" => a.repeat = it.next().ok_or("--repeat needs a number")?.parse()?,
            "--svg-dir" => {
                a.svg_dir = Some(PathBuf::from(it.next().ok_or("--svg-dir needs a path")?));
            }
            "--steady-seconds" => {
                a.steady_seconds = it
                    .next()
                    .ok_or("--steady-seconds needs a number")?
                    .parse()?;
            }
            "--webhook-events" => {
                a.webhook_events = it
                    .next()
                    .ok_or("--webhook-events needs a number")?
                    .parse()?;
            }
            "--pubsub-events" => {
                a.pubsub_events = it.next().ok_or("--pubsub-events needs a number")?.parse()?;
            }
            "--aws-events" => {
                a.aws_events = it.next().ok_or("--aws-events needs a number")?.parse()?;
            }
            "--walbox" => a.walbox = PathBuf::from(it.next().ok_or("--walbox needs a path")?),
            "--baseline" => {
                a.baseline = Some(PathBuf::from(it.next().ok_or("--baseline needs a path")?));
            }
            "--contenders" => {
                let list = it
                    .next()
                    .ok_or("--contenders needs a list such as walbox-redis,baseline-redis")?;
                a.contenders = Some(comma_list(&list, |c| Ok(c.to_owned()))?);
            }
            "--busy" => a.busy = it.next().ok_or("--busy needs a number")?.parse()?,
            "--walbox-counting" => {
                a.walbox_counting = Some(PathBuf::from(
                    it.next().ok_or("--walbox-counting needs a path")?,
                ));
            }
            "--alloc-events" => {
                a.alloc_events = it.next().ok_or("--alloc-events needs a number")?.parse()?;
            }
            "--rates" => {
                let list = it.next().ok_or("--rates needs a list such as 1000,5000")?;
                a.rates = comma_list(&list, |r| Ok(r.parse()?))?;
            }
            "--only" => {
                let list = it
                    .next()
                    .ok_or("--only needs a list such as backlog,steady")?;
                a.only = comma_list(&list, Scenario::parse)?;
            }
            other => {
                return Err(format!("unknown argument {other:?}\n{USAGE}").into());
            }
        }
    }
    if a.webhook_events == 0 || !a.webhook_events.is_multiple_of(10) {
        return Err("--webhook-events must be a positive multiple of 10".into());
    }
    if a.pubsub_events == 0 || !a.pubsub_events.is_multiple_of(10) {
        return Err("--pubsub-events must be a positive multiple of 10".into());
    }
    if a.aws_events == 0 || !a.aws_events.is_multiple_of(10) {
        return Err("--aws-events must be a positive multiple of 10".into());
    }
    if a.alloc_events == 0 || !a.alloc_events.is_multiple_of(10) {
        return Err("--alloc-events must be a positive multiple of 10".into());
    }
    if a.events == 0 || !a.events.is_multiple_of(10) {
        return Err("--events must be a positive multiple of 10".into());
    }
    if a.big_txn == 0 || a.steady_seconds == 0 || a.rates.contains(&0) {
        return Err("--big-txn, --steady-seconds and --rates must be positive".into());
    }
    if let Some(named) = &a.contenders {
        let known: Vec<&str> = crate::contenders::Contender::ALL
            .iter()
            .chain(&crate::contenders::Contender::BASELINE)
            .map(|c| c.short())
            .collect();
        if let Some(unknown) = named.iter().find(|n| !known.contains(&n.as_str())) {
            return Err(format!(
                "--contenders: unknown contender {unknown:?} ({})",
                known.join(", ")
            )
            .into());
        }
    }
    if a.repeat == 0 {
        return Err("--repeat must be at least 1 (3 or more for a median and a spread)".into());
    }
    Ok(Some(a))
}

/// The items of a comma-separated flag value.
fn comma_list<T>(list: &str, item: impl Fn(&str) -> Result<T, Error>) -> Result<Vec<T>, Error> {
    list.split(',').map(item).collect()
}

impl Args {
    /// The walbox the allocations scenario runs with
    /// `WALBOX_COUNT_ALLOCATIONS=1`: `--walbox-counting`, else `--walbox`.
    #[must_use]
    pub fn counting(&self) -> &std::path::Path {
        self.walbox_counting.as_deref().unwrap_or(&self.walbox)
    }
}
