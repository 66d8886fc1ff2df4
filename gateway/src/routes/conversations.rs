//! `GET /v1/conversations/{id}/transcript` and `GET /v1/conversations/{id}/stream` (every
//! run of the conversation as one resumable SSE stream, see [`crate::conversation_stream`]).

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use sb_protocol::proxy::TranscriptItem;
use sb_store::page::ThreadFilter;
use sb_store::transcript::{Direction, TranscriptQuery, TranscriptRecord};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::{ListPage, epoch};
use crate::auth::Caller;
use crate::conversation_stream::{ConversationCursor, StreamStart, conversation_stream};
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::normalize::MAX_ID_LEN;
use crate::state::AppState;

/// Query of the transcript read.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct TranscriptParams {
    /// Continue from this cursor (a `next_cursor` of an earlier page).
    pub cursor: Option<String>,
    /// Page size, clamped to [1, 100].
    pub limit: Option<u64>,
    /// `backward` (default: newest first, continuing towards older items) or `forward`
    /// (oldest first).
    #[serde(default)]
    pub direction: Direction,
    /// Only this thread (default: every thread of the conversation).
    pub thread_id: Option<String>,
}

/// `GET /v1/conversations/{id}/transcript`: `{items: [TranscriptItem…], next_cursor, has_more}`.
#[utoipa::path(
    get,
    path = "/v1/conversations/{id}/transcript",
    tag = "conversations",
    params(("id" = String, Path, description = "Conversation id"), TranscriptParams),
    responses(
        (status = 200, description = "Transcript items", body = ListPage<TranscriptItem>),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn transcript(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(conversation_id): ApiPath<String>,
    ApiQuery(p): ApiQuery<TranscriptParams>,
) -> ApiResult<ApiJson<ListPage<TranscriptItem>>> {
    let mut query = TranscriptQuery::new(caller.workspace_id, conversation_id);
    query.direction = p.direction;
    query.limit = Some(i64::try_from(state.page_limit(p.limit)).unwrap_or(i64::MAX));
    if let Some(thread) = p.thread_id {
        query.thread = ThreadFilter::Exactly(Some(thread));
    }
    match p.direction {
        Direction::Backward => query.before_cursor = p.cursor,
        Direction::Forward => query.after_cursor = p.cursor,
    }
    let page = state.stores().transcript.page(query).await?;
    Ok(ApiJson(ListPage {
        items: page.items.into_iter().map(to_item).collect(),
        next_cursor: page.next_cursor,
        has_more: page.has_more,
    }))
}

/// The protocol projection of a transcript row (the same shape the Host API returns).
pub(crate) fn to_item(r: TranscriptRecord) -> TranscriptItem {
    TranscriptItem {
        transcript_id: r.id,
        event_id: r.event_id,
        conversation_id: Some(r.conversation_id),
        thread_id: r.thread_id,
        role: r.role,
        item_type: r.item_type,
        content: r.content,
        content_json: r.content_json.and_then(into_object),
        artifact_refs: match r.artifact_refs {
            Some(Value::Array(refs)) => refs.into_iter().filter_map(into_object).collect(),
            Some(other) => into_object(other).into_iter().collect(),
            None => Vec::new(),
        },
        seq: Some(r.seq),
        cursor: Some(r.cursor),
        created_at: Some(epoch(r.created_at)),
        metadata: into_object(r.metadata).unwrap_or_default(),
    }
}

fn into_object(value: Value) -> Option<Map<String, Value>> {
    match value {
        Value::Object(map) => Some(map),
        _ => None,
    }
}

/// Query of `GET /v1/conversations/{id}/stream`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ConversationStreamQuery {
    /// Start with every run created from this time on (epoch milliseconds), finished ones
    /// included (default: the runs active now, then every later run).
    pub since_ms: Option<i64>,
    /// Resume after this position (the `id` of a frame); `Last-Event-ID` does the same and
    /// wins (a reconnecting `EventSource` repeats the URL and adds the header).
    pub cursor: Option<String>,
}

/// `GET /v1/conversations/{id}/stream`: SSE of every run of the conversation, each item
/// tagged with its `run_id` and `sequence`, `id:` = a resumable conversation position.
#[utoipa::path(
    get,
    path = "/v1/conversations/{id}/stream",
    tag = "conversations",
    params(("id" = String, Path, description = "Conversation id"), ConversationStreamQuery, ("Last-Event-ID" = Option<String>, Header, description = "Resume after this position (wins over `cursor`)")),
    responses(
        (status = 200, description = "Server-sent events of every run of the conversation, each tagged with its `run_id`", body = String, content_type = "text/event-stream"),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn stream(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(conversation_id): ApiPath<String>,
    ApiQuery(q): ApiQuery<ConversationStreamQuery>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    if conversation_id.is_empty()
        || conversation_id.chars().count() > MAX_ID_LEN
        || conversation_id.chars().any(char::is_control)
    {
        return Err(ApiError::invalid(format!(
            "invalid conversation id: must be 1-{MAX_ID_LEN} characters without control characters"
        )));
    }
    let header = match headers.get("last-event-id") {
        None => None,
        Some(value) => Some(value.to_str().map_err(|_| {
            ApiError::invalid("invalid `Last-Event-ID`: expected the `id` of a frame")
        })?),
    };
    let start = match (header.or(q.cursor.as_deref()), q.since_ms) {
        (Some(position), _) => StreamStart::Resume(
            position
                .parse::<ConversationCursor>()
                .map_err(|e| ApiError::invalid(e.to_string()))?,
        ),
        (None, Some(ms)) if ms < 0 => {
            return Err(ApiError::invalid(
                "invalid `since_ms`: expected epoch milliseconds",
            ));
        }
        (None, Some(ms)) => StreamStart::Since(ms),
        (None, None) => StreamStart::Now(chrono::Utc::now().timestamp_millis()),
    };
    let slot = state.key_limits().open_stream(caller.key_id)?;
    Ok(conversation_stream(
        state.stream_context(),
        caller.workspace_id,
        conversation_id,
        start,
        slot,
    )
    .into_response())
}
