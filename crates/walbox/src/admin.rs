//! `walbox setup` and `walbox slot drop`: the publication and the slot.

use anyhow::{Context, Result, bail};

use crate::config::Config;
use crate::pg::ConnParams;

/// Double-quotes an identifier for SQL.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Creates the publication (or adds missing tables to it) and the slot; does
/// nothing that is already done.
pub async fn setup(config: &Config) -> Result<()> {
    let conn = ConnParams::parse(config.dsn()?)?;
    let sql = conn.connect().await?;
    let publication = &config.source.publication;
    let tables: Vec<(String, String)> = config
        .outbox
        .iter()
        .map(|t| {
            let (s, n) = t.qualified();
            (s.to_owned(), n.to_owned())
        })
        .collect();
    for (schema, name) in &tables {
        let exists = sql
            .query_opt(
                "SELECT 1 FROM pg_tables WHERE schemaname = $1 AND tablename = $2",
                &[schema, name],
            )
            .await?
            .is_some();
        if !exists {
            bail!("outbox table {schema}.{name} does not exist");
        }
    }
    let has_pub = sql
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[publication],
        )
        .await?
        .is_some();
    let quoted: Vec<String> = tables
        .iter()
        .map(|(s, n)| format!("{}.{}", ident(s), ident(n)))
        .collect();
    if has_pub {
        for ((schema, name), q) in tables.iter().zip(&quoted) {
            let member = sql
                .query_opt(
                    "SELECT 1 FROM pg_publication_tables
                     WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                    &[publication, schema, name],
                )
                .await?
                .is_some();
            if !member {
                sql.batch_execute(&format!(
                    "ALTER PUBLICATION {} ADD TABLE {q}",
                    ident(publication)
                ))
                .await
                .with_context(|| format!("adding {schema}.{name} to publication {publication}"))?;
                println_out(&format!(
                    "added {schema}.{name} to publication {publication}"
                ));
            }
        }
    } else {
        sql.batch_execute(&format!(
            "CREATE PUBLICATION {} FOR TABLE {}",
            ident(publication),
            quoted.join(", ")
        ))
        .await
        .with_context(|| format!("creating publication {publication}"))?;
        println_out(&format!(
            "created publication {publication} for {}",
            quoted.join(", ")
        ));
    }
    let slot = &config.source.slot;
    let has_slot = sql
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
            &[slot],
        )
        .await?
        .is_some();
    if has_slot {
        println_out(&format!("slot {slot} exists"));
    } else {
        let row = sql
            .query_one(
                "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
                &[slot],
            )
            .await
            .with_context(|| format!("creating replication slot {slot}"))?;
        let lsn: String = row.get(0);
        println_out(&format!("created slot {slot} at {lsn}"));
    }
    Ok(())
}

/// Drops the slot; refuses while a reader holds it.
pub async fn drop_slot(config: &Config) -> Result<()> {
    let conn = ConnParams::parse(config.dsn()?)?;
    let sql = conn.connect().await?;
    let slot = &config.source.slot;
    let row = sql
        .query_opt(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[slot],
        )
        .await?;
    match row {
        None => {
            println_out(&format!("slot {slot} does not exist"));
            Ok(())
        }
        Some(r) => {
            if let Some(pid) = r.get::<_, Option<i32>>(0) {
                bail!("slot {slot} is in use by pid {pid}; stop that reader first");
            }
            sql.execute("SELECT pg_drop_replication_slot($1)", &[slot])
                .await
                .with_context(|| format!("dropping slot {slot}"))?;
            println_out(&format!("dropped slot {slot}"));
            Ok(())
        }
    }
}

#[allow(clippy::print_stdout)] // command output
fn println_out(line: &str) {
    println!("{line}");
}
