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

/// Rights `role` has that walbox never uses, one warning each with its fix.
pub async fn unneeded(sql: &tokio_postgres::Client, role: &Role) -> Result<Vec<String>> {
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
        (role.bypassrls, "BYPASSRLS"),
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
