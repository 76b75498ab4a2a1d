//! The steady-load scenario: writers commit single-row transactions at a fixed
//! rate while walbox streams to the broker; walbox reports commit-to-acknowledgement
//! and commit-to-read latency, the bench samples the slot's lag every second.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::Error;
use crate::contenders::{lsn, slot_reached, usage};
use crate::scenarios::{Bench, INSERT, ROW_SELECT};

/// Figures of one steady-load run.
pub struct Steady {
    pub rate: u64,
    pub achieved: f64,
    /// `p50=.. p95=.. p99=.. max=.. n=..` in ms, as walbox reports it.
    pub latency: String,
    /// The same from the commit to walbox reading the transaction.
    pub read_latency: String,
    /// Slot lag (bytes behind the server's WAL) at the middle and the end of the
    /// writing, and its maximum.
    pub lag_mid: i64,
    pub lag_end: i64,
    pub lag_max: i64,
    pub drain_seconds: f64,
    pub peak_rss_kb: u64,
    pub cpu_seconds: f64,
}

impl Bench {
    /// walbox streams while writers commit `rate` single-row transactions per
    /// second for `seconds`; walbox measures commit-to-acknowledgement latency.
    pub async fn steady(&self, rate: u64, seconds: u64) -> Result<Steady, Error> {
        const WRITERS: u64 = 4;
        let db = &self.db;
        let pg = &self.pg;
        let slot = "walbox_steady";
        db.execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await?;
        let log_path = pg.client_dir().join(format!("steady-{rate}.log"));
        let log = std::fs::File::create(&log_path)?;
        let checkpoint = pg
            .client_dir()
            .join(format!("steady-{rate}.checkpoint.json"));
        let mut child = Command::new(&self.a.walbox)
            .arg("run")
            .env("WALBOX_DSN", pg.conninfo("postgres"))
            .env("WALBOX_SLOT", slot)
            .env("WALBOX_CHECKPOINT", &checkpoint)
            .env("WALBOX_BOOTSTRAP_SERVERS", self.broker.bootstrap())
            .env("WALBOX_CREATE_TOPICS", "true")
            .env("WALBOX_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()?;
        let pid = child.id();
        let ready = Instant::now();
        while !std::fs::read_to_string(&log_path)?.contains("streaming") {
            if ready.elapsed() > Duration::from_secs(60) {
                return Err("walbox did not start streaming".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let total = rate * seconds;
        let started = Instant::now();
        let insert = format!(
            "{INSERT} {} FROM (SELECT $1::bigint AS n) s",
            ROW_SELECT.replacen("'order'", "'steady'", 1)
        );
        let mut writers = Vec::new();
        for w in 0..WRITERS {
            let client = pg.connect("postgres").await?;
            let insert = insert.clone();
            writers.push(tokio::spawn(async move {
                let stmt = client.prepare(&insert).await?;
                let mut i = w;
                while i < total {
                    // Event i is due at i / rate seconds; a writer that falls
                    // behind writes at once (the achieved rate shows it).
                    #[allow(clippy::cast_precision_loss)]
                    let due = started + Duration::from_secs_f64(i as f64 / rate as f64);
                    tokio::time::sleep_until(due.into()).await;
                    let n = i64::try_from(i)?;
                    client.execute(&stmt, &[&n]).await?;
                    i += WRITERS;
                }
                Ok::<_, Error>(())
            }));
        }
        let mut lags = Vec::new();
        while !writers.iter().all(tokio::task::JoinHandle::is_finished) {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let lag: i64 = db
                .query_one(
                    "SELECT coalesce((pg_current_wal_lsn() - confirmed_flush_lsn)::bigint, 0)
                     FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await?
                .get(0);
            lags.push(lag);
        }
        for w in writers {
            w.await??;
        }
        let achieved = total as f64 / started.elapsed().as_secs_f64();
        let target = lsn(db, "SELECT pg_current_wal_lsn()::text").await?;
        let draining = Instant::now();
        loop {
            let done = slot_reached(db, slot, &target).await?;
            if done {
                break;
            }
            if draining.elapsed() > Duration::from_secs(600) {
                return Err(format!("walbox did not catch up after the {rate}/s run").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let drain_seconds = draining.elapsed().as_secs_f64();
        // VmHWM is the high-water mark: one reading at the end holds the peak.
        let peak = usage(pid);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid)?),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        child.wait()?;
        let text = std::fs::read_to_string(&log_path)?;
        let stop_line = text
            .lines()
            .rev()
            .find(|l| l.contains(" stopped"))
            .ok_or("walbox logged no stop line")?;
        let latency = stop_line
            .split("commit_to_ack_ms=")
            .nth(1)
            .map(|rest| rest.trim().trim_matches('"').to_owned())
            .ok_or("walbox's stop line has no latency")?;
        let read_latency = stop_line
            .split("commit_to_read_ms=")
            .nth(1)
            .and_then(|rest| rest.split(" commit_to_ack_ms=").next())
            .map(|v| v.trim().trim_matches('"').to_owned())
            .ok_or("walbox's stop line has no commit-to-read latency")?;
        db.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
            .await?;
        Ok(Steady {
            rate,
            achieved,
            latency,
            read_latency,
            lag_mid: lags.get(lags.len() / 2).copied().unwrap_or(0),
            lag_end: lags.last().copied().unwrap_or(0),
            lag_max: lags.iter().copied().max().unwrap_or(0),
            drain_seconds,
            peak_rss_kb: peak.0,
            cpu_seconds: peak.1,
        })
    }
}
