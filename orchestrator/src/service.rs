//! The orchestrator as a running service: its dependencies, options, the tasks it starts,
//! and the one place a handled message is settled.
//!
//! [`Orchestrator::spawn`] starts, as named tasks on the [`Shutdown`] tracker:
//!
//! | task | count | loop |
//! | --- | --- | --- |
//! | `orchestrator.shards` | one | the shard reconciler (below) |
//! | `orchestrator.events.<k>` | one per events shard this orchestrator owns | [`crate::events`] |
//! | `orchestrator.sink.<k>` | one per results shard this orchestrator owns | [`crate::sink`] |
//! | `orchestrator.reaper` | one | [`crate::reaper`] |
//! | `orchestrator.scheduler` | one | [`crate::scheduler`] |
//! | `orchestrator.retention` | one (passes only while it holds the retention lease) | [`crate::retention`] |
//!
//! Every loop has the STYLE §3.6 shape (`select! { biased; shutdown first, … }`): on shutdown
//! a loop finishes the message it is handling, stops consuming and returns; deliveries it had
//! not settled go back to their queue when its subscription is dropped.
//!
//! # Shard ownership
//! The shard queues are single-active-consumer, and the broker makes the first subscriber
//! active, so subscribing every orchestrator to every shard would leave all but one idle.
//! The shard reconciler spreads them instead: every `membership_heartbeat` it renews this
//! orchestrator's entry in the live-member registry ([`crate::shards::Membership`]), reads
//! the live members, computes its shards with [`crate::shards::assign`] and
//!
//! - starts a consumer for each shard it newly owns (if another member still consumes it,
//!   the broker keeps that one active until it lets go: no overlap);
//! - hands back each shard it no longer owns: the shard's loop gets its own
//!   [`Shutdown::child`], which is cancelled — the loop finishes and settles the message in
//!   hand, stops pulling and drops its subscription, so the prefetched, unsettled deliveries
//!   return to the queue in order and the new owner's consumer becomes active.
//!
//! When the registry cannot be read (session store down), the last known members are kept;
//! before any read succeeded, that is this orchestrator alone, which owns everything — the
//! single-active-consumer flag keeps that correct if others did the same. A lone
//! orchestrator (embedded mode) owns every shard from the first tick, done before
//! [`Orchestrator::spawn`] returns (which therefore waits at most one membership TTL for an
//! unresponsive session store).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use sb_common::bus::topology::{Topology, declare_topology};
use sb_common::bus::{Bus, Delivery};
use sb_common::config::SwitchboardConfig;
use sb_common::session::SessionStore;
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Registry, names};
use sb_protocol::error::{Disposition, HasErrorCode};
use sb_protocol::host::RunBudgets;
use sb_store::Stores;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::catalog::ResourceCatalog;
use crate::error::Result;
use crate::shards::{Membership, ShardFamily, assign};

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
    /// the shards (see the module docs). A join is picked up by the others within this long.
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
            retry_backoff: Duration::from_millis(100),
            retry_backoff_max: Duration::from_secs(5),
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

/// The shards one orchestrator consumes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnedShards {
    /// Events shards (`switchboard.events.<k>`).
    pub events: BTreeSet<u32>,
    /// Results shards (`switchboard.results.<k>`).
    pub results: BTreeSet<u32>,
}

/// The running orchestrator: its member id, handles of its tasks and the shards it owns.
#[derive(Debug)]
pub struct Orchestrator {
    id: String,
    tasks: Vec<JoinHandle<()>>,
    owned: watch::Receiver<OwnedShards>,
}

impl Orchestrator {
    /// Declares the bus topology (idempotent), joins the live-member registry, starts the
    /// consumers of the shards it owns (all of them when it is alone), the shard reconciler
    /// the scheduler and the reaper, as tracked tasks of `shutdown`. They stop when it triggers.
    pub async fn spawn(
        deps: OrchestratorDeps,
        options: OrchestratorOptions,
        shutdown: &Shutdown,
    ) -> Result<Self> {
        declare_topology(deps.bus.as_ref(), deps.topology.options()).await?;
        let options = Arc::new(options);
        let mut tasks = Vec::new();
        // Unique per process start: a restarted orchestrator is a new member (its old entry
        // expires), so two processes never share an id.
        let id = options.member_id.clone().unwrap_or_else(|| {
            format!(
                "orchestrator-{}-{}",
                std::process::id(),
                &uuid::Uuid::new_v4().simple().to_string()[..12]
            )
        });

        let router = Arc::new(crate::events::EventRouter::new(
            deps.clone(),
            Arc::clone(&options),
        ));
        let sink = Arc::new(crate::sink::ResultSink::new(
            deps.clone(),
            Arc::clone(&options),
        ));

        let heartbeat = options.membership_heartbeat.max(Duration::from_millis(1));
        let mut ttl = options.membership_ttl;
        if ttl <= heartbeat {
            tracing::warn!(
                ?ttl,
                ?heartbeat,
                "membership TTL not above the heartbeat; using three heartbeats"
            );
            ttl = heartbeat.saturating_mul(3);
        }
        let (owned_tx, owned) = watch::channel(OwnedShards::default());
        let mut reconciler = ShardReconciler {
            membership: Membership::new(Arc::clone(&deps.sessions), id.clone(), ttl),
            members: BTreeSet::new(),
            store_ok: true,
            events_shards: deps.topology.options().events_shards.get(),
            results_shards: deps.topology.options().results_shards.get(),
            router,
            sink: Arc::clone(&sink),
            shutdown: shutdown.clone(),
            running: BTreeMap::new(),
            stopping: Vec::new(),
            owned: owned_tx,
            heartbeat,
            ttl,
        };
        reconciler.tick().await;
        tasks.push(shutdown.spawn("orchestrator.shards", reconciler.run())?);

        let scheduler = crate::scheduler::Scheduler::new(deps.clone(), Arc::clone(&options));
        tasks.push(shutdown.spawn("orchestrator.scheduler", scheduler.run(shutdown.clone()))?);
        let retention = crate::retention::Retention::new(
            deps.stores.clone(),
            Arc::clone(&deps.sessions),
            options.retention.clone(),
            id.clone(),
        );
        tasks.push(shutdown.spawn("orchestrator.retention", retention.run(shutdown.clone()))?);
        let reaper = crate::reaper::Reaper::new(deps, Arc::clone(&options), sink);
        tasks.push(shutdown.spawn("orchestrator.reaper", reaper.run(shutdown.clone()))?);

        let shards = owned.borrow().clone();
        tracing::info!(
            orchestrator = %id,
            events_shards = ?shards.events,
            results_shards = ?shards.results,
            "orchestrator started"
        );
        Ok(Self { id, tasks, owned })
    }

    /// This orchestrator's member id (unique per process start).
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The shards it consumes now.
    #[must_use]
    pub fn owned_shards(&self) -> OwnedShards {
        self.owned.borrow().clone()
    }

    /// Waits until the shards it consumes satisfy `predicate` (returns at once if they do);
    /// returns the shards then, or `None` once the orchestrator stopped.
    pub async fn wait_for_shards(
        &self,
        mut predicate: impl FnMut(&OwnedShards) -> bool,
    ) -> Option<OwnedShards> {
        let mut owned = self.owned.clone();
        let result = owned.wait_for(|shards| predicate(shards)).await;
        result.ok().map(|shards| shards.clone())
    }

    /// Number of tasks running now: the shard reconciler, the scheduler, the retention task,
    /// the reaper and one consumer per owned shard.
    #[must_use]
    pub fn task_count(&self) -> usize {
        let owned = self.owned.borrow();
        self.tasks.len() + owned.events.len() + owned.results.len()
    }

    /// Waits until every task has returned (after shutdown). The reconciler returns once
    /// every shard consumer it started has.
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

/// A running shard consumer: its own shutdown scope (cancelled to hand the shard over) and
/// its task.
struct ShardTask {
    scope: Shutdown,
    handle: JoinHandle<()>,
}

/// The `orchestrator.shards` task: keeps the running consumers equal to the assignment (see
/// the module docs).
struct ShardReconciler {
    membership: Membership,
    /// Last live members read (kept while the registry cannot be read).
    members: BTreeSet<String>,
    /// Whether the last registry call succeeded (to log only changes).
    store_ok: bool,
    events_shards: u32,
    results_shards: u32,
    router: Arc<crate::events::EventRouter>,
    sink: Arc<crate::sink::ResultSink>,
    shutdown: Shutdown,
    running: BTreeMap<(ShardFamily, u32), ShardTask>,
    /// Consumers handed over, still finishing their message in hand.
    stopping: Vec<JoinHandle<()>>,
    owned: watch::Sender<OwnedShards>,
    heartbeat: Duration,
    ttl: Duration,
}

impl ShardReconciler {
    async fn run(mut self) {
        let mut ticks = tokio::time::interval(self.heartbeat);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick of an interval completes at once; `spawn` already did that one.
        ticks.tick().await;
        let shutdown = self.shutdown.clone();
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticks.tick() => {}
            }
            // A slow registry read must not hold up shutdown (the tick only awaits in its
            // read; starting and stopping consumers does not await).
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                () = self.tick() => {}
            }
        }
        // Leave first, so the others start taking the shards while ours finish their
        // message in hand (the broker activates theirs when ours let go).
        match tokio::time::timeout(self.heartbeat, self.membership.leave()).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::warn!(%error, "could not leave the orchestrator registry; the entry expires")
            }
            Err(_) => {
                tracing::warn!("leaving the orchestrator registry timed out; the entry expires")
            }
        }
        let running = std::mem::take(&mut self.running);
        for task in running
            .into_values()
            .map(|t| t.handle)
            .chain(self.stopping.drain(..))
        {
            if let Err(error) = task.await {
                if error.is_panic() {
                    tracing::error!(%error, "shard consumer panicked");
                }
            }
        }
        self.owned.send_replace(OwnedShards::default());
    }

    /// Renews the membership, reads the members, and starts/stops consumers to match.
    async fn tick(&mut self) {
        let read = async {
            self.membership.heartbeat().await?;
            self.membership.live_members().await
        };
        match tokio::time::timeout(self.ttl, read).await {
            Ok(Ok(members)) => {
                if !self.store_ok {
                    tracing::info!("orchestrator registry readable again");
                }
                self.store_ok = true;
                if members != self.members {
                    tracing::info!(orchestrator = %self.membership.id(), ?members, "orchestrator members changed");
                }
                self.members = members;
            }
            Ok(Err(error)) => {
                if self.store_ok {
                    tracing::warn!(%error, "cannot read the orchestrator registry; keeping the current shards");
                }
                self.store_ok = false;
            }
            Err(_) => {
                if self.store_ok {
                    tracing::warn!(
                        "reading the orchestrator registry timed out; keeping the current shards"
                    );
                }
                self.store_ok = false;
            }
        }
        let me = self.membership.id().to_owned();
        let target: BTreeSet<(ShardFamily, u32)> =
            assign(ShardFamily::Events, self.events_shards, &self.members, &me)
                .into_iter()
                .map(|k| (ShardFamily::Events, k))
                .chain(
                    assign(
                        ShardFamily::Results,
                        self.results_shards,
                        &self.members,
                        &me,
                    )
                    .into_iter()
                    .map(|k| (ShardFamily::Results, k)),
                )
                .collect();
        self.reconcile(&target);
    }

    /// Hands back the consumers not in `target` and starts the missing ones.
    fn reconcile(&mut self, target: &BTreeSet<(ShardFamily, u32)>) {
        if self.shutdown.is_shutting_down() {
            // Every consumer is stopping on its own; nothing new starts.
            return;
        }
        self.stopping.retain(|task| !task.is_finished());
        // A consumer only returns on cancellation; one that ended otherwise (a panic) is
        // started again below if the shard is still ours.
        self.running.retain(|&(family, shard), task| {
            let ended = task.handle.is_finished();
            if ended {
                tracing::error!(%family, shard, "shard consumer ended unexpectedly; restarting it");
            }
            !ended
        });
        let released: Vec<(ShardFamily, u32)> = self
            .running
            .keys()
            .filter(|key| !target.contains(key))
            .copied()
            .collect();
        for key in released {
            if let Some(task) = self.running.remove(&key) {
                tracing::info!(family = %key.0, shard = key.1, "handing a shard over");
                task.scope.token().cancel();
                self.stopping.push(task.handle);
            }
        }
        for &(family, shard) in target {
            if self.running.contains_key(&(family, shard)) {
                continue;
            }
            let scope = self.shutdown.child();
            let spawned = match family {
                ShardFamily::Events => self.shutdown.spawn(
                    format!("orchestrator.events.{shard}"),
                    crate::events::run_shard(Arc::clone(&self.router), shard, scope.clone()),
                ),
                ShardFamily::Results => self.shutdown.spawn(
                    format!("orchestrator.sink.{shard}"),
                    crate::sink::run_shard(Arc::clone(&self.sink), shard, scope.clone()),
                ),
            };
            match spawned {
                Ok(handle) => {
                    tracing::info!(%family, shard, "consuming a shard");
                    self.running
                        .insert((family, shard), ShardTask { scope, handle });
                }
                // Shutdown began: nothing new starts.
                Err(_) => return,
            }
        }
        let mut owned = OwnedShards::default();
        for &(family, shard) in self.running.keys() {
            match family {
                ShardFamily::Events => owned.events.insert(shard),
                ShardFamily::Results => owned.results.insert(shard),
            };
        }
        self.owned.send_if_modified(|current| {
            let changed = *current != owned;
            *current = owned;
            changed
        });
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
