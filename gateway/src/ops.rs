//! The operations endpoints every role serves: `GET /healthz` (liveness), `GET /readyz`
//! (dependencies) and `GET /metrics` (Prometheus text).
//!
//! A gateway serves them on its API listener (the handlers in [`crate::routes::health`]
//! call into [`Probes`]); an orchestrator or a worker process has no API listener, so it
//! serves [`router`] on `telemetry.metrics_listen` ([`serve`]). One home for what "ready"
//! means, so a load balancer and a Kubernetes probe read every role the same way.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use sb_common::bus::Bus;
use sb_common::session::SessionStore;
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::Metrics;
use sb_store::Health;
use serde::Serialize;
use tokio::net::TcpListener;

use crate::error::ApiJson;

/// What a process depends on, probed by `/readyz`.
#[derive(Clone)]
pub struct Probes {
    /// The ledger.
    pub database: Arc<dyn Health>,
    /// The message bus.
    pub bus: Arc<dyn Bus>,
    /// The session store.
    pub sessions: Arc<dyn SessionStore>,
    /// How long each probe may take before the dependency counts as unavailable.
    pub timeout: Duration,
}

/// `/readyz` body.
#[derive(Debug, Serialize)]
pub struct Readiness {
    /// `ready` or `degraded`.
    pub status: &'static str,
    /// Per dependency: `ok` or `unavailable`.
    pub checks: Checks,
}

/// Result of each dependency check.
#[derive(Debug, Serialize)]
pub struct Checks {
    /// The database.
    pub database: &'static str,
    /// The message bus.
    pub bus: &'static str,
    /// The session store.
    pub sessions: &'static str,
}

impl Probes {
    /// Probes the database, the bus and the session store concurrently: `200` when all
    /// answer within [`Probes::timeout`], `503` otherwise. Failure details are logged, not
    /// returned (they may name hosts).
    pub async fn readiness(&self) -> (StatusCode, Readiness) {
        let (database, bus, sessions) = tokio::join!(
            check("database", self.timeout, async {
                self.database.ping().await.map_err(|e| e.to_string())
            }),
            check("bus", self.timeout, async {
                self.bus.ping().await.map_err(|e| e.to_string())
            }),
            check("sessions", self.timeout, async {
                self.sessions.ping().await.map_err(|e| e.to_string())
            }),
        );
        let ready = database && bus && sessions;
        let word = |ok: bool| if ok { "ok" } else { "unavailable" };
        let body = Readiness {
            status: if ready { "ready" } else { "degraded" },
            checks: Checks {
                database: word(database),
                bus: word(bus),
                sessions: word(sessions),
            },
        };
        let status = if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        (status, body)
    }
}

async fn check(
    name: &str,
    timeout: Duration,
    probe: impl Future<Output = Result<(), String>>,
) -> bool {
    match tokio::time::timeout(timeout, probe).await {
        Ok(Ok(())) => true,
        Ok(Err(error)) => {
            tracing::warn!(dependency = name, %error, "readiness check failed");
            false
        }
        Err(_) => {
            tracing::warn!(dependency = name, ?timeout, "readiness check timed out");
            false
        }
    }
}

/// `GET /healthz`: the process serves requests. Checks nothing else, so an outage of a
/// dependency does not get the process restarted (that is what `/readyz` reports).
pub fn liveness() -> Response {
    ApiJson(serde_json::json!({"status": "ok"})).into_response()
}

/// `GET /metrics`: the process registry in the Prometheus text format.
pub fn metrics() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        Metrics::global().render(),
    )
        .into_response()
}

/// The three endpoints on their own, for a process without the API.
pub fn router(probes: Probes) -> Router {
    Router::new()
        .route("/healthz", get(|| async { liveness() }))
        .route(
            "/readyz",
            get(|State(probes): State<Probes>| async move {
                let (status, body) = probes.readiness().await;
                (status, ApiJson(body)).into_response()
            }),
        )
        .route("/metrics", get(|| async { metrics() }))
        .with_state(probes)
}

/// Serves [`router`] on `listener` until `shutdown` fires.
pub async fn serve(
    listener: TcpListener,
    probes: Probes,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    axum::serve(listener, router(probes))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}
