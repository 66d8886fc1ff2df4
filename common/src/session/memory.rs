//! In-process [`SessionStore`]: one map behind a mutex, Redis-like values with TTLs.
//!
//! Expiry uses `tokio::time::Instant`, so tests running with `tokio::time::pause()` can jump
//! over a 10-minute TTL instantly. Expired entries are removed lazily when touched, and by a
//! sweep every `SWEEP_EVERY` writes so abandoned keys do not accumulate. Every operation
//! runs under the one lock, which makes each of them atomic as the contract requires.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use sb_protocol::ids::RunId;
use serde_json::Value as Json;
use tokio::time::Instant;

use super::{
    EndedSession, Keys, PullMode, PushOutcome, Result, RunBegin, RunEnd, SessionError,
    SessionStore, cancel_flag_key, check_ttl, run_handed_off_key, run_lease_key,
};

/// Writes between two sweeps of expired entries.
const SWEEP_EVERY: u64 = 1024;

/// The in-process session store. Cheap to clone; clones share the data.
#[derive(Clone)]
pub struct MemorySessionStore {
    keys: Keys,
    inner: Arc<Mutex<Inner>>,
}

impl std::fmt::Debug for MemorySessionStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemorySessionStore")
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    writes: u64,
}

struct Entry {
    value: Value,
    expires_at: Option<Instant>,
}

enum Value {
    Json(Json),
    Bytes(Vec<u8>),
    Text(String),
    Int(i64),
    List(VecDeque<Json>),
    Set(BTreeSet<String>),
}

impl Default for MemorySessionStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemorySessionStore {
    /// An empty store without key prefix.
    pub fn new() -> Self {
        Self::with_prefix("")
    }

    /// An empty store whose keys all start with `prefix`.
    pub fn with_prefix(prefix: impl Into<String>) -> Self {
        Self {
            keys: Keys::new(prefix),
            inner: Arc::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn deadline(ttl: Duration) -> Instant {
    Instant::now() + ttl
}

impl Inner {
    /// The live entry at `key`, dropping it if it expired.
    fn live(&mut self, key: &str) -> Option<&mut Entry> {
        let expired = self
            .entries
            .get(key)?
            .expires_at
            .is_some_and(|at| at <= Instant::now());
        if expired {
            self.entries.remove(key);
            return None;
        }
        self.entries.get_mut(key)
    }

    fn put(&mut self, key: String, value: Value, expires_at: Option<Instant>) {
        self.entries.insert(key, Entry { value, expires_at });
        self.wrote();
    }

    fn wrote(&mut self) {
        self.writes += 1;
        if self.writes % SWEEP_EVERY == 0 {
            let now = Instant::now();
            self.entries
                .retain(|_, e| e.expires_at.is_none_or(|at| at > now));
        }
    }

    fn remove(&mut self, key: &str) -> Option<Value> {
        let _ = self.live(key)?;
        self.entries.remove(key).map(|e| e.value)
    }

    /// `acquire_lease` on the full key `k` (`key` names it in errors).
    fn acquire(&mut self, k: &str, key: &str, holder: &str, ttl: Duration) -> Result<bool> {
        match self.live(k) {
            Some(Entry {
                value: Value::Text(current),
                expires_at,
            }) => {
                if current != holder {
                    return Ok(false);
                }
                *expires_at = Some(deadline(ttl));
            }
            Some(_) => return Err(wrong_type(key)),
            None => self.put(
                k.to_owned(),
                Value::Text(holder.to_owned()),
                Some(deadline(ttl)),
            ),
        }
        Ok(true)
    }

    /// `release_lease` on the full key `k`.
    fn release(&mut self, k: &str, holder: &str) -> bool {
        let held = matches!(self.live(k), Some(Entry { value: Value::Text(current), .. }) if current == holder);
        if held {
            self.entries.remove(k);
        }
        held
    }

    /// `end_session` of `run_id`.
    fn end_session(&mut self, keys: &Keys, run_id: &RunId) -> Result<Option<EndedSession>> {
        let key = keys.session(run_id);
        match self.remove(&key) {
            None => return Ok(None),
            Some(Value::Json(_)) => {}
            Some(_) => return Err(wrong_type(&key)),
        }
        let steering = match self.remove(&keys.steering(run_id)) {
            Some(Value::List(items)) => items.into(),
            _ => Vec::new(),
        };
        self.wrote();
        Ok(Some(EndedSession { steering }))
    }

    /// `lease_holder` on the full key `k`.
    fn holder(&mut self, k: &str, key: &str) -> Result<Option<String>> {
        match self.live(k).map(|e| &e.value) {
            None => Ok(None),
            Some(Value::Text(holder)) => Ok(Some(holder.clone())),
            Some(_) => Err(wrong_type(key)),
        }
    }

    /// `get_session` on the full key `k`.
    fn session(&mut self, k: &str) -> Result<Option<Json>> {
        match self.live(k).map(|e| &e.value) {
            None => Ok(None),
            Some(Value::Json(v)) => Ok(Some(v.clone())),
            Some(_) => Err(wrong_type(k)),
        }
    }

    /// `get` on the full key `k`.
    fn bytes(&mut self, k: &str, key: &str) -> Result<Option<Vec<u8>>> {
        match self.live(k).map(|e| &e.value) {
            None => Ok(None),
            Some(Value::Bytes(v)) => Ok(Some(v.clone())),
            Some(_) => Err(wrong_type(key)),
        }
    }

    /// `set_remove` on the full key `k`.
    fn set_remove(&mut self, k: &str, key: &str, member: &str) -> Result<bool> {
        let (removed, now_empty) = match self.live(k) {
            None => return Ok(false),
            Some(Entry {
                value: Value::Set(members),
                ..
            }) => (members.remove(member), members.is_empty()),
            Some(_) => return Err(wrong_type(key)),
        };
        // Like Redis: an emptied set no longer exists (and loses its TTL).
        if now_empty {
            self.entries.remove(k);
        }
        Ok(removed)
    }

    /// `set_members` on the full key `k`.
    fn set_members(&mut self, k: &str, key: &str) -> Result<Vec<String>> {
        match self.live(k).map(|e| &e.value) {
            None => Ok(Vec::new()),
            Some(Value::Set(members)) => Ok(members.iter().cloned().collect()),
            Some(_) => Err(wrong_type(key)),
        }
    }

    fn int(&mut self, key: &str) -> Result<i64> {
        match self.live(key).map(|e| &e.value) {
            None => Ok(0),
            Some(Value::Int(v)) => Ok(*v),
            Some(_) => Err(wrong_type(key)),
        }
    }

    /// Adds to an integer entry, keeping its TTL (or setting `ttl` if it has none).
    fn add(&mut self, key: &str, by: i64, ttl: Option<Duration>) -> Result<i64> {
        let current = self.int(key)?;
        let value = current.checked_add(by).ok_or_else(|| {
            SessionError::InvalidArgument(format!("counter {key:?} would overflow"))
        })?;
        let expires_at = match self.live(key) {
            Some(Entry {
                expires_at: Some(at),
                ..
            }) => Some(*at),
            _ => ttl.map(deadline),
        };
        self.put(key.to_owned(), Value::Int(value), expires_at);
        Ok(value)
    }
}

fn wrong_type(key: &str) -> SessionError {
    SessionError::Corrupt {
        key: key.to_owned(),
        reason: "value has the wrong type for this operation".into(),
    }
}

#[async_trait]
impl SessionStore for MemorySessionStore {
    async fn put_session(&self, run_id: &RunId, session: &Json, ttl: Duration) -> Result<()> {
        check_ttl(ttl)?;
        self.lock().put(
            self.keys.session(run_id),
            Value::Json(session.clone()),
            Some(deadline(ttl)),
        );
        Ok(())
    }

    async fn get_session(&self, run_id: &RunId) -> Result<Option<Json>> {
        self.lock().session(&self.keys.session(run_id))
    }

    async fn touch_session(&self, run_id: &RunId, ttl: Duration) -> Result<bool> {
        check_ttl(ttl)?;
        let mut inner = self.lock();
        let Some(session) = inner.live(&self.keys.session(run_id)) else {
            return Ok(false);
        };
        session.expires_at = Some(deadline(ttl));
        if let Some(list) = inner.live(&self.keys.steering(run_id)) {
            list.expires_at = Some(deadline(ttl));
        }
        Ok(true)
    }

    async fn end_session(&self, run_id: &RunId) -> Result<Option<EndedSession>> {
        self.lock().end_session(&self.keys, run_id)
    }

    async fn steering_push(&self, run_id: &RunId, item: &Json, cap: usize) -> Result<PushOutcome> {
        let mut inner = self.lock();
        let Some(session_expiry) = inner.live(&self.keys.session(run_id)).map(|e| e.expires_at)
        else {
            return Ok(PushOutcome::NoSession);
        };
        let key = self.keys.steering(run_id);
        match inner.live(&key) {
            Some(Entry {
                value: Value::List(items),
                expires_at,
            }) => {
                if items.len() >= cap {
                    return Ok(PushOutcome::Full);
                }
                items.push_back(item.clone());
                *expires_at = session_expiry;
            }
            Some(_) => return Err(wrong_type(&key)),
            None => {
                if cap == 0 {
                    return Ok(PushOutcome::Full);
                }
                inner.put(
                    key,
                    Value::List(VecDeque::from([item.clone()])),
                    session_expiry,
                );
            }
        }
        Ok(PushOutcome::Accepted)
    }

    async fn steering_pull(&self, run_id: &RunId, max: usize, mode: PullMode) -> Result<Vec<Json>> {
        let take = match mode {
            PullMode::All => max,
            PullMode::One => max.min(1),
        };
        let key = self.keys.steering(run_id);
        let mut inner = self.lock();
        let items = match inner.live(&key) {
            None => return Ok(Vec::new()),
            Some(Entry {
                value: Value::List(items),
                ..
            }) => {
                let n = take.min(items.len());
                items.drain(..n).collect::<Vec<_>>()
            }
            Some(_) => return Err(wrong_type(&key)),
        };
        if matches!(inner.live(&key), Some(Entry { value: Value::List(rest), .. }) if rest.is_empty())
        {
            inner.entries.remove(&key);
        }
        Ok(items)
    }

    async fn steering_len(&self, run_id: &RunId) -> Result<usize> {
        let key = self.keys.steering(run_id);
        match self.lock().live(&key).map(|e| &e.value) {
            None => Ok(0),
            Some(Value::List(items)) => Ok(items.len()),
            Some(_) => Err(wrong_type(&key)),
        }
    }

    async fn acquire_lease(&self, key: &str, holder: &str, ttl: Duration) -> Result<bool> {
        check_ttl(ttl)?;
        self.lock().acquire(&self.keys.lease(key), key, holder, ttl)
    }

    async fn renew_lease(&self, key: &str, holder: &str, ttl: Duration) -> Result<()> {
        check_ttl(ttl)?;
        let k = self.keys.lease(key);
        match self.lock().live(&k) {
            Some(Entry {
                value: Value::Text(current),
                expires_at,
            }) if current == holder => {
                *expires_at = Some(deadline(ttl));
                Ok(())
            }
            _ => Err(SessionError::LeaseLost {
                key: key.to_owned(),
            }),
        }
    }

    async fn release_lease(&self, key: &str, holder: &str) -> Result<bool> {
        Ok(self.lock().release(&self.keys.lease(key), holder))
    }

    async fn lease_holder(&self, key: &str) -> Result<Option<String>> {
        self.lock().holder(&self.keys.lease(key), key)
    }

    async fn begin_run(&self, run_id: &RunId, holder: &str, ttl: Duration) -> Result<RunBegin> {
        check_ttl(ttl)?;
        let key = run_lease_key(run_id);
        let k = self.keys.lease(&key);
        let mut inner = self.lock();
        if !inner.acquire(&k, &key, holder, ttl)? {
            let current = inner.holder(&k, &key)?.unwrap_or_default();
            return Ok(RunBegin::HeldBy(current));
        }
        let flag = cancel_flag_key(run_id);
        let cancel_flag = inner.bytes(&self.keys.kv(&flag), &flag)?;
        Ok(RunBegin::Leased {
            cancel_flag,
            session: inner.session(&self.keys.session(run_id))?,
        })
    }

    async fn end_run(
        &self,
        run_id: &RunId,
        holder: &str,
        handed_off_ttl: Duration,
    ) -> Result<RunEnd> {
        check_ttl(handed_off_ttl)?;
        let mut inner = self.lock();
        let ended = inner.end_session(&self.keys, run_id)?;
        inner.remove(&self.keys.kv(&cancel_flag_key(run_id)));
        inner.put(
            self.keys.kv(&run_handed_off_key(run_id)),
            Value::Bytes(holder.as_bytes().to_vec()),
            Some(deadline(handed_off_ttl)),
        );
        let lease_released = inner.release(&self.keys.lease(&run_lease_key(run_id)), holder);
        Ok(RunEnd {
            ended,
            lease_released,
        })
    }

    async fn counter_incr(&self, key: &str, by: i64, ttl: Option<Duration>) -> Result<i64> {
        if let Some(ttl) = ttl {
            check_ttl(ttl)?;
        }
        self.lock().add(&self.keys.counter(key), by, ttl)
    }

    async fn counter_get(&self, key: &str) -> Result<i64> {
        self.lock().int(&self.keys.counter(key))
    }

    async fn counter_try_add(
        &self,
        key: &str,
        by: i64,
        limit: i64,
        ttl: Option<Duration>,
    ) -> Result<i64> {
        if by < 0 {
            return Err(SessionError::InvalidArgument(
                "a budget cannot be refunded (by < 0)".into(),
            ));
        }
        if let Some(ttl) = ttl {
            check_ttl(ttl)?;
        }
        let (counter, marker) = (self.keys.counter(key), self.keys.exhausted(key));
        let mut inner = self.lock();
        let used = inner.int(&counter)?;
        let exhausted = inner.live(&marker).is_some();
        if exhausted || used.checked_add(by).is_none_or(|v| v > limit) {
            let expires_at = inner
                .live(&counter)
                .and_then(|e| e.expires_at)
                .or_else(|| ttl.map(deadline));
            inner.put(marker, Value::Int(1), expires_at);
            return Err(SessionError::Exhausted {
                key: key.to_owned(),
                used,
                limit,
            });
        }
        inner.add(&counter, by, ttl)
    }

    async fn rate_limit_hit(
        &self,
        key: &str,
        max_per_window: u32,
        window: Duration,
    ) -> Result<bool> {
        check_ttl(window)?;
        let hits = self.lock().add(&self.keys.rate(key), 1, Some(window))?;
        Ok(hits <= i64::from(max_per_window))
    }

    async fn set_ex(&self, key: &str, value: &[u8], ttl: Duration) -> Result<()> {
        check_ttl(ttl)?;
        self.lock().put(
            self.keys.kv(key),
            Value::Bytes(value.to_vec()),
            Some(deadline(ttl)),
        );
        Ok(())
    }

    async fn set_nx_ex(&self, key: &str, value: &[u8], ttl: Duration) -> Result<bool> {
        check_ttl(ttl)?;
        let k = self.keys.kv(key);
        let mut inner = self.lock();
        if inner.live(&k).is_some() {
            return Ok(false);
        }
        inner.put(k, Value::Bytes(value.to_vec()), Some(deadline(ttl)));
        Ok(true)
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.lock().bytes(&self.keys.kv(key), key)
    }

    async fn del(&self, key: &str) -> Result<bool> {
        Ok(self.lock().remove(&self.keys.kv(key)).is_some())
    }

    async fn set_add(&self, key: &str, member: &str, ttl: Option<Duration>) -> Result<bool> {
        if let Some(ttl) = ttl {
            check_ttl(ttl)?;
        }
        let k = self.keys.set(key);
        let mut inner = self.lock();
        let added = match inner.live(&k) {
            Some(Entry {
                value: Value::Set(members),
                expires_at,
            }) => {
                if let Some(ttl) = ttl {
                    *expires_at = Some(deadline(ttl));
                }
                members.insert(member.to_owned())
            }
            Some(_) => return Err(wrong_type(key)),
            None => {
                inner.put(
                    k,
                    Value::Set(BTreeSet::from([member.to_owned()])),
                    ttl.map(deadline),
                );
                true
            }
        };
        Ok(added)
    }

    async fn set_remove(&self, key: &str, member: &str) -> Result<bool> {
        self.lock().set_remove(&self.keys.set(key), key, member)
    }

    async fn set_members(&self, key: &str) -> Result<Vec<String>> {
        self.lock().set_members(&self.keys.set(key), key)
    }

    async fn set_remove_then_members(
        &self,
        key: &str,
        member: &str,
        members_of: &str,
    ) -> Result<(bool, Vec<String>)> {
        let mut inner = self.lock();
        let removed = inner.set_remove(&self.keys.set(key), key, member)?;
        Ok((
            removed,
            inner.set_members(&self.keys.set(members_of), members_of)?,
        ))
    }

    async fn ping(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With paused time a long TTL expires without waiting (the reason TTLs use tokio time).
    #[tokio::test(start_paused = true)]
    async fn ttl_follows_paused_tokio_time() {
        let store = MemorySessionStore::new();
        let run = RunId::new();
        store
            .put_session(&run, &serde_json::json!({"a": 1}), Duration::from_secs(600))
            .await
            .unwrap();
        store
            .set_ex("k", b"v", Duration::from_secs(60))
            .await
            .unwrap();
        assert!(
            store
                .acquire_lease("l", "w1", Duration::from_secs(10))
                .await
                .unwrap()
        );
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(
            store
                .acquire_lease("l", "w2", Duration::from_secs(10))
                .await
                .unwrap(),
            "lease expired"
        );
        assert!(store.get("k").await.unwrap().is_some());
        tokio::time::advance(Duration::from_secs(50)).await;
        assert!(store.get("k").await.unwrap().is_none());
        assert!(store.get_session(&run).await.unwrap().is_some());
        tokio::time::advance(Duration::from_secs(540)).await;
        assert!(store.get_session(&run).await.unwrap().is_none());
        assert!(store.end_session(&run).await.unwrap().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn sweep_drops_abandoned_keys() {
        let store = MemorySessionStore::new();
        for i in 0..10 {
            store
                .set_ex(&format!("old{i}"), b"v", Duration::from_secs(1))
                .await
                .unwrap();
        }
        tokio::time::advance(Duration::from_secs(2)).await;
        for i in 0..SWEEP_EVERY {
            store
                .set_ex(&format!("new{i}"), b"v", Duration::from_secs(100))
                .await
                .unwrap();
        }
        let inner = store.lock();
        assert!(!inner.entries.keys().any(|k| k.starts_with("kv:old")));
    }
}
