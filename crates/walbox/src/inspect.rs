//! `walbox inspect`: a read-only look at what a slot holds.

use std::collections::BTreeMap;
use std::io::Write as _;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use walbox_pgoutput::{Decoder, LogicalMessage, Lsn, Oid};

/// Arguments of `walbox inspect`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Connection string (libpq key=value or URI form).
    #[arg(long, env = "WALBOX_DSN", hide_env_values = true)]
    dsn: crate::config::Secret,
    /// Logical replication slot (pgoutput) to look into.
    #[arg(long)]
    slot: String,
    /// Publication(s) to decode with, comma-separated.
    #[arg(long)]
    publication: String,
    /// Stop after this many messages (0: all pending).
    #[arg(long, default_value_t = 0)]
    limit: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Counts of one table's pending changes.
#[derive(Debug, Default, Clone, Copy)]
struct TableCounts {
    inserts: u64,
    updates: u64,
    deletes: u64,
    truncates: u64,
}

/// What a slot holds.
#[derive(Debug, Default)]
pub struct Summary {
    messages: u64,
    transactions: u64,
    logical_messages: u64,
    first_lsn: Option<Lsn>,
    last_commit_end: Option<Lsn>,
    tables: BTreeMap<String, TableCounts>,
}

impl Summary {
    /// Adds one decoded message found at `lsn`.
    fn observe(&mut self, names: &mut BTreeMap<Oid, String>, lsn: Lsn, msg: &LogicalMessage) {
        self.messages += 1;
        self.first_lsn.get_or_insert(lsn);
        fn table<'a>(
            tables: &'a mut BTreeMap<String, TableCounts>,
            names: &BTreeMap<Oid, String>,
            oid: Oid,
        ) -> &'a mut TableCounts {
            let name = names
                .get(&oid)
                .cloned()
                .unwrap_or_else(|| format!("oid {oid}"));
            tables.entry(name).or_default()
        }
        match msg {
            LogicalMessage::Relation(r) => {
                names.insert(r.oid, format!("{}.{}", r.namespace, r.name));
            }
            LogicalMessage::Insert(i) => {
                table(&mut self.tables, names, i.relation_oid).inserts += 1
            }
            LogicalMessage::Update(u) => {
                table(&mut self.tables, names, u.relation_oid).updates += 1
            }
            LogicalMessage::Delete(d) => {
                table(&mut self.tables, names, d.relation_oid).deletes += 1
            }
            LogicalMessage::Truncate(t) => {
                for oid in &t.relation_oids {
                    table(&mut self.tables, names, *oid).truncates += 1;
                }
            }
            LogicalMessage::Message(_) => self.logical_messages += 1,
            LogicalMessage::Commit(c) => {
                self.transactions += 1;
                self.last_commit_end = Some(c.end_lsn);
            }
            _ => {}
        }
    }

    fn to_json(&self) -> serde_json::Value {
        let tables: serde_json::Map<String, serde_json::Value> = self
            .tables
            .iter()
            .map(|(name, c)| {
                (
                    name.clone(),
                    serde_json::json!({
                        "inserts": c.inserts, "updates": c.updates,
                        "deletes": c.deletes, "truncates": c.truncates,
                    }),
                )
            })
            .collect();
        serde_json::json!({
            "messages": self.messages,
            "transactions": self.transactions,
            "logical_messages": self.logical_messages,
            "first_lsn": self.first_lsn.map(|l| l.to_string()),
            "last_commit_end_lsn": self.last_commit_end.map(|l| l.to_string()),
            "tables": tables,
        })
    }

    fn print_table(&self, out: &mut impl std::io::Write) -> std::io::Result<()> {
        let range = match (self.first_lsn, self.last_commit_end) {
            (Some(a), Some(b)) => format!("{a} .. {b}"),
            _ => "-".into(),
        };
        writeln!(
            out,
            "{} messages, {} committed transactions, {} logical messages; WAL {range}",
            self.messages, self.transactions, self.logical_messages
        )?;
        writeln!(
            out,
            "{:<40} {:>10} {:>10} {:>10} {:>10}",
            "table", "inserts", "updates", "deletes", "truncates"
        )?;
        for (name, c) in &self.tables {
            writeln!(
                out,
                "{name:<40} {:>10} {:>10} {:>10} {:>10}",
                c.inserts, c.updates, c.deletes, c.truncates
            )?;
        }
        Ok(())
    }
}

/// Peeks the slot's pending changes and summarises them.
pub async fn summarise(client: &tokio_postgres::Client, args: &Args) -> Result<Summary> {
    let limit = (args.limit > 0).then(|| i64::try_from(args.limit).unwrap_or(i64::MAX));
    let rows = client
        .query(
            "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes(
                 $1, NULL, $2::int, 'proto_version', '1', 'publication_names', $3, 'messages', 'true')",
            &[&args.slot, &limit.map(|l| i32::try_from(l).unwrap_or(i32::MAX)), &args.publication],
        )
        .await
        .with_context(|| format!("reading slot {}", args.slot))?;
    let mut summary = Summary::default();
    let mut decoder = Decoder::new();
    let mut names = BTreeMap::new();
    for row in rows {
        let lsn: Lsn = row.get::<_, String>(0).parse()?;
        let data = Bytes::from(row.get::<_, Vec<u8>>(1));
        let msg = decoder
            .decode(&data)
            .with_context(|| format!("message at {lsn}"))?;
        summary.observe(&mut names, lsn, &msg);
    }
    Ok(summary)
}

/// Runs `walbox inspect`.
pub async fn run(args: Args) -> Result<()> {
    if args.slot.is_empty() || args.publication.is_empty() {
        bail!("--slot and --publication must not be empty");
    }
    let client = crate::pg::ConnParams::parse(args.dsn.expose())?
        .connect()
        .await?;
    let summary = summarise(&client, &args).await?;
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", summary.to_json())?;
    } else {
        summary.print_table(&mut out)?;
    }
    Ok(())
}
