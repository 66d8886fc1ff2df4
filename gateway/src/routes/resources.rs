//! The workspace resource registry (SPEC §8): `POST/GET /v1/models`, `POST/GET /v1/tools`,
//! `POST/GET /v1/knowledge-bases`, `POST /v1/knowledge-bases/{kb_id}/documents`.
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

use super::{Items, epoch, parse_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiResult};
use crate::state::AppState;

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
#[derive(Debug, Deserialize)]
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
#[derive(Debug, Serialize)]
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

/// `POST /v1/models` → `201`.
pub async fn create_model(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CreateModel>,
) -> ApiResult<impl IntoResponse> {
    check_egress(&state, "base_url", &body.base_url)?;
    if let Some(env) = body.api_key_env.as_deref() {
        check_secret(&state, "api_key_env", env)?;
    }
    let row = state
        .stores()
        .resources
        .create_model(NewModel {
            workspace_id: caller.workspace_id,
            name: body.name,
            kind: body.kind,
            base_url: body.base_url,
            model_name: body.model_name,
            api_key_env: body.api_key_env,
            context_window: body.context_window,
            extra_args: body.extra_args.map(Value::Object),
        })
        .await?;
    tracing::info!(model_id = %row.model_id, kind = row.kind.as_str(), "model registered");
    Ok((StatusCode::CREATED, ApiJson(ModelView::from(row))))
}

/// `GET /v1/models`.
pub async fn list_models(
    State(state): State<AppState>,
    caller: Caller,
) -> ApiResult<ApiJson<Items<ModelView>>> {
    let rows = state
        .stores()
        .resources
        .list_models(&caller.workspace_id)
        .await?;
    Ok(ApiJson(Items {
        items: rows.into_iter().map(ModelView::from).collect(),
    }))
}

/// Body of `POST /v1/tools`.
#[derive(Debug, Deserialize)]
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
#[derive(Debug, Serialize)]
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

/// `POST /v1/tools` → `201`.
pub async fn create_tool(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CreateTool>,
) -> ApiResult<impl IntoResponse> {
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
    check_egress(&state, "url", &body.url)?;
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
        check_secret(&state, &format!("headers_env.{header}"), env)?;
    }
    let parameters = body
        .parameters
        .map(Value::Object)
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
    let row = state
        .stores()
        .resources
        .create_tool(NewTool {
            workspace_id: caller.workspace_id,
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
        .await?;
    tracing::info!(tool = %row.name, "tool registered");
    Ok((StatusCode::CREATED, ApiJson(ToolView::from(row))))
}

/// `GET /v1/tools`.
pub async fn list_tools(
    State(state): State<AppState>,
    caller: Caller,
) -> ApiResult<ApiJson<Items<ToolView>>> {
    let rows = state
        .stores()
        .resources
        .list_tools(&caller.workspace_id)
        .await?;
    Ok(ApiJson(Items {
        items: rows.into_iter().map(ToolView::from).collect(),
    }))
}

/// Body of `POST /v1/knowledge-bases`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateKnowledgeBase {
    /// Unique in the workspace.
    pub name: String,
    /// Free text.
    #[serde(default)]
    pub description: Option<String>,
}

/// A knowledge base on the wire.
#[derive(Debug, Serialize)]
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
pub async fn list_kbs(
    State(state): State<AppState>,
    caller: Caller,
) -> ApiResult<ApiJson<Items<KnowledgeBaseView>>> {
    let rows = state
        .stores()
        .resources
        .list_kbs(&caller.workspace_id)
        .await?;
    Ok(ApiJson(Items {
        items: rows.into_iter().map(KnowledgeBaseView::from).collect(),
    }))
}

/// Body of `POST /v1/knowledge-bases/{kb_id}/documents`: exactly one of `text` and
/// `artifact_id`.
#[derive(Debug, Deserialize)]
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
#[derive(Debug, Serialize)]
pub struct DocumentView {
    document_id: Uuid,
    kb_id: Uuid,
    title: String,
    size_bytes: i64,
    sha256: String,
    chunks: u64,
    artifact_id: Option<String>,
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
