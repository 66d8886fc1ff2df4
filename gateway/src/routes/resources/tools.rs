//! Tool registrations: `POST/GET /v1/tools` and `GET/PATCH/DELETE /v1/tools/{id}`.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use sb_store::{NewTool, ToolRecord};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::shared::{Reference, check_egress, check_secret, merged, missing, refuse_if_referenced};
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::routes::{ListPage, PageQuery, epoch, page_by_key, parse_id};
use crate::state::AppState;

/// Default HTTP tool timeout (lowered to `limits.tool_timeout_max` when that is smaller).
const DEFAULT_TOOL_TIMEOUT_MS: u64 = 10_000;
/// Default cap of an HTTP tool response body (lowered to `limits.tool_response_bytes_max`
/// when that is smaller).
const DEFAULT_TOOL_MAX_RESPONSE_BYTES: u64 = 1024 * 1024;

/// Body of `POST /v1/tools`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTool {
    /// Unique in the workspace.
    pub name: String,
    /// Shown to models.
    #[serde(default)]
    pub description: String,
    /// JSON schema of the parameters.
    #[serde(default)]
    pub parameters: Option<Map<String, Value>>,
    /// Only `http`.
    pub kind: String,
    /// Where the call is POSTed.
    pub url: String,
    /// Timeout of one call (default 10 s, at most `limits.tool_timeout_max`).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Cap of the response body (default 1 MiB, at most `limits.tool_response_bytes_max`).
    #[serde(default)]
    pub max_response_bytes: Option<u64>,
    /// Static headers: header name → environment variable holding the value.
    #[serde(default)]
    pub headers_env: BTreeMap<String, String>,
}

/// A tool on the wire.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ToolView {
    tool_id: Uuid,
    name: String,
    description: String,
    parameters: Value,
    kind: String,
    url: Value,
    timeout_ms: Value,
    max_response_bytes: Value,
    headers_env: Value,
    enabled: bool,
    created_at: i64,
}

impl From<ToolRecord> for ToolView {
    fn from(t: ToolRecord) -> Self {
        let field = |k: &str| t.config.get(k).cloned().unwrap_or(Value::Null);
        Self {
            url: field("url"),
            timeout_ms: field("timeout_ms"),
            max_response_bytes: field("max_response_bytes"),
            headers_env: field("headers_env"),
            tool_id: t.tool_id,
            name: t.name,
            description: t.description,
            parameters: t.parameters,
            kind: t.kind,
            enabled: t.enabled,
            created_at: epoch(t.created_at),
        }
    }
}

/// Checks a tool body as a registration (name rules, egress policy of `url`, the
/// deployment's timeout and response ceilings, header names and their secret references)
/// and turns it into the store's form; create and update share it.
fn new_tool(state: &AppState, caller: &Caller, body: CreateTool) -> ApiResult<NewTool> {
    if body.kind != "http" {
        return Err(ApiError::invalid("kind must be \"http\""));
    }
    if !body
        .name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        || body.name.is_empty()
        || body.name.len() > 64
    {
        return Err(ApiError::invalid(
            "name must be 1 to 64 characters of [A-Za-z0-9_.-]",
        ));
    }
    check_egress(state, "url", &body.url)?;
    // The deployment's ceilings; the config validation keeps both at least 1.
    let options = state.options();
    let timeout_max_ms = u64::try_from(options.tool_timeout_max.as_millis()).unwrap_or(u64::MAX);
    let timeout_ms = body
        .timeout_ms
        .unwrap_or(DEFAULT_TOOL_TIMEOUT_MS.min(timeout_max_ms));
    if timeout_ms == 0 || timeout_ms > timeout_max_ms {
        return Err(ApiError::invalid(format!(
            "timeout_ms must be between 1 and {timeout_max_ms} (limits.tool_timeout_max)"
        )));
    }
    let response_bytes_max = options.tool_response_bytes_max;
    let max_response_bytes = body
        .max_response_bytes
        .unwrap_or(DEFAULT_TOOL_MAX_RESPONSE_BYTES.min(response_bytes_max));
    if max_response_bytes == 0 || max_response_bytes > response_bytes_max {
        return Err(ApiError::invalid(format!(
            "max_response_bytes must be between 1 and {response_bytes_max} \
             (limits.tool_response_bytes_max)"
        )));
    }
    for (header, env) in &body.headers_env {
        if header.is_empty()
            || !header
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(ApiError::invalid(format!("invalid header name {header:?}")));
        }
        check_secret(state, &format!("headers_env.{header}"), env)?;
    }
    let parameters = body
        .parameters
        .map(Value::Object)
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
    Ok(NewTool {
        workspace_id: caller.workspace_id.clone(),
        name: body.name,
        kind: body.kind,
        description: body.description,
        parameters,
        config: json!({
            "url": body.url,
            "timeout_ms": timeout_ms,
            "max_response_bytes": max_response_bytes,
            "headers_env": body.headers_env,
        }),
    })
}

/// `POST /v1/tools` → `201`.
#[utoipa::path(
    post,
    path = "/v1/tools",
    tag = "resources",
    request_body = CreateTool,
    responses(
        (status = 201, description = "The new tool", body = ToolView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 409, description = "`conflict`: the id is taken", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn create_tool(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CreateTool>,
) -> ApiResult<impl IntoResponse> {
    let new = new_tool(&state, &caller, body)?;
    let row = state.stores().resources.create_tool(new).await?;
    tracing::info!(tool = %row.name, "tool registered");
    Ok((StatusCode::CREATED, ApiJson(ToolView::from(row))))
}

/// `GET /v1/tools`.
#[utoipa::path(
    get,
    path = "/v1/tools",
    tag = "resources",
    params(PageQuery),
    responses(
        (status = 200, description = "Registered tools", body = ListPage<ToolView>),
    )
)]
pub async fn list_tools(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ApiResult<ApiJson<ListPage<ToolView>>> {
    let rows = state
        .stores()
        .resources
        .list_tools(&caller.workspace_id)
        .await?;
    let items: Vec<ToolView> = rows.into_iter().map(ToolView::from).collect();
    Ok(ApiJson(page_by_key(
        items,
        |t| (t.name.clone(), t.tool_id),
        q.cursor.as_deref(),
        state.page_limit(q.limit),
    )?))
}

/// The tool `id` of the caller's workspace.
async fn find_tool(state: &AppState, caller: &Caller, id: &str) -> ApiResult<ToolRecord> {
    let tool_id: Uuid = parse_id("tool", id)?;
    state
        .stores()
        .resources
        .list_tools(&caller.workspace_id)
        .await?
        .into_iter()
        .find(|t| t.tool_id == tool_id)
        .ok_or_else(|| ApiError::not_found(format!("tool {id} not found")))
}

/// `GET /v1/tools/{id}`.
#[utoipa::path(
    get,
    path = "/v1/tools/{id}",
    tag = "resources",
    params(("id" = String, Path, description = "Tool id")),
    responses(
        (status = 200, description = "The tool", body = ToolView),
        (status = 404, description = "no such tool in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn get_tool(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<ApiJson<ToolView>> {
    Ok(ApiJson(find_tool(&state, &caller, &id).await?.into()))
}

/// `PATCH /v1/tools/{id}`: the updated tool; a rename is refused (`409`) while an agent
/// grants the tool by its old name.
#[utoipa::path(
    patch,
    path = "/v1/tools/{id}",
    tag = "resources",
    params(("id" = String, Path, description = "Tool id")),
    request_body(content = Object, description = "Fields of `CreateTool` to change"),
    responses(
        (status = 200, description = "The changed tool", body = ToolView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 404, description = "no such tool in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn update_tool(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiJson(patch): ApiJson<Map<String, Value>>,
) -> ApiResult<ApiJson<ToolView>> {
    let current = find_tool(&state, &caller, &id).await?;
    let config = |k: &str| current.config.get(k).cloned().unwrap_or(Value::Null);
    let body: CreateTool = merged(
        json!({
            "name": current.name, "description": current.description,
            "parameters": current.parameters, "kind": current.kind, "url": config("url"),
            "timeout_ms": config("timeout_ms"),
            "max_response_bytes": config("max_response_bytes"),
            "headers_env": current.config.get("headers_env").cloned().unwrap_or_else(|| json!({})),
        }),
        patch,
    )?;
    if body.name != current.name {
        let doing = format!("rename tool {}", current.name);
        refuse_if_referenced(&state, &caller, Reference::Tool(&current.name), &doing).await?;
    }
    let new = new_tool(&state, &caller, body)?;
    let row = state
        .stores()
        .resources
        .update_tool(current.tool_id, new)
        .await
        .map_err(missing("tool", &id))?;
    tracing::info!(tool = %row.name, "tool updated");
    Ok(ApiJson(row.into()))
}

/// `DELETE /v1/tools/{id}`: `204`; `409` while an agent grants it.
#[utoipa::path(
    delete,
    path = "/v1/tools/{id}",
    tag = "resources",
    params(("id" = String, Path, description = "Tool id")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "no such tool in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn delete_tool(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    let current = find_tool(&state, &caller, &id).await?;
    let doing = format!("delete tool {}", current.name);
    refuse_if_referenced(&state, &caller, Reference::Tool(&current.name), &doing).await?;
    if !state
        .stores()
        .resources
        .delete_tool(&caller.workspace_id, current.tool_id)
        .await?
    {
        return Err(ApiError::not_found(format!("tool {id} not found")));
    }
    tracing::info!(tool = %current.name, "tool deleted");
    Ok(StatusCode::NO_CONTENT)
}
