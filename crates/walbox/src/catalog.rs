//! An outbox table as the server's catalog describes it, in the shape pgoutput
//! announces it: the snapshot reads rows with it, `doctor` checks the mapping
//! against it.

use anyhow::{Context, Result};
use walbox_pgoutput::{Relation, RelationColumn, ReplicaIdentity};

/// Double-quotes an identifier for SQL.
pub fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A table and its primary key.
#[derive(Debug, Clone)]
pub struct Table {
    /// The columns pgoutput publishes (generated columns are not), in order;
    /// primary key columns carry the key flag.
    pub relation: Relation,
    /// Primary key columns in key order (empty without one).
    pub primary_key: Vec<String>,
    /// Columns filled from a sequence (identity, serial, bigserial), in column
    /// order: they grow in insertion order.
    pub sequenced: Vec<String>,
}

impl Table {
    /// `"schema"."name"`, quoted for SQL.
    pub fn quoted(&self) -> String {
        format!(
            "{}.{}",
            ident(&self.relation.namespace),
            ident(&self.relation.name)
        )
    }
}

/// Reads `schema.name`; `None` when there is no such ordinary or partitioned table.
pub async fn table(
    sql: &tokio_postgres::Client,
    schema: &str,
    name: &str,
) -> Result<Option<Table>> {
    let Some(row) = sql
        .query_opt(
            "SELECT c.oid, c.relreplident::text FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')",
            &[&schema, &name],
        )
        .await
        .with_context(|| format!("looking up {schema}.{name}"))?
    else {
        return Ok(None);
    };
    let oid: u32 = row.get(0);
    let identity: String = row.get(1);
    let primary_key: Vec<String> = sql
        .query(
            "SELECT a.attname::text FROM pg_index i
             CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
             WHERE i.indrelid = $1 AND i.indisprimary ORDER BY k.ord",
            &[&oid],
        )
        .await
        .context("reading the primary key")?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let columns = sql
        .query(
            "SELECT attname::text, atttypid, atttypmod FROM pg_attribute
             WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped AND attgenerated = ''
             ORDER BY attnum",
            &[&oid],
        )
        .await
        .context("reading the columns")?
        .iter()
        .map(|c| {
            let name: String = c.get(0);
            RelationColumn {
                flags: u8::from(primary_key.contains(&name)),
                name,
                type_oid: c.get(1),
                type_modifier: c.get(2),
            }
        })
        .collect();
    let sequenced: Vec<String> = sql
        .query(
            "SELECT a.attname::text FROM pg_attribute a
             LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
             WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped
               AND (a.attidentity <> '' OR pg_get_expr(d.adbin, d.adrelid) LIKE 'nextval(%')
             ORDER BY a.attnum",
            &[&oid],
        )
        .await
        .context("reading the sequence-filled columns")?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let replica_identity = match identity.as_str() {
        "n" => ReplicaIdentity::Nothing,
        "f" => ReplicaIdentity::Full,
        "i" => ReplicaIdentity::Index,
        _ => ReplicaIdentity::Default,
    };
    Ok(Some(Table {
        relation: Relation {
            xid: None,
            oid,
            namespace: schema.to_owned(),
            name: name.to_owned(),
            replica_identity,
            columns,
        },
        primary_key,
        sequenced,
    }))
}
