//! What routing reads on every event and rarely changes — a workspace's enabled agents
//! (parsed into [`AgentCandidate`]s) and the registry's runner descriptors — cached per
//! orchestrator process.
//!
//! Without it, every event costs two ledger reads and the JSON decoding of every agent row
//! and of the runner descriptor. An entry is valid while
//!
//! - the **routing epoch** ([`sb_common::session::ROUTING_EPOCH_KEY`]) read before this
//!   routing equals the one read before the entry was loaded: every writer of agents or
//!   runners replaces the epoch after its commit, so a change is seen by the next event
//!   routed after it, on every orchestrator (the epoch is read before the ledger, so an entry
//!   loaded concurrently with a change is filed under the old epoch and reloaded next time);
//! - and it is younger than `max_age`: a bound on staleness for changes made behind the
//!   writers' backs (raw SQL), and for a lost announcement.
//!
//! `max_age` zero disables the cache (every lookup reads the ledger).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sb_protocol::ids::WorkspaceId;
use sb_rules::bindings::AgentCandidate;
use tokio::time::Instant;

use crate::lock;
use crate::plan::RunnerLookup;

/// Entries kept per map; the map is emptied when it would grow past this.
const CAPACITY: usize = 4_096;

/// One cached value, with the epoch and time it was loaded under.
#[derive(Debug, Clone)]
struct Entry<T> {
    epoch: Option<Vec<u8>>,
    loaded: Instant,
    value: T,
}

/// The per-process cache of routing lookups (see the module docs).
#[derive(Debug)]
pub struct RouteCache {
    max_age: Duration,
    agents: Mutex<HashMap<WorkspaceId, Entry<Arc<[AgentCandidate]>>>>,
    runners: Mutex<HashMap<String, Entry<RunnerLookup>>>,
}

impl RouteCache {
    /// An empty cache whose entries live at most `max_age` (zero: nothing is cached).
    #[must_use]
    pub fn new(max_age: Duration) -> Self {
        Self {
            max_age,
            agents: Mutex::new(HashMap::new()),
            runners: Mutex::new(HashMap::new()),
        }
    }

    /// Whether lookups are cached at all.
    #[must_use]
    pub fn is_enabled(&self) -> bool {
        !self.max_age.is_zero()
    }

    /// The workspace's candidates, if cached under `epoch` and fresh.
    pub fn agents(
        &self,
        workspace: &WorkspaceId,
        epoch: Option<&[u8]>,
    ) -> Option<Arc<[AgentCandidate]>> {
        fresh(&lock(&self.agents), workspace, epoch, self.max_age)
    }

    /// Files the workspace's candidates loaded after reading `epoch`.
    pub fn put_agents(
        &self,
        workspace: &WorkspaceId,
        epoch: Option<&[u8]>,
        value: Arc<[AgentCandidate]>,
    ) {
        if self.is_enabled() {
            insert(&mut lock(&self.agents), workspace.clone(), epoch, value);
        }
    }

    /// The runner's lookup, if cached under `epoch` and fresh.
    pub fn runner(&self, runner_id: &str, epoch: Option<&[u8]>) -> Option<RunnerLookup> {
        fresh(&lock(&self.runners), runner_id, epoch, self.max_age)
    }

    /// Files the runner's lookup loaded after reading `epoch`.
    pub fn put_runner(&self, runner_id: &str, epoch: Option<&[u8]>, value: RunnerLookup) {
        if self.is_enabled() {
            insert(&mut lock(&self.runners), runner_id.to_owned(), epoch, value);
        }
    }
}

fn fresh<K, Q, T>(
    map: &HashMap<K, Entry<T>>,
    key: &Q,
    epoch: Option<&[u8]>,
    max_age: Duration,
) -> Option<T>
where
    K: std::borrow::Borrow<Q> + std::hash::Hash + Eq,
    Q: std::hash::Hash + Eq + ?Sized,
    T: Clone,
{
    let entry = map.get(key)?;
    (entry.epoch.as_deref() == epoch && entry.loaded.elapsed() < max_age)
        .then(|| entry.value.clone())
}

fn insert<K: std::hash::Hash + Eq, T>(
    map: &mut HashMap<K, Entry<T>>,
    key: K,
    epoch: Option<&[u8]>,
    value: T,
) {
    if map.len() >= CAPACITY {
        map.clear();
    }
    map.insert(
        key,
        Entry {
            epoch: epoch.map(<[u8]>::to_vec),
            loaded: Instant::now(),
            value,
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ws() -> WorkspaceId {
        WorkspaceId::new("w").unwrap()
    }

    #[test]
    fn an_entry_holds_for_its_epoch() {
        let cache = RouteCache::new(Duration::from_secs(30));
        cache.put_runner("r", Some(b"e1"), RunnerLookup::Missing);
        assert_eq!(cache.runner("r", Some(b"e1")), Some(RunnerLookup::Missing));
        // Another epoch, or none (a store that came back empty): reload.
        assert_eq!(cache.runner("r", Some(b"e2")), None);
        assert_eq!(cache.runner("r", None), None);
    }

    #[test]
    fn an_entry_expires_after_max_age() {
        let cache = RouteCache::new(Duration::from_millis(10));
        cache.put_runner("r", Some(b"e1"), RunnerLookup::Missing);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(cache.runner("r", Some(b"e1")), None);
    }

    #[test]
    fn agents_are_cached_per_workspace() {
        let cache = RouteCache::new(Duration::from_secs(30));
        let empty: Arc<[AgentCandidate]> = Arc::from(Vec::new());
        cache.put_agents(&ws(), None, Arc::clone(&empty));
        assert!(cache.agents(&ws(), None).is_some());
        assert!(
            cache
                .agents(&WorkspaceId::new("other").unwrap(), None)
                .is_none()
        );
        assert!(cache.agents(&ws(), Some(b"e")).is_none());
    }

    #[test]
    fn zero_max_age_caches_nothing() {
        let cache = RouteCache::new(Duration::ZERO);
        cache.put_runner("r", None, RunnerLookup::Missing);
        assert_eq!(cache.runner("r", None), None);
    }
}
