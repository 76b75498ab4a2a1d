//! Crash loops under load: a writer that commits until told to stop, and rounds
//! of `walbox run` each killed with SIGKILL at a random moment after it made
//! progress.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use walbox_testkit::PgCluster;

use super::{Walbox, checkpoint, confirmed_lsn, wait_slot_released};

/// A pseudo-random number below `n` (fault timing, not synchronisation).
pub fn random_below(n: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
        % n
}

/// One outbox insert for `key` carrying its per-key `seq` in the payload.
pub fn outbox_insert(key: &str, seq: i64) -> String {
    format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', '{key}', 'OrderPlaced', '{{\"seq\": {seq}}}');"
    )
}

/// One writer committing transactions of 5 outbox inserts over 10 keys until
/// stopped; yields how many events it committed.
pub async fn steady_writer(
    pg: &PgCluster,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<usize> {
    steady_writer_with(pg, stop, outbox_insert).await
}

/// [`steady_writer`] with each event's statement made by `event(key, seq)`: an
/// insert, a `pg_logical_emit_message`, or anything else that makes one event.
pub async fn steady_writer_with(
    pg: &PgCluster,
    stop: Arc<AtomicBool>,
    event: fn(&str, i64) -> String,
) -> tokio::task::JoinHandle<usize> {
    let db = pg.connect("postgres").await.unwrap();
    tokio::spawn(async move {
        let mut seq = [0i64; 10];
        let mut n = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let mut sql = String::from("BEGIN;");
            for _ in 0..5 {
                let k = n % 10;
                sql.push_str(&event(&format!("order-{k}"), seq[k]));
                seq[k] += 1;
                n += 1;
            }
            sql.push_str("COMMIT;");
            db.batch_execute(&sql).await.unwrap();
        }
        n
    })
}

/// `rounds` runs of `walbox run` with `env`: each waits until the checkpoint
/// moved past the previous round's, then dies by SIGKILL within 400 ms.
pub async fn kill_9_rounds(
    pg: &PgCluster,
    db: &tokio_postgres::Client,
    env: &[(&str, String)],
    rounds: usize,
) {
    let mut previous = confirmed_lsn(db, "walbox").await;
    for round in 0..rounds {
        let mut walbox = Walbox::spawn(&["run"], env);
        walbox_testkit::wait_until("the checkpoint to move", Duration::from_secs(60), || {
            checkpoint(pg).filter(|c| c.lsn > previous).map(|c| c.lsn)
        })
        .map(|lsn| previous = lsn)
        .unwrap_or_else(|e| panic!("round {round}: {e}\n{}", walbox.log()));
        std::thread::sleep(Duration::from_millis(random_below(400)));
        walbox.kill9();
        wait_slot_released(db, "walbox").await;
    }
}
