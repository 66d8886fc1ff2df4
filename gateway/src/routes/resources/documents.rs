//! Documents of a knowledge base: `POST/GET /v1/knowledge-bases/{kb_id}/documents`, `PATCH/DELETE` of each.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use sb_protocol::error::ErrorCode;
use sb_protocol::ids::WorkspaceId;
use sb_store::resources::MAX_DOCUMENT_BYTES;
use sb_store::{KbDocumentRecord, NewKbDocument, StoreError};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::shared::{merged, missing};
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::routes::{ListPage, PageQuery, epoch, page_by_key, parse_id};
use crate::state::AppState;
use sb_store::DocumentEdit;

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
