//! `walbox verify`: the outbox table against the topics.

mod common;

use std::time::Duration;

use common::*;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use walbox_testkit::{Broker, OUTBOX_DDL, PgCluster};

const TOPIC: &str = "outbox.order";

async fn produce(bootstrap: &str, key: &str, id: &str, lsn: &str) {
    let producer: FutureProducer = walbox_testkit::kafka::client_config(bootstrap)
        .set("partitioner", "murmur2_random")
        .create()
        .unwrap();
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "event_id",
            value: Some(id),
        })
        .insert(Header {
            key: "walbox_commit_lsn",
            value: Some(lsn),
        })
        .insert(Header {
            key: "walbox_index",
            value: Some("0"),
        });
    producer
        .send(
            FutureRecord::to(TOPIC)
                .key(key)
                .payload("{}")
                .headers(headers),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
}

fn verify(env: &[(&str, String)], extra: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let mut args = vec!["verify", "--json"];
    args.extend_from_slice(extra);
    let (code, out, err) = walbox_cmd(&args, env);
    let report = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    (code, report, err)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reports_missing_duplicated_and_out_of_order_events() {
    let pg = PgCluster::start().unwrap();
    let broker = Broker::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let (env, mut walbox) = Walbox::set_up_and_run(&pg, &broker);
    write_events(&pg, 2, 10, 10, 10).await;
    wait_caught_up(&db).await;
    walbox.stop();

    let (code, r, err) = verify(&env, &[]);
    assert_eq!(code, Some(0), "{r}\n{err}");
    assert_eq!(r["rows"], 200);
    assert_eq!(r["records"], 200);
    assert_eq!(r["missing"], 0);
    assert_eq!(r["topics"], serde_json::json!([TOPIC]));
    // Reading each partition to its end is the normal way to finish, not an error.
    assert!(
        !err.lines().any(|l| l.contains("ERROR")),
        "no error logged: {err}"
    );

    // Three rows committed while walbox is down: missing until it runs again.
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'order-0', 'OrderPlaced', '{}' FROM generate_series(1, 3)",
    )
    .await
    .unwrap();
    let (code, r, _) = verify(&env, &[]);
    assert_eq!(code, Some(1));
    assert_eq!(r["missing"], 3);
    assert_eq!(r["examples"]["missing"].as_array().unwrap().len(), 3);
    // A filter leaves them out.
    let (code, r, _) = verify(&env, &["--where", "payload <> '{}'::jsonb"]);
    assert_eq!(code, Some(0), "{r}");

    // One of them shows up out of order (a source position before the key's
    // latest), and an existing event comes again from another position.
    let late: String = db
        .query_one(
            "SELECT id::text FROM outbox WHERE payload = '{}'::jsonb LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let old: String = db
        .query_one(
            "SELECT id::text FROM outbox WHERE aggregate_id = 'order-1' LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    produce(&broker.bootstrap(), "order-0", &late, "0/1").await;
    produce(&broker.bootstrap(), "order-1", &old, "FF/0").await;
    let (code, r, _) = verify(&env, &[]);
    assert_eq!(code, Some(1), "{r}");
    assert_eq!(r["missing"], 2);
    assert_eq!(r["out_of_order"], 1);
    assert_eq!(r["examples"]["out_of_order"], serde_json::json!([late]));
    assert_eq!(r["duplicated"], 1);
    assert_eq!(r["duplicated_as_replay"], 0);
    assert_eq!(
        r["examples"]["duplicated_from_other_positions"],
        serde_json::json!([old])
    );

    // walbox publishes the rest; what remains is the injected order problem.
    let mut walbox = Walbox::spawn(&["run"], &env);
    wait_caught_up(&db).await;
    walbox.stop();
    let (_, r, _) = verify(&env, &[]);
    assert_eq!(r["missing"], 0, "{r}");
    assert_eq!(r["records"], 205);
}
