//! `GET /healthz` (liveness), `GET /readyz` (dependencies), `GET /metrics` (Prometheus).

use axum::extract::State;
use axum::response::IntoResponse;

use crate::error::ApiJson;
use crate::ops::{self, Probes};
use crate::state::AppState;

/// `GET /healthz`: the process serves requests (see [`ops::liveness`]).
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "meta",
    responses(
        (status = 200, description = "The process serves requests", body = Object, content_type = "application/json"),
    )
)]
pub async fn healthz() -> impl IntoResponse {
    ops::liveness()
}

/// `GET /readyz`: `200` when the database, the bus and the session store all answer within
/// the readiness timeout, `503` otherwise (see [`ops::Probes::readiness`]).
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "meta",
    responses(
        (status = 200, description = "Every dependency answers", body = Object, content_type = "application/json"),
        (status = 503, description = "A dependency does not answer", body = Object, content_type = "application/json"),
    )
)]
pub async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let probes = Probes {
        database: state.stores().health.clone(),
        bus: state.bus().clone(),
        sessions: state.sessions().clone(),
        timeout: state.options().readiness_timeout,
    };
    let (status, body) = probes.readiness().await;
    (status, ApiJson(body))
}

/// `GET /metrics`: the process registry in the Prometheus text format.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "meta",
    responses(
        (status = 200, description = "Prometheus text format", body = String, content_type = "text/plain"),
    )
)]
pub async fn metrics() -> impl IntoResponse {
    ops::metrics()
}
