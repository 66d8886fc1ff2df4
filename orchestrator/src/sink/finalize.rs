//! Host-made run ends (reaper, embedded recovery) through the one finalize of
//! [`sb_lifecycle`]: the sink is its hand-over, applying the terminal item's side effects and
//! publishing it for live delivery.

use async_trait::async_trait;
use sb_lifecycle::{Finalizer, HandOver, Origin, RunRef, SessionEnd};
use sb_protocol::messages::ResultMessage;
use sb_protocol::result::AgentRunResult;
use sb_store::{RunOutcome, RunRecord};

use super::{ResultSink, Written};
use crate::error::{OrchestratorError, Result};
use crate::journal;

impl ResultSink {
    /// Finalizes `run` with a host-made terminal item: the reaper's `timeout` (deadline,
    /// deployment maximum) or `interrupted` (lost lease), the embedded recovery's
    /// `interrupted`. The steps, the one-terminal-item rule and the session's end are
    /// [`Finalizer::finalize`]'s; a run whose own terminal item is already stored ends with
    /// that one (an item is stored before its side effects, so a run whose terminal item was
    /// stored but never applied still looks active).
    ///
    /// Returns the sequence of the terminal item that ended the run, or `None` when the run
    /// had already ended (someone else finalized it; nothing is done).
    pub async fn finalize(
        &self,
        run: &RunRecord,
        outcome: RunOutcome,
        result: AgentRunResult,
    ) -> Result<Option<u64>> {
        let stores = &self.deps.stores;
        let finalizer = Finalizer {
            ledger: stores.runs.as_ref(),
            events: stores.events.as_ref(),
            sessions: self.deps.sessions.as_ref(),
        };
        let run_ref = RunRef {
            run_id: run.id,
            runner_id: &run.runner_id,
            workspace_id: &run.workspace_id,
        };
        let hand_over = ApplyAndDeliver { sink: self, run };
        match finalizer
            .finalize(run_ref, outcome, result, SessionEnd::Host, &hand_over)
            .await
        {
            Ok(ended) => Ok(ended.map(|ended| ended.sequence)),
            Err(sb_lifecycle::FinalizeError::Ledger(error)) => Err(error.into()),
            Err(sb_lifecycle::FinalizeError::HandOver { error, .. }) => Err(error),
        }
    }
}

/// The sink's hand-over: apply the terminal item, then publish it for live delivery.
struct ApplyAndDeliver<'a> {
    sink: &'a ResultSink,
    run: &'a RunRecord,
}

#[async_trait]
impl HandOver for ApplyAndDeliver<'_> {
    type Error = OrchestratorError;

    /// Applies the item and publishes it for live delivery. The delivery is best effort,
    /// like every live delivery: the item is stored and applied, and a stream that misses it
    /// reads it from the ledger.
    async fn hand_over(&self, sequence: u64, item: AgentRunResult, origin: Origin) -> Result<()> {
        let (sink, run) = (self.sink, self.run);
        let message = ResultMessage::new(
            run.id,
            run.workspace_id.clone(),
            run.conversation_id.clone(),
            sequence,
            item,
        )
        .with_run(Some(super::facts_of_row(run)));
        let info = sink.facts_of(&message).await?;
        let plan = journal::plan_item(&message.result);
        sink.apply(&info, &message, &plan, Written::default())
            .await?;
        let stored = sb_store::ItemJson::of(&message.result);
        if let Err(error) = sink
            .deps
            .bus
            .publish_batch(vec![sink.outgoing(&[(&message, stored.as_raw())])])
            .await
        {
            tracing::warn!(run_id = %run.id, %error, origin = origin.as_str(), "live delivery of a terminal item failed");
        }
        Ok(())
    }
}
