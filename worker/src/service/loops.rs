//! The worker's loops: one consume loop per runs queue, the control queue's loop, and the
//! drain that ends them ([`supervise`] is the worker's life, spawned by
//! `Worker::spawn_with`). Each loop only pulls, hands a job to its own task
//! (`job`), and settles; the decisions live elsewhere.
//!
//! # Slots and prefetch
//! Each pool is consumed with `prefetch = slots`, and a slot (semaphore permit) is taken
//! *before* the next delivery is pulled, so at most `slots` jobs execute and the deliveries
//! the broker buffers for this worker never exceed its free slots.
//!
//! # Shutdown (STYLE §3.6)
//! Stop pulling jobs → in-flight runs get `worker.drain_timeout` → the rest are cancelled
//! (they end as `run.failed cancelled` after `worker.cancel_grace`) → runs still going after
//! that are abandoned: their deliveries are nacked (requeued, so the redelivery finalizes them
//! `interrupted`), their leases released, and each is logged → subscriptions dropped (buffered
//! jobs go back to the queue) → runner processes shut down.

use std::sync::Arc;
use std::time::Duration;

use sb_common::bus::{BusError, Settlement, Subscription};
use sb_common::config::WorkerConfig;
use sb_protocol::error::HasErrorCode;
use sb_protocol::ids::RunId;
use sb_protocol::messages::{ControlMessage, decode};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;

use super::decisions::settlement_for;
use super::job::Core;

/// After cancelling the runs left at the drain deadline, extra time (beyond the cancel grace)
/// for their terminal item to be published and their job acked.
const CANCEL_SETTLE: Duration = Duration::from_secs(2);
/// After forcing the last runs, how long their tasks get to nack and release their leases.
const FORCE_SETTLE: Duration = Duration::from_secs(5);
/// Pause after a transient consume error before pulling again.
const CONSUME_ERROR_PAUSE: Duration = Duration::from_millis(500);

/// What the drain had to do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerReport {
    /// Runs cancelled because they were still in flight at the drain deadline.
    pub cancelled_runs: Vec<RunId>,
    /// Runs abandoned because they did not end even after the cancel: their jobs were
    /// requeued (the redelivery finalizes them `interrupted`).
    pub forced_runs: Vec<RunId>,
}

/// The longest a worker's drain can take with this configuration: give `Shutdown::drain` at
/// least this much so the worker can finish cooperatively instead of being aborted.
#[must_use]
pub fn drain_budget(config: &WorkerConfig) -> Duration {
    config.drain_timeout
        + config.cancel_grace
        + CANCEL_SETTLE
        + FORCE_SETTLE
        + config.cancel_grace * 2
}

/// Pulls jobs while slots are free, until shutdown. Returns the subscription so that the
/// deliveries of running jobs stay settleable during the drain.
async fn consume_jobs(
    core: Arc<Core>,
    mut sub: Subscription,
    slots: Arc<Semaphore>,
    runs: TaskTracker,
) -> Subscription {
    loop {
        let permit = tokio::select! {
            biased;
            () = core.stop.cancelled() => break,
            permit = slots.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let delivery = tokio::select! {
            biased;
            () = core.stop.cancelled() => break,
            delivery = sub.next() => delivery,
        };
        match delivery {
            Ok(delivery) => {
                runs.spawn(
                    core.clone()
                        .handle_job(sub.queue().to_owned(), delivery, permit),
                );
            }
            Err(BusError::Closed) => {
                tracing::error!(queue = %sub.queue(), "job subscription closed; this worker takes no more jobs from it");
                break;
            }
            Err(error) => {
                tracing::warn!(queue = %sub.queue(), %error, "consuming jobs failed; retrying");
                tokio::time::sleep(CONSUME_ERROR_PAUSE).await;
            }
        }
    }
    sub
}

/// Follows `cancel.<run_id>` messages for the runs this worker holds (the control queue is
/// bound to every cancel once, at start: see "Cancel messages" in `startup`).
async fn consume_control(core: Arc<Core>, mut sub: Subscription, stop: CancellationToken) {
    loop {
        let delivery = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            delivery = sub.next() => delivery,
        };
        let delivery = match delivery {
            Ok(delivery) => delivery,
            Err(BusError::Closed) => {
                tracing::error!(
                    "control subscription closed; cancel messages no longer reach this worker"
                );
                break;
            }
            Err(error) => {
                tracing::warn!(%error, "consuming control messages failed; retrying");
                tokio::time::sleep(CONSUME_ERROR_PAUSE).await;
                continue;
            }
        };
        let settlement = match decode::<ControlMessage>(&delivery.body) {
            Ok(ControlMessage::Cancel { run_id, reason }) => {
                if core.request_cancel(run_id, reason.clone()) {
                    tracing::info!(%run_id, %reason, "cancel requested");
                } else {
                    tracing::debug!(%run_id, "cancel for a run this worker does not hold");
                }
                Settlement::Ack
            }
            Err(error) => {
                tracing::warn!(%error, "undecodable control message");
                settlement_for(error.code())
            }
        };
        let mut delivery = delivery;
        if let Err(error) = delivery.settle(settlement).await {
            tracing::debug!(%error, "settling a control message failed");
        }
    }
}

/// The worker's life: consume until shutdown, then drain.
pub(super) async fn supervise(
    core: Arc<Core>,
    jobs: Vec<Subscription>,
    control: Subscription,
) -> WorkerReport {
    let runs = TaskTracker::new();
    let slots = Arc::new(Semaphore::new(core.config.slots.get() as usize));
    let consumers: Vec<JoinHandle<Subscription>> = jobs
        .into_iter()
        .map(|sub| {
            tokio::spawn(
                consume_jobs(core.clone(), sub, slots.clone(), runs.clone()).in_current_span(),
            )
        })
        .collect();
    let control_stop = CancellationToken::new();
    let control_task = tokio::spawn(
        consume_control(core.clone(), control, control_stop.clone()).in_current_span(),
    );

    core.stop.cancelled().await;
    tracing::info!(
        active = core.active_ids().len(),
        "worker draining: no new jobs"
    );
    let mut subscriptions = Vec::new();
    for consumer in consumers {
        match consumer.await {
            Ok(sub) => subscriptions.push(sub),
            Err(error) => tracing::error!(%error, "job consumer failed"),
        }
    }
    let report = drain(&core, &runs).await;
    control_stop.cancel();
    let _ = control_task.await;
    // Jobs buffered for this worker but never started go back to their queue.
    drop(subscriptions);
    let grace = core.config.cancel_grace;
    futures::future::join_all(core.hosts.values().map(|host| host.shutdown(grace))).await;
    tracing::info!(
        cancelled = report.cancelled_runs.len(),
        forced = report.forced_runs.len(),
        "worker stopped"
    );
    report
}

/// Waits for in-flight runs (drain timeout), cancels the rest, then abandons what is left.
async fn drain(core: &Core, runs: &TaskTracker) -> WorkerReport {
    let mut report = WorkerReport::default();
    runs.close();
    if tokio::time::timeout(core.config.drain_timeout, runs.wait())
        .await
        .is_ok()
    {
        return report;
    }
    report.cancelled_runs = core.active_ids();
    for run_id in &report.cancelled_runs {
        tracing::warn!(%run_id, drain_timeout = ?core.config.drain_timeout, "run still in flight at the drain deadline; cancelling it");
        core.request_cancel(*run_id, "worker shutting down".to_owned());
    }
    if tokio::time::timeout(core.config.cancel_grace + CANCEL_SETTLE, runs.wait())
        .await
        .is_ok()
    {
        return report;
    }
    report.forced_runs = core.active_ids();
    for run_id in &report.forced_runs {
        tracing::warn!(%run_id, "run did not end after its cancel; forcing it (job requeued, lease released)");
    }
    core.force.cancel();
    if tokio::time::timeout(FORCE_SETTLE, runs.wait())
        .await
        .is_err()
    {
        tracing::error!(runs = ?core.active_ids(), "run tasks did not stop after being forced");
    }
    report
}
