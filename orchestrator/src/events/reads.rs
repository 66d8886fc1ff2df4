//! The router's event reads, shared by the events routed side by side (the lanes of a shard
//! batch, the shards of this orchestrator): the event rows pending at once are one statement
//! ([`sb_common::group_commit`]'s natural batching, applied to reads).
//!
//! Every event's route reads its event row (step 1); the run's transcript cursor and state
//! are read by the run's start, in its commit (step 7). One event at a time costs one
//! statement, as a direct read; under load the reads of every route that waits at the same
//! moment go together. A shared read that fails is made again for each request alone, so a
//! failure stays with the request it belongs to.

use std::future::Future;
use std::sync::Arc;

use sb_common::group_commit::GroupCommit;
use sb_protocol::ids::EventId;
use sb_store::{EventRecord, StoreError, Stores};

use crate::error::Result;

/// Most events one read carries.
const MAX_READS: usize = 64;

/// The shared reads of one router. Cheap to clone.
#[derive(Clone)]
pub(super) struct RouteReads {
    events: GroupCommit<EventId, Result<Option<EventRecord>, StoreError>>,
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
        Self {
            events: batched(move |ids: Vec<EventId>| {
                let events = Arc::clone(&events);
                async move { events.get_many(&ids).await }
            }),
        }
    }

    /// The event with this id, if any ([`EventLog::get`](sb_store::EventLog::get)).
    pub(super) async fn event(&self, id: EventId) -> Result<Option<EventRecord>> {
        Ok(self.events.submit(id).await??)
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
    async fn events_asked_together_are_answered_each() {
        let db = sb_store::testing::sqlite_memory_db().await;
        let reads = RouteReads::start(&db.stores);
        let (a, b) =
            futures::future::join(reads.event(EventId::new()), reads.event(EventId::new())).await;
        assert!(a.unwrap().is_none() && b.unwrap().is_none());
    }
}
