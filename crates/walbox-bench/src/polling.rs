//! The poll-and-publish relay walbox replaces, as the pattern's references write
//! it: in one transaction, `SELECT ... WHERE published_at IS NULL ORDER BY id LIMIT
//! 100 FOR UPDATE SKIP LOCKED`, publish each row and wait for the broker's
//! acknowledgement, mark the rows published, commit. Two variants: one `UPDATE`
//! per row (as the references write it) and one `UPDATE ... WHERE id = ANY(...)`
//! per batch (the best a polling relay can do). Same broker, same producer
//! settings as walbox (idempotent, `acks=all`, murmur2 keys, `linger.ms=5`), same
//! envelope and headers; a partial index on the pending rows, so each poll finds
//! them without a scan.

use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use uuid::Uuid;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Rows per poll, as in the references.
pub const BATCH: i64 = 100;

/// How rows are marked published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marking {
    /// `UPDATE outbox SET published_at = now() WHERE id = $1`, once per row.
    PerRow,
    /// `UPDATE outbox SET published_at = now() WHERE id = ANY($1)`, once per batch.
    PerBatch,
}

/// Prepares the table for polling: the `published_at` column and the partial
/// index a polling relay needs.
pub async fn prepare(db: &tokio_postgres::Client) -> Result<(), Error> {
    db.batch_execute(
        "ALTER TABLE outbox ADD COLUMN IF NOT EXISTS published_at timestamptz;
         CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (id) WHERE published_at IS NULL;",
    )
    .await?;
    Ok(())
}

/// Publishes every pending row; returns how many.
pub async fn drain(
    db: &mut tokio_postgres::Client,
    bootstrap: &str,
    marking: Marking,
) -> Result<u64, Error> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("partitioner", "murmur2_random")
        .set("linger.ms", "5")
        .set("log_level", "3")
        .create()?;
    let select = db
        .prepare(
            "SELECT id, aggregate_type, aggregate_id, event_type, payload::text,
                    headers ->> 'traceparent',
                    to_char(occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"+00:00\"'),
                    schema_version
             FROM outbox WHERE published_at IS NULL
             ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
        )
        .await?;
    let mark_row = db
        .prepare("UPDATE outbox SET published_at = now() WHERE id = $1")
        .await?;
    let mark_batch = db
        .prepare("UPDATE outbox SET published_at = now() WHERE id = ANY($1)")
        .await?;
    let mut published = 0u64;
    loop {
        let tx = db.transaction().await?;
        let rows = tx.query(&select, &[&BATCH]).await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(published);
        }
        let mut acks = Vec::with_capacity(rows.len());
        let mut ids: Vec<Uuid> = Vec::with_capacity(rows.len());
        for r in &rows {
            let uuid: Uuid = r.get(0);
            let id = uuid.to_string();
            let aggregate_type: String = r.get(1);
            let key: String = r.get(2);
            let event_type: String = r.get(3);
            let payload: String = r.get(4);
            let traceparent: Option<String> = r.get(5);
            let occurred_at: String = r.get(6);
            let version: Option<i32> = r.get(7);
            let envelope = format!(
                "{{\"event_id\":\"{id}\",\"event_type\":{},\"schema_version\":{},\"occurred_at\":\"{occurred_at}\",\"producer\":\"polling-relay\",\"payload\":{payload}}}",
                json_string(&event_type),
                version.unwrap_or(1)
            );
            let version = version.unwrap_or(1).to_string();
            let mut headers = OwnedHeaders::new_with_capacity(5);
            for (key, value) in [
                ("event_id", Some(&id)),
                ("event_type", Some(&event_type)),
                ("schema_version", Some(&version)),
                ("aggregate_type", Some(&aggregate_type)),
                ("traceparent", traceparent.as_ref()),
            ] {
                if let Some(value) = value {
                    headers = headers.insert(Header {
                        key,
                        value: Some(value),
                    });
                }
            }
            let topic = format!("outbox.{aggregate_type}");
            let record = FutureRecord::to(&topic)
                .key(&key)
                .payload(&envelope)
                .headers(headers);
            acks.push(producer.send_result(record).map_err(|(e, _)| e)?);
            ids.push(uuid);
        }
        // At least once: every row acknowledged before it is marked.
        for ack in acks {
            ack.await?.map_err(|(e, _)| e)?;
        }
        match marking {
            Marking::PerRow => {
                for id in &ids {
                    tx.execute(&mark_row, &[id]).await?;
                }
            }
            Marking::PerBatch => {
                tx.execute(&mark_batch, &[&ids]).await?;
            }
        }
        tx.commit().await?;
        published += rows.len() as u64;
    }
}

fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
