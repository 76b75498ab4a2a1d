//! Helpers shared by the end-to-end tests in this directory.
//!
//! Each test file starts its own PostgreSQL cluster and broker through
//! `walbox-testkit`; nothing here talks to a server the test did not start, except
//! a real Kafka named by `WALBOX_TEST_KAFKA`.

#![allow(dead_code)] // each test binary uses a different part

use std::collections::HashMap;

use walbox_pgoutput::{LogicalMessage, Oid, Relation};

/// Tracks Relation messages so Inserts, Updates and Deletes can be read by name.
#[derive(Debug, Default)]
pub struct Relations {
    by_oid: HashMap<Oid, Relation>,
}

impl Relations {
    /// Records `msg` when it is a Relation message.
    pub fn observe(&mut self, msg: &LogicalMessage) {
        if let LogicalMessage::Relation(r) = msg {
            self.by_oid.insert(r.oid, r.clone());
        }
    }

    /// The relation announced for `oid`.
    ///
    /// # Panics
    /// When no Relation message for `oid` came first, which pgoutput never allows.
    #[must_use]
    pub fn get(&self, oid: Oid) -> &Relation {
        self.by_oid
            .get(&oid)
            .unwrap_or_else(|| panic!("change for relation {oid} before its Relation message"))
    }

    /// The qualified name of relation `oid`.
    #[must_use]
    pub fn name(&self, oid: Oid) -> String {
        let r = self.get(oid);
        format!("{}.{}", r.namespace, r.name)
    }
}

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use walbox_testkit::{Broker, PgCluster, kafka::Record, wait_until};

/// A `walbox` process started by a test, with its output in a log file.
pub struct Walbox {
    child: Option<Child>,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Walbox {
    /// Starts `walbox <args>` with `env` (and a quiet-enough log level).
    pub fn spawn(args: &[&str], env: &[(&str, String)]) -> Walbox {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("walbox.log");
        let out = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_walbox"));
        cmd.args(args)
            .env("WALBOX_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Walbox {
            child: Some(cmd.spawn().unwrap()),
            log,
            _dir: dir,
        }
    }

    /// `walbox setup`, then `walbox run`, with the usual environment; returns
    /// the environment for later commands.
    pub fn set_up_and_run(
        pg: &PgCluster,
        broker: &Broker,
    ) -> (Vec<(&'static str, String)>, Walbox) {
        let env = walbox_env(pg, broker);
        setup(&env);
        let walbox = Walbox::spawn(&["run"], &env);
        (env, walbox)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// What the process has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal` to the process.
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
        let _ = nix::sys::signal::kill(pid, signal);
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let child = self.child.as_mut().expect("running");
        let status = wait_until("walbox to exit", timeout, || {
            child.try_wait().ok().flatten()
        })
        .unwrap_or_else(|e| panic!("{e}; log:\n{}", self.log()));
        self.child = None;
        status
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGTERM, and check it stops cleanly (exit 0) within a minute.
    pub fn stop(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        let log = self.log();
        assert_eq!(self.wait(Duration::from_secs(60)).code(), Some(0), "{log}");
    }

    /// SIGKILL, and wait for it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Walbox {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Environment for `walbox` against this cluster and broker.
pub fn walbox_env(pg: &PgCluster, broker: &Broker) -> Vec<(&'static str, String)> {
    vec![
        ("WALBOX_DSN", pg.conninfo("postgres")),
        ("WALBOX_BOOTSTRAP_SERVERS", broker.bootstrap()),
        ("WALBOX_CREATE_TOPICS", "true".into()),
        ("WALBOX_SLOT", "walbox".into()),
        ("WALBOX_PUBLICATION", "walbox_outbox".into()),
        (
            "WALBOX_CHECKPOINT",
            checkpoint_path(pg).display().to_string(),
        ),
    ]
}

/// Where [`walbox_env`] keeps walbox's checkpoint.
pub fn checkpoint_path(pg: &PgCluster) -> std::path::PathBuf {
    pg.client_dir().join("walbox.checkpoint.json")
}

/// walbox's saved checkpoint.
pub fn checkpoint(pg: &PgCluster) -> Option<walbox_core::Checkpoint> {
    walbox_core::CheckpointFile::new(checkpoint_path(pg))
        .load()
        .unwrap()
}

/// Runs `walbox setup` and checks it succeeded.
pub fn setup(env: &[(&str, String)]) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_walbox"));
    cmd.arg("setup");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "walbox setup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The server's current WAL position.
pub async fn current_lsn(db: &tokio_postgres::Client) -> walbox_pgoutput::Lsn {
    let s: String = db
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    s.parse().unwrap()
}

/// The slot's confirmed position.
pub async fn confirmed_lsn(db: &tokio_postgres::Client, slot: &str) -> walbox_pgoutput::Lsn {
    let s: String = db
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    s.parse().unwrap()
}

/// Waits until the slot's confirmed position reaches `target`.
pub async fn wait_confirmed(
    db: &tokio_postgres::Client,
    slot: &str,
    target: walbox_pgoutput::Lsn,
    timeout: Duration,
) {
    walbox_testkit::wait_until_async("the slot to confirm the last commit", timeout, || async {
        (confirmed_lsn(db, slot).await >= target).then_some(())
    })
    .await
    .unwrap();
}

/// The event ids of the outbox table.
pub async fn outbox_ids(db: &tokio_postgres::Client) -> std::collections::HashSet<String> {
    db.query("SELECT id::text FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Reads topic records from a blocking thread.
pub async fn read_topic(bootstrap: &str, topic: &str, at_least: usize) -> Vec<Record> {
    let (b, t) = (bootstrap.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let mut records =
            walbox_testkit::kafka::read_at_least(&b, &t, at_least, Duration::from_secs(120))?;
        // Then everything else the topic holds.
        let all = walbox_testkit::kafka::read_all(&b, &t, Duration::from_secs(120))?;
        if all.len() > records.len() {
            records = all;
        }
        Ok::<_, walbox_testkit::TestkitError>(records)
    })
    .await
    .unwrap()
    .unwrap()
}

/// Missing ids, and ids seen more than once, between the table and the records.
pub fn audit(
    ids: &std::collections::HashSet<String>,
    records: &[Record],
) -> (Vec<String>, Vec<String>) {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for r in records {
        *seen
            .entry(r.header("event_id").unwrap_or_default().to_owned())
            .or_default() += 1;
    }
    let missing = ids
        .iter()
        .filter(|id| !seen.contains_key(*id))
        .cloned()
        .collect();
    let dup = seen
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| id.clone())
        .collect();
    (missing, dup)
}

/// Checks per-key order: within each key, the payload's `seq` grows by one from 0
/// in partition offset order (repeats allowed only as exact replays when
/// `allow_replay`).
pub fn assert_per_key_order(records: &[Record], allow_replay: bool) {
    let mut sorted: Vec<&Record> = records.iter().collect();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    let mut next: HashMap<String, (i32, i64)> = HashMap::new();
    for r in sorted {
        let key = r.key_str().expect("key").to_owned();
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
        let seq = v["payload"]["seq"].as_i64().unwrap();
        let (partition, expected) = next.entry(key.clone()).or_insert((r.partition, 0));
        assert_eq!(*partition, r.partition, "key {key} on two partitions");
        if seq == *expected {
            *expected += 1;
        } else if allow_replay && seq < *expected {
            // A replay after a restart starts again from an earlier event.
            *expected = seq + 1;
        } else {
            panic!("key {key}: seq {seq} where {expected} was expected");
        }
    }
}

/// Exit status code, for assertions.
pub fn code(s: ExitStatus) -> Option<i32> {
    s.code()
}

/// Writers that commit outbox events concurrently. Writer `w` owns the keys
/// `k` with `k % writers == w`, so each key's commit order is its writer's order,
/// recorded as `seq` in the payload.
pub async fn write_events(
    pg: &PgCluster,
    writers: usize,
    txns_per_writer: usize,
    events_per_txn: usize,
    keys: usize,
) {
    write_events_from(pg, writers, txns_per_writer, events_per_txn, keys, 0).await;
}

/// [`write_events`] on the keys `first_key..first_key + keys`, so that rounds of
/// writes can use keys of their own.
pub async fn write_events_from(
    pg: &PgCluster,
    writers: usize,
    txns_per_writer: usize,
    events_per_txn: usize,
    keys: usize,
    first_key: usize,
) {
    let mut tasks = Vec::new();
    for w in 0..writers {
        let mut db = pg.connect("postgres").await.unwrap();
        tasks.push(tokio::spawn(async move {
            let own: Vec<usize> = (0..keys).filter(|k| k % writers == w).collect();
            let mut seq = vec![0i64; own.len()];
            let mut n = 0usize;
            for _ in 0..txns_per_writer {
                let tx = db.transaction().await.unwrap();
                for _ in 0..events_per_txn {
                    let slot = n % own.len();
                    n += 1;
                    let key = format!("order-{}", first_key + own[slot]);
                    let payload = format!(r#"{{"seq": {}, "writer": {w}, "note": "Grüße"}}"#, seq[slot]);
                    seq[slot] += 1;
                    tx.execute(
                        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, schema_version)
                         VALUES ('order', $1, 'OrderPlaced', $2::text::jsonb,
                                 jsonb_build_object('traceparent', '00-' || md5($1) || '-00f067aa0ba902b7-01'), 1)",
                        &[&key, &payload],
                    )
                    .await
                    .unwrap();
                }
                tx.commit().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Kafka's Java client hash: `Utils.murmur2`.
pub fn java_murmur2(key: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = SEED ^ (key.len() as u32);
    let mut chunks = key.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if tail.len() >= 3 {
        h ^= u32::from(tail[2]) << 16;
    }
    if tail.len() >= 2 {
        h ^= u32::from(tail[1]) << 8;
    }
    if !tail.is_empty() {
        h ^= u32::from(tail[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition the Java client's default partitioner picks for `key`.
pub fn java_partition(key: &[u8], partitions: i32) -> i32 {
    (java_murmur2(key) & 0x7fff_ffff) % partitions
}

/// Waits until the slot's confirmed position passes `before`.
pub async fn wait_slot_moves(db: &tokio_postgres::Client, before: walbox_pgoutput::Lsn) {
    walbox_testkit::wait_until_async("the slot to move", Duration::from_secs(60), || async {
        (confirmed_lsn(db, "walbox").await > before).then_some(())
    })
    .await
    .unwrap();
}

/// Waits until the slot has confirmed everything written so far, reads the topic,
/// and checks that it holds every one of the `expected` outbox rows (duplicates
/// are the caller's to judge). Returns the records.
pub async fn assert_all_delivered(
    db: &tokio_postgres::Client,
    bootstrap: &str,
    topic: &str,
    expected: usize,
    after: &str,
) -> Vec<Record> {
    let last = current_lsn(db).await;
    wait_confirmed(db, "walbox", last, Duration::from_secs(120)).await;
    let records = read_topic(bootstrap, topic, expected).await;
    let ids = outbox_ids(db).await;
    assert_eq!(ids.len(), expected);
    let (missing, _) = audit(&ids, &records);
    assert!(
        missing.is_empty(),
        "{} missing after {after}",
        missing.len()
    );
    records
}

/// Waits until walbox's checkpoint reaches `target`.
pub async fn wait_checkpoint(pg: &PgCluster, target: walbox_pgoutput::Lsn, timeout: Duration) {
    walbox_testkit::wait_until_async(
        "the checkpoint to reach the last commit",
        timeout,
        || async { checkpoint(pg).filter(|c| c.lsn >= target).map(drop) },
    )
    .await
    .unwrap();
}

/// Runs a walbox command to its end; returns (exit code, stdout, stderr).
pub fn walbox_cmd(args: &[&str], env: &[(&str, String)]) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_walbox"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Waits until the slot `walbox` has confirmed everything committed so far.
pub async fn wait_caught_up(db: &tokio_postgres::Client) {
    let last = current_lsn(db).await;
    wait_confirmed(db, "walbox", last, Duration::from_secs(60)).await;
}

/// Writes a walbox configuration file beside the cluster; returns its path.
pub fn config_file(pg: &PgCluster, name: &str, toml: &str) -> String {
    let path = pg.client_dir().join(name);
    std::fs::write(&path, toml).unwrap();
    path.display().to_string()
}

/// Resident set size of `pid` in kB.
pub fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// The stdout sink's JSON lines in `output` (other lines skipped), parsed.
pub fn json_lines(output: &str) -> Vec<serde_json::Value> {
    output
        .lines()
        .filter(|l| l.starts_with("{\"topic\""))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}
