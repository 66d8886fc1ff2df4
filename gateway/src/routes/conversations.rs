//! `GET /v1/conversations/{id}/transcript`.

use axum::extract::State;
use sb_protocol::proxy::TranscriptItem;
use sb_store::page::ThreadFilter;
use sb_store::transcript::{Direction, TranscriptQuery, TranscriptRecord};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::{ListPage, epoch};
use crate::auth::Caller;
use crate::error::{ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::state::AppState;

/// Query of the transcript read.
#[derive(Debug, Default, Deserialize)]
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
