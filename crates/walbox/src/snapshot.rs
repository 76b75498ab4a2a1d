//! Reading the rows an exported snapshot shows: the query, its rows as pgoutput
//! tuples, and progress reporting. The relay publishes what this reads.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use tokio_postgres::SimpleQueryMessage;
use walbox_pgoutput::TupleValue;

use crate::catalog::{Table, ident};
use crate::config::SnapshotConfig;
use walbox_outbox::TableConfig;

/// Name of the cursor the snapshot reads through.
pub const CURSOR: &str = "walbox_snapshot";

/// Opens the snapshot transaction on `sql`: repeatable read, read only, seeing
/// exactly what the slot's exported snapshot `name` shows.
pub async fn begin(sql: &tokio_postgres::Client, name: &str) -> Result<()> {
    sql.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .await
        .context("starting the snapshot transaction")?;
    sql.batch_execute(&format!(
        "SET TRANSACTION SNAPSHOT '{}'",
        name.replace('\'', "''")
    ))
    .await
    .context("importing the slot's snapshot")?;
    // Values render as in the stream: the connection pins the settings that
    // change a value's text form (`pg::SESSION_OPTIONS`).
    Ok(())
}

/// The order a snapshot reads a table in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadOrder {
    /// `ORDER BY` columns; empty for storage order.
    pub columns: Vec<String>,
    /// What the order rests on, for people to read.
    pub basis: &'static str,
    /// Set when the order need not follow each key's commit order: the problem
    /// and the fix.
    pub warning: Option<String>,
}

const INT2: u32 = 21;
const INT4: u32 = 23;
const INT8: u32 = 20;
const TIMESTAMP: u32 = 1114;
const TIMESTAMPTZ: u32 = 1184;

/// The order a snapshot reads `table` in. Existing rows have no commit position,
/// so each key's events keep their commit order only if the order columns grow
/// with it. `snapshot.order_by` when set; else the first of:
///
/// 1. the primary key, when it is one integer column filled from a sequence
///    (identity, serial, bigserial): insertion order;
/// 2. another integer column filled from a sequence, then the primary key;
/// 3. the mapped occurrence-time column (`timestamp` or `timestamptz`), then the
///    primary key;
/// 4. the primary key, or storage order without one, with a warning: neither
///    need follow commit order (a random uuid certainly does not).
pub fn read_order(
    table: &Table,
    table_config: &TableConfig,
    config: &SnapshotConfig,
) -> Result<ReadOrder> {
    let name = format!("{}.{}", table.relation.namespace, table.relation.name);
    let type_of = |c: &str| {
        table
            .relation
            .columns
            .iter()
            .find(|col| col.name == c)
            .map(|col| col.type_oid)
    };
    if !config.order_by.is_empty() {
        if let Some(c) = config.order_by.iter().find(|c| type_of(c).is_none()) {
            bail!(
                "snapshot.order_by: {name} has no column {c:?}; name columns every outbox \
                 table has, or leave snapshot.order_by unset for the default order"
            );
        }
        return Ok(ReadOrder {
            columns: config.order_by.clone(),
            basis: "snapshot.order_by",
            warning: None,
        });
    }
    let integer = |c: &str| matches!(type_of(c), Some(INT2 | INT4 | INT8));
    let pk = &table.primary_key;
    let with_pk = |first: &str| {
        let mut columns = vec![first.to_owned()];
        columns.extend(pk.iter().filter(|c| *c != first).cloned());
        columns
    };
    if let [key] = pk.as_slice()
        && table.sequenced.contains(key)
        && integer(key)
    {
        return Ok(ReadOrder {
            columns: pk.clone(),
            basis: "sequence-filled primary key",
            warning: None,
        });
    }
    if let Some(seq) = table.sequenced.iter().find(|c| integer(c)) {
        return Ok(ReadOrder {
            columns: with_pk(seq),
            basis: "sequence-filled column, then the primary key",
            warning: None,
        });
    }
    let occurred_at = table_config
        .columns
        .occurred_at
        .as_deref()
        .unwrap_or("occurred_at");
    if matches!(type_of(occurred_at), Some(TIMESTAMP | TIMESTAMPTZ)) {
        return Ok(ReadOrder {
            columns: with_pk(occurred_at),
            basis: "occurrence time, then the primary key",
            warning: None,
        });
    }
    let fix = "each aggregate's existing events may be published out of commit order. Set \
               snapshot.order_by to columns that grow with commit order (e.g. \
               snapshot.order_by = [\"created_at\", \"id\"]), or give the table a bigserial \
               or identity column or a timestamptz occurred_at column";
    let (basis, warning) = if pk.is_empty() {
        (
            "storage order",
            format!(
                "{name} has no primary key, no sequence-filled column and no occurrence-time \
                 column: a snapshot reads it in storage order, and {fix}"
            ),
        )
    } else {
        (
            "primary key",
            format!(
                "a snapshot reads {name} in primary key order ({}), which need not be the \
                 order rows were committed in (a random uuid is not): {fix}",
                pk.join(", ")
            ),
        )
    };
    Ok(ReadOrder {
        columns: pk.clone(),
        basis,
        warning: Some(warning),
    })
}

/// `FROM ... [WHERE ...]` of the snapshot query.
fn from_where(table: &Table, config: &SnapshotConfig) -> String {
    match &config.filter {
        Some(f) => format!("FROM {} WHERE ({f})", table.quoted()),
        None => format!("FROM {}", table.quoted()),
    }
}

/// Rows the snapshot will read from `table`.
pub async fn count(
    sql: &tokio_postgres::Client,
    table: &Table,
    config: &SnapshotConfig,
) -> Result<u64> {
    let row = sql
        .query_one(
            &format!("SELECT count(*) {}", from_where(table, config)),
            &[],
        )
        .await
        .with_context(|| match &config.filter {
            Some(f) => format!("counting snapshot rows (snapshot.where = {f:?})"),
            None => "counting snapshot rows".to_owned(),
        })?;
    Ok(u64::try_from(row.get::<_, i64>(0)).unwrap_or(0))
}

/// Declares the cursor over `table`'s published columns, in [`read_order`].
pub async fn declare(
    sql: &tokio_postgres::Client,
    table: &Table,
    table_config: &TableConfig,
    config: &SnapshotConfig,
) -> Result<()> {
    let columns: Vec<String> = table
        .relation
        .columns
        .iter()
        .map(|c| ident(&c.name))
        .collect();
    let order = read_order(table, table_config, config)?;
    if let Some(w) = &order.warning {
        tracing::warn!("{w}");
    }
    tracing::info!(
        table = %format_args!("{}.{}", table.relation.namespace, table.relation.name),
        order_by = ?order.columns,
        basis = order.basis,
        "snapshot: read order"
    );
    let order_by = if order.columns.is_empty() {
        String::new()
    } else {
        let keys: Vec<String> = order.columns.iter().map(|c| ident(c)).collect();
        format!(" ORDER BY {}", keys.join(", "))
    };
    sql.batch_execute(&format!(
        "DECLARE {CURSOR} NO SCROLL CURSOR FOR SELECT {} {}{order_by}",
        columns.join(", "),
        from_where(table, config)
    ))
    .await
    .context("declaring the snapshot cursor")
}

/// The next chunk of rows as pgoutput tuples (text values); empty at the end.
pub fn rows(messages: Vec<SimpleQueryMessage>, width: usize) -> Result<Vec<Vec<TupleValue>>> {
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        if let SimpleQueryMessage::Row(row) = m {
            if row.len() != width {
                bail!("snapshot row has {} columns, expected {width}", row.len());
            }
            let values = (0..width)
                .map(|i| match row.get(i) {
                    Some(text) => TupleValue::Text(Bytes::copy_from_slice(text.as_bytes())),
                    None => TupleValue::Null,
                })
                .collect();
            out.push(values);
        }
    }
    Ok(out)
}

/// Snapshot progress: a bar on a terminal, a log line every few seconds otherwise.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    table: String,
    total: u64,
    done: u64,
    started: Instant,
    logged: Instant,
}

/// How often progress is logged without a terminal.
const LOG_EVERY: Duration = Duration::from_secs(10);

impl Progress {
    /// Progress over `total` rows of `table`.
    pub fn new(table: String, total: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} [{bar:30}] {pos}/{len} rows, {per_sec}, ETA {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.set_message(format!("snapshot {table}"));
            bar
        });
        tracing::info!(table = %table, rows = total, "snapshot: reading");
        let now = Instant::now();
        Progress {
            bar,
            table,
            total,
            done: 0,
            started: now,
            logged: now,
        }
    }

    /// `n` more rows were sent.
    pub fn add(&mut self, n: u64) {
        self.done += n;
        if let Some(bar) = &self.bar {
            bar.set_position(self.done);
        } else if self.logged.elapsed() >= LOG_EVERY {
            self.logged = Instant::now();
            self.log("snapshot: progress");
        }
    }

    fn log(&self, what: &str) {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        #[allow(clippy::cast_precision_loss)] // a rate for people to read
        let rate = self.done as f64 / secs;
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let eta = if rate > 0.0 {
            (self.total.saturating_sub(self.done) as f64 / rate).round() as u64
        } else {
            0
        };
        tracing::info!(
            table = %self.table,
            rows = self.done,
            total = self.total,
            rows_per_s = rate.round(),
            eta_s = eta,
            "{what}"
        );
    }

    /// Every row was sent.
    pub fn finish(self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        self.log("snapshot: table read");
    }
}

#[cfg(test)]
mod tests {
    use walbox_pgoutput::{Relation, RelationColumn, ReplicaIdentity};

    use super::*;

    const UUID: u32 = 2950;
    const TEXT: u32 = 25;

    /// A table of `(name, type oid)` columns.
    fn table(columns: &[(&str, u32)], primary_key: &[&str], sequenced: &[&str]) -> Table {
        Table {
            relation: Relation {
                xid: None,
                oid: 1,
                namespace: "public".into(),
                name: "outbox".into(),
                replica_identity: ReplicaIdentity::Default,
                columns: columns
                    .iter()
                    .map(|(name, type_oid)| RelationColumn {
                        flags: u8::from(primary_key.contains(name)),
                        name: (*name).to_owned(),
                        type_oid: *type_oid,
                        type_modifier: -1,
                    })
                    .collect(),
            },
            primary_key: primary_key.iter().map(|c| (*c).to_owned()).collect(),
            sequenced: sequenced.iter().map(|c| (*c).to_owned()).collect(),
        }
    }

    fn order(t: &Table, tc: &TableConfig, order_by: &[&str]) -> ReadOrder {
        let config = SnapshotConfig {
            order_by: order_by.iter().map(|c| (*c).to_owned()).collect(),
            ..SnapshotConfig::default()
        };
        read_order(t, tc, &config).unwrap()
    }

    fn columns(o: &ReadOrder) -> Vec<&str> {
        o.columns.iter().map(String::as_str).collect()
    }

    #[test]
    fn a_sequence_filled_integer_key_is_read_in_key_order() {
        let tc = TableConfig::new("outbox");
        for int in [INT2, INT4, INT8] {
            let t = table(
                &[("id", int), ("occurred_at", TIMESTAMPTZ)],
                &["id"],
                &["id"],
            );
            let o = order(&t, &tc, &[]);
            assert_eq!(columns(&o), ["id"]);
            assert_eq!(o.warning, None);
        }
    }

    #[test]
    fn another_sequence_column_comes_before_the_occurrence_time() {
        let tc = TableConfig::new("outbox");
        let t = table(
            &[("id", UUID), ("occurred_at", TIMESTAMPTZ), ("seq", INT8)],
            &["id"],
            &["seq"],
        );
        let o = order(&t, &tc, &[]);
        assert_eq!(columns(&o), ["seq", "id"]);
        assert_eq!(o.warning, None);
        // A sequence over a column that is not an integer is not trusted.
        let t = table(
            &[("id", UUID), ("occurred_at", TIMESTAMPTZ), ("code", TEXT)],
            &["id"],
            &["code"],
        );
        assert_eq!(columns(&order(&t, &tc, &[])), ["occurred_at", "id"]);
    }

    #[test]
    fn a_uuid_key_is_read_by_occurrence_time_then_key() {
        let t = table(&[("id", UUID), ("occurred_at", TIMESTAMPTZ)], &["id"], &[]);
        let o = order(&t, &TableConfig::new("outbox"), &[]);
        assert_eq!(columns(&o), ["occurred_at", "id"]);
        assert_eq!(o.warning, None);
        // The mapped column, under its own name; `timestamp` too.
        let t = table(&[("id", UUID), ("created", TIMESTAMP)], &["id"], &[]);
        let mut tc = TableConfig::new("outbox");
        tc.columns.occurred_at = Some("created".into());
        assert_eq!(columns(&order(&t, &tc, &[])), ["created", "id"]);
        // An occurrence time kept as text does not order.
        let t = table(&[("id", UUID), ("occurred_at", TEXT)], &["id"], &[]);
        let o = order(&t, &TableConfig::new("outbox"), &[]);
        assert_eq!(columns(&o), ["id"]);
        assert!(o.warning.is_some());
    }

    #[test]
    fn a_key_that_need_not_follow_commit_order_is_read_with_a_warning_naming_the_fix() {
        let tc = TableConfig::new("outbox");
        for key in [UUID, TEXT, INT8] {
            let t = table(&[("id", key), ("payload", TEXT)], &["id"], &[]);
            let o = order(&t, &tc, &[]);
            assert_eq!(columns(&o), ["id"]);
            let w = o.warning.unwrap();
            assert!(
                w.contains("public.outbox") && w.contains("primary key order (id)"),
                "{w}"
            );
            assert!(w.contains("snapshot.order_by = ["), "{w}");
        }
        let t = table(&[("id", UUID), ("payload", TEXT)], &[], &[]);
        let o = order(&t, &tc, &[]);
        assert!(o.columns.is_empty());
        assert!(o.warning.unwrap().contains("storage order"));
    }

    #[test]
    fn a_configured_order_wins_and_must_name_columns_of_the_table() {
        let tc = TableConfig::new("outbox");
        let t = table(
            &[("id", UUID), ("occurred_at", TIMESTAMPTZ), ("n", INT8)],
            &["id"],
            &["n"],
        );
        let o = order(&t, &tc, &["occurred_at"]);
        assert_eq!(columns(&o), ["occurred_at"]);
        assert_eq!((o.basis, o.warning), ("snapshot.order_by", None));
        let config = SnapshotConfig {
            order_by: vec!["nope".into()],
            ..SnapshotConfig::default()
        };
        let e = read_order(&t, &tc, &config).unwrap_err().to_string();
        assert!(e.contains("has no column \"nope\""), "{e}");
    }
}
