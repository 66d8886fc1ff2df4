//! Host-made run ends: finishing a run from the terminal item its ledger already holds,
//! and finalizing it with a terminal item of the host's own (reaper, recovery).

use sb_common::telemetry::{Metrics, names};
use sb_protocol::messages::ResultMessage;
use sb_protocol::result::AgentRunResult;
use sb_store::{Finalized, RunOutcome, RunRecord, audit};

use super::{ResultSink, Written};
use crate::error::Result;
use crate::journal;

impl ResultSink {
    /// Finishes `run` from a terminal item already in its ledger, if there is one: applies it
    /// again (every side effect is idempotent, see the module docs) and publishes it for live
    /// delivery. Returns its sequence, or `None` when the ledger holds no terminal item.
    ///
    /// The reaper calls this before making a terminal item of its own: an item is stored
    /// (step 2) before its side effects, so a run whose terminal item was stored but never
    /// applied (its delivery dead-lettered) still looks active, and a second, host-made
    /// terminal item would end it twice.
    pub async fn finish_from_ledger(&self, run: &RunRecord) -> Result<Option<u64>> {
        let Some((sequence, result)) = self
            .stored_items(run.id)
            .await?
            .into_iter()
            .find(|(_, result)| result.is_terminal())
        else {
            return Ok(None);
        };
        self.apply_and_deliver(run, sequence, result, "stored")
            .await?;
        Ok(Some(sequence))
    }

    /// Applies `run`'s terminal item `result`, stored at `sequence` without any of its side
    /// effects, and publishes it for live delivery. The delivery is best effort, like every
    /// live delivery: the item is stored and applied, and a stream that misses it reads it
    /// from the ledger. `origin` names the item in the log (`stored`, `host-made`).
    async fn apply_and_deliver(
        &self,
        run: &RunRecord,
        sequence: u64,
        result: AgentRunResult,
        origin: &str,
    ) -> Result<()> {
        let message = ResultMessage::new(
            run.id,
            run.workspace_id.clone(),
            run.conversation_id.clone(),
            sequence,
            result,
        )
        .with_run(Some(super::facts_of_row(run)));
        let info = self.facts_of(&message).await?;
        let plan = journal::plan_item(&message.result);
        self.apply(&info, &message, &plan, Written::default())
            .await?;
        if let Err(error) = self
            .deps
            .bus
            .publish_batch(vec![self.outgoing(&[&message])])
            .await
        {
            tracing::warn!(run_id = %run.id, %error, origin, "live delivery of a terminal item failed");
        }
        Ok(())
    }

    /// Finalizes `run` with a host-made terminal item: the reaper's `timeout` (deadline,
    /// deployment maximum) or `interrupted` (lost lease), the embedded recovery's
    /// `interrupted`. The one way the orchestrator's side ends a run that its worker did not:
    ///
    /// 1. the ledger stores the item at the first free sequence **and** the terminal status
    ///    in one commit ([`RunLedger::finalize_run`](sb_store::RunLedger::finalize_run)), so
    ///    a stream reader never sees the status without the item; if the run's own terminal
    ///    item is already stored, that one ends the run instead ([`Self::finish_from_ledger`]),
    ///    so a run has exactly one terminal item whatever races;
    /// 2. the item's side effects are applied and it is published for live delivery;
    /// 3. the run's session is ended (Host API calls for it are refused) and the steering
    ///    items it never pulled are audited as `steering.dropped`.
    ///
    /// Returns the sequence of the terminal item that ended the run, or `None` when the run
    /// had already ended (someone else finalized it; nothing is done).
    pub async fn finalize(
        &self,
        run: &RunRecord,
        outcome: RunOutcome,
        result: AgentRunResult,
    ) -> Result<Option<u64>> {
        let status = outcome.status;
        let sequence = match self
            .deps
            .stores
            .runs
            .finalize_run(run.id, outcome, result.clone())
            .await?
        {
            Finalized::AlreadyEnded(_) => return Ok(None),
            Finalized::TerminalStored { .. } => self.finish_from_ledger(run).await?,
            Finalized::Ended { sequence } => {
                Metrics::global().inc(names::RUNS_TOTAL, &[("status", status.as_str())]);
                let result = result.with_run_id(run.id).with_sequence(sequence);
                self.apply_and_deliver(run, sequence, result, "host-made")
                    .await?;
                Some(sequence)
            }
        };
        self.end_session(run).await;
        Ok(sequence)
    }

    /// Ends `run`'s session and audits the steering items it never pulled.
    async fn end_session(&self, run: &RunRecord) {
        match self.deps.sessions.end_session(&run.id).await {
            Ok(Some(ended)) => {
                for item in &ended.steering {
                    let row = audit::steering_dropped(
                        item,
                        run.id,
                        &run.runner_id,
                        &run.workspace_id,
                        audit::DROPPED_RUN_ENDED,
                    );
                    if let Err(error) = self.deps.stores.events.append(row, Vec::new()).await {
                        tracing::warn!(run_id = %run.id, %error, "could not audit a dropped steering item");
                    }
                }
            }
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(run_id = %run.id, %error, "could not end the session of a finalized run; it expires with its ttl");
            }
        }
    }
}
