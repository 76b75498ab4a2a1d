//! `walbox doctor`: checks a server and the destination ([`destination`])
//! before first use and says what to fix; with `--standby`, a standby for a
//! failover too ([`standby`]).

mod destination;
mod standby;

use std::fmt;

use anyhow::{Result, bail};
use walbox_outbox::Mapper;

use crate::config::Config;
use crate::pg::ConnParams;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Verdict {
    Ok,
    Warn,
    Fail,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Ok => "ok  ",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
        })
    }
}

#[derive(Debug, Default)]
struct Report {
    lines: Vec<(Verdict, String)>,
}

impl Report {
    fn add(&mut self, verdict: Verdict, text: impl Into<String>) {
        self.lines.push((verdict, text.into()));
    }
    fn check(&mut self, good: bool, ok: impl Into<String>, fail: impl Into<String>) {
        if good {
            self.add(Verdict::Ok, ok);
        } else {
            self.add(Verdict::Fail, fail);
        }
    }
}

/// The longest delay before the shipped deployments start walbox again after
/// a crash: a crash-looping Kubernetes pod's back-off (`deploy/kubernetes`);
/// the systemd unit waits 5 s.
pub(crate) const CRASH_LOOP_RESTART_S: u64 = 300;

/// The risk of a NATS duplicate window of `window_s` seconds: shorter than a
/// restart after a crash loop and as long again to catch up, a resend after
/// such a restart may be stored twice.
pub(crate) fn duplicate_window_risk(window_s: u64) -> Option<String> {
    let needed = 2 * CRASH_LOOP_RESTART_S;
    (window_s < needed).then(|| {
        format!(
            "sink.nats.duplicate_window_s = {window_s} is shorter than {needed} s, twice the \
             {CRASH_LOOP_RESTART_S} s a crash-looping Kubernetes pod waits before its next start: \
             events resent after such a restart can be stored twice; raise it to {needed} or \
             more (and the stream's: nats stream edit <stream> --dupe-window {needed}s)"
        )
    })
}

/// The longest `sink.webhook.max_retry_duration_s` walbox takes without a
/// warning: 6 hours.
const WEBHOOK_RETRY_CEILING_S: u64 = 6 * 3600;

/// The risk of a webhook retry ceiling of `seconds`: a key the receiver keeps
/// refusing holds the slot's WAL from its event on for that long.
pub(crate) fn webhook_retry_risk(seconds: u64) -> Option<String> {
    (seconds > WEBHOOK_RETRY_CEILING_S).then(|| {
        format!(
            "sink.webhook.max_retry_duration_s = {seconds}: one key the receiver keeps failing \
             holds the slot's WAL from its event on for up to {} h before the event is \
             dead-lettered; the primary's disk must hold that much WAL (see \
             max_slot_wal_keep_size and the retained-WAL alert), or lower it",
            seconds / 3600
        )
    })
}

async fn setting(sql: &tokio_postgres::Client, name: &str) -> Result<String> {
    Ok(sql
        .query_one("SELECT current_setting($1)", &[&name])
        .await?
        .get(0))
}

/// Runs every check (the standby's too, when given), prints one line per check,
/// fails when any check failed.
pub async fn run(config: &Config, standby_dsn: Option<&str>) -> Result<()> {
    let conn = ConnParams::parse(config.dsn()?)?;
    let sql = conn.connect().await?;
    let mut r = Report::default();
    r.add(Verdict::Ok, format!("connected to {}", conn.describe()));

    let wal_level = setting(&sql, "wal_level").await?;
    r.check(
        wal_level == "logical",
        "wal_level = logical",
        format!("wal_level = {wal_level}: set wal_level = logical and restart the server"),
    );

    let slot = &config.source.slot;
    let slot_row = crate::slot::info(&sql, slot).await?;
    let (max_slots, used_slots) = crate::slot::slots_in_use(&sql).await?;
    match &slot_row {
        Some(info) => {
            let plugin = info.plugin.clone();
            if plugin.as_deref() != Some("pgoutput") {
                r.add(Verdict::Fail, format!("slot {slot} uses plugin {plugin:?}, not pgoutput"));
            } else if let Some(why) = info.invalidation() {
                r.add(
                    Verdict::Fail,
                    format!(
                        "slot {slot} is invalidated ({why}): drop it and set up again \
                         (`walbox slot drop`, then `walbox setup --snapshot`)"
                    ),
                );
            } else {
                r.add(Verdict::Ok, format!("slot {slot} exists ({})", slot_columns(info)));
            }
        }
        None => r.check(
            used_slots < max_slots,
            format!("max_replication_slots: {used_slots} of {max_slots} used, room for slot {slot}"),
            format!("max_replication_slots: all {max_slots} used; raise it (restart) or drop an unused slot"),
        ),
    }
    match crate::relay::where_run_starts(&sql, config).await {
        Ok(Some(start)) => r.add(Verdict::Ok, start),
        Ok(None) => {}
        Err(e) => r.add(Verdict::Fail, format!("{e:#}")),
    }
    let (max_senders, used_senders) = crate::slot::senders_in_use(&sql).await?;
    r.check(
        used_senders < max_senders,
        format!("max_wal_senders: {used_senders} of {max_senders} in use"),
        format!("max_wal_senders: all {max_senders} in use; raise it (restart)"),
    );

    let role = crate::privileges::role(&sql).await?;
    let user = role.name.clone();
    r.check(
        role.replication || role.superuser,
        format!("role {user} may replicate"),
        format!("role {user} lacks REPLICATION: ALTER ROLE {user} REPLICATION"),
    );
    let mut row_security = Vec::new();
    for table in &config.outbox {
        let (schema, name) = table.qualified();
        if let Some(rls) = crate::privileges::row_security(&sql, schema, name).await? {
            row_security.push((format!("{schema}.{name}"), rls));
        }
    }
    let any_rls = row_security.iter().any(|(_, rls)| rls.enabled);
    for extra in crate::privileges::unneeded(&sql, &role, any_rls).await? {
        r.add(Verdict::Warn, extra);
    }
    for (qualified, rls) in &row_security {
        if let Some(w) = crate::privileges::row_security_warning(&role, qualified, rls) {
            r.add(Verdict::Warn, w);
        }
    }

    let keep = setting(&sql, "max_slot_wal_keep_size").await?;
    if keep == "-1" {
        r.add(
            Verdict::Warn,
            "max_slot_wal_keep_size = -1 (unlimited): a stopped walbox keeps WAL until the disk fills; \
             set a limit the disk can hold",
        );
    } else {
        r.add(Verdict::Ok, format!("max_slot_wal_keep_size = {keep}"));
    }

    // PostgreSQL 18+: a slot nobody reads for this long is invalidated.
    let idle: Option<String> = sql
        .query_one(
            "SELECT current_setting('idle_replication_slot_timeout', true)",
            &[],
        )
        .await?
        .get(0);
    match idle.as_deref() {
        None => {}
        Some("0") => r.add(Verdict::Ok, "idle_replication_slot_timeout = 0 (disabled)"),
        Some(timeout) => r.add(
            Verdict::Warn,
            format!(
                "idle_replication_slot_timeout = {timeout}: when walbox is stopped longer, the \
                 server invalidates the slot at a checkpoint and the events committed meanwhile \
                 can only be recovered with a snapshot; set it to 0, or longer than walbox may \
                 ever be stopped"
            ),
        ),
    }

    let publication = &config.source.publication;
    let facts = crate::publication::fetch(&sql, publication, &config.outbox).await?;
    let problems = crate::publication::problems(&config.outbox, &config.producer, &facts);
    for p in &problems {
        r.add(Verdict::Fail, p.to_string());
    }
    if problems.is_empty() {
        for table in &config.outbox {
            let (schema, name) = table.qualified();
            r.add(
                Verdict::Ok,
                format!(
                    "{schema}.{name} is in publication {publication}: its inserts, every mapped \
                     column, no row filter"
                ),
            );
        }
    }
    for m in &config.messages {
        for prefix in &m.prefixes {
            r.add(
                Verdict::Ok,
                format!(
                    "message prefix {prefix:?} (format {}): logical decoding messages need no \
                     table in publication {publication}",
                    m.formatting.format.name()
                ),
            );
        }
    }
    for table in &config.outbox {
        let (schema, name) = table.qualified();
        let qualified = format!("{schema}.{name}");
        let Some(found) = crate::catalog::table(&sql, schema, name).await? else {
            // Reported with the publication.
            continue;
        };
        let oid = found.relation.oid;
        let usage: bool = sql
            .query_one("SELECT has_schema_privilege($1, 'USAGE')", &[&schema])
            .await?
            .get(0);
        r.check(
            usage,
            format!("{user} may use schema {schema}"),
            format!("{user} cannot use schema {schema}: GRANT USAGE ON SCHEMA {schema} TO {user}"),
        );
        let select: bool = sql
            .query_one("SELECT has_table_privilege($1::oid, 'SELECT')", &[&oid])
            .await?
            .get(0);
        r.check(
            select,
            format!("{user} may SELECT from {qualified}"),
            format!("{user} cannot SELECT from {qualified}: GRANT SELECT ON {qualified} TO {user}"),
        );
        if let Some(w) = crate::privileges::writes(&sql, &role, oid, &qualified).await? {
            r.add(Verdict::Warn, w);
        }
        // The order a snapshot reads the table in.
        match crate::snapshot::read_order(&found, table, &config.snapshot) {
            Ok(order) => match order.warning {
                Some(w) => r.add(Verdict::Warn, w),
                None => r.add(
                    Verdict::Ok,
                    format!(
                        "a snapshot reads {qualified} by {} ({})",
                        order.columns.join(", "),
                        order.basis
                    ),
                ),
            },
            Err(e) => r.add(Verdict::Fail, format!("{e:#}")),
        }
        // The table's columns against the mapping, as walbox will see them.
        let relation = found.relation;
        match Mapper::compile(table, &config.producer, &relation) {
            Ok(_) => r.add(Verdict::Ok, format!("{qualified} columns fit the mapping")),
            Err(e) => r.add(Verdict::Fail, e.to_string()),
        }
    }

    if let Some(dsn) = standby_dsn {
        standby::check(&mut r, &sql, config, dsn).await?;
    } else if config.source.failover {
        let major = crate::failover::server_major(&sql).await?;
        let waited = crate::failover::waited_standby_slots(&sql, major).await?;
        if let Some(risk) = crate::failover::unwaited_standby_risk(waited.as_deref()) {
            r.add(Verdict::Warn, risk);
        }
    }

    destination::check(&mut r, config).await;
    if config.sink.kind == crate::config::SinkKind::Nats {
        let window = config.sink.nats.duplicate_window_s();
        match duplicate_window_risk(window) {
            Some(w) => r.add(Verdict::Warn, w),
            None => r.add(
                Verdict::Ok,
                format!(
                    "sink.nats.duplicate_window_s = {window} covers a restart after a crash loop \
                     ({CRASH_LOOP_RESTART_S} s) and as long again to catch up"
                ),
            ),
        }
    }

    if config.sink.kind == crate::config::SinkKind::Webhook {
        match config.webhook_sink() {
            Ok(w) => {
                match webhook_retry_risk(w.max_retry_duration_s) {
                    Some(risk) => r.add(Verdict::Warn, risk),
                    None => r.add(
                        Verdict::Ok,
                        format!(
                            "sink.webhook.max_retry_duration_s = {}: a key held by retries is \
                             dead-lettered within {} min",
                            w.max_retry_duration_s,
                            w.max_retry_duration_s / 60
                        ),
                    ),
                }
                let path = w.dead_letter_file.unwrap_or_default();
                match std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                {
                    Ok(_) => r.add(
                        Verdict::Ok,
                        format!("dead letters go to {} (writable)", path.display()),
                    ),
                    Err(e) => r.add(
                        Verdict::Fail,
                        format!(
                            "sink.webhook.dead_letter_file {}: {e}; dead letters could not be \
                             kept",
                            path.display()
                        ),
                    ),
                }
            }
            Err(e) => r.add(Verdict::Fail, format!("{e:#}")),
        }
    }
    if config.sink.kind == crate::config::SinkKind::Redis {
        let redis = config.sink.redis_sink(&config.source.slot)?;
        match walbox_sink::server_durability(&redis).await {
            Ok(d @ walbox_sink::Durability::Synced) => r.add(Verdict::Ok, d.describe()),
            Ok(d @ walbox_sink::Durability::Unknown(_)) => r.add(Verdict::Warn, d.describe()),
            Ok(d) if redis.allow_unsynced => r.add(
                Verdict::Warn,
                format!("{} (sink.redis.allow_unsynced = true)", d.describe()),
            ),
            Ok(d) => r.add(
                Verdict::Fail,
                format!(
                    "{}; walbox run refuses it: set appendonly yes, appendfsync always and \
                     no-appendfsync-on-rewrite no",
                    d.describe()
                ),
            ),
            Err(e @ walbox_sink::SinkError::RedisAuthentication { .. }) => r.add(
                Verdict::Fail,
                format!(
                    "sink.redis: {e}: check sink.redis.username and password (or the URL's, or \
                     WALBOX_REDIS_PASSWORD)"
                ),
            ),
            Err(e) => r.add(
                Verdict::Fail,
                format!("sink.redis: {e}: check sink.redis.url and that the server runs"),
            ),
        }
    }
    if config.sink.kind == crate::config::SinkKind::PubSub {
        match walbox_sink::describe_pubsub(&config.sink.pubsub_sink()?).await {
            Ok((ok, warn)) => {
                r.add(Verdict::Ok, ok);
                if let Some(w) = warn {
                    r.add(Verdict::Warn, w);
                }
            }
            Err(e) => r.add(Verdict::Fail, format!("sink.pubsub: {e}")),
        }
    }
    if config.sink.kind == crate::config::SinkKind::RabbitMq {
        match config.sink.rabbitmq.mode {
            walbox_sink::RabbitMqMode::Stream => r.add(
                Verdict::Warn,
                "sink.rabbitmq.mode = \"stream\": RabbitMQ streams do not fsync; a confirm \
                 means replicated to a quorum of nodes, so a single-node broker can lose what it \
                 confirmed on a power loss (a kill of the process is safe)",
            ),
            walbox_sink::RabbitMqMode::Exchange => r.add(
                Verdict::Ok,
                format!(
                    "sink.rabbitmq.mode = \"exchange\": at least once (same message_id); a \
                     confirm is durable only for queues bound to exchange {:?} that are durable \
                     (classic or quorum)",
                    config.sink.rabbitmq.exchange
                ),
            ),
        }
    }

    print(&r);
    let failed = r.lines.iter().filter(|(v, _)| *v == Verdict::Fail).count();
    if failed > 0 {
        bail!("{failed} check(s) failed");
    }
    Ok(())
}

/// The slot's columns as the server has them: plugin and `wal_status`, then
/// those of 16+ (`conflicting`) and 17+ (`failover`, `synced`,
/// `inactive_since`) where present.
fn slot_columns(info: &crate::slot::SlotInfo) -> String {
    let mut text = format!(
        "{}, wal_status {}",
        info.plugin.as_deref().unwrap_or_default(),
        info.wal_status.as_deref().unwrap_or("-")
    );
    for (name, value) in [
        ("conflicting", info.conflicting),
        ("failover", info.failover),
        ("synced", info.synced),
    ] {
        if let Some(v) = value {
            text.push_str(&format!(", {name} {v}"));
        }
    }
    if let Some(since) = &info.inactive_since {
        text.push_str(&format!(", inactive since {since}"));
    }
    text
}

#[allow(clippy::print_stdout)] // command output
fn print(r: &Report) {
    for (verdict, text) in &r.lines {
        println!("{verdict} {text}");
    }
}

#[cfg(test)]
mod window_tests {
    use super::*;

    #[test]
    fn a_webhook_retry_ceiling_past_six_hours_is_a_risk_and_the_default_is_not() {
        assert_eq!(
            webhook_retry_risk(walbox_sink::WebhookSinkConfig::default().max_retry_duration_s),
            None
        );
        assert_eq!(webhook_retry_risk(6 * 3600), None);
        let risk = webhook_retry_risk(24 * 3600).expect("a day is a risk");
        assert!(risk.contains("24 h"), "{risk}");
        assert!(risk.contains("max_slot_wal_keep_size"), "{risk}");
    }

    #[test]
    fn a_duplicate_window_shorter_than_a_crash_loop_restart_and_catch_up_is_a_risk() {
        let risk = duplicate_window_risk(120).expect("120 s is too short");
        for part in [
            "duplicate_window_s = 120",
            "600 s",
            "300 s",
            "--dupe-window 600s",
        ] {
            assert!(risk.contains(part), "{part}: {risk}");
        }
        assert!(duplicate_window_risk(599).is_some());
        assert_eq!(duplicate_window_risk(600), None);
        // The default is no risk.
        assert_eq!(
            duplicate_window_risk(walbox_sink::NatsSinkConfig::default().duplicate_window_s()),
            None
        );
    }
}
