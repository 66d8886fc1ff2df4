//! The deadline reaper: finalizes runs still active past `deadline + grace` as `timeout`
//! (SPEC §11).
//!
//! The worker enforces deadlines itself; the reaper is the safety net for a run whose
//! worker died or whose terminal result never arrived. Per overdue run:
//!
//! 0. if the run's ledger already holds a terminal item (stored, but its side effects never
//!    applied), that item finishes the run ([`ResultSink::finish_from_ledger`]) and steps 1
//!    and 2 are skipped: a run has exactly one terminal item;
//! 1. `finish_run(timeout)` — conditional, so among several orchestrators (and a late worker
//!    result) exactly one finalizes the run; the others skip it;
//! 2. the winner stores a synthetic terminal item `run.failed {code: "timeout"}` through the
//!    result sink ([`ResultSink::persist_synthetic`]: ledger, side effects, live delivery),
//!    so every stream of the run ends;
//! 3. it ends the run's session, so Host API calls still made for the run are refused, and
//!    audits the steering items the run never pulled as `steering.dropped`.
//!
//! Each scan also sweeps the conversations with parked events
//! ([`Conversations::sweep`](crate::conversations::Conversations::sweep)), the safety net
//! of the `enqueue` policy.

use std::sync::Arc;

use chrono::Utc;
use sb_common::shutdown::Shutdown;
use sb_protocol::error::run_failure;
use sb_protocol::result::AgentRunResult;
use sb_store::{RunOutcome, RunStatus, audit};

use crate::conversations::Conversations;
use crate::error::Result;
use crate::service::{OrchestratorDeps, OrchestratorOptions};
use crate::sink::ResultSink;

/// The message of a reaped run.
pub const TIMEOUT_MESSAGE: &str = "run exceeded its deadline";

/// Finalizes overdue runs.
#[derive(Debug)]
pub struct Reaper {
    deps: OrchestratorDeps,
    options: Arc<OrchestratorOptions>,
    sink: Arc<ResultSink>,
    conversations: Conversations,
}

impl Reaper {
    /// A reaper writing through `sink`.
    #[must_use]
    pub fn new(
        deps: OrchestratorDeps,
        options: Arc<OrchestratorOptions>,
        sink: Arc<ResultSink>,
    ) -> Self {
        let conversations = deps.conversations(&options);
        Self {
            deps,
            options,
            sink,
            conversations,
        }
    }

    /// One scan: finalizes up to `reaper_batch` runs whose deadline passed more than
    /// `session_grace` ago. Returns the runs this call finalized.
    pub async fn reap_once(&self) -> Result<Vec<sb_protocol::ids::RunId>> {
        let grace = chrono::Duration::from_std(self.options.session_grace)
            .unwrap_or(chrono::Duration::zero());
        let cutoff = Utc::now() - grace;
        let overdue = self
            .deps
            .stores
            .runs
            .runs_past_deadline(cutoff, self.options.reaper_batch)
            .await?;
        let mut reaped = Vec::new();
        for run in overdue {
            // The run's own terminal item may be stored without having been applied: it
            // ends the run (once), not a timeout of ours.
            let sequence = if let Some(sequence) = self.sink.finish_from_ledger(&run).await? {
                sequence
            } else {
                let outcome = RunOutcome::with_error(
                    RunStatus::Timeout,
                    run_failure::TIMEOUT,
                    TIMEOUT_MESSAGE,
                );
                if !self.deps.stores.runs.finish_run(run.id, outcome).await? {
                    continue; // someone else ended it meanwhile
                }
                let result = AgentRunResult::run_failed(
                    run_failure::TIMEOUT,
                    TIMEOUT_MESSAGE,
                    run_failure::default_retryable(run_failure::TIMEOUT),
                );
                self.sink.persist_synthetic(&run, result).await?
            };
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
                    tracing::warn!(run_id = %run.id, %error, "could not end the session of a reaped run; it expires with its ttl");
                }
            }
            tracing::warn!(run_id = %run.id, sequence, "run reaped after its deadline");
            reaped.push(run.id);
        }
        Ok(reaped)
    }

    /// Scans every `reaper_interval` until shutdown.
    pub async fn run(self, shutdown: Shutdown) {
        shutdown
            .every(self.options.reaper_interval, || async {
                if let Err(error) = self.reap_once().await {
                    tracing::warn!(%error, "reaper scan failed; retrying at the next tick");
                }
                match self.conversations.sweep().await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(released = n, "parked events released by the sweep"),
                    Err(error) => {
                        tracing::warn!(%error, "parked-queue sweep failed; retrying at the next tick");
                    }
                }
            })
            .await;
    }
}
