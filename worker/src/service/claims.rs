//! The worker's claims (`queued → running`, SPEC §2 step 3), group-committed: the jobs this
//! worker received together claim their runs in one statement
//! ([`RunLedger::claim_runs`]).
//!
//! A job still claims its run before anything executes, and a claim is still decided by the
//! ledger alone (a conditional update: exactly one claimer wins). Only the commit is shared:
//! one job at a time costs one statement as before, and the jobs that arrive while a claim
//! commits share the next one ([`sb_common::group_commit`]).

use std::collections::HashSet;
use std::sync::Arc;

use sb_common::group_commit::{GroupCommit, GroupCommitClosed};
use sb_protocol::ids::RunId;
use sb_store::{RunLedger, StoreError};

/// Most claims one commit carries: above any worker's concurrency.
const MAX_CLAIMS_PER_COMMIT: usize = 256;

/// The submitting side of a worker's claims. Cheap to clone.
#[derive(Clone)]
pub(super) struct Claims {
    group: GroupCommit<RunId, Result<bool, StoreError>>,
}

impl Claims {
    /// Starts the committing task (on the current Tokio runtime) for `worker_id`.
    pub(super) fn start(ledger: Arc<dyn RunLedger>, worker_id: String) -> Self {
        let group = GroupCommit::spawn(MAX_CLAIMS_PER_COMMIT, move |ids: Vec<RunId>| {
            let ledger = Arc::clone(&ledger);
            let worker_id = worker_id.clone();
            async move { claim_together(ledger.as_ref(), &ids, &worker_id).await }
        });
        Self { group }
    }

    /// Claims `run_id` in the next shared commit: `Ok(true)` iff this call moved it
    /// `queued → running`, as [`RunLedger::claim_run`] answers.
    pub(super) async fn claim(
        &self,
        run_id: RunId,
    ) -> Result<Result<bool, StoreError>, GroupCommitClosed> {
        self.group.submit(run_id).await
    }
}

/// One answer per id, in order. A run named twice is won by its first request only (one
/// claim, one execution). When the shared statement fails, each claim is made alone, so each
/// gets its own error.
async fn claim_together(
    ledger: &dyn RunLedger,
    ids: &[RunId],
    worker_id: &str,
) -> Vec<Result<bool, StoreError>> {
    match ledger.claim_runs(ids, worker_id).await {
        Ok(mut claimed) => ids.iter().map(|id| Ok(claimed.remove(id))).collect(),
        Err(error) if ids.len() == 1 => vec![Err(error)],
        Err(error) => {
            tracing::debug!(%error, claims = ids.len(), "batched claim failed; claiming one by one");
            let mut seen = HashSet::new();
            let mut answers = Vec::with_capacity(ids.len());
            for id in ids {
                answers.push(if seen.insert(*id) {
                    ledger.claim_run(*id, worker_id).await
                } else {
                    Ok(false)
                });
            }
            answers
        }
    }
}

#[cfg(test)]
mod tests {
    use sb_store::RunStatus;
    use sb_store::testing::sqlite_memory_db;

    use super::*;

    async fn queued_run(db: &sb_store::testing::TestDb) -> RunId {
        sb_store::testing::suite::create_run(db, None).await.id
    }

    #[tokio::test]
    async fn claims_made_together_are_each_won_once() {
        let db = sqlite_memory_db().await;
        let (a, b) = (queued_run(&db).await, queued_run(&db).await);
        let ledger = db.stores.runs.as_ref();
        let answers = claim_together(ledger, &[a, b, a, RunId::new()], "w1").await;
        let answers: Vec<bool> = answers.into_iter().map(Result::unwrap).collect();
        assert_eq!(answers, [true, true, false, false]);
        let again = claim_together(ledger, &[b], "w2").await;
        assert!(!again[0].as_ref().unwrap());
        let run = db.stores.runs.get_run(a).await.unwrap().unwrap();
        assert_eq!(run.status, RunStatus::Running);
        assert_eq!(run.worker_id.as_deref(), Some("w1"));
    }

    #[tokio::test]
    async fn a_failed_batch_is_claimed_one_by_one() {
        let db = sqlite_memory_db().await;
        let run = queued_run(&db).await;
        // An empty worker id fails the statement for every claim; alone, each fails too.
        let answers = claim_together(db.stores.runs.as_ref(), &[run, run], "").await;
        assert!(answers[0].is_err());
        assert!(!answers[1].as_ref().unwrap());
    }

    #[tokio::test]
    async fn concurrent_claims_are_answered_each() {
        let db = sqlite_memory_db().await;
        let claims = Claims::start(Arc::clone(&db.stores.runs), "w1".into());
        let mut runs = Vec::new();
        for _ in 0..8 {
            runs.push(queued_run(&db).await);
        }
        let answers = futures::future::join_all(runs.iter().map(|run| claims.claim(*run))).await;
        assert!(answers.into_iter().all(|a| a.unwrap().unwrap()));
        assert!(!claims.claim(runs[0]).await.unwrap().unwrap());
    }
}
