//! Bearer API keys on every `/v1` route.
//!
//! [`require_api_key`] (a `from_fn_with_state` middleware) reads `Authorization: Bearer
//! <key>`, asks [`Tenancy::authenticate`](sb_store::agents::Tenancy::authenticate) which
//! workspace the key belongs to, and stores a [`Caller`] in the request extensions;
//! handlers take the [`Caller`] extractor. Every read and write is scoped by
//! `Caller::workspace_id`, so a key never sees another workspace's data (resources of
//! other workspaces are reported as missing, not forbidden).

use axum::extract::{FromRequestParts, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::Response;
use sb_protocol::ids::WorkspaceId;

use crate::error::ApiError;
use crate::state::AppState;

/// Longest accepted key; anything longer is not one of ours and is refused without a
/// database lookup.
const MAX_KEY_LEN: usize = 256;

/// The authenticated caller of a `/v1` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The workspace the API key belongs to.
    pub workspace_id: WorkspaceId,
}

/// The bearer token of an `Authorization` header value, if well-formed. The scheme is
/// case-insensitive (RFC 9110 §11.1).
pub fn bearer_token(header: &str) -> Option<&str> {
    let (scheme, token) = header.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = token.trim();
    (!token.is_empty() && token.len() <= MAX_KEY_LEN && token.bytes().all(|b| b.is_ascii_graphic()))
        .then_some(token)
}

/// Middleware: authenticates the request or answers `401 unauthorized`.
pub async fn require_api_key(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let token = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .ok_or_else(ApiError::unauthorized)?;
    let workspace_id = state
        .stores()
        .tenancy
        .authenticate(token)
        .await?
        .ok_or_else(ApiError::unauthorized)?;
    request.extensions_mut().insert(Caller { workspace_id });
    Ok(next.run(request).await)
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        // Missing only if a route was mounted outside the authenticated router: a bug, and
        // refusing is the safe answer.
        parts
            .extensions
            .get::<Caller>()
            .cloned()
            .ok_or_else(ApiError::unauthorized)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bearer_tokens() {
        assert_eq!(bearer_token("Bearer sb_abc"), Some("sb_abc"));
        assert_eq!(bearer_token("bearer sb_abc"), Some("sb_abc"));
        assert_eq!(bearer_token("Bearer   sb_abc  "), Some("sb_abc"));
        assert_eq!(bearer_token("Basic dXNlcjpwYXNz"), None);
        assert_eq!(bearer_token("Bearer"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("Bearer a b"), None);
        assert_eq!(bearer_token(&format!("Bearer {}", "k".repeat(257))), None);
    }
}
