//! Reading topics back and auditing them against the outbox table: missing and
//! duplicated event ids.

use std::collections::HashMap;
use std::time::Duration;

use walbox_testkit::kafka::Record;

use super::positions::{current_lsn, wait_confirmed};

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

/// Every duplicate is a replay: all copies of an event id carry the same source
/// position.
pub fn assert_duplicates_are_replays(records: &[walbox_testkit::kafka::Record]) {
    let mut seen: HashMap<&str, (&str, &str)> = HashMap::new();
    for r in records {
        let position = (
            r.header("walbox_commit_lsn").unwrap(),
            r.header("walbox_index").unwrap(),
        );
        let first = *seen
            .entry(r.header("event_id").unwrap())
            .or_insert(position);
        assert_eq!(
            first, position,
            "a duplicate from somewhere else than a replay"
        );
    }
}
