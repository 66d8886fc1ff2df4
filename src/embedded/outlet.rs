//! The worker's result outlet in a process that runs a worker: the result sink itself
//! ([`ResultSink::store`]), over the same ledger, session store and bus, so a run's items are
//! stored, applied and delivered without a trip through the results queue
//! (`sb_worker::outlet` has the contract and why).
//!
//! This is where the two roles meet, in the binary that composes them: the worker crate
//! defines the seam and the orchestrator crate the sink, and neither depends on the other.

use async_trait::async_trait;
use sb_orchestrator::sink::ResultSink;
use sb_protocol::error::{Disposition, HasErrorCode};
use sb_protocol::messages::ResultMessage;
use sb_worker::outlet::{OutletError, ResultOutlet};

/// A [`ResultOutlet`] over a result sink of this process.
#[derive(Debug)]
pub(super) struct SinkOutlet {
    sink: ResultSink,
}

impl SinkOutlet {
    pub(super) fn new(sink: ResultSink) -> Self {
        Self { sink }
    }
}

#[async_trait]
impl ResultOutlet for SinkOutlet {
    /// Stores the items with the sink. What the sink fails with for now (an unreachable
    /// ledger, session store or bus) is [`OutletError::Unavailable`]; what it would never
    /// take (the run is not in the ledger) is [`OutletError::Refused`], and the worker sends
    /// it by the results queue, where the sink's consumer settles it as it settles any
    /// delivery, dead letters included.
    async fn hand_over(
        &self,
        messages: &[ResultMessage],
        retried: bool,
    ) -> Result<(), OutletError> {
        match self.sink.store(messages.to_vec(), retried).await {
            Ok(()) => Ok(()),
            Err(error) if error.code().disposition() == Disposition::Retry => {
                Err(OutletError::Unavailable(error.to_string()))
            }
            Err(error) => Err(OutletError::Refused(error.to_string())),
        }
    }
}
