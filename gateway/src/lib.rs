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
//! | `POST /v1/events` | client | `202 {event_id, status}`; `agent_id` names the agent, `deliver_at` delays it (see [`routes::events`]); `?stream=true`: the run's SSE stream (`x-event-id` header) |
//! | `GET /v1/events/{id}` | client | the event with its routing `status`, `run_id`, `reason` |
//! | `GET /v1/events/{id}/wait` | client | long-poll (≤ 60 s, one stream slot) until the event is routed; the event with its `run_id` |
//! | `GET /v1/conversations/{id}/stream` | client | SSE of every run of the conversation, resumable by `Last-Event-ID` (see [`conversation_stream`]) |
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
//! | `GET/POST /v1/schedules`, `GET/PATCH/DELETE /v1/schedules/{id}` | admin | schedules (see [`routes::schedules`]) |
//! | `GET/POST /v1/models`, `/v1/tools`, `/v1/knowledge-bases`, `/v1/knowledge-bases/{kb_id}/documents`; `GET/PATCH/DELETE` of each by id | admin | the resource registry (see [`routes::resources`]) |
//! | `GET/POST /v1/keys`, `DELETE /v1/keys/{id}` | admin | the workspace's API keys (see [`routes::keys`]) |
//! | `POST /v1/artifacts`, `GET /v1/artifacts/{id}`, `GET /v1/artifacts/{id}/content` | client | upload (JSON base64 or multipart, sha256 verified) / metadata / content with `Range` (see [`routes::artifacts`]) |
//! | `GET /healthz`, `GET /readyz`, `GET /metrics` | none | liveness, dependency readiness, Prometheus text |
//! | `GET /v1/openapi.json` | none | the OpenAPI 3.1 document of every route (see [`openapi`]) |
//! | `GET /`, `GET /console/{file}` | none | the web console, embedded in the binary (see [`console`]) |
//! | `POST /v1/host/{action}` | run token | the Host API for runners outside a worker: `{data}` (see [`routes::host`]) |
//!
//! Every `/v1` route needs `Authorization: Bearer <api key>` (`401 unauthorized` without a
//! valid one); an admin route called with a `client` key is `403 permission_denied`; every
//! key has a request rate and a number of open streams (`429 rate_limited`, see [`limits`]).
//! Reads of the resource registry and the schedules are admin-only as well: they show
//! configuration (URLs, secret names, events) that an application does not need. Errors are
//! `{"code", "message", "request_id"}` with the status of `ErrorCode::http_status`, from
//! every layer (unknown route `404`, a method the route does not serve `405` with `Allow`,
//! oversized head `431`/`414`, body `413`, timeout `504`); every response carries its
//! `x-request-id`, which is also on the request's log lines. The exception is the
//! remote Host API: its bearer is the run's token (`ctx.runtime.metadata.host_api`), never an
//! API key, and its errors are the runner-facing `{"code", "message", "retryable", "details"}`
//! (with `request_id` as well).
//!
//! # Layout
//! - [`error`]: [`error::ApiError`], the only place an error becomes an HTTP response, and
//!   the `ApiJson` / `ApiQuery` extractors whose rejections use the same `{code, message}`
//!   shape.
//! - [`auth`]: bearer API key middleware, the [`auth::Caller`] extractor (workspace, key,
//!   role), the admin-route check and the revocation-aware key cache.
//! - [`limits`]: per-key request rate and open-stream limits.
//! - [`normalize`]: ingest payload → `AgentEventEnvelope` (pure, unit-tested).
//! - [`openapi`]: the OpenAPI document, generated from the same declarations as the router
//!   (`route_table` in this file, whose docs say how a route is declared).
//! - [`routes`](mod@routes): one file per resource: events, runs, conversations, agents, runners,
//!   health, `resources` (models, tools, knowledge bases), `keys`, `sessions` and `turns`
//!   (the turn API) and `host` (the remote Host API).
//! - [`stream`]: SSE framing and the ledger-then-live, gap-free result stream.
//! - [`conversation_stream`]: the same for every run of a conversation, with a resumable
//!   conversation-level position.
//! - [`live`]: the gateway's exclusive delivery queue and the per-run fan-out.
//! - [`ingest`]: the group commit of `POST /v1/events` (concurrent ingests share one commit).
//! - [`relay`]: the outbox relay task.
//! - [`request_id`]: the per-request id of responses, error bodies and log lines.
//! - [`server`]: the HTTP/1 accept loop, its connection options and the head limits.
//! - [`state`]: [`AppState`], [`GatewayDeps`], [`GatewayOptions`].

pub mod auth;
pub mod console;
pub mod conversation_stream;
pub mod error;
pub mod ingest;
pub mod limits;
pub mod live;
pub mod normalize;
pub mod openapi;
pub mod ops;
pub mod relay;
pub mod request_id;
pub mod routes;
pub mod server;
pub mod state;
pub mod stream;

use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::error_handling::HandleErrorLayer;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::header::CONTENT_LENGTH;
use axum::middleware::{Next, from_fn, from_fn_with_state};
use axum::response::Response;
use sb_common::config::SwitchboardConfig;
use sb_common::error::ShutdownError;
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::error::ErrorCode;
use tokio::net::TcpListener;
use tower::ServiceBuilder;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::{RequestBodyTimeoutLayer, TimeoutBody};
use tower_http::trace::TraceLayer;
use utoipa::OpenApi as _;
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouter, UtoipaMethodRouterExt as _};
use utoipa_axum::routes;

pub use crate::error::{ApiError, ApiResult};
pub use crate::state::{AppState, GatewayDeps, GatewayOptions};

use crate::openapi::Access;
use crate::relay::OutboxRelay;
use crate::routes::{
    agents, artifacts, conversations, events, health, host, keys, resources, runners, runs,
    schedules, sessions, turns,
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
    /// Shutdown began before the gateway started.
    #[error(transparent)]
    Shutdown(#[from] ShutdownError),
}

/// The router: `/v1` (authenticated), `/healthz`, `/readyz`, `/metrics`.
///
/// Layers, outermost first: the request id (a client's usable `x-request-id` or a fresh
/// UUID, echoed in the response, see [`request_id`]), tracing (span per request with the
/// matched route and the request id), error-detail logging, [`error::finish_errors`] (every
/// `4xx`/`5xx` in the one error shape with the request id, whichever layer refused), HTTP
/// metrics, the head limits ([`server::refuse_oversized_head`]: `431`, `414`), the body-size
/// guard (a `Content-Length` over the limit is refused
/// before anything is read; chunked bodies are cut at the limit by `DefaultBodyLimit`),
/// then, on `/v1`, the API-key check (with the key's request rate); non-streaming `/v1`
/// routes also get the request timeout. A stream's response is produced at once (its body is
/// fed by a task), so the timeout never cuts a stream. Admin handlers are wrapped one by one
/// in `admin`, so the role of every route reads off this function (and the table in the
/// crate docs).
pub fn app(state: AppState) -> Router {
    let max_body = state.options().max_body_bytes;
    let upload_body = artifacts::upload_body_limit(state.options().artifact_upload_bytes);
    let timeout = state.options().request_timeout;

    let RouteTable {
        timed,
        streams,
        host,
        public,
    } = route_table(upload_body);
    let timed = Router::from(timed).layer(
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(timeout_error))
            .layer(tower::timeout::TimeoutLayer::new(timeout)),
    );
    // Long-lived requests: no request timeout (each bounds itself and takes a stream slot).
    let v1 = timed
        .merge(Router::from(streams))
        .route_layer(from_fn_with_state(
            state.clone(),
            auth::require_api_key::<AppState>,
        ));
    // Authenticated by the run token inside the handler, not by an API key.
    let remote_host_api = Router::from(host).layer(
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(host_timeout_error))
            .layer(tower::timeout::TimeoutLayer::new(timeout)),
    );

    Router::from(public)
        .merge(v1)
        .merge(remote_host_api)
        // The web console (`GET /`, `/console/{file}`): outside `/v1`, no API key.
        .merge(console::router())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(
            ServiceBuilder::new()
                .layer(RequestBodyTimeoutLayer::new(body_idle_timeout(timeout)))
                .map_request(|request: Request<TimeoutBody<Body>>| request.map(Body::new)),
        )
        .layer(from_fn_with_state((max_body, upload_body), refuse_oversized))
        .layer(from_fn(server::refuse_oversized_head))
        .layer(from_fn(record_http_metrics))
        .layer(from_fn(error::finish_errors))
        .layer(from_fn(error::log_error_details))
        .layer(TraceLayer::new_for_http().make_span_with(|request: &Request| {
            let route = request.extensions().get::<MatchedPath>().map_or("", MatchedPath::as_str);
            let request_id = request_id::of(request.headers()).unwrap_or("");
            tracing::info_span!("http", method = %request.method(), route, uri = %request.uri().path(), request_id)
        }))
        .layer(PropagateRequestIdLayer::new(request_id::HEADER))
        .layer(SetRequestIdLayer::new(request_id::HEADER, MakeRequestUuid))
        .layer(from_fn(request_id::drop_unusable))
        .with_state(state)
}

/// How long a request body may pause before the request is refused `408`: half the request
/// timeout, so a client that stops sending its body is told so (a `4xx`) before the
/// timeout's `504`, which would blame the gateway.
fn body_idle_timeout(request_timeout: std::time::Duration) -> std::time::Duration {
    request_timeout / 2
}

/// Every route of the API, grouped by how [`app`] guards it. Each route is declared once, by
/// its handler's `#[utoipa::path]`; `routes!` builds both the route and its entry in the
/// OpenAPI document from that declaration, so the router and `/v1/openapi.json` cannot drift.
///
/// # Declaring a route
///
/// 1. Annotate the handler with `#[utoipa::path(<method>, path = "/v1/…", tag = "…",
///    params(…), request_body = …, responses(…))]` (see any handler in [`routes`]): path and
///    query parameters (`IntoParams` on the query struct), the body type (`ToSchema`) and the
///    answers, errors as `body = crate::error::ErrorBody<'static>`.
/// 2. Add `.routes(routes!(module::handler))` to its group below; wrap it in `admin(…)` when
///    only admin keys may call it. One `routes!` holds handlers of one path.
///
/// Never `.route(…)`: such a route would be served but missing from the document, and
/// `tests/openapi.rs` (which compares the real router with the document) fails.
struct RouteTable {
    /// `/v1` with an API key and the request timeout.
    timed: OpenApiRouter<AppState>,
    /// `/v1` with an API key, no request timeout: streams and long polls, each bounded by
    /// itself and holding a stream slot.
    streams: OpenApiRouter<AppState>,
    /// The remote Host API: the run token is checked by the handler.
    host: OpenApiRouter<AppState>,
    /// No credentials: health, readiness, metrics and the OpenAPI document.
    public: OpenApiRouter<AppState>,
}

/// The routes of [`RouteTable`]; `upload_body` is the body limit of `POST /v1/artifacts`.
fn route_table(upload_body: usize) -> RouteTable {
    let mut timed = OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .routes(routes!(events::ingest))
        .routes(routes!(events::get_event))
        .routes(routes!(runs::list_runs))
        .routes(routes!(runs::get_run))
        .routes(routes!(runs::run_events))
        .routes(routes!(runs::cancel_run))
        .routes(routes!(conversations::transcript))
        .routes(routes!(sessions::list_sessions, sessions::create_session))
        .routes(routes!(sessions::get_session, sessions::close_session))
        .routes(routes!(sessions::history))
        .routes(routes!(turns::start_turn))
        .routes(routes!(turns::get_turn))
        .routes(routes!(turns::turn_events))
        .routes(routes!(turns::cancel_turn))
        .routes(admin(routes!(runners::list_runners)))
        .routes(routes!(agents::list_agents))
        .routes(admin(routes!(agents::create_agent)))
        .routes(routes!(agents::get_agent))
        .routes(admin(routes!(agents::update_agent, agents::delete_agent)))
        .routes(admin(routes!(
            schedules::list_schedules,
            schedules::create_schedule
        )))
        .routes(admin(routes!(
            schedules::get_schedule,
            schedules::update_schedule,
            schedules::delete_schedule
        )))
        .routes(admin(routes!(
            resources::models::list_models,
            resources::models::create_model
        )))
        .routes(admin(routes!(
            resources::tools::list_tools,
            resources::tools::create_tool
        )))
        .routes(admin(routes!(
            resources::knowledge::list_kbs,
            resources::knowledge::create_kb
        )))
        .routes(admin(routes!(
            resources::models::get_model,
            resources::models::update_model,
            resources::models::delete_model
        )))
        .routes(admin(routes!(
            resources::tools::get_tool,
            resources::tools::update_tool,
            resources::tools::delete_tool
        )))
        .routes(admin(routes!(
            resources::knowledge::get_kb,
            resources::knowledge::update_kb,
            resources::knowledge::delete_kb
        )))
        .routes(admin(routes!(
            resources::documents::list_documents,
            resources::documents::add_document
        )))
        .routes(admin(routes!(
            resources::documents::update_document,
            resources::documents::delete_document
        )))
        .routes(admin(routes!(keys::list_keys, keys::create_key)))
        .routes(admin(routes!(keys::revoke_key)))
        // Uploads have their own body limit (`limits.artifact_upload_bytes` as base64 plus
        // the envelope) instead of `gateway.max_body_bytes`; see `refuse_oversized`.
        .routes(routes!(artifacts::upload).map(|r| r.layer(DefaultBodyLimit::max(upload_body))))
        .routes(routes!(artifacts::get_artifact))
        .routes(routes!(artifacts::content));
    let mut streams = OpenApiRouter::new()
        .routes(routes!(runs::stream_run))
        .routes(routes!(turns::wait_turn))
        .routes(routes!(events::wait_event))
        .routes(routes!(conversations::stream));
    let mut host = OpenApiRouter::new().routes(routes!(host::call));
    let mut public = OpenApiRouter::new()
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(health::metrics))
        .routes(routes!(openapi::openapi_json));
    openapi::mark(&mut timed.get_openapi_mut().paths, Access::Client);
    openapi::mark(&mut streams.get_openapi_mut().paths, Access::Client);
    openapi::mark(&mut host.get_openapi_mut().paths, Access::RunToken);
    openapi::mark(&mut public.get_openapi_mut().paths, Access::Public);
    RouteTable {
        timed,
        streams,
        host,
        public,
    }
}

/// The OpenAPI 3.1 document of every route of [`app`] (served at `GET /v1/openapi.json`,
/// see [`openapi`]).
#[must_use]
pub fn openapi_document() -> utoipa::openapi::OpenApi {
    let RouteTable {
        timed,
        streams,
        host,
        public,
    } = route_table(0);
    timed
        .merge(streams)
        .merge(host)
        .merge(public)
        .into_openapi()
}

/// `routes`, answered only to admin keys: a `client` key gets `403 permission_denied`
/// ([`auth::require_admin`]) before the handlers' extractors run, so nothing is read or
/// stored. Runs inside the API-key middleware, which put the caller in the extensions. The
/// document lists the `admin` role in these operations' security.
fn admin(routes: UtoipaMethodRouter<AppState>) -> UtoipaMethodRouter<AppState> {
    let (schemas, mut paths, method_router) = routes;
    openapi::mark(&mut paths, Access::Admin);
    (
        schemas,
        paths,
        method_router.route_layer(from_fn(auth::require_admin)),
    )
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

/// `405`; the router adds `Allow` with the route's methods.
async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

/// Refuses a request whose declared length is over the limit before reading its body: the
/// upload limit for `POST /v1/artifacts`, `gateway.max_body_bytes` for everything else.
async fn refuse_oversized(
    State((max_body, upload_body)): State<(usize, usize)>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let upload = request.method() == axum::http::Method::POST
        && request
            .extensions()
            .get::<MatchedPath>()
            .is_some_and(|p| p.as_str() == artifacts::UPLOAD_PATH);
    let max = if upload { upload_body } else { max_body };
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
    let metrics = Metrics::global();
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
/// (streams end on shutdown, so they do not hold the server up) and the relay mark the rows
/// it published (its marks are deferred).
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
    let relay = shutdown.spawn("outbox-relay", relay.run(token.clone()))?;
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, gateway_id = %state.options().gateway_id, "gateway listening");
    }
    // Connection options (no Nagle, hyper's ceilings above our head limits): see `server`.
    server::serve(listener, app(state), token).await;
    if let Err(error) = relay.await {
        tracing::warn!(%error, "outbox relay task failed");
    }
    tracing::info!("gateway stopped");
    Ok(())
}
