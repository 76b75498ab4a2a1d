//! walbox's checkpoint against the slot: resume, the mismatch rules, replay from
//! a saved LSN, a lost slot, and a standby relay waiting for the slot.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use walbox_testkit::{Broker, PgCluster, PgOptions};

const TOPIC: &str = "outbox.order";

async fn start() -> (PgCluster, Broker, tokio_postgres::Client) {
    servers().await
}

/// A config file with a replay window.
fn window_config(pg: &PgCluster, window: &str) -> String {
    config_file(
        pg,
        "window.toml",
        &format!("[source]\nreplay_window = \"{window}\"\n"),
    )
}

/// How many records each event id has.
fn counts(records: &[walbox_testkit::kafka::Record]) -> HashMap<String, usize> {
    let mut n = HashMap::new();
    for r in records {
        *n.entry(r.header("event_id").unwrap().to_owned())
            .or_default() += 1;
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_behind_the_checkpoint_resumes_at_the_checkpoint_without_duplicates() {
    let (pg, broker, db) = start().await;
    let env = walbox_env(&pg, &broker);
    setup(&env);
    let slot_start = confirmed_lsn(&db, "walbox").await;
    // A replay window keeps the slot where it is while walbox publishes: the same
    // state a server crash leaves when the slot's position was not yet saved.
    let cfg = window_config(&pg, "1h");
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    write_events(&pg, 2, 50, 10, 20).await;
    wait_checkpoint(&pg, current_lsn(&db).await, Duration::from_secs(60)).await;
    walbox.stop();
    assert_eq!(
        confirmed_lsn(&db, "walbox").await,
        slot_start,
        "the window held the slot"
    );
    assert!(checkpoint(&pg).unwrap().lsn > slot_start);

    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events_from(&pg, 2, 10, 10, 20, 20).await;
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, 1_200, "restart").await;
    let log = walbox.log();
    walbox.stop();
    assert!(log.contains("starting at the checkpoint"), "{log}");
    let dup: Vec<_> = counts(&records)
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .collect();
    assert!(dup.is_empty(), "{} events published twice", dup.len());
    assert_eq!(records.len(), 1_200);
    assert_per_key_order(&records, false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_publishes_a_range_again_and_run_continues_after_it() {
    let (pg, broker, db) = start().await;
    let env = walbox_env(&pg, &broker);
    setup(&env);
    let slot_start = confirmed_lsn(&db, "walbox").await;
    let cfg = window_config(&pg, "1h");
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    let (code, out, _) = walbox_cmd(&["doctor"], &env);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("walbox run starts at"), "{out}");
    write_events(&pg, 1, 50, 10, 10).await; // 500 events
    let middle = current_lsn(&db).await;
    write_events_from(&pg, 1, 30, 10, 10, 10).await; // 300 more, keys 10..19
    let end = current_lsn(&db).await;
    wait_checkpoint(&pg, end, Duration::from_secs(60)).await;

    // Replay needs the slot to itself.
    let (code, _, err) = walbox_cmd(&["replay", "--from", &middle.to_string()], &env);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("needs slot \"walbox\" to itself"), "{err}");
    walbox.stop();
    let (code, out, err) = walbox_cmd(&["slot", "status", "--json", "--config", &cfg], &env);
    assert_eq!(code, Some(0), "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    let c = &status[0]["checkpoint"];
    assert_eq!(c["lsn"], checkpoint(&pg).unwrap().lsn.to_string());
    assert_eq!(c["replay_window"], "1h");
    let behind = end.as_u64() - slot_start.as_u64();
    assert!(c["slot_behind_bytes"].as_u64().unwrap() >= behind, "{c}");
    let first = read_topic(&broker.bootstrap(), TOPIC, 800).await;
    assert_eq!(first.len(), 800);

    // Outside the window: refused, naming the earliest position still there.
    let (code, _, err) = walbox_cmd(&["replay", "--from", "0/10"], &env);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "earliest position still available is {slot_start}"
        )),
        "{err}"
    );

    let (code, out, err) = walbox_cmd(&["replay", "--from", &middle.to_string()], &env);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("replayed 300 events"), "{out}\n{err}");
    let records = read_topic(&broker.bootstrap(), TOPIC, 1_100).await;
    assert_eq!(records.len(), 1_100);
    // The replayed events are exactly those after `middle`, with the same ids
    // and source positions.
    let n = counts(&records);
    let mut positions: HashMap<String, Vec<(String, String)>> = HashMap::new();
    for r in &records {
        positions
            .entry(r.header("event_id").unwrap().to_owned())
            .or_default()
            .push((
                r.header("walbox_commit_lsn").unwrap().to_owned(),
                r.header("walbox_index").unwrap().to_owned(),
            ));
    }
    for r in &records {
        let id = r.header("event_id").unwrap();
        let at: walbox_pgoutput::Lsn = r.header("walbox_commit_lsn").unwrap().parse().unwrap();
        let expected = if at >= middle { 2 } else { 1 };
        assert_eq!(n[id], expected, "event at {at}");
        let p = &positions[id];
        assert!(
            p.iter().all(|x| *x == p[0]),
            "a replayed event keeps its position"
        );
    }
    assert_per_key_order(&records, true);

    // Run continues after the replayed range: the next events once, nothing again.
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events_from(&pg, 1, 10, 10, 10, 20).await;
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    walbox.stop();
    let records = read_topic(&broker.bootstrap(), TOPIC, 1_200).await;
    assert_eq!(
        records.len(),
        1_200,
        "100 new events, nothing replayed again"
    );
    assert_eq!(outbox_ids(&db).await.len(), counts(&records).len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_ahead_of_the_checkpoint_or_recreated_is_refused_unless_accepted() {
    let (pg, broker, db) = start().await;
    let (env, mut walbox) = Walbox::set_up_and_run(&pg, &broker);
    write_events(&pg, 1, 1, 10, 10).await;
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    walbox.stop();

    // While walbox is down, five events are committed and someone moves the slot.
    write_events_from(&pg, 1, 1, 5, 5, 100).await;
    let skipped_from = checkpoint(&pg).unwrap().lsn;
    db.execute(
        "SELECT pg_replication_slot_advance('walbox', pg_current_wal_lsn())",
        &[],
    )
    .await
    .unwrap();
    let slot_at = confirmed_lsn(&db, "walbox").await;
    let (code, _, err) = walbox_cmd(&["run"], &env);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "committed between {skipped_from} and {slot_at} were never published"
        )),
        "{err}"
    );
    assert!(err.contains("--accept-slot-position"), "{err}");
    assert_eq!(confirmed_lsn(&db, "walbox").await, slot_at, "nothing moved");
    // doctor says the same before anyone starts walbox.
    let (code, out, _) = walbox_cmd(&["doctor"], &env);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("FAIL") && out.contains("were never published"),
        "{out}"
    );

    // The operator accepts: walbox continues from the slot.
    let mut walbox = Walbox::spawn(&["run", "--accept-slot-position"], &env);
    write_events_from(&pg, 1, 1, 3, 3, 200).await;
    let last = current_lsn(&db).await;
    wait_confirmed(&db, "walbox", last, Duration::from_secs(60)).await;
    walbox.stop();
    let records = read_topic(&broker.bootstrap(), TOPIC, 13).await;
    assert_eq!(
        records.len(),
        13,
        "10 before, 3 after; the 5 skipped as accepted"
    );

    // The slot dropped and created again while walbox is down: refused as well.
    let (code, _, err) = walbox_cmd(&["slot", "drop"], &env);
    assert_eq!(code, Some(0), "{err}");
    write_events_from(&pg, 1, 1, 2, 2, 300).await;
    setup(&env);
    let (code, _, err) = walbox_cmd(&["run"], &env);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("were never published"), "{err}");
    // With the slot gone entirely, walbox says it was dropped.
    let (code, _, _) = walbox_cmd(&["slot", "drop"], &env);
    assert_eq!(code, Some(0));
    let (code, _, err) = walbox_cmd(&["run"], &env);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("the slot was dropped"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_stops_walbox_at_once_with_the_recovery_steps() {
    let (pg, broker, db) = servers_with(
        PgOptions::default().setting("max_slot_wal_keep_size", "1MB"),
        walbox_testkit::BrokerOptions::default(),
    )
    .await;
    let (env, mut walbox) = Walbox::set_up_and_run(&pg, &broker);
    write_events(&pg, 1, 1, 10, 10).await;
    wait_checkpoint(&pg, current_lsn(&db).await, Duration::from_secs(60)).await;
    walbox.stop();
    // Past max_slot_wal_keep_size while walbox is down: the next checkpoint
    // invalidates the slot.
    db.batch_execute("CREATE TABLE filler (b text)")
        .await
        .unwrap();
    walbox_testkit::wait_until_async(
        "the slot to be invalidated",
        Duration::from_secs(120),
        || async {
            db.batch_execute(
                "INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 20000);
             SELECT pg_switch_wal(); CHECKPOINT;",
            )
            .await
            .unwrap();
            let status: Option<String> = db
                .query_one(
                    "SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'walbox'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            (status.as_deref() == Some("lost")).then_some(())
        },
    )
    .await
    .unwrap();
    let began = std::time::Instant::now();
    let (code, _, err) = walbox_cmd(&["run"], &env);
    assert_eq!(code, Some(1), "{err}");
    assert!(began.elapsed() < Duration::from_secs(30), "no retry loop");
    assert!(err.contains("wal_status = lost"), "{err}");
    assert!(
        err.contains("walbox's checkpoint") && err.contains("--snapshot"),
        "{err}"
    );
    // 17+ names the reason; before, the cause is inferred.
    let major = pg.major().unwrap();
    assert_eq!(
        err.contains("invalidation_reason = wal_removed"),
        major >= 17,
        "PostgreSQL {major}: {err}"
    );
    assert!(err.contains("max_slot_wal_keep_size"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_waits_for_the_slot_and_takes_over_when_the_holder_dies() {
    let (pg, broker, db) = start().await;
    let (env, mut first) = Walbox::set_up_and_run(&pg, &broker);
    write_events(&pg, 1, 5, 10, 10).await;
    wait_caught_up(&db).await;
    // Without --wait-for-slot a second relay is refused, naming the holder.
    let (code, _, err) = walbox_cmd(&["run"], &env);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("is in use by pid") && err.contains("--wait-for-slot"),
        "{err}"
    );

    let mut standby = Walbox::spawn(&["run", "--wait-for-slot"], &env);
    walbox_testkit::wait_until("the standby to wait", Duration::from_secs(30), || {
        standby
            .log()
            .contains("waiting for it to be released")
            .then_some(())
    })
    .unwrap();
    first.kill9();
    write_events_from(&pg, 1, 5, 10, 10, 10).await;
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, 100, "takeover").await;
    assert_per_key_order(&records, true);
    assert!(standby.log().contains("taking over"), "{}", standby.log());
    standby.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_inside_a_large_transaction_skips_its_acknowledged_events() {
    let (pg, broker, db) = start().await;
    let env = walbox_env(&pg, &broker);
    setup(&env);
    // One transaction of 30,000 events over 10 keys.
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'order-' || (g % 10), 'OrderPlaced', jsonb_build_object('seq', g / 10)
         FROM generate_series(0, 29999) g ORDER BY g",
        &[],
    )
    .await
    .unwrap();
    let slow = config_file(&pg, "slow.toml", "[sink]\nmax_in_flight = 5\n");
    let mut walbox = Walbox::spawn(&["run", "--config", &slow], &env);
    walbox_testkit::wait_until(
        "part of the transaction to be acknowledged",
        Duration::from_secs(120),
        || {
            checkpoint(&pg)
                .and_then(|c| c.partial)
                .filter(|p| p.events >= 3_000)
                .map(drop)
        },
    )
    .unwrap();
    walbox.kill9();
    wait_slot_released(&db, "walbox").await;
    let saved = checkpoint(&pg).unwrap().partial.unwrap();
    assert!(saved.events < 30_000, "killed inside the transaction");

    let mut walbox = Walbox::spawn(&["run"], &env);
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, 30_000, "restart").await;
    let log = walbox.log();
    walbox.stop();
    assert!(log.contains("resuming inside a transaction"), "{log}");
    let n = counts(&records);
    for r in &records {
        let index: u64 = r.header("walbox_index").unwrap().parse().unwrap();
        if index < saved.events {
            assert_eq!(
                n[r.header("event_id").unwrap()],
                1,
                "event {index} was acknowledged before the kill"
            );
        }
    }
    assert!(
        records.len() <= 60_000 - usize::try_from(saved.events).unwrap(),
        "{} records",
        records.len()
    );
    assert_per_key_order(&records, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_another_cluster_is_refused() {
    let (pg, broker, db) = start().await;
    let (env, mut walbox) = Walbox::set_up_and_run(&pg, &broker);
    write_events(&pg, 1, 1, 10, 10).await;
    wait_checkpoint(&pg, current_lsn(&db).await, Duration::from_secs(60)).await;
    walbox.stop();
    let path = checkpoint_path(&pg);
    let mine = std::fs::read_to_string(&path).unwrap();
    let mut other: serde_json::Value = serde_json::from_str(&mine).unwrap();
    other["system_identifier"] = "7000000000000000001".into();
    std::fs::write(&path, other.to_string()).unwrap();
    let (code, _, err) = walbox_cmd(&["run"], &env);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("on cluster 7000000000000000001"), "{err}");
    assert!(
        err.contains("give each relay its own checkpoint path"),
        "{err}"
    );
    std::fs::write(&path, mine).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_position_after_what_was_published_is_refused_unless_the_skip_is_accepted() {
    let (pg, broker, db) = start().await;
    let env = walbox_env(&pg, &broker);
    setup(&env);
    let slot_at = confirmed_lsn(&db, "walbox").await;
    write_events(&pg, 1, 1, 5, 5).await;
    let after = current_lsn(&db).await;

    // `replay` names its own flag.
    let (code, _, err) = walbox_cmd(&["replay", "--from", "0/100"], &env);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "--from 0/100 is before slot \"walbox\"'s confirmed position; the earliest \
             position still available is {slot_at}"
        )),
        "{err}"
    );
    assert!(!err.contains("--from-lsn"), "{err}");

    // No checkpoint yet: a start after the slot's position would skip the five.
    let refused = |from: walbox_pgoutput::Lsn| {
        let mut walbox = Walbox::spawn(&["run", "--from-lsn", &from.to_string()], &env);
        let status = walbox.wait(Duration::from_secs(60));
        let log = walbox.log();
        assert_eq!(status.code(), Some(1), "{log}");
        assert!(log.contains("--accept-skip"), "{log}");
        log
    };
    let log = refused(after);
    assert!(
        log.contains(&format!(
            "after slot \"walbox\"'s confirmed position at {slot_at}: outbox events committed \
             between {slot_at} and {after} would never be published"
        )),
        "{log}"
    );
    assert_eq!(confirmed_lsn(&db, "walbox").await, slot_at, "nothing moved");
    assert!(checkpoint(&pg).is_none());

    // Accepted: walbox starts there.
    let mut walbox = Walbox::spawn(
        &["run", "--from-lsn", &after.to_string(), "--accept-skip"],
        &env,
    );
    write_events_from(&pg, 1, 1, 3, 3, 100).await;
    wait_caught_up(&db).await;
    walbox.stop();
    let records = read_topic(&broker.bootstrap(), TOPIC, 3).await;
    assert_eq!(records.len(), 3, "the five skipped as accepted");

    // With a checkpoint: a start after it is refused as well.
    write_events_from(&pg, 1, 1, 2, 2, 200).await;
    let saved = checkpoint(&pg).unwrap().lsn;
    let later = current_lsn(&db).await;
    let log = refused(later);
    assert!(
        log.contains(&format!(
            "between {saved} and {later} would never be published"
        )) && log.contains("after walbox's checkpoint"),
        "{log}"
    );
}
