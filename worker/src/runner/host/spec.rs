//! What a `RunnerHost` is told: the runner to host ([`RunnerSpec`]), its tuning
//! ([`RunnerHostOptions`]) and the runs it starts ([`RunRequest`]). Plain data, kept apart
//! from the host so that the host, its actors and the plugin loader share it without
//! reaching into each other.

use std::ffi::OsString;
use std::num::{NonZeroU64, NonZeroUsize};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sb_common::config::SandboxConfig;
use sb_protocol::context::AgentRunContext;
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::manifest::RunnerId;
use sb_protocol::result::ResultLimits;
use sb_protocol::wire::DEFAULT_MAX_LINE_BYTES;

use crate::runner::link::ExecutionMode;
use crate::runner::process::{ProcessSpec, StderrOptions};

/// How a host reads the worker's environment for a process's allowlisted variables
/// (`std::env::var_os` in production, a map in tests).
pub type EnvLookup = Arc<dyn Fn(&str) -> Option<OsString> + Send + Sync>;

/// What to host: one runner of a plugin, resolved from its manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerSpec {
    pub runner_id: RunnerId,
    pub process: ProcessSpec,
    pub mode: ExecutionMode,
    /// `shared`: concurrent runs on the process; `per_run`: concurrent processes.
    pub max_concurrency: NonZeroUsize,
}

/// Tuning of a `RunnerHost`. Defaults follow SPEC §13; tests shorten the durations.
#[derive(Debug, Clone)]
pub struct RunnerHostOptions {
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
    /// Items buffered per run between the process and its
    /// [`RunHandle`](super::handle::RunHandle).
    pub run_buffer: usize,
    pub stderr: StderrOptions,
    /// How every process is confined (`worker.sandbox`, SPEC §14).
    pub sandbox: SandboxConfig,
}

impl Default for RunnerHostOptions {
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
            stderr: StderrOptions::default(),
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
