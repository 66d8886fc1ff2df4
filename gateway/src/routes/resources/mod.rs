//! The workspace resource registry (SPEC §8): `POST/GET /v1/models`, `POST/GET /v1/tools`,
//! `POST/GET /v1/knowledge-bases`, `POST/GET /v1/knowledge-bases/{kb_id}/documents`, and
//! `GET/PATCH/DELETE` of each one (`/v1/models/{id}`, `/v1/tools/{id}`,
//! `/v1/knowledge-bases/{id}`, `/v1/knowledge-bases/{kb_id}/documents/{id}`).
//!
//! # Editing
//!
//! A `PATCH` body holds the fields to change, with the names of the create body; the current
//! registration with the patch on top (top-level keys replace, `null` clears an optional
//! field) is then checked exactly as a create body is (unknown fields, egress policy, secret
//! references, limits) and replaces the registration; the answer is the updated view. A
//! document's text cannot be patched (delete it and add the new text), only its `title`
//! and `metadata`.
//!
//! Nothing caches a registration: the orchestrator's catalog reads the registry for every
//! run it plans, and a worker reads the model or tool at every call, so an edit or a delete
//! applies from the next run (and the next call of a running one).
//!
//! # Deleting what an agent uses
//!
//! A `DELETE` of a model, tool or knowledge base that an agent of the workspace still refers
//! to (its `resource_policy` grants, or, for ids, anywhere in its `runner_config`, e.g. the
//! local agent's `model.primary`) is refused with `409 conflict` naming the agents: a
//! delete would otherwise leave the agent failing at its next run. Renaming a tool that an
//! agent grants by name is refused the same way. Edit or delete the agents first.
//!
//! A document's text is given inline (`text`) or read from an artifact of the workspace
//! (`artifact_id`, e.g. a file a runner produced or an event attached); see
//! [`add_document`] for what an artifact must be.
//!
//! Secrets never pass through here: a model names the environment variable holding its API
//! key (`api_key_env`) and a tool the environment variables of its static headers
//! (`headers_env`), and only workers read the values when they call the provider. A name must
//! be one the operator made available (`secrets.allow`, see `sb_common::secrets`), never the
//! host's own configuration. The views echo those *names* (so an operator can see which
//! variable to set), never a value.
//!
//! URLs pass the deployment's egress policy (`sb_common::egress`) here, so a model or tool
//! pointing at metadata, loopback or private addresses is refused at registration with a
//! clear `400`; workers check again at connect time, on the resolved address.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use sb_protocol::error::ErrorCode;
use sb_protocol::ids::WorkspaceId;
use sb_store::resources::MAX_DOCUMENT_BYTES;
use sb_store::{
    KbDocumentRecord, KnowledgeBaseRecord, ModelKind, ModelRecord, NewKbDocument, NewModel,
    NewTool, StoreError, ToolRecord,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::{ListPage, PageQuery, epoch, page_by_key, parse_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::state::AppState;
use sb_store::DocumentEdit;
use sb_store::agents::AgentRow;

/// Default HTTP tool timeout (lowered to `limits.tool_timeout_max` when that is smaller).
const DEFAULT_TOOL_TIMEOUT_MS: u64 = 10_000;
/// Default cap of an HTTP tool response body (lowered to `limits.tool_response_bytes_max`
/// when that is smaller).
const DEFAULT_TOOL_MAX_RESPONSE_BYTES: u64 = 1024 * 1024;

/// Refuses a URL the deployment's egress policy refuses, naming the field.
fn check_egress(state: &AppState, field: &'static str, url: &str) -> ApiResult<()> {
    state
        .options()
        .providers
        .egress
        .check_url(field, url)
        .map(drop)
        .map_err(|e| ApiError::invalid(e.to_string()))
}

/// Refuses a secret reference the deployment does not make available, naming the field.
fn check_secret(state: &AppState, field: &str, name: &str) -> ApiResult<()> {
    state
        .options()
        .providers
        .secrets
        .check(name)
        .map_err(|e| ApiError::invalid(format!("{field}: {e}")))
}

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

/// Body of `POST /v1/knowledge-bases/{kb_id}/documents`: exactly one of `text` and
/// `artifact_id`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AddDocument {
    /// Title returned with every hit.
    pub title: String,
    /// The text (chunked and indexed).
    #[serde(default)]
    pub text: Option<String>,
    /// An artifact of the workspace whose content is the text.
    #[serde(default)]
    pub artifact_id: Option<String>,
    /// Metadata object.
    #[serde(default)]
    pub metadata: Option<Map<String, Value>>,
}

/// A stored document on the wire.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct DocumentView {
    document_id: Uuid,
    kb_id: Uuid,
    title: String,
    size_bytes: i64,
    sha256: String,
    chunks: u64,
    artifact_id: Option<String>,
    metadata: Value,
    created_at: i64,
}

impl From<KbDocumentRecord> for DocumentView {
    fn from(d: KbDocumentRecord) -> Self {
        Self {
            document_id: d.document_id,
            kb_id: d.kb_id,
            title: d.title,
            size_bytes: d.size_bytes,
            sha256: d.sha256,
            chunks: d.chunks,
            artifact_id: d.artifact_id,
            metadata: d.metadata,
            created_at: epoch(d.created_at),
        }
    }
}

/// `POST /v1/knowledge-bases/{kb_id}/documents` → `201`.
///
/// With `artifact_id`, the artifact's content becomes the text, under the rules of inline
/// text (same size limit, `413` above it) plus:
/// - it must be a live artifact of the caller's workspace: a missing, expired or foreign one
///   is `404`, worded alike so ids of other workspaces cannot be probed;
/// - its bytes must be stored by the host (an artifact that is only a URL or a platform
///   file reference is `400`: the host does not fetch external content);
/// - they must be UTF-8 text (`400` otherwise, with the offset of the first invalid byte).
///
/// The document records the artifact id (`kb_documents.artifact_id`) and returns it.
#[utoipa::path(
    post,
    path = "/v1/knowledge-bases/{kb_id}/documents",
    tag = "resources",
    params(("kb_id" = String, Path, description = "Knowledge base id")),
    request_body = AddDocument,
    responses(
        (status = 201, description = "The new document", body = DocumentView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 404, description = "no such knowledge base in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn add_document(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(kb_id): ApiPath<String>,
    ApiJson(body): ApiJson<AddDocument>,
) -> ApiResult<impl IntoResponse> {
    let kb_uuid: Uuid = parse_id("knowledge base", &kb_id)?;
    let (text, artifact_id) = match (body.text, body.artifact_id) {
        (Some(text), None) => (text, None),
        (None, Some(id)) => (
            artifact_text(&state, &caller.workspace_id, &id).await?,
            Some(id),
        ),
        (Some(_), Some(_)) | (None, None) => {
            return Err(ApiError::invalid(
                "exactly one of `text` and `artifact_id` is required",
            ));
        }
    };
    let row = state
        .stores()
        .resources
        .add_document(NewKbDocument {
            workspace_id: caller.workspace_id,
            kb_id: kb_uuid,
            title: body.title,
            text,
            artifact_id,
            metadata: body.metadata.map_or(Value::Null, Value::Object),
        })
        .await?;
    tracing::info!(kb_id = %row.kb_id, document_id = %row.document_id, chunks = row.chunks, "document indexed");
    Ok((StatusCode::CREATED, ApiJson(DocumentView::from(row))))
}

/// The content of artifact `id` of `workspace` as document text (see [`add_document`]).
async fn artifact_text(state: &AppState, workspace: &WorkspaceId, id: &str) -> ApiResult<String> {
    let missing = || ApiError::not_found(format!("artifact {id} not found"));
    // One byte past the limit tells "too large" from "exactly at the limit".
    let limit = i64::try_from(MAX_DOCUMENT_BYTES + 1).unwrap_or(i64::MAX);
    let read = match state.stores().artifacts.read(id, 0, Some(limit)).await {
        Ok(read) => read,
        Err(StoreError::NotFound(_)) => return Err(missing()),
        Err(e) => return Err(e.into()),
    };
    if read.artifact.workspace_id != *workspace {
        return Err(missing());
    }
    let Some(bytes) = read.content else {
        return Err(ApiError::invalid(format!(
            "artifact {id} has no content stored by the host (storage `{}`); upload its text instead",
            read.artifact.storage_type
        )));
    };
    if bytes.len() > MAX_DOCUMENT_BYTES {
        return Err(ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("artifact {id} is larger than the {MAX_DOCUMENT_BYTES}-byte document limit"),
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        ApiError::invalid(format!(
            "artifact {id} is not UTF-8 text (invalid byte at offset {}); only text can be indexed",
            e.utf8_error().valid_up_to()
        ))
    })
}

// ---------------------------------------------------------------------------------------
// Reading one, editing and deleting (see the module docs).

/// What an agent refers to, for the referrer check of deletes and tool renames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reference<'a> {
    /// A model, by id.
    Model(&'a str),
    /// A tool, by name.
    Tool(&'a str),
    /// A knowledge base, by id.
    KnowledgeBase(&'a str),
}

/// `true` when `value` holds the string `needle` anywhere (object values, array items).
fn mentions(value: &Value, needle: &str) -> bool {
    match value {
        Value::String(s) => s == needle,
        Value::Array(items) => items.iter().any(|v| mentions(v, needle)),
        Value::Object(map) => map.values().any(|v| mentions(v, needle)),
        _ => false,
    }
}

/// The names of the `agents` that refer to `reference` (pure; see the module docs): a tool
/// through `resource_policy.allowed_tool_names`; a model or knowledge base through its id
/// anywhere in `resource_policy` or `runner_config` (ids are UUIDs, so a match is a
/// reference, never a coincidence).
#[must_use]
pub fn referrers(agents: &[AgentRow], reference: Reference<'_>) -> Vec<String> {
    agents
        .iter()
        .filter(|agent| match reference {
            Reference::Tool(name) => agent
                .resource_policy
                .get("allowed_tool_names")
                .is_some_and(|names| mentions(names, name)),
            Reference::Model(id) | Reference::KnowledgeBase(id) => {
                mentions(&agent.resource_policy, id) || mentions(&agent.runner_config, id)
            }
        })
        .map(|agent| agent.name.clone())
        .collect()
}

/// Refuses with `409 conflict` when an agent of the caller's workspace refers to
/// `reference`; `doing` says what was refused ("delete model m1").
async fn refuse_if_referenced(
    state: &AppState,
    caller: &Caller,
    reference: Reference<'_>,
    doing: &str,
) -> ApiResult<()> {
    let agents = state.stores().agents.list(&caller.workspace_id).await?;
    let names = referrers(&agents, reference);
    if names.is_empty() {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorCode::Conflict,
        format!(
            "cannot {doing}: agent(s) {} refer to it; change or delete them first",
            names.join(", ")
        ),
    ))
}

/// The current fields of a registration as a create body (an object), with `patch` on
/// top: top-level keys replace, so `null` clears an optional field.
fn merged<T: serde::de::DeserializeOwned>(
    current: Value,
    patch: Map<String, Value>,
) -> ApiResult<T> {
    let mut body = match current {
        Value::Object(map) => map,
        _ => return Err(ApiError::internal("registration is not an object")),
    };
    body.extend(patch);
    from_body(&Value::Object(body))
}

/// Reads a merged body exactly as the create route reads its request body (same
/// extractor, so the same refusal texts naming the field).
pub(crate) fn from_body<T: serde::de::DeserializeOwned>(body: &Value) -> ApiResult<T> {
    let bytes = serde_json::to_vec(body).map_err(ApiError::internal)?;
    axum::Json::<T>::from_bytes(&bytes)
        .map(|axum::Json(value)| value)
        .map_err(ApiError::from)
}

/// A missing resource of `what` with path id `id`: the store's `not_found` worded for the
/// API.
fn missing(what: &str, id: &str) -> impl FnOnce(StoreError) -> ApiError {
    let message = format!("{what} {id} not found");
    move |e| match e {
        StoreError::NotFound(_) => ApiError::not_found(message),
        e => e.into(),
    }
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

/// `GET /v1/knowledge-bases/{kb_id}/documents`: its documents, oldest first.
#[utoipa::path(
    get,
    path = "/v1/knowledge-bases/{kb_id}/documents",
    tag = "resources",
    params(("kb_id" = String, Path, description = "Knowledge base id"), PageQuery),
    responses(
        (status = 200, description = "The knowledge base's documents", body = ListPage<DocumentView>),
        (status = 404, description = "no such knowledge base in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn list_documents(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(kb_id): ApiPath<String>,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ApiResult<ApiJson<ListPage<DocumentView>>> {
    let kb_uuid: Uuid = parse_id("knowledge base", &kb_id)?;
    let rows = state
        .stores()
        .resources
        .list_documents(&caller.workspace_id, kb_uuid)
        .await
        .map_err(missing("knowledge base", &kb_id))?;
    let items: Vec<DocumentView> = rows.into_iter().map(DocumentView::from).collect();
    Ok(ApiJson(page_by_key(
        items,
        |d| d.document_id,
        q.cursor.as_deref(),
        state.page_limit(q.limit),
    )?))
}

/// Body of `PATCH /v1/knowledge-bases/{kb_id}/documents/{id}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EditDocument {
    /// Title returned with every hit.
    pub title: String,
    /// Metadata object (`null` clears it).
    #[serde(default)]
    pub metadata: Option<Map<String, Value>>,
}

/// `PATCH /v1/knowledge-bases/{kb_id}/documents/{id}` (`title`, `metadata`): the updated
/// document. Its text is not editable (`400` for `text` or `artifact_id`).
#[utoipa::path(
    patch,
    path = "/v1/knowledge-bases/{kb_id}/documents/{id}",
    tag = "resources",
    params(("kb_id" = String, Path, description = "Knowledge base id"), ("id" = String, Path, description = "Document id")),
    request_body(content = Object, description = "Fields of `AddDocument` to change"),
    responses(
        (status = 200, description = "The changed document", body = DocumentView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 404, description = "no such document in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn update_document(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath((kb_id, id)): ApiPath<(String, String)>,
    ApiJson(patch): ApiJson<Map<String, Value>>,
) -> ApiResult<ApiJson<DocumentView>> {
    let kb_uuid: Uuid = parse_id("knowledge base", &kb_id)?;
    let document_id: Uuid = parse_id("document", &id)?;
    if let Some(field) = ["text", "artifact_id"]
        .into_iter()
        .find(|f| patch.contains_key(*f))
    {
        return Err(ApiError::invalid(format!(
            "invalid `{field}`: a document's text cannot be changed; delete the document and add the new text"
        )));
    }
    let resources = &state.stores().resources;
    let current = resources
        .list_documents(&caller.workspace_id, kb_uuid)
        .await
        .map_err(missing("knowledge base", &kb_id))?
        .into_iter()
        .find(|d| d.document_id == document_id)
        .ok_or_else(|| ApiError::not_found(format!("document {id} not found")))?;
    let body: EditDocument = merged(
        json!({"title": current.title, "metadata": current.metadata}),
        patch,
    )?;
    let row = resources
        .update_document(
            &caller.workspace_id,
            kb_uuid,
            document_id,
            DocumentEdit {
                title: body.title,
                metadata: body.metadata.map_or(Value::Null, Value::Object),
            },
        )
        .await
        .map_err(missing("document", &id))?;
    tracing::info!(%kb_uuid, %document_id, "document updated");
    Ok(ApiJson(row.into()))
}

/// `DELETE /v1/knowledge-bases/{kb_id}/documents/{id}`: `204`; its chunks leave the index
/// with it.
#[utoipa::path(
    delete,
    path = "/v1/knowledge-bases/{kb_id}/documents/{id}",
    tag = "resources",
    params(("kb_id" = String, Path, description = "Knowledge base id"), ("id" = String, Path, description = "Document id")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "no such document in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn delete_document(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath((kb_id, id)): ApiPath<(String, String)>,
) -> ApiResult<StatusCode> {
    let kb_uuid: Uuid = parse_id("knowledge base", &kb_id)?;
    let document_id: Uuid = parse_id("document", &id)?;
    if state
        .stores()
        .resources
        .delete_document(&caller.workspace_id, kb_uuid, document_id)
        .await?
    {
        tracing::info!(%kb_uuid, %document_id, "document deleted");
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("document {id} not found")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(name: &str, policy: Value, runner_config: Value) -> AgentRow {
        AgentRow {
            id: sb_protocol::ids::AgentId::new(),
            workspace_id: WorkspaceId::default_workspace(),
            name: name.into(),
            description: None,
            runner_id: "plugin:x/y".into(),
            runner_config,
            event_types: json!([]),
            scope: json!({}),
            bot_id: None,
            channel: None,
            conversation_id: None,
            actor_id: None,
            filters: json!([]),
            resource_policy: policy,
            state_policy: json!({}),
            delivery_policy: json!({}),
            budgets: json!({}),
            enabled: true,
            routing: Default::default(),
            created_at: chrono::Utc::now(),
            updated_at: chrono::Utc::now(),
        }
    }

    #[test]
    fn referrers_find_grants_and_runner_config_ids() {
        let model = "0190c3a0-0000-7000-8000-000000000001";
        let kb = "0190c3a0-0000-7000-8000-000000000002";
        let agents = [
            agent(
                "granted",
                json!({"allowed_model_uuids": [model]}),
                json!({}),
            ),
            agent("primary", json!({}), json!({"model": {"primary": model}})),
            agent(
                "tools",
                json!({"allowed_tool_names": ["weather"], "allowed_kb_uuids": [kb]}),
                json!({"prompt": "weather"}),
            ),
        ];
        assert_eq!(
            referrers(&agents, Reference::Model(model)),
            ["granted", "primary"]
        );
        assert_eq!(referrers(&agents, Reference::KnowledgeBase(kb)), ["tools"]);
        assert_eq!(referrers(&agents, Reference::Tool("weather")), ["tools"]);
        // A tool is referred to by its grant only, not by a word in a prompt.
        let prompt_only = [agent("p", json!({}), json!({"prompt": "weather"}))];
        assert!(referrers(&prompt_only, Reference::Tool("weather")).is_empty());
        assert!(referrers(&agents, Reference::Tool("calendar")).is_empty());
    }
}
