//! `GET /v1/runs`, `GET /v1/runs/{id}`, `GET /v1/runs/{id}/events`, `GET /v1/runs/{id}/stream`,
//! `POST /v1/runs/{id}/cancel`.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use sb_common::bus::PublishOptions;
use sb_common::bus::topology::control_routing_key;
use sb_common::session::cancel_flag_key;
use sb_protocol::ids::{AgentId, RunId};
use sb_protocol::messages::{ControlMessage, encode};
use sb_protocol::result::AgentRunResult;
use sb_store::runs::CancelOutcome;
use sb_store::runs::{RunFilter, RunRecord, RunStatus};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{ListPage, epoch, epoch_ms, parse_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::state::AppState;
use crate::stream::{record_to_result, run_stream};

/// A run as the API shows it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RunView {
    /// Run id.
    pub run_id: RunId,
    /// `queued`, `running`, `completed`, `failed`, `cancelled`, `timeout` or `interrupted`.
    pub status: RunStatus,
    /// The event that started it.
    pub event_id: String,
    /// The agent whose binding was selected.
    pub agent_id: Option<String>,
    /// Runner.
    pub runner_id: String,
    /// Worker pool.
    pub pool: String,
    /// Conversation.
    pub conversation_id: Option<String>,
    /// Thread.
    pub thread_id: Option<String>,
    /// Bot.
    pub bot_id: Option<String>,
    /// Failure code and message of a run that did not complete.
    pub error: Option<RunErrorView>,
    /// Attempt number.
    pub attempt: i64,
    /// Worker that claimed it.
    pub worker_id: Option<String>,
    /// Highest result sequence stored.
    pub last_sequence: i64,
    /// Model usage totals.
    pub usage: Option<Value>,
    /// Result items were deleted by retention (the run is never re-run).
    pub expired: bool,
    /// Epoch seconds.
    pub created_at: i64,
    /// Epoch seconds.
    pub started_at: Option<i64>,
    /// Epoch seconds.
    pub ended_at: Option<i64>,
    /// `created_at` in epoch milliseconds: when the run was created (its event routed).
    pub created_at_ms: i64,
    /// `started_at` in epoch milliseconds: when a worker claimed the run.
    pub started_at_ms: Option<i64>,
    /// `ended_at` in epoch milliseconds: when the run reached its terminal status.
    pub ended_at_ms: Option<i64>,
    /// Epoch seconds.
    pub deadline_at: Option<i64>,
    /// Epoch seconds.
    pub cancel_requested_at: Option<i64>,
    /// Reason given with the cancel request.
    pub cancel_reason: Option<String>,
}

/// Why a run did not complete.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RunErrorView {
    /// Failure code (`runner.crashed`, `timeout`, …).
    pub code: Option<String>,
    /// Message.
    pub message: Option<String>,
}

impl From<RunRecord> for RunView {
    fn from(r: RunRecord) -> Self {
        let error = (r.error_code.is_some() || r.error_message.is_some()).then(|| RunErrorView {
            code: r.error_code.clone(),
            message: r.error_message.clone(),
        });
        Self {
            run_id: r.id,
            status: r.status,
            event_id: r.event_id.to_string(),
            agent_id: r.agent_id.map(|a| a.to_string()),
            runner_id: r.runner_id,
            pool: r.pool,
            conversation_id: r.conversation_id,
            thread_id: r.thread_id,
            bot_id: r.bot_id,
            error,
            attempt: r.attempt,
            worker_id: r.worker_id,
            last_sequence: r.last_sequence,
            usage: r.usage,
            expired: r.events_expired_at.is_some(),
            created_at: epoch(r.created_at),
            started_at: r.started_at.map(epoch),
            ended_at: r.ended_at.map(epoch),
            created_at_ms: epoch_ms(r.created_at),
            started_at_ms: r.started_at.map(epoch_ms),
            ended_at_ms: r.ended_at.map(epoch_ms),
            deadline_at: r.deadline_at.map(epoch),
            cancel_requested_at: r.cancel_requested_at.map(epoch),
            cancel_reason: r.cancel_reason,
        }
    }
}

/// Loads a run of the caller's workspace, or `404`.
pub(crate) async fn load_run(state: &AppState, caller: &Caller, id: &str) -> ApiResult<RunRecord> {
    let run_id: RunId = parse_id("run", id)?;
    match state.stores().runs.get_run(run_id).await? {
        Some(run) if run.workspace_id == caller.workspace_id => Ok(run),
        _ => Err(ApiError::not_found(format!("run {id} not found"))),
    }
}

/// `GET /v1/runs/{id}`.
#[utoipa::path(
    get,
    path = "/v1/runs/{id}",
    tag = "runs",
    params(("id" = String, Path, description = "Run id")),
    responses(
        (status = 200, description = "The run", body = RunView),
        (status = 404, description = "no such run in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn get_run(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<ApiJson<RunView>> {
    Ok(ApiJson(load_run(&state, &caller, &id).await?.into()))
}

/// Query of `GET /v1/runs`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListRunsQuery {
    /// Only this conversation.
    pub conversation_id: Option<String>,
    /// Only this status (comma-separated list allowed).
    pub status: Option<String>,
    /// Only this agent.
    pub agent_id: Option<String>,
    /// Only this runner.
    pub runner_id: Option<String>,
    /// Continue after this cursor.
    pub cursor: Option<String>,
    /// Page size, clamped to [1, 100].
    pub limit: Option<u64>,
}

/// `GET /v1/runs`: newest first.
#[utoipa::path(
    get,
    path = "/v1/runs",
    tag = "runs",
    params(ListRunsQuery),
    responses(
        (status = 200, description = "Runs, newest first", body = ListPage<RunView>),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn list_runs(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<ListRunsQuery>,
) -> ApiResult<ApiJson<ListPage<RunView>>> {
    let mut filter = RunFilter::workspace(caller.workspace_id);
    filter.conversation_id = q.conversation_id;
    filter.runner_id = q.runner_id;
    if let Some(agent) = q.agent_id.as_deref() {
        filter.agent_id = Some(
            parse_id::<AgentId>("agent", agent)
                .map_err(|_| ApiError::invalid("invalid `agent_id`"))?,
        );
    }
    if let Some(statuses) = q.status.as_deref() {
        for s in statuses.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            filter.statuses.push(s.parse().map_err(|_| {
                ApiError::invalid(format!(
                    "invalid `status` {s:?}: expected queued, running, completed, failed, cancelled, timeout or interrupted"
                ))
            })?);
        }
    }
    let limit = i64::try_from(state.page_limit(q.limit)).unwrap_or(i64::MAX);
    let page = state
        .stores()
        .runs
        .list_runs(filter, q.cursor, Some(limit))
        .await?;
    Ok(ApiJson(ListPage {
        items: page.items.into_iter().map(RunView::from).collect(),
        next_cursor: page.next_cursor,
        has_more: page.has_more,
    }))
}

/// Query of `GET /v1/runs/{id}/events`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct RunEventsQuery {
    /// Only items with a greater sequence (default 0: from the start).
    #[serde(default)]
    pub after_sequence: u64,
    /// Continue after this cursor (the `next_cursor` of the previous page: the sequence of
    /// its last item); instead of `after_sequence`, so this list pages like every other.
    pub cursor: Option<String>,
    /// Page size, clamped to [1, 100].
    pub limit: Option<u64>,
}

/// `GET /v1/runs/{id}/events` body: a page of result items (`items`, `next_cursor`,
/// `has_more`), and what retention took.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RunEventsPage {
    /// The page.
    #[serde(flatten)]
    pub page: ListPage<AgentRunResult>,
    /// Retention deleted the run's items (`retention.run_results` after it ended).
    pub expired: bool,
    /// Items after `after_sequence` existed and are gone (retention): the page does not
    /// continue where the caller left off. Read the run instead; it is never re-run.
    pub gap: bool,
}

/// Whether retention took items of `run` that a read after `after` should have returned:
/// its items were deleted, and the read did not start right after `after` (`first` is the
/// first sequence read) although the run had more. Pure.
pub(crate) fn retention_gap(run: &RunRecord, after: i64, first: Option<i64>) -> bool {
    run.events_expired_at.is_some()
        && match first {
            Some(first) => first > after + 1,
            None => run.last_sequence > after,
        }
}

/// `GET /v1/runs/{id}/events`: result items after a sequence, ascending. `next_cursor` is
/// the sequence to pass as `after_sequence` for the next page (set when `has_more`).
#[utoipa::path(
    get,
    path = "/v1/runs/{id}/events",
    tag = "runs",
    params(("id" = String, Path, description = "Run id"), RunEventsQuery),
    responses(
        (status = 200, description = "Result items after a sequence, ascending", body = ListPage<AgentRunResult>),
        (status = 404, description = "no such run in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn run_events(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<RunEventsQuery>,
) -> ApiResult<ApiJson<RunEventsPage>> {
    let run = load_run(&state, &caller, &id).await?;
    let limit = state.page_limit(q.limit);
    let after_sequence = match q.cursor.as_deref() {
        Some(cursor) => cursor
            .parse::<u64>()
            .map_err(|_| ApiError::invalid("invalid `cursor`: pass a `next_cursor` back as is"))?,
        None => q.after_sequence,
    };
    let after = i64::try_from(after_sequence)
        .map_err(|_| ApiError::invalid("`after_sequence` is too large"))?;
    // One extra row tells whether there is more.
    let mut records = state
        .stores()
        .runs
        .events_after(run.id, after, limit + 1)
        .await?;
    let has_more = records.len() as u64 > limit;
    records.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    let gap = retention_gap(&run, after, records.first().map(|r| r.sequence));
    let items: Vec<AgentRunResult> = records.iter().map(record_to_result).collect();
    let next_cursor = if has_more {
        items.last().and_then(|r| r.sequence).map(|s| s.to_string())
    } else {
        None
    };
    Ok(ApiJson(RunEventsPage {
        page: ListPage {
            items,
            next_cursor,
            has_more,
        },
        expired: run.events_expired_at.is_some(),
        gap,
    }))
}

/// Query of `GET /v1/runs/{id}/stream`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct StreamQuery {
    /// Start after this sequence (default 0).
    #[serde(default)]
    pub after_sequence: u64,
}

/// `GET /v1/runs/{id}/stream`: SSE of the run's results after `after_sequence` or the
/// `Last-Event-ID` header (whichever is further: a reconnecting `EventSource` repeats the
/// original URL and adds the header).
#[utoipa::path(
    get,
    path = "/v1/runs/{id}/stream",
    tag = "runs",
    params(("id" = String, Path, description = "Run id"), StreamQuery, ("Last-Event-ID" = Option<String>, Header, description = "Resume after this sequence (wins over `after_sequence`)")),
    responses(
        (status = 200, description = "Server-sent events: one `AgentRunResult` per frame, closed after the terminal item", body = String, content_type = "text/event-stream"),
        (status = 404, description = "no such run in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn stream_run(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<StreamQuery>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let last_event_id = match headers.get("last-event-id") {
        None => None,
        Some(value) => Some(
            value
                .to_str()
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    ApiError::invalid("invalid `Last-Event-ID`: expected a result sequence number")
                })?,
        ),
    };
    let run = load_run(&state, &caller, &id).await?;
    let after = q.after_sequence.max(last_event_id.unwrap_or(0));
    let slot = state.key_limits().open_stream(caller.key_id)?;
    Ok(run_stream(state.stream_context(), run.id, after, slot).into_response())
}

/// Body of `POST /v1/runs/{id}/cancel` (optional).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelRequest {
    /// Why (kept with the run, passed to the runner). Default `cancelled via api`.
    #[serde(default)]
    pub reason: Option<String>,
}

/// Answer of a cancel request.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct CancelResponse {
    /// The run.
    pub run_id: RunId,
    /// `true` when this request (or an earlier one) asked an active run to stop; `false`
    /// when the run had already ended (its result is never rewritten).
    pub cancelled: bool,
    /// The run's status when the request was handled.
    pub status: RunStatus,
}

/// Longest accepted cancel reason.
const MAX_CANCEL_REASON_CHARS: usize = 500;

/// How long the session-store cancel flag lives after the run's deadline (or, for a run
/// without a deadline, at all): long enough for any worker to pick the job up and see it.
const CANCEL_FLAG_SLACK: Duration = Duration::from_secs(3600);

/// `POST /v1/runs/{id}/cancel` (SPEC §11): records the intent in the ledger (the first
/// request wins), sets the session-store cancel flag (read by a worker before it starts the
/// run), then publishes `cancel.<run_id>` on `switchboard.control` for the worker holding it.
/// `202` when the run was active, `200 {cancelled: false}` when it had already ended.
#[utoipa::path(
    post,
    path = "/v1/runs/{id}/cancel",
    tag = "runs",
    params(("id" = String, Path, description = "Run id")),
    request_body = Option<CancelRequest>,
    responses(
        (status = 202, description = "Cancellation requested", body = CancelResponse),
        (status = 200, description = "The run had already ended; nothing changed", body = CancelResponse),
        (status = 404, description = "no such run in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn cancel_run(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = body?;
    // The body is optional, so it is parsed by hand rather than by `ApiJson`.
    let request: CancelRequest = if body.iter().all(u8::is_ascii_whitespace) {
        CancelRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::invalid(format!("invalid request body: {e}")))?
    };
    let run = load_run(&state, &caller, &id).await?;
    let reason = request
        .reason
        .map(|r| r.trim().to_owned())
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "cancelled via api".to_owned());
    if reason.chars().count() > MAX_CANCEL_REASON_CHARS || reason.chars().any(char::is_control) {
        return Err(ApiError::invalid(format!(
            "invalid `reason`: must be at most {MAX_CANCEL_REASON_CHARS} characters without control characters"
        )));
    }
    let cancelled = request_cancel(&state, &run, reason).await?;
    let body = CancelResponse {
        run_id: run.id,
        cancelled: cancelled.is_none(),
        status: cancelled.unwrap_or(run.status),
    };
    if !body.cancelled {
        return Ok((StatusCode::OK, ApiJson(body)).into_response());
    }
    Ok((StatusCode::ACCEPTED, ApiJson(body)).into_response())
}

/// Asks an active run to stop: records the intent (a terminal run is never rewritten),
/// sets the cancel flag for a worker that has not claimed it yet, and broadcasts
/// `cancel.<run_id>`. `Some(status)` when the run had already ended with `status`.
pub(crate) async fn request_cancel(
    state: &AppState,
    run: &RunRecord,
    reason: String,
) -> ApiResult<Option<RunStatus>> {
    let outcome = state
        .stores()
        .runs
        .request_cancel(run.id, Some(reason.clone()))
        .await?;
    if let CancelOutcome::AlreadyFinished(status) = outcome {
        return Ok(Some(status));
    }
    // The flag first: a worker that claims the run after this point sees it even if it had
    // not bound its control queue when the message below was published.
    let ttl = run
        .deadline_at
        .and_then(|d| (d - Utc::now()).to_std().ok())
        .unwrap_or_default()
        + CANCEL_FLAG_SLACK;
    state
        .sessions()
        .set_ex(&cancel_flag_key(&run.id), reason.as_bytes(), ttl)
        .await?;
    let message = ControlMessage::Cancel {
        run_id: run.id,
        reason,
    };
    state
        .bus()
        .publish(
            &state.topology().control_exchange(),
            &control_routing_key(&run.id),
            encode(&message).into(),
            // Nobody may hold the run yet (queued): the flag covers that case.
            PublishOptions::best_effort(),
        )
        .await?;
    tracing::info!(run_id = %run.id, "run cancel requested");
    Ok(None)
}
