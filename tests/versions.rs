//! What differs between the supported PostgreSQL majors (15 to 18): the slot's
//! columns as `walbox slot status` and `walbox doctor` show them, and a slot the
//! server invalidated for idleness (`idle_replication_slot_timeout`, 18+).
//! `WALBOX_PG_VERSION` picks the major; a test that does not apply to it says so.

#![allow(clippy::print_stderr)] // says which major it tested, and when a test does not apply

mod common;

use std::time::Duration;

use common::*;
use walbox_testkit::PgCluster;

/// The major of the test's server, printed so a run's log says what it tested.
fn major(pg: &PgCluster) -> u32 {
    let major = pg.major().unwrap();
    eprintln!("PostgreSQL {major}");
    major
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_status_and_doctor_show_the_columns_the_server_has() {
    let (pg, broker, _db) = servers().await;
    let major = major(&pg);
    let env = walbox_env(&pg, &broker);
    setup(&env);

    let (code, out, err) = walbox_cmd(&["slot", "status", "--json"], &env);
    assert_eq!(code, Some(0), "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    let slot = status[0].as_object().unwrap();
    let has = |column: &str| slot.contains_key(column);
    assert_eq!(has("conflicting"), major >= 16, "{out}");
    for column in [
        "failover",
        "synced",
        "inactive_since",
        "invalidation_reason",
    ] {
        assert_eq!(has(column), major >= 17, "{column}: {out}");
    }
    assert_eq!(has("two_phase_at"), major >= 18, "{out}");
    if major >= 16 {
        assert_eq!(slot["conflicting"], false, "{out}");
    }
    if major >= 17 {
        assert_eq!(slot["failover"], false, "{out}");
        assert_eq!(slot["synced"], false, "{out}");
        // Nobody reads it yet: inactive since its creation, and not invalidated.
        assert!(slot["inactive_since"].is_string(), "{out}");
        assert!(slot["invalidation_reason"].is_null(), "{out}");
    }

    let (code, text, err) = walbox_cmd(&["slot", "status"], &env);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(text.contains("  failover "), major >= 17, "{text}");
    assert_eq!(text.contains("  inactive_since "), major >= 17, "{text}");
    assert_eq!(text.contains("  conflicting "), major >= 16, "{text}");

    let (code, doctor, err) = walbox_cmd(&["doctor"], &env);
    assert_eq!(code, Some(0), "{doctor}\n{err}");
    assert!(
        doctor.contains("slot walbox exists (pgoutput, wal_status reserved"),
        "{doctor}"
    );
    assert_eq!(
        doctor.contains("failover false, synced false"),
        major >= 17,
        "{doctor}"
    );
    assert_eq!(
        doctor.contains("conflicting false"),
        major >= 16,
        "{doctor}"
    );
    assert_eq!(
        doctor.contains("idle_replication_slot_timeout = 0 (disabled)"),
        major >= 18,
        "{doctor}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_invalidated_for_idleness_stops_walbox_with_the_reason_and_the_recovery() {
    let (pg, broker, db) = servers().await;
    if major(&pg) < 18 {
        eprintln!("idle_replication_slot_timeout is new in PostgreSQL 18: nothing to test here");
        return;
    }
    let (env, mut walbox) = Walbox::set_up_and_run(&pg, &broker);
    write_events(&pg, 1, 1, 10, 10).await;
    wait_checkpoint(&pg, current_lsn(&db).await, Duration::from_secs(60)).await;
    walbox.stop();
    // Committed while walbox is stopped: only the slot still holds them.
    write_events_from(&pg, 1, 1, 10, 10, 10).await;

    // The shortest timeout (seconds); the slot is invalidated at the first
    // checkpoint after it has been inactive that long.
    db.batch_execute("ALTER SYSTEM SET idle_replication_slot_timeout = '1s'")
        .await
        .unwrap();
    db.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    walbox_testkit::wait_until_async(
        "the slot to be invalidated for idleness",
        Duration::from_secs(60),
        || async {
            db.batch_execute("CHECKPOINT").await.unwrap();
            let row = db
                .query_one(
                    "SELECT invalidation_reason::text, wal_status FROM pg_replication_slots
                     WHERE slot_name = 'walbox'",
                    &[],
                )
                .await
                .unwrap();
            let reason: Option<String> = row.get(0);
            let wal_status: Option<String> = row.get(1);
            (reason.as_deref() == Some("idle_timeout")).then_some(wal_status)
        },
    )
    .await
    .map(|wal_status| assert_eq!(wal_status.as_deref(), Some("lost")))
    .unwrap();

    let began = std::time::Instant::now();
    let (code, _, err) = walbox_cmd(&["run"], &env);
    assert_eq!(code, Some(1), "{err}");
    assert!(began.elapsed() < Duration::from_secs(30), "no retry loop");
    assert!(
        err.contains("invalidation_reason = idle_timeout")
            && err.contains("wal_status = lost")
            && err.contains("set idle_replication_slot_timeout = 0")
            && err.contains("walbox's checkpoint")
            && err.contains("walbox slot drop")
            && err.contains("--snapshot"),
        "{err}"
    );

    let (code, doctor, _) = walbox_cmd(&["doctor"], &env);
    assert_eq!(code, Some(1), "{doctor}");
    assert!(
        doctor.contains(
            "FAIL slot walbox is invalidated (wal_status = lost, invalidation_reason = idle_timeout"
        ),
        "{doctor}"
    );
    assert!(
        doctor.contains("warn idle_replication_slot_timeout = 1s"),
        "{doctor}"
    );
    let (code, text, err) = walbox_cmd(&["slot", "status"], &env);
    assert_eq!(code, Some(0), "{err}");
    assert!(text.contains("invalidation_reason idle_timeout"), "{text}");
}
