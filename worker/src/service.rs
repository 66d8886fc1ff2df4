//! The worker service: consumes run jobs, executes them on the runner hosts, publishes their
//! sequenced results, follows cancel messages, and drains on shutdown (SPEC §2 step 3, §3,
//! §4.4, §11).
//!
//! # One job
//!
//! ```text
//!  delivery ─decode─▶ RunJob ──(bad body: dead-letter via ErrorCode::disposition)
//!     │
//!     ▼ reserve run_id on this worker ── already active here ──────────────▶ ack (duplicate)
//!     ▼ begin_run: acquire lease:<run_id>, read the cancel flag and the session (one round trip)
//!     │   └─ held by a live worker (kept after waiting one lease TTL for it
//!     │      to lapse) ───────────────────────────────────────────────────▶ ack (duplicate)
//!     ▼ claim queued → running ── lost ─▶ decide_claim_lost(status, session?)
//!     │                                     ├─ terminal / no run / no session ▶ ack (drop)
//!     │                                     └─ running + session ─▶ finalize `interrupted`
//!     │                                        (item + status in one ledger commit, then published)
//!     ▼ cancel flag set? deadline passed? runner missing? ─▶ terminal run.failed, seq 1
//!     ▼ start on the RunnerHost; heartbeat renews the lease (missing while the run is still
//!     │ ours ─▶ re-established with the run's session; held by another ─▶ cancel the run)
//!     ▼ publish every item (seq 1, 2, 3, …, exactly one terminal) to switchboard.results,
//!     │ ready items pipelined in one confirmed batch, failures retried in order
//!     ▼ terminal: end_run: end the session, drop the cancel flag, mark the run handed off,
//!     │ release the lease (one round trip) ─▶ steering.dropped audits ─▶ ack
//! ```
//!
//! # Cancel messages
//! The worker's exclusive control queue is bound to `cancel.*` once, at start, and a cancel
//! for a run this worker does not hold is acked and ignored. Binding `cancel.<run_id>` per
//! run instead would put two broker round trips (bind before the run starts, unbind after)
//! and a broker metadata change on every run's path, to save every worker from seeing cancel
//! messages, which are rare (user cancels, the `interrupt` policy). With the binding in place
//! from the start there is also no window in which a cancel published for a just-claimed run
//! reaches nobody; the session-store cancel flag still covers a run cancelled before any
//! worker took its job.
//!
//! # Why the lease comes before the claim
//! A run that is `running` in the ledger while nobody holds its lease was abandoned by a dead
//! worker. If the claim came first there would be a moment where our own fresh claim looks
//! exactly like that to a duplicate delivery, which would then finalize a live run as
//! `interrupted`. Taking the lease first closes the window: whoever holds the lease owns the
//! decision.
//!
//! # Why a redelivered job looks at the session
//! A finished run's terminal status is written by the orchestrator's result sink, which may
//! lag behind the worker. So `running` + free lease alone does not prove a crash: the run may
//! have ended cleanly a moment ago. The worker ends the run's session before it releases the
//! lease, so "session still present" is what distinguishes a crash (finalize `interrupted`)
//! from a clean end (drop the duplicate). A crash old enough for the session to have expired
//! is left to the orchestrator's reaper, which finalizes runs with expired leases.
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

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chrono::Utc;
use futures::FutureExt as _;
use sb_common::bus::topology::{CONTROL_ALL_PATTERN, Topology, declare_topology};
use sb_common::bus::{
    Binding, Bus, BusError, ConsumeOptions, Delivery, Outgoing, Settlement, Subscription,
};
use sb_common::config::{SwitchboardConfig, WorkerConfig};
use sb_common::error::ShutdownError;
use sb_common::session::{
    RUN_HANDED_OFF_TTL, RunBegin, SessionError, SessionStore, announce_routing_change,
    run_lease_key,
};
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Registry, names};
use sb_host_api::actions::{AUDIT_TARGET, ActionDispatcher, ActionLimits};
use sb_host_api::api::HostApi;
use sb_host_api::api_gate::{ApiGate, Dispatcher};
use sb_protocol::error::{Disposition, ErrorCode, HasErrorCode, run_failure};
use sb_protocol::host::AgentRunnerDescriptor;
use sb_protocol::ids::RunId;
use sb_protocol::manifest::RunnerId;
use sb_protocol::messages::{ControlMessage, ResultBatch, ResultMessage, RunJob, decode, encode};
use sb_protocol::result::{AgentRunResult, ResultLimits, ResultType};
use sb_store::{
    EventLog, Finalized, RunLedger, RunOutcome, RunStatus, RunnerRow, StoreError, Stores, audit,
};
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::{AbortOnDropHandle, TaskTracker};
use tracing::Instrument as _;

use crate::plugins::{CommandLookup, PluginRunner, bundled_runners_dir, load_plugins};
use crate::runner::{
    RunHandle, RunRequest, RunnerHost, RunnerHostConfig, SandboxError, make_undumpable,
};
use crate::sequencer::RunItem;

/// Most result items taken from a run for one publish.
const MAX_BATCH: usize = 64;
/// Largest body of one `switchboard.results/1` message: a batch above it is split (a single
/// item is bounded by `worker.max_result_bytes` on its own). Far below the broker's message
/// size limit, and small enough that one batch never holds a shard's consumer for long.
const BATCH_BYTES_MAX: usize = 1024 * 1024;
/// Prefetch of the control queue (cancel messages are tiny and handled inline).
const CONTROL_PREFETCH: u16 = 64;
/// After cancelling the runs left at the drain deadline, extra time (beyond the cancel grace)
/// for their terminal item to be published and their job acked.
const CANCEL_SETTLE: Duration = Duration::from_secs(2);
/// After forcing the last runs, how long their tasks get to nack and release their leases.
const FORCE_SETTLE: Duration = Duration::from_secs(5);
/// First and largest delay between attempts while the bus (publishing results) or the ledger
/// (claiming a run) fails.
const RETRY_INITIAL: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(5);
/// Pause after a transient consume error before pulling again.
const CONSUME_ERROR_PAUSE: Duration = Duration::from_millis(500);

/// The session-store key of a run's worker lease ([`run_lease_key`]: the reaper reads it
/// too).
#[must_use]
pub fn lease_key(run_id: &RunId) -> String {
    run_lease_key(run_id)
}

/// Everything the worker talks to.
#[derive(Clone)]
pub struct WorkerDeps {
    /// The message bus (jobs in, results out, control).
    pub bus: Arc<dyn Bus>,
    /// Active-run sessions, leases, cancel flags.
    pub sessions: Arc<dyn SessionStore>,
    /// The ledger (claims) and the runner registry.
    pub stores: Stores,
    /// The whole configuration (the `worker` and `limits` sections are used).
    pub config: Arc<SwitchboardConfig>,
    /// Exchange and queue names shared by every role of the deployment.
    pub topology: Topology,
}

impl std::fmt::Debug for WorkerDeps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerDeps")
            .field("topology", &self.topology)
            .finish_non_exhaustive()
    }
}

/// How the worker finds its runners and serves their Host API calls.
#[derive(Clone)]
pub struct WorkerOptions {
    /// Also load the bundled runners directory (see [`bundled_runners_dir`]) after the
    /// configured `worker.runners_dirs`. Default `true`.
    pub bundled_runners: bool,
    /// Where runner commands are looked up.
    pub command_lookup: CommandLookup,
    /// Serves Host API calls that passed the gate; `None` (the default) serves them with
    /// [`ActionDispatcher`] over the worker's stores and session store and the configured
    /// `[limits]`.
    pub dispatcher: Option<Arc<dyn Dispatcher>>,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            bundled_runners: true,
            command_lookup: CommandLookup::from_env(),
            dispatcher: None,
        }
    }
}

impl std::fmt::Debug for WorkerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerOptions")
            .field("bundled_runners", &self.bundled_runners)
            .field("command_lookup", &self.command_lookup)
            .finish_non_exhaustive()
    }
}

/// Why the worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A runner could not be registered in the `runners` table.
    #[error("cannot register runner {runner_id}: {source}")]
    Register {
        /// The runner.
        runner_id: String,
        /// The store failure.
        #[source]
        source: StoreError,
    },
    /// A runner's manifest does not make a valid descriptor.
    #[error("runner {runner_id} has an invalid descriptor: {reason}")]
    Descriptor {
        /// The runner.
        runner_id: String,
        /// What is wrong.
        reason: String,
    },
    /// The topology could not be declared or a queue consumed.
    #[error("cannot set up {what}: {source}")]
    Bus {
        /// Which queue or step.
        what: String,
        /// The bus failure.
        #[source]
        source: BusError,
    },
    /// The worker could not protect itself from its runners (SPEC §14).
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// Shutdown had already begun.
    #[error(transparent)]
    Shutdown(#[from] ShutdownError),
}

impl HasErrorCode for WorkerError {
    fn code(&self) -> ErrorCode {
        match self {
            Self::Register { source, .. } => source.code(),
            Self::Descriptor { .. } => ErrorCode::InvalidArgument,
            Self::Bus { source, .. } => source.code(),
            Self::Sandbox(source) => source.code(),
            Self::Shutdown(_) => ErrorCode::Unavailable,
        }
    }
}

/// What the drain had to do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerReport {
    /// Runs cancelled because they were still in flight at the drain deadline.
    pub cancelled_runs: Vec<RunId>,
    /// Runs abandoned because they did not end even after the cancel: their jobs were
    /// requeued (the redelivery finalizes them `interrupted`).
    pub forced_runs: Vec<RunId>,
}

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

/// The worker role.
#[derive(Debug)]
pub struct Worker;

impl Worker {
    /// Starts a worker with the default options (bundled runners, the gate in front of
    /// [`ActionDispatcher`]). See [`Worker::spawn_with`].
    pub async fn spawn(deps: WorkerDeps, shutdown: Shutdown) -> Result<WorkerHandle, WorkerError> {
        Self::spawn_with(deps, WorkerOptions::default(), shutdown).await
    }

    /// Makes the process non-dumpable (SPEC §14, see
    /// [`make_undumpable`]), loads the runner plugins, registers the runners of this
    /// worker's pools in the `runners` table, declares the topology, starts consuming `switchboard.runs.<pool>` for
    /// every configured pool and the worker's control queue, and returns. The worker runs
    /// until `shutdown` is triggered, then drains (see the module docs); it is tracked by
    /// `shutdown` as task `worker <id>`.
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

/// Everything [`Worker::spawn_with`] does before the worker runs.
async fn start(
    id: String,
    deps: WorkerDeps,
    options: WorkerOptions,
    shutdown: &Shutdown,
) -> Result<(Arc<Core>, Vec<Subscription>, Subscription, Vec<RunnerId>), WorkerError> {
    // Before any runner exists: from here on no same-user process can read this process's
    // memory or environment (the bus, Redis and database credentials). Every deployment —
    // `switchboard worker` and the embedded `switchboard dev` — starts its worker here.
    make_undumpable()?;
    let config = deps.config.worker.clone();
    let dirs = plugin_dirs(&config.runners_dirs, options.bundled_runners);
    let report = load_plugins(&dirs, &options.command_lookup);
    let dispatcher = options.dispatcher.clone().unwrap_or_else(|| {
        let limits = ActionLimits::from_config(&deps.config.limits);
        let providers = sb_host_api::providers::ProviderOptions::of(&deps.config);
        Arc::new(
            ActionDispatcher::new(deps.stores.clone(), deps.sessions.clone(), limits)
                .with_provider_options(providers),
        )
    });
    let gate: Arc<dyn HostApi> = Arc::new(ApiGate::new(deps.sessions.clone(), dispatcher));
    let host_config = host_config(&deps.config);
    let mut hosts = HashMap::new();
    for runner in report.runners {
        if !config.pools.contains(&runner.execution.pool) {
            tracing::info!(runner_id = %runner.runner_id, pool = %runner.execution.pool, "runner belongs to a pool this worker does not serve; not hosted");
            continue;
        }
        let row = runner_row(&runner)?;
        deps.stores
            .runners
            .upsert(row)
            .await
            .map_err(|source| WorkerError::Register {
                runner_id: runner.runner_id.to_string(),
                source,
            })?;
        tracing::info!(runner_id = %runner.runner_id, pool = %runner.execution.pool, program = %runner.program.display(), "runner registered");
        hosts.insert(
            runner.runner_id.clone(),
            RunnerHost::new(runner.runner_spec(), host_config.clone(), gate.clone()),
        );
    }
    if hosts.is_empty() {
        tracing::warn!(dirs = ?dirs, pools = ?config.pools, "no runner to host: every job will fail with runner.error");
    } else if let Err(error) = announce_routing_change(deps.sessions.as_ref()).await {
        // The registrations are committed; routing caches see them within their max age.
        tracing::warn!(%error, "could not announce the runner registrations to the routing caches");
    }

    declare_topology(deps.bus.as_ref(), deps.topology.options())
        .await
        .map_err(|source| WorkerError::Bus {
            what: "the bus topology".into(),
            source,
        })?;
    let control_spec = deps.topology.control_queue(&id);
    let control = deps
        .bus
        .subscribe(&control_spec, ConsumeOptions::prefetch(CONTROL_PREFETCH))
        .await
        .map_err(|source| WorkerError::Bus {
            what: control_spec.name.clone(),
            source,
        })?;
    // Every cancel message, once (see "Cancel messages" in the module docs).
    let every_cancel = Binding::new(deps.topology.control_exchange(), CONTROL_ALL_PATTERN);
    deps.bus
        .bind(&control_spec.name, &every_cancel)
        .await
        .map_err(|source| WorkerError::Bus {
            what: format!("{} binding {CONTROL_ALL_PATTERN}", control_spec.name),
            source,
        })?;
    let prefetch = u16::try_from(config.slots.get()).unwrap_or(u16::MAX);
    let mut jobs = Vec::new();
    for pool in &config.pools {
        let spec = deps.topology.runs_queue(pool);
        let sub = deps
            .bus
            .subscribe(&spec, ConsumeOptions::prefetch(prefetch))
            .await
            .map_err(|source| WorkerError::Bus {
                what: spec.name.clone(),
                source,
            })?;
        jobs.push(sub);
    }

    let mut runners: Vec<RunnerId> = hosts.keys().cloned().collect();
    runners.sort();
    let core = Arc::new(Core {
        id,
        bus: deps.bus,
        sessions: deps.sessions,
        ledger: deps.stores.runs,
        events: deps.stores.events,
        topology: deps.topology,
        config,
        hosts,
        active: Arc::new(Mutex::new(HashMap::new())),
        stop: shutdown.token(),
        force: CancellationToken::new(),
        metrics: Registry::global(),
    });
    tracing::info!(runners = runners.len(), pools = ?core.config.pools, slots = core.config.slots.get(), "worker started");
    Ok((core, jobs, control, runners))
}

/// The configured plugin directories, then the bundled one (unless already listed).
fn plugin_dirs(configured: &[PathBuf], bundled: bool) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = configured.to_vec();
    if bundled {
        if let Some(dir) = bundled_runners_dir(None) {
            let canonical = |p: &PathBuf| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
            let known = dirs.iter().any(|d| canonical(d) == canonical(&dir));
            if !known {
                dirs.push(dir);
            }
        }
    }
    dirs
}

/// The runner host tuning from the worker and limits sections.
fn host_config(config: &SwitchboardConfig) -> RunnerHostConfig {
    let worker = &config.worker;
    let defaults = RunnerHostConfig::default();
    RunnerHostConfig {
        max_line_bytes: worker.max_line_bytes.get(),
        result_limits: ResultLimits {
            max_result_bytes: worker.max_result_bytes.get(),
            max_inline_artifact_bytes: config.limits.artifact_inline_bytes.get(),
            ..ResultLimits::default()
        },
        run_items_max: config.limits.run_items_max,
        cancel_grace: worker.cancel_grace,
        // SIGTERM → SIGKILL gets the same grace as a cooperative cancel.
        kill_grace: worker.cancel_grace,
        stderr: crate::runner::process::StderrConfig {
            max_line_bytes: worker.stderr_cap_bytes.get(),
            ..defaults.stderr
        },
        sandbox: worker.sandbox.clone(),
        ..defaults
    }
}

/// The `runners` table row of a loaded runner.
fn runner_row(runner: &PluginRunner) -> Result<RunnerRow, WorkerError> {
    let raw_manifest = json!({
        "plugin": {
            "author": runner.plugin.author,
            "name": runner.plugin.name,
            "version": runner.plugin.version,
        },
        "runner": runner.manifest,
        "execution": {
            "mode": runner.execution.mode,
            "max_concurrency": runner.execution.max_concurrency.get(),
            "pool": runner.execution.pool,
        },
    });
    let descriptor = AgentRunnerDescriptor::from_manifest(
        &runner.manifest,
        Some(runner.plugin.version.clone()),
        runner.execution.pool.clone(),
        raw_manifest,
    )
    .map_err(|e| WorkerError::Descriptor {
        runner_id: runner.runner_id.to_string(),
        reason: e.to_string(),
    })?;
    let descriptor_json =
        serde_json::to_value(&descriptor).map_err(|e| WorkerError::Descriptor {
            runner_id: runner.runner_id.to_string(),
            reason: e.to_string(),
        })?;
    Ok(RunnerRow {
        id: runner.runner_id.to_string(),
        plugin_id: runner.runner_id.plugin_id(),
        pool: runner.execution.pool.clone(),
        version: runner.plugin.version.clone(),
        descriptor: descriptor_json,
        seen_at: Utc::now(),
    })
}

// ---------------------------------------------------------------------------------------------
// Pure decisions
// ---------------------------------------------------------------------------------------------

/// How a bus settlement follows from an error code (the one disposition mapping).
#[must_use]
pub fn settlement_for(code: ErrorCode) -> Settlement {
    match code.disposition() {
        Disposition::Ack => Settlement::Ack,
        Disposition::Retry => Settlement::Nack { requeue: true },
        Disposition::DeadLetter => Settlement::Nack { requeue: false },
    }
}

/// What to do with a job whose claim was lost while this worker holds the run's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimLost {
    /// Nothing to do: acknowledge and drop the job (the reason is logged).
    Drop(&'static str),
    /// The run started on a worker that is gone: finalize it `interrupted`.
    Interrupt,
    /// The ledger is in a state that should not last (e.g. still `queued`): try again later.
    Retry,
}

/// Decides a lost claim from the run's ledger status and whether its session still exists
/// (see the module docs for why the session is the crash witness).
#[must_use]
pub fn decide_claim_lost(status: Option<RunStatus>, session_exists: bool) -> ClaimLost {
    match status {
        None => ClaimLost::Drop("the run does not exist"),
        Some(s) if s.is_terminal() => ClaimLost::Drop("the run already ended"),
        Some(RunStatus::Running) if session_exists => ClaimLost::Interrupt,
        Some(RunStatus::Running) => ClaimLost::Drop(
            "the run ended elsewhere or its session expired (the reaper finalizes lost runs)",
        ),
        Some(_) => ClaimLost::Retry,
    }
}

/// Why a claimed run ends before it reaches a runner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PreStart {
    /// Cancel was requested before the start.
    Cancelled(String),
    /// The deadline passed while the job waited.
    DeadlinePassed,
    /// This worker does not host the runner.
    RunnerMissing,
}

impl PreStart {
    /// The terminal `run.failed` for this reason.
    #[must_use]
    pub fn result(&self, runner_id: &RunnerId, pool: &str) -> AgentRunResult {
        match self {
            Self::Cancelled(reason) => AgentRunResult::run_failed(
                run_failure::CANCELLED,
                if reason.is_empty() {
                    "cancelled before the run started".to_owned()
                } else {
                    reason.clone()
                },
                false,
            ),
            Self::DeadlinePassed => AgentRunResult::run_failed(
                run_failure::TIMEOUT,
                "the run deadline passed before the run started",
                run_failure::default_retryable(run_failure::TIMEOUT),
            ),
            Self::RunnerMissing => AgentRunResult::run_failed(
                run_failure::RUNNER_ERROR,
                format!("runner {runner_id} is not available in worker pool {pool}"),
                false,
            ),
        }
    }
}

/// Checks made after the claim, in order: cancel first (the user's intent wins), then the
/// deadline, then whether the runner is hosted here.
#[must_use]
pub fn decide_pre_start(
    cancel_reason: Option<String>,
    deadline_at_ms: Option<i64>,
    now_ms: i64,
    runner_hosted: bool,
) -> Option<PreStart> {
    if let Some(reason) = cancel_reason {
        return Some(PreStart::Cancelled(reason));
    }
    if deadline_at_ms.is_some_and(|d| now_ms >= d) {
        return Some(PreStart::DeadlinePassed);
    }
    if !runner_hosted {
        return Some(PreStart::RunnerMissing);
    }
    None
}

/// The bodies that carry `items` (consecutive items of `job`'s run, ascending) to the result
/// sink: one `switchboard.result/1` for a single item, else `switchboard.results/1` batches,
/// halved until each is at most [`BATCH_BYTES_MAX`] (or holds one item). Order is kept.
fn result_bodies(job: &RunJob, conversation: Option<String>, items: Vec<RunItem>) -> Vec<Vec<u8>> {
    fn encode_items(
        job: &RunJob,
        conversation: &Option<String>,
        items: Vec<RunItem>,
        out: &mut Vec<Vec<u8>>,
    ) {
        if items.len() == 1 {
            let item = items.into_iter().next().expect("one item");
            out.push(encode(&ResultMessage::new(
                job.run_id,
                job.workspace_id.clone(),
                conversation.clone(),
                item.sequence,
                item.result,
            )));
            return;
        }
        let batch = ResultBatch::new(
            job.run_id,
            job.workspace_id.clone(),
            conversation.clone(),
            items.iter().map(|i| (i.sequence, i.result.clone())),
        );
        let body = encode(&batch);
        if body.len() <= BATCH_BYTES_MAX {
            out.push(body);
        } else {
            let mut first = items;
            let second = first.split_off(first.len() / 2);
            encode_items(job, conversation, first, out);
            encode_items(job, conversation, second, out);
        }
    }
    let mut out = Vec::new();
    if !items.is_empty() {
        encode_items(job, &conversation, items, &mut out);
    }
    out
}

/// The `status` label of a terminal item: `completed`, `cancelled` or `failed`.
fn terminal_status(result: &AgentRunResult) -> &'static str {
    match result.known_type() {
        Some(ResultType::RunCompleted) => "completed",
        _ if result.data.get("code").and_then(|c| c.as_str()) == Some(run_failure::CANCELLED) => {
            "cancelled"
        }
        _ => "failed",
    }
}

/// The cancel reason a run's cancel flag carries (its value; empty: a generic one).
fn cancel_reason(flag: &[u8]) -> String {
    let reason = String::from_utf8_lossy(flag).trim().to_owned();
    if reason.is_empty() {
        "cancelled before the run started".to_owned()
    } else {
        reason
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

// ---------------------------------------------------------------------------------------------
// The service
// ---------------------------------------------------------------------------------------------

/// Cancel requests of the runs this worker holds: run id → latest reason (`None` = none yet).
type ActiveRuns = Arc<Mutex<HashMap<RunId, watch::Sender<Option<String>>>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Shared state of one worker.
struct Core {
    id: String,
    bus: Arc<dyn Bus>,
    sessions: Arc<dyn SessionStore>,
    ledger: Arc<dyn RunLedger>,
    /// Audit rows (`steering.dropped`).
    events: Arc<dyn EventLog>,
    topology: Topology,
    config: WorkerConfig,
    hosts: HashMap<RunnerId, RunnerHost>,
    active: ActiveRuns,
    /// The root shutdown token: stop taking work.
    stop: CancellationToken,
    /// Cancelled at the very end of the drain: abandon whatever is still running.
    force: CancellationToken,
    metrics: &'static Registry,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// A run id reserved on this worker. Dropping it frees the reservation.
struct Reservation {
    run_id: RunId,
    /// When this worker took the job: the start of `sb_run_duration_seconds`.
    claimed_at: std::time::Instant,
    active: ActiveRuns,
    cancel_tx: watch::Sender<Option<String>>,
    cancel_rx: watch::Receiver<Option<String>>,
    /// Set once [`Core::end_run`] released the run lease with the session's end, so that
    /// `process` does not release it a second time (one round trip fewer per run).
    lease_released: bool,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        lock(&self.active).remove(&self.run_id);
        Registry::global().gauge_add(names::RUNS_ACTIVE, &[], -1.0);
    }
}

/// Outcome of waiting for a run's lease.
enum LeaseWait {
    Acquired(Begun),
    HeldBy(String),
    Stopped,
    Failed(SessionError),
}

/// What the worker read with the run lease ([`SessionStore::begin_run`]).
struct Begun {
    /// The reason the run's cancel flag gave, if it was set.
    cancel_flag: Option<String>,
    /// The run's session as the orchestrator stored it: what the heartbeat puts back if the
    /// store loses it (see [`heartbeat`]). Read with the lease so that keeping it costs no
    /// round trip of its own; the job does not carry it (only its digest of the Host API
    /// token is in it, and the frozen grants must be exactly the orchestrator's).
    session: Option<Value>,
}

/// How streaming a run ended.
enum Streamed {
    /// The terminal item was published.
    Ended,
    /// The drain gave up on the run.
    Forced,
}

impl Core {
    fn active_ids(&self) -> Vec<RunId> {
        let mut ids: Vec<RunId> = lock(&self.active).keys().copied().collect();
        ids.sort_by_key(ToString::to_string);
        ids
    }

    fn reserve(&self, run_id: RunId) -> Option<Reservation> {
        let mut active = lock(&self.active);
        if active.contains_key(&run_id) {
            return None;
        }
        let (cancel_tx, cancel_rx) = watch::channel(None);
        active.insert(run_id, cancel_tx.clone());
        self.metrics.gauge_add(names::RUNS_ACTIVE, &[], 1.0);
        Some(Reservation {
            run_id,
            claimed_at: std::time::Instant::now(),
            active: self.active.clone(),
            cancel_tx,
            cancel_rx,
            lease_released: false,
        })
    }

    /// Records a cancel request for a held run (the first reason is kept). `false` if the run
    /// is not held here.
    fn request_cancel(&self, run_id: RunId, reason: String) -> bool {
        match lock(&self.active).get(&run_id) {
            Some(tx) => {
                tx.send_if_modified(|current| {
                    if current.is_none() {
                        *current = Some(reason);
                        true
                    } else {
                        false
                    }
                });
                true
            }
            None => false,
        }
    }

    /// Handles one delivery from a runs queue, start to settlement.
    async fn handle_job(
        self: Arc<Self>,
        queue: String,
        mut delivery: Delivery,
        _slot: OwnedSemaphorePermit,
    ) {
        let settlement = match decode::<RunJob>(&delivery.body) {
            Ok(job) if job.context.run_id != job.run_id => {
                tracing::warn!(run_id = %job.run_id, context_run_id = %job.context.run_id, "run job whose context names another run");
                settlement_for(ErrorCode::InvalidArgument)
            }
            Ok(job) => {
                let span =
                    tracing::info_span!("run", run_id = %job.run_id, runner_id = %job.runner_id);
                self.process(&job).instrument(span).await
            }
            Err(error) => {
                tracing::warn!(%error, routing_key = %delivery.routing_key, "undecodable run job");
                settlement_for(error.code())
            }
        };
        let disposition = match settlement {
            Settlement::Ack => "ack",
            Settlement::Nack { requeue: true } => "retry",
            Settlement::Nack { requeue: false } => "dead_letter",
        };
        self.metrics.inc(
            names::BUS_CONSUMED_TOTAL,
            &[("queue", &queue), ("disposition", disposition)],
        );
        if let Err(error) = delivery.settle(settlement).await {
            // The message is (or will be) redelivered; the redelivery is recognized then.
            tracing::warn!(%error, ?settlement, "settling a run job failed");
        }
    }

    async fn process(&self, job: &RunJob) -> Settlement {
        let run_id = job.run_id;
        let Some(mut reservation) = self.reserve(run_id) else {
            tracing::info!("duplicate delivery of a run active on this worker; dropped");
            return Settlement::Ack;
        };
        let begun = match self.take_lease(run_id).await {
            LeaseWait::Acquired(begun) => begun,
            LeaseWait::HeldBy(holder) => {
                tracing::info!(%holder, "run is held by another live worker; duplicate job dropped");
                return Settlement::Ack;
            }
            LeaseWait::Stopped => return Settlement::Nack { requeue: true },
            LeaseWait::Failed(error) => {
                tracing::warn!(%error, "cannot take the run lease");
                return settlement_for(error.code());
            }
        };
        let settlement = self.with_lease(job, &mut reservation, begun).await;
        if !reservation.lease_released {
            match self
                .sessions
                .release_lease(&lease_key(&run_id), &self.id)
                .await
            {
                Ok(_) => {}
                // It expires on its own; a redelivery meanwhile waits for that.
                Err(error) => tracing::warn!(%error, "releasing the run lease failed"),
            }
        }
        settlement
    }

    /// Takes the run lease, reading the run's cancel flag and session with it
    /// ([`SessionStore::begin_run`], one round trip). The flag is read after the run was
    /// reserved here, so a cancel set later still reaches the run: its cancel message follows
    /// the flag and finds the reservation. If another holder has the lease, waits up to one
    /// lease TTL (plus a heartbeat) for it to lapse: a worker that crashed a moment ago still
    /// holds its lease when the broker redelivers its job, while a live holder keeps renewing
    /// it.
    async fn take_lease(&self, run_id: RunId) -> LeaseWait {
        let ttl = self.config.lease_ttl;
        let give_up = tokio::time::Instant::now() + ttl + self.config.heartbeat_interval;
        let mut logged = false;
        loop {
            let holder = match self.sessions.begin_run(&run_id, &self.id, ttl).await {
                Ok(RunBegin::Leased {
                    cancel_flag,
                    session,
                }) => {
                    return LeaseWait::Acquired(Begun {
                        cancel_flag: cancel_flag.as_deref().map(cancel_reason),
                        session,
                    });
                }
                Ok(RunBegin::HeldBy(holder)) => holder,
                Err(error) => return LeaseWait::Failed(error),
            };
            if tokio::time::Instant::now() >= give_up {
                return LeaseWait::HeldBy(holder);
            }
            if !logged {
                tracing::info!(%holder, "run lease is held by another worker; waiting to see whether it lapses");
                logged = true;
            }
            tokio::select! {
                biased;
                () = self.stop.cancelled() => return LeaseWait::Stopped,
                () = tokio::time::sleep(self.config.heartbeat_interval) => {}
            }
        }
    }

    async fn with_lease(
        &self,
        job: &RunJob,
        reservation: &mut Reservation,
        begun: Begun,
    ) -> Settlement {
        let run_id = job.run_id;
        // While the ledger is unreachable the claim is retried here, holding the job: a
        // requeue per failure would spend the runs queue's delivery limit within seconds and
        // dead-letter the job of a run that then stays `queued` (found by the chaos suite's
        // `restart_postgres`).
        let mut delay = RETRY_INITIAL;
        loop {
            match self.ledger.claim_run(run_id, &self.id).await {
                Ok(true) => break,
                Ok(false) => return self.on_claim_lost(job, reservation).await,
                Err(error) if error.is_transient() => {
                    tracing::warn!(%error, retry_in_ms = delay.as_millis() as u64, "claiming the run failed; the ledger is unreachable, retrying");
                    tokio::select! {
                        biased;
                        () = self.stop.cancelled() => return settlement_for(error.code()),
                        () = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(RETRY_MAX);
                }
                Err(error) => {
                    tracing::warn!(%error, "claiming the run failed");
                    return settlement_for(error.code());
                }
            }
        }
        tracing::debug!("run claimed");
        self.execute(job, reservation, begun).await
    }

    async fn on_claim_lost(&self, job: &RunJob, reservation: &mut Reservation) -> Settlement {
        let run_id = job.run_id;
        let record = match self.ledger.get_run(run_id).await {
            Ok(record) => record,
            Err(error) => {
                tracing::warn!(%error, "reading the run after a lost claim failed");
                return settlement_for(error.code());
            }
        };
        let status = record.as_ref().map(|r| r.status);
        let session_exists = if status == Some(RunStatus::Running) {
            match self.sessions.get_session(&run_id).await {
                Ok(session) => session.is_some(),
                Err(error) => {
                    tracing::warn!(%error, "reading the run session failed");
                    return settlement_for(error.code());
                }
            }
        } else {
            false
        };
        match decide_claim_lost(status, session_exists) {
            ClaimLost::Drop(reason) => {
                tracing::info!(status = ?status, reason, "job for a run that cannot start here dropped");
                Settlement::Ack
            }
            ClaimLost::Retry => {
                tracing::warn!(status = ?status, "claim lost but the run is still queued; retrying later");
                Settlement::Nack { requeue: true }
            }
            ClaimLost::Interrupt => self.finalize_interrupted(job, reservation).await,
        }
    }

    /// A redelivered job of a run that started on a worker that is gone: never re-executed,
    /// it ends `interrupted`. The terminal item and the status are stored in one ledger
    /// commit ([`RunLedger::finalize_run`]) before the item is published: a stream reader
    /// never sees the status without the item, and the item takes the first free sequence
    /// even if the lost worker's last results are still in flight. The result sink applies
    /// the published item's side effects and delivers it (it finds it stored as is). The run
    /// ends (session, lease) before the item is published: the ledger already says how it
    /// ended, so the lease protects nothing any more.
    async fn finalize_interrupted(
        &self,
        job: &RunJob,
        reservation: &mut Reservation,
    ) -> Settlement {
        let run_id = job.run_id;
        let message = "the worker executing the run was lost";
        let outcome =
            RunOutcome::with_error(RunStatus::Interrupted, run_failure::INTERRUPTED, message);
        let result = AgentRunResult::run_failed(
            run_failure::INTERRUPTED,
            message,
            run_failure::default_retryable(run_failure::INTERRUPTED),
        );
        let sequence = match self
            .ledger
            .finalize_run(run_id, outcome, result.clone())
            .await
        {
            Ok(Finalized::Ended { sequence }) => sequence,
            Ok(other) => {
                // Its own terminal item is stored (the reaper applies it) or it ended.
                tracing::info!(?other, "run was finished concurrently; nothing to finalize");
                return Settlement::Ack;
            }
            Err(error) => {
                tracing::warn!(%error, "finalizing the interrupted run failed");
                return settlement_for(error.code());
            }
        };
        tracing::warn!(
            sequence,
            "run was interrupted by the loss of its worker; finalized as interrupted"
        );
        self.end_run(job, reservation).await;
        let item = RunItem {
            sequence,
            result: result.with_run_id(run_id).with_sequence(sequence),
        };
        if self.publish_items(job, vec![item]).await {
            Settlement::Ack
        } else {
            // Forced drain: the ledger already says interrupted, so the redelivery drops it.
            Settlement::Nack { requeue: true }
        }
    }

    /// The run is claimed: execute it and publish its results.
    async fn execute(
        &self,
        job: &RunJob,
        reservation: &mut Reservation,
        begun: Begun,
    ) -> Settlement {
        let run_id = job.run_id;
        let host = self.hosts.get(&job.runner_id);
        let requested = reservation.cancel_rx.borrow_and_update().clone();
        let cancel_reason = requested.or(begun.cancel_flag);
        let pre = decide_pre_start(cancel_reason, job.deadline_at_ms, now_ms(), host.is_some());
        let host = match (pre, host) {
            (None, Some(host)) => host,
            (pre, _) => {
                let pre = pre.unwrap_or(PreStart::RunnerMissing);
                tracing::info!(reason = ?pre, "run ends before it starts");
                let result = pre
                    .result(&job.runner_id, &job.pool)
                    .with_run_id(run_id)
                    .with_sequence(1);
                return self
                    .finish(
                        job,
                        reservation,
                        vec![RunItem {
                            sequence: 1,
                            result,
                        }],
                    )
                    .await;
            }
        };

        // The job's workspace is the orchestrator's (the one the session was authorized in);
        // it picks the shared process the run may go to.
        let mut request =
            RunRequest::new(job.context.clone()).in_workspace(job.workspace_id.clone());
        request.run_id = run_id;
        if let Some(ms) = job.deadline_at_ms {
            request.deadline =
                Some(UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
        }
        let mut handle = match host.start_run(request).await {
            Ok(handle) => handle,
            Err(error) => {
                tracing::error!(%error, "runner could not start the run");
                let result = AgentRunResult::run_failed(
                    run_failure::RUNNER_ERROR,
                    format!("the runner could not be started: {error}"),
                    error.code().is_retryable(),
                )
                .with_run_id(run_id)
                .with_sequence(1);
                return self
                    .finish(
                        job,
                        reservation,
                        vec![RunItem {
                            sequence: 1,
                            result,
                        }],
                    )
                    .await;
            }
        };
        tracing::debug!("run started");
        let heartbeat = AbortOnDropHandle::new(tokio::spawn(
            heartbeat(
                self.sessions.clone(),
                self.ledger.clone(),
                HeartbeatRun {
                    run_id,
                    holder: self.id.clone(),
                    session: begun.session,
                    ttl: self.config.lease_ttl,
                    interval: self.config.heartbeat_interval,
                },
                reservation.cancel_tx.clone(),
            )
            .in_current_span(),
        ));
        let streamed = self.stream(job, &mut handle, reservation).await;
        // Stopped (not only told to stop) before the lease is released: a renewal racing the
        // release would find the lease missing and could take it back for an ended run.
        heartbeat.abort();
        let _ = heartbeat.await;
        match streamed {
            Streamed::Ended => {
                self.end_run(job, reservation).await;
                Settlement::Ack
            }
            Streamed::Forced => {
                tracing::warn!("run abandoned by the forced drain; its job is requeued");
                // Dropping the handle cancels the run in the runner host.
                drop(handle);
                Settlement::Nack { requeue: true }
            }
        }
    }

    /// Publishes a run's items (ending with its terminal item) without a runner, then ends the
    /// run.
    async fn finish(
        &self,
        job: &RunJob,
        reservation: &mut Reservation,
        items: Vec<RunItem>,
    ) -> Settlement {
        if self.publish_items(job, items).await {
            self.end_run(job, reservation).await;
            Settlement::Ack
        } else {
            Settlement::Nack { requeue: true }
        }
    }

    /// Forwards cancel requests to the run and publishes its items as they come.
    async fn stream(
        &self,
        job: &RunJob,
        handle: &mut RunHandle,
        reservation: &mut Reservation,
    ) -> Streamed {
        let mut cancel_open = true;
        let mut first_published = false;
        loop {
            tokio::select! {
                biased;
                () = self.force.cancelled() => return Streamed::Forced,
                changed = reservation.cancel_rx.changed(), if cancel_open => match changed {
                    Ok(()) => {
                        if let Some(reason) = reservation.cancel_rx.borrow_and_update().clone() {
                            tracing::info!(%reason, "cancelling the run");
                            handle.cancel(reason);
                        }
                    }
                    Err(_) => cancel_open = false,
                },
                item = handle.next() => {
                    let Some(first) = item else {
                        // The handle ends only after its terminal item, which returned below.
                        return Streamed::Ended;
                    };
                    let mut batch = vec![first];
                    while batch.len() < MAX_BATCH && !batch.last().is_some_and(RunItem::is_terminal) {
                        match handle.next().now_or_never() {
                            Some(Some(item)) => batch.push(item),
                            _ => break,
                        }
                    }
                    let terminal = batch
                        .last()
                        .filter(|item| item.is_terminal())
                        .map(|item| terminal_status(&item.result));
                    if !self.publish_items(job, batch).await {
                        return Streamed::Forced;
                    }
                    if !first_published {
                        first_published = true;
                        if let Some(accepted) = job.accepted_at_ms {
                            let seconds = (now_ms() - accepted).max(0) as f64 / 1000.0;
                            self.metrics.observe(names::RUN_FIRST_RESULT_SECONDS, &[], seconds);
                        }
                    }
                    if let Some(status) = terminal {
                        self.metrics.observe(
                            names::RUN_DURATION_SECONDS,
                            &[("status", status)],
                            reservation.claimed_at.elapsed().as_secs_f64(),
                        );
                        return Streamed::Ended;
                    }
                }
            }
        }
    }

    /// Publishes items in order, as few messages as [`result_bodies`] makes of them (one
    /// `switchboard.results/1` batch per ≤ [`BATCH_BYTES_MAX`], or a single
    /// `switchboard.result/1`), with confirms, retrying from the first failed message (later
    /// ones that did land are published again; the result sink keeps the first copy of each
    /// `(run_id, sequence)`). `false` only if the forced drain gave up while the bus kept
    /// failing.
    async fn publish_items(&self, job: &RunJob, items: Vec<RunItem>) -> bool {
        let exchange = self.topology.results_exchange();
        let routing_key = self.topology.results_routing_key(&job.run_id);
        let conversation = job
            .context
            .conversation
            .as_ref()
            .and_then(|c| c.conversation_id.clone());
        let mut pending: Vec<Outgoing> = result_bodies(job, conversation, items)
            .into_iter()
            .map(|body| Outgoing::new(exchange.clone(), routing_key.clone(), body))
            .collect();
        let mut delay = RETRY_INITIAL;
        loop {
            let count = pending.len();
            let outcome = if count == 1 {
                let m = &pending[0];
                self.bus
                    .publish(&m.exchange, &m.routing_key, m.body.clone(), m.options)
                    .await
                    .map_err(|e| (0, e.to_string()))
            } else {
                self.bus
                    .publish_batch(pending.clone())
                    .await
                    .map_err(|e| (e.failed.first().map_or(0, |(i, _)| *i), e.to_string()))
            };
            match outcome {
                Ok(()) => {
                    self.metrics.add(
                        names::BUS_PUBLISHED_TOTAL,
                        &[("exchange", &exchange)],
                        count as u64,
                    );
                    return true;
                }
                Err((first_failed, error)) => {
                    self.metrics.add(
                        names::BUS_PUBLISHED_TOTAL,
                        &[("exchange", &exchange)],
                        first_failed as u64,
                    );
                    pending.drain(..first_failed.min(pending.len()));
                    tracing::warn!(%error, remaining = pending.len(), retry_in_ms = delay.as_millis() as u64, "publishing run results failed; retrying");
                    self.metrics.inc(
                        names::ERRORS_TOTAL,
                        &[("error_type", "publish_failed"), ("stage", "retried")],
                    );
                    tokio::select! {
                        biased;
                        () = self.force.cancelled() => return false,
                        () = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(RETRY_MAX);
                }
            }
        }
    }

    /// Ends the run in the session store in one round trip ([`SessionStore::end_run`]): the
    /// session ends atomically (later Host API calls see `not_found`), the cancel flag has done
    /// its job, the run is marked handed off (its terminal item is published: the reaper must
    /// not take a lagging result sink for a lost worker), and the lease is released. Then
    /// audits the steering items the run never pulled.
    async fn end_run(&self, job: &RunJob, reservation: &mut Reservation) {
        match self
            .sessions
            .end_run(&job.run_id, &self.id, RUN_HANDED_OFF_TTL)
            .await
        {
            Ok(end) => {
                reservation.lease_released = true;
                match end.ended {
                    Some(ended) => self.audit_dropped_steering(job, &ended.steering).await,
                    None => tracing::debug!("run session was already gone"),
                }
            }
            // The session and flag expire on their own; until then late Host API calls still
            // pass the gate's session check but the runner host refuses calls for ended runs.
            // `process` still tries to release the lease.
            Err(error) => tracing::warn!(%error, "ending the run in the session store failed"),
        }
    }

    /// Audits each steering item the run never pulled as a `steering.dropped` event-log row
    /// (reason `run_ended`) and on the audit log target. The row's idempotency key makes a
    /// repeated audit append once. The items are gone from the session store either way, so
    /// a failed append is logged rather than retried.
    async fn audit_dropped_steering(&self, job: &RunJob, items: &[Value]) {
        let run_id = job.run_id;
        let runner_id = job.runner_id.to_string();
        for item in items {
            let event_id = item
                .pointer("/event/event_id")
                .and_then(Value::as_str)
                .unwrap_or("");
            tracing::info!(
                target: AUDIT_TARGET,
                audit = audit::STEERING_DROPPED,
                %run_id,
                event_id,
                "steering item dropped: the run ended before pulling it"
            );
            let row = audit::steering_dropped(
                item,
                run_id,
                &runner_id,
                &job.workspace_id,
                audit::DROPPED_RUN_ENDED,
            );
            if let Err(error) = self.events.append(row, Vec::new()).await {
                tracing::warn!(%error, event_id, "writing the steering.dropped audit row failed");
            }
        }
    }
}

/// What a worker does when renewing its run lease failed with `LeaseLost`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostLease {
    /// The lease is missing but the run is still ours (the session store came back empty):
    /// take it again, and put the run's session back.
    Reestablish,
    /// Another holder has it, or the run is no longer ours: stop acting on the run.
    Lost,
}

/// Decides a failed renewal from the lease's current holder and the run's ledger row
/// (`status`, `worker_id`). A lease taken by another holder is lost whatever the ledger
/// says; a missing one is ours again only while the ledger says we are running the run.
#[must_use]
pub fn decide_lost_lease(
    current_holder: Option<&str>,
    run: Option<(RunStatus, Option<&str>)>,
    me: &str,
) -> LostLease {
    match current_holder {
        Some(holder) if holder != me => LostLease::Lost,
        Some(_) => LostLease::Reestablish,
        None => match run {
            Some((RunStatus::Running, Some(worker))) if worker == me => LostLease::Reestablish,
            _ => LostLease::Lost,
        },
    }
}

/// The run a [`heartbeat`] keeps.
struct HeartbeatRun {
    run_id: RunId,
    /// This worker's id.
    holder: String,
    /// The run's session as read with the lease ([`Begun::session`]).
    session: Option<Value>,
    /// Lease TTL set by every renewal.
    ttl: Duration,
    /// Time between renewals.
    interval: Duration,
}

/// Renews the run lease every `interval`. A renewal that finds the lease missing while the
/// run is still ours ([`decide_lost_lease`]) re-establishes it, and the run's `session` with
/// it (as read with the lease, kept alive by later heartbeats): a session store that
/// restarted empty neither cancels a healthy run nor breaks its Host API calls. The session
/// has to be read before any loss, since a store that lost it cannot give it back. A lease
/// held by another holder, or a run that is no longer ours, cancels the run (a worker that
/// lost its lease must stop acting on the run).
async fn heartbeat(
    sessions: Arc<dyn SessionStore>,
    ledger: Arc<dyn RunLedger>,
    run: HeartbeatRun,
    cancel: watch::Sender<Option<String>>,
) {
    let HeartbeatRun {
        run_id,
        holder,
        session,
        ttl,
        interval,
    } = run;
    let key = lease_key(&run_id);
    let mut restored = false;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match sessions.renew_lease(&key, &holder, ttl).await {
            Ok(()) => {
                if restored {
                    // A restored session lives as long as its holder keeps renewing.
                    if let Err(error) = sessions.touch_session(&run_id, ttl).await {
                        tracing::debug!(%error, "extending the restored run session failed");
                    }
                }
            }
            Err(SessionError::LeaseLost { .. }) => {
                match reestablish(&*sessions, &*ledger, run_id, &holder, ttl).await {
                    Ok(true) => {
                        tracing::warn!(
                            "run lease was missing (session store emptied?); re-established"
                        );
                        restored |=
                            restore_session(&*sessions, run_id, session.as_ref(), ttl).await;
                    }
                    Ok(false) => {
                        tracing::warn!("run lease lost; cancelling the run");
                        cancel.send_if_modified(|current| {
                            if current.is_none() {
                                *current = Some("worker lease lost".to_owned());
                                true
                            } else {
                                false
                            }
                        });
                        return;
                    }
                    Err(error) => {
                        tracing::warn!(%error, "checking a lost run lease failed; will retry");
                    }
                }
            }
            Err(error) => tracing::warn!(%error, "renewing the run lease failed; will retry"),
        }
    }
}

/// Takes the run lease again after a renewal found it lost, if [`decide_lost_lease`] says
/// the run is still ours. `Ok(true)` once the lease is ours again.
async fn reestablish(
    sessions: &dyn SessionStore,
    ledger: &dyn RunLedger,
    run_id: RunId,
    holder: &str,
    ttl: Duration,
) -> Result<bool, String> {
    let key = lease_key(&run_id);
    let current = sessions
        .lease_holder(&key)
        .await
        .map_err(|e| e.to_string())?;
    let run = ledger.get_run(run_id).await.map_err(|e| e.to_string())?;
    let facts = run.as_ref().map(|r| (r.status, r.worker_id.as_deref()));
    match decide_lost_lease(current.as_deref(), facts, holder) {
        LostLease::Lost => Ok(false),
        // Atomic: fails if another holder took it in between.
        LostLease::Reestablish => sessions
            .acquire_lease(&key, holder, ttl)
            .await
            .map_err(|e| e.to_string()),
    }
}

/// Puts the run's session back if the store lost it. `true` if it was put back.
async fn restore_session(
    sessions: &dyn SessionStore,
    run_id: RunId,
    session: Option<&Value>,
    ttl: Duration,
) -> bool {
    let Some(session) = session else {
        return false;
    };
    match sessions.get_session(&run_id).await {
        Ok(Some(_)) => false,
        Ok(None) => match sessions.put_session(&run_id, session, ttl).await {
            Ok(()) => {
                tracing::warn!("run session was missing; restored");
                true
            }
            Err(error) => {
                tracing::warn!(%error, "restoring the run session failed");
                false
            }
        },
        Err(error) => {
            tracing::warn!(%error, "reading the run session failed");
            false
        }
    }
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

/// Follows `cancel.<run_id>` messages for the runs this worker holds.
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
async fn supervise(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_lost_decisions() {
        use ClaimLost::*;
        assert!(matches!(decide_claim_lost(None, true), Drop(_)));
        for terminal in [
            RunStatus::Completed,
            RunStatus::Failed,
            RunStatus::Cancelled,
            RunStatus::Timeout,
            RunStatus::Interrupted,
        ] {
            assert!(
                matches!(decide_claim_lost(Some(terminal), true), Drop(_)),
                "{terminal}"
            );
        }
        assert_eq!(decide_claim_lost(Some(RunStatus::Running), true), Interrupt);
        assert!(matches!(
            decide_claim_lost(Some(RunStatus::Running), false),
            Drop(_)
        ));
        assert_eq!(decide_claim_lost(Some(RunStatus::Queued), true), Retry);
    }

    #[test]
    fn pre_start_order() {
        let now = 1_000;
        assert_eq!(decide_pre_start(None, None, now, true), None);
        assert_eq!(decide_pre_start(None, Some(now + 1), now, true), None);
        assert_eq!(
            decide_pre_start(None, Some(now), now, true),
            Some(PreStart::DeadlinePassed)
        );
        assert_eq!(
            decide_pre_start(None, None, now, false),
            Some(PreStart::RunnerMissing)
        );
        assert_eq!(
            decide_pre_start(Some("user".into()), Some(0), now, false),
            Some(PreStart::Cancelled("user".into()))
        );
        let runner: RunnerId = "plugin:a/b/c".parse().unwrap();
        let failed = PreStart::DeadlinePassed.result(&runner, "default");
        assert_eq!(failed.data["code"], "timeout");
        assert_eq!(failed.data["retryable"], true);
        let failed = PreStart::Cancelled(String::new()).result(&runner, "default");
        assert_eq!(failed.data["code"], "cancelled");
        assert_eq!(failed.data["retryable"], false);
    }

    #[test]
    fn cancel_flag_reasons() {
        assert_eq!(cancel_reason(b" user asked \n"), "user asked");
        assert_eq!(cancel_reason(b""), "cancelled before the run started");
    }

    #[test]
    fn settlements_follow_the_disposition_mapping() {
        assert_eq!(
            settlement_for(ErrorCode::InvalidArgument),
            Settlement::Nack { requeue: false }
        );
        assert_eq!(
            settlement_for(ErrorCode::Unavailable),
            Settlement::Nack { requeue: true }
        );
        assert_eq!(settlement_for(ErrorCode::NotFound), Settlement::Ack);
    }

    #[test]
    fn keys() {
        let run = RunId::new();
        assert_eq!(lease_key(&run), run.to_string());
    }

    #[test]
    fn a_missing_lease_is_reestablished_only_while_the_run_is_ours() {
        let running = |w: &'static str| Some((RunStatus::Running, Some(w)));
        // The store came back empty: the ledger says we run it.
        assert_eq!(
            decide_lost_lease(None, running("me"), "me"),
            LostLease::Reestablish
        );
        // Another holder took it: lost, whatever the ledger says.
        assert_eq!(
            decide_lost_lease(Some("other"), running("me"), "me"),
            LostLease::Lost
        );
        assert_eq!(
            decide_lost_lease(Some("me"), running("me"), "me"),
            LostLease::Reestablish
        );
        // Missing, and the run is no longer ours (finalized by the reaper, claimed elsewhere).
        assert_eq!(
            decide_lost_lease(None, Some((RunStatus::Interrupted, Some("me"))), "me"),
            LostLease::Lost
        );
        assert_eq!(
            decide_lost_lease(None, running("other"), "me"),
            LostLease::Lost
        );
        assert_eq!(decide_lost_lease(None, None, "me"), LostLease::Lost);
    }
}
