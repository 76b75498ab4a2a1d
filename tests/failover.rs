//! A primary failover with PostgreSQL 17 failover slots: a primary and a
//! physical standby (a low-level base backup, streaming through a physical
//! slot) with `sync_replication_slots = on`, walbox streaming through a
//! failover slot over a connection string naming both servers, the primary
//! killed with SIGKILL and the standby promoted. Checked against the new
//! primary's outbox table by the independent audit in `common`. And the
//! takeovers walbox must refuse: a standby that did not synchronize the slot,
//! and one that fell behind the slot because the primary did not wait for it
//! (`synchronized_standby_slots` unset). On servers before 17 each test says so
//! and returns.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use walbox_testkit::{Broker, PgCluster, PgOptions, wait_until_async};

const TOPIC: &str = "outbox.order";

/// The primary with the outbox table, its broker, and whether the server has
/// failover slots (17 and later); says so when it has not.
#[allow(clippy::print_stderr)] // says why the test has nothing to do
async fn primary() -> Option<(PgCluster, Broker, tokio_postgres::Client)> {
    let (pg, broker, db) = servers().await;
    let major = pg.major().unwrap();
    if major < 17 {
        eprintln!(
            "PostgreSQL {major} has no failover slots (17 and later): nothing to test; run \
             with WALBOX_PG_VERSION=17"
        );
        return None;
    }
    Some((pg, broker, db))
}

/// A standby of `primary`, synchronizing slots when `sync_slots`; with
/// `wait_for_standby`, the primary's `synchronized_standby_slots` names the
/// standby's physical slot.
async fn standby(
    primary: &PgCluster,
    db: &tokio_postgres::Client,
    sync_slots: bool,
    wait_for_standby: bool,
) -> PgCluster {
    let options = if sync_slots {
        PgOptions::default().setting("sync_replication_slots", "on")
    } else {
        PgOptions::default()
    };
    let standby = PgCluster::standby_of(primary, options).await.unwrap();
    if wait_for_standby {
        let slot = standby.primary_slot_name().unwrap();
        db.batch_execute(&format!(
            "ALTER SYSTEM SET synchronized_standby_slots = '{slot}'"
        ))
        .await
        .unwrap();
        db.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    }
    standby
}

/// [`primary`] and its [`standby`], walbox set up through [`failover_env`] (the
/// slot made by `walbox setup`); `None` before PostgreSQL 17.
async fn set_up_pair(
    sync_slots: bool,
    wait_for_standby: bool,
) -> Option<(
    PgCluster,
    PgCluster,
    Broker,
    tokio_postgres::Client,
    Vec<(&'static str, String)>,
)> {
    let (primary, broker, db) = self::primary().await?;
    let standby = standby(&primary, &db, sync_slots, wait_for_standby).await;
    let env = failover_env(&primary, &standby, &broker);
    setup(&env);
    Some((primary, standby, broker, db, env))
}

/// Once the standby has the slot, `walbox run` relaying a few transactions,
/// caught up.
async fn streaming(
    primary: &PgCluster,
    standby: &PgCluster,
    db: &tokio_postgres::Client,
    env: &[(&str, String)],
) -> Walbox {
    wait_synced(db, standby).await;
    let walbox = Walbox::spawn(&["run"], env);
    write_events(primary, 2, 5, 3, 6).await;
    wait_caught_up(db).await;
    walbox
}

/// walbox's environment with a connection string naming the primary, then the
/// standby, asking for the one that accepts writes; with a failover slot.
fn failover_env(
    primary: &PgCluster,
    standby: &PgCluster,
    broker: &Broker,
) -> Vec<(&'static str, String)> {
    let mut env = walbox_env(primary, broker);
    for (k, v) in &mut env {
        if *k == "WALBOX_DSN" {
            *v = format!(
                "host={h},{h} port={},{} user={} dbname=postgres connect_timeout=5 \
                 target_session_attrs=read-write",
                primary.port(),
                standby.port(),
                primary.user(),
                h = primary.host(),
            );
        }
    }
    env.push(("WALBOX_FAILOVER", "true".into()));
    env
}

/// Waits until the standby holds slot `walbox` as a synchronized, persistent
/// slot (ready for a failover), asking the primary for the running
/// transactions record the synchronization waits on.
async fn wait_synced(db: &tokio_postgres::Client, standby: &PgCluster) {
    let sdb = standby.connect("postgres").await.unwrap();
    wait_until_async(
        "the standby to synchronize slot walbox",
        Duration::from_secs(120),
        || async {
            let _ = db.execute("SELECT pg_log_standby_snapshot()", &[]).await;
            let row = sdb
                .query_opt(
                    "SELECT synced AND NOT temporary FROM pg_replication_slots
                     WHERE slot_name = 'walbox'",
                    &[],
                )
                .await
                .ok()??;
            row.get::<_, bool>(0).then_some(())
        },
    )
    .await
    .unwrap();
}

/// Writers committing transactions of 3 events on their own keys (`seq` per
/// key from 0) until told to stop or their server goes away.
async fn writers_until_gone(
    pg: &PgCluster,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for w in 0..3 {
        let db = pg.connect("postgres").await.unwrap();
        let stop = Arc::clone(&stop);
        tasks.push(tokio::spawn(async move {
            let mut seq = [0i64; 4];
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let mut sql = String::from("BEGIN;");
                for _ in 0..3 {
                    let k = n % 4;
                    sql.push_str(&format!(
                        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                         VALUES ('order', 'order-{w}-{k}', 'OrderPlaced', '{{\"seq\": {}}}');",
                        seq[k]
                    ));
                    seq[k] += 1;
                    n += 1;
                }
                sql.push_str("COMMIT;");
                if db.batch_execute(&sql).await.is_err() {
                    return; // the server is gone: what it committed is the table's to say
                }
            }
        }));
    }
    tasks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_with_the_synced_slot_takes_over_and_nothing_is_lost() {
    let Some((mut primary, standby, broker, db, env)) = set_up_pair(true, true).await else {
        return;
    };
    let failover: bool = db
        .query_one(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = 'walbox'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(failover, "--failover made the slot a failover slot");
    wait_synced(&db, &standby).await;

    let mut walbox = Walbox::spawn(&["run"], &env);
    let stop = Arc::new(AtomicBool::new(false));
    let writers = writers_until_gone(&primary, Arc::clone(&stop)).await;
    // walbox has published part of what is being written when the primary dies.
    wait_slot_moves(&db, current_lsn(&db).await).await;
    wait_slot_moves(&db, current_lsn(&db).await).await;
    // The new primary waits for no standby, and walbox says so there; not here.
    let log = walbox.log();
    assert!(
        !log.contains("synchronized_standby_slots is empty"),
        "no warning while the primary waits for the standby:\n{log}"
    );
    primary.kill9().unwrap();
    for w in writers {
        w.await.unwrap();
    }
    standby.promote().await.unwrap();

    // The new primary gets writes of its own, on keys of their own.
    let sdb = standby.connect("postgres").await.unwrap();
    write_events_from(&standby, 2, 20, 3, 6, 1000).await;
    let last = current_lsn(&sdb).await;
    wait_confirmed(&sdb, "walbox", last, Duration::from_secs(120)).await;
    assert!(
        walbox.running(),
        "walbox resumed by itself:\n{}",
        walbox.log()
    );
    let log = walbox.log();
    assert!(
        log.contains("synchronized from the old primary"),
        "took over through the synced slot:\n{log}"
    );

    let ids = outbox_ids(&sdb).await;
    let records = read_topic(&broker.bootstrap(), TOPIC, ids.len()).await;
    walbox.stop();
    let (missing, _) = audit(&ids, &records);
    assert!(
        missing.is_empty(),
        "{} events of the new primary missing",
        missing.len()
    );
    let published: HashSet<String> = records
        .iter()
        .map(|r| r.header("event_id").unwrap().to_owned())
        .collect();
    let phantoms = published.difference(&ids).count();
    assert_eq!(
        phantoms, 0,
        "events published that the new primary does not have"
    );
    assert_duplicates_are_replays(&records);
    assert_per_key_order(&records, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_makes_the_snapshots_slot_a_failover_slot_and_is_refused_before_17() {
    let (pg, broker, db) = servers().await;
    let mut env = walbox_env(&pg, &broker);
    env.push(("WALBOX_FAILOVER", "true".into()));
    let major = pg.major().unwrap();
    let (status, _, stderr) = walbox_cmd(&["setup", "--snapshot"], &env);
    if major < 17 {
        assert_ne!(status, Some(0), "{stderr}");
        assert!(
            stderr.contains(&format!("server is PostgreSQL {major}"))
                && stderr.contains("needs PostgreSQL 17"),
            "{stderr}"
        );
        let slots: i64 = db
            .query_one("SELECT count(*) FROM pg_replication_slots", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(slots, 0, "no slot created");
        return;
    }
    assert_eq!(status, Some(0), "{stderr}");
    let failover: bool = db
        .query_one(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = 'walbox'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(failover, "the slot is created with FAILOVER");
}

/// Runs walbox until it exits after the promotion; returns its log.
async fn refused_after_promotion(
    primary: &mut PgCluster,
    standby: &PgCluster,
    walbox: &mut Walbox,
) -> String {
    primary.kill9().unwrap();
    standby.promote().await.unwrap();
    let status = walbox.wait(Duration::from_secs(120));
    let log = walbox.log();
    assert_ne!(
        code(status),
        Some(0),
        "walbox must refuse the takeover:\n{log}"
    );
    log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_without_slot_synchronization_is_refused_with_the_recovery_steps() {
    let Some((mut primary, standby, _broker, db, env)) = set_up_pair(false, true).await else {
        return;
    };
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&primary, 2, 10, 3, 6).await;
    wait_caught_up(&db).await;
    let cp = checkpoint(&primary).unwrap().lsn;

    let log = refused_after_promotion(&mut primary, &standby, &mut walbox).await;
    assert!(log.contains("has no slot"), "{log}");
    assert!(log.contains("sync_replication_slots = on"), "{log}");
    assert!(log.contains(&format!("checkpoint at {cp}")), "{log}");
    assert!(log.contains("walbox setup --snapshot"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_behind_the_slot_is_refused_with_the_range() {
    // Slot synchronization on, but the primary does not wait for the standby.
    let Some((mut primary, standby, _broker, db, env)) = set_up_pair(true, false).await else {
        return;
    };
    let mut walbox = streaming(&primary, &standby, &db, &env).await;

    // The standby stops receiving; walbox goes on past what it has.
    let sdb = standby.connect("postgres").await.unwrap();
    sdb.batch_execute("ALTER SYSTEM SET primary_conninfo = ''")
        .await
        .unwrap();
    sdb.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    wait_until_async(
        "the standby's WAL receiver to stop",
        Duration::from_secs(60),
        || async {
            let n: i64 = sdb
                .query_one("SELECT count(*) FROM pg_stat_wal_receiver", &[])
                .await
                .ok()?
                .get(0);
            (n == 0).then_some(())
        },
    )
    .await
    .unwrap();
    write_events_from(&primary, 2, 20, 3, 6, 100).await;
    wait_caught_up(&db).await;
    let cp = checkpoint(&primary).unwrap().lsn;

    let log = refused_after_promotion(&mut primary, &standby, &mut walbox).await;
    assert!(
        log.contains("WARN") && log.contains("synchronized_standby_slots is empty"),
        "the risk was named while streaming:\n{log}"
    );
    assert!(log.contains("before walbox's checkpoint"), "{log}");
    assert!(
        log.contains(&cp.to_string()),
        "the range ends at the checkpoint {cp}:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_standby_says_what_to_fix_until_the_standby_can_take_over() {
    let Some((primary, broker, db)) = self::primary().await else {
        return;
    };
    let standby = standby(&primary, &db, false, false).await;
    let mut env = walbox_env(&primary, &broker);
    setup(&env);
    // Without --standby, a failover slot on a primary that waits for no standby
    // is a warning with the setting to fix.
    let mut plain = env.clone();
    plain.push(("WALBOX_FAILOVER", "true".into()));
    let (_, out, err) = walbox_cmd(&["doctor"], &plain);
    assert!(
        out.contains(
            "warn source.failover is on but the primary's synchronized_standby_slots is empty"
        ),
        "{out}{err}"
    );
    env.push(("WALBOX_STANDBY_DSN", standby.conninfo("postgres")));
    let physical = standby.primary_slot_name().unwrap().to_owned();

    let (status, out, err) = walbox_cmd(&["doctor"], &env);
    assert_ne!(status, Some(0), "{out}{err}");
    for fix in [
        "FAIL standby: sync_replication_slots = off",
        "set sync_replication_slots = on on the standby",
        "ok   standby: hot_standby_feedback = on",
        &format!("ok   standby: primary_slot_name = {physical}"),
        "ok   standby: primary_conninfo names a dbname",
        "FAIL primary: synchronized_standby_slots = '' does not name",
        &format!("synchronized_standby_slots = '{physical}'"),
        &format!("ok   primary: physical slot {physical} is in use by the standby"),
        "FAIL primary: slot walbox is not a failover slot",
        "FAIL standby: no slot walbox yet",
    ] {
        assert!(out.contains(fix), "{fix:?} in:\n{out}");
    }

    // Each fix as the report says it.
    let sdb = standby.connect("postgres").await.unwrap();
    sdb.batch_execute("ALTER SYSTEM SET sync_replication_slots = on")
        .await
        .unwrap();
    sdb.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    db.batch_execute(&format!(
        "ALTER SYSTEM SET synchronized_standby_slots = '{physical}'"
    ))
    .await
    .unwrap();
    db.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    let (status, out, err) = walbox_cmd(&["slot", "create", "--failover"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("slot walbox is now a failover slot"), "{out}");
    wait_synced(&db, &standby).await;

    let (status, out, err) = walbox_cmd(&["doctor"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(
        out.contains("ok   standby: slot walbox is synchronized (synced = true), confirmed at"),
        "{out}"
    );
    assert!(!out.contains("FAIL"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_primary_back_beside_the_promoted_one_is_refused_naming_both() {
    let Some((mut primary, standby, _broker, db, env)) = set_up_pair(true, true).await else {
        return;
    };
    let mut walbox = streaming(&primary, &standby, &db, &env).await;
    walbox.stop();
    drop(db);

    // The failover, then the old primary restarts as a primary of its own, on
    // the timeline walbox's checkpoint has, first in the connection string.
    primary.kill9().unwrap();
    standby.promote().await.unwrap();
    write_events_from(&standby, 2, 5, 3, 6, 100).await;
    primary.start_again().unwrap();

    let mut walbox = Walbox::spawn(&["run"], &env);
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_ne!(code(status), Some(0), "refused, not streamed:\n{log}");
    let (a, b) = (
        format!("{}:{}", primary.host(), primary.port()),
        format!("{}:{}", standby.host(), standby.port()),
    );
    assert!(log.contains("two primaries"), "{log}");
    assert!(log.contains(&format!("{a} (timeline 1)")), "{log}");
    assert!(log.contains(&format!("{b} (timeline 2)")), "{log}");
    assert!(log.contains("fence"), "{log}");
    assert_eq!(
        log.matches("session ended").count(),
        0,
        "refused at once, not retried:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_on_a_promoted_server_does_not_let_run_skip_the_takeover_check() {
    // No slot synchronization: the standby's slot of walbox's name is its own.
    let Some((mut primary, standby, _broker, db, env)) = set_up_pair(false, false).await else {
        return;
    };
    let sdb = standby.connect("postgres").await.unwrap();
    let create = tokio::spawn(async move {
        sdb.query_one(
            "SELECT lsn::text FROM pg_create_logical_replication_slot('walbox', 'pgoutput')",
            &[],
        )
        .await
        .map(|row| row.get::<_, String>(0))
    });
    wait_until_async(
        "the standby to create its own slot walbox",
        Duration::from_secs(120),
        || async {
            let _ = db.execute("SELECT pg_log_standby_snapshot()", &[]).await;
            create.is_finished().then_some(())
        },
    )
    .await
    .unwrap();
    let standby_slot: walbox_pgoutput::Lsn = create.await.unwrap().unwrap().parse().unwrap();

    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&primary, 2, 5, 3, 6).await;
    wait_caught_up(&db).await;
    walbox.stop();
    let cp = checkpoint(&primary).unwrap();
    assert_eq!(cp.timeline, Some(1));
    let sdb = standby.connect("postgres").await.unwrap();
    let end = current_lsn(&db).await;
    wait_until_async("the standby to replay", Duration::from_secs(60), || async {
        let at: String = sdb
            .query_one("SELECT pg_last_wal_replay_lsn()::text", &[])
            .await
            .ok()?
            .get(0);
        (at.parse::<walbox_pgoutput::Lsn>().ok()? >= end).then_some(())
    })
    .await
    .unwrap();
    drop(db);
    primary.kill9().unwrap();
    standby.promote().await.unwrap();

    let from = standby_slot.to_string();
    let (status, out, err) = walbox_cmd(&["replay", "--from", &from], &env);
    assert_ne!(status, Some(0), "replay refused:\n{out}{err}");
    assert!(err.contains("not synchronized"), "{err}");
    assert_eq!(
        checkpoint(&primary).unwrap().timeline,
        Some(1),
        "the checkpoint keeps the timeline of the last good takeover"
    );
    let mut walbox = Walbox::spawn(&["run"], &env);
    let status = walbox.wait(Duration::from_secs(60));
    let log = walbox.log();
    assert_ne!(code(status), Some(0), "refused:\n{log}");
    assert!(log.contains("not synchronized"), "{log}");
}
