//! `walbox setup`, `walbox slot create | drop | status | list`: the publication and
//! the slot.

use anyhow::{Context, Result, bail};

use crate::config::Config;
use crate::pg::ConnParams;

use crate::catalog::ident;
use crate::publication::{self, CREATED_BY_WALBOX, Problem};
use crate::slot::SlotStatus;

/// Creates the publication (marked as walbox's, publishing partitions as their
/// root) or adds missing outbox tables to it; on a publication walbox created,
/// also turns on inserts and `publish_via_partition_root` when needed. Refuses,
/// with the fix, a publication that would still lose events (one walbox did not
/// create is not changed beyond adding tables). With `create_slot`, the slot too.
/// Does nothing that is already done. Without `create_slot` (a snapshot
/// follows), warns about tables whose snapshot order need not keep each key's
/// commit order.
pub async fn setup(config: &Config, create_slot_too: bool) -> Result<()> {
    let conn = ConnParams::parse(config.dsn()?)?.resolve().await?;
    let sql = conn.connect().await?;
    if config.source.failover {
        crate::failover::require_support(crate::failover::server_major(&sql).await?)?;
    }
    let publication = &config.source.publication;
    let quoted_pub = ident(publication);
    let facts = publication::fetch(&sql, publication, &config.outbox).await?;
    let missing: Vec<&String> = facts
        .tables
        .iter()
        .filter(|(_, found)| found.is_none())
        .map(|(table, _)| table)
        .collect();
    if let Some(table) = missing.first() {
        bail!("outbox table {table} does not exist");
    }
    let quoted: Vec<String> = config
        .outbox
        .iter()
        .map(|t| {
            let (s, n) = t.qualified();
            format!("{}.{}", ident(s), ident(n))
        })
        .collect();
    match &facts.flags {
        None => {
            // Logical decoding messages need no table in the publication: with
            // only [[messages]], it publishes no table.
            let for_tables = if quoted.is_empty() {
                String::new()
            } else {
                format!("FOR TABLE {} ", quoted.join(", "))
            };
            sql.batch_execute(&format!(
                "CREATE PUBLICATION {quoted_pub} {for_tables}WITH (publish_via_partition_root = true);
                 COMMENT ON PUBLICATION {quoted_pub} IS '{CREATED_BY_WALBOX}'"
            ))
            .await
            .with_context(|| format!("creating publication {publication}"))?;
            if quoted.is_empty() {
                println_out(&format!(
                    "created publication {publication} with no table (logical decoding \
                     messages need none)"
                ));
            } else {
                println_out(&format!(
                    "created publication {publication} for {}",
                    quoted.join(", ")
                ));
            }
        }
        Some(flags) if flags.walbox_made => {
            for problem in publication::problems(&config.outbox, &config.producer, &facts) {
                let (fix, done) = match problem {
                    Problem::NoInserts { .. } => (
                        "SET (publish = 'insert, update, delete, truncate')",
                        "inserts",
                    ),
                    Problem::NeedsViaRoot { .. } => (
                        "SET (publish_via_partition_root = true)",
                        "partitions as their root",
                    ),
                    _ => continue,
                };
                sql.batch_execute(&format!("ALTER PUBLICATION {quoted_pub} {fix}"))
                    .await
                    .with_context(|| format!("altering publication {publication}"))?;
                println_out(&format!("publication {publication} now publishes {done}"));
            }
        }
        Some(_) => {}
    }
    let facts = publication::fetch(&sql, publication, &config.outbox).await?;
    for problem in publication::problems(&config.outbox, &config.producer, &facts) {
        if let Problem::NotMember { table, .. } = problem {
            let (schema, name) = table.split_once('.').unwrap_or(("public", &table));
            sql.batch_execute(&format!(
                "ALTER PUBLICATION {quoted_pub} ADD TABLE {}.{}",
                ident(schema),
                ident(name)
            ))
            .await
            .with_context(|| format!("adding {table} to publication {publication}"))?;
            println_out(&format!("added {table} to publication {publication}"));
        }
    }
    let facts = publication::fetch(&sql, publication, &config.outbox).await?;
    let left = publication::problems(&config.outbox, &config.producer, &facts);
    if !left.is_empty() {
        bail!(
            "{}\n(walbox setup changes a publication it did not create only by adding tables)",
            publication::refusal(&left)
        );
    }
    if create_slot_too {
        create_slot(&sql, &config.source.slot).await?;
        failover_slot(&conn, &sql, config).await?;
    } else {
        // A snapshot follows: say when it cannot keep each key's order.
        for t in &config.outbox {
            let (schema, name) = t.qualified();
            if let Some(table) = crate::catalog::table(&sql, schema, name).await?
                && let Some(w) = crate::snapshot::read_order(&table, t, &config.snapshot)?.warning
            {
                tracing::warn!("{w}");
            }
        }
    }
    Ok(())
}

/// `walbox setup` with `snapshot.mode = "initial"` (no `--snapshot`): the slot
/// exists now (it holds every change from its creation on); this says what
/// `walbox run` does about the rows that were in the outbox before.
pub fn say_run_takes_the_snapshot(config: &Config) -> Result<()> {
    let slot = &config.source.slot;
    let line = if config.checkpoint_store().load()?.is_some() {
        format!("slot {slot}: walbox has streamed from it (checkpoint found); no snapshot is due")
    } else {
        format!(
            "slot {slot} has no snapshot taken on it: with snapshot.mode = \"initial\", `walbox \
             run` publishes the rows already in the outbox first (a snapshot from a temporary \
             slot), then streams slot {slot} from its position, so rows written in between \
             come twice with the same event ids (`walbox setup --snapshot` creates the slot \
             with the snapshot instead; snapshot.mode = \"never\" streams without those rows)"
        )
    };
    println_out(&line);
    Ok(())
}

/// Drops the slot; refuses while a reader holds it.
pub async fn drop_slot(config: &Config) -> Result<()> {
    let conn = ConnParams::parse(config.dsn()?)?;
    let sql = conn.connect().await?;
    let slot = &config.source.slot;
    match crate::slot::info(&sql, slot).await? {
        None => {
            println_out(&format!("slot {slot} does not exist"));
            Ok(())
        }
        Some(info) => {
            if let Some(pid) = info.active_pid {
                bail!("slot {slot} is in use by pid {pid}; stop that reader first");
            }
            crate::slot::drop(&sql, slot).await?;
            println_out(&format!("dropped slot {slot}"));
            Ok(())
        }
    }
}

#[allow(clippy::print_stdout)] // command output
fn println_out(line: &str) {
    println!("{line}");
}

/// One slot as `walbox slot status` / `list` show it: the server's view, and
/// for `status` the publication's tables and walbox's checkpoint.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SlotReport {
    #[serde(flatten)]
    slot: SlotStatus,
    /// Tables of the configured publication (status only).
    #[serde(skip_serializing_if = "Option::is_none")]
    publication_tables: Option<Vec<String>>,
    /// walbox's checkpoint for this slot (status only).
    #[serde(skip_serializing_if = "Option::is_none")]
    checkpoint: Option<CheckpointStatus>,
}

impl From<SlotStatus> for SlotReport {
    fn from(slot: SlotStatus) -> Self {
        SlotReport {
            slot,
            publication_tables: None,
            checkpoint: None,
        }
    }
}

/// walbox's checkpoint as `slot status` shows it.
#[derive(Debug, Clone, serde::Serialize)]
struct CheckpointStatus {
    path: String,
    /// Acknowledged position (`null` when there is no checkpoint yet).
    lsn: Option<String>,
    /// How far the slot's confirmed position is behind the checkpoint: the
    /// replay window (or a server crash); negative when the slot is ahead.
    slot_behind_bytes: Option<i64>,
    /// `complete`, `unfinished`, or absent without a snapshot.
    #[serde(skip_serializing_if = "Option::is_none")]
    snapshot: Option<String>,
    /// The configured replay window.
    replay_window: String,
}

fn or_dash<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

#[allow(clippy::print_stdout)] // command output
fn print_slots(slots: &[SlotReport], json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(slots)?);
        return Ok(());
    }
    for report in slots {
        let s = &report.slot;
        println!("slot                 {}", s.slot);
        println!("  plugin             {}", or_dash(s.plugin.as_ref()));
        println!("  database           {}", or_dash(s.database.as_ref()));
        println!("  active pid         {}", or_dash(s.active_pid));
        println!(
            "  confirmed_flush    {}",
            or_dash(s.confirmed_flush_lsn.as_ref())
        );
        println!("  restart_lsn        {}", or_dash(s.restart_lsn.as_ref()));
        println!("  wal_status         {}", or_dash(s.wal_status.as_ref()));
        println!(
            "  WAL retained       {} bytes",
            or_dash(s.retained_wal_bytes)
        );
        println!("  lag behind server  {} bytes", or_dash(s.lag_bytes));
        // The columns of later majors, where the server has them.
        let bools = [
            ("conflicting", s.conflicting),
            ("failover", s.failover),
            ("synced", s.synced),
        ];
        for (name, value) in bools {
            if let Some(v) = value {
                println!("  {name:<18} {}", or_dash(v));
            }
        }
        let texts = [
            ("inactive_since", &s.inactive_since),
            ("invalidation_reason", &s.invalidation_reason),
            ("two_phase_at", &s.two_phase_at),
        ];
        for (name, value) in texts {
            if let Some(v) = value {
                println!("  {name:<18} {}", or_dash(v.as_ref()));
            }
        }
        if let Some(tables) = &report.publication_tables {
            println!("  publication tables {}", tables.join(", "));
        }
        if let Some(c) = &report.checkpoint {
            println!(
                "  checkpoint         {} ({})",
                or_dash(c.lsn.as_ref()),
                c.path
            );
            if let Some(snapshot) = &c.snapshot {
                println!("  snapshot           {snapshot}");
            }
            println!(
                "  slot behind it     {} bytes (replay window {})",
                or_dash(c.slot_behind_bytes),
                c.replay_window
            );
        }
    }
    Ok(())
}

/// `walbox slot status`: the configured slot.
pub async fn slot_status(config: &Config, json: bool) -> Result<()> {
    let sql = ConnParams::parse(config.dsn()?)?.connect().await?;
    let slot = &config.source.slot;
    let mut status = SlotReport::from(crate::slot::status(&sql, slot).await?.ok_or_else(|| {
        anyhow::anyhow!("slot {slot:?} does not exist; create it with `walbox setup`")
    })?);
    status.publication_tables = Some(
        sql.query(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1 ORDER BY 1",
            &[&config.source.publication],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect(),
    );
    let store = config.checkpoint_store();
    let saved = store.load()?;
    let lsn = saved.as_ref().map(|c| c.lsn);
    let confirmed: Option<walbox_pgoutput::Lsn> = status
        .slot
        .confirmed_flush_lsn
        .as_deref()
        .map(str::parse)
        .transpose()?;
    status.checkpoint = Some(CheckpointStatus {
        path: store.path().display().to_string(),
        lsn: lsn.map(|l| l.to_string()),
        slot_behind_bytes: lsn.zip(confirmed).map(|(c, s)| {
            let diff = i128::from(c.as_u64()) - i128::from(s.as_u64());
            i64::try_from(diff).unwrap_or(i64::MAX)
        }),
        snapshot: saved.as_ref().and_then(|c| c.snapshot.as_ref()).map(|s| {
            if s.complete {
                format!("complete ({} rows)", s.rows)
            } else {
                "unfinished (the next start takes it again)".to_owned()
            }
        }),
        replay_window: config.source.replay_window.clone(),
    });
    print_slots(&[status], json)
}

/// `walbox slot list`: every logical slot of the server.
pub async fn slot_list(config: &Config, json: bool) -> Result<()> {
    let sql = ConnParams::parse(config.dsn()?)?.connect().await?;
    let slots: Vec<SlotReport> = crate::slot::list(&sql)
        .await?
        .into_iter()
        .map(SlotReport::from)
        .collect();
    print_slots(&slots, json)
}

/// `walbox slot create`: the slot alone (idempotent).
pub async fn slot_create(config: &Config) -> Result<()> {
    let conn = ConnParams::parse(config.dsn()?)?.resolve().await?;
    let sql = conn.connect().await?;
    create_slot(&sql, &config.source.slot).await?;
    failover_slot(&conn, &sql, config).await
}

/// With `source.failover`, makes the slot a failover slot (refused before
/// PostgreSQL 17).
async fn failover_slot(
    conn: &ConnParams,
    sql: &tokio_postgres::Client,
    config: &Config,
) -> Result<()> {
    if crate::failover::ensure(conn, sql, config).await? {
        println_out(&format!(
            "slot {} is now a failover slot",
            config.source.slot
        ));
    }
    Ok(())
}

async fn create_slot(sql: &tokio_postgres::Client, slot: &str) -> Result<()> {
    match crate::slot::info(sql, slot).await? {
        Some(info) => {
            let plugin = info.plugin;
            if plugin.as_deref() != Some("pgoutput") {
                bail!("slot {slot} exists with plugin {plugin:?}; walbox needs pgoutput");
            }
            println_out(&format!("slot {slot} exists"));
        }
        None => {
            let lsn = crate::slot::create(sql, slot).await?;
            println_out(&format!("created slot {slot} at {lsn}"));
        }
    }
    Ok(())
}
