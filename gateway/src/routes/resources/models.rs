//! Model registrations: `POST/GET /v1/models` and `GET/PATCH/DELETE /v1/models/{id}`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use sb_store::{ModelKind, ModelRecord, NewModel};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::shared::{Reference, check_egress, check_secret, merged, missing, refuse_if_referenced};
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::routes::{ListPage, PageQuery, epoch, page_by_key, parse_id};
use crate::state::AppState;

/// Body of `POST /v1/models`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateModel {
    /// Unique in the workspace.
    pub name: String,
    /// `llm` or `rerank`.
    pub kind: ModelKind,
    /// OpenAI-compatible base URL.
    pub base_url: String,
    /// Provider model name.
    pub model_name: String,
    /// Environment variable holding the API key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Context window in tokens.
    #[serde(default)]
    pub context_window: Option<i64>,
    /// Extra request body fields (an object).
    #[serde(default)]
    pub extra_args: Option<Map<String, Value>>,
}

/// A model on the wire.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ModelView {
    model_id: Uuid,
    name: String,
    kind: ModelKind,
    base_url: String,
    model_name: String,
    api_key_env: Option<String>,
    context_window: Option<i64>,
    extra_args: Value,
    enabled: bool,
    created_at: i64,
}

impl From<ModelRecord> for ModelView {
    fn from(m: ModelRecord) -> Self {
        Self {
            model_id: m.model_id,
            name: m.name,
            kind: m.kind,
            base_url: m.base_url,
            model_name: m.model_name,
            api_key_env: m.api_key_env,
            context_window: m.context_window,
            extra_args: m.extra_args,
            enabled: m.enabled,
            created_at: epoch(m.created_at),
        }
    }
}

/// Checks a model body as a registration (egress policy of `base_url`, secret reference of
/// `api_key_env`) and turns it into the store's form; create and update share it.
fn new_model(state: &AppState, caller: &Caller, body: CreateModel) -> ApiResult<NewModel> {
    check_egress(state, "base_url", &body.base_url)?;
    if let Some(env) = body.api_key_env.as_deref() {
        check_secret(state, "api_key_env", env)?;
    }
    Ok(NewModel {
        workspace_id: caller.workspace_id.clone(),
        name: body.name,
        kind: body.kind,
        base_url: body.base_url,
        model_name: body.model_name,
        api_key_env: body.api_key_env,
        context_window: body.context_window,
        extra_args: body.extra_args.map(Value::Object),
    })
}

/// `POST /v1/models` → `201`.
#[utoipa::path(
    post,
    path = "/v1/models",
    tag = "resources",
    request_body = CreateModel,
    responses(
        (status = 201, description = "The new model", body = ModelView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 409, description = "`conflict`: the id is taken", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn create_model(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CreateModel>,
) -> ApiResult<impl IntoResponse> {
    let new = new_model(&state, &caller, body)?;
    let row = state.stores().resources.create_model(new).await?;
    tracing::info!(model_id = %row.model_id, kind = row.kind.as_str(), "model registered");
    Ok((StatusCode::CREATED, ApiJson(ModelView::from(row))))
}

/// `GET /v1/models`.
#[utoipa::path(
    get,
    path = "/v1/models",
    tag = "resources",
    params(PageQuery),
    responses(
        (status = 200, description = "Registered models", body = ListPage<ModelView>),
    )
)]
pub async fn list_models(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ApiResult<ApiJson<ListPage<ModelView>>> {
    let rows = state
        .stores()
        .resources
        .list_models(&caller.workspace_id)
        .await?;
    let items: Vec<ModelView> = rows.into_iter().map(ModelView::from).collect();
    Ok(ApiJson(page_by_key(
        items,
        |m| (m.name.clone(), m.model_id),
        q.cursor.as_deref(),
        state.page_limit(q.limit),
    )?))
}

/// `GET /v1/models/{id}`.
#[utoipa::path(
    get,
    path = "/v1/models/{id}",
    tag = "resources",
    params(("id" = String, Path, description = "Model id")),
    responses(
        (status = 200, description = "The model", body = ModelView),
        (status = 404, description = "no such model in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn get_model(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<ApiJson<ModelView>> {
    let model_id: Uuid = parse_id("model", &id)?;
    let row = state
        .stores()
        .resources
        .get_model(&caller.workspace_id, model_id)
        .await
        .map_err(missing("model", &id))?;
    Ok(ApiJson(row.into()))
}

/// `PATCH /v1/models/{id}`: the updated model.
#[utoipa::path(
    patch,
    path = "/v1/models/{id}",
    tag = "resources",
    params(("id" = String, Path, description = "Model id")),
    request_body(content = Object, description = "Fields of `CreateModel` to change"),
    responses(
        (status = 200, description = "The changed model", body = ModelView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 404, description = "no such model in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn update_model(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiJson(patch): ApiJson<Map<String, Value>>,
) -> ApiResult<ApiJson<ModelView>> {
    let model_id: Uuid = parse_id("model", &id)?;
    let resources = &state.stores().resources;
    let current = resources
        .get_model(&caller.workspace_id, model_id)
        .await
        .map_err(missing("model", &id))?;
    let body: CreateModel = merged(
        json!({
            "name": current.name, "kind": current.kind, "base_url": current.base_url,
            "model_name": current.model_name, "api_key_env": current.api_key_env,
            "context_window": current.context_window, "extra_args": current.extra_args,
        }),
        patch,
    )?;
    let new = new_model(&state, &caller, body)?;
    let row = resources
        .update_model(model_id, new)
        .await
        .map_err(missing("model", &id))?;
    tracing::info!(%model_id, "model updated");
    Ok(ApiJson(row.into()))
}

/// `DELETE /v1/models/{id}`: `204`; `409` while an agent refers to it.
#[utoipa::path(
    delete,
    path = "/v1/models/{id}",
    tag = "resources",
    params(("id" = String, Path, description = "Model id")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "no such model in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn delete_model(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    let model_id: Uuid = parse_id("model", &id)?;
    let current = state
        .stores()
        .resources
        .get_model(&caller.workspace_id, model_id)
        .await
        .map_err(missing("model", &id))?;
    let doing = format!("delete model {}", current.name);
    refuse_if_referenced(&state, &caller, Reference::Model(&id), &doing).await?;
    if !state
        .stores()
        .resources
        .delete_model(&caller.workspace_id, model_id)
        .await?
    {
        return Err(ApiError::not_found(format!("model {id} not found")));
    }
    tracing::info!(%model_id, "model deleted");
    Ok(StatusCode::NO_CONTENT)
}
