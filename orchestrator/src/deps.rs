//! What the orchestrator runs on: [`OrchestratorDeps`] (the backends, as trait objects) and
//! [`OrchestratorOptions`] (its tunables, from the configuration).
//!
//! Every loop the orchestrator starts (events, sink, reaper, scheduler) and the recovery
//! take these two, and the service (`service`) only hands them out: apart from it, the
//! loops depend on their inputs without depending on the code that spawns them (no import
//! circle between the service and its loops).

use std::sync::Arc;
use std::time::Duration;

use sb_common::bus::Bus;
use sb_common::bus::topology::Topology;
use sb_common::config::SwitchboardConfig;
use sb_common::retry::{RetryConfig, RetryPolicy};
use sb_common::session::SessionStore;
use sb_protocol::host::RunBudgets;
use sb_store::Stores;

use crate::catalog::ResourceCatalog;

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
    /// How often the scheduler fires due schedules.
    pub scheduler_interval: Duration,
    /// Most due schedules the scheduler fires per scan.
    pub scheduler_batch: u64,
    /// What the retention task deletes, and when (`[retention]`).
    pub retention: crate::retention::RetentionPolicy,
    /// Session TTL of a run without a deadline (`runner_config.timeout` ≤ 0 or null).
    pub no_deadline_session_ttl: Duration,
    /// Longest a run without a deadline stays active before the reaper finalizes it
    /// (`limits.run_max_duration`).
    pub run_max_duration: Duration,
    /// Unacknowledged deliveries per consumer.
    pub prefetch: u16,
    /// Most result deliveries the sink persists in one ledger call.
    pub sink_batch: usize,
    /// Delays before a message that failed with a transient error is requeued (by its
    /// previous attempts), and between attempts while a backend is unreachable: the
    /// configuration's `[retry]`.
    pub retry: RetryPolicy,
    /// Largest state value, bytes of UTF-8 JSON.
    pub max_state_value_bytes: usize,
    /// Largest inline artifact a runner may create, decoded bytes.
    pub max_inline_artifact_bytes: usize,
    /// Host version reported to runners (`runtime.langbot_version`).
    pub host_version: String,
    /// Per-run budgets of a run whose agent does not set its own (`limits.budgets`).
    pub default_budgets: RunBudgets,
    /// Steering items a run's list holds; a message arriving when it is full is dispatched
    /// normally (SPEC §13).
    pub steering_queue_cap: usize,
    /// How long one orchestrator holds an event while routing it. Another orchestrator that
    /// receives the same event meanwhile requeues it instead of routing it concurrently, so
    /// one event is never both claimed and dispatched. A holder that dies releases the event
    /// after this long.
    pub route_lock_ttl: Duration,
    /// Longest an entry of the routing cache (a workspace's agents, a runner's descriptor)
    /// is used; changes made through the API are seen at once (the routing epoch, see
    /// [`crate::route_cache`]), this bounds only changes made behind its back. Zero: no
    /// cache.
    pub route_cache_max_age: Duration,
    /// Lower bound of the TTL of a conversation's active-run index (it is reset on every
    /// run added, to at least that run's session TTL).
    pub conversation_index_ttl: Duration,
    /// How often the shard reconciler renews this orchestrator's membership and rebalances
    /// the shards (see the `service` module docs). A join is picked up by the others within this long.
    pub membership_heartbeat: Duration,
    /// How long a member stays live after its last heartbeat: the shards of an orchestrator
    /// that died move to the others after at most this plus one heartbeat. Must exceed
    /// `membership_heartbeat` (a smaller value is raised to three heartbeats).
    pub membership_ttl: Duration,
    /// This orchestrator's id in the member registry; `None` generates one unique per
    /// process start (`orchestrator-<pid>-<random>`). Two running orchestrators must never
    /// share an id.
    pub member_id: Option<String>,
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
            scheduler_interval: Duration::from_secs(1),
            // One indexed query per scan; a larger backlog drains over scans.
            scheduler_batch: 100,
            retention: crate::retention::RetentionPolicy::default(),
            // A run without a deadline still must not hold a session forever if its worker
            // vanished; a day covers any interactive run.
            no_deadline_session_ttl: Duration::from_secs(24 * 3600),
            run_max_duration: Duration::from_secs(24 * 3600),
            prefetch: 64,
            // Enough to amortise one transaction over a burst of deltas, small enough to keep
            // per-item latency low.
            sink_batch: 64,
            retry: RetryConfig::default().policy(),
            max_state_value_bytes: crate::state_keys::MAX_STATE_VALUE_BYTES,
            max_inline_artifact_bytes: sb_protocol::result::MAX_ARTIFACT_INLINE_BYTES,
            host_version: env!("CARGO_PKG_VERSION").to_owned(),
            default_budgets: RunBudgets::default(),
            steering_queue_cap: sb_common::session::STEERING_CAP,
            // Routing takes milliseconds; a holder stuck this long is presumed dead.
            route_lock_ttl: Duration::from_secs(30),
            route_cache_max_age: Duration::from_secs(30),
            // As long as the longest default session (a run without a deadline).
            conversation_index_ttl: Duration::from_secs(24 * 3600),
            // Two missed heartbeats are tolerated before a member is presumed dead.
            membership_heartbeat: Duration::from_secs(2),
            membership_ttl: Duration::from_secs(6),
            member_id: None,
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
            scheduler_interval: config.orchestrator.scheduler_interval,
            retention: crate::retention::RetentionPolicy::from_config(&config.retention),
            membership_heartbeat: config.orchestrator.membership_heartbeat,
            membership_ttl: config.orchestrator.membership_ttl,
            member_id: config.orchestrator.member_id.clone(),
            prefetch: config.bus.prefetch.get(),
            max_state_value_bytes: config.limits.state_value_bytes.get(),
            max_inline_artifact_bytes: config.limits.artifact_inline_bytes.get(),
            default_budgets: default_budgets(&config.limits.budgets),
            steering_queue_cap: usize::try_from(config.limits.steering_queue_items.get())
                .unwrap_or(sb_common::session::STEERING_CAP),
            run_max_duration: config.limits.run_max_duration,
            route_cache_max_age: config.orchestrator.route_cache_max_age,
            retry: config.retry.policy(),
            ..Self::default()
        }
    }

    /// Delay before requeueing a message that failed transiently, after `attempts` earlier
    /// returns of it: `retry.initial · 2^attempts`, capped at `retry.max`.
    #[must_use]
    pub fn retry_delay(&self, attempts: u32) -> Duration {
        self.retry.delay(attempts)
    }
}

/// The configured budgets as the snapshot carries them.
fn default_budgets(config: &sb_common::config::BudgetsConfig) -> RunBudgets {
    RunBudgets {
        max_model_calls: config.max_model_calls.get(),
        max_tool_calls: config.max_tool_calls.get(),
        max_tool_result_chars: u64::try_from(config.max_tool_result_chars.get())
            .unwrap_or(u64::MAX),
        max_model_output_chars: u64::try_from(config.max_model_output_chars.get())
            .unwrap_or(u64::MAX),
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
        assert_eq!(o.default_budgets, RunBudgets::default());
        assert_eq!(o.membership_ttl, Duration::from_secs(6));

        let mut config = SwitchboardConfig::default();
        config.limits.budgets.max_tool_calls = std::num::NonZeroU32::new(3).unwrap();
        config.orchestrator.membership_heartbeat = Duration::from_millis(500);
        config.orchestrator.member_id = Some("orch-a".into());
        let o = OrchestratorOptions::from_config(&config);
        assert_eq!(o.default_budgets.max_tool_calls, 3);
        assert_eq!(o.default_budgets.max_model_calls, 16);
        assert_eq!(o.membership_heartbeat, Duration::from_millis(500));
        assert_eq!(o.member_id.as_deref(), Some("orch-a"));
    }
}
