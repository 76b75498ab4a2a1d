//! The rights of the role walbox connects as, for `walbox doctor`: those it
//! lacks are checked where they are used; this module names the ones it has and
//! does not need, each with the statement that takes it away. What walbox needs
//! is in the README's "Least privilege" section.

use anyhow::Result;

/// The attributes of the connected role.
#[derive(Debug, Clone)]
pub struct Role {
    /// `current_user`.
    pub name: String,
    /// `SUPERUSER`.
    pub superuser: bool,
    /// `REPLICATION`.
    pub replication: bool,
    createdb: bool,
    createrole: bool,
    bypassrls: bool,
}

/// The connected role's attributes.
pub async fn role(sql: &tokio_postgres::Client) -> Result<Role> {
    let row = sql
        .query_one(
            "SELECT current_user::text, rolsuper, rolreplication, rolcreatedb, rolcreaterole, rolbypassrls \
             FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await?;
    Ok(Role {
        name: row.get(0),
        superuser: row.get(1),
        replication: row.get(2),
        createdb: row.get(3),
        createrole: row.get(4),
        bypassrls: row.get(5),
    })
}

const SEE: &str = "the README's \"Least privilege\" has the statements for a streaming role";

/// Row-level security on a table, as it bears on the connected role.
#[derive(Debug, Clone, Copy)]
pub struct RowSecurity {
    /// `ENABLE ROW LEVEL SECURITY`.
    pub enabled: bool,
    /// `FORCE ROW LEVEL SECURITY`: the owner is subject to it too.
    forced: bool,
    /// The role has the owner's rights (owner, or a member of it).
    owner: bool,
}

impl RowSecurity {
    /// Whether the table's policies apply to `role`'s reads: PostgreSQL exempts
    /// superusers, `BYPASSRLS` roles and, unless forced, the owner.
    pub fn applies_to(&self, role: &Role) -> bool {
        self.enabled && !role.superuser && !role.bypassrls && (!self.owner || self.forced)
    }
}

/// Row-level security on table `schema`.`name`, or `None` when there is no such
/// table.
pub async fn row_security(
    sql: &tokio_postgres::Client,
    schema: &str,
    name: &str,
) -> Result<Option<RowSecurity>> {
    let row = sql
        .query_opt(
            "SELECT c.relrowsecurity, c.relforcerowsecurity, pg_has_role(c.relowner, 'USAGE') \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2",
            &[&schema, &name],
        )
        .await?;
    Ok(row.map(|r| RowSecurity {
        enabled: r.get(0),
        forced: r.get(1),
        owner: r.get(2),
    }))
}

/// The warning for an outbox table whose row-level security applies to `role`,
/// or `None`.
pub fn row_security_warning(role: &Role, qualified: &str, rls: &RowSecurity) -> Option<String> {
    let user = &role.name;
    rls.applies_to(role).then(|| {
        format!(
            "{qualified} has row-level security enabled and role {user} is subject to it: \
             walbox reads tables with row_security = off so that a policy can never hide rows \
             from it, so a snapshot (setup --snapshot), replay --from-table and verify fail on \
             this table (streaming is not affected): ALTER ROLE {user} BYPASSRLS, or ALTER TABLE \
             {qualified} DISABLE ROW LEVEL SECURITY"
        )
    })
}

/// Rights `role` has that walbox never uses, one warning each with its fix.
/// `row_security`: whether an outbox table has row-level security enabled, which
/// makes `BYPASSRLS` needed.
pub async fn unneeded(
    sql: &tokio_postgres::Client,
    role: &Role,
    row_security: bool,
) -> Result<Vec<String>> {
    let user = &role.name;
    let mut out = Vec::new();
    if role.superuser {
        out.push(format!(
            "role {user} is a superuser; walbox needs only LOGIN, REPLICATION, CONNECT, USAGE on \
             the schema and SELECT on the outbox tables: run it as a role with just those ({SEE})"
        ));
        // A superuser has every right below too; one warning says it.
        return Ok(out);
    }
    let extra: Vec<&str> = [
        (role.createdb, "CREATEDB"),
        (role.createrole, "CREATEROLE"),
        (role.bypassrls && !row_security, "BYPASSRLS"),
    ]
    .into_iter()
    .filter_map(|(has, name)| has.then_some(name))
    .collect();
    if !extra.is_empty() {
        let revoke: Vec<String> = extra.iter().map(|a| format!("NO{a}")).collect();
        out.push(format!(
            "role {user} has {}, which walbox does not use: ALTER ROLE {user} {}",
            extra.join(", "),
            revoke.join(" ")
        ));
    }
    let owned = sql
        .query_one(
            "SELECT count(*), min(quote_ident(n.nspname) || '.' || quote_ident(c.relname)) \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.relkind IN ('r', 'p') \
               AND n.nspname NOT IN ('pg_catalog', 'information_schema') \
               AND n.nspname NOT LIKE 'pg\\_toast%' \
               AND pg_has_role(c.relowner, 'USAGE')",
            &[],
        )
        .await?;
    let (count, example): (i64, Option<String>) = (owned.get(0), owned.get(1));
    if count > 0 {
        out.push(format!(
            "role {user} owns {count} table(s) (such as {}), directly or through a role it is a \
             member of, so it may alter or drop them; walbox run only reads: stream as a role \
             without ownership and keep ownership for the role that runs walbox setup ({SEE})",
            example.unwrap_or_default()
        ));
    }
    Ok(out)
}

/// The writes `role` may make to table `oid` (`qualified` in messages), which
/// walbox never makes: a warning with the REVOKE, or `None`.
pub async fn writes(
    sql: &tokio_postgres::Client,
    role: &Role,
    oid: u32,
    qualified: &str,
) -> Result<Option<String>> {
    if role.superuser {
        return Ok(None);
    }
    let mut granted = Vec::new();
    for right in ["INSERT", "UPDATE", "DELETE", "TRUNCATE"] {
        let has: bool = sql
            .query_one("SELECT has_table_privilege($1::oid, $2)", &[&oid, &right])
            .await?
            .get(0);
        if has {
            granted.push(right);
        }
    }
    Ok((!granted.is_empty()).then(|| {
        let user = &role.name;
        format!(
            "role {user} may {} {qualified}; walbox only reads it: REVOKE {} ON {qualified} FROM {user} \
             (or stream as a role without these rights)",
            granted.join(", "),
            granted.join(", ")
        )
    }))
}
