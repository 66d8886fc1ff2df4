//! The turn API's turns (SPEC §10.2, seed 004): `POST /v1/sessions/{id}/turns`,
//! `GET /v1/turns/{id}`, `GET /v1/turns/{id}/wait`, `GET /v1/turns/{id}/events`,
//! `POST /v1/turns/{id}/cancel`.
//!
//! # Receipt and identity
//!
//! A turn is ingested like `POST /v1/events`: normalized into a `message.received` envelope
//! in the session's conversation, stored with its outbox row, announced by the relay. Its
//! identity `(session, idempotency_key) → (request fingerprint, turn id)` commits in the same
//! transaction ([`sb_store::TurnStore::start_turn`]), so the `202` receipt is answered only
//! once the request is durable.
//!
//! The **turn id is the run id**, chosen here at receipt: the envelope carries
//! `metadata.turn {session_id, turn_id, agent_id}` (ingest never lets a client set envelope
//! metadata), and the orchestrator creates the run under `turn_id`, routes the event to
//! `agent_id` whatever the scopes say, and never absorbs it as steering input. Until the run
//! exists the turn is `queued`; an event that ends `unrouted` or `rejected` (the agent was
//! disabled or deleted meanwhile, a `reject` concurrency policy) makes the turn `failed`.
//!
//! The fingerprint is the sha256 of the normalized envelope of `{text, contents}` (the same
//! function as for events): same key + same request → the first turn, nothing re-run
//! (`idempotent-replayed: true`); same key + another request → `409 conflict`.
//!
//! # Snapshot
//!
//! `status` is `queued | running | completed | failed | cancelled`; a completed turn has
//! `result {text, content, usage}` (the final assistant message: the last
//! `message.completed`, or the message of `run.completed`), a failed or cancelled one
//! `failure {code, message}`, never both. A run that timed out is `failed` with code
//! `timeout`, one interrupted by a crash `failed` with code `interrupted`. Once retention
//! deleted its result (`retention.run_results` after the end) a turn says `expired: true`,
//! and a completed one has `failure {code: "result_expired"}` in place of its result; its
//! events page says `gap: true` for what is gone. Nothing re-runs it: a retry with its key
//! still answers this turn.

use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::content::ContentElement;
use sb_protocol::host::event_types;
use sb_protocol::ids::{EventId, RunId};
use sb_store::events::{EventStatus, NewEvent, is_valid_idempotency_key};
use sb_store::{
    NewTurn, RunEventRecord, RunRecord, RunStatus, TURN_METADATA_KEY, TurnRecord, TurnTag,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use uuid::Uuid;

use super::events::{IDEMPOTENT_REPLAYED, request_fingerprint};
use super::sessions::load_session;
use super::{epoch, parse_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::normalize::{IngestRequest, NormalizeContext, normalize};
use crate::state::AppState;

/// How often a waiting request reads the turn again.
const WAIT_POLL: Duration = Duration::from_millis(50);
/// The failure code of a completed turn whose result retention deleted (seed 004's
/// `AGENT_RESULT_EXPIRED`).
pub const RESULT_EXPIRED: &str = "result_expired";
/// Most result items read to find a turn's final message.
const MAX_RESULT_SCAN: u64 = 1000;

/// Body of `POST /v1/sessions/{id}/turns`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StartTurnRequest {
    /// 1–128 chars of `[A-Za-z0-9-_.:]`, fixed for one request and its retries.
    pub idempotency_key: String,
    /// The user's message.
    pub text: String,
    /// Typed content blocks beside the text.
    #[serde(default)]
    pub contents: Option<Vec<ContentElement>>,
}

/// `202` receipt of a turn.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TurnReceipt {
    /// The session.
    pub session_id: Uuid,
    /// The turn id (= run id).
    pub turn_id: RunId,
    /// `queued` or `running` (or already terminal, for a replay of a finished turn).
    pub status: TurnStatus,
}

/// Where a turn stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TurnStatus {
    /// Accepted; its run has not started.
    Queued,
    /// Its run is executing.
    Running,
    /// Ended with a result.
    Completed,
    /// Ended with a failure.
    Failed,
    /// Cancelled.
    Cancelled,
}

impl TurnStatus {
    /// Whether the turn has ended.
    #[must_use]
    pub fn is_terminal(self) -> bool {
        !matches!(self, Self::Queued | Self::Running)
    }
}

/// The result of a completed turn.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TurnResult {
    /// The final assistant text.
    pub text: String,
    /// The final assistant message's content as the runner sent it (string or blocks).
    pub content: Value,
    /// Model usage as reported (absent when the runner reported none).
    pub usage: Option<Value>,
}

/// Why a turn failed (or was cancelled).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TurnFailure {
    /// Stable code (`cancelled`, `timeout`, `interrupted`, `unrouted`, a runner's code …).
    pub code: String,
    /// What happened.
    pub message: String,
}

/// A turn snapshot.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TurnSnapshot {
    /// The session.
    pub session_id: Uuid,
    /// The turn id (= run id).
    pub turn_id: RunId,
    /// The status.
    pub status: TurnStatus,
    /// Set when `completed`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<TurnResult>,
    /// Set when `failed` or `cancelled`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure: Option<TurnFailure>,
    /// Highest result sequence so far.
    pub last_sequence: i64,
    /// Receipt time, epoch seconds.
    pub created_at: i64,
    /// End time, epoch seconds.
    pub ended_at: Option<i64>,
    /// Retention deleted the turn's result and events (`retention.run_results` after it
    /// ended): a completed turn then has no `result` but `failure {code: "result_expired"}`;
    /// the turn is never re-run.
    pub expired: bool,
}

/// `POST /v1/sessions/{id}/turns`: `202` receipt once the request identity is durable.
#[utoipa::path(
    post,
    path = "/v1/sessions/{id}/turns",
    tag = "turns",
    params(("id" = String, Path, description = "Session id")),
    request_body = StartTurnRequest,
    responses(
        (status = 202, description = "The durable receipt; the same key and request answer the same turn", body = TurnReceipt),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 404, description = "no such session in the caller's workspace", body = crate::error::ErrorBody<'static>),
        (status = 409, description = "`conflict`: the key was used with another request, or the session is closed", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn start_turn(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<StartTurnRequest>,
) -> ApiResult<Response> {
    if !is_valid_idempotency_key(&body.idempotency_key) {
        return Err(ApiError::invalid(
            "invalid `idempotency_key`: must be 1-128 characters of [A-Za-z0-9-_.:]",
        ));
    }
    let session = load_session(&state, &caller, &id).await?;
    // Through the same deserialization and normalization as `POST /v1/events`.
    let request: IngestRequest = serde_json::from_value(json!({
        "event_type": event_types::MESSAGE_RECEIVED,
        "source": "api",
        "conversation_id": session.conversation_id,
        "input": {"text": body.text, "contents": body.contents.unwrap_or_default()},
    }))
    .map_err(|e| ApiError::invalid(format!("invalid turn: {e}")))?;
    let limits = state.options().normalize;
    let mut generated = Vec::new();
    let mut new_artifact_id = || {
        let id = Uuid::new_v4().to_string();
        generated.push(id.clone());
        id
    };
    let mut normalized = normalize(
        request,
        NormalizeContext {
            workspace_id: caller.workspace_id.clone(),
            event_id: EventId::new(),
            now: Utc::now().timestamp(),
            idempotency_header: None,
            limits,
            new_artifact_id: &mut new_artifact_id,
        },
    )
    .map_err(|e| ApiError::from_coded(&e))?;
    // Before the turn's tag: the fingerprint covers what the client asked for.
    let fingerprint = request_fingerprint(&mut normalized.envelope, None, &generated)
        .ok_or_else(|| ApiError::invalid("invalid turn"))?;
    let tag = TurnTag {
        session_id: session.id,
        turn_id: RunId::new(),
        agent_id: session.agent_id,
    };
    normalized.envelope.metadata.insert(
        TURN_METADATA_KEY.to_owned(),
        serde_json::to_value(tag).map_err(ApiError::internal)?,
    );
    let outbox = super::event_outbox(state.topology(), &normalized.envelope);
    let event = NewEvent::from_envelope(&normalized.envelope, None, normalized.input_summary)?;
    let (turn, created) = state
        .stores()
        .turns
        .start_turn(NewTurn {
            session_id: session.id,
            idempotency_key: body.idempotency_key,
            request_hash: fingerprint,
            run_id: tag.turn_id,
            event,
            outbox: vec![outbox],
        })
        .await?;
    let metrics = Metrics::global();
    if created {
        state.relay().wake();
        metrics.inc(names::EVENTS_INGESTED_TOTAL, &[("outcome", "accepted")]);
        tracing::info!(session_id = %session.id, turn_id = %turn.run_id, "turn accepted");
    } else {
        metrics.inc(names::EVENTS_INGESTED_TOTAL, &[("outcome", "duplicate")]);
    }
    let snapshot = snapshot(&state, &turn, false).await?;
    let receipt = TurnReceipt {
        session_id: turn.session_id,
        turn_id: turn.run_id,
        status: snapshot.status,
    };
    let mut response = (StatusCode::ACCEPTED, ApiJson(receipt)).into_response();
    if !created {
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    Ok(response)
}

/// The turn `id` of the caller's workspace (`404` otherwise).
async fn load_turn(state: &AppState, caller: &Caller, id: &str) -> ApiResult<TurnRecord> {
    let run_id: RunId = parse_id("turn", id)?;
    let not_found = || ApiError::not_found(format!("turn {id} not found"));
    let turn = state
        .stores()
        .turns
        .get_turn(run_id)
        .await?
        .ok_or_else(not_found)?;
    // The session says whose the turn is.
    state
        .stores()
        .turns
        .get_session(&caller.workspace_id, turn.session_id)
        .await?
        .ok_or_else(not_found)?;
    Ok(turn)
}

/// The snapshot of `turn`; with `with_result`, a completed turn's result is read too.
async fn snapshot(
    state: &AppState,
    turn: &TurnRecord,
    with_result: bool,
) -> ApiResult<TurnSnapshot> {
    let run = state.stores().runs.get_run(turn.run_id).await?;
    let mut snapshot = TurnSnapshot {
        session_id: turn.session_id,
        turn_id: turn.run_id,
        status: TurnStatus::Queued,
        result: None,
        failure: None,
        last_sequence: 0,
        created_at: epoch(turn.created_at),
        ended_at: None,
        expired: false,
    };
    let Some(run) = run else {
        // No run yet: queued, unless routing refused the event.
        if let Some(event_id) = turn.event_id {
            if let Some(routing) = state.stores().events.routing(event_id).await? {
                let code = match routing.status {
                    EventStatus::Unrouted => Some("unrouted"),
                    EventStatus::Rejected => Some("rejected"),
                    _ => None,
                };
                if let Some(code) = code {
                    snapshot.status = TurnStatus::Failed;
                    snapshot.failure = Some(TurnFailure {
                        code: code.to_owned(),
                        message: routing
                            .reason
                            .unwrap_or_else(|| "the turn could not be started".to_owned()),
                    });
                }
            }
        }
        return Ok(snapshot);
    };
    snapshot.last_sequence = run.last_sequence;
    snapshot.ended_at = run.ended_at.map(epoch);
    snapshot.expired = run.events_expired_at.is_some();
    snapshot.status = match run.status {
        RunStatus::Queued => TurnStatus::Queued,
        RunStatus::Running => TurnStatus::Running,
        RunStatus::Completed => TurnStatus::Completed,
        RunStatus::Cancelled => TurnStatus::Cancelled,
        RunStatus::Failed | RunStatus::Timeout | RunStatus::Interrupted => TurnStatus::Failed,
    };
    match snapshot.status {
        // The result went with the items: say so rather than answer an empty result.
        TurnStatus::Completed if snapshot.expired => {
            snapshot.failure = Some(TurnFailure {
                code: RESULT_EXPIRED.to_owned(),
                message: "the turn completed, and its result was deleted by retention".to_owned(),
            });
        }
        TurnStatus::Completed if with_result => {
            snapshot.result = Some(final_result(state, &run).await?);
        }
        TurnStatus::Failed | TurnStatus::Cancelled => {
            snapshot.failure = Some(failure_of(&run));
        }
        _ => {}
    }
    Ok(snapshot)
}

fn failure_of(run: &RunRecord) -> TurnFailure {
    let default_code = match run.status {
        RunStatus::Cancelled => "cancelled",
        RunStatus::Timeout => "timeout",
        RunStatus::Interrupted => "interrupted",
        _ => "failed",
    };
    let code = match run.status {
        // The status is the code for these, whatever detail the worker recorded.
        RunStatus::Timeout | RunStatus::Interrupted => default_code.to_owned(),
        _ => run
            .error_code
            .clone()
            .unwrap_or_else(|| default_code.to_owned()),
    };
    TurnFailure {
        code,
        message: run
            .error_message
            .clone()
            .or_else(|| run.cancel_reason.clone())
            .unwrap_or_else(|| format!("the turn ended {}", run.status)),
    }
}

/// The final assistant message of a completed run: the last `message.completed`, or the
/// message of `run.completed` when it carries one.
async fn final_result(state: &AppState, run: &RunRecord) -> ApiResult<TurnResult> {
    let records = state
        .stores()
        .runs
        .events_after(run.id, 0, MAX_RESULT_SCAN)
        .await?;
    let content = records
        .iter()
        .rev()
        .find_map(final_message_content)
        .unwrap_or(Value::Null);
    Ok(TurnResult {
        text: content_text(&content),
        content,
        usage: run.usage.clone(),
    })
}

fn final_message_content(record: &RunEventRecord) -> Option<Value> {
    match record.result_type.as_str() {
        "message.completed" | "run.completed" => record
            .data
            .get("data")
            .and_then(|d| d.get("message"))
            .and_then(|m| m.get("content"))
            .filter(|c| !c.is_null())
            .cloned(),
        _ => None,
    }
}

/// The text of a message content: the string itself, or the `text` of its blocks.
fn content_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// `GET /v1/turns/{id}`.
#[utoipa::path(
    get,
    path = "/v1/turns/{id}",
    tag = "turns",
    params(("id" = String, Path, description = "Turn id")),
    responses(
        (status = 200, description = "The turn's snapshot", body = TurnSnapshot),
        (status = 404, description = "no such turn in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn get_turn(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<ApiJson<TurnSnapshot>> {
    let turn = load_turn(&state, &caller, &id).await?;
    Ok(ApiJson(snapshot(&state, &turn, true).await?))
}

/// Query of `GET /v1/turns/{id}/wait`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct WaitQuery {
    /// How long to wait for a terminal snapshot, in milliseconds (default 30 000, at most
    /// 60 000).
    pub timeout_ms: Option<u64>,
}

/// `GET /v1/turns/{id}/wait`: the snapshot once terminal, or the current one at the
/// timeout. Only reads: it never resubmits. Holds one of the key's stream slots while it
/// waits, as a long-lived request.
#[utoipa::path(
    get,
    path = "/v1/turns/{id}/wait",
    tag = "turns",
    params(("id" = String, Path, description = "Turn id"), WaitQuery),
    responses(
        (status = 200, description = "The terminal snapshot, or the current one at the timeout", body = TurnSnapshot),
        (status = 404, description = "no such turn in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn wait_turn(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<WaitQuery>,
) -> ApiResult<ApiJson<TurnSnapshot>> {
    let turn = load_turn(&state, &caller, &id).await?;
    let _slot = state.key_limits().open_stream(caller.key_id)?;
    let (state, turn) = (&state, &turn);
    let answer = super::long_poll(state, q.timeout_ms, WAIT_POLL, |last| async move {
        let current = snapshot(state, turn, false).await?;
        Ok(if current.status == TurnStatus::Completed {
            Some(snapshot(state, turn, true).await?)
        } else if current.status.is_terminal() || last {
            Some(current)
        } else {
            None
        })
    })
    .await?;
    Ok(ApiJson(answer))
}

/// Query of `GET /v1/turns/{id}/events`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct TurnEventsQuery {
    /// Only events with a greater sequence (default 0: from the start).
    #[serde(default)]
    pub after_sequence: u64,
    /// Page size, clamped to [1, 100].
    pub limit: Option<u64>,
}

/// One event of a turn.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TurnEvent {
    /// The session.
    pub session_id: Uuid,
    /// The turn.
    pub turn_id: RunId,
    /// Position in the turn, from 1, dense.
    pub sequence: i64,
    /// When it was recorded, epoch seconds.
    pub timestamp: i64,
    /// Result type (`message.delta`, `tool.call.started`, `run.completed`, …).
    #[serde(rename = "type")]
    pub event_type: String,
    /// The result's `data` (a tool event keeps the runner's `call_id` in it).
    pub data: Value,
    /// The runner's tool call id, for tool events.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
}

/// `GET /v1/turns/{id}/events` body.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TurnEventsPage {
    /// The events after `after_sequence`, ascending.
    pub events: Vec<TurnEvent>,
    /// Part of what was asked is gone (retention): show the snapshot, do not resubmit.
    pub gap: bool,
    /// Pass as `after_sequence` to read on.
    pub next_sequence: i64,
    /// The turn now.
    pub snapshot: TurnSnapshot,
}

/// `GET /v1/turns/{id}/events?after_sequence=N&limit=`.
#[utoipa::path(
    get,
    path = "/v1/turns/{id}/events",
    tag = "turns",
    params(("id" = String, Path, description = "Turn id"), TurnEventsQuery),
    responses(
        (status = 200, description = "Events after a sequence", body = TurnEventsPage),
        (status = 404, description = "no such turn in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn turn_events(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<TurnEventsQuery>,
) -> ApiResult<ApiJson<TurnEventsPage>> {
    let turn = load_turn(&state, &caller, &id).await?;
    let after = i64::try_from(q.after_sequence)
        .map_err(|_| ApiError::invalid("`after_sequence` is too large"))?;
    // The snapshot first: events read after it are at least as new as it says.
    let snapshot = snapshot(&state, &turn, true).await?;
    let run = state.stores().runs.get_run(turn.run_id).await?;
    let records = match &run {
        Some(run) => {
            state
                .stores()
                .runs
                .events_after(run.id, after, state.page_limit(q.limit))
                .await?
        }
        None => Vec::new(),
    };
    let gap = run.as_ref().is_some_and(|run| {
        super::runs::retention_gap(run, after, records.first().map(|r| r.sequence))
    });
    let next_sequence = records.last().map_or(after, |r| r.sequence);
    let events = records
        .into_iter()
        .map(|r| {
            let data = r.data.get("data").cloned().unwrap_or(Value::Null);
            let call_id = data
                .get("call_id")
                .and_then(Value::as_str)
                .map(str::to_owned);
            TurnEvent {
                session_id: turn.session_id,
                turn_id: turn.run_id,
                sequence: r.sequence,
                timestamp: epoch(r.created_at),
                event_type: r.result_type,
                data,
                call_id,
            }
        })
        .collect();
    Ok(ApiJson(TurnEventsPage {
        events,
        gap,
        next_sequence,
        snapshot,
    }))
}

/// `POST /v1/turns/{id}/cancel` body.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TurnCancelResponse {
    /// `true` when an active turn was asked to stop (by this or an earlier request);
    /// `false` when it had already ended (its result is never rewritten).
    pub cancelled: bool,
    /// The turn now.
    pub snapshot: TurnSnapshot,
}

/// `POST /v1/turns/{id}/cancel`. A turn whose run does not exist yet is cancelled as
/// soon as the run is created (the intent is recorded on the run then; until that,
/// `cancelled: false` with a `queued` snapshot tells the caller to ask again).
#[utoipa::path(
    post,
    path = "/v1/turns/{id}/cancel",
    tag = "turns",
    params(("id" = String, Path, description = "Turn id")),
    responses(
        (status = 200, description = "Whether this call cancelled the turn, and its snapshot", body = TurnCancelResponse),
        (status = 404, description = "no such turn in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn cancel_turn(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<ApiJson<TurnCancelResponse>> {
    let turn = load_turn(&state, &caller, &id).await?;
    let cancelled = match state.stores().runs.get_run(turn.run_id).await? {
        Some(run) => super::runs::request_cancel(&state, &run, "cancelled via api".to_owned())
            .await?
            .is_none(),
        None => false,
    };
    let snapshot = snapshot(&state, &turn, true).await?;
    Ok(ApiJson(TurnCancelResponse {
        cancelled,
        snapshot,
    }))
}
