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
    sql.batch_execute("SET LOCAL TimeZone = 'UTC'; SET LOCAL DateStyle = 'ISO, YMD'")
        .await
        .context("session settings")?;
    Ok(())
}

/// The columns rows are read in: the configured ones, else the primary key.
fn order(table: &Table, config: &SnapshotConfig) -> Result<Vec<String>> {
    let columns = if config.order_by.is_empty() {
        table.primary_key.clone()
    } else {
        config.order_by.clone()
    };
    for c in &columns {
        if !table.relation.columns.iter().any(|col| &col.name == c) {
            bail!(
                "snapshot.order_by: {}.{} has no column {c:?}",
                table.relation.namespace,
                table.relation.name
            );
        }
    }
    Ok(columns)
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

/// Declares the cursor over `table`'s published columns, in order.
pub async fn declare(
    sql: &tokio_postgres::Client,
    table: &Table,
    config: &SnapshotConfig,
) -> Result<()> {
    let columns: Vec<String> = table
        .relation
        .columns
        .iter()
        .map(|c| ident(&c.name))
        .collect();
    let order = order(table, config)?;
    if order.is_empty() {
        tracing::warn!(
            table = %format_args!("{}.{}", table.relation.namespace, table.relation.name),
            "no primary key and no snapshot.order_by: the snapshot reads rows in storage order"
        );
    }
    let order_by = if order.is_empty() {
        String::new()
    } else {
        let keys: Vec<String> = order.iter().map(|c| ident(c)).collect();
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
