//! `POST /v1/artifacts`, `GET /v1/artifacts/{id}`, `GET /v1/artifacts/{id}/content`
//! (SPEC §9, §10.1; issue 14).
//!
//! # Upload
//!
//! Two body forms, chosen by `Content-Type`:
//!
//! - `application/json`: [`UploadRequest`], the bytes as `content_base64` (standard alphabet,
//!   padded);
//! - `multipart/form-data`: a `file` part with the bytes (its file name and content type
//!   become `name` and `mime_type` unless given as parts), and optional text parts `name`,
//!   `mime_type`, `artifact_type`, `sha256`, `conversation_id`, `expires_at` (RFC 3339) and
//!   `metadata` (a JSON object).
//!
//! The content is capped at `limits.artifact_upload_bytes` (`413 payload_too_large`); the
//! route's body limit is that cap plus the base64 and envelope overhead
//! ([`upload_body_limit`]) instead of `gateway.max_body_bytes`. A declared `sha256` (and the
//! decoded size) is verified by the store before anything is written: a mismatch is `400`.
//! The artifact belongs to the caller's workspace, `source: "api"`, scope `workspace`.
//!
//! # Download
//!
//! Artifacts are read in the caller's workspace only: another workspace's id, an expired
//! artifact and a malformed id all answer `404`, alike. Runner-made artifacts (`artifact.created`
//! results and the Host API's artifact actions) are the same rows and download the same way.
//! `…/content` serves the stored bytes with `Content-Type` (the artifact's MIME type, else
//! `application/octet-stream`), `Content-Length`, `Accept-Ranges: bytes` and an `ETag` of the
//! sha256. A single `Range: bytes=…` is answered `206` with `Content-Range`; an unsatisfiable
//! or malformed range, or several ranges, `416` with `Content-Range: bytes */<size>` (the
//! RFC 9110 answer; the body is the usual error shape). Only content the host stores can be
//! downloaded: an artifact known by URL or platform reference answers `404` here, its
//! metadata names the reference (`storage_key`).

use axum::body::Body;
use axum::extract::{FromRequest, Multipart, Request, State};
use axum::http::StatusCode;
use axum::http::header::{
    ACCEPT_RANGES, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, ETAG, HeaderMap, HeaderValue, RANGE,
};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use chrono::{DateTime, Utc};
use sb_store::artifacts::MAX_ARTIFACT_READ_BYTES;
use sb_store::{ArtifactRecord, ArtifactScope, NewArtifact};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::epoch;
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiResult};
use crate::state::AppState;

/// The upload route (its body limit is [`upload_body_limit`], not `gateway.max_body_bytes`).
pub const UPLOAD_PATH: &str = "/v1/artifacts";

/// Room for the JSON or multipart envelope around the content.
const ENVELOPE_BYTES: usize = 64 * 1024;

/// The body limit of `POST /v1/artifacts` for a content cap of `content_max` bytes: the
/// base64 form of that much content plus `ENVELOPE_BYTES`.
#[must_use]
pub fn upload_body_limit(content_max: usize) -> usize {
    content_max
        .div_ceil(3)
        .saturating_mul(4)
        .saturating_add(ENVELOPE_BYTES)
}

/// JSON body of `POST /v1/artifacts`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadRequest {
    /// The content, base64 (standard alphabet, padded).
    pub content_base64: String,
    /// File name.
    #[serde(default)]
    pub name: Option<String>,
    /// MIME type (also accepted as `content_type`).
    #[serde(default, alias = "content_type")]
    pub mime_type: Option<String>,
    /// `file` (default), `image`, `document`, … (≤ 50 chars).
    #[serde(default)]
    pub artifact_type: Option<String>,
    /// Lower-case hex sha256 of the content; verified when given.
    #[serde(default)]
    pub sha256: Option<String>,
    /// Conversation the artifact belongs to.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// A JSON object kept with the artifact.
    #[serde(default)]
    pub metadata: Option<Value>,
    /// After this instant (RFC 3339) the artifact is gone.
    #[serde(default)]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub expires_at: Option<DateTime<Utc>>,
}

/// An artifact as the API shows it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ArtifactView {
    /// Id.
    pub artifact_id: String,
    /// `file`, `image`, …
    pub artifact_type: String,
    /// MIME type.
    pub mime_type: Option<String>,
    /// File name.
    pub name: Option<String>,
    /// Size in bytes.
    pub size_bytes: Option<i64>,
    /// Lower-case hex sha256 (verified for stored content).
    pub sha256: Option<String>,
    /// `api`, `runner`, `platform`, …
    pub source: String,
    /// `workspace`, `conversation`, `run` or `runner`.
    pub scope: ArtifactScope,
    /// `inline` (downloadable from `…/content`), `url`, `platform_ref` or `metadata_only`.
    pub storage_type: String,
    /// The URL or platform reference of content the host does not store.
    pub storage_key: Option<String>,
    /// Conversation.
    pub conversation_id: Option<String>,
    /// The run that made it.
    pub run_id: Option<String>,
    /// The runner that made it.
    pub runner_id: Option<String>,
    /// Metadata object.
    pub metadata: Value,
    /// Epoch seconds.
    pub expires_at: Option<i64>,
    /// Epoch seconds.
    pub created_at: i64,
}

impl From<ArtifactRecord> for ArtifactView {
    fn from(a: ArtifactRecord) -> Self {
        Self {
            artifact_id: a.id,
            artifact_type: a.artifact_type,
            mime_type: a.mime_type,
            name: a.name,
            size_bytes: a.size_bytes,
            sha256: a.sha256,
            source: a.source,
            scope: a.scope,
            storage_type: a.storage_type,
            storage_key: a.storage_key,
            conversation_id: a.conversation_id,
            run_id: a.run_id.map(|r| r.to_string()),
            runner_id: a.runner_id,
            metadata: a.metadata,
            expires_at: a.expires_at.map(epoch),
            created_at: epoch(a.created_at),
        }
    }
}

/// What an upload carries besides its bytes.
#[derive(Debug, Default)]
struct UploadFields {
    name: Option<String>,
    mime_type: Option<String>,
    artifact_type: Option<String>,
    sha256: Option<String>,
    conversation_id: Option<String>,
    metadata: Option<Value>,
    expires_at: Option<DateTime<Utc>>,
}

fn too_large(max: usize) -> ApiError {
    ApiError::new(
        sb_protocol::error::ErrorCode::PayloadTooLarge,
        format!("artifact content is larger than {max} bytes (limits.artifact_upload_bytes)"),
    )
}

/// `POST /v1/artifacts`: `201` with the stored artifact.
#[utoipa::path(
    post,
    path = "/v1/artifacts",
    tag = "artifacts",
    request_body(
        description = "JSON with base64 `content`, or `multipart/form-data` with a `file` part",
        content((UploadRequest = "application/json"), ("multipart/form-data"))
    ),
    responses(
        (status = 201, description = "The stored artifact", body = ArtifactView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 413, description = "`payload_too_large`: over the upload cap", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn upload(
    State(state): State<AppState>,
    caller: Caller,
    request: Request,
) -> ApiResult<(StatusCode, ApiJson<ArtifactView>)> {
    let max = state.options().artifact_upload_bytes;
    let content_type = request
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let (bytes, fields) = if content_type.starts_with("multipart/form-data") {
        let multipart = Multipart::from_request(request, &state)
            .await
            .map_err(|e| ApiError::invalid(format!("invalid multipart body: {}", e.body_text())))?;
        read_multipart(multipart, max).await?
    } else if content_type.starts_with("application/json") {
        let ApiJson(body) = ApiJson::<UploadRequest>::from_request(request, &state).await?;
        let bytes = decode_base64(&body.content_base64, max)?;
        let fields = UploadFields {
            name: body.name,
            mime_type: body.mime_type,
            artifact_type: body.artifact_type,
            sha256: body.sha256,
            conversation_id: body.conversation_id,
            metadata: body.metadata,
            expires_at: body.expires_at,
        };
        (bytes, fields)
    } else {
        return Err(ApiError::invalid(
            "expected `Content-Type: application/json` (with `content_base64`) or \
             `multipart/form-data` (with a `file` part)",
        ));
    };
    if let Some(metadata) = &fields.metadata {
        if !metadata.is_object() {
            return Err(ApiError::invalid("`metadata` must be a JSON object"));
        }
    }
    if fields.expires_at.is_some_and(|at| at <= Utc::now()) {
        return Err(ApiError::invalid("`expires_at` must be in the future"));
    }
    let mut artifact = NewArtifact::inline(
        caller.workspace_id.clone(),
        fields.artifact_type.unwrap_or_else(|| "file".to_owned()),
        "api",
        ArtifactScope::Workspace,
        bytes,
    );
    artifact.name = fields.name;
    artifact.mime_type = fields.mime_type;
    artifact.conversation_id = fields.conversation_id;
    artifact.declared_sha256 = fields.sha256;
    artifact.expires_at = fields.expires_at;
    if let Some(metadata) = fields.metadata {
        artifact.metadata = metadata;
    }
    let stored = state.stores().artifacts.put(artifact).await?;
    Ok((StatusCode::CREATED, ApiJson(stored.into())))
}

/// Decodes `content_base64`, refusing more than `max` decoded bytes before decoding.
fn decode_base64(encoded: &str, max: usize) -> ApiResult<Vec<u8>> {
    // Each 4 characters decode to at most 3 bytes.
    if encoded.len().div_ceil(4).saturating_mul(3) > max.saturating_add(2) {
        return Err(too_large(max));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|e| ApiError::invalid(format!("`content_base64` is not valid base64: {e}")))?;
    if bytes.len() > max {
        return Err(too_large(max));
    }
    Ok(bytes)
}

/// Reads a multipart upload: the `file` part (at most `max` bytes, counted as it streams)
/// and the text fields.
async fn read_multipart(
    mut multipart: Multipart,
    max: usize,
) -> ApiResult<(Vec<u8>, UploadFields)> {
    let bad = |e: axum::extract::multipart::MultipartError| {
        ApiError::invalid(format!("invalid multipart body: {}", e.body_text()))
    };
    let mut bytes: Option<Vec<u8>> = None;
    let mut fields = UploadFields::default();
    let mut file_name = None;
    let mut file_type = None;
    while let Some(mut field) = multipart.next_field().await.map_err(bad)? {
        let name = field.name().unwrap_or("").to_owned();
        if name == "file" {
            if bytes.is_some() {
                return Err(ApiError::invalid("more than one `file` part"));
            }
            file_name = field.file_name().map(str::to_owned);
            file_type = field.content_type().map(str::to_owned);
            let mut content = Vec::new();
            while let Some(chunk) = field.chunk().await.map_err(bad)? {
                if content.len() + chunk.len() > max {
                    return Err(too_large(max));
                }
                content.extend_from_slice(&chunk);
            }
            bytes = Some(content);
            continue;
        }
        let text = field.text().await.map_err(bad)?;
        match name.as_str() {
            "name" => fields.name = Some(text),
            "mime_type" | "content_type" => fields.mime_type = Some(text),
            "artifact_type" => fields.artifact_type = Some(text),
            "sha256" => fields.sha256 = Some(text),
            "conversation_id" => fields.conversation_id = Some(text),
            "metadata" => {
                fields.metadata = Some(serde_json::from_str(&text).map_err(|e| {
                    ApiError::invalid(format!("the `metadata` part is not JSON: {e}"))
                })?);
            }
            "expires_at" => {
                fields.expires_at = Some(
                    DateTime::parse_from_rfc3339(&text)
                        .map_err(|e| {
                            ApiError::invalid(format!("the `expires_at` part is not RFC 3339: {e}"))
                        })?
                        .with_timezone(&Utc),
                );
            }
            other => {
                return Err(ApiError::invalid(format!(
                    "unknown multipart part `{other}` (expected file, name, mime_type, \
                     artifact_type, sha256, conversation_id, metadata, expires_at)"
                )));
            }
        }
    }
    let bytes = bytes.ok_or_else(|| ApiError::invalid("missing the `file` part"))?;
    fields.name = fields.name.or(file_name);
    fields.mime_type = fields.mime_type.or(file_type);
    Ok((bytes, fields))
}

/// The artifact `id` of the caller's workspace, or `404` (missing, expired or another
/// workspace's, alike).
async fn load(state: &AppState, caller: &Caller, id: &str) -> ApiResult<ArtifactRecord> {
    let not_found = || ApiError::not_found(format!("artifact {id} not found"));
    match state.stores().artifacts.metadata(id).await {
        Ok(artifact) if artifact.workspace_id == caller.workspace_id => Ok(artifact),
        Ok(_) => Err(not_found()),
        Err(sb_store::StoreError::NotFound(_) | sb_store::StoreError::InvalidArgument(_)) => {
            Err(not_found())
        }
        Err(e) => Err(e.into()),
    }
}

/// `GET /v1/artifacts/{id}`: the artifact's metadata.
#[utoipa::path(
    get,
    path = "/v1/artifacts/{id}",
    tag = "artifacts",
    params(("id" = String, Path, description = "Artifact id")),
    responses(
        (status = 200, description = "The artifact's metadata", body = ArtifactView),
        (status = 404, description = "no such artifact in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn get_artifact(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<ApiJson<ArtifactView>> {
    Ok(ApiJson(load(&state, &caller, &id).await?.into()))
}

/// What a `Range` header asks of content of `size` bytes. Pure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RangeAnswer {
    /// No `Range`: all of it, `200`.
    Full,
    /// One satisfiable range, inclusive bounds: `206`.
    Partial(u64, u64),
    /// Malformed, unsatisfiable or several ranges: `416`.
    Unsatisfiable(&'static str),
}

/// The answer to `range` (the header's value, if any) for `size` bytes.
#[must_use]
pub fn answer_range(range: Option<&str>, size: u64) -> RangeAnswer {
    let Some(range) = range else {
        return RangeAnswer::Full;
    };
    if size == 0 {
        // RFC 9110: no range of empty content is satisfiable.
        return RangeAnswer::Unsatisfiable("the content is empty");
    }
    let ranges = match http_range_header::parse_range_header(range)
        .and_then(|parsed| parsed.validate(size))
    {
        Ok(ranges) => ranges,
        Err(_) => {
            return RangeAnswer::Unsatisfiable("the range is malformed or outside the content");
        }
    };
    match ranges.as_slice() {
        [one] => RangeAnswer::Partial(*one.start(), *one.end()),
        _ => RangeAnswer::Unsatisfiable("only a single range is served"),
    }
}

/// `GET /v1/artifacts/{id}/content`: the stored bytes, all or one range.
#[utoipa::path(
    get,
    path = "/v1/artifacts/{id}/content",
    tag = "artifacts",
    params(("id" = String, Path, description = "Artifact id"), ("Range" = Option<String>, Header, description = "One byte range, `bytes=first-last`")),
    responses(
        (status = 200, description = "The content", body = Vec<u8>, content_type = "application/octet-stream"),
        (status = 206, description = "The requested range", body = Vec<u8>, content_type = "application/octet-stream"),
        (status = 416, description = "The range is outside the content", body = crate::error::ErrorBody<'static>),
        (status = 404, description = "no such artifact in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn content(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let artifact = load(&state, &caller, &id).await?;
    if artifact.storage_type != "inline" {
        return Err(ApiError::not_found(format!(
            "artifact {id} has no content stored here (its {} is in `storage_key`)",
            artifact.storage_type
        )));
    }
    let size = u64::try_from(artifact.size_bytes.unwrap_or(0)).unwrap_or(0);
    let range = headers.get(RANGE).map(|v| v.to_str().unwrap_or("invalid"));
    let (status, start, end) = match answer_range(range, size) {
        RangeAnswer::Full => (StatusCode::OK, 0, size),
        RangeAnswer::Partial(first, last) => (StatusCode::PARTIAL_CONTENT, first, last + 1),
        RangeAnswer::Unsatisfiable(why) => {
            // A plain refusal with its status kept: the error middleware gives it the one
            // error shape (`invalid_argument`) and keeps `Content-Range`.
            let mut response = (
                StatusCode::RANGE_NOT_SATISFIABLE,
                format!("range not satisfiable: {why}"),
            )
                .into_response();
            insert(&mut response, CONTENT_RANGE, format!("bytes */{size}"));
            return Ok(response);
        }
    };
    let bytes = read_range(&state, &id, start, end).await?;
    let mut response = Response::new(Body::from(bytes));
    *response.status_mut() = status;
    let mime = artifact
        .mime_type
        .as_deref()
        .and_then(|m| HeaderValue::from_str(m).ok())
        .unwrap_or_else(|| HeaderValue::from_static("application/octet-stream"));
    response.headers_mut().insert(CONTENT_TYPE, mime);
    insert(&mut response, CONTENT_LENGTH, (end - start).to_string());
    response
        .headers_mut()
        .insert(ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if let Some(sha) = &artifact.sha256 {
        insert(&mut response, ETAG, format!("\"{sha}\""));
    }
    if status == StatusCode::PARTIAL_CONTENT {
        insert(
            &mut response,
            CONTENT_RANGE,
            format!("bytes {start}-{}/{size}", end - 1),
        );
    }
    Ok(response)
}

fn insert(response: &mut Response, name: axum::http::HeaderName, value: String) {
    if let Ok(value) = HeaderValue::from_str(&value) {
        response.headers_mut().insert(name, value);
    }
}

/// Bytes `[start, end)` of the stored content, in reads of at most the store's largest.
async fn read_range(state: &AppState, id: &str, start: u64, end: u64) -> ApiResult<Vec<u8>> {
    let mut out = Vec::with_capacity(usize::try_from(end - start).unwrap_or(0));
    let mut offset = start;
    while offset < end {
        let want = (end - offset).min(MAX_ARTIFACT_READ_BYTES);
        let read = state
            .stores()
            .artifacts
            .read(
                id,
                i64::try_from(offset).unwrap_or(i64::MAX),
                Some(i64::try_from(want).unwrap_or(i64::MAX)),
            )
            .await?;
        let chunk = match read.content {
            Some(chunk) if !chunk.is_empty() => chunk,
            // Deleted or shortened meanwhile: the bytes promised are not there.
            _ => return Err(ApiError::not_found(format!("artifact {id} not found"))),
        };
        offset += chunk.len() as u64;
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_follow_rfc_9110() {
        assert_eq!(answer_range(None, 10), RangeAnswer::Full);
        assert_eq!(
            answer_range(Some("bytes=0-3"), 10),
            RangeAnswer::Partial(0, 3)
        );
        assert_eq!(
            answer_range(Some("bytes=4-"), 10),
            RangeAnswer::Partial(4, 9)
        );
        assert_eq!(
            answer_range(Some("bytes=-3"), 10),
            RangeAnswer::Partial(7, 9)
        );
        // An end past the content is cut to it.
        assert_eq!(
            answer_range(Some("bytes=8-100"), 10),
            RangeAnswer::Partial(8, 9)
        );
        for bad in [
            "bytes=10-",
            "bytes=5-2",
            "items=0-1",
            "bytes=abc",
            "bytes=0-1,4-5",
        ] {
            assert!(
                matches!(answer_range(Some(bad), 10), RangeAnswer::Unsatisfiable(_)),
                "{bad}"
            );
        }
        // Nothing of empty content is satisfiable.
        assert!(matches!(
            answer_range(Some("bytes=0-0"), 0),
            RangeAnswer::Unsatisfiable(_)
        ));
    }

    #[test]
    fn the_upload_body_limit_covers_base64_and_the_envelope() {
        assert_eq!(upload_body_limit(3), 4 + ENVELOPE_BYTES);
        assert_eq!(upload_body_limit(4), 8 + ENVELOPE_BYTES);
        assert!(upload_body_limit(10 * 1024 * 1024) > 10 * 1024 * 1024 * 4 / 3);
    }

    #[test]
    fn base64_over_the_cap_is_refused_before_decoding() {
        let encoded = base64::engine::general_purpose::STANDARD.encode([7u8; 10]);
        assert_eq!(decode_base64(&encoded, 10).unwrap(), vec![7u8; 10]);
        assert_eq!(
            decode_base64(&encoded, 9).unwrap_err().code(),
            sb_protocol::error::ErrorCode::PayloadTooLarge
        );
        assert_eq!(
            decode_base64("not base64!", 100).unwrap_err().code(),
            sb_protocol::error::ErrorCode::InvalidArgument
        );
    }
}
