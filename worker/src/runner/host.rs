//! [`RunnerHost`]: hosts the processes of one runner and runs on them (SPEC §4.2–§4.4, §11).
//!
//! ```text
//!  start_run(req) ──▶ RunnerHost ──(shared: the one process | per_run: a new process)──▶ actor
//!        ▲                                                                             │
//!        └──────────── RunHandle ◀── RunItem 1, 2, 3, …, terminal ◀────────────────────┘
//! ```
//!
//! Each process is driven by one **actor** task that owns the [`RunnerProcess`], a
//! [`Session`] (the pure state machine) and the run timers; a reader task turns stdout into
//! frames, a writer task batches messages to stdin, and one task per Host API call serves it
//! through the injected [`HostApi`]. The actor applies the session's [`Effect`]s.
//!
//! Host API calls get **exactly one** `api_result` each: the serving task and the end of the
//! call's run (which answers `not_found`) race through the call's [`ApiStream`], which lets
//! only the first answer through. A call id already in flight on the process is refused
//! with `conflict` (answers carry no run id, so one id must name one call at a time).
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
//! ([`RunnerHostConfig::restart_backoff_initial`] doubling up to
//! [`RunnerHostConfig::restart_backoff_max`]; a process that stayed up for
//! [`RunnerHostConfig::healthy_after`] resets it). Idle processes stay up for the next run of
//! their workspace; when a new workspace needs a process and `max_concurrency` processes are
//! already up, the least recently used idle one is drained to make room, so a runner never
//! has more than `max_concurrency` processes serving. `per_run` mode starts a process per
//! run (at most `max_concurrency` at once) and retires it when the run ends.
//!
//! Every process is confined by [`RunnerHostConfig::sandbox`] (see [`super::sandbox`]), and
//! its Host API calls carry its [`Connection`] (workspace and current runs) to the gate.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::num::{NonZeroU64, NonZeroUsize};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::Stream;
use nix::sys::signal::Signal;
use sb_common::config::SandboxConfig;
use sb_common::telemetry::{Registry, names};
use sb_host_api::api::{ApiStream, CallerIdentity, Connection, HostApi};
use sb_protocol::context::AgentRunContext;
use sb_protocol::error::{AgentApiError, ErrorCode, run_failure};
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::manifest::RunnerId;
use sb_protocol::result::{AgentRunResult, ResultLimits};
use sb_protocol::wire::{ApiCallId, ApiResult, DEFAULT_MAX_LINE_BYTES, HostToRunner};
use tokio::process::{ChildStdin, ChildStdout};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::codec::{FrameError, MessageReader, MessageWriter, RunnerLine};
use super::error::RunnerError;
use super::process::{ProcessSpec, RunnerProcess, StderrConfig};
use super::session::{Effect, ExecutionMode, Input, Phase, Session, StartRefused, not_active};
use crate::sequencer::RunItem;

/// How a host reads the worker's environment for a process's allowlisted variables
/// (`std::env::var_os` in production, a map in tests).
pub type EnvLookup = Arc<dyn Fn(&str) -> Option<OsString> + Send + Sync>;

/// Where each active run lives: the command channel of its actor.
type Routes = Arc<Mutex<HashMap<RunId, mpsc::UnboundedSender<Command>>>>;

/// What to host: one runner of a plugin, resolved from its manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerSpec {
    pub runner_id: RunnerId,
    pub process: ProcessSpec,
    pub mode: ExecutionMode,
    /// `shared`: concurrent runs on the process; `per_run`: concurrent processes.
    pub max_concurrency: NonZeroUsize,
}

/// Tuning of a [`RunnerHost`]. Defaults follow SPEC §13; tests shorten the durations.
#[derive(Debug, Clone)]
pub struct RunnerHostConfig {
    /// Cap on one stdout line (SPEC: 4 MiB).
    pub max_line_bytes: usize,
    /// Result caps applied by the sequencer (1 MiB per result).
    pub result_limits: ResultLimits,
    /// Most result items per run, its terminal item included (`limits.run_items_max`).
    pub run_items_max: NonZeroU64,
    /// After a `cancel`, how long the runner has to end the run itself before the host ends
    /// it as `cancelled`.
    pub cancel_grace: Duration,
    /// Between group `SIGTERM` and group `SIGKILL`; also how long a process may take to exit
    /// after `shutdown` and end of input.
    pub kill_grace: Duration,
    /// First restart delay after a crash of the shared process.
    pub restart_backoff_initial: Duration,
    /// Largest restart delay.
    pub restart_backoff_max: Duration,
    /// A process that stayed up this long before crashing restarts after the initial delay
    /// again (the crash counter resets).
    pub healthy_after: Duration,
    /// Items buffered per run between the process and its [`RunHandle`].
    pub run_buffer: usize,
    pub stderr: StderrConfig,
    /// How every process is confined (`worker.sandbox`, SPEC §14).
    pub sandbox: SandboxConfig,
}

impl Default for RunnerHostConfig {
    fn default() -> Self {
        Self {
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            result_limits: ResultLimits::default(),
            run_items_max: crate::sequencer::DEFAULT_RUN_ITEMS_MAX,
            // Enough for a runner to close an upstream stream and report; short enough that a
            // user's cancel feels immediate.
            cancel_grace: Duration::from_secs(5),
            kill_grace: Duration::from_secs(5),
            restart_backoff_initial: Duration::from_millis(200),
            restart_backoff_max: Duration::from_secs(30),
            healthy_after: Duration::from_secs(60),
            // A burst of deltas fits; a stalled consumer pushes back within a few hundred items.
            run_buffer: 256,
            stderr: StderrConfig::default(),
            sandbox: SandboxConfig::default(),
        }
    }
}

/// A run to start.
#[derive(Debug, Clone)]
pub struct RunRequest {
    pub run_id: RunId,
    /// The tenant of the run: a `shared` run goes to the process of this workspace only.
    /// The worker sets it from the job (the orchestrator's authoritative value).
    pub workspace_id: WorkspaceId,
    pub context: AgentRunContext,
    /// Hard deadline: the run fails with `timeout` when it passes.
    pub deadline: Option<SystemTime>,
}

impl RunRequest {
    /// A request for `context`, with the run id, the workspace (`conversation.workspace_id`,
    /// else the default workspace) and the deadline (`runtime.deadline_at`) taken from it.
    #[must_use]
    pub fn new(context: AgentRunContext) -> Self {
        let deadline = context
            .runtime
            .deadline_at
            .filter(|s| s.is_finite() && *s > 0.0)
            .and_then(|s| UNIX_EPOCH.checked_add(Duration::from_secs_f64(s)));
        let workspace_id = context
            .conversation
            .as_ref()
            .and_then(|c| c.workspace_id.as_deref())
            .and_then(|w| WorkspaceId::new(w).ok())
            .unwrap_or_else(WorkspaceId::default_workspace);
        Self {
            run_id: context.run_id,
            workspace_id,
            context,
            deadline,
        }
    }

    /// The same request in `workspace_id`.
    #[must_use]
    pub fn in_workspace(mut self, workspace_id: WorkspaceId) -> Self {
        self.workspace_id = workspace_id;
        self
    }
}

enum Command {
    Start {
        run_id: RunId,
        context: Box<AgentRunContext>,
        deadline: Option<Instant>,
        slot: RunSlot,
        reply: oneshot::Sender<Result<(), Refusal>>,
    },
    Cancel {
        run_id: RunId,
        reason: String,
    },
    Drain,
    Abort {
        detail: String,
    },
}

/// A refused start hands everything back so the host can retry on another process.
struct Refusal {
    reason: StartRefused,
    slot: RunSlot,
    context: Box<AgentRunContext>,
}

/// Per-run resources held by the actor until the run ends.
struct RunSlot {
    events: mpsc::Sender<RunItem>,
    /// Concurrency permit, released when the run ends.
    _permit: OwnedSemaphorePermit,
}

/// A Host API call being served for a run of the process.
struct InFlightCall {
    run_id: RunId,
    /// Shared with the serving task: whoever answers first (the task with its outcome, or
    /// the end of the run with `not_found`) writes the call's one answer.
    reply: ApiStream,
    task: AbortHandle,
}

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

/// How an actor ended, for the restart policy.
struct ExitReport {
    generation: u64,
    workspace_id: WorkspaceId,
    /// The host asked it to drain (not a crash).
    expected: bool,
    uptime: Duration,
}

struct HostInner {
    spec: RunnerSpec,
    config: Arc<RunnerHostConfig>,
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl RunnerHost {
    /// A host for `spec`. Processes inherit only the allowlisted variables of the worker's
    /// own environment, and run confined by `config.sandbox`.
    #[must_use]
    pub fn new(spec: RunnerSpec, config: RunnerHostConfig, api: Arc<dyn HostApi>) -> Self {
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
        config: RunnerHostConfig,
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
                    return Ok(RunHandle {
                        run_id,
                        events: events_rx,
                        control: actor.commands,
                        last_sequence: 0,
                        finished: false,
                    });
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
        Registry::global().gauge_add(
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
            Session::new(inner.spec.mode, inner.config.result_limits)
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
        Registry::global().gauge_add(
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
        Registry::global().inc(names::RUNNER_RESTARTS_TOTAL, &[("reason", "crashed")]);
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
fn backoff_delay(config: &RunnerHostConfig, failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(20));
    config
        .restart_backoff_initial
        .saturating_mul(factor)
        .min(config.restart_backoff_max)
}

fn to_instant(at: SystemTime) -> Instant {
    match at.duration_since(SystemTime::now()) {
        Ok(left) => Instant::now() + left,
        Err(_) => Instant::now(),
    }
}

/// The consumer side of one run. See the module docs for the contract.
pub struct RunHandle {
    run_id: RunId,
    events: mpsc::Receiver<RunItem>,
    control: mpsc::UnboundedSender<Command>,
    last_sequence: u64,
    finished: bool,
}

impl RunHandle {
    #[must_use]
    pub fn run_id(&self) -> RunId {
        self.run_id
    }

    /// The next item, or `None` after the terminal item.
    pub async fn next(&mut self) -> Option<RunItem> {
        std::future::poll_fn(|cx| self.poll_item(cx)).await
    }

    /// Asks for the run to be cancelled (see [`RunnerHost::cancel`]).
    pub fn cancel(&self, reason: impl Into<String>) {
        if !self.finished {
            let _ = self.control.send(Command::Cancel {
                run_id: self.run_id,
                reason: reason.into(),
            });
        }
    }

    fn poll_item(&mut self, cx: &mut Context<'_>) -> Poll<Option<RunItem>> {
        if self.finished {
            return Poll::Ready(None);
        }
        match self.events.poll_recv(cx) {
            Poll::Ready(Some(item)) => {
                self.last_sequence = item.sequence;
                self.finished = item.is_terminal();
                Poll::Ready(Some(item))
            }
            Poll::Ready(None) => {
                // The actor went away without a terminal item (it panicked). Keep the
                // contract: exactly one terminal item.
                self.finished = true;
                let sequence = self.last_sequence + 1;
                let result = AgentRunResult::run_failed(
                    run_failure::RUNNER_CRASHED,
                    "runner host lost the run",
                    false,
                )
                .with_run_id(self.run_id)
                .with_sequence(sequence);
                Poll::Ready(Some(RunItem { sequence, result }))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Stream for RunHandle {
    type Item = RunItem;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<RunItem>> {
        self.get_mut().poll_item(cx)
    }
}

impl Drop for RunHandle {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.control.send(Command::Cancel {
                run_id: self.run_id,
                reason: "run handle dropped".into(),
            });
        }
    }
}

impl std::fmt::Debug for RunHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunHandle")
            .field("run_id", &self.run_id)
            .field("last_sequence", &self.last_sequence)
            .field("finished", &self.finished)
            .finish()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Timer {
    Deadline(RunId),
    CancelGrace(RunId),
    /// The process should have exited after `shutdown` + end of input.
    ExitOverdue,
    /// `SIGTERM` was sent; the grace period is over.
    ForceKill,
}

/// What an actor needs from its host. Deliberately not the host itself: an actor must not
/// keep its host alive, so that dropping the last [`RunnerHost`] (and every [`RunHandle`])
/// closes the actor's command channel and stops the process.
struct ActorEnv {
    config: Arc<RunnerHostConfig>,
    runner_id: RunnerId,
    api: Arc<dyn HostApi>,
    /// The identity calls of this process are made with (carries `connection`).
    caller: Arc<CallerIdentity>,
    /// The process's workspace and current runs, kept current by the actor.
    connection: Connection,
    routes: Routes,
}

/// Drives one process. See the module docs.
struct Actor {
    generation: u64,
    /// The runner id as written in `run` messages.
    runner: String,
    process: RunnerProcess,
    session: Session,
    env: ActorEnv,
    commands: mpsc::UnboundedReceiver<Command>,
    commands_open: bool,
    frames: mpsc::Receiver<Result<RunnerLine, FrameError>>,
    stdout_open: bool,
    writer: mpsc::Sender<HostToRunner>,
    close_input: Option<oneshot::Sender<()>>,
    runs: HashMap<RunId, RunSlot>,
    /// Host API calls not yet answered (or answered but not yet pruned), by call id over
    /// **all** runs of the process: answers carry no run id, so an id names one call of the
    /// process at a time.
    calls: HashMap<ApiCallId, InFlightCall>,
    timers: BTreeMap<(Instant, u64), Timer>,
    /// Keys of the pending timers of each run, so a finished run's timers are dropped at once
    /// instead of lingering until their deadline.
    run_timers: HashMap<RunId, Vec<(Instant, u64)>>,
    timer_seq: u64,
    exit_status: Option<std::io::Result<std::process::ExitStatus>>,
    started: Instant,
    drain_requested: bool,
    killing: bool,
}

impl Actor {
    fn new(
        generation: u64,
        process: RunnerProcess,
        stdin: ChildStdin,
        stdout: ChildStdout,
        commands: mpsc::UnboundedReceiver<Command>,
        session: Session,
        env: ActorEnv,
    ) -> Self {
        let (frames_tx, frames_rx) = mpsc::channel(256);
        tokio::spawn(read_frames(
            MessageReader::new(stdout, env.config.max_line_bytes),
            frames_tx,
        ));
        let (writer_tx, writer_rx) = mpsc::channel(1024);
        let (close_tx, close_rx) = oneshot::channel();
        tokio::spawn(write_frames(MessageWriter::new(stdin), writer_rx, close_rx));
        let runner = env.runner_id.to_string();
        Self {
            generation,
            runner,
            process,
            session,
            env,
            commands,
            commands_open: true,
            frames: frames_rx,
            stdout_open: true,
            writer: writer_tx,
            close_input: Some(close_tx),
            runs: HashMap::new(),
            calls: HashMap::new(),
            timers: BTreeMap::new(),
            run_timers: HashMap::new(),
            timer_seq: 0,
            exit_status: None,
            started: Instant::now(),
            drain_requested: false,
            killing: false,
        }
    }

    fn config(&self) -> &RunnerHostConfig {
        &self.env.config
    }

    async fn run(mut self) -> ExitReport {
        loop {
            let next_timer = self.timers.keys().next().map(|(at, _)| *at);
            tokio::select! {
                biased;
                cmd = self.commands.recv(), if self.commands_open => match cmd {
                    Some(cmd) => self.on_command(cmd).await,
                    None => {
                        // The host is gone entirely: nobody can consume results any more.
                        self.commands_open = false;
                        let fx = self.session.on(Input::Abort { detail: "runner host dropped".into() });
                        self.apply(fx).await;
                    }
                },
                frame = self.frames.recv(), if self.stdout_open => match frame {
                    Some(Ok(line)) => {
                        let fx = self.session.on(line_input(line));
                        self.apply(fx).await;
                    }
                    Some(Err(e)) => {
                        let fx = self.session.on(Input::BadFrame {
                            run_id: e.run_id_hint().map(str::to_owned),
                            detail: e.to_string(),
                        });
                        self.apply(fx).await;
                    }
                    None => self.stdout_open = false,
                },
                status = self.process.wait(), if self.exit_status.is_none() => {
                    self.exit_status = Some(status);
                }
                () = sleep_until_opt(next_timer) => self.fire_timers().await,
            }
            if !self.stdout_open || self.exit_status.is_some() {
                break;
            }
        }
        self.finish().await
    }

    /// The process is exiting (stdout closed or the process was reaped): collect the rest,
    /// end the remaining runs, report.
    async fn finish(mut self) -> ExitReport {
        let grace = self.config().kill_grace;
        // Lines still buffered in the pipe belong to the runs: read them first.
        while self.stdout_open {
            match tokio::time::timeout(grace, self.frames.recv()).await {
                Ok(Some(Ok(line))) => {
                    let fx = self.session.on(line_input(line));
                    self.apply(fx).await;
                }
                Ok(Some(Err(e))) => {
                    let fx = self.session.on(Input::BadFrame {
                        run_id: e.run_id_hint().map(str::to_owned),
                        detail: e.to_string(),
                    });
                    self.apply(fx).await;
                }
                // End of output, or a helper process still holds stdout open: stop reading.
                Ok(None) | Err(_) => self.stdout_open = false,
            }
        }
        if self.exit_status.is_none() {
            // Output closed but the process lives on: give it the grace period, then kill.
            self.exit_status = Some(
                match tokio::time::timeout(grace, self.process.wait()).await {
                    Ok(status) => status,
                    Err(_) => self.process.terminate(grace).await,
                },
            );
        }
        // Helpers left in the group are not allowed to outlive the runner.
        self.process.signal_group(Signal::SIGKILL);
        self.process.drain_stderr(Duration::from_millis(200)).await;
        let (clean, detail) = match &self.exit_status {
            Some(Ok(status)) => (status.success(), describe_exit(*status)),
            Some(Err(e)) => (false, format!("waiting for the process failed: {e}")),
            None => (false, "unknown exit".into()),
        };
        let runner_id = &self.env.runner_id;
        if self.drain_requested || (self.session.phase() == Phase::Draining && clean) {
            tracing::info!(%runner_id, pid = self.process.pid(), %detail, "runner process exited");
        } else {
            tracing::warn!(%runner_id, pid = self.process.pid(), %detail, in_flight = self.session.active_runs(), "runner process exited unexpectedly");
        }
        let expected = self.drain_requested
            || (self.session.phase() == Phase::Draining
                && self.session.mode() == ExecutionMode::PerRun);
        let fx = self.session.on(Input::Exited { clean, detail });
        self.apply(fx).await;
        // Refuse whatever start requests raced with the exit.
        self.commands.close();
        while let Ok(cmd) = self.commands.try_recv() {
            if let Command::Start {
                slot,
                reply,
                context,
                ..
            } = cmd
            {
                let _ = reply.send(Err(Refusal {
                    reason: StartRefused::NotAccepting,
                    slot,
                    context,
                }));
            }
        }
        ExitReport {
            generation: self.generation,
            workspace_id: self.env.connection.workspace_id().clone(),
            expected,
            uptime: self.started.elapsed(),
        }
    }

    async fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Start {
                run_id,
                context,
                deadline,
                slot,
                reply,
            } => {
                if let Err(reason) = self.session.check_start(run_id) {
                    let _ = reply.send(Err(Refusal {
                        reason,
                        slot,
                        context,
                    }));
                    return;
                }
                match self.session.start_run(run_id, &self.runner, context) {
                    Ok(fx) => {
                        // Before the runner hears of the run, so its first call passes the gate.
                        self.env.connection.attach(run_id);
                        self.runs.insert(run_id, slot);
                        if let Some(at) = deadline {
                            self.arm(at, Timer::Deadline(run_id));
                        }
                        let _ = reply.send(Ok(()));
                        self.apply(fx).await;
                    }
                    Err(reason) => {
                        // check_start just passed; keep the contract anyway.
                        tracing::error!(%run_id, %reason, "run refused after check");
                        drop(slot);
                        drop(reply);
                    }
                }
            }
            Command::Cancel { run_id, reason } => {
                let fx = self.session.on(Input::Cancel { run_id, reason });
                self.apply(fx).await;
            }
            Command::Drain => {
                self.drain_requested = true;
                let fx = self.session.on(Input::Drain);
                self.apply(fx).await;
            }
            Command::Abort { detail } => {
                let fx = self.session.on(Input::Abort { detail });
                self.apply(fx).await;
            }
        }
    }

    fn arm(&mut self, at: Instant, timer: Timer) {
        self.timer_seq += 1;
        let key = (at, self.timer_seq);
        if let Timer::Deadline(run_id) | Timer::CancelGrace(run_id) = timer {
            self.run_timers.entry(run_id).or_default().push(key);
        }
        self.timers.insert(key, timer);
    }

    async fn fire_timers(&mut self) {
        let now = Instant::now();
        while let Some(entry) = self.timers.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let timer = entry.remove();
            let fx = match timer {
                Timer::Deadline(run_id) if self.runs.contains_key(&run_id) => {
                    tracing::info!(%run_id, "run deadline passed");
                    self.session.on(Input::DeadlinePassed { run_id })
                }
                Timer::CancelGrace(run_id) if self.runs.contains_key(&run_id) => {
                    self.session.on(Input::CancelGraceElapsed { run_id })
                }
                Timer::ExitOverdue if self.exit_status.is_none() => {
                    tracing::warn!(runner_id = %self.env.runner_id, pid = self.process.pid(), "runner did not exit after shutdown");
                    vec![Effect::Kill]
                }
                Timer::ForceKill if self.exit_status.is_none() => {
                    tracing::warn!(runner_id = %self.env.runner_id, pid = self.process.pid(), "runner ignored SIGTERM, killing its process group");
                    self.process.signal_group(Signal::SIGKILL);
                    Vec::new()
                }
                _ => Vec::new(),
            };
            self.apply(fx).await;
        }
    }

    async fn apply(&mut self, effects: Vec<Effect>) {
        for effect in effects {
            match effect {
                Effect::Write(msg) => {
                    // A closed writer means the process is gone; its exit is handled in run().
                    let _ = self.writer.send(msg).await;
                }
                Effect::Deliver { run_id, item } => {
                    if let Some(slot) = self.runs.get(&run_id) {
                        // A dropped handle is not an error: its drop already asked to cancel.
                        let _ = slot.events.send(item).await;
                    }
                }
                Effect::RunEnded { run_id } => self.end_run(run_id).await,
                Effect::Dispatch {
                    call_id,
                    run_id,
                    action,
                    params,
                } => {
                    self.dispatch(call_id, run_id, action, params).await;
                }
                Effect::StartCancelGrace { run_id } => {
                    let at = Instant::now() + self.config().cancel_grace;
                    self.arm(at, Timer::CancelGrace(run_id));
                }
                Effect::CloseInput => {
                    if let Some(close) = self.close_input.take() {
                        let _ = close.send(());
                    }
                    let at = Instant::now() + self.config().kill_grace;
                    self.arm(at, Timer::ExitOverdue);
                }
                Effect::Kill => {
                    if !self.killing && self.exit_status.is_none() {
                        self.killing = true;
                        self.process.signal_group(Signal::SIGTERM);
                        let at = Instant::now() + self.config().kill_grace;
                        self.arm(at, Timer::ForceKill);
                    }
                }
            }
        }
    }

    async fn end_run(&mut self, run_id: RunId) {
        self.env.connection.detach(run_id);
        lock(&self.env.routes).remove(&run_id);
        for key in self.run_timers.remove(&run_id).unwrap_or_default() {
            self.timers.remove(&key);
        }
        if self.runs.remove(&run_id).is_none() {
            return;
        }
        // Calls still in flight will never be useful: stop them and tell the runner. A call
        // whose task already answered (even one still finishing) keeps that answer: the
        // shared reply lets exactly one of the two through.
        let ids: Vec<ApiCallId> = self
            .calls
            .iter()
            .filter(|(_, call)| call.run_id == run_id)
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            if let Some(call) = self.calls.remove(&id) {
                call.task.abort();
                call.reply
                    .answer(Err(not_active(&run_id.to_string())))
                    .await;
            }
        }
        // Dropping the slot released the concurrency permit and closed the run's channel.
    }

    /// Serves a call of an active run on its own task, unless its id is already in flight
    /// on this process: reusing it would make the two answers indistinguishable to the
    /// runner (and used to cost the first call its abort handle), so the second call is
    /// refused with `conflict` and the first goes on undisturbed.
    async fn dispatch(
        &mut self,
        call_id: ApiCallId,
        run_id: RunId,
        action: String,
        params: serde_json::Value,
    ) {
        if !self.runs.contains_key(&run_id) {
            return;
        }
        self.calls.retain(|_, call| !call.reply.is_answered());
        if let Some(first) = self.calls.get(&call_id) {
            tracing::warn!(%run_id, first_run_id = %first.run_id, %call_id, %action, "api call id already in flight, call refused");
            let error = AgentApiError::new(
                ErrorCode::Conflict,
                format!(
                    "api call id {call_id} is already in flight on this process; use an id per call"
                ),
            )
            .with_detail("id", serde_json::to_value(&call_id).unwrap_or_default());
            // Written directly, not through the first call's reply, which still belongs to
            // the first call.
            let _ = self
                .writer
                .send(HostToRunner::ApiResult(ApiResult::failure(call_id, error)))
                .await;
            return;
        }
        let api = self.env.api.clone();
        let caller = self.env.caller.clone();
        let reply = ApiStream::new(call_id.clone(), self.writer.clone());
        let stream = reply.clone();
        let task = tokio::spawn(async move {
            let outcome = api.call(&caller, run_id, &action, params, &stream).await;
            if let Err(e) = &outcome {
                tracing::debug!(%run_id, %action, code = %e.code, "host api call refused");
            }
            stream.answer(outcome).await;
        });
        self.calls.insert(
            call_id,
            InFlightCall {
                run_id,
                reply,
                task: task.abort_handle(),
            },
        );
    }
}

/// What a decoded runner line means to the session.
fn line_input(line: RunnerLine) -> Input {
    match line {
        RunnerLine::Message(message) => Input::Frame(message),
        RunnerLine::RefusedCall(call) => Input::RefusedCall(call),
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn describe_exit(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => "unknown exit".into(),
    }
}

async fn read_frames(
    mut reader: MessageReader<ChildStdout>,
    frames: mpsc::Sender<Result<RunnerLine, FrameError>>,
) {
    loop {
        match reader.read_message().await {
            Ok(Some(msg)) => {
                if frames.send(Ok(msg)).await.is_err() {
                    return;
                }
            }
            Ok(None) => return,
            Err(e) if e.is_recoverable() => {
                if frames.send(Err(e)).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "runner stdout read failed");
                return;
            }
        }
    }
}

/// Writes messages in arrival order, flushing when the queue runs dry (one syscall per
/// burst). On `close` (after the queue is drained) it closes the runner's stdin.
async fn write_frames(
    mut writer: MessageWriter<ChildStdin>,
    mut messages: mpsc::Receiver<HostToRunner>,
    mut close: oneshot::Receiver<()>,
) {
    loop {
        let msg = tokio::select! {
            biased;
            msg = messages.recv() => msg,
            // Also taken when the actor is gone (sender dropped): close either way.
            _ = &mut close => {
                // Write what is already queued, then close.
                let mut ok = true;
                while let Ok(msg) = messages.try_recv() {
                    ok = ok && writer.write_message_buffered(&msg).await.is_ok();
                }
                if ok {
                    let _ = writer.close().await;
                }
                // Keep draining (and discarding) so senders never block on a dead pipe.
                while messages.recv().await.is_some() {}
                return;
            }
        };
        let Some(msg) = msg else { return };
        if writer.write_message_buffered(&msg).await.is_err() {
            break;
        }
        let mut failed = false;
        while let Ok(more) = messages.try_recv() {
            if writer.write_message_buffered(&more).await.is_err() {
                failed = true;
                break;
            }
        }
        if failed || writer.flush().await.is_err() {
            break;
        }
    }
    // The pipe is broken (the process died): discard the rest so senders never block.
    while messages.recv().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let config = RunnerHostConfig {
            restart_backoff_initial: Duration::from_millis(100),
            restart_backoff_max: Duration::from_secs(1),
            ..RunnerHostConfig::default()
        };
        let delays: Vec<u128> = (0..7)
            .map(|f| backoff_delay(&config, f).as_millis())
            .collect();
        assert_eq!(delays, vec![0, 100, 200, 400, 800, 1000, 1000]);
        assert_eq!(backoff_delay(&config, u32::MAX), Duration::from_secs(1));
    }
}
