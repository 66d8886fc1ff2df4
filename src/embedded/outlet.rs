//! The worker's result outlet in a process that runs a worker: the result sink itself
//! ([`ResultSink::store`]), over the same ledger, session store and bus, so a run's items are
//! stored, applied and delivered without a trip through the results queue
//! (`sb_worker::outlet` has the contract and why).
//!
//! The hand-overs of the worker's runs that are pending at the same moment are stored
//! together, as the deliveries of one consume are ([`sb_common::group_commit`]): one ledger
//! insert, one publish of their live deliveries. One run at a time costs what a direct call
//! costs; under load the batches grow by themselves.
//!
//! This is where the two roles meet, in the binary that composes them: the worker crate
//! defines the seam and the orchestrator crate the sink, and neither depends on the other.

use std::sync::Arc;

use async_trait::async_trait;
use sb_common::group_commit::GroupCommit;
use sb_orchestrator::OrchestratorError;
use sb_orchestrator::sink::ResultSink;
use sb_protocol::error::{Disposition, HasErrorCode};
use sb_protocol::messages::ResultMessage;
use sb_worker::outlet::{OutletError, ResultOutlet};

/// Most hand-overs one store carries: above any worker's slots.
const MAX_HAND_OVERS_PER_STORE: usize = 256;

/// A [`ResultOutlet`] over a result sink of this process.
#[derive(Debug)]
pub(super) struct SinkOutlet {
    group: GroupCommit<(Vec<ResultMessage>, bool), Result<(), OutletError>>,
}

impl SinkOutlet {
    /// An outlet storing with `sink`, its storing task started on the current Tokio runtime.
    pub(super) fn new(sink: ResultSink) -> Self {
        let sink = Arc::new(sink);
        let group = GroupCommit::spawn(MAX_HAND_OVERS_PER_STORE, move |handed| {
            let sink = Arc::clone(&sink);
            async move {
                sink.store(handed)
                    .await
                    .into_iter()
                    .map(|answer| answer.map_err(outlet_error))
                    .collect()
            }
        });
        Self { group }
    }
}

/// What the sink failed with for now (an unreachable ledger, session store or bus, or a
/// batch deferred behind such a failure) is [`OutletError::Unavailable`]; what it would never
/// take (the run is not in the ledger) is [`OutletError::Refused`], and the worker sends it by
/// the results queue, where the sink's consumer settles it as it settles any delivery, dead
/// letters included.
fn outlet_error(error: OrchestratorError) -> OutletError {
    if error.code().disposition() == Disposition::Retry {
        OutletError::Unavailable(error.to_string())
    } else {
        OutletError::Refused(error.to_string())
    }
}

#[async_trait]
impl ResultOutlet for SinkOutlet {
    async fn hand_over(
        &self,
        messages: &[ResultMessage],
        retried: bool,
    ) -> Result<(), OutletError> {
        self.group
            .submit((messages.to_vec(), retried))
            .await
            .map_err(|closed| OutletError::Unavailable(closed.to_string()))?
    }
}
