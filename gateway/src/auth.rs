//! Bearer API keys on every `/v1` route: who the caller is, what its role allows, and the
//! cache that makes an authenticated request cost no database query.
//!
//! [`require_api_key`] (a `from_fn_with_state` middleware) reads `Authorization: Bearer
//! <key>`, resolves the key through the [`KeyCache`] (the ledger's
//! [`Tenancy::authenticate`] on a miss), takes a token of the key's request bucket
//! ([`crate::limits`]) and stores a [`Caller`] in the request extensions; handlers take the
//! [`Caller`] extractor. Every read and write is scoped by `Caller::workspace_id`, so a key
//! never sees another workspace's data (resources of other workspaces are reported as
//! missing, not forbidden). Admin routes are wrapped in [`require_admin`], which answers a
//! `client` key `403 permission_denied` before the handler (and its body extractor) runs.
//!
//! # The key cache and revocation
//!
//! The guarantee: **a revocation is effective on the next request, on every gateway**, however
//! many gateway processes share the database. A per-process cache alone cannot give it, so
//! the cache is tagged with a *revocation epoch* kept in the session store that every
//! gateway of a deployment shares (Redis in cluster mode, memory in embedded mode):
//!
//! ```text
//!  request ─ read epoch (one GET, ─┬─ differs from the cache's ─▶ clear the cache, adopt it
//!            shared: see below)    │
//!                                  └─ cached, younger than KEY_CACHE_MAX_AGE ─▶ answer
//!           miss ─▶ ledger lookup ─▶ valid key: cache it under the epoch read *before* the
//!                                    lookup, unless the cache moved to another epoch since
//!  revoke ─ ledger: revoked_at set (committed) ─▶ announce: a fresh random epoch (one SET)
//! ```
//!
//! Why it holds: a request that reads the epoch after an announcement finds it changed,
//! drops everything it cached and asks the ledger, where the revocation committed before the
//! announcement. An entry can only be cached under an epoch read before its ledger lookup, so
//! an entry looked up before a revocation carries an epoch older than the announcement and is
//! dropped by the first request that sees the new one. Epochs are random (not a counter), so
//! a session store that lost its data (a Redis restart without persistence) cannot bring an
//! old epoch back: the first gateway to find it missing writes a fresh one (`SET NX`), and
//! every cache clears once.
//!
//! The requests that wait at once share one read of the epoch ([`SharedRead`]), but only a
//! read that began after the request arrived: a request that arrives after an announcement
//! never takes the result of a read sent before it, so the guarantee is the same as with a
//! read per request, at about one read per session-store round trip under load.
//!
//! What does not go through the announcement: a session store that cannot be read makes the
//! gateway clear its cache and ask the ledger for every request until it can (slower, never
//! stale); a revocation whose announcement failed is answered `503` (the ledger has it;
//! retrying announces again), and a key revoked in SQL by hand or by `switchboard keys
//! revoke` on a database without a reachable shared session store is refused once the
//! cached entry is [`KEY_CACHE_MAX_AGE`] old, at the latest. Unknown tokens are never cached,
//! so a new key works at once and guessing fills nothing.

use std::num::NonZeroUsize;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::{FromRequestParts, MatchedPath, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::Response;
use lru::LruCache;
use sb_common::group_commit::SharedRead;
use sb_common::session::{SessionError, SessionStore};
use sb_protocol::ids::WorkspaceId;
use sb_store::{ApiKeyRole, AuthenticatedKey, StoreError, Tenancy};
use sha2::{Digest as _, Sha256};
use uuid::Uuid;

use crate::error::ApiError;
use crate::limits::KeyLimits;

/// Longest accepted key; anything longer is not one of ours and is refused without a
/// database lookup.
const MAX_KEY_LEN: usize = 256;

/// Longest time a cached key is trusted without asking the ledger again. The revocation
/// epoch makes revocations through the API effective at once; this bounds the rest (a key
/// revoked in SQL, or with an announcement that could not be made) to a minute, at the cost
/// of one ledger query per key and minute.
pub const KEY_CACHE_MAX_AGE: Duration = Duration::from_secs(60);

/// Session-store key (`kv` family) of the revocation epoch. Shared by every gateway of a
/// deployment and by `switchboard keys revoke` on a database: part of their contract.
pub const REVOCATION_EPOCH_KEY: &str = "api_keys:revocation_epoch";

/// Lifetime of an epoch in the session store. Its expiry only costs every gateway one cache
/// clear (a fresh epoch is written by the first reader), so it is long, but finite, as every
/// session-store value is.
const REVOCATION_EPOCH_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// The authenticated caller of a `/v1` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The workspace the API key belongs to.
    pub workspace_id: WorkspaceId,
    /// The key's id (the per-key limits count by it).
    pub key_id: Uuid,
    /// What the key may do.
    pub role: ApiKeyRole,
}

impl From<AuthenticatedKey> for Caller {
    fn from(key: AuthenticatedKey) -> Self {
        Self {
            workspace_id: key.workspace_id,
            key_id: key.key_id,
            role: key.role,
        }
    }
}

/// Tuning of API key authentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuthOptions {
    /// Keys kept in the cache (least recently used dropped first).
    pub key_cache_entries: NonZeroUsize,
    /// See [`KEY_CACHE_MAX_AGE`].
    pub key_cache_max_age: Duration,
}

impl Default for AuthOptions {
    fn default() -> Self {
        Self {
            key_cache_entries: sb_common::config::GatewayConfig::default().key_cache_entries,
            key_cache_max_age: KEY_CACHE_MAX_AGE,
        }
    }
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

/// What [`require_api_key`] needs of the application's state. The gateway's `AppState`
/// implements it; keeping the middleware generic keeps this module below the state (which
/// owns a [`KeyCache`]) instead of both using each other.
pub trait KeyAuthority: Clone + Send + Sync + 'static {
    /// The process's cache of authenticated keys.
    fn keys(&self) -> &KeyCache;
    /// The ledger's keys, asked on a cache miss.
    fn tenancy(&self) -> &dyn Tenancy;
    /// The shared session store that holds the revocation epoch.
    fn sessions(&self) -> &dyn SessionStore;
    /// The per-key request limiters.
    fn key_limits(&self) -> &KeyLimits;
}

/// Middleware: authenticates the request (`401 unauthorized`) and applies the key's request
/// rate (`429 rate_limited`).
pub async fn require_api_key<S: KeyAuthority>(
    State(state): State<S>,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let token = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .ok_or_else(ApiError::unauthorized)?;
    let key = state
        .keys()
        .authenticate(token, state.tenancy(), state.sessions())
        .await?
        .ok_or_else(ApiError::unauthorized)?;
    state.key_limits().admit(key.key_id)?;
    request.extensions_mut().insert(Caller::from(key));
    Ok(next.run(request).await)
}

/// Middleware of the admin routes (see the table in the crate docs): a `client` key gets
/// `403 permission_denied` before the handler runs, so nothing is read or stored.
pub async fn require_admin(request: Request, next: Next) -> Result<Response, ApiError> {
    let caller = request
        .extensions()
        .get::<Caller>()
        .ok_or_else(ApiError::unauthorized)?;
    if !caller.role.allows(ApiKeyRole::Admin) {
        let route = request
            .extensions()
            .get::<MatchedPath>()
            .map_or_else(|| request.uri().path(), MatchedPath::as_str);
        return Err(ApiError::permission_denied(&format!(
            "`{} {route}`",
            request.method()
        )));
    }
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

/// Makes every gateway sharing `sessions` forget the keys it cached (see the module docs):
/// call it after a revocation committed in the ledger, never before.
pub async fn announce_revocation(sessions: &dyn SessionStore) -> Result<(), SessionError> {
    sessions
        .set_ex(REVOCATION_EPOCH_KEY, &new_epoch(), REVOCATION_EPOCH_TTL)
        .await
}

fn new_epoch() -> Vec<u8> {
    Uuid::new_v4().simple().to_string().into_bytes()
}

/// The current revocation epoch, written first if the store has none.
async fn current_epoch(sessions: &dyn SessionStore) -> Result<Vec<u8>, SessionError> {
    if let Some(epoch) = sessions.get(REVOCATION_EPOCH_KEY).await? {
        return Ok(epoch);
    }
    let fresh = new_epoch();
    if sessions
        .set_nx_ex(REVOCATION_EPOCH_KEY, &fresh, REVOCATION_EPOCH_TTL)
        .await?
    {
        return Ok(fresh);
    }
    // Another process wrote one between the two calls: theirs holds.
    sessions
        .get(REVOCATION_EPOCH_KEY)
        .await?
        .ok_or_else(|| SessionError::Internal("the revocation epoch vanished as it was set".into()))
}

/// The bounded, revocation-aware cache of key lookups (see the module docs). Keyed by the
/// SHA-256 of the token, so the process keeps no key in the clear.
pub struct KeyCache {
    state: Mutex<CacheState>,
    max_age: Duration,
    /// The epoch reads, shared by the requests that wait at once — each request is answered
    /// by a read that began after it arrived, so sharing keeps the guarantee (see the module
    /// docs) while a busy gateway reads about once per session-store round trip, not once
    /// per request.
    epochs: SharedRead<Option<Vec<u8>>>,
}

struct CacheState {
    /// The epoch the entries were looked up under; `None`: not known (start, or the
    /// session store could not be read).
    epoch: Option<Vec<u8>>,
    entries: LruCache<[u8; 32], Cached>,
}

struct Cached {
    key: AuthenticatedKey,
    at: Instant,
}

impl std::fmt::Debug for KeyCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyCache")
            .field("entries", &self.len())
            .field("max_age", &self.max_age)
            .finish_non_exhaustive()
    }
}

impl KeyCache {
    /// An empty cache.
    pub fn new(options: AuthOptions) -> Self {
        Self {
            state: Mutex::new(CacheState {
                epoch: None,
                entries: LruCache::new(options.key_cache_entries),
            }),
            max_age: options.key_cache_max_age,
            epochs: SharedRead::default(),
        }
    }

    /// Keys cached now.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheState> {
        // The state is valid after any panic (a clear or a put either happened or not).
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The key `token` is, if valid: from the cache when it holds it under the current
    /// epoch, else from `tenancy` (and then cached). Only ledger failures are errors; a
    /// session store that cannot be read only costs the cache.
    pub async fn authenticate(
        &self,
        token: &str,
        tenancy: &dyn Tenancy,
        sessions: &dyn SessionStore,
    ) -> Result<Option<AuthenticatedKey>, StoreError> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let epoch = self
            .epochs
            .read(|| async {
                match current_epoch(sessions).await {
                    Ok(epoch) => Some(epoch),
                    Err(error) => {
                        tracing::warn!(%error, "cannot read the api key revocation epoch; asking the ledger");
                        None
                    }
                }
            })
            .await;
        {
            let mut state = self.lock();
            if state.epoch != epoch {
                state.entries.clear();
                state.epoch.clone_from(&epoch);
            }
            if epoch.is_some() {
                match state.entries.get(&digest) {
                    Some(hit) if hit.at.elapsed() < self.max_age => {
                        return Ok(Some(hit.key.clone()));
                    }
                    Some(_) => {
                        state.entries.pop(&digest);
                    }
                    None => {}
                }
            }
        }
        let found = tenancy.authenticate(token).await?;
        if let (Some(key), Some(epoch)) = (&found, &epoch) {
            let mut state = self.lock();
            // A request that saw a newer epoch meanwhile cleared the cache: what this lookup
            // found may predate that revocation, so it is not kept.
            if state.epoch.as_ref() == Some(epoch) {
                state.entries.put(
                    digest,
                    Cached {
                        key: key.clone(),
                        at: Instant::now(),
                    },
                );
            }
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use async_trait::async_trait;
    use sb_common::session::memory::MemorySessionStore;
    use sb_store::{ApiKeyRecord, NewApiKey};

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

    /// One valid key, `sb_good`, until `revoked`; counts lookups.
    #[derive(Default)]
    struct OneKey {
        lookups: AtomicUsize,
        revoked: std::sync::atomic::AtomicBool,
    }

    fn good() -> AuthenticatedKey {
        AuthenticatedKey {
            key_id: Uuid::nil(),
            workspace_id: WorkspaceId::default_workspace(),
            role: ApiKeyRole::Client,
        }
    }

    #[async_trait]
    impl Tenancy for OneKey {
        async fn ensure_workspace(&self, _: &WorkspaceId) -> sb_store::Result<()> {
            Ok(())
        }
        async fn create_api_key(
            &self,
            _: &WorkspaceId,
            _: Option<&str>,
            _: ApiKeyRole,
        ) -> sb_store::Result<NewApiKey> {
            unreachable!()
        }
        async fn authenticate(&self, token: &str) -> sb_store::Result<Option<AuthenticatedKey>> {
            self.lookups.fetch_add(1, Ordering::SeqCst);
            Ok((token == "sb_good" && !self.revoked.load(Ordering::SeqCst)).then(good))
        }
        async fn get_api_key(
            &self,
            _: &WorkspaceId,
            _: Uuid,
        ) -> sb_store::Result<Option<ApiKeyRecord>> {
            Ok(None)
        }
        async fn revoke(&self, _: &WorkspaceId, _: Uuid) -> sb_store::Result<bool> {
            Ok(!self.revoked.swap(true, Ordering::SeqCst))
        }
        async fn list_api_keys(&self, _: &WorkspaceId) -> sb_store::Result<Vec<ApiKeyRecord>> {
            Ok(Vec::new())
        }
    }

    fn cache(entries: usize) -> KeyCache {
        KeyCache::new(AuthOptions {
            key_cache_entries: NonZeroUsize::new(entries).unwrap(),
            key_cache_max_age: KEY_CACHE_MAX_AGE,
        })
    }

    #[tokio::test]
    async fn hits_cost_no_lookup_and_misses_are_not_cached() {
        let ledger = OneKey::default();
        let sessions = MemorySessionStore::new();
        let cache = cache(8);
        for _ in 0..3 {
            assert_eq!(
                cache
                    .authenticate("sb_good", &ledger, &sessions)
                    .await
                    .unwrap(),
                Some(good())
            );
        }
        assert_eq!(ledger.lookups.load(Ordering::SeqCst), 1);
        for _ in 0..3 {
            assert_eq!(
                cache
                    .authenticate("sb_bad", &ledger, &sessions)
                    .await
                    .unwrap(),
                None
            );
        }
        assert_eq!(ledger.lookups.load(Ordering::SeqCst), 4, "every miss asks");
        assert_eq!(cache.len(), 1, "unknown tokens fill nothing");
    }

    #[tokio::test]
    async fn an_announced_revocation_clears_every_cache_sharing_the_store() {
        let ledger = OneKey::default();
        let sessions = MemorySessionStore::new();
        let (a, b) = (cache(8), cache(8));
        for c in [&a, &b] {
            assert!(
                c.authenticate("sb_good", &ledger, &sessions)
                    .await
                    .unwrap()
                    .is_some()
            );
        }
        ledger
            .revoke(&WorkspaceId::default_workspace(), Uuid::nil())
            .await
            .unwrap();
        // Not announced: the caches still answer (what KEY_CACHE_MAX_AGE bounds).
        assert!(
            a.authenticate("sb_good", &ledger, &sessions)
                .await
                .unwrap()
                .is_some()
        );
        announce_revocation(&sessions).await.unwrap();
        for c in [&a, &b] {
            assert_eq!(
                c.authenticate("sb_good", &ledger, &sessions).await.unwrap(),
                None
            );
            assert!(c.is_empty());
        }
    }

    #[tokio::test]
    async fn a_lost_epoch_is_replaced_and_clears_the_caches() {
        let ledger = OneKey::default();
        let sessions = MemorySessionStore::new();
        let c = cache(8);
        c.authenticate("sb_good", &ledger, &sessions).await.unwrap();
        let before = sessions.get(REVOCATION_EPOCH_KEY).await.unwrap().unwrap();
        // The session store lost its data (a restart without persistence).
        sessions.del(REVOCATION_EPOCH_KEY).await.unwrap();
        c.authenticate("sb_good", &ledger, &sessions).await.unwrap();
        assert_eq!(
            ledger.lookups.load(Ordering::SeqCst),
            2,
            "cleared, asked again"
        );
        let after = sessions.get(REVOCATION_EPOCH_KEY).await.unwrap().unwrap();
        assert_ne!(before, after);
    }

    #[tokio::test]
    async fn old_entries_are_asked_again_and_the_size_is_bounded() {
        let ledger = OneKey::default();
        let sessions = MemorySessionStore::new();
        let c = KeyCache::new(AuthOptions {
            key_cache_entries: NonZeroUsize::new(1).unwrap(),
            key_cache_max_age: Duration::ZERO,
        });
        c.authenticate("sb_good", &ledger, &sessions).await.unwrap();
        c.authenticate("sb_good", &ledger, &sessions).await.unwrap();
        assert_eq!(
            ledger.lookups.load(Ordering::SeqCst),
            2,
            "max age 0: no hit"
        );
        assert_eq!(c.len(), 1);
    }

    /// A session store that is down.
    struct Down;

    #[async_trait]
    impl SessionStore for Down {
        async fn put_session(
            &self,
            _: &sb_protocol::ids::RunId,
            _: &serde_json::Value,
            _: Duration,
        ) -> sb_common::session::Result<()> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn get_session(
            &self,
            _: &sb_protocol::ids::RunId,
        ) -> sb_common::session::Result<Option<serde_json::Value>> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn touch_session(
            &self,
            _: &sb_protocol::ids::RunId,
            _: Duration,
        ) -> sb_common::session::Result<bool> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn end_session(
            &self,
            _: &sb_protocol::ids::RunId,
        ) -> sb_common::session::Result<Option<sb_common::session::EndedSession>> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn steering_push(
            &self,
            _: &sb_protocol::ids::RunId,
            _: &serde_json::Value,
            _: usize,
        ) -> sb_common::session::Result<sb_common::session::PushOutcome> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn steering_pull(
            &self,
            _: &sb_protocol::ids::RunId,
            _: usize,
            _: sb_common::session::PullMode,
        ) -> sb_common::session::Result<Vec<serde_json::Value>> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn steering_len(
            &self,
            _: &sb_protocol::ids::RunId,
        ) -> sb_common::session::Result<usize> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn acquire_lease(
            &self,
            _: &str,
            _: &str,
            _: Duration,
        ) -> sb_common::session::Result<bool> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn renew_lease(
            &self,
            _: &str,
            _: &str,
            _: Duration,
        ) -> sb_common::session::Result<()> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn release_lease(&self, _: &str, _: &str) -> sb_common::session::Result<bool> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn lease_holder(&self, _: &str) -> sb_common::session::Result<Option<String>> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn counter_incr(
            &self,
            _: &str,
            _: i64,
            _: Option<Duration>,
        ) -> sb_common::session::Result<i64> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn counter_get(&self, _: &str) -> sb_common::session::Result<i64> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn counter_try_add(
            &self,
            _: &str,
            _: i64,
            _: i64,
            _: Option<Duration>,
        ) -> sb_common::session::Result<i64> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn rate_limit_hit(
            &self,
            _: &str,
            _: u32,
            _: Duration,
        ) -> sb_common::session::Result<bool> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn set_ex(&self, _: &str, _: &[u8], _: Duration) -> sb_common::session::Result<()> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn set_nx_ex(
            &self,
            _: &str,
            _: &[u8],
            _: Duration,
        ) -> sb_common::session::Result<bool> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn get(&self, _: &str) -> sb_common::session::Result<Option<Vec<u8>>> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn del(&self, _: &str) -> sb_common::session::Result<bool> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn set_add(
            &self,
            _: &str,
            _: &str,
            _: Option<Duration>,
        ) -> sb_common::session::Result<bool> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn set_remove(&self, _: &str, _: &str) -> sb_common::session::Result<bool> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn set_members(&self, _: &str) -> sb_common::session::Result<Vec<String>> {
            Err(SessionError::Unavailable("down".into()))
        }
        async fn ping(&self) -> sb_common::session::Result<()> {
            Err(SessionError::Unavailable("down".into()))
        }
    }

    #[tokio::test]
    async fn without_the_session_store_every_request_asks_the_ledger() {
        let ledger = OneKey::default();
        let up = Arc::new(MemorySessionStore::new());
        let c = cache(8);
        c.authenticate("sb_good", &ledger, up.as_ref())
            .await
            .unwrap();
        assert_eq!(c.len(), 1);
        for _ in 0..2 {
            assert_eq!(
                c.authenticate("sb_good", &ledger, &Down).await.unwrap(),
                Some(good())
            );
        }
        assert_eq!(ledger.lookups.load(Ordering::SeqCst), 3);
        assert!(
            c.is_empty(),
            "nothing is trusted or kept while the epoch is unknown"
        );
    }
}
