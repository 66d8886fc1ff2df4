//! The router's ledger reads, shared by the events routed side by side (the lanes of a shard
//! batch, the shards of this orchestrator): each kind of read that is pending at once is one
//! statement ([`sb_common::group_commit`]'s natural batching, applied to reads).
//!
//! Every event's route reads its event row (step 1), its conversation's transcript cursor
//! (step 5) and its state scopes (step 6). One event at a time costs one statement each, as
//! a direct read; under load the reads of every route that waits at the same moment go
//! together. A shared read that fails is made again for each request alone, so a failure
//! stays with the request it belongs to.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;

use sb_common::group_commit::GroupCommit;
use sb_protocol::ids::{EventId, WorkspaceId};
use sb_store::{EventRecord, StoreError, Stores};
use serde_json::Value;

use crate::error::Result;

/// Most requests of one kind one read carries.
const MAX_READS: usize = 64;

/// The values of a state scope, by key.
type ScopeValues = BTreeMap<String, Value>;

/// The shared reads of one router. Cheap to clone.
#[derive(Clone)]
pub(super) struct RouteReads {
    events: GroupCommit<EventId, Result<Option<EventRecord>, StoreError>>,
    cursors: GroupCommit<(WorkspaceId, String), Result<Option<String>, StoreError>>,
    scopes: GroupCommit<Vec<String>, Result<BTreeMap<String, ScopeValues>, StoreError>>,
}

impl std::fmt::Debug for RouteReads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteReads").finish_non_exhaustive()
    }
}

impl RouteReads {
    /// Starts the reading tasks (on the current Tokio runtime) over `stores`.
    pub(super) fn start(stores: &Stores) -> Self {
        let events = Arc::clone(&stores.events);
        let transcript = Arc::clone(&stores.transcript);
        let state = Arc::clone(&stores.state);
        Self {
            events: batched(move |ids: Vec<EventId>| {
                let events = Arc::clone(&events);
                async move { events.get_many(&ids).await }
            }),
            cursors: batched(move |keys: Vec<(WorkspaceId, String)>| {
                let transcript = Arc::clone(&transcript);
                async move { transcript.latest_cursors(&keys).await }
            }),
            scopes: batched(move |requests: Vec<Vec<String>>| {
                let state = Arc::clone(&state);
                async move {
                    let keys: Vec<String> = requests
                        .iter()
                        .flatten()
                        .cloned()
                        .collect::<BTreeSet<_>>()
                        .into_iter()
                        .collect();
                    let values = state.snapshots(&keys).await?;
                    Ok(requests
                        .into_iter()
                        .map(|keys| {
                            keys.into_iter()
                                .map(|key| {
                                    let scope = values.get(&key).cloned().unwrap_or_default();
                                    (key, scope)
                                })
                                .collect()
                        })
                        .collect())
                }
            }),
        }
    }

    /// The event with this id, if any ([`EventLog::get`](sb_store::EventLog::get)).
    pub(super) async fn event(&self, id: EventId) -> Result<Option<EventRecord>> {
        Ok(self.events.submit(id).await??)
    }

    /// The conversation's latest transcript cursor
    /// ([`Transcript::latest_cursor`](sb_store::Transcript::latest_cursor)).
    pub(super) async fn latest_cursor(
        &self,
        workspace_id: &WorkspaceId,
        conversation_id: &str,
    ) -> Result<Option<String>> {
        let key = (workspace_id.clone(), conversation_id.to_owned());
        Ok(self.cursors.submit(key).await??)
    }

    /// Every value of each scope of `scope_keys`
    /// ([`StateStore::snapshots`](sb_store::StateStore::snapshots)).
    pub(super) async fn snapshots(
        &self,
        scope_keys: Vec<String>,
    ) -> Result<BTreeMap<String, ScopeValues>> {
        Ok(self.scopes.submit(scope_keys).await??)
    }
}

/// A group of reads: `read` answers a list of requests by position; when it fails for a
/// batch of several, each request is read again alone.
fn batched<K, V, F, Fut>(read: F) -> GroupCommit<K, Result<V, StoreError>>
where
    K: Clone + Send + 'static,
    V: Send + 'static,
    F: Fn(Vec<K>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Vec<V>, StoreError>> + Send + 'static,
{
    let read = Arc::new(read);
    GroupCommit::spawn(MAX_READS, move |keys: Vec<K>| {
        let read = Arc::clone(&read);
        async move {
            let count = keys.len();
            match read(keys.clone()).await {
                Ok(values) if values.len() == count => values.into_iter().map(Ok).collect(),
                Ok(_) => keys.iter().map(|_| Err(unanswered())).collect(),
                Err(error) if count == 1 => vec![Err(error)],
                Err(error) => {
                    tracing::debug!(%error, reads = count, "batched read failed; reading one by one");
                    let mut alone = Vec::with_capacity(count);
                    for key in keys {
                        alone.push(
                            read(vec![key])
                                .await
                                .and_then(|mut one| one.pop().ok_or_else(unanswered)),
                        );
                    }
                    alone
                }
            }
        }
    })
}

fn unanswered() -> StoreError {
    StoreError::Corrupt("a batched read answered a different number of requests".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_batch_that_fails_is_read_again_one_by_one() {
        // Fails any batch holding the key 13, and any of several keys.
        let group = batched(|keys: Vec<u32>| async move {
            if keys.contains(&13) || keys.len() > 1 {
                Err(StoreError::InvalidArgument("unlucky".into()))
            } else {
                Ok(keys.into_iter().map(|k| k * 2).collect())
            }
        });
        let answers = futures::future::join_all([1, 13, 3].map(|k| group.submit(k))).await;
        let answers: Vec<_> = answers
            .into_iter()
            .map(|a| a.unwrap().map_err(|e| e.to_string()))
            .collect();
        assert_eq!(answers, [Ok(2), Err("unlucky".into()), Ok(6)]);
    }

    #[tokio::test]
    async fn a_read_that_loses_answers_fails_its_requests() {
        let group = batched(|_: Vec<u32>| async { Ok(Vec::<u32>::new()) });
        assert!(matches!(
            group.submit(1).await,
            Ok(Err(StoreError::Corrupt(_)))
        ));
    }

    #[tokio::test]
    async fn scopes_asked_together_are_split_per_request() {
        let db = sb_store::testing::sqlite_memory_db().await;
        let reads = RouteReads::start(&db.stores);
        let (a, b) = futures::future::join(
            reads.snapshots(vec!["s1".into(), "s2".into()]),
            reads.snapshots(vec!["s2".into()]),
        )
        .await;
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.keys().collect::<Vec<_>>(), ["s1", "s2"]);
        assert_eq!(b.keys().collect::<Vec<_>>(), ["s2"]);
        assert!(reads.event(EventId::new()).await.unwrap().is_none());
    }
}
