//! The actor of one runner process: it owns the [`RunnerProcess`], the [`RunnerLink`] (the
//! pure protocol state machine) and the run timers, feeds the link every happening (a line,
//! a command, a timer, the exit) and carries out the [`Effect`]s it returns — writing to the
//! runner, delivering items to run handles, serving Host API calls on their own tasks,
//! killing the process. It ends when the process is gone and reports how, for the host's
//! restart policy.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use sb_protocol::error::{AgentApiError, ErrorCode};
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::manifest::RunnerId;
use sb_protocol::wire::{ApiCallId, ApiResult, HostToRunner};
use tokio::process::{ChildStdin, ChildStdout};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::command::{Command, Refusal, Routes, RunSlot};
use super::pipes::{read_frames, write_frames};
use super::spec::RunnerHostOptions;
use crate::lock::lock;
use crate::runner::codec::{FrameError, MessageReader, MessageWriter, RunnerLine};
use crate::runner::link::{
    Effect, ExecutionMode, Input, Phase, RunnerLink, StartRefused, not_active,
};
use crate::runner::process::RunnerProcess;
use sb_host_api::api::{ApiStream, CallerIdentity, Connection, HostApi};

/// A Host API call being served for a run of the process.
struct InFlightCall {
    run_id: RunId,
    /// Shared with the serving task: whoever answers first (the task with its outcome, or
    /// the end of the run with `not_found`) writes the call's one answer.
    reply: ApiStream,
    task: AbortHandle,
}

/// How an actor ended, for the restart policy.
pub(super) struct ExitReport {
    pub(super) generation: u64,
    pub(super) workspace_id: WorkspaceId,
    /// The host asked it to drain (not a crash).
    pub(super) expected: bool,
    pub(super) uptime: Duration,
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
/// keep its host alive, so that dropping the last `RunnerHost` (and every `RunHandle`)
/// closes the actor's command channel and stops the process.
pub(super) struct ActorEnv {
    pub(super) config: Arc<RunnerHostOptions>,
    pub(super) runner_id: RunnerId,
    pub(super) api: Arc<dyn HostApi>,
    /// The identity calls of this process are made with (carries `connection`).
    pub(super) caller: Arc<CallerIdentity>,
    /// The process's workspace and current runs, kept current by the actor.
    pub(super) connection: Connection,
    pub(super) routes: Routes,
}

/// Drives one process. See the module docs.
pub(super) struct Actor {
    generation: u64,
    /// The runner id as written in `run` messages.
    runner: String,
    process: RunnerProcess,
    link: RunnerLink,
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
    pub(super) fn new(
        generation: u64,
        process: RunnerProcess,
        stdin: ChildStdin,
        stdout: ChildStdout,
        commands: mpsc::UnboundedReceiver<Command>,
        link: RunnerLink,
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
            link,
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

    fn config(&self) -> &RunnerHostOptions {
        &self.env.config
    }

    pub(super) async fn run(mut self) -> ExitReport {
        loop {
            let next_timer = self.timers.keys().next().map(|(at, _)| *at);
            tokio::select! {
                biased;
                cmd = self.commands.recv(), if self.commands_open => match cmd {
                    Some(cmd) => self.on_command(cmd).await,
                    None => {
                        // The host is gone entirely: nobody can consume results any more.
                        self.commands_open = false;
                        let fx = self.link.on(Input::Abort { detail: "runner host dropped".into() });
                        self.apply(fx).await;
                    }
                },
                frame = self.frames.recv(), if self.stdout_open => match frame {
                    Some(Ok(line)) => {
                        let fx = self.link.on(line_input(line));
                        self.apply(fx).await;
                    }
                    Some(Err(e)) => {
                        let fx = self.link.on(Input::BadFrame {
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
                    let fx = self.link.on(line_input(line));
                    self.apply(fx).await;
                }
                Ok(Some(Err(e))) => {
                    let fx = self.link.on(Input::BadFrame {
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
        if self.drain_requested || (self.link.phase() == Phase::Draining && clean) {
            tracing::info!(%runner_id, pid = self.process.pid(), %detail, "runner process exited");
        } else {
            tracing::warn!(%runner_id, pid = self.process.pid(), %detail, in_flight = self.link.active_runs(), "runner process exited unexpectedly");
        }
        let expected = self.drain_requested
            || (self.link.phase() == Phase::Draining && self.link.mode() == ExecutionMode::PerRun);
        let fx = self.link.on(Input::Exited { clean, detail });
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
                if let Err(reason) = self.link.check_start(run_id) {
                    let _ = reply.send(Err(Refusal {
                        reason,
                        slot,
                        context,
                    }));
                    return;
                }
                match self.link.start_run(run_id, &self.runner, context) {
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
                let fx = self.link.on(Input::Cancel { run_id, reason });
                self.apply(fx).await;
            }
            Command::Drain => {
                self.drain_requested = true;
                let fx = self.link.on(Input::Drain);
                self.apply(fx).await;
            }
            Command::Abort { detail } => {
                let fx = self.link.on(Input::Abort { detail });
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
                    self.link.on(Input::DeadlinePassed { run_id })
                }
                Timer::CancelGrace(run_id) if self.runs.contains_key(&run_id) => {
                    self.link.on(Input::CancelGraceElapsed { run_id })
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

/// What a decoded runner line means to the link.
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
