//! The publication walbox reads through, checked against the configured outbox
//! tables. pgoutput sends only what the publication selects, so a publication
//! that leaves something out loses events without a word: one that does not
//! publish inserts, that no longer holds the outbox table (a table renamed or
//! replaced is not followed: membership is by table, not by name), whose column
//! list drops a column the mapping reads, with a row filter, or that sends the
//! changes of a partitioned outbox under each partition's name.
//!
//! [`problems`] judges the catalog facts [`fetch`] reads; `setup` fixes what it
//! may, `doctor` reports, and `run` refuses to start on any problem and keeps
//! checking while it streams ([`PublicationWatch`]): positions reported to the
//! server stay at or below the WAL position of the last passing check, so a
//! change of the publication is found before the slot passes it.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::sync::{Notify, watch};
use walbox_core::TableIdentity;
use walbox_outbox::{Mapper, TableConfig};
use walbox_pgoutput::{Lsn, Relation};

use crate::catalog::{self, ident};
use crate::pg::ConnParams;

/// Comment `walbox setup` puts on a publication it creates: the mark of a
/// publication walbox may change.
pub const CREATED_BY_WALBOX: &str = "created by walbox setup";

/// The publication as `pg_publication` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublicationFlags {
    /// `pubinsert`.
    pub inserts: bool,
    /// `pubupdate`.
    pub updates: bool,
    /// `pubdelete`.
    pub deletes: bool,
    /// `pubtruncate`.
    pub truncates: bool,
    /// `pubviaroot`: changes of partitions are published as their root table.
    pub via_root: bool,
    /// Whether `walbox setup` created it.
    pub walbox_made: bool,
}

/// A table's entry in the publication (`pg_publication_tables`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Membership {
    /// The column list; `None` publishes every column.
    pub columns: Option<Vec<String>>,
    /// The row filter, as SQL.
    pub row_filter: Option<String>,
}

/// A configured outbox table as the catalog shows it.
#[derive(Debug, Clone)]
pub struct FoundTable {
    /// Its real columns (generated columns excluded: pgoutput does not send them).
    pub relation: Relation,
    /// `relkind = 'p'`.
    pub partitioned: bool,
    /// For a partition: its root table, `schema.name`, and whether that root
    /// is in the publication.
    pub partition_root: Option<(String, bool)>,
    /// Its own entry, found by oid; `None` when it is not in the publication.
    pub membership: Option<Membership>,
}

/// What the catalog says about the publication and each configured table.
#[derive(Debug, Clone)]
pub struct Facts {
    /// The publication's name.
    pub publication: String,
    /// `None` when there is no such publication.
    pub flags: Option<PublicationFlags>,
    /// One entry per configured table, in configuration order: `schema.name`
    /// and what was found (`None`: no such table).
    pub tables: Vec<(String, Option<FoundTable>)>,
}

/// Something about the publication that would lose events, with its fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// There is no such publication.
    Missing { publication: String },
    /// It does not publish inserts.
    NoInserts {
        publication: String,
        publish: String,
    },
    /// An outbox table does not exist.
    NoTable { table: String },
    /// A partitioned outbox table needs `publish_via_partition_root`.
    NeedsViaRoot { publication: String, table: String },
    /// The table (this table: by oid) is not in the publication.
    NotMember { publication: String, table: String },
    /// A partition whose changes are published under its root's name.
    PublishedAsRoot {
        publication: String,
        table: String,
        root: String,
    },
    /// The column list leaves out columns the mapping reads.
    ColumnList {
        publication: String,
        table: String,
        missing: Vec<String>,
    },
    /// A row filter drops events.
    RowFilter {
        publication: String,
        table: String,
        filter: String,
    },
}

/// `"schema"."name"` from `schema.name`.
fn quoted(table: &str) -> String {
    match table.split_once('.') {
        Some((s, n)) => format!("{}.{}", ident(s), ident(n)),
        None => ident(table),
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Missing { publication } => write!(
                f,
                "publication {publication} does not exist: run `walbox setup`, or CREATE \
                 PUBLICATION {} FOR TABLE <the outbox tables> WITH (publish_via_partition_root = true)",
                ident(publication)
            ),
            Problem::NoInserts {
                publication,
                publish,
            } => write!(
                f,
                "publication {publication} does not publish inserts (publish = '{publish}'), so no \
                 outbox event reaches walbox: ALTER PUBLICATION {} SET (publish = '{}')",
                ident(publication),
                if publish.is_empty() {
                    "insert".to_owned()
                } else {
                    format!("insert, {publish}")
                }
            ),
            Problem::NoTable { table } => write!(f, "outbox table {table} does not exist"),
            Problem::NeedsViaRoot { publication, table } => write!(
                f,
                "outbox table {table} is partitioned and publication {publication} publishes its \
                 changes under each partition's name, which walbox does not map: ALTER \
                 PUBLICATION {} SET (publish_via_partition_root = true)",
                ident(publication)
            ),
            Problem::NotMember { publication, table } => write!(
                f,
                "outbox table {table} is not in publication {publication} (a table that was \
                 renamed or replaced is not followed by the publication), so its events do not \
                 reach walbox: ALTER PUBLICATION {} ADD TABLE {} (or `walbox setup`). When \
                 walbox has published from a table of this name before (it was swapped for a \
                 new one), its next start after the fix takes a snapshot of the new table \
                 before it streams on, because the slot has none of the rows written to it \
                 before it joined the publication: those the table still holds then are \
                 published; rows inserted and deleted again in that window (an outbox that \
                 deletes its rows) cannot be",
                ident(publication),
                quoted(table)
            ),
            Problem::PublishedAsRoot {
                publication,
                table,
                root,
            } => write!(
                f,
                "outbox table {table} is a partition of {root}, and publication {publication} \
                 publishes its changes as {root}: configure {root} as the outbox table, or ALTER \
                 PUBLICATION {} SET (publish_via_partition_root = false)",
                ident(publication)
            ),
            Problem::ColumnList {
                publication,
                table,
                missing,
            } => write!(
                f,
                "publication {publication} publishes a column list of {table} without {} that \
                 the mapping reads: publish every column with BEGIN; ALTER PUBLICATION {p} DROP \
                 TABLE {t}; ALTER PUBLICATION {p} ADD TABLE {t}; COMMIT",
                missing.join(", "),
                p = ident(publication),
                t = quoted(table)
            ),
            Problem::RowFilter {
                publication,
                table,
                filter,
            } => write!(
                f,
                "publication {publication} has a row filter on {table} (WHERE {filter}), which \
                 drops the events it filters out: publish every row with BEGIN; ALTER \
                 PUBLICATION {p} DROP TABLE {t}; ALTER PUBLICATION {p} ADD TABLE {t}; COMMIT",
                p = ident(publication),
                t = quoted(table)
            ),
        }
    }
}

/// Everything in `facts` that would lose events of the `tables` (configured
/// outbox tables, in the order `facts` lists them).
#[must_use]
pub fn problems(tables: &[TableConfig], producer: &str, facts: &Facts) -> Vec<Problem> {
    let publication = facts.publication.clone();
    let Some(flags) = &facts.flags else {
        let absent = facts.tables.iter().filter(|(_, t)| t.is_none());
        return std::iter::once(Problem::Missing { publication })
            .chain(absent.map(|(table, _)| Problem::NoTable {
                table: table.clone(),
            }))
            .collect();
    };
    let mut found = Vec::new();
    if !flags.inserts {
        let publish = [
            (flags.updates, "update"),
            (flags.deletes, "delete"),
            (flags.truncates, "truncate"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, op)| *op)
        .collect::<Vec<_>>()
        .join(", ");
        found.push(Problem::NoInserts {
            publication: publication.clone(),
            publish,
        });
    }
    for (config, (table, fact)) in tables.iter().zip(&facts.tables) {
        let table = table.clone();
        let publication = publication.clone();
        let Some(t) = fact else {
            found.push(Problem::NoTable { table });
            continue;
        };
        if t.partitioned && !flags.via_root {
            // Its changes come under the partitions' names; whether the root
            // is in the publication shows only once they do not.
            found.push(Problem::NeedsViaRoot { publication, table });
            continue;
        }
        if let Some((root, true)) = &t.partition_root
            && flags.via_root
        {
            found.push(Problem::PublishedAsRoot {
                publication,
                table,
                root: root.clone(),
            });
            continue;
        }
        let Some(member) = &t.membership else {
            found.push(Problem::NotMember { publication, table });
            continue;
        };
        if let Some(list) = &member.columns
            && let Ok(mapper) = Mapper::compile(config, producer, &t.relation)
        {
            // A mapping that does not fit the table is reported as such
            // (doctor; run when the table's Relation message arrives).
            let missing: Vec<String> = mapper
                .columns_used()
                .into_iter()
                .filter(|c| !list.iter().any(|l| l == c))
                .map(str::to_owned)
                .collect();
            if !missing.is_empty() {
                found.push(Problem::ColumnList {
                    publication: publication.clone(),
                    table: table.clone(),
                    missing,
                });
            }
        }
        if let Some(filter) = &member.row_filter {
            found.push(Problem::RowFilter {
                publication,
                table,
                filter: filter.clone(),
            });
        }
    }
    found
}

/// Reads the facts [`problems`] judges, in whatever transaction `sql` is in.
pub async fn fetch(
    sql: &tokio_postgres::Client,
    publication: &str,
    tables: &[TableConfig],
) -> Result<Facts> {
    let flags = sql
        .query_opt(
            "SELECT pubinsert, pubupdate, pubdelete, pubtruncate, pubviaroot,
                    coalesce(obj_description(oid, 'pg_publication') = $2, false)
             FROM pg_publication WHERE pubname = $1",
            &[&publication, &CREATED_BY_WALBOX],
        )
        .await
        .context("reading pg_publication")?
        .map(|r| PublicationFlags {
            inserts: r.get(0),
            updates: r.get(1),
            deletes: r.get(2),
            truncates: r.get(3),
            via_root: r.get(4),
            walbox_made: r.get(5),
        });
    // Column lists and row filters exist from PostgreSQL 15.
    let version: i32 = sql
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await?
        .get(0);
    let lists = if version >= 150_000 {
        "pt.attnames::text[], pt.rowfilter"
    } else {
        "NULL::text[], NULL::text"
    };
    let members: Vec<(u32, Membership)> = sql
        .query(
            &format!(
                "SELECT c.oid, {lists} FROM pg_publication_tables pt
                 JOIN pg_namespace n ON n.nspname = pt.schemaname
                 JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename
                 WHERE pt.pubname = $1"
            ),
            &[&publication],
        )
        .await
        .context("reading pg_publication_tables")?
        .iter()
        .map(|r| {
            (
                r.get(0),
                Membership {
                    columns: r.get(1),
                    row_filter: r.get(2),
                },
            )
        })
        .collect();
    let member = |oid: u32| members.iter().find(|(o, _)| *o == oid).map(|(_, m)| m);
    let mut found = Vec::new();
    for config in tables {
        let (schema, name) = config.qualified();
        let qualified = format!("{schema}.{name}");
        let Some(table) = catalog::table(sql, schema, name).await? else {
            found.push((qualified, None));
            continue;
        };
        let oid = table.relation.oid;
        let row = sql
            .query_one(
                "SELECT c.relkind = 'p', CASE WHEN c.relispartition THEN r.oid END,
                        rn.nspname::text || '.' || r.relname::text
                 FROM pg_class c
                 LEFT JOIN pg_class r ON r.oid = pg_partition_root(c.oid)
                 LEFT JOIN pg_namespace rn ON rn.oid = r.relnamespace
                 WHERE c.oid = $1",
                &[&oid],
            )
            .await
            .with_context(|| format!("reading the partitioning of {qualified}"))?;
        let root: Option<u32> = row.get(1);
        found.push((
            qualified,
            Some(FoundTable {
                partitioned: row.get(0),
                partition_root: root.map(|r| (row.get(2), member(r).is_some())),
                membership: member(oid).cloned(),
                relation: table.relation,
            }),
        ));
    }
    Ok(Facts {
        publication: publication.to_owned(),
        flags,
        tables: found,
    })
}

/// The identity of each configured outbox table that exists: its oid and the
/// catalog row that makes it a member of `publication` (0 when none does), read
/// in whatever transaction `sql` is in. walbox records them in its checkpoint;
/// a table whose identity changes between sessions may hold rows no slot has.
pub async fn identities(
    sql: &tokio_postgres::Client,
    publication: &str,
    tables: &[TableConfig],
) -> Result<BTreeMap<String, TableIdentity>> {
    let mut found = BTreeMap::new();
    for config in tables {
        let (schema, name) = config.qualified();
        let row = sql
            .query_opt(
                "SELECT c.oid,
                        coalesce(pr.oid, pn.oid, CASE WHEN p.puballtables THEN p.oid END, 0::oid)
                 FROM pg_class c
                 JOIN pg_namespace n ON n.oid = c.relnamespace
                 LEFT JOIN pg_publication p ON p.pubname = $3
                 LEFT JOIN pg_publication_rel pr ON pr.prpubid = p.oid AND pr.prrelid = c.oid
                 LEFT JOIN pg_publication_namespace pn
                        ON pn.pnpubid = p.oid AND pn.pnnspid = c.relnamespace
                 WHERE n.nspname = $1 AND c.relname = $2",
                &[&schema, &name, &publication],
            )
            .await
            .with_context(|| format!("reading the identity of {schema}.{name}"))?;
        if let Some(row) = row {
            found.insert(
                format!("{schema}.{name}"),
                TableIdentity {
                    oid: row.get(0),
                    membership: row.get(1),
                },
            );
        }
    }
    Ok(found)
}

/// The problems as one error message, a line each.
pub fn refusal(problems: &[Problem]) -> String {
    let lines: Vec<String> = problems.iter().map(|p| format!("  - {p}")).collect();
    format!(
        "the publication would lose outbox events:\n{}",
        lines.join("\n")
    )
}

/// How often a streaming relay checks the publication again.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// What the watch knows.
#[derive(Debug, Clone)]
struct WatchState {
    /// Changes committed at or below this position were seen by a passing check.
    verified: Lsn,
    /// Why the relay must stop.
    failure: Option<WatchFailure>,
}

/// Why a watched relay must stop.
#[derive(Debug, Clone)]
pub struct WatchFailure {
    /// The error, naming the problem and its fix.
    pub message: String,
    /// A lost connection (a new session may succeed), not a problem found.
    pub retry: bool,
}

/// Checks the publication while a relay streams, on an SQL connection and a
/// task of its own, every [`CHECK_EVERY`] and when asked.
///
/// A check reads the server's WAL position, then the open transactions, then
/// the catalog in one snapshot. A position is verified when a later check
/// passed and no transaction that was open when the position was read is
/// still committing (committed but not yet visible): then every change
/// committed at or below it was visible to that check. The relay reports no
/// position beyond [`verified_up_to`](Self::verified_up_to), so a publication
/// changed under it (the outbox table swapped for a new one) stops it before the
/// slot passes the change.
pub struct PublicationWatch {
    state: watch::Receiver<WatchState>,
    recheck: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PublicationWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One check's reading: its WAL position and the transactions open then.
struct Reading {
    wal: Lsn,
    open: Vec<String>,
}

impl PublicationWatch {
    /// Checks once (an error lists every problem, each with its fix), then
    /// keeps checking on a task of its own.
    ///
    /// `identities` are the outbox tables' identities the session started with:
    /// a check that finds another one (a table swapped for a new one that the
    /// publication takes in at once, as `FOR ALL TABLES` does; a table dropped
    /// from the publication and added again between two checks) ends the session
    /// as a retry, so that the next one takes the table's snapshot before it
    /// streams past it.
    pub async fn start(
        conn: &ConnParams,
        publication: &str,
        tables: &[TableConfig],
        producer: &str,
        identities: BTreeMap<String, TableIdentity>,
    ) -> Result<Self> {
        let sql = conn.connect().await?;
        let checker = Checker {
            publication: publication.to_owned(),
            tables: tables.to_vec(),
            producer: producer.to_owned(),
            identities,
        };
        let (first, _) = checker.round(&sql, None).await?;
        let (tx, state) = watch::channel(WatchState {
            verified: Lsn(0),
            failure: None,
        });
        let recheck = Arc::new(Notify::new());
        let nudge = Arc::clone(&recheck);
        let task = tokio::spawn(async move {
            let mut previous = first;
            loop {
                tokio::select! {
                    () = tokio::time::sleep(CHECK_EVERY) => {}
                    () = nudge.notified() => {}
                }
                match checker.round(&sql, Some(&previous)).await {
                    Ok((reading, settled)) => {
                        // Sent after every check, so that `settle` hears of each.
                        tx.send_modify(|s| {
                            if settled {
                                s.verified = s.verified.max(previous.wal);
                            }
                        });
                        previous = reading;
                    }
                    Err(e) => {
                        let retry = e.downcast_ref::<Refused>().is_none();
                        tx.send_modify(|s| {
                            s.failure = Some(WatchFailure {
                                message: format!("{e:#}"),
                                retry,
                            });
                        });
                        return;
                    }
                }
            }
        });
        Ok(PublicationWatch {
            state,
            recheck,
            task,
        })
    }

    /// Positions at or below this are safe to report.
    pub fn verified_up_to(&self) -> Lsn {
        self.state.borrow().verified
    }

    /// Why the relay must stop, once a check failed.
    pub fn failure(&self) -> Option<WatchFailure> {
        self.state.borrow().failure.clone()
    }

    /// Checks at once until `target` is verified (two checks: one that reads a
    /// WAL position at or past it, one that confirms it): on a clean stop, so
    /// that the final position is not held back by the check interval. Returns
    /// the failure when a check fails; gives up after `timeout` (the position
    /// then stays where the checks left it).
    pub async fn settle(&mut self, target: Lsn, timeout: Duration) -> Option<WatchFailure> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            {
                let state = self.state.borrow_and_update();
                if state.failure.is_some() || state.verified >= target {
                    return state.failure.clone();
                }
            }
            self.recheck.notify_one();
            match tokio::time::timeout_at(deadline, self.state.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return self.failure(),
                Err(_) => {
                    tracing::warn!(%target, verified = %self.verified_up_to(),
                        "the publication was not checked up to the final position in time; \
                         the position stays at the last check");
                    return None;
                }
            }
        }
    }

    /// Checks again now (a mapped table's Relation message came with another
    /// name).
    pub fn recheck(&self) {
        self.recheck.notify_one();
    }
}

/// A check found an outbox table with another identity than the session
/// started with: a new session (which takes its snapshot) can go on.
#[derive(Debug)]
pub struct IdentityChanged(String);

impl fmt::Display for IdentityChanged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for IdentityChanged {}

/// A check that found problems (as opposed to one that could not run).
#[derive(Debug)]
struct Refused(String);

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

struct Checker {
    publication: String,
    tables: Vec<TableConfig>,
    producer: String,
    /// The tables' identities when the session started.
    identities: BTreeMap<String, TableIdentity>,
}

impl Checker {
    /// One check: an error when it finds problems. Returns this check's
    /// reading and whether `previous` is now verified.
    async fn round(
        &self,
        sql: &tokio_postgres::Client,
        previous: Option<&Reading>,
    ) -> Result<(Reading, bool)> {
        // Separate statements, in this order: each takes a newer snapshot.
        let wal: String = sql
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .context("checking the publication")?
            .get(0);
        let open: Vec<String> = sql
            .query_one(
                "SELECT coalesce(array_agg(x::text), '{}')
                 FROM pg_snapshot_xip(pg_current_snapshot()) x",
                &[],
            )
            .await
            .context("checking the publication")?
            .get(0);
        sql.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .await
            .context("checking the publication")?;
        let checked = async {
            let facts = fetch(sql, &self.publication, &self.tables).await?;
            let committing: i64 = sql
                .query_one(
                    "SELECT count(*) FROM unnest($1::text[]) x
                     WHERE NOT pg_visible_in_snapshot(x::xid8, pg_current_snapshot())
                       AND pg_xact_status(x::xid8) = 'committed'",
                    &[&previous.map(|p| p.open.clone()).unwrap_or_default()],
                )
                .await?
                .get(0);
            let now = identities(sql, &self.publication, &self.tables).await?;
            Ok::<_, anyhow::Error>((facts, committing, now))
        }
        .await;
        let ended = sql.batch_execute("COMMIT").await;
        let (facts, committing, now) = checked.context("checking the publication")?;
        ended.context("checking the publication")?;
        let found = problems(&self.tables, &self.producer, &facts);
        if !found.is_empty() {
            return Err(Refused(refusal(&found)).into());
        }
        if let Some((table, was)) = self
            .identities
            .iter()
            .find(|(t, id)| now.get(*t).is_some_and(|n| n != *id))
        {
            return Err(IdentityChanged(format!(
                "outbox table {table} changed identity while streaming (was {was}, now {}): it \
                 was swapped for a new table or added to the publication again, so the slot may \
                 lack rows written to it in between; a new session takes its snapshot before \
                 streaming past it",
                now[table]
            ))
            .into());
        }
        let reading = Reading {
            wal: wal.parse().context("pg_current_wal_lsn")?,
            open,
        };
        Ok((reading, committing == 0))
    }
}

#[cfg(test)]
mod tests;
