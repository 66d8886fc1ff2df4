//! The turn API's sessions (SPEC §10.2, seed 004): `POST/GET /v1/sessions`,
//! `GET/DELETE /v1/sessions/{id}`, `GET /v1/sessions/{id}/history`. Turns of a session are
//! in [`super::turns`].
//!
//! A session is a conversation (`session:<session_id>`) with one agent, fixed at creation
//! together with that agent's runner: later changes to the scopes of agents never move a
//! session's turns elsewhere. Closing a session refuses later turns (`409 conflict`); its
//! history stays readable.

use axum::extract::State;
use axum::http::StatusCode;
use sb_protocol::ids::AgentId;
use sb_protocol::proxy::TranscriptItem;
use sb_store::transcript::{Direction, TranscriptQuery};
use sb_store::{NewTurnSession, TurnSessionRecord};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use super::conversations::to_item;
use super::{ListPage, epoch, parse_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::state::AppState;

/// Body of `POST /v1/sessions`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSessionRequest {
    /// The agent of every turn (enabled, of the caller's workspace).
    pub agent_id: String,
    /// Caller metadata (a JSON object), returned as given.
    #[serde(default)]
    pub metadata: Option<Value>,
}

/// A session on the wire.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct SessionView {
    /// Session id.
    pub session_id: Uuid,
    /// The agent fixed at creation.
    pub agent_id: AgentId,
    /// Its runner at creation.
    pub runner_id: Option<String>,
    /// The conversation of the session's turns (its transcript).
    pub conversation_id: String,
    /// Caller metadata.
    pub metadata: Option<Value>,
    /// `open` or `closed`.
    pub status: &'static str,
    /// Close time, epoch seconds.
    pub closed_at: Option<i64>,
    /// Creation time, epoch seconds.
    pub created_at: i64,
}

impl From<TurnSessionRecord> for SessionView {
    fn from(r: TurnSessionRecord) -> Self {
        Self {
            session_id: r.id,
            agent_id: r.agent_id,
            runner_id: r.runner_id,
            conversation_id: r.conversation_id,
            metadata: r.metadata,
            status: if r.closed_at.is_some() {
                "closed"
            } else {
                "open"
            },
            closed_at: r.closed_at.map(epoch),
            created_at: epoch(r.created_at),
        }
    }
}

/// The session `id` of the caller's workspace, closed or not (`404` otherwise).
pub(crate) async fn load_session(
    state: &AppState,
    caller: &Caller,
    id: &str,
) -> ApiResult<TurnSessionRecord> {
    let session_id: Uuid = parse_id("session", id)?;
    state
        .stores()
        .turns
        .get_session(&caller.workspace_id, session_id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("session {id} not found")))
}

/// `POST /v1/sessions`: `201` with the session.
#[utoipa::path(
    post,
    path = "/v1/sessions",
    tag = "sessions",
    request_body = CreateSessionRequest,
    responses(
        (status = 201, description = "The new session", body = SessionView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 404, description = "no such agent in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn create_session(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CreateSessionRequest>,
) -> ApiResult<(StatusCode, ApiJson<SessionView>)> {
    if body.metadata.as_ref().is_some_and(|m| !m.is_object()) {
        return Err(ApiError::invalid(
            "invalid `metadata`: must be a JSON object",
        ));
    }
    // An unknown agent and one of another workspace look the same.
    let unknown = || ApiError::invalid(format!("invalid `agent_id`: no agent {}", body.agent_id));
    let agent_id: AgentId = body.agent_id.parse().map_err(|_| unknown())?;
    let agent = state
        .stores()
        .agents
        .get(&caller.workspace_id, agent_id)
        .await?
        .ok_or_else(unknown)?;
    if !agent.enabled {
        return Err(ApiError::invalid(format!(
            "invalid `agent_id`: agent {agent_id} is disabled"
        )));
    }
    let record = state
        .stores()
        .turns
        .create_session(NewTurnSession {
            workspace_id: caller.workspace_id.clone(),
            agent_id,
            runner_id: agent.runner_id,
            metadata: body.metadata,
        })
        .await?;
    tracing::info!(session_id = %record.id, %agent_id, "session created");
    Ok((StatusCode::CREATED, ApiJson(record.into())))
}

/// Query of `GET /v1/sessions`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListSessionsQuery {
    /// Continue after this cursor.
    pub cursor: Option<String>,
    /// Page size, clamped to [1, 100].
    pub limit: Option<u64>,
}

/// `GET /v1/sessions`: the caller's workspace's sessions, oldest first.
#[utoipa::path(
    get,
    path = "/v1/sessions",
    tag = "sessions",
    params(ListSessionsQuery),
    responses(
        (status = 200, description = "The workspace's sessions, oldest first", body = ListPage<SessionView>),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn list_sessions(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<ListSessionsQuery>,
) -> ApiResult<ApiJson<ListPage<SessionView>>> {
    let limit = i64::try_from(state.page_limit(q.limit)).unwrap_or(i64::MAX);
    let page = state
        .stores()
        .turns
        .list_sessions(&caller.workspace_id, q.cursor, Some(limit))
        .await?;
    Ok(ApiJson(ListPage {
        items: page.items.into_iter().map(SessionView::from).collect(),
        next_cursor: page.next_cursor,
        has_more: page.has_more,
    }))
}

/// `GET /v1/sessions/{id}`.
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}",
    tag = "sessions",
    params(("id" = String, Path, description = "Session id")),
    responses(
        (status = 200, description = "The session", body = SessionView),
        (status = 404, description = "no such session in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn get_session(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<ApiJson<SessionView>> {
    Ok(ApiJson(load_session(&state, &caller, &id).await?.into()))
}

/// `DELETE /v1/sessions/{id}`: closes the session (idempotent) and answers it.
#[utoipa::path(
    delete,
    path = "/v1/sessions/{id}",
    tag = "sessions",
    params(("id" = String, Path, description = "Session id")),
    responses(
        (status = 200, description = "The closed session (closing again changes nothing)", body = SessionView),
        (status = 404, description = "no such session in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn close_session(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<ApiJson<SessionView>> {
    let session = load_session(&state, &caller, &id).await?;
    let closed = state
        .stores()
        .turns
        .close_session(&caller.workspace_id, session.id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("session {id} not found")))?;
    tracing::info!(session_id = %closed.id, "session closed");
    Ok(ApiJson(closed.into()))
}

/// Query of `GET /v1/sessions/{id}/history`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct HistoryQuery {
    /// Continue from this cursor.
    pub cursor: Option<String>,
    /// Page size, clamped to [1, 100].
    pub limit: Option<u64>,
    /// `backward` (newest first, the default) or `forward`.
    #[serde(default)]
    pub direction: Direction,
}

/// `GET /v1/sessions/{id}/history`: the user and assistant messages of the session's
/// transcript, paged like the transcript (a page covers `limit` transcript items; the
/// others, such as tool calls, are left out of it, so a page can hold fewer).
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}/history",
    tag = "sessions",
    params(("id" = String, Path, description = "Session id"), HistoryQuery),
    responses(
        (status = 200, description = "User and assistant messages", body = ListPage<TranscriptItem>),
        (status = 404, description = "no such session in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn history(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<HistoryQuery>,
) -> ApiResult<ApiJson<ListPage<TranscriptItem>>> {
    let session = load_session(&state, &caller, &id).await?;
    let mut query = TranscriptQuery::new(caller.workspace_id, session.conversation_id);
    query.direction = q.direction;
    query.limit = Some(i64::try_from(state.page_limit(q.limit)).unwrap_or(i64::MAX));
    match q.direction {
        Direction::Backward => query.before_cursor = q.cursor,
        Direction::Forward => query.after_cursor = q.cursor,
    }
    let page = state.stores().transcript.page(query).await?;
    Ok(ApiJson(ListPage {
        items: page
            .items
            .into_iter()
            .filter(|r| matches!(r.role.as_str(), "user" | "assistant"))
            .map(to_item)
            .collect(),
        next_cursor: page.next_cursor,
        has_more: page.has_more,
    }))
}
