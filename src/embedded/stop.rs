//! The stop sequence of an embedded process (the parent module's docs, "Stop"): the roles
//! stop in pipeline order, each on its own [`Shutdown`], with the memory bus watched for
//! work still being handed from one role to the next.
//!
//! Kept apart from the start (the parent module), which builds the roles: this half only
//! takes what was started ([`Parts`]) down, and decides when the memory bus is idle.

use std::sync::Arc;
use std::time::Duration;

use sb_common::bus::Bus;
use sb_common::bus::memory::MemoryBus;
use sb_common::bus::topology::Topology;
use sb_common::config::SwitchboardConfig;
use sb_common::shutdown::{DrainReport, Shutdown};
use sb_store::SqlStore;
use sb_worker::WorkerReport;
use tokio::time::Instant;

use super::{GatewayRole, OrchestratorRole, Roles, WorkerRole};

/// Time the gateway gets to finish in-flight requests (streams end at once on shutdown).
const GATEWAY_DRAIN: Duration = Duration::from_secs(10);
/// Time the results of the worker's last runs get to be persisted (step 4 of the stop).
const RESULTS_SETTLE: Duration = Duration::from_secs(10);
/// Time the orchestrator's loops get to finish the message they are handling.
const ORCHESTRATOR_DRAIN: Duration = Duration::from_secs(10);
/// How often the queues are looked at while waiting for the pipeline to go idle.
const IDLE_POLL: Duration = Duration::from_millis(20);
/// Consecutive observations that count as idle (see [`wait_until`]).
const IDLE_CONFIRMATIONS: u32 = 2;

/// How the process stopped.
#[derive(Debug, Default)]
pub struct StopReport {
    /// A role that stopped on its own with an error (the gateway's server failing), which is
    /// what began the stop; `None` for a requested stop.
    pub failure: Option<String>,
    /// Step 2 of the stop: every accepted event was routed and every job taken by the worker
    /// before the drain timeout. `None` when the step does not apply (roles in separate
    /// processes).
    pub work_handed_over: Option<bool>,
    /// What the worker's own drain had to do.
    pub worker: Option<WorkerReport>,
    /// Tasks aborted at a role's drain deadline, as `<role>: <task>`.
    pub forced_tasks: Vec<String>,
}

impl StopReport {
    /// `true` when nothing failed and nothing had to be forced.
    #[must_use]
    pub fn is_clean(&self) -> bool {
        self.failure.is_none()
            && self.forced_tasks.is_empty()
            && self
                .worker
                .as_ref()
                .is_none_or(|w| w.cancelled_runs.is_empty() && w.forced_runs.is_empty())
    }
}

/// Everything the stop sequence needs.
pub(super) struct Parts {
    pub(super) config: Arc<SwitchboardConfig>,
    pub(super) roles: Roles,
    pub(super) sql: SqlStore,
    pub(super) bus: Arc<dyn Bus>,
    pub(super) memory_bus: Option<MemoryBus>,
    pub(super) topology: Topology,
    pub(super) gateway: Option<GatewayRole>,
    pub(super) orchestrator: Option<OrchestratorRole>,
    pub(super) worker: Option<WorkerRole>,
}

/// Waits for the trigger (or a role failing on its own), then runs the stop sequence.
pub(super) async fn supervise(mut parts: Parts, trigger: Shutdown) -> StopReport {
    let gateway_task = parts.gateway.as_mut().and_then(|g| g.task.as_mut());
    let failure = match gateway_task {
        Some(task) => tokio::select! {
            biased;
            _ = trigger.cancelled() => None,
            result = task => {
                let failure = match result {
                    Ok(Ok(())) => "the gateway stopped unexpectedly".to_owned(),
                    Ok(Err(error)) => format!("the gateway failed: {error}"),
                    Err(error) => format!("the gateway task failed: {error}"),
                };
                tracing::error!(%failure, "stopping the process");
                if let Some(gateway) = parts.gateway.as_mut() {
                    gateway.task = None;
                }
                trigger.trigger();
                Some(failure)
            }
        },
        None => {
            trigger.cancelled().await;
            None
        }
    };
    stop(parts, failure).await
}

/// The stop sequence (module docs, "Stop").
pub(super) async fn stop(parts: Parts, failure: Option<String>) -> StopReport {
    let mut report = StopReport {
        failure,
        ..StopReport::default()
    };
    tracing::info!(roles = %parts.roles.names(), "stopping");

    // 1. Ingest.
    if let Some(gateway) = parts.gateway {
        let drain = gateway.shutdown.drain(GATEWAY_DRAIN).await;
        note_forced(&mut report, "gateway", &drain);
        if let Some(task) = gateway.task {
            match task.await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, "the gateway stopped with an error"),
                Err(error) if error.is_cancelled() => {}
                Err(error) => tracing::warn!(%error, "the gateway task failed"),
            }
        }
        tracing::info!("gateway stopped");
    }

    // 2. Work already accepted: routed, and taken by the worker, while every consumer runs.
    let all_local = parts.worker.is_some() && parts.orchestrator.is_some();
    if let (Some(bus), true) = (&parts.memory_bus, all_local) {
        let budget = parts.config.worker.drain_timeout;
        let backlog = Backlog::of(&parts.topology);
        let handed_over = wait_until(budget, || backlog.count(bus) == 0).await;
        if handed_over {
            tracing::info!("every accepted event was routed and its run started");
        } else {
            tracing::warn!(
                backlog = backlog.count(bus),
                ?budget,
                "events or jobs were still waiting at the drain timeout; they resume at the next start"
            );
        }
        report.work_handed_over = Some(handed_over);
    }

    // 3. The worker: stops taking jobs, drains its runs.
    if let Some(worker) = parts.worker {
        worker.shutdown.trigger();
        let worker_report = worker.handle.join().await;
        if !worker_report.cancelled_runs.is_empty() || !worker_report.forced_runs.is_empty() {
            tracing::warn!(
                cancelled = worker_report.cancelled_runs.len(),
                forced = worker_report.forced_runs.len(),
                "runs were still in flight when the worker stopped"
            );
        }
        let drain = worker.shutdown.drain(Duration::from_secs(2)).await;
        note_forced(&mut report, "worker", &drain);
        report.worker = Some(worker_report);
        tracing::info!("worker stopped");
    }

    // 4. The terminal items the worker just published reach the ledger.
    if let (Some(bus), Some(_)) = (&parts.memory_bus, &parts.orchestrator) {
        let results: Vec<String> = (0..parts.topology.options().results_shards.get())
            .map(|k| parts.topology.results_queue(k).name)
            .collect();
        if !wait_until(RESULTS_SETTLE, || messages(bus, &results, true) == 0).await {
            tracing::warn!(
                pending = messages(bus, &results, true),
                "results were still unpersisted at shutdown; their runs end `interrupted` at the next start"
            );
        }
    }

    // 5. The orchestrator, then the connections.
    if let Some(orchestrator) = parts.orchestrator {
        let drain = orchestrator.shutdown.drain(ORCHESTRATOR_DRAIN).await;
        note_forced(&mut report, "orchestrator", &drain);
        orchestrator.orchestrator.join().await;
        tracing::info!("orchestrator stopped");
    }
    if let Err(error) = parts.bus.close().await {
        tracing::warn!(%error, "closing the bus failed");
    }
    if let Err(error) = parts.sql.close().await {
        tracing::warn!(%error, "closing the database failed");
    }
    tracing::info!("stopped");
    report
}

fn note_forced(report: &mut StopReport, role: &str, drain: &DrainReport) {
    report
        .forced_tasks
        .extend(drain.forced.iter().map(|task| format!("{role}: {task}")));
}

/// Work accepted but not yet started: messages in the events queues (ready, or being
/// routed) and jobs in the runs queues that no worker has taken. A job a worker holds is
/// unacknowledged until its run ends, so it is in flight, not backlog: the worker's own drain
/// owns it.
pub(super) struct Backlog {
    pub(super) events: Vec<String>,
    pub(super) runs: Vec<String>,
}

impl Backlog {
    pub(super) fn of(topology: &Topology) -> Self {
        let options = topology.options();
        Self {
            events: (0..options.events_shards.get())
                .map(|k| topology.events_queue(k).name)
                .collect(),
            runs: options
                .pools
                .iter()
                .map(|p| topology.runs_queue(p).name)
                .collect(),
        }
    }

    pub(super) fn count(&self, bus: &MemoryBus) -> usize {
        messages(bus, &self.events, true) + messages(bus, &self.runs, false)
    }
}

/// Messages ready in `queues`, plus the delivered-but-unsettled ones with `unsettled`.
fn messages(bus: &MemoryBus, queues: &[String], unsettled: bool) -> usize {
    queues
        .iter()
        .map(|q| {
            let ready = bus.ready_count(q).unwrap_or(0);
            let unacked = if unsettled {
                bus.unacked_count(q).unwrap_or(0)
            } else {
                0
            };
            ready + unacked
        })
        .sum()
}

/// Polls `done` until it holds on [`IDLE_CONFIRMATIONS`] consecutive looks (a message being
/// handed from one queue to the next is always visible in one of them, but two looks rule
/// out reading mid-hand-over), at most `budget`.
async fn wait_until(budget: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + budget;
    let mut quiet = 0;
    loop {
        if done() {
            quiet += 1;
            if quiet >= IDLE_CONFIRMATIONS {
                return true;
            }
        } else {
            quiet = 0;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(IDLE_POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use sb_common::bus::PublishOptions;
    use sb_common::bus::topology::declare_topology;

    use super::*;
    use crate::embedded::topology_options;

    #[tokio::test]
    async fn backlog_counts_waiting_work_but_not_runs_in_flight() {
        use sb_common::bus::ConsumeOptions;
        let bus = MemoryBus::new();
        let config = SwitchboardConfig::default();
        let topology = declare_topology(&bus, &topology_options(&config).unwrap())
            .await
            .unwrap();
        let backlog = Backlog::of(&topology);
        assert_eq!(backlog.count(&bus), 0);
        assert!(wait_until(Duration::from_secs(1), || backlog.count(&bus) == 0).await);

        let event_key = topology.events_routing_key("default", Some("c1"));
        bus.publish(
            &topology.events_exchange(),
            &event_key,
            "e".into(),
            PublishOptions::default(),
        )
        .await
        .unwrap();
        bus.publish(
            &topology.runs_exchange(),
            "default",
            "j".into(),
            PublishOptions::default(),
        )
        .await
        .unwrap();
        assert_eq!(backlog.count(&bus), 2);

        // An event being routed is still backlog; a job a worker holds is in flight.
        let shard = sb_common::bus::topology::events_shard(
            "default",
            Some("c1"),
            topology.options().events_shards,
        );
        let mut events = bus
            .subscribe(&topology.events_queue(shard), ConsumeOptions::prefetch(1))
            .await
            .unwrap();
        let mut jobs = bus
            .subscribe(&topology.runs_queue("default"), ConsumeOptions::prefetch(1))
            .await
            .unwrap();
        let event = events.next().await.unwrap();
        let job = jobs.next().await.unwrap();
        assert_eq!(backlog.count(&bus), 1);
        assert!(!wait_until(Duration::from_millis(100), || backlog.count(&bus) == 0).await);
        event.ack().await.unwrap();
        assert!(wait_until(Duration::from_secs(1), || backlog.count(&bus) == 0).await);
        job.ack().await.unwrap();
    }
}
