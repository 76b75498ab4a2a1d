//! Histories that used to lose events, end to end: a server restored behind the
//! checkpoint, the final position on a clean stop, a configuration change inside
//! a partly acknowledged transaction, and inserts from a published table that is
//! no outbox.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use walbox_testkit::{PgCluster, StopMode, wait_until};

const TOPIC: &str = "outbox.order";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restored_behind_the_checkpoint_is_refused_with_the_range() {
    let (mut pg, broker, db) = servers().await;
    let env = walbox_env(&pg, &broker);
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 1, 10, 10, 10).await; // 100
    wait_caught_up(&db).await;
    walbox.stop();
    drop(db);

    // A disk snapshot of the server, taken here.
    pg.stop(StopMode::Fast).unwrap();
    pg.copy_data("disk-snapshot").unwrap();
    pg.start_again().unwrap();

    let db = pg.connect("postgres").await.unwrap();
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events_from(&pg, 1, 200, 10, 10, 10).await; // 2,000 more
    wait_caught_up(&db).await;
    walbox.stop();
    let saved = checkpoint(&pg).unwrap().lsn;
    drop(db);

    // The server comes back from the snapshot; the service goes on writing.
    pg.stop(StopMode::Fast).unwrap();
    pg.restore_data("disk-snapshot").unwrap();
    pg.start_again().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    write_events_from(&pg, 1, 30, 10, 10, 100).await; // 300 new rows
    let end = current_lsn(&db).await;
    assert!(
        end < saved,
        "the restored server's WAL is behind the checkpoint"
    );

    let mut walbox = Walbox::spawn(&["run"], &env);
    let status = walbox.wait(Duration::from_secs(60));
    let err = walbox.log();
    assert_eq!(code(status), Some(1), "{err}");
    assert!(
        err.contains("before walbox's checkpoint")
            && err.contains(&saved.to_string())
            && err.contains("--accept-wal-behind"),
        "{err}"
    );
    // Nothing was confirmed past the new rows.
    let slot = confirmed_lsn(&db, "walbox").await;
    assert!(slot < end, "slot at {slot}, new rows end at {end}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_leaves_the_final_position_on_the_server() {
    let (pg, broker, db) = servers().await;
    let env = walbox_env(&pg, &broker);
    setup(&env);
    // Positions are sent once per status interval: a long one leaves a wide
    // window between handing a position to the client and sending it.
    let cfg = config_file(&pg, "slow.toml", "[source]\nstatus_interval_ms = 5000\n");
    for round in 0..3 {
        let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
        write_events_from(&pg, 1, 5, 10, 5, round * 5).await;
        let last = current_lsn(&db).await;
        // Acknowledged and saved: walbox reports it next, then is asked to stop.
        wait_checkpoint(&pg, last, Duration::from_secs(60)).await;
        walbox.stop();
        let slot = confirmed_lsn(&db, "walbox").await;
        assert!(
            slot >= last,
            "round {round}: the slot is at {slot} after a clean stop, the checkpoint at {}",
            checkpoint(&pg).unwrap().lsn
        );
    }
}

/// Two outbox tables, each with its own topic.
const TWO_TABLES: &str = "
    CREATE TABLE outbox_b (LIKE outbox INCLUDING ALL);
";

fn two_table_config(pg: &PgCluster, name: &str, tables: &[&str], ignore: &[&str]) -> String {
    let mut toml = String::from("[sink]\nmax_in_flight = 64\n\n[source]\nignore_tables = [");
    toml.push_str(
        &ignore
            .iter()
            .map(|t| format!("\"{t}\""))
            .collect::<Vec<_>>()
            .join(", "),
    );
    toml.push_str("]\n");
    for t in tables {
        toml.push_str(&format!(
            "\n[[outbox]]\ntable = \"public.{t}\"\ntopic = \"{t}.{{aggregate_type}}\"\n"
        ));
    }
    config_file(pg, name, &toml)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_change_inside_a_partly_acknowledged_transaction_sends_it_whole_again() {
    let (pg, broker, db) = servers().await;
    db.batch_execute(TWO_TABLES).await.unwrap();
    let env = walbox_env(&pg, &broker);
    let both = two_table_config(&pg, "both.toml", &["outbox", "outbox_b"], &[]);
    let (code, _, err) = walbox_cmd(&["setup", "--config", &both], &env);
    assert_eq!(code, Some(0), "{err}");
    let mut walbox = Walbox::spawn(&["run", "--config", &both], &env);
    // One transaction: 20,000 rows, alternating between the two tables; killed
    // inside it, once the checkpoint holds part of it. A walbox that gets through a
    // whole transaction between two looks at the checkpoint gets another one.
    let mut caught = false;
    for _ in 0..5 {
        db.batch_execute(
            "BEGIN;
             DO $$ BEGIN FOR i IN 0..9999 LOOP
               INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', 'k' || (i % 7), 'E', jsonb_build_object('seq', i / 7));
               INSERT INTO outbox_b (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', 'k' || (i % 7), 'E', jsonb_build_object('seq', i / 7));
             END LOOP; END $$;
             COMMIT;",
        )
        .await
        .unwrap();
        let committed = current_lsn(&db).await;
        caught = wait_until(
            "a partly acknowledged transaction in the checkpoint, or the whole of it",
            Duration::from_secs(120),
            || {
                let c = checkpoint(&pg)?;
                if c.partial.as_ref().is_some_and(|p| p.events >= 2_000) {
                    Some(true)
                } else {
                    (c.lsn >= committed).then_some(false)
                }
            },
        )
        .unwrap();
        if caught {
            break;
        }
    }
    assert!(
        caught,
        "no partly acknowledged transaction seen in five tries"
    );
    walbox.kill9();
    wait_slot_released(&db, "walbox").await;
    let partial = checkpoint(&pg).unwrap().partial.unwrap();
    assert!(partial.events < 20_000);

    // outbox_b moves to another relay: this one now relays outbox alone.
    let one = two_table_config(&pg, "one.toml", &["outbox"], &["public.outbox_b"]);
    let mut walbox = Walbox::spawn(&["run", "--config", &one], &env);
    wait_caught_up(&db).await;
    let log = walbox.log();
    walbox.stop();
    assert!(log.contains("sent whole again"), "{log}");
    let ids: HashSet<String> = db
        .query("SELECT id::text FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let records = read_topic(&broker.bootstrap(), "outbox.order", ids.len()).await;
    let (missing, _) = audit(&ids, &records);
    assert!(
        missing.is_empty(),
        "{} of {} events of outbox missing after the configuration change",
        missing.len(),
        ids.len()
    );
    assert_per_key_order(&records, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_from_a_published_table_that_is_no_outbox_stops_walbox_before_it() {
    let (pg, broker, db) = servers().await;
    db.batch_execute("CREATE TABLE audit_log (id bigserial PRIMARY KEY, note text)")
        .await
        .unwrap();
    let env = walbox_env(&pg, &broker);
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 1, 5, 10, 5).await;
    wait_caught_up(&db).await;
    // Someone adds another table to walbox's publication.
    db.batch_execute("ALTER PUBLICATION walbox_outbox ADD TABLE audit_log")
        .await
        .unwrap();
    let before = current_lsn(&db).await;
    db.batch_execute("INSERT INTO audit_log (note) VALUES ('x')")
        .await
        .unwrap();
    write_events_from(&pg, 1, 5, 10, 5, 5).await;
    let status = walbox.wait(Duration::from_secs(60));
    assert_eq!(code(status), Some(1), "{}", walbox.log());
    let log = walbox.log();
    assert!(
        log.contains("an insert into public.audit_log") && log.contains("no [[outbox]] table maps"),
        "{log}"
    );
    let slot = confirmed_lsn(&db, "walbox").await;
    assert!(
        slot <= before,
        "slot at {slot} passed the insert after {before}"
    );

    // Declared as not walbox's: counted, and the outbox events after it flow.
    let cfg = config_file(
        &pg,
        "ignore.toml",
        "[source]\nignore_tables = [\"public.audit_log\"]\n",
    );
    let mut walbox = Walbox::spawn(&["run", "--config", &cfg], &env);
    let records = assert_all_delivered(&db, &broker.bootstrap(), TOPIC, 100, "ignore").await;
    walbox.stop();
    assert!(
        walbox.log().contains("ignored as configured"),
        "{}",
        walbox.log()
    );
    assert_per_key_order(&records, true);
}
