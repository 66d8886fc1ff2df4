//! `GET/POST /v1/keys`, `DELETE /v1/keys/{id}`: the API keys of the caller's workspace
//! (SPEC §14). Admin routes, like everything that changes who may do what.
//!
//! Only a key's SHA-256 is stored, so a key's secret is in exactly one answer: the `201` of
//! its creation. Listings show the prefix that tells keys apart, never a hash.
//!
//! Revoking writes the ledger, then announces the revocation to every gateway sharing the
//! session store ([`crate::auth::announce_revocation`]): the key is refused from the next
//! request on, on every gateway. If the announcement cannot be made, the answer is `503`:
//! the key is revoked in the ledger (and refused by every gateway within
//! [`crate::auth::KEY_CACHE_MAX_AGE`]), and repeating the `DELETE` announces again. An admin
//! key may revoke itself; its next request is refused like any other.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use sb_protocol::error::ErrorCode;
use sb_store::{ApiKeyRecord, ApiKeyRole};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{ListPage, PageQuery, epoch, page_by_key, parse_id};
use crate::auth::{Caller, announce_revocation};
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::state::AppState;

/// Body of `POST /v1/keys`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateKey {
    /// Label, to tell keys apart in listings (at most 255 characters).
    #[serde(default)]
    pub name: Option<String>,
    /// `client` or `admin`. Required: what a new key may do is never implied.
    pub role: ApiKeyRole,
}

/// A key as listed (no secret, no hash).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct KeyView {
    /// Key id (`DELETE /v1/keys/{key_id}`).
    pub key_id: Uuid,
    /// Label.
    pub name: Option<String>,
    /// `client` or `admin`.
    pub role: ApiKeyRole,
    /// The first characters of the key.
    pub prefix: String,
    /// Epoch seconds.
    pub created_at: i64,
    /// Epoch seconds; absent while the key is valid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<i64>,
    /// The key this request was made with.
    pub current: bool,
}

impl KeyView {
    fn new(record: ApiKeyRecord, caller: &Caller) -> Self {
        Self {
            current: record.id == caller.key_id,
            key_id: record.id,
            name: record.name,
            role: record.role,
            prefix: record.prefix,
            created_at: epoch(record.created_at),
            revoked_at: record.revoked_at.map(epoch),
        }
    }
}

/// `201` body of `POST /v1/keys`: the key, shown this once.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct CreatedKey {
    /// The secret (`Authorization: Bearer <key>`). Not stored; not shown again.
    pub key: String,
    /// The stored key.
    #[serde(flatten)]
    pub view: KeyView,
}

/// `GET /v1/keys`: the workspace's keys, revoked ones included, oldest first.
#[utoipa::path(
    get,
    path = "/v1/keys",
    tag = "keys",
    params(PageQuery),
    responses(
        (status = 200, description = "The workspace's keys, revoked ones included, oldest first", body = ListPage<KeyView>),
    )
)]
pub async fn list_keys(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ApiResult<ApiJson<ListPage<KeyView>>> {
    let keys = state
        .stores()
        .tenancy
        .list_api_keys(&caller.workspace_id)
        .await?;
    let items: Vec<KeyView> = keys
        .into_iter()
        .map(|record| KeyView::new(record, &caller))
        .collect();
    Ok(ApiJson(page_by_key(
        items,
        |k| (k.created_at, k.key_id),
        q.cursor.as_deref(),
        state.page_limit(q.limit),
    )?))
}

/// `POST /v1/keys`: `201` with the new key's secret.
#[utoipa::path(
    post,
    path = "/v1/keys",
    tag = "keys",
    request_body = CreateKey,
    responses(
        (status = 201, description = "The new key with its secret (shown only once)", body = CreatedKey),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn create_key(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CreateKey>,
) -> ApiResult<impl IntoResponse> {
    let name = body
        .name
        .as_deref()
        .map(str::trim)
        .filter(|n| !n.is_empty());
    let created = state
        .stores()
        .tenancy
        .create_api_key(&caller.workspace_id, name, body.role)
        .await?;
    tracing::info!(
        key_id = %created.record.id,
        prefix = %created.record.prefix,
        role = %created.record.role,
        workspace = %caller.workspace_id,
        by = %caller.key_id,
        "api key created"
    );
    Ok((
        StatusCode::CREATED,
        ApiJson(CreatedKey {
            key: created.plaintext,
            view: KeyView::new(created.record, &caller),
        }),
    ))
}

/// `DELETE /v1/keys/{id}`: `204` once the key is revoked and every gateway told; `404` for
/// a key that is not the workspace's; `503` when the revocation is recorded but could not be
/// announced (see the module docs). Revoking a revoked key announces again and answers `204`.
#[utoipa::path(
    delete,
    path = "/v1/keys/{id}",
    tag = "keys",
    params(("id" = String, Path, description = "Key id")),
    responses(
        (status = 204, description = "Revoked"),
        (status = 404, description = "no such key in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn revoke_key(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    let key_id: Uuid = parse_id("api key", &id)?;
    let tenancy = &state.stores().tenancy;
    if tenancy
        .get_api_key(&caller.workspace_id, key_id)
        .await?
        .is_none()
    {
        return Err(ApiError::not_found(format!("api key {id} not found")));
    }
    let revoked_now = tenancy.revoke(&caller.workspace_id, key_id).await?;
    announce_revocation(state.sessions().as_ref())
        .await
        .map_err(|e| {
            tracing::error!(error = %e, %key_id, "api key revoked in the ledger but the revocation could not be announced");
            ApiError::new(
                ErrorCode::Unavailable,
                "the key is revoked, but the gateways could not all be told yet; repeat the \
                 request to make it effective at once (otherwise it is within a minute)",
            )
        })?;
    if revoked_now {
        tracing::info!(%key_id, workspace = %caller.workspace_id, by = %caller.key_id, "api key revoked");
    }
    Ok(StatusCode::NO_CONTENT)
}
