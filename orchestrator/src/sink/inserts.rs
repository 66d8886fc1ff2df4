//! Step 2's ledger inserts, group-committed across the sink's shards: the batches the shard
//! loops of one process insert at the same moment share one [`RunLedger::insert_events`]
//! call, so under load a sink batch no longer costs a transaction of its own. A batch alone
//! costs what a direct call costs ([`sb_common::group_commit`]: nothing waits for more).
//!
//! Order is kept: a run's results go to one shard, whose loop awaits each insert before it
//! takes its next batch, so two batches of one run are never in one call, and rows of other
//! runs beside them change nothing about a run's own rows.

use std::sync::Arc;

use sb_common::group_commit::GroupCommit;
use sb_store::{NewRunEvent, RunLedger};

/// Most shard batches one call carries (the ledger splits a call's rows into chunks).
const MAX_BATCHES_PER_CALL: usize = 16;

/// The submitting side of the sink's shared inserts. Cheap to clone.
#[derive(Clone, Debug)]
pub(super) struct Inserts {
    group: GroupCommit<Vec<NewRunEvent>, Option<Vec<bool>>>,
}

impl Inserts {
    /// Starts the inserting task on the current Tokio runtime.
    ///
    /// # Panics
    /// Outside a Tokio runtime.
    pub(super) fn start(ledger: Arc<dyn RunLedger>) -> Self {
        let group = GroupCommit::spawn(MAX_BATCHES_PER_CALL, move |batches| {
            let ledger = Arc::clone(&ledger);
            async move { insert_together(ledger.as_ref(), batches).await }
        });
        Self { group }
    }

    /// Inserts `rows` in the next shared call: whether each row is new, as
    /// [`RunLedger::insert_events`] answers; `None` when that call failed (or the task is
    /// gone), and the caller inserts item by item, each with its own answer.
    pub(super) async fn insert(&self, rows: Vec<NewRunEvent>) -> Option<Vec<bool>> {
        self.group.submit(rows).await.ok().flatten()
    }
}

/// One answer per batch, in order: its rows' flags, cut from one call over all the rows.
async fn insert_together(
    ledger: &dyn RunLedger,
    batches: Vec<Vec<NewRunEvent>>,
) -> Vec<Option<Vec<bool>>> {
    let sizes: Vec<usize> = batches.iter().map(Vec::len).collect();
    let rows: Vec<NewRunEvent> = batches.into_iter().flatten().collect();
    let total = rows.len();
    match ledger.insert_events(rows).await {
        Ok(flags) if flags.len() == total => {
            let mut flags = flags.into_iter();
            sizes
                .iter()
                .map(|&n| Some(flags.by_ref().take(n).collect()))
                .collect()
        }
        Ok(_) => vec![None; sizes.len()],
        Err(error) => {
            tracing::debug!(%error, batches = sizes.len(), "shared ledger insert failed; inserting item by item");
            vec![None; sizes.len()]
        }
    }
}
