//! The Switchboard gateway: the HTTP API (JSON, `/v1`, bearer API keys), the outbox relay
//! that publishes accepted events, and live delivery of run results over server-sent
//! events (SPEC §2 steps 1 and 5, §10.1).
//!
//! [`app`] builds the router from an [`AppState`] (tests drive it with `oneshot`, no
//! socket); [`run`] binds the configured address, starts the outbox relay and serves until
//! the shutdown handle fires.
//!
//! # Routes
//!
//! | route | role | answer |
//! | --- | --- | --- |
//! | `POST /v1/events` | client | `202 {event_id, status}`; `?stream=true`: the run's SSE stream (`x-event-id` header) |
//! | `GET /v1/events/{id}` | client | the event with its routing `status`, `run_id`, `reason` |
//! | `GET /v1/runs`, `GET /v1/runs/{id}` | client | runs (newest first, filters) / one run |
//! | `GET /v1/runs/{id}/events` | client | `{items: [AgentRunResult], next_cursor, has_more}` after a sequence |
//! | `GET /v1/runs/{id}/stream` | client | SSE after `after_sequence` / `Last-Event-ID`, closed after the terminal item |
//! | `POST /v1/runs/{id}/cancel` | client | records the intent, sets the cancel flag, broadcasts `cancel.<run_id>` |
//! | `GET /v1/conversations/{id}/transcript` | client | `{items: [TranscriptItem], next_cursor, has_more}` |
//! | `POST /v1/sessions`, `GET /v1/sessions` | client | `201` a session (agent fixed at creation) / the workspace's sessions, paged (see [`routes::sessions`]) |
//! | `GET /v1/sessions/{id}`, `DELETE /v1/sessions/{id}` | client | a session / closes it (later turns `409`, history stays) |
//! | `GET /v1/sessions/{id}/history` | client | the session's user and assistant messages, paged |
//! | `POST /v1/sessions/{id}/turns` | client | `202 {session_id, turn_id, status}` once durable; same key + other request `409` (see [`routes::turns`]) |
//! | `GET /v1/turns/{id}`, `GET /v1/turns/{id}/events` | client | the turn's snapshot / `{events, gap, next_sequence, snapshot}` after a sequence |
//! | `GET /v1/turns/{id}/wait` | client | long-poll (≤ 60 s, one stream slot) to a terminal snapshot; never resubmits |
//! | `POST /v1/turns/{id}/cancel` | client | `{cancelled, snapshot}`; a terminal result is never rewritten |
//! | `GET /v1/agents`, `GET /v1/agents/{id}` | client | agents (an application picks the agent it talks to) |
//! | `POST /v1/agents`, `PATCH/DELETE /v1/agents/{id}` | admin | agents (`422` unknown runner, `409` ambiguous scope) |
//! | `GET /v1/runners` | admin | registered runners |
//! | `GET/POST /v1/schedules`, `GET/DELETE /v1/schedules/{id}` | admin | schedules (see [`routes::schedules`]) |
//! | `GET/POST /v1/models`, `/v1/tools`, `/v1/knowledge-bases`; `POST /v1/knowledge-bases/{kb_id}/documents` | admin | the resource registry (see [`routes::resources`]) |
//! | `GET/POST /v1/keys`, `DELETE /v1/keys/{id}` | admin | the workspace's API keys (see [`routes::keys`]) |
//! | `GET /healthz`, `GET /readyz`, `GET /metrics` | none | liveness, dependency readiness, Prometheus text |
//! | `POST /v1/host/{action}` | run token | the Host API for runners outside a worker: `{data}` (see [`routes::host`]) |
//!
//! Every `/v1` route needs `Authorization: Bearer <api key>` (`401 unauthorized` without a
//! valid one); an admin route called with a `client` key is `403 permission_denied`; every
//! key has a request rate and a number of open streams (`429 rate_limited`, see [`limits`]).
//! Reads of the resource registry and the schedules are admin-only as well: they show
//! configuration (URLs, secret names, events) that an application does not need. Errors are
//! `{"code", "message"}` with the status of `ErrorCode::http_status`. The exception is the
//! remote Host API: its bearer is the run's token (`ctx.runtime.metadata.host_api`), never an
//! API key, and its errors are the runner-facing `{"code", "message", "retryable", "details"}`.
//!
//! # Layout
//! - [`error`]: [`error::ApiError`], the only place an error becomes an HTTP response, and
//!   the `ApiJson` / `ApiQuery` extractors whose rejections use the same `{code, message}`
//!   shape.
//! - [`auth`]: bearer API key middleware, the [`auth::Caller`] extractor (workspace, key,
//!   role), the admin-route check and the revocation-aware key cache.
//! - [`limits`]: per-key request rate and open-stream limits.
//! - [`normalize`]: ingest payload → `AgentEventEnvelope` (pure, unit-tested).
//! - [`routes`]: one file per resource: events, runs, conversations, agents, runners,
//!   health, `resources` (models, tools, knowledge bases), `keys`, `sessions` and `turns`
//!   (the turn API) and `host` (the remote Host API).
//! - [`stream`]: SSE framing and the ledger-then-live, gap-free result stream.
//! - [`live`]: the gateway's exclusive delivery queue and the per-run fan-out.
//! - [`relay`]: the outbox relay task.
//! - [`state`]: [`AppState`], [`GatewayDeps`], [`GatewayOptions`].

pub mod auth;
pub mod error;
pub mod limits;
pub mod live;
pub mod normalize;
pub mod relay;
pub mod routes;
pub mod state;
pub mod stream;

use std::time::Instant;

use axum::Router;
use axum::error_handling::HandleErrorLayer;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::handler::Handler;
use axum::http::header::CONTENT_LENGTH;
use axum::middleware::{Next, from_fn, from_fn_with_state};
use axum::response::Response;
use axum::routing::{delete, get, post};
use axum::serve::ListenerExt as _;
use sb_common::config::SwitchboardConfig;
use sb_common::error::ShutdownError;
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Registry, names};
use sb_protocol::error::ErrorCode;
use tokio::net::TcpListener;
use tower::ServiceBuilder;
use tower_http::trace::TraceLayer;

pub use crate::error::{ApiError, ApiResult};
pub use crate::state::{AppState, GatewayDeps, GatewayOptions};

use crate::relay::OutboxRelay;
use crate::routes::{
    agents, conversations, events, health, host, keys, resources, runners, runs, schedules,
    sessions, turns,
};

/// Errors that stop the gateway.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The HTTP address cannot be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The configured address.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The live-delivery queue cannot be declared or consumed.
    #[error("cannot start live delivery: {0}")]
    Bus(#[from] sb_common::bus::BusError),
    /// The HTTP server failed.
    #[error("http server failed: {0}")]
    Serve(std::io::Error),
    /// Shutdown began before the gateway started.
    #[error(transparent)]
    Shutdown(#[from] ShutdownError),
}

/// The router: `/v1` (authenticated), `/healthz`, `/readyz`, `/metrics`.
///
/// Layers, outermost first: tracing (span per request with the matched route), error-detail
/// logging, HTTP metrics, the body-size guard (a `Content-Length` over the limit is refused
/// before anything is read; chunked bodies are cut at the limit by `DefaultBodyLimit`),
/// then, on `/v1`, the API-key check (with the key's request rate); non-streaming `/v1`
/// routes also get the request timeout. A stream's response is produced at once (its body is
/// fed by a task), so the timeout never cuts a stream. Admin handlers are wrapped one by one
/// in [`admin`], so the role of every route reads off this function (and the table in the
/// crate docs).
pub fn app(state: AppState) -> Router {
    let max_body = state.options().max_body_bytes;
    let timeout = state.options().request_timeout;

    let timed = Router::new()
        .route("/v1/events", post(events::ingest))
        .route("/v1/events/{id}", get(events::get_event))
        .route("/v1/runs", get(runs::list_runs))
        .route("/v1/runs/{id}", get(runs::get_run))
        .route("/v1/runs/{id}/events", get(runs::run_events))
        .route("/v1/runs/{id}/cancel", post(runs::cancel_run))
        .route(
            "/v1/conversations/{id}/transcript",
            get(conversations::transcript),
        )
        .route(
            "/v1/sessions",
            get(sessions::list_sessions).post(sessions::create_session),
        )
        .route(
            "/v1/sessions/{id}",
            get(sessions::get_session).delete(sessions::close_session),
        )
        .route("/v1/sessions/{id}/history", get(sessions::history))
        .route("/v1/sessions/{id}/turns", post(turns::start_turn))
        .route("/v1/turns/{id}", get(turns::get_turn))
        .route("/v1/turns/{id}/events", get(turns::turn_events))
        .route("/v1/turns/{id}/cancel", post(turns::cancel_turn))
        .route("/v1/runners", get(admin(runners::list_runners)))
        .route(
            "/v1/agents",
            get(agents::list_agents).post(admin(agents::create_agent)),
        )
        .route(
            "/v1/agents/{id}",
            get(agents::get_agent)
                .patch(admin(agents::update_agent))
                .delete(admin(agents::delete_agent)),
        )
        .route(
            "/v1/schedules",
            get(admin(schedules::list_schedules)).post(admin(schedules::create_schedule)),
        )
        .route(
            "/v1/schedules/{id}",
            get(admin(schedules::get_schedule)).delete(admin(schedules::delete_schedule)),
        )
        .route(
            "/v1/models",
            get(admin(resources::list_models)).post(admin(resources::create_model)),
        )
        .route(
            "/v1/tools",
            get(admin(resources::list_tools)).post(admin(resources::create_tool)),
        )
        .route(
            "/v1/knowledge-bases",
            get(admin(resources::list_kbs)).post(admin(resources::create_kb)),
        )
        .route(
            "/v1/knowledge-bases/{kb_id}/documents",
            post(admin(resources::add_document)),
        )
        .route(
            "/v1/keys",
            get(admin(keys::list_keys)).post(admin(keys::create_key)),
        )
        .route("/v1/keys/{id}", delete(admin(keys::revoke_key)))
        .layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(timeout_error))
                .layer(tower::timeout::TimeoutLayer::new(timeout)),
        );
    // Long-lived requests: no request timeout (each bounds itself and takes a stream slot).
    let streams = Router::new()
        .route("/v1/runs/{id}/stream", get(runs::stream_run))
        .route("/v1/turns/{id}/wait", get(turns::wait_turn));
    let v1 = timed
        .merge(streams)
        .route_layer(from_fn_with_state(state.clone(), auth::require_api_key));
    // Authenticated by the run token inside the handler, not by an API key.
    let remote_host_api = Router::new()
        .route("/v1/host/{action}", post(host::call))
        .layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(host_timeout_error))
                .layer(tower::timeout::TimeoutLayer::new(timeout)),
        );

    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .merge(v1)
        .merge(remote_host_api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(from_fn_with_state(max_body, refuse_oversized))
        .layer(from_fn(record_http_metrics))
        .layer(from_fn(error::log_error_details))
        .layer(TraceLayer::new_for_http().make_span_with(|request: &Request| {
            let route = request.extensions().get::<MatchedPath>().map_or("", MatchedPath::as_str);
            tracing::info_span!("http", method = %request.method(), route, uri = %request.uri().path())
        }))
        .with_state(state)
}

/// `handler`, answered only to admin keys: a `client` key gets `403 permission_denied`
/// ([`auth::require_admin`]) before the handler's extractors run, so nothing is read or
/// stored. Runs inside the API-key middleware, which put the caller in the extensions.
fn admin<H, T>(handler: H) -> impl Handler<T, AppState>
where
    H: Handler<T, AppState>,
    T: 'static,
{
    handler.layer(from_fn(auth::require_admin))
}

async fn timeout_error(err: tower::BoxError) -> ApiError {
    if err.is::<tower::timeout::error::Elapsed>() {
        ApiError::new(
            ErrorCode::DeadlineExceeded,
            "the request took too long and was abandoned",
        )
    } else {
        ApiError::internal(err)
    }
}

/// [`timeout_error`] in the runner-facing error shape of the remote Host API.
async fn host_timeout_error(err: tower::BoxError) -> ApiError {
    timeout_error(err).await.for_runner()
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::invalid("method not allowed on this route")
}

/// Refuses a request whose declared length is over the limit before reading its body.
async fn refuse_oversized(
    State(max): State<usize>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > max as u64) {
        return Err(ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("request body is larger than {max} bytes; upload large content as an artifact"),
        ));
    }
    Ok(next.run(request).await)
}

/// Counts requests by method, matched route and status, and observes their latency (until
/// the response head; a stream's duration is not a request latency).
async fn record_http_metrics(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().as_str().to_owned();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(request).await;
    let metrics = Registry::global();
    let status = response.status().as_u16().to_string();
    metrics.inc(
        names::HTTP_REQUESTS_TOTAL,
        &[("method", &method), ("route", &route), ("status", &status)],
    );
    metrics.observe(
        names::HTTP_REQUEST_DURATION_SECONDS,
        &[("method", &method), ("route", &route)],
        started.elapsed().as_secs_f64(),
    );
    response
}

/// Runs the gateway: binds `config.gateway.http_addr`, then [`serve`]s.
pub async fn run(
    config: &SwitchboardConfig,
    deps: GatewayDeps,
    shutdown: Shutdown,
) -> Result<(), GatewayError> {
    let addr = config.gateway.http_addr;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| GatewayError::Bind { addr, source })?;
    serve(
        listener,
        deps,
        GatewayOptions::from_config(config),
        shutdown,
    )
    .await
}

/// Serves on an already bound listener (tests bind port 0): starts live delivery and the
/// outbox relay, serves until `shutdown` fires, then lets in-flight requests finish
/// (streams end on shutdown, so they do not hold the server up).
pub async fn serve(
    listener: TcpListener,
    deps: GatewayDeps,
    options: GatewayOptions,
    shutdown: Shutdown,
) -> Result<(), GatewayError> {
    let state = AppState::new(deps, options, shutdown.clone()).await?;
    let relay = OutboxRelay::new(
        state.stores().outbox.clone(),
        state.bus().clone(),
        state.relay().clone(),
        state.options().relay,
    );
    let token = shutdown.token();
    shutdown.spawn("outbox-relay", relay.run(token.clone()))?;
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, gateway_id = %state.options().gateway_id, "gateway listening");
    }
    // No Nagle: SSE frames and small JSON answers are written as soon as they are ready.
    // With Nagle, a frame written while the previous one is unacknowledged waits for the
    // client's delayed ACK (~40 ms on Linux), which alone would dwarf the pipeline latency.
    let listener = listener.tap_io(|tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY on a connection");
        }
    });
    axum::serve(listener, app(state))
        .with_graceful_shutdown(token.cancelled_owned())
        .await
        .map_err(GatewayError::Serve)?;
    tracing::info!("gateway stopped");
    Ok(())
}
