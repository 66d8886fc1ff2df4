//! The reaper: finalizes the runs nobody else will end (SPEC §11, issue 15 finding 6).
//!
//! The worker enforces deadlines itself and the result sink ends a run at its terminal item;
//! the reaper is the safety net for the runs where neither happens. Each scan finalizes:
//!
//! 1. runs still active past `deadline + grace` as `timeout` (the worker died, or its
//!    terminal item never arrived);
//! 2. runs without a deadline still active `limits.run_max_duration` after their creation as
//!    `timeout`, so no run lives forever;
//! 3. runs `running` in the ledger whose worker lease has been missing for longer than the
//!    grace as `interrupted`: their worker died and their job is not redelivered (or was
//!    dropped). A live worker renews its lease every heartbeat and puts it back when the
//!    session store lost it ([`sb_common::session`], "A store that comes back empty"), so a
//!    lease is missing for longer than a heartbeat only when its holder is gone — or when the
//!    worker finished and handed the run to a result sink that lags (its terminal item is on
//!    the bus: [`run_handed_off_key`] marks that, and such a run is left to the sink). The first
//!    time a scan saw each run without a lease is kept in memory ([`LeaseWatch`]); a restarted
//!    orchestrator starts counting again, which only delays a finalization.
//!
//! A reaped run's worker, if it still executes it, is sent a cancel (`cancel.<run_id>`).
//! Every finalization goes through [`ResultSink::finalize`]: the host-made terminal item
//! and the terminal status are one ledger commit, a run whose own terminal item is already
//! stored ends with that one, and the session is ended with its dropped steering audited.
//! So a run has exactly one terminal item even when its worker finishes at the same moment,
//! and among several orchestrators exactly one finalizes it.
//!
//! Each scan also sweeps the conversations with parked events
//! ([`Conversations::sweep`](crate::conversations::Conversations::sweep)), the safety net
//! of the `enqueue` policy.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use sb_common::bus::PublishOptions;
use sb_common::bus::topology::control_routing_key;
use sb_common::session::{run_handed_off_key, run_lease_key};
use sb_common::shutdown::Shutdown;
use sb_protocol::error::run_failure;
use sb_protocol::ids::RunId;
use sb_protocol::messages::{self, ControlMessage};
use sb_protocol::result::AgentRunResult;
use sb_store::{RunOutcome, RunRecord, RunStatus};

use crate::conversations::Conversations;
use crate::deps::{OrchestratorDeps, OrchestratorOptions};
use crate::error::Result;
use crate::lock;
use crate::sink::ResultSink;

/// The message of a run reaped after its deadline.
pub const TIMEOUT_MESSAGE: &str = "run exceeded its deadline";
/// The message of a run without a deadline reaped at the deployment's maximum duration.
pub const MAX_DURATION_MESSAGE: &str =
    "run exceeded the deployment's maximum run duration (limits.run_max_duration)";
/// The message of a run whose worker lease expired.
pub const LEASE_EXPIRED_MESSAGE: &str = "the worker executing the run was lost (its lease expired)";

/// Runs read per page when looking for expired leases.
const LEASE_PAGE: i64 = 100;

/// When each `running` run was first seen without a worker lease (module docs, step 3).
#[derive(Debug, Default)]
pub struct LeaseWatch {
    missing_since: HashMap<RunId, DateTime<Utc>>,
}

impl LeaseWatch {
    /// Records what one scan saw of `run` (`leased`: its lease has a holder) at `now` and
    /// decides: `true` once the lease has been missing for at least `grace`.
    pub fn observe(
        &mut self,
        run: RunId,
        leased: bool,
        now: DateTime<Utc>,
        grace: chrono::Duration,
    ) -> bool {
        if leased {
            self.missing_since.remove(&run);
            return false;
        }
        let since = *self.missing_since.entry(run).or_insert(now);
        now - since >= grace
    }

    /// Forgets the runs a scan no longer saw `running` (they ended, or were finalized).
    pub fn retain(&mut self, running: &std::collections::HashSet<RunId>) {
        self.missing_since.retain(|run, _| running.contains(run));
    }
}

/// Finalizes overdue, over-long and lease-expired runs.
#[derive(Debug)]
pub struct Reaper {
    deps: OrchestratorDeps,
    options: Arc<OrchestratorOptions>,
    sink: Arc<ResultSink>,
    conversations: Conversations,
    leases: Mutex<LeaseWatch>,
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
            leases: Mutex::new(LeaseWatch::default()),
        }
    }

    fn grace(&self) -> chrono::Duration {
        chrono::Duration::from_std(self.options.session_grace).unwrap_or(chrono::Duration::zero())
    }

    /// One scan (module docs, steps 1–3): finalizes up to `reaper_batch` runs per step.
    /// Returns the runs this call finalized.
    pub async fn reap_once(&self) -> Result<Vec<RunId>> {
        let now = Utc::now();
        let mut reaped = Vec::new();

        let overdue = self
            .deps
            .stores
            .runs
            .runs_past_deadline(now - self.grace(), self.options.reaper_batch)
            .await?;
        for run in overdue {
            if self
                .finalize(
                    &run,
                    RunStatus::Timeout,
                    run_failure::TIMEOUT,
                    TIMEOUT_MESSAGE,
                )
                .await?
            {
                reaped.push(run.id);
            }
        }

        let max = chrono::Duration::from_std(self.options.run_max_duration)
            .unwrap_or(chrono::Duration::MAX);
        let over_long = self
            .deps
            .stores
            .runs
            .runs_without_deadline_created_before(
                now.checked_sub_signed(max)
                    .unwrap_or(DateTime::<Utc>::MIN_UTC),
                self.options.reaper_batch,
            )
            .await?;
        for run in over_long {
            if self
                .finalize(
                    &run,
                    RunStatus::Timeout,
                    run_failure::TIMEOUT,
                    MAX_DURATION_MESSAGE,
                )
                .await?
            {
                reaped.push(run.id);
            }
        }

        for run in self.lease_expired(now).await? {
            if self
                .finalize(
                    &run,
                    RunStatus::Interrupted,
                    run_failure::INTERRUPTED,
                    LEASE_EXPIRED_MESSAGE,
                )
                .await?
            {
                reaped.push(run.id);
            }
        }
        Ok(reaped)
    }

    /// The `running` runs whose lease has been missing for at least the grace (step 3), at
    /// most `reaper_batch`.
    async fn lease_expired(&self, now: DateTime<Utc>) -> Result<Vec<RunRecord>> {
        let mut running = std::collections::HashSet::new();
        let mut expired = Vec::new();
        let mut cursor = None;
        loop {
            let page = self
                .deps
                .stores
                .runs
                .runs_with_status(RunStatus::Running, cursor, Some(LEASE_PAGE))
                .await?;
            for run in page.items {
                running.insert(run.id);
                let sessions = &self.deps.sessions;
                // A run whose worker handed it off (terminal item published) waits for the
                // sink, however long its lease has been gone.
                let leased = sessions
                    .lease_holder(&run_lease_key(&run.id))
                    .await?
                    .is_some()
                    || sessions.get(&run_handed_off_key(&run.id)).await?.is_some();
                let gone = lock(&self.leases).observe(run.id, leased, now, self.grace());
                if gone && (expired.len() as u64) < self.options.reaper_batch {
                    expired.push(run);
                }
            }
            match page.next_cursor {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        lock(&self.leases).retain(&running);
        Ok(expired)
    }

    /// Finalizes one run through the sink; `true` if this call ended it.
    async fn finalize(
        &self,
        run: &RunRecord,
        status: RunStatus,
        code: &str,
        message: &str,
    ) -> Result<bool> {
        let outcome = RunOutcome::with_error(status, code, message);
        let result =
            AgentRunResult::run_failed(code, message, run_failure::default_retryable(code));
        match self.sink.finalize(run, outcome, result).await? {
            Some(sequence) => {
                tracing::warn!(run_id = %run.id, sequence, status = status.as_str(), reason = message, "run reaped");
                self.cancel_on_worker(run.id, message).await;
                Ok(true)
            }
            None => Ok(false), // someone else ended it meanwhile
        }
    }

    /// Tells a worker that may still execute a reaped run (one past the deployment maximum
    /// is usually alive) to stop it. Best effort: its late terminal item is refused by the
    /// ledger anyway (one terminal item per run), and a worker without a lease stops on its
    /// own at its next heartbeat.
    async fn cancel_on_worker(&self, run_id: RunId, reason: &str) {
        let message = ControlMessage::Cancel {
            run_id,
            reason: reason.to_owned(),
        };
        if let Err(error) = self
            .deps
            .bus
            .publish(
                &self.deps.topology.control_exchange(),
                &control_routing_key(&run_id),
                messages::encode(&message).into(),
                PublishOptions::best_effort(),
            )
            .await
        {
            tracing::debug!(%run_id, %error, "could not publish the cancel of a reaped run");
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_counts_as_expired_only_after_missing_for_the_grace() {
        let mut watch = LeaseWatch::default();
        let run = RunId::new();
        let grace = chrono::Duration::seconds(15);
        let t0 = Utc::now();
        // Missing at one scan (a session store that just came back empty): not yet.
        assert!(!watch.observe(run, false, t0, grace));
        assert!(!watch.observe(run, false, t0 + chrono::Duration::seconds(14), grace));
        // Re-established by its worker: the count starts again.
        assert!(!watch.observe(run, true, t0 + chrono::Duration::seconds(16), grace));
        assert!(!watch.observe(run, false, t0 + chrono::Duration::seconds(20), grace));
        assert!(watch.observe(run, false, t0 + chrono::Duration::seconds(35), grace));
        // A run no longer running is forgotten.
        watch.retain(&std::collections::HashSet::new());
        assert!(!watch.observe(run, false, t0 + chrono::Duration::seconds(36), grace));
    }
}
