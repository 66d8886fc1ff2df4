//! The worker service: consumes run jobs, executes them on the runner hosts, publishes their
//! sequenced results, follows cancel messages, and drains on shutdown (SPEC §2 step 3, §3,
//! §4.4, §11).
//!
//! [`Worker::spawn_with`] starts a worker and returns its [`WorkerHandle`]; the worker runs
//! until the shutdown it was given is triggered, then drains and reports ([`WorkerReport`]).
//!
//! # Layout
//! This module only wires the others together; each concern has one home, and no module
//! uses one that uses it back (the shared types sit in modules of their own).
//! - `deps`: [`WorkerDeps`] and [`WorkerOptions`], what a worker is given.
//! - `error`: [`WorkerError`], why a worker could not start.
//! - `startup`: everything before the worker runs — plugins loaded, runners registered and
//!   hosted, topology declared, queues subscribed — and why one control binding takes every
//!   cancel message.
//! - `decisions`: the pure rules ([`settlement_for`], [`decide_claim_lost`],
//!   [`decide_pre_start`], [`decide_lost_lease`], result batching) with their unit tests,
//!   and why a redelivered job looks at the run's session.
//! - `claims`: the runs' claims, group-committed (the jobs received together claim their
//!   runs in one statement).
//! - `job`: the pipeline of one job, delivery to settlement (its diagram is there), and why
//!   the lease comes before the claim.
//! - `lease`: the run lease's key ([`lease_key`]) and the heartbeat that keeps it.
//! - `loops`: the consume loops (runs queues, control queue), slots and prefetch, and the
//!   drain on shutdown ([`drain_budget`]).

use std::sync::Arc;

use sb_common::error::ShutdownError;
use sb_common::shutdown::Shutdown;
use sb_protocol::ids::RunId;
use sb_protocol::manifest::RunnerId;
use tokio::task::JoinHandle;
use tracing::Instrument as _;

use self::job::Core;
use self::loops::supervise;
use self::startup::start;

mod claims;
mod decisions;
mod deps;
mod error;
mod job;
mod lease;
mod loops;
mod startup;

pub use self::decisions::{
    ClaimLost, LostLease, PreStart, decide_claim_lost, decide_lost_lease, decide_pre_start,
    settlement_for,
};
pub use self::deps::{WorkerDeps, WorkerOptions};
pub use self::error::WorkerError;
pub use self::lease::lease_key;
pub use self::loops::{WorkerReport, drain_budget};

/// A running worker.
#[derive(Debug)]
pub struct WorkerHandle {
    id: String,
    runners: Vec<RunnerId>,
    core: Arc<Core>,
    task: JoinHandle<WorkerReport>,
}

impl WorkerHandle {
    /// The worker id (lease holder, control queue name).
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The runners this worker hosts (and registered).
    #[must_use]
    pub fn runners(&self) -> &[RunnerId] {
        &self.runners
    }

    /// Runs this worker currently holds.
    #[must_use]
    pub fn active_runs(&self) -> Vec<RunId> {
        self.core.active_ids()
    }

    /// Waits until the worker has drained (after shutdown was triggered).
    pub async fn join(self) -> WorkerReport {
        match self.task.await {
            Ok(report) => report,
            Err(error) => {
                tracing::error!(worker_id = %self.id, %error, "worker task failed");
                WorkerReport::default()
            }
        }
    }
}

/// The worker role.
#[derive(Debug)]
pub struct Worker;

impl Worker {
    /// Starts a worker with the default options (bundled runners, the gate in front of
    /// [`ActionDispatcher`](sb_host_api::actions::ActionDispatcher)). See [`Worker::spawn_with`].
    pub async fn spawn(deps: WorkerDeps, shutdown: Shutdown) -> Result<WorkerHandle, WorkerError> {
        Self::spawn_with(deps, WorkerOptions::default(), shutdown).await
    }

    /// Makes the process non-dumpable (SPEC §14, see
    /// [`make_undumpable`](crate::runner::make_undumpable)), loads the runner plugins,
    /// registers the runners of this worker's pools in the `runners` table, declares the
    /// topology, starts consuming `switchboard.runs.<pool>` for every configured pool and the
    /// worker's control queue, and returns. The worker runs until `shutdown` is triggered,
    /// then drains (the `loops` module explains how); it is tracked by `shutdown` as task
    /// `worker <id>`.
    pub async fn spawn_with(
        deps: WorkerDeps,
        options: WorkerOptions,
        shutdown: Shutdown,
    ) -> Result<WorkerHandle, WorkerError> {
        if shutdown.is_shutting_down() {
            return Err(ShutdownError {
                task: "worker".into(),
            }
            .into());
        }
        let id = deps.config.worker.id_or_generate();
        let span = tracing::info_span!("worker", worker_id = %id);
        let (core, jobs, control, runners) = start(id.clone(), deps, options, &shutdown)
            .instrument(span.clone())
            .await?;
        let task = shutdown.spawn(
            format!("worker {id}"),
            supervise(core.clone(), jobs, control).instrument(span),
        )?;
        Ok(WorkerHandle {
            id,
            runners,
            core,
            task,
        })
    }
}
