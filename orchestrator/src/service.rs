//! The orchestrator as a running service: the tasks it starts and supervises. What they run
//! on is [`crate::deps`]; how their loops settle messages is `settle`.
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

use sb_common::bus::topology::declare_topology;
use sb_common::shutdown::Shutdown;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::deps::{OrchestratorDeps, OrchestratorOptions};
use crate::error::Result;
use crate::shards::{Membership, ShardFamily, assign};

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
        let target = assign(self.events_shards, self.results_shards, &self.members, &me);
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
