//! `GET /healthz` (liveness), `GET /readyz` (dependencies), `GET /metrics` (Prometheus).

use std::future::Future;
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use sb_common::telemetry::Registry;
use serde::Serialize;

use crate::error::ApiJson;
use crate::state::AppState;

/// `GET /healthz`: the process serves requests. Checks nothing else, so an outage of a
/// dependency does not get the gateway restarted (that is what `/readyz` reports).
pub async fn healthz() -> impl IntoResponse {
    ApiJson(serde_json::json!({"status": "ok"}))
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

/// `GET /readyz`: `200` when the database, the bus and the session store all answer within
/// the readiness timeout, `503` otherwise. Failure details are logged, not returned.
pub async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let timeout = state.options().readiness_timeout;
    let (database, bus, sessions) = tokio::join!(
        check("database", timeout, async {
            state
                .stores()
                .health
                .ping()
                .await
                .map_err(|e| e.to_string())
        }),
        check("bus", timeout, async {
            state.bus().ping().await.map_err(|e| e.to_string())
        }),
        check("sessions", timeout, async {
            state.sessions().ping().await.map_err(|e| e.to_string())
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
    (status, ApiJson(body))
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

/// `GET /metrics`: the process registry in the Prometheus text format.
pub async fn metrics() -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        Registry::global().render(),
    )
}
