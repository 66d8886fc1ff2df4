//! The orchestrator as a running service: its dependencies, options, the tasks it starts,
//! and the one place a handled message is settled.
//!
//! [`Orchestrator::spawn`] starts, as named tasks on the [`Shutdown`] tracker:
//!
//! | task | count | loop |
//! | --- | --- | --- |
//! | `orchestrator.events.<k>` | one per events shard | [`crate::events`] |
//! | `orchestrator.sink.<k>` | one per results shard | [`crate::sink`] |
//! | `orchestrator.reaper` | one | [`crate::reaper`] |
//!
//! Every loop has the STYLE §3.6 shape (`select! { biased; shutdown first, … }`): on shutdown
//! a loop finishes the message it is handling, stops consuming and returns; deliveries it had
//! not settled go back to their queue when its subscription is dropped.

use std::sync::Arc;
use std::time::Duration;

use sb_common::bus::topology::{Topology, declare_topology};
use sb_common::bus::{Bus, Delivery};
use sb_common::config::SwitchboardConfig;
use sb_common::session::SessionStore;
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Registry, names};
use sb_protocol::error::{Disposition, HasErrorCode};
use sb_store::Stores;
use tokio::task::JoinHandle;

use crate::catalog::ResourceCatalog;
use crate::error::Result;

/// Everything the orchestrator talks to. Each is a trait object so embedded mode (memory
/// bus, memory sessions, SQLite) and cluster mode (RabbitMQ, Redis, Postgres) share the code.
#[derive(Clone)]
pub struct OrchestratorDeps {
    /// The message bus.
    pub bus: Arc<dyn Bus>,
    /// Active-run sessions (frozen authorization snapshots).
    pub sessions: Arc<dyn SessionStore>,
    /// The database.
    pub stores: Stores,
    /// Exchange/queue names and shard counts (must match every other role's).
    pub topology: Topology,
    /// Which models, tools, knowledge bases and skills exist.
    pub catalog: Arc<dyn ResourceCatalog>,
}

impl OrchestratorDeps {
    /// The per-conversation state (active-run index, parked queue) over these dependencies.
    #[must_use]
    pub fn conversations(
        &self,
        options: &OrchestratorOptions,
    ) -> crate::conversations::Conversations {
        crate::conversations::Conversations::new(
            Arc::clone(&self.sessions),
            Arc::clone(&self.bus),
            self.topology.clone(),
            options.conversation_index_ttl,
        )
    }
}

impl std::fmt::Debug for OrchestratorDeps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrchestratorDeps")
            .field("topology", &self.topology)
            .finish_non_exhaustive()
    }
}

/// Tunables of the orchestrator. [`OrchestratorOptions::from_config`] fills them from the
/// validated configuration; the rest keep their defaults.
#[derive(Debug, Clone)]
pub struct OrchestratorOptions {
    /// Run timeout when the agent's `runner_config.timeout` is absent.
    pub default_run_timeout: Duration,
    /// Extra life of a run past its deadline: the session TTL is `deadline + grace`, and the
    /// reaper finalizes runs still active at `deadline + grace`.
    pub session_grace: Duration,
    /// How often the reaper scans for overdue runs.
    pub reaper_interval: Duration,
    /// Most overdue runs the reaper finalizes per scan.
    pub reaper_batch: u64,
    /// Session TTL of a run without a deadline (`runner_config.timeout` ≤ 0 or null).
    pub no_deadline_session_ttl: Duration,
    /// Unacknowledged deliveries per consumer.
    pub prefetch: u16,
    /// Most result deliveries the sink persists in one ledger call.
    pub sink_batch: usize,
    /// First delay before a message that failed with a transient error is requeued; doubled
    /// per previous attempt of that message.
    pub retry_backoff: Duration,
    /// Upper bound of that delay.
    pub retry_backoff_max: Duration,
    /// Largest state value, bytes of UTF-8 JSON.
    pub max_state_value_bytes: usize,
    /// Largest inline artifact a runner may create, decoded bytes.
    pub max_inline_artifact_bytes: usize,
    /// Host version reported to runners (`runtime.langbot_version`).
    pub host_version: String,
    /// Steering items a run's list holds; a message arriving when it is full is dispatched
    /// normally (SPEC §13).
    pub steering_queue_cap: usize,
    /// How long one orchestrator holds an event while routing it. Another orchestrator that
    /// receives the same event meanwhile requeues it instead of routing it concurrently, so
    /// one event is never both claimed and dispatched. A holder that dies releases the event
    /// after this long.
    pub route_lock_ttl: Duration,
    /// Lower bound of the TTL of a conversation's active-run index (it is reset on every
    /// run added, to at least that run's session TTL).
    pub conversation_index_ttl: Duration,
}

impl Default for OrchestratorOptions {
    fn default() -> Self {
        Self {
            // Seed behaviour (DEFAULT_RUNNER_TIMEOUT_SECONDS).
            default_run_timeout: Duration::from_secs(300),
            // Worker cancel grace plus the result's trip through the bus.
            session_grace: Duration::from_secs(15),
            reaper_interval: Duration::from_secs(5),
            // One indexed query per scan; a backlog larger than this drains over scans.
            reaper_batch: 100,
            // A run without a deadline still must not hold a session forever if its worker
            // vanished; a day covers any interactive run.
            no_deadline_session_ttl: Duration::from_secs(24 * 3600),
            prefetch: 64,
            // Enough to amortise one transaction over a burst of deltas, small enough to keep
            // per-item latency low.
            sink_batch: 64,
            retry_backoff: Duration::from_millis(100),
            retry_backoff_max: Duration::from_secs(5),
            max_state_value_bytes: crate::state_keys::MAX_STATE_VALUE_BYTES,
            max_inline_artifact_bytes: sb_protocol::result::MAX_ARTIFACT_INLINE_BYTES,
            host_version: env!("CARGO_PKG_VERSION").to_owned(),
            steering_queue_cap: sb_common::session::STEERING_CAP,
            // Routing takes milliseconds; a holder stuck this long is presumed dead.
            route_lock_ttl: Duration::from_secs(30),
            // As long as the longest default session (a run without a deadline).
            conversation_index_ttl: Duration::from_secs(24 * 3600),
        }
    }
}

impl OrchestratorOptions {
    /// Options from the validated configuration.
    #[must_use]
    pub fn from_config(config: &SwitchboardConfig) -> Self {
        Self {
            default_run_timeout: config.orchestrator.default_run_timeout,
            session_grace: config.orchestrator.lease_grace,
            reaper_interval: config.orchestrator.reaper_interval,
            prefetch: config.bus.prefetch.get(),
            max_state_value_bytes: config.limits.state_value_bytes.get(),
            max_inline_artifact_bytes: config.limits.artifact_inline_bytes.get(),
            steering_queue_cap: usize::try_from(config.limits.steering_queue_items.get())
                .unwrap_or(sb_common::session::STEERING_CAP),
            ..Self::default()
        }
    }

    /// Delay before requeueing a message that failed transiently, after `attempts` earlier
    /// returns of it: `retry_backoff · 2^attempts`, capped at `retry_backoff_max`.
    #[must_use]
    pub fn retry_delay(&self, attempts: u32) -> Duration {
        let factor = 2u32.saturating_pow(attempts.min(16));
        self.retry_backoff
            .saturating_mul(factor)
            .min(self.retry_backoff_max)
    }
}

/// The running orchestrator: handles of its tasks.
#[derive(Debug)]
pub struct Orchestrator {
    tasks: Vec<JoinHandle<()>>,
}

impl Orchestrator {
    /// Declares the bus topology (idempotent) and starts the event consumers (one per events
    /// shard), the result sinks (one per results shard) and the reaper, as tracked tasks of
    /// `shutdown`. They stop when it triggers.
    pub async fn spawn(
        deps: OrchestratorDeps,
        options: OrchestratorOptions,
        shutdown: &Shutdown,
    ) -> Result<Self> {
        declare_topology(deps.bus.as_ref(), deps.topology.options()).await?;
        let options = Arc::new(options);
        let mut tasks = Vec::new();

        let router = Arc::new(crate::events::EventRouter::new(
            deps.clone(),
            Arc::clone(&options),
        ));
        for shard in 0..deps.topology.options().events_shards.get() {
            let task = crate::events::run_shard(Arc::clone(&router), shard, shutdown.clone());
            tasks.push(shutdown.spawn(format!("orchestrator.events.{shard}"), task)?);
        }

        let sink = Arc::new(crate::sink::ResultSink::new(
            deps.clone(),
            Arc::clone(&options),
        ));
        for shard in 0..deps.topology.options().results_shards.get() {
            let task = crate::sink::run_shard(Arc::clone(&sink), shard, shutdown.clone());
            tasks.push(shutdown.spawn(format!("orchestrator.sink.{shard}"), task)?);
        }

        let reaper = crate::reaper::Reaper::new(deps, Arc::clone(&options), sink);
        tasks.push(shutdown.spawn("orchestrator.reaper", reaper.run(shutdown.clone()))?);

        tracing::info!(tasks = tasks.len(), "orchestrator started");
        Ok(Self { tasks })
    }

    /// Number of tasks started.
    #[must_use]
    pub fn task_count(&self) -> usize {
        self.tasks.len()
    }

    /// Waits until every task has returned (after shutdown).
    pub async fn join(self) {
        for task in self.tasks {
            if let Err(error) = task.await {
                if error.is_panic() {
                    tracing::error!(%error, "orchestrator task panicked");
                }
            }
        }
    }
}

/// Settles a delivery from the outcome of handling it, by the error code's disposition
/// (the project's one mapping): `Ack` removes it, `Retry` requeues it after a backoff
/// (cut short by shutdown), `DeadLetter` rejects it to the dead-letter exchange.
pub(crate) async fn settle(
    delivery: Delivery,
    outcome: &Result<()>,
    queue: &str,
    options: &OrchestratorOptions,
    shutdown: &Shutdown,
) {
    let disposition = match outcome {
        Ok(()) => Disposition::Ack,
        Err(error) => {
            let disposition = error.code().disposition();
            match disposition {
                Disposition::Ack => {
                    tracing::info!(%error, queue, "message handled with a final error")
                }
                Disposition::Retry => {
                    tracing::warn!(%error, queue, attempts = delivery.delivery_count, "message will be retried")
                }
                Disposition::DeadLetter => tracing::error!(%error, queue, "message dead-lettered"),
            }
            disposition
        }
    };
    let (label, settled) = match disposition {
        Disposition::Ack => ("ack", delivery.ack().await),
        Disposition::Retry => {
            let delay = options.retry_delay(delivery.delivery_count);
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(delay) => {}
            }
            ("retry", delivery.nack(true).await)
        }
        Disposition::DeadLetter => ("dead_letter", delivery.nack(false).await),
    };
    if let Err(error) = settled {
        // The broker will redeliver it; every handler is idempotent.
        tracing::warn!(%error, queue, "could not settle a delivery");
    }
    Registry::global().inc(
        names::BUS_CONSUMED_TOTAL,
        &[("queue", queue), ("disposition", label)],
    );
}

/// Waits `delay` unless shutdown begins first; `false` on shutdown.
pub(crate) async fn pause(delay: Duration, shutdown: &Shutdown) -> bool {
    tokio::select! {
        biased;
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(delay) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_double_and_cap() {
        let o = OrchestratorOptions::default();
        assert_eq!(o.retry_delay(0), Duration::from_millis(100));
        assert_eq!(o.retry_delay(1), Duration::from_millis(200));
        assert_eq!(o.retry_delay(3), Duration::from_millis(800));
        assert_eq!(o.retry_delay(10), Duration::from_secs(5));
        assert_eq!(o.retry_delay(u32::MAX), Duration::from_secs(5));
    }

    #[test]
    fn options_from_config() {
        let config = SwitchboardConfig::default();
        let o = OrchestratorOptions::from_config(&config);
        assert_eq!(o.default_run_timeout, Duration::from_secs(300));
        assert_eq!(o.session_grace, config.orchestrator.lease_grace);
        assert_eq!(o.max_state_value_bytes, 256 * 1024);
        assert_eq!(o.max_inline_artifact_bytes, 1024 * 1024);
        assert_eq!(o.steering_queue_cap, 100);
    }
}
