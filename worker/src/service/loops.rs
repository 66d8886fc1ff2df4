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

use sb_common::bus::consumer::{settle, settle_outcome};
use sb_common::bus::{QueueSpec, Settlement, Subscription};
use sb_common::config::WorkerConfig;
use sb_protocol::ids::RunId;
use sb_protocol::messages::{ControlMessage, decode};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;

use super::job::Core;

/// After cancelling the runs left at the drain deadline, extra time (beyond the cancel grace)
/// for their terminal item to be published and their job acked.
const CANCEL_SETTLE: Duration = Duration::from_secs(2);
/// After forcing the last runs, how long their tasks get to nack and release their leases.
const FORCE_SETTLE: Duration = Duration::from_secs(5);

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

/// A queue the worker consumes, subscribed at startup (so that a missing queue fails the
/// start rather than the first pull).
pub(super) struct Subscribed {
    /// The queue, as every resubscription declares it again.
    pub queue: QueueSpec,
    /// Deliveries the broker may hand over before they are settled.
    pub prefetch: u16,
    /// The subscription made at startup.
    pub subscription: Subscription,
}

/// Pulls jobs one at a time, each handed to its own task once a slot is free, until
/// shutdown (the shared loop, `ConsumeLoop`). Returns the subscription so that the
/// deliveries of running jobs stay settleable during the drain.
async fn consume_jobs(
    core: Arc<Core>,
    consumer: Subscribed,
    slots: Arc<Semaphore>,
    runs: TaskTracker,
) -> Option<Subscription> {
    let Subscribed {
        queue,
        prefetch,
        subscription,
    } = consumer;
    core.consume_loop(&queue, prefetch, 1)
        .run(Some(subscription), &core.stop, |batch| {
            let (core, slots, runs, queue) = (&core, &slots, &runs, &queue.name);
            async move {
                for delivery in batch {
                    // The next delivery waits here, not in the broker's buffer: at most
                    // `slots` jobs execute, and the prefetch bounds what waits.
                    let permit = tokio::select! {
                        biased;
                        () = core.stop.cancelled() => None,
                        permit = slots.clone().acquire_owned() => permit.ok(),
                    };
                    match permit {
                        Some(permit) => {
                            runs.spawn(core.clone().handle_job(queue.clone(), delivery, permit));
                        }
                        // Stopping: the job goes back to its queue for another worker.
                        None => {
                            let requeue = Settlement::Nack { requeue: true };
                            settle(delivery, requeue, queue, &core.retry(), &core.stop).await;
                        }
                    }
                }
            }
        })
        .await
}

/// Follows `cancel.<run_id>` messages for the runs this worker holds (the control queue is
/// bound to every cancel once, at start: see "Cancel messages" in `startup`).
async fn consume_control(core: Arc<Core>, consumer: Subscribed, stop: CancellationToken) {
    let Subscribed {
        queue,
        prefetch,
        subscription,
    } = consumer;
    core.consume_loop(&queue, prefetch, usize::from(prefetch))
        .run(Some(subscription), &stop, |batch| {
            let (core, stop, queue) = (&core, &stop, &queue.name);
            async move {
                for delivery in batch {
                    let outcome = decode::<ControlMessage>(&delivery.body).map(|message| {
                        let ControlMessage::Cancel { run_id, reason } = message;
                        if core.request_cancel(run_id, reason.clone()) {
                            tracing::info!(%run_id, %reason, "cancel requested");
                        } else {
                            tracing::debug!(%run_id, "cancel for a run this worker does not hold");
                        }
                    });
                    settle_outcome(delivery, &outcome, queue, &core.retry(), stop).await;
                }
            }
        })
        .await;
}

/// The worker's life: consume until shutdown, then drain.
pub(super) async fn supervise(
    core: Arc<Core>,
    jobs: Vec<Subscribed>,
    control: Subscribed,
) -> WorkerReport {
    let runs = TaskTracker::new();
    let slots = Arc::new(Semaphore::new(core.config.slots.get() as usize));
    let consumers: Vec<JoinHandle<Option<Subscription>>> = jobs
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
            Ok(sub) => subscriptions.extend(sub),
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
