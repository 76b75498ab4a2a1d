//! Positions: the server's WAL position, the slot's confirmed position and
//! walbox's checkpoint, and waiting until they reach a target.

use std::time::Duration;

use walbox_testkit::PgCluster;

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

/// Waits until no walsender holds `slot`: after a walbox is killed its
/// walsender holds the slot until it notices, and a walbox started before that
/// is refused ("in use by pid"), as a supervisor's restart delay avoids.
pub async fn wait_slot_released(db: &tokio_postgres::Client, slot: &str) {
    walbox_testkit::wait_until_async(
        "the killed walbox's walsender to release the slot",
        Duration::from_secs(60),
        || async {
            let active: bool = db
                .query_one(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .unwrap()
                .get(0);
            (!active).then_some(())
        },
    )
    .await
    .unwrap();
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

/// Waits until the slot's confirmed position passes `before`.
pub async fn wait_slot_moves(db: &tokio_postgres::Client, before: walbox_pgoutput::Lsn) {
    walbox_testkit::wait_until_async("the slot to move", Duration::from_secs(60), || async {
        (confirmed_lsn(db, "walbox").await > before).then_some(())
    })
    .await
    .unwrap();
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

/// Waits until the slot `walbox` has confirmed everything committed so far.
pub async fn wait_caught_up(db: &tokio_postgres::Client) {
    let last = current_lsn(db).await;
    wait_confirmed(db, "walbox", last, Duration::from_secs(60)).await;
}
