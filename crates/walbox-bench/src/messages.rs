//! The table-less outbox against table inserts: the backlog's events, built by the
//! same generator, emitted as transactional logical decoding messages
//! (`pg_logical_emit_message(true, 'walbox', json)`) in transactions of 10 and
//! drained in rounds by the ceiling (`pg_recvlogical -o messages=true`) and by
//! walbox to the broker with a `[[messages]]` section; next to them the backlog's
//! rows: their average event size, WAL per event, and both drained against their
//! own ceiling.

use crate::Error;
use crate::contenders::{Contender, MESSAGES_PREFIX, lsn, wal_between};
use crate::report::{Contended, ratio};
use crate::scenarios::{Bench, ROW_SELECT, backlog_load};

/// One event as a JSON object with the outbox table's columns as its fields, over
/// a relation `o` with those columns: a message's content, and what a row carries.
const CONTENT: &str = "jsonb_build_object(
    'id', o.id, 'aggregate_type', o.aggregate_type, 'aggregate_id', o.aggregate_id,
    'event_type', o.event_type, 'payload', o.payload, 'headers', o.headers,
    'occurred_at', o.occurred_at, 'schema_version', o.schema_version)::text";

/// The session setting in which the load leaves the bytes of content it emitted
/// (a setting, so that counting them writes no WAL).
const CONTENT_BYTES: &str = "walbox_bench.content_bytes";

/// `events` messages in transactions of 10: the backlog's rows from
/// [`ROW_SELECT`], with a fresh uuid and the transaction's time as a row gets
/// them by default.
pub fn load(events: u64) -> String {
    format!(
        "DO $$
         DECLARE
           emitted bigint := 0;
           n_bytes bigint;
           n_messages bigint;
         BEGIN
           FOR t IN 0..{last} LOOP
             SELECT sum(octet_length(c)), count(pg_logical_emit_message(true, '{MESSAGES_PREFIX}', c))
               INTO n_bytes, n_messages
               FROM (SELECT {CONTENT} AS c
                     FROM (SELECT gen_random_uuid() AS id, now() AS occurred_at, r.*
                           FROM ({ROW_SELECT} FROM generate_series(t * 10, t * 10 + 9) n)
                             AS r(aggregate_type, aggregate_id, event_type, payload, headers,
                                  schema_version)) o) m;
             emitted := emitted + n_bytes;
             COMMIT;
           END LOOP;
           PERFORM set_config('{CONTENT_BYTES}', emitted::text, false);
         END $$;",
        last = events / 10 - 1
    )
}

/// The scenario's figures.
pub struct Messages {
    /// The ceiling first, then walbox to the broker.
    pub contenders: Vec<Contended>,
    /// WAL the messages wrote, bytes.
    pub wal_bytes: i64,
    /// Average content of a message, bytes.
    pub event_bytes: f64,
    /// WAL the rows wrote, bytes.
    pub rows_wal_bytes: i64,
    /// Average row as the same JSON object, bytes.
    pub row_event_bytes: f64,
}

impl Bench {
    /// Runs the scenario. `rows_wal` is the backlog's WAL when the backlog
    /// scenario loaded the rows the table holds; otherwise the rows are loaded
    /// here once (no slot reads them) to measure theirs.
    pub async fn messages(&self, events: u64, rows_wal: i64) -> Result<Messages, Error> {
        let db = &self.db;
        let rows: i64 = db
            .query_one("SELECT count(*) FROM outbox", &[])
            .await?
            .get(0);
        let rows_wal_bytes = if rows_wal > 0 && u64::try_from(rows)? == events {
            rows_wal
        } else {
            println!("loading the backlog's {events} rows once to measure their WAL");
            db.batch_execute("TRUNCATE outbox; CHECKPOINT").await?;
            let from = lsn(db, "SELECT pg_current_wal_lsn()::text").await?;
            db.batch_execute(&backlog_load(events)).await?;
            let to = lsn(db, "SELECT pg_current_wal_lsn()::text").await?;
            wal_between(db, &from, &to).await?
        };
        let row_event_bytes: f64 = db
            .query_one(
                &format!("SELECT avg(octet_length({CONTENT}))::float8 FROM outbox o"),
                &[],
            )
            .await?
            .get(0);

        println!(
            "scenario: the backlog's {events} events as transactional messages of prefix \
             {MESSAGES_PREFIX}, in transactions of 10"
        );
        let drained = self
            .drain_slots(&self.messages_contenders(), &load(events), events)
            .await?;
        let content_bytes: String = db
            .query_one(&format!("SELECT current_setting('{CONTENT_BYTES}')"), &[])
            .await?
            .get(0);
        let event_bytes = content_bytes.parse::<f64>()? / events as f64;
        let m = Messages {
            contenders: drained.contenders,
            wal_bytes: drained.wal_bytes,
            event_bytes,
            rows_wal_bytes,
            row_event_bytes,
        };
        println!(
            "average event: {:.0} bytes as a row, {:.0} as a message; WAL per event: \
             {:.0} bytes for the rows, {:.0} for the messages",
            m.row_event_bytes,
            m.event_bytes,
            m.rows_wal_bytes as f64 / events as f64,
            m.wal_bytes as f64 / events as f64
        );
        Ok(m)
    }
}

/// The comparison of the two loads: event size, WAL per event, and the ceiling
/// and walbox to the broker on each; `backlog` is the backlog scenario's
/// contenders (empty when it did not run).
pub fn print_comparison(events: u64, m: &Messages, backlog: &[Contended]) {
    println!();
    println!("### Messages against table inserts: {events} events in transactions of 10");
    println!();
    println!(
        "The same events from the same generator, as outbox rows (the backlog scenario) \
         and as transactional messages (publication without tables). Event size: the \
         event's fields as one JSON object (a message's content; a row's columns \
         rendered the same way). Each load against its own ceiling."
    );
    println!();
    println!(
        "| load | average event | WAL per event | WAL of the rows' | ceiling events/s | walbox to the broker events/s | of ceiling | walbox CPU s per M events |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let per_event = |wal: i64| wal as f64 / events as f64;
    for (load, size, wal, ceiling, walbox) in [
        (
            "table inserts (outbox rows)",
            m.row_event_bytes,
            m.rows_wal_bytes,
            find(backlog, Contender::TrueCeiling),
            find(backlog, Contender::WalboxKafka),
        ),
        (
            "transactional messages",
            m.event_bytes,
            m.wal_bytes,
            find(&m.contenders, Contender::TrueCeilingMessages),
            find(&m.contenders, Contender::WalboxKafkaMessages),
        ),
    ] {
        let rate = |c: Option<&Contended>| {
            c.map_or_else(
                || "- (backlog scenario not run)".to_owned(),
                |c| format!("{:.0}", events as f64 / c.seconds().median),
            )
        };
        let of_ceiling = match (ceiling, walbox) {
            (Some(c), Some(w)) => match ratio(c, w) {
                (m, Some(range)) if range.n > 1 => {
                    format!("{m:.2} ({:.2}–{:.2})", range.min, range.max)
                }
                (m, _) => format!("{m:.2}"),
            },
            _ => "-".to_owned(),
        };
        let cpu = walbox.map_or_else(
            || "-".to_owned(),
            |w| format!("{:.1}", w.cpu_seconds().median * 1e6 / events as f64),
        );
        println!(
            "| {load} | {size:.0} B | {:.0} B | {:.2} | {} | {} | {of_ceiling} | {cpu} |",
            per_event(wal),
            wal as f64 / m.rows_wal_bytes as f64,
            rate(ceiling),
            rate(walbox),
        );
    }
}

/// Contender `c`'s runs in `list`, if it ran in the rounds.
fn find(list: &[Contended], c: Contender) -> Option<&Contended> {
    list.iter().find(|r| r.name == c.name() && r.in_rounds)
}
