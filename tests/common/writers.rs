//! Writers of outbox rows: concurrent transactions whose per-key commit order
//! is recorded in each payload's `seq`.

use walbox_testkit::PgCluster;

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
