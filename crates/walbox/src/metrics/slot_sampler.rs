//! The slot's gauges, sampled every few seconds on an SQL connection of their
//! own with the query `walbox slot status` uses ([`crate::slot::status`]), and
//! the server's version for `walbox_build_info`.

use std::sync::Arc;
use std::time::Duration;

use super::Metrics;
use crate::pg::ConnParams;

/// How often the slot is sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);

/// Samples slot `slot` until the process ends; reconnects after an error.
pub async fn run(metrics: Arc<Metrics>, conn: ConnParams, slot: String) {
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sql: Option<tokio_postgres::Client> = None;
    loop {
        tick.tick().await;
        if sql.as_ref().is_none_or(tokio_postgres::Client::is_closed) {
            match connect(&metrics, &conn).await {
                Ok(c) => sql = Some(c),
                Err(e) => {
                    tracing::debug!(error = %format!("{e:#}"), "slot sampler: cannot connect");
                    continue;
                }
            }
        }
        let Some(client) = &sql else { continue };
        match tokio::time::timeout(SAMPLE_EVERY * 5, crate::slot::status(client, &slot)).await {
            Ok(Ok(found)) => record(&metrics, &slot, found.as_ref()),
            Ok(Err(e)) => {
                tracing::debug!(error = %format!("{e:#}"), "slot sampler: query failed");
                sql = None;
            }
            Err(_) => sql = None,
        }
    }
}

async fn connect(metrics: &Metrics, conn: &ConnParams) -> anyhow::Result<tokio_postgres::Client> {
    let sql = conn.connect().await?;
    let version: String = sql.query_one("SHOW server_version", &[]).await?.get(0);
    metrics.set_build_info(&version);
    Ok(sql)
}

/// Sets the slot's gauges from its status (`None`: it does not exist).
pub fn record(metrics: &Metrics, slot: &str, found: Option<&crate::slot::SlotStatus>) {
    let Some(s) = found else {
        metrics.slot_active.set(0);
        metrics.set_wal_status(None);
        metrics
            .health
            .set_slot_problem(Some(format!("replication slot {slot:?} does not exist")));
        return;
    };
    metrics.slot_active.set(i64::from(s.active_pid.is_some()));
    metrics.set_wal_status(s.wal_status.as_deref());
    if let Some(v) = s.retained_wal_bytes {
        metrics.slot_retained_wal_bytes.set(v);
    }
    if let Some(v) = s.lag_bytes {
        metrics.slot_confirmed_lag_bytes.set(v);
    }
    if let Some(v) = s.safe_wal_size {
        metrics.slot_safe_wal_size_bytes.set(v);
    }
    metrics
        .health
        .set_slot_problem((s.wal_status.as_deref() == Some("lost")).then(|| {
            format!(
                "replication slot {slot:?} is invalidated (wal_status = lost): the server \
                 removed WAL it still needed"
            )
        }));
}
