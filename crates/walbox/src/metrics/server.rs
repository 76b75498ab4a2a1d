//! The HTTP endpoint: `/metrics`, `/healthz` and `/readyz`, served by axum on a
//! thread and runtime of its own.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use axum::Router;
use axum::extract::State as Shared;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use super::Metrics;

/// OpenMetrics, which Prometheus reads.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Binds `listen` and serves the endpoints on a thread of their own until the
/// process ends; `also` runs on the same runtime (the slot sampler). Returns
/// the address bound.
pub fn start<F>(
    listen: &str,
    metrics: Arc<Metrics>,
    also: impl FnOnce() -> F + Send + 'static,
) -> Result<SocketAddr>
where
    F: std::future::Future<Output = ()> + 'static,
{
    let std_listener = std::net::TcpListener::bind(listen).with_context(|| {
        format!(
            "metrics.listen {listen:?}: cannot listen there (in use, or not an address of this \
             machine); choose another address:port, or leave it unset to serve no metrics"
        )
    })?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the metrics runtime")?;
    std::thread::Builder::new()
        .name("walbox-metrics".into())
        .spawn(move || {
            runtime.block_on(async move {
                let local = tokio::task::LocalSet::new();
                local
                    .run_until(async move {
                        tokio::task::spawn_local(also());
                        let listener = match tokio::net::TcpListener::from_std(std_listener) {
                            Ok(l) => l,
                            Err(e) => {
                                tracing::error!(error = %e, "metrics endpoint");
                                return;
                            }
                        };
                        let app = Router::new()
                            .route("/metrics", get(scrape))
                            .route("/healthz", get(healthz))
                            .route("/readyz", get(readyz))
                            .with_state(metrics);
                        if let Err(e) = axum::serve(listener, app).await {
                            tracing::error!(error = %e, "metrics endpoint stopped");
                        }
                    })
                    .await;
            });
        })
        .context("starting the metrics thread")?;
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    Ok(addr)
}

async fn scrape(Shared(m): Shared<Arc<Metrics>>) -> Response {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], m.encode()).into_response()
}

fn answer(ok: bool, state: super::State, reason: String) -> Response {
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({ "state": state.as_str(), "reason": reason }).to_string();
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn healthz(Shared(m): Shared<Arc<Metrics>>) -> Response {
    let (ok, state, reason) = m.health.liveness(Instant::now());
    answer(ok, state, reason)
}

async fn readyz(Shared(m): Shared<Arc<Metrics>>) -> Response {
    let (ok, state, reason) = m.health.readiness(Instant::now());
    answer(ok, state, reason)
}
