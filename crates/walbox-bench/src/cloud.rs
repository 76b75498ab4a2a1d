//! What the cloud destinations' scenarios (Pub/Sub, Kinesis, SQS, SNS) do
//! alike: a backlog of rows in transactions of 10 under a slot of the
//! scenario's own, walbox run on it until the slot confirms the last commit,
//! and a plain client's per-key lanes (one call per key in flight, as walbox
//! keeps them) to time against.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::Error;
use crate::contenders::{checkpoint_file, lsn, usage};
use crate::scenarios::{Bench, INSERT, ROW_SELECT};

/// walbox's side of one scenario.
#[derive(Debug, Clone, Copy)]
pub struct WalboxDrain {
    pub seconds: f64,
    pub cpu_seconds: f64,
    pub peak_rss_kb: u64,
}

impl Bench {
    /// Writes `events` rows (transactions of 10, over the backlog's 1,000
    /// keys) under a new slot `slot`, then runs walbox with configuration
    /// `config` and environment `env` from its start until the slot
    /// confirms the last commit; the slot is dropped afterwards.
    pub async fn drain_backlog(
        &self,
        slot: &str,
        events: u64,
        config: &Path,
        env: &[(&'static str, String)],
    ) -> Result<WalboxDrain, Error> {
        self.db.batch_execute("TRUNCATE outbox").await?;
        self.db
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&slot],
            )
            .await?;
        self.db
            .batch_execute(&format!(
                "DO $$
                 BEGIN
                   FOR t IN 0..{last} LOOP
                     {INSERT} {ROW_SELECT} FROM generate_series(t * 10, t * 10 + 9) n;
                     COMMIT;
                   END LOOP;
                 END $$;",
                last = events / 10 - 1
            ))
            .await?;
        let end = lsn(&self.db, "SELECT pg_current_wal_lsn()::text").await?;
        let started = Instant::now();
        let mut child = Command::new(&self.a.walbox)
            .arg("run")
            .env("WALBOX_CONFIG", config)
            .env("WALBOX_DSN", self.pg.conninfo("postgres"))
            .env("WALBOX_SLOT", slot)
            .env("WALBOX_CHECKPOINT", checkpoint_file(&self.pg, slot))
            .env("WALBOX_LOG", "warn")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()?;
        let deadline = started + Duration::from_secs(3_600);
        loop {
            let done: bool = self
                .db
                .query_one(
                    "SELECT confirmed_flush_lsn >= $1::text::pg_lsn FROM pg_replication_slots \
                     WHERE slot_name = $2",
                    &[&end, &slot],
                )
                .await?
                .get(0);
            if done {
                break;
            }
            if Instant::now() > deadline || child.try_wait()?.is_some() {
                let _ = child.kill();
                return Err(format!("{slot}: walbox did not confirm the last commit").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let seconds = started.elapsed().as_secs_f64();
        let (peak_rss_kb, cpu_seconds) = usage(child.id());
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(child.id())?),
            nix::sys::signal::Signal::SIGTERM,
        );
        child.wait()?;
        self.db
            .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
            .await?;
        Ok(WalboxDrain {
            seconds,
            cpu_seconds,
            peak_rss_kb,
        })
    }
}

/// Sends every key's messages in order the way walbox's lanes do: a call
/// takes the head of up to `batch` keys that have nothing out, at most
/// `calls` calls are out at once, and a key's next message goes once the
/// call holding its last one has answered. `send` makes one call and fails
/// on any message not stored. The seconds from the first call to the last
/// answer.
pub async fn per_key_lanes<M, F, Fut>(
    by_key: BTreeMap<Vec<u8>, Vec<M>>,
    batch: usize,
    calls: usize,
    send: F,
) -> Result<f64, Error>
where
    M: Send + 'static,
    F: Fn(Vec<M>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send,
{
    struct Lanes<M> {
        /// Keys with a message to send and nothing out.
        ready: VecDeque<usize>,
        queues: Vec<VecDeque<M>>,
        /// Keys with a message out or to send.
        open: usize,
    }
    let queues: Vec<VecDeque<M>> = by_key.into_values().map(VecDeque::from).collect();
    let lanes = Arc::new(Mutex::new(Lanes {
        ready: (0..queues.len()).collect(),
        open: queues.len(),
        queues,
    }));
    let changed = Arc::new(tokio::sync::Notify::new());
    let send = Arc::new(send);
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..calls {
        let (lanes, changed, send) = (Arc::clone(&lanes), Arc::clone(&changed), Arc::clone(&send));
        workers.spawn(async move {
            loop {
                let notified = changed.notified();
                let taken: Vec<(usize, M)> = {
                    let mut l = lanes.lock().map_err(|_| "a worker panicked".to_owned())?;
                    if l.open == 0 {
                        changed.notify_waiters();
                        return Ok::<(), String>(());
                    }
                    let n = l.ready.len().min(batch);
                    let keys: Vec<usize> = l.ready.drain(..n).collect();
                    keys.into_iter()
                        .filter_map(|k| Some((k, l.queues[k].pop_front()?)))
                        .collect()
                };
                if taken.is_empty() {
                    notified.await;
                    continue;
                }
                let (keys, messages): (Vec<usize>, Vec<M>) = taken.into_iter().unzip();
                send(messages).await?;
                let mut l = lanes.lock().map_err(|_| "a worker panicked".to_owned())?;
                for k in keys {
                    if l.queues[k].is_empty() {
                        l.open -= 1;
                    } else {
                        l.ready.push_back(k);
                    }
                }
                changed.notify_waiters();
            }
        });
    }
    while let Some(worker) = workers.join_next().await {
        worker??;
    }
    Ok(started.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lanes_send_every_message_once_each_key_in_order_one_call_per_key() {
        let mut by_key: BTreeMap<Vec<u8>, Vec<(u8, u32)>> = BTreeMap::new();
        for k in 0..7u8 {
            by_key.insert(
                vec![k],
                (0..(u32::from(k) * 3 + 1)).map(|i| (k, i)).collect(),
            );
        }
        let seen: Arc<Mutex<Vec<(u8, u32)>>> = Arc::default();
        let out = Arc::new(Mutex::new(std::collections::HashSet::new()));
        let (s, o) = (Arc::clone(&seen), Arc::clone(&out));
        per_key_lanes(by_key, 3, 4, move |batch: Vec<(u8, u32)>| {
            let (s, o) = (Arc::clone(&s), Arc::clone(&o));
            async move {
                assert!(batch.len() <= 3);
                for (k, _) in &batch {
                    assert!(o.lock().unwrap().insert(*k), "key {k} had two out");
                }
                tokio::task::yield_now().await;
                for (k, _) in &batch {
                    o.lock().unwrap().remove(k);
                }
                s.lock().unwrap().extend(batch);
                Ok(())
            }
        })
        .await
        .unwrap();
        let seen = seen.lock().unwrap();
        for k in 0..7u8 {
            let of_key: Vec<u32> = seen.iter().filter(|m| m.0 == k).map(|m| m.1).collect();
            assert_eq!(of_key, (0..(u32::from(k) * 3 + 1)).collect::<Vec<_>>());
        }
    }
}
