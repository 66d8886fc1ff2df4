//! [`RunnerHost`]: hosts the processes of one runner and runs on them (SPEC §4.2–§4.4, §11).
//!
//! ```text
//!  start_run(req) ──▶ RunnerHost ──(shared: the one process | per_run: a new process)──▶ actor
//!        ▲                                                                             │
//!        └──────────── RunHandle ◀── RunItem 1, 2, 3, …, terminal ◀────────────────────┘
//! ```
//!
//! Each process is driven by one **actor** task that owns the [`RunnerProcess`], a
//! [`RunnerLink`] (the pure protocol state machine) and the run timers; a reader task turns
//! stdout into frames, a writer task batches messages to stdin, and one task per Host API
//! call serves it through the injected [`HostApi`]. The actor applies the link's
//! [`Effect`](crate::runner::link::Effect)s.
//!
//! Host API calls get **exactly one** `api_result` each: the serving task and the end of the
//! call's run (which answers `not_found`) race through the call's
//! [`ApiStream`](sb_host_api::api::ApiStream), which lets only the first answer through. A
//! call id already in flight on the process is refused with `conflict` (answers carry no run
//! id, so one id must name one call at a time).
//!
//! Contract of [`RunHandle`]: items arrive in transport-sequence order (1, 2, 3, … with no
//! gaps) and the stream ends with **exactly one** terminal item (`run.completed` or
//! `run.failed`), after which it yields `None`. Poll it promptly: the process's output is
//! back-pressured through the handle, so an unpolled handle stalls its process. Dropping a
//! handle before its terminal item cancels the run.
//!
//! `shared` mode keeps one process **per workspace** (SPEC §14: a shared runner process is
//! bound to one workspace, so plugin code holding one tenant's runs never holds another's),
//! with up to `max_concurrency` concurrent runs over all of them. When a process exits
//! unexpectedly its in-flight runs fail with `runner.crashed` and the next run of that
//! workspace starts a new process after an exponential backoff
//! ([`RunnerHostOptions::restart_backoff_initial`] doubling up to
//! [`RunnerHostOptions::restart_backoff_max`]; a process that stayed up for
//! [`RunnerHostOptions::healthy_after`] resets it). Idle processes stay up for the next run of
//! their workspace; when a new workspace needs a process and `max_concurrency` processes are
//! already up, the least recently used idle one is drained to make room, so a runner never
//! has more than `max_concurrency` processes serving. `per_run` mode starts a process per
//! run (at most `max_concurrency` at once) and retires it when the run ends.
//!
//! Every process is confined by [`RunnerHostOptions::sandbox`] (see [`super::sandbox`]), and
//! its Host API calls carry its [`Connection`] (workspace and current runs) to the gate.
//!
//! # Layout
//! - this module: [`RunnerHost`], the front — starts runs on the right process (the
//!   workspace's shared one, or a new per-run one), routes cancels, keeps the shared
//!   processes per workspace with their restart backoff, and shuts everything down;
//! - `spec`: what it is told ([`RunnerSpec`], [`RunnerHostOptions`],
//!   [`RunRequest`]);
//! - `actor`: the per-process supervision (one actor task per process);
//! - `pipes`: the stdout reader and stdin writer tasks of a process;
//! - `command`: what the host and run handles send an actor;
//! - `handle`: [`RunHandle`], the ordered item stream of one run.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use sb_common::retry::RetryPolicy;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::manifest::RunnerId;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use self::actor::{Actor, ActorEnv, ExitReport};
use self::command::{Command, Refusal, Routes, RunSlot};
use crate::lock::lock;
use crate::runner::error::RunnerError;
use crate::runner::link::{ExecutionMode, RunnerLink, StartRefused};
use crate::runner::process::RunnerProcess;
use sb_host_api::api::{CallerIdentity, Connection, HostApi};

mod actor;
mod command;
mod handle;
mod pipes;
mod spec;

pub use self::handle::RunHandle;
pub use self::spec::{EnvLookup, RunRequest, RunnerHostOptions, RunnerSpec};

/// A live actor, as the host and run handles reach it.
#[derive(Clone)]
struct ActorRef {
    generation: u64,
    commands: mpsc::UnboundedSender<Command>,
    /// Cancelled when the actor has finished (process reaped, runs ended).
    exited: CancellationToken,
    /// The process's workspace and current runs (idle = no run).
    connection: Connection,
}

#[derive(Default)]
enum SlotState {
    #[default]
    Empty,
    Up(ActorRef),
    Backoff {
        until: Instant,
    },
}

/// The shared process of one workspace.
struct SharedSlot {
    state: SlotState,
    /// Unexpected exits (or failed spawns) in a row; drives the restart backoff.
    failures: u32,
    /// Last time a run asked for this slot (picks the idle process to drain for room).
    last_used: Instant,
}

impl SharedSlot {
    fn new() -> Self {
        Self {
            state: SlotState::Empty,
            failures: 0,
            last_used: Instant::now(),
        }
    }

    /// The slot's process, if it is up and has not exited.
    fn live(&self) -> Option<&ActorRef> {
        match &self.state {
            SlotState::Up(actor) if !actor.exited.is_cancelled() => Some(actor),
            _ => None,
        }
    }

    /// A slot without a process or a pending backoff carries nothing worth keeping.
    fn is_vacant(&self) -> bool {
        matches!(self.state, SlotState::Empty) && self.failures == 0
    }
}

/// The shared processes of a host, one slot per workspace.
#[derive(Default)]
struct SharedSlots {
    by_workspace: HashMap<WorkspaceId, SharedSlot>,
    /// Set at shutdown: no process is started any more.
    closed: bool,
}

struct HostInner {
    spec: RunnerSpec,
    config: Arc<RunnerHostOptions>,
    api: Arc<dyn HostApi>,
    permits: Arc<Semaphore>,
    /// `shared` mode: the process of each workspace.
    shared: Mutex<SharedSlots>,
    /// Every live actor, for drain/abort at shutdown.
    actors: Mutex<HashMap<u64, ActorRef>>,
    /// Where each active run lives (for [`RunnerHost::cancel`]).
    routes: Routes,
    /// Pid of each live actor's process (diagnostics).
    pids: Mutex<HashMap<u64, u32>>,
    generation: AtomicU64,
    tracker: TaskTracker,
    lookup_env: EnvLookup,
}

/// Hosts the processes of one runner. Cheap to clone.
#[derive(Clone)]
pub struct RunnerHost {
    inner: Arc<HostInner>,
}

impl RunnerHost {
    /// A host for `spec`. Processes inherit only the allowlisted variables of the worker's
    /// own environment, and run confined by `config.sandbox`.
    #[must_use]
    pub fn new(spec: RunnerSpec, config: RunnerHostOptions, api: Arc<dyn HostApi>) -> Self {
        Self::with_env(
            spec,
            config,
            api,
            Arc::new(|name: &str| std::env::var_os(name)),
        )
    }

    /// Like [`RunnerHost::new`] with an explicit environment lookup (tests).
    #[must_use]
    pub fn with_env(
        spec: RunnerSpec,
        config: RunnerHostOptions,
        api: Arc<dyn HostApi>,
        lookup_env: EnvLookup,
    ) -> Self {
        let permits = Arc::new(Semaphore::new(spec.max_concurrency.get()));
        Self {
            inner: Arc::new(HostInner {
                spec,
                config: Arc::new(config),
                api,
                permits,
                shared: Mutex::new(SharedSlots::default()),
                actors: Mutex::new(HashMap::new()),
                routes: Arc::new(Mutex::new(HashMap::new())),
                pids: Mutex::new(HashMap::new()),
                generation: AtomicU64::new(1),
                tracker: TaskTracker::new(),
                lookup_env,
            }),
        }
    }

    #[must_use]
    pub fn runner_id(&self) -> &RunnerId {
        &self.inner.spec.runner_id
    }

    #[must_use]
    pub fn spec(&self) -> &RunnerSpec {
        &self.inner.spec
    }

    /// Runs in flight on this host.
    #[must_use]
    pub fn active_runs(&self) -> usize {
        lock(&self.inner.routes).len()
    }

    /// Free run slots (`max_concurrency` minus active runs).
    #[must_use]
    pub fn available_slots(&self) -> usize {
        self.inner.permits.available_permits()
    }

    /// The pid of the shared process of `workspace_id`, if one is up (diagnostics, tests).
    #[must_use]
    pub fn shared_pid(&self, workspace_id: &WorkspaceId) -> Option<u32> {
        let generation = match &lock(&self.inner.shared)
            .by_workspace
            .get(workspace_id)?
            .state
        {
            SlotState::Up(actor) => actor.generation,
            _ => return None,
        };
        lock(&self.inner.pids).get(&generation).copied()
    }

    /// The pids of every live process of this host, shared or per-run (diagnostics, tests).
    #[must_use]
    pub fn pids(&self) -> Vec<u32> {
        lock(&self.inner.pids).values().copied().collect()
    }

    /// Starts a run. Waits for a concurrency slot (and, after a crash of the shared process,
    /// for the restart backoff). Errors only if the run could not be started at all; every
    /// later failure is the terminal item of the returned handle.
    pub async fn start_run(&self, request: RunRequest) -> Result<RunHandle, RunnerError> {
        let inner = &self.inner;
        let run_id = request.run_id;
        if lock(&inner.routes).contains_key(&run_id) {
            return Err(RunnerError::DuplicateRun(run_id));
        }
        let permit = inner
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| RunnerError::ShuttingDown)?;
        let (events_tx, events_rx) = mpsc::channel(inner.config.run_buffer.max(1));
        let mut slot = RunSlot {
            events: events_tx,
            _permit: permit,
        };
        let deadline = request.deadline.map(to_instant);
        let workspace_id = request.workspace_id;
        let mut context = Box::new(request.context);
        loop {
            let actor = match inner.spec.mode {
                ExecutionMode::Shared => self.shared_actor(&workspace_id).await?,
                ExecutionMode::PerRun => self.spawn_actor(&workspace_id)?,
            };
            // Register the route before the actor can end the run, so a fast run's removal
            // never precedes its insertion.
            lock(&inner.routes).insert(run_id, actor.commands.clone());
            let (reply_tx, reply_rx) = oneshot::channel();
            let sent = actor.commands.send(Command::Start {
                run_id,
                context,
                deadline,
                slot,
                reply: reply_tx,
            });
            let outcome = match sent {
                Ok(()) => reply_rx.await.ok(),
                Err(mpsc::error::SendError(Command::Start { slot, context, .. })) => {
                    Some(Err(Refusal {
                        reason: StartRefused::NotAccepting,
                        slot,
                        context,
                    }))
                }
                Err(_) => None,
            };
            match outcome {
                Some(Ok(())) => {
                    return Ok(RunHandle::new(run_id, events_rx, actor.commands));
                }
                Some(Err(refusal)) => {
                    lock(&inner.routes).remove(&run_id);
                    if refusal.reason == StartRefused::Duplicate {
                        return Err(RunnerError::DuplicateRun(run_id));
                    }
                    // The process is on its way out: wait for it, then use the next one.
                    slot = refusal.slot;
                    context = refusal.context;
                    let _ =
                        tokio::time::timeout(inner.config.kill_grace * 3, actor.exited.cancelled())
                            .await;
                    self.retire(&workspace_id, actor.generation);
                }
                None => {
                    // The actor vanished with our request (it panicked); nothing to retry with.
                    lock(&inner.routes).remove(&run_id);
                    return Err(RunnerError::ShuttingDown);
                }
            }
        }
    }

    /// Cancels a run (cooperative `cancel`, then `run.failed {code: "cancelled"}` after the
    /// grace period). Unknown or finished runs are ignored.
    pub fn cancel(&self, run_id: RunId, reason: impl Into<String>) {
        if let Some(commands) = lock(&self.inner.routes).get(&run_id) {
            let _ = commands.send(Command::Cancel {
                run_id,
                reason: reason.into(),
            });
        }
    }

    /// Stops hosting: no new runs; in-flight runs get `grace` to finish, then are ended as
    /// `interrupted` and their processes killed. Returns when every process is gone.
    pub async fn shutdown(&self, grace: Duration) {
        let inner = &self.inner;
        lock(&inner.shared).closed = true;
        inner.permits.close();
        let actors: Vec<ActorRef> = lock(&inner.actors).values().cloned().collect();
        for actor in &actors {
            let _ = actor.commands.send(Command::Drain);
        }
        inner.tracker.close();
        if tokio::time::timeout(grace, inner.tracker.wait())
            .await
            .is_err()
        {
            let actors: Vec<ActorRef> = lock(&inner.actors).values().cloned().collect();
            for actor in &actors {
                tracing::warn!(runner_id = %inner.spec.runner_id, generation = actor.generation, "runner process did not drain in time, forcing it");
                let _ = actor.commands.send(Command::Abort {
                    detail: "worker shutting down".into(),
                });
            }
            inner.tracker.wait().await;
        }
    }

    /// The shared process of `workspace_id`, spawning one if needed (after the restart
    /// backoff, and after draining an idle process of another workspace if the host is at
    /// its process cap).
    async fn shared_actor(&self, workspace_id: &WorkspaceId) -> Result<ActorRef, RunnerError> {
        loop {
            let wait_until = {
                let mut shared = lock(&self.inner.shared);
                if shared.closed {
                    return Err(RunnerError::ShuttingDown);
                }
                let now = Instant::now();
                let slot = shared
                    .by_workspace
                    .entry(workspace_id.clone())
                    .or_insert_with(SharedSlot::new);
                slot.last_used = now;
                if let Some(actor) = slot.live() {
                    return Ok(actor.clone());
                }
                match &slot.state {
                    SlotState::Backoff { until } if now < *until => *until,
                    _ => {
                        self.make_room(&mut shared, workspace_id);
                        let spawned = self.spawn_actor(workspace_id);
                        let slot = shared
                            .by_workspace
                            .entry(workspace_id.clone())
                            .or_insert_with(SharedSlot::new);
                        return match spawned {
                            Ok(actor) => {
                                slot.state = SlotState::Up(actor.clone());
                                Ok(actor)
                            }
                            Err(e) => {
                                slot.failures += 1;
                                let delay = backoff_delay(&self.inner.config, slot.failures);
                                slot.state = SlotState::Backoff {
                                    until: Instant::now() + delay,
                                };
                                Err(e)
                            }
                        };
                    }
                }
            };
            tokio::time::sleep_until(wait_until).await;
        }
    }

    /// Before a process for `for_workspace` is started: if `max_concurrency` shared
    /// processes are up already, drains the least recently used idle one. One is idle
    /// whenever the cap is reached, because the caller holds one of the `max_concurrency`
    /// run permits and every busy process holds at least one other.
    fn make_room(&self, shared: &mut SharedSlots, for_workspace: &WorkspaceId) {
        let up = shared
            .by_workspace
            .values()
            .filter(|slot| slot.live().is_some())
            .count();
        if up < self.inner.spec.max_concurrency.get() {
            return;
        }
        let idle = shared
            .by_workspace
            .iter()
            .filter(|(ws, slot)| {
                *ws != for_workspace
                    && slot
                        .live()
                        .is_some_and(|actor| actor.connection.run_count() == 0)
            })
            .min_by_key(|(_, slot)| slot.last_used)
            .map(|(ws, _)| ws.clone());
        let Some(workspace_id) = idle else {
            return;
        };
        if let Some(slot) = shared.by_workspace.remove(&workspace_id) {
            if let SlotState::Up(actor) = slot.state {
                tracing::info!(runner_id = %self.inner.spec.runner_id, %workspace_id, generation = actor.generation, "draining an idle shared runner process to make room for another workspace");
                // A run that raced for it is refused and retried on a new process.
                let _ = actor.commands.send(Command::Drain);
            }
        }
    }

    /// Forgets a shared actor that stopped taking runs (if it is still the current one of
    /// its workspace).
    fn retire(&self, workspace_id: &WorkspaceId, generation: u64) {
        let mut shared = lock(&self.inner.shared);
        if let Some(slot) = shared.by_workspace.get_mut(workspace_id) {
            if matches!(&slot.state, SlotState::Up(a) if a.generation == generation) {
                slot.state = SlotState::Empty;
            }
        }
    }

    fn spawn_actor(&self, workspace_id: &WorkspaceId) -> Result<ActorRef, RunnerError> {
        let inner = &self.inner;
        if inner.tracker.is_closed() {
            return Err(RunnerError::ShuttingDown);
        }
        let mut process = RunnerProcess::spawn(
            &inner.spec.process,
            inner.config.stderr,
            &inner.config.sandbox,
            inner.lookup_env.as_ref(),
        )?;
        let Some((stdin, stdout)) = process.take_stdio() else {
            return Err(RunnerError::Spawn {
                program: inner.spec.process.program.display().to_string(),
                source: std::io::Error::other("runner stdio pipes missing"),
            });
        };
        let generation = inner.generation.fetch_add(1, Ordering::Relaxed);
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let connection = Connection::new(workspace_id.clone());
        let actor_ref = ActorRef {
            generation,
            commands: cmd_tx,
            exited: CancellationToken::new(),
            connection: connection.clone(),
        };
        lock(&inner.actors).insert(generation, actor_ref.clone());
        lock(&inner.pids).insert(generation, process.pid());
        Metrics::global().gauge_add(
            names::RUNNER_PROCESSES,
            &[("mode", inner.spec.mode.as_str())],
            1.0,
        );
        tracing::info!(runner_id = %inner.spec.runner_id, %workspace_id, pid = process.pid(), uid = process.user().uid.as_raw(), mode = ?inner.spec.mode, "runner process started");

        let caller = Arc::new(CallerIdentity::for_connection(
            &inner.spec.runner_id,
            connection.clone(),
        ));
        let actor = Actor::new(
            generation,
            process,
            stdin,
            stdout,
            cmd_rx,
            RunnerLink::new(inner.spec.mode, inner.config.result_limits)
                .with_run_items_max(inner.config.run_items_max),
            ActorEnv {
                config: inner.config.clone(),
                runner_id: inner.spec.runner_id.clone(),
                api: inner.api.clone(),
                caller,
                connection,
                routes: inner.routes.clone(),
            },
        );
        let host = Arc::downgrade(&self.inner);
        let exited = actor_ref.exited.clone();
        inner.tracker.spawn(async move {
            let report = actor.run().await;
            if let Some(inner) = host.upgrade() {
                RunnerHost { inner }.on_actor_exit(report);
            }
            exited.cancel();
        });
        Ok(actor_ref)
    }

    fn on_actor_exit(&self, report: ExitReport) {
        let inner = &self.inner;
        lock(&inner.actors).remove(&report.generation);
        lock(&inner.pids).remove(&report.generation);
        Metrics::global().gauge_add(
            names::RUNNER_PROCESSES,
            &[("mode", inner.spec.mode.as_str())],
            -1.0,
        );
        if inner.spec.mode != ExecutionMode::Shared {
            return;
        }
        let mut shared = lock(&inner.shared);
        let Some(slot) = shared.by_workspace.get_mut(&report.workspace_id) else {
            // Drained to make room: nothing is kept for its workspace.
            return;
        };
        let current = matches!(&slot.state, SlotState::Up(a) if a.generation == report.generation);
        if report.expected {
            if current {
                slot.state = SlotState::Empty;
            }
            slot.failures = 0;
            if slot.is_vacant() {
                shared.by_workspace.remove(&report.workspace_id);
            }
            return;
        }
        slot.failures = if report.uptime >= inner.config.healthy_after {
            1
        } else {
            slot.failures + 1
        };
        let delay = backoff_delay(&inner.config, slot.failures);
        // The next run of the workspace starts a new process once the delay has passed.
        Metrics::global().inc(names::RUNNER_RESTARTS_TOTAL, &[("reason", "crashed")]);
        tracing::warn!(runner_id = %inner.spec.runner_id, workspace_id = %report.workspace_id, failures = slot.failures, restart_in_ms = delay.as_millis() as u64, "shared runner process exited unexpectedly");
        if current || matches!(slot.state, SlotState::Empty) {
            slot.state = SlotState::Backoff {
                until: Instant::now() + delay,
            };
        }
    }
}

/// Restart delay after `failures` consecutive failures: 0 for none, then the initial delay
/// doubling up to the maximum.
fn backoff_delay(config: &RunnerHostOptions, failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    RetryPolicy::new(config.restart_backoff_initial, config.restart_backoff_max).delay(failures - 1)
}

fn to_instant(at: SystemTime) -> Instant {
    match at.duration_since(SystemTime::now()) {
        Ok(left) => Instant::now() + left,
        Err(_) => Instant::now(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let config = RunnerHostOptions {
            restart_backoff_initial: Duration::from_millis(100),
            restart_backoff_max: Duration::from_secs(1),
            ..RunnerHostOptions::default()
        };
        let delays: Vec<u128> = (0..7)
            .map(|f| backoff_delay(&config, f).as_millis())
            .collect();
        assert_eq!(delays, vec![0, 100, 200, 400, 800, 1000, 1000]);
        assert_eq!(backoff_delay(&config, u32::MAX), Duration::from_secs(1));
    }
}
