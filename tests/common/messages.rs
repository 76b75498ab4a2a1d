//! The table-less outbox in tests: statements that emit logical decoding
//! messages, the event content they carry, a writer's mix of messages and rows,
//! and the configuration naming the prefix.

use std::collections::HashSet;

use walbox_testkit::PgCluster;

use super::{config_file, outbox_insert};

/// `SELECT pg_logical_emit_message(...)` of `content` under `prefix`.
pub fn emit(transactional: bool, prefix: &str, content: &str) -> String {
    format!(
        "SELECT pg_logical_emit_message({transactional}, '{prefix}', '{}');",
        content.replace('\'', "''")
    )
}

/// An event's JSON content: id, aggregate type `order`, the key, `OrderPlaced`
/// and a payload carrying the per-key `seq`.
pub fn event_content(id: &str, key: &str, seq: i64) -> String {
    serde_json::json!({
        "id": id,
        "aggregate_type": "order",
        "aggregate_id": key,
        "event_type": "OrderPlaced",
        "payload": {"seq": seq},
    })
    .to_string()
}

/// The id a message event of `key` and `seq` gets from [`row_or_message`].
pub fn message_id(key: &str, seq: i64) -> String {
    format!("msg-{key}-{seq}")
}

/// One event for `steady_writer_with`: a transactional message of prefix
/// `walbox` for even `seq`, an outbox insert for odd ones, so each key's events
/// alternate between the two.
pub fn row_or_message(key: &str, seq: i64) -> String {
    if seq % 2 == 0 {
        emit(
            true,
            "walbox",
            &event_content(&message_id(key, seq), key, seq),
        )
    } else {
        outbox_insert(key, seq)
    }
}

/// The ids of the messages a `steady_writer_with(.., row_or_message)` that
/// wrote `n` events emitted (event `i` is key `order-{i % 10}`, seq `i / 10`).
pub fn message_ids_written(n: usize) -> HashSet<String> {
    (0..n)
        .map(|i| (format!("order-{}", i % 10), (i / 10) as i64))
        .filter(|(_, seq)| seq % 2 == 0)
        .map(|(key, seq)| message_id(&key, seq))
        .collect()
}

/// A configuration file with the outbox table (unless `table` is false) and
/// `[[messages]]` for prefix `walbox` with `extra` lines.
pub fn messages_config(pg: &PgCluster, table: bool, extra: &str) -> String {
    let outbox = if table {
        "[[outbox]]\ntable = \"public.outbox\"\n"
    } else {
        ""
    };
    config_file(
        pg,
        "messages.toml",
        &format!("{outbox}[[messages]]\nprefix = \"walbox\"\n{extra}\n"),
    )
}
