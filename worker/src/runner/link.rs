//! [`RunnerLink`]: the protocol state machine of the worker's link to one runner process,
//! pure over the messages and happenings of that one connection.
//!
//! It is named for the link, not "session": a *session* in Switchboard is the active-run
//! record in the session store (what the Host API gate checks) and the service API's
//! sessions of turns; this is neither — it is the worker's side of one runner process's
//! stdio connection, which may carry many runs (`shared`) or one (`per_run`).
//!
//! The async shell (the runner host's per-process actor) owns the process, the pipes and the
//! timers; it feeds every happening into [`RunnerLink`] as an [`Input`] and carries out the
//! returned [`Effect`]s. All decisions — which run a line belongs to, what a bad line costs,
//! when a run is over, when the process must go — are made here, so they are unit-tested
//! without processes.
//!
//! ```text
//!            spawn             first line / first run          drain (shutdown, per_run done)
//!  ──▶ Starting ───────────────────────▶ Running ──────────────────────▶ Draining
//!          │                                │                                │
//!          └──────────── exit ──────────────┴──────────── exit ─────────────┴──▶ Exited
//! ```
//!
//! - **Starting**: spawned, nothing written or read yet. Accepts runs.
//! - **Running**: serving. Accepts runs (`shared`: up to the host's concurrency; `per_run`:
//!   exactly one run per process, ever).
//! - **Draining**: no new runs; in-flight runs finish; once none is left the link writes
//!   `shutdown` and closes the runner's stdin.
//! - **Exited**: the process is gone; every run still in flight ends (`runner.crashed`,
//!   or for a `per_run` process that exited cleanly, like `done`).
//!
//! Identity and authorization of Host API calls: a call is dispatched only if its `run_id`
//! is an active run **of this link** (of this very process) — never another process's run,
//! never a finished run — otherwise it is answered `not_found` here, before any host code
//! sees it. The caller identity handed to the dispatcher comes from the link's connection,
//! not the message. A call the host cannot accept as written ([`Input::RefusedCall`]: no
//! `run_id`, no `action`, an unusable `id`) is answered with an error here too, and counts as
//! a usable line: it never fails a run.

use std::collections::{HashMap, HashSet, VecDeque};
use std::num::NonZeroU64;

use sb_protocol::context::AgentRunContext;
use sb_protocol::error::{AgentApiError, ErrorCode};
use sb_protocol::ids::RunId;
use sb_protocol::result::ResultLimits;
use sb_protocol::wire::{ApiCallId, ApiResult, HostToRunner, LogLevel, RunnerToHost};
use serde_json::Value;

use super::codec::RefusedCall;
use crate::sequencer::{
    Admission, DEFAULT_RUN_ITEMS_MAX, EndCause, RunItem, RunSequencer, SkipReason,
};

/// How a runner process serves runs (manifest `execution.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionMode {
    /// One long-lived process, many concurrent runs multiplexed by `run_id`.
    Shared,
    /// One process per run; its exit ends the run.
    PerRun,
}

impl ExecutionMode {
    /// The manifest text (`shared`, `per_run`), also the `mode` label of the metrics.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Shared => "shared",
            Self::PerRun => "per_run",
        }
    }
}

/// Lifecycle phase of a process connection. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Starting,
    Running,
    Draining,
    Exited,
}

/// Why a run is being cancelled.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Cancelling {
    /// Asked by the host (user cancel, interrupt policy, handle dropped).
    Requested { reason: String },
}

#[derive(Debug)]
struct ActiveRun {
    sequencer: RunSequencer,
    cancelling: Option<Cancelling>,
}

/// Something that happened to the connection.
#[derive(Debug)]
pub enum Input {
    /// A line from the runner.
    Frame(RunnerToHost),
    /// An `api` line from the runner that is not a well-formed call: answered with an error.
    RefusedCall(RefusedCall),
    /// A line from the runner that could not be used. `run_id` is the run it names, when it
    /// was readable enough to tell; `detail` says what was wrong.
    BadFrame {
        run_id: Option<String>,
        detail: String,
    },
    /// The host asks to cancel a run.
    Cancel { run_id: RunId, reason: String },
    /// The cancel grace period of a run elapsed.
    CancelGraceElapsed { run_id: RunId },
    /// A run's deadline passed.
    DeadlinePassed { run_id: RunId },
    /// Stop taking runs and let the process go once idle.
    Drain,
    /// Force every in-flight run to end now (forced shutdown); the process is then killed.
    Abort { detail: String },
    /// The process exited (its stdout closed and it was reaped). `clean` is exit status 0.
    Exited { clean: bool, detail: String },
}

/// Something the shell must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Write a message to the runner's stdin.
    Write(HostToRunner),
    /// Hand an item to the run's consumer (in sequence order; terminal items included).
    Deliver { run_id: RunId, item: RunItem },
    /// The run is over (its terminal item was delivered): release its slot, stop its timers
    /// and abort its in-flight Host API calls.
    RunEnded { run_id: RunId },
    /// Serve a Host API call for an active run of this link; answer with
    /// `api_result {id}` (exactly one answer per call: the shell races the serving task and
    /// the end of the run through one reply).
    Dispatch {
        call_id: ApiCallId,
        run_id: RunId,
        action: String,
        params: Value,
    },
    /// Arm the cancel grace timer of a run (then feed [`Input::CancelGraceElapsed`]).
    StartCancelGrace { run_id: RunId },
    /// Close the runner's stdin (after `shutdown` was written).
    CloseInput,
    /// Stop the process now: group `SIGTERM`, `SIGKILL` after the grace period.
    Kill,
}

/// Why [`RunnerLink::start_run`] refused a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StartRefused {
    #[error("runner process is draining or gone")]
    NotAccepting,
    #[error("per-run process already served a run")]
    PerRunUsed,
    #[error("run is already active on this process")]
    Duplicate,
}

/// How many recently finished run ids are remembered, to log late lines as "late" rather than
/// "unknown run" (diagnostics only; both are dropped).
const RECENT_RUNS: usize = 1024;

/// The state of one process connection.
#[derive(Debug)]
pub struct RunnerLink {
    mode: ExecutionMode,
    limits: ResultLimits,
    /// Most result items per run (`limits.run_items_max`), passed to each run's sequencer.
    run_items_max: NonZeroU64,
    phase: Phase,
    runs: HashMap<RunId, ActiveRun>,
    /// Runs ever started on this connection (a `per_run` process serves one).
    started: u64,
    recent: VecDeque<RunId>,
    recent_set: HashSet<RunId>,
    /// Consecutive unusable lines. One is forgiven (the stream resynchronises on the next
    /// line); a second in a row means the process cannot resynchronise.
    bad_streak: u32,
    /// Whether `shutdown` was already written.
    shutdown_sent: bool,
}

impl RunnerLink {
    #[must_use]
    pub fn new(mode: ExecutionMode, limits: ResultLimits) -> Self {
        Self {
            mode,
            limits,
            run_items_max: DEFAULT_RUN_ITEMS_MAX,
            phase: Phase::Starting,
            runs: HashMap::new(),
            started: 0,
            recent: VecDeque::new(),
            recent_set: HashSet::new(),
            bad_streak: 0,
            shutdown_sent: false,
        }
    }

    /// Sets the most result items each run may deliver, its terminal item included
    /// (default [`DEFAULT_RUN_ITEMS_MAX`]).
    #[must_use]
    pub fn with_run_items_max(mut self, run_items_max: NonZeroU64) -> Self {
        self.run_items_max = run_items_max;
        self
    }

    #[must_use]
    pub fn phase(&self) -> Phase {
        self.phase
    }

    #[must_use]
    pub fn mode(&self) -> ExecutionMode {
        self.mode
    }

    /// Runs in flight.
    #[must_use]
    pub fn active_runs(&self) -> usize {
        self.runs.len()
    }

    #[must_use]
    pub fn is_active(&self, run_id: &RunId) -> bool {
        self.runs.contains_key(run_id)
    }

    /// Whether a new run could be started now.
    #[must_use]
    pub fn accepts_runs(&self) -> bool {
        matches!(self.phase, Phase::Starting | Phase::Running)
            && (self.mode == ExecutionMode::Shared || self.started == 0)
    }

    /// Whether [`RunnerLink::start_run`] would accept `run_id` now.
    pub fn check_start(&self, run_id: RunId) -> Result<(), StartRefused> {
        if !matches!(self.phase, Phase::Starting | Phase::Running) {
            return Err(StartRefused::NotAccepting);
        }
        if self.mode == ExecutionMode::PerRun && self.started > 0 {
            return Err(StartRefused::PerRunUsed);
        }
        if self.runs.contains_key(&run_id) {
            return Err(StartRefused::Duplicate);
        }
        Ok(())
    }

    /// Starts a run: registers it and writes the `run` message.
    pub fn start_run(
        &mut self,
        run_id: RunId,
        runner: &str,
        context: Box<AgentRunContext>,
    ) -> Result<Vec<Effect>, StartRefused> {
        self.check_start(run_id)?;
        self.phase = Phase::Running;
        self.started += 1;
        self.runs.insert(
            run_id,
            ActiveRun {
                sequencer: RunSequencer::new(run_id, self.limits)
                    .with_items_max(self.run_items_max),
                cancelling: None,
            },
        );
        Ok(vec![Effect::Write(HostToRunner::Run {
            run_id,
            runner: runner.to_owned(),
            context,
        })])
    }

    /// Applies one input.
    pub fn on(&mut self, input: Input) -> Vec<Effect> {
        let mut fx = Vec::new();
        match input {
            Input::Frame(frame) => {
                self.usable_line();
                self.on_frame(frame, &mut fx);
            }
            Input::RefusedCall(call) => {
                self.usable_line();
                self.on_refused_call(call, &mut fx);
            }
            Input::BadFrame { run_id, detail } => self.on_bad_frame(run_id, detail, &mut fx),
            Input::Cancel { run_id, reason } => {
                let run = self
                    .runs
                    .get_mut(&run_id)
                    .filter(|r| r.cancelling.is_none());
                if let Some(run) = run {
                    run.cancelling = Some(Cancelling::Requested {
                        reason: reason.clone(),
                    });
                    fx.push(Effect::Write(HostToRunner::Cancel { run_id, reason }));
                    fx.push(Effect::StartCancelGrace { run_id });
                }
            }
            Input::CancelGraceElapsed { run_id } => {
                if let Some(Cancelling::Requested { reason }) =
                    self.runs.get(&run_id).and_then(|r| r.cancelling.clone())
                {
                    tracing::info!(%run_id, "runner did not end the cancelled run within the grace period");
                    self.end_run(run_id, EndCause::Cancelled { reason }, &mut fx);
                    if self.mode == ExecutionMode::PerRun {
                        fx.push(Effect::Kill);
                    }
                }
            }
            Input::DeadlinePassed { run_id } => {
                if self.runs.contains_key(&run_id) {
                    // The deadline is hard: tell the runner, end the run now.
                    fx.push(Effect::Write(HostToRunner::Cancel {
                        run_id,
                        reason: "deadline exceeded".into(),
                    }));
                    self.end_run(run_id, EndCause::TimedOut, &mut fx);
                    if self.mode == ExecutionMode::PerRun {
                        fx.push(Effect::Kill);
                    }
                }
            }
            Input::Drain => {
                if matches!(self.phase, Phase::Starting | Phase::Running) {
                    self.phase = Phase::Draining;
                }
                self.maybe_finish_draining(&mut fx);
            }
            Input::Abort { detail } => {
                let ids: Vec<RunId> = self.runs.keys().copied().collect();
                for run_id in ids {
                    self.end_run(
                        run_id,
                        EndCause::Interrupted {
                            detail: detail.clone(),
                        },
                        &mut fx,
                    );
                }
                if self.phase != Phase::Exited {
                    self.phase = Phase::Draining;
                    fx.push(Effect::Kill);
                }
            }
            Input::Exited { clean, detail } => {
                self.phase = Phase::Exited;
                let ids: Vec<RunId> = self.runs.keys().copied().collect();
                for run_id in ids {
                    let cause = match self.runs.get(&run_id).and_then(|r| r.cancelling.clone()) {
                        Some(Cancelling::Requested { reason }) => EndCause::Cancelled { reason },
                        // "per_run: exit means done" — a clean exit ends the stream.
                        None if clean && self.mode == ExecutionMode::PerRun => EndCause::Done,
                        // A shared process that exits cleanly did not crash, but it left its
                        // runs unfinished: they fail all the same, worded as what happened.
                        None if clean => EndCause::ExitedMidRun {
                            detail: detail.clone(),
                        },
                        None => EndCause::Crashed {
                            detail: detail.clone(),
                        },
                    };
                    self.end_run(run_id, cause, &mut fx);
                }
            }
        }
        fx
    }

    /// A line that could be used (a message or a call to refuse): the stream is in sync.
    fn usable_line(&mut self) {
        self.bad_streak = 0;
        if self.phase == Phase::Starting {
            self.phase = Phase::Running;
        }
    }

    /// Answers a call the host cannot accept as written. The checks follow the Host API's
    /// order (SPEC §8): a run that is not active here is `not_found` whatever else is wrong;
    /// everything else is `invalid_argument`. Without a usable id the answer is `id: null`.
    fn on_refused_call(&mut self, call: RefusedCall, fx: &mut Vec<Effect>) {
        let RefusedCall {
            id,
            run_id,
            problem,
        } = call;
        let error = match run_id.as_deref() {
            Some(run_id) if id.is_some() && !self.is_active_text(run_id) => not_active(run_id),
            _ => AgentApiError::new(ErrorCode::InvalidArgument, problem),
        };
        tracing::warn!(run_id = run_id.as_deref().unwrap_or_default(), call_id = ?id, code = %error.code, error = %error.message, "api call refused");
        let answer = match id {
            Some(id) => ApiResult::failure(id, error),
            None => ApiResult::unaddressed(error),
        };
        fx.push(Effect::Write(HostToRunner::ApiResult(answer)));
    }

    fn is_active_text(&self, run_id: &str) -> bool {
        run_id
            .parse::<RunId>()
            .is_ok_and(|id| self.runs.contains_key(&id))
    }

    fn on_frame(&mut self, frame: RunnerToHost, fx: &mut Vec<Effect>) {
        match frame {
            RunnerToHost::Result { run_id, result } => {
                let Some(id) = self.active_id(&run_id, "result") else {
                    return;
                };
                let Some(run) = self.runs.get_mut(&id) else {
                    return;
                };
                match run.sequencer.admit(&result) {
                    Admission::Deliver(item) => {
                        let terminal = item.is_terminal();
                        fx.push(Effect::Deliver { run_id: id, item });
                        if terminal {
                            self.finish(id, fx);
                        }
                    }
                    Admission::Skip(reason) => log_skip(id, &reason),
                    Admission::Fail(item) => {
                        let code = item.failure_code().unwrap_or_default().to_owned();
                        // Tell the runner to stop working on a run the host has ended.
                        fx.push(Effect::Write(HostToRunner::Cancel {
                            run_id: id,
                            reason: code.clone(),
                        }));
                        let error = item
                            .result
                            .data
                            .get("error")
                            .and_then(Value::as_str)
                            .unwrap_or_default();
                        tracing::warn!(run_id = %id, %code, %error, "runner broke a run's rules, failing the run");
                        fx.push(Effect::Deliver { run_id: id, item });
                        self.finish(id, fx);
                    }
                }
            }
            RunnerToHost::Done { run_id } => {
                let Some(id) = self.active_id(&run_id, "done") else {
                    return;
                };
                let cause = match self.runs.get(&id).and_then(|r| r.cancelling.clone()) {
                    Some(Cancelling::Requested { reason }) => EndCause::Cancelled { reason },
                    None => EndCause::Done,
                };
                self.end_run(id, cause, fx);
            }
            RunnerToHost::Api {
                id: call_id,
                run_id,
                action,
                params,
            } => {
                match run_id
                    .parse::<RunId>()
                    .ok()
                    .filter(|id| self.runs.contains_key(id))
                {
                    Some(id) => fx.push(Effect::Dispatch {
                        call_id,
                        run_id: id,
                        action,
                        params,
                    }),
                    None => {
                        tracing::debug!(%run_id, %action, "api call for a run that is not active on this process");
                        fx.push(Effect::Write(HostToRunner::ApiResult(ApiResult::failure(
                            call_id,
                            not_active(&run_id),
                        ))));
                    }
                }
            }
            RunnerToHost::Log {
                level,
                message,
                run_id,
            } => {
                let run_id = run_id.unwrap_or_default();
                // Runner output is untrusted: the same structural redaction as stderr.
                let message = super::redact::redact(&message);
                match level {
                    LogLevel::Error => {
                        tracing::error!(target: "sb_worker::runner::log", %run_id, "{message}")
                    }
                    LogLevel::Warn => {
                        tracing::warn!(target: "sb_worker::runner::log", %run_id, "{message}")
                    }
                    LogLevel::Info => {
                        tracing::info!(target: "sb_worker::runner::log", %run_id, "{message}")
                    }
                    LogLevel::Debug => {
                        tracing::debug!(target: "sb_worker::runner::log", %run_id, "{message}")
                    }
                    LogLevel::Trace => {
                        tracing::trace!(target: "sb_worker::runner::log", %run_id, "{message}")
                    }
                }
            }
        }
    }

    /// A bad line fails the run it names; a line naming no run fails the only run in flight
    /// (always the case for `per_run`). A second bad line in a row means the stream cannot
    /// resynchronise: every run fails and the process is killed (and, in `shared` mode,
    /// restarted by the host).
    fn on_bad_frame(&mut self, run_id: Option<String>, detail: String, fx: &mut Vec<Effect>) {
        self.bad_streak += 1;
        let named = run_id
            .as_deref()
            .and_then(|r| r.parse::<RunId>().ok())
            .filter(|id| self.runs.contains_key(id));
        let blamed = named.or_else(|| {
            if self.runs.len() == 1 {
                self.runs.keys().next().copied()
            } else {
                None
            }
        });
        tracing::warn!(run_id = ?blamed, streak = self.bad_streak, %detail, "unusable line from runner");
        if self.bad_streak >= 2 {
            let ids: Vec<RunId> = self.runs.keys().copied().collect();
            for id in ids {
                self.end_run(
                    id,
                    EndCause::ProtocolError {
                        detail: format!("runner output cannot be resynchronised: {detail}"),
                    },
                    fx,
                );
            }
            if self.phase != Phase::Exited {
                self.phase = Phase::Draining;
                fx.push(Effect::Kill);
            }
            return;
        }
        if let Some(id) = blamed {
            fx.push(Effect::Write(HostToRunner::Cancel {
                run_id: id,
                reason: "runner protocol error".into(),
            }));
            self.end_run(
                id,
                EndCause::ProtocolError {
                    detail: format!("invalid runner output: {detail}"),
                },
                fx,
            );
        }
    }

    /// The active run named by a runner line, or `None` (logged) if it is not one.
    fn active_id(&self, run_id: &str, op: &str) -> Option<RunId> {
        match run_id.parse::<RunId>() {
            Ok(id) if self.runs.contains_key(&id) => Some(id),
            Ok(id) if self.recent_set.contains(&id) => {
                tracing::debug!(run_id = %id, op, "late line for a finished run dropped");
                None
            }
            _ => {
                tracing::warn!(%run_id, op, "line for an unknown run dropped");
                None
            }
        }
    }

    fn end_run(&mut self, run_id: RunId, cause: EndCause, fx: &mut Vec<Effect>) {
        let Some(run) = self.runs.get_mut(&run_id) else {
            return;
        };
        if let Some(item) = run.sequencer.end(cause) {
            fx.push(Effect::Deliver { run_id, item });
        }
        self.finish(run_id, fx);
    }

    /// Forgets a run whose terminal item was delivered.
    fn finish(&mut self, run_id: RunId, fx: &mut Vec<Effect>) {
        if self.runs.remove(&run_id).is_none() {
            return;
        }
        fx.push(Effect::RunEnded { run_id });
        if self.recent_set.insert(run_id) {
            self.recent.push_back(run_id);
            if self.recent.len() > RECENT_RUNS {
                if let Some(old) = self.recent.pop_front() {
                    self.recent_set.remove(&old);
                }
            }
        }
        if self.mode == ExecutionMode::PerRun && self.phase == Phase::Running {
            // The process's one run is over.
            self.phase = Phase::Draining;
        }
        self.maybe_finish_draining(fx);
    }

    fn maybe_finish_draining(&mut self, fx: &mut Vec<Effect>) {
        if self.phase == Phase::Draining && self.runs.is_empty() && !self.shutdown_sent {
            self.shutdown_sent = true;
            fx.push(Effect::Write(HostToRunner::Shutdown {}));
            fx.push(Effect::CloseInput);
        }
    }
}

/// The answer to a call for a run that is not active on this process (never started here,
/// or already ended).
pub(crate) fn not_active(run_id: &str) -> AgentApiError {
    AgentApiError::new(
        ErrorCode::NotFound,
        format!("run session {run_id} not found or expired"),
    )
}

fn log_skip(run_id: RunId, reason: &SkipReason) {
    match reason {
        SkipReason::Late => tracing::debug!(%run_id, "result after the terminal item dropped"),
        SkipReason::Duplicate { sequence } => {
            tracing::warn!(%run_id, sequence, "duplicate runner sequence dropped");
        }
        SkipReason::Invalid { reason } => tracing::warn!(%run_id, %reason, "runner result dropped"),
    }
}

#[cfg(test)]
mod tests;
