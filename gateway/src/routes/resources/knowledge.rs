//! Knowledge bases: `POST/GET /v1/knowledge-bases`, `GET/PATCH/DELETE` of each by id.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use sb_store::KnowledgeBaseRecord;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::shared::{Reference, merged, missing, refuse_if_referenced};
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::routes::{ListPage, PageQuery, epoch, page_by_key, parse_id};
use crate::state::AppState;

/// Body of `POST /v1/knowledge-bases`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateKnowledgeBase {
    /// Unique in the workspace.
    pub name: String,
    /// Free text.
    #[serde(default)]
    pub description: Option<String>,
}

/// A knowledge base on the wire.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct KnowledgeBaseView {
    kb_id: Uuid,
    name: String,
    description: Option<String>,
    created_at: i64,
}

impl From<KnowledgeBaseRecord> for KnowledgeBaseView {
    fn from(k: KnowledgeBaseRecord) -> Self {
        Self {
            kb_id: k.kb_id,
            name: k.name,
            description: k.description,
            created_at: epoch(k.created_at),
        }
    }
}

/// `POST /v1/knowledge-bases` → `201 {kb_id, …}`.
#[utoipa::path(
    post,
    path = "/v1/knowledge-bases",
    tag = "resources",
    request_body = CreateKnowledgeBase,
    responses(
        (status = 201, description = "The new knowledge base", body = KnowledgeBaseView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 409, description = "`conflict`: the id is taken", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn create_kb(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CreateKnowledgeBase>,
) -> ApiResult<impl IntoResponse> {
    let row = state
        .stores()
        .resources
        .create_kb(&caller.workspace_id, &body.name, body.description)
        .await?;
    tracing::info!(kb_id = %row.kb_id, "knowledge base created");
    Ok((StatusCode::CREATED, ApiJson(KnowledgeBaseView::from(row))))
}

/// `GET /v1/knowledge-bases`.
#[utoipa::path(
    get,
    path = "/v1/knowledge-bases",
    tag = "resources",
    params(PageQuery),
    responses(
        (status = 200, description = "Knowledge bases", body = ListPage<KnowledgeBaseView>),
    )
)]
pub async fn list_kbs(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ApiResult<ApiJson<ListPage<KnowledgeBaseView>>> {
    let rows = state
        .stores()
        .resources
        .list_kbs(&caller.workspace_id)
        .await?;
    let items: Vec<KnowledgeBaseView> = rows.into_iter().map(KnowledgeBaseView::from).collect();
    Ok(ApiJson(page_by_key(
        items,
        |k| (k.name.clone(), k.kb_id),
        q.cursor.as_deref(),
        state.page_limit(q.limit),
    )?))
}

/// `GET /v1/knowledge-bases/{id}`.
#[utoipa::path(
    get,
    path = "/v1/knowledge-bases/{id}",
    tag = "resources",
    params(("id" = String, Path, description = "Knowledge base id")),
    responses(
        (status = 200, description = "The knowledge base", body = KnowledgeBaseView),
        (status = 404, description = "no such knowledge base in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn get_kb(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<ApiJson<KnowledgeBaseView>> {
    let kb_id: Uuid = parse_id("knowledge base", &id)?;
    let row = state
        .stores()
        .resources
        .get_kb(&caller.workspace_id, kb_id)
        .await
        .map_err(missing("knowledge base", &id))?;
    Ok(ApiJson(row.into()))
}

/// `PATCH /v1/knowledge-bases/{id}` (`name`, `description`): the updated knowledge base.
#[utoipa::path(
    patch,
    path = "/v1/knowledge-bases/{id}",
    tag = "resources",
    params(("id" = String, Path, description = "Knowledge base id")),
    request_body(content = Object, description = "Fields of `CreateKnowledgeBase` to change"),
    responses(
        (status = 200, description = "The changed knowledge base", body = KnowledgeBaseView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 404, description = "no such knowledge base in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn update_kb(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiJson(patch): ApiJson<Map<String, Value>>,
) -> ApiResult<ApiJson<KnowledgeBaseView>> {
    let kb_id: Uuid = parse_id("knowledge base", &id)?;
    let resources = &state.stores().resources;
    let current = resources
        .get_kb(&caller.workspace_id, kb_id)
        .await
        .map_err(missing("knowledge base", &id))?;
    let body: CreateKnowledgeBase = merged(
        json!({"name": current.name, "description": current.description}),
        patch,
    )?;
    let row = resources
        .update_kb(&caller.workspace_id, kb_id, &body.name, body.description)
        .await
        .map_err(missing("knowledge base", &id))?;
    tracing::info!(%kb_id, "knowledge base updated");
    Ok(ApiJson(row.into()))
}

/// `DELETE /v1/knowledge-bases/{id}`: `204`, with its documents; `409` while an agent
/// refers to it.
#[utoipa::path(
    delete,
    path = "/v1/knowledge-bases/{id}",
    tag = "resources",
    params(("id" = String, Path, description = "Knowledge base id")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "no such knowledge base in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn delete_kb(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    let kb_id: Uuid = parse_id("knowledge base", &id)?;
    let current = state
        .stores()
        .resources
        .get_kb(&caller.workspace_id, kb_id)
        .await
        .map_err(missing("knowledge base", &id))?;
    let doing = format!("delete knowledge base {}", current.name);
    refuse_if_referenced(&state, &caller, Reference::KnowledgeBase(&id), &doing).await?;
    if !state
        .stores()
        .resources
        .delete_kb(&caller.workspace_id, kb_id)
        .await?
    {
        return Err(ApiError::not_found(format!(
            "knowledge base {id} not found"
        )));
    }
    tracing::info!(%kb_id, "knowledge base deleted");
    Ok(StatusCode::NO_CONTENT)
}
