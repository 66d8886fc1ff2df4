//! The runner main loop: read host messages, run each run on a thread of its own (kept for
//! later runs, `threads`), route API answers.

use std::collections::HashMap;
use std::io::{self, BufRead, Write};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use sb_protocol::error::{AgentApiError, ErrorCode, run_failure};
use sb_protocol::wire::{HostToRunner, LogLevel, RunnerToHost};
use serde_json::Value;

use crate::api::{ApiRouter, HostApi, cancelled_error, host_gone};
use crate::cancel::CancelToken;
use crate::emit::{EmitError, Emitter};
use crate::output::Output;
use crate::run::{Run, deadline_of};
use crate::threads::RunThreads;

/// A runner implementation. One value serves every run of the process, concurrently.
pub trait Runner: Send + Sync + 'static {
    /// Executes one run, writing its results through `out`.
    ///
    /// Contract: emit results in order, end with `out.run_completed()` or `out.run_failed(..)`
    /// (or return `Err`, which the SDK turns into `run.failed`), and check
    /// [`Run::is_cancelled`] in long loops. Returning is the end of the run: the SDK sends
    /// `done` afterwards and ignores anything emitted later.
    fn run(&self, run: &Run, out: &Emitter) -> Result<(), RunError>;
}

/// A run failure, written as `run.failed {code, error, retryable}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct RunError {
    pub code: String,
    pub message: String,
    pub retryable: bool,
}

impl RunError {
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
            retryable: false,
        }
    }

    /// A generic runner failure (`runner.error`).
    pub fn runner(message: impl Into<String>) -> Self {
        Self::new(run_failure::RUNNER_ERROR, message)
    }

    #[must_use]
    pub fn retryable(mut self, retryable: bool) -> Self {
        self.retryable = retryable;
        self
    }
}

impl From<EmitError> for RunError {
    fn from(e: EmitError) -> Self {
        Self::runner(e.to_string())
    }
}

impl From<AgentApiError> for RunError {
    /// A Host API failure that ends the run: `cancelled` stays `cancelled`, a passed deadline
    /// becomes `timeout`, everything else `runner.error` naming the API error code.
    fn from(e: AgentApiError) -> Self {
        match e.error_code() {
            Some(ErrorCode::Cancelled) => Self::new(run_failure::CANCELLED, e.message),
            Some(ErrorCode::DeadlineExceeded) => {
                Self::new(run_failure::TIMEOUT, e.message).retryable(true)
            }
            _ => Self::runner(format!("host api error {}: {}", e.code, e.message))
                .retryable(e.retryable),
        }
    }
}

/// Tuning of [`serve_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeOptions {
    /// After stdin closes (the worker is gone or finished with us), in-flight runs get this
    /// long to finish before they are cancelled.
    pub eof_grace: Duration,
    /// After that cancel, how long to wait for runs to return before giving up on them.
    pub cancel_grace: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            eof_grace: Duration::from_secs(30),
            cancel_grace: Duration::from_secs(5),
        }
    }
}

/// Serves runs over stdin/stdout until the host sends `shutdown` or closes stdin.
pub fn serve<R: Runner>(runner: R) -> io::Result<()> {
    // `Stdin` (not its lock, which is not `Send`) because the reader runs on its own thread.
    serve_with(
        runner,
        io::BufReader::new(io::stdin()),
        io::stdout(),
        ServeOptions::default(),
    )
}

/// [`serve`] over any reader/writer (tests use in-memory pipes).
pub fn serve_io<R: Runner>(
    runner: R,
    input: impl BufRead + Send + 'static,
    output: impl Write + Send + 'static,
) -> io::Result<()> {
    serve_with(runner, input, output, ServeOptions::default())
}

#[derive(Default)]
struct Registry {
    /// Cancel tokens of the runs in flight, by wire run id.
    runs: HashMap<String, CancelToken>,
    /// No new runs are started once set (`shutdown` or end of input).
    closing: bool,
    /// Set when input ended (as opposed to an explicit `shutdown`).
    input_ended: bool,
}

struct Shared {
    registry: Mutex<Registry>,
    changed: Condvar,
    /// The threads runs execute on, kept between runs.
    threads: RunThreads,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// [`serve_io`] with explicit tuning.
pub fn serve_with<R: Runner>(
    runner: R,
    input: impl BufRead + Send + 'static,
    output: impl Write + Send + 'static,
    config: ServeOptions,
) -> io::Result<()> {
    let out = Arc::new(Output::new(Box::new(output))?);
    let router = Arc::new(ApiRouter::new(out.clone()));
    let shared = Arc::new(Shared {
        registry: Mutex::new(Registry::default()),
        changed: Condvar::new(),
        threads: RunThreads::new(),
    });
    let runner = Arc::new(runner);

    // The reader runs on its own thread so this thread can wait for in-flight runs after a
    // `shutdown` while API answers for those runs keep being routed.
    let reader = {
        let (out, router, shared, runner) =
            (out.clone(), router.clone(), shared.clone(), runner.clone());
        std::thread::Builder::new()
            .name("sb-runner-reader".into())
            .spawn(move || read_loop(input, &out, &router, &shared, &runner))?
    };

    let mut registry = shared.lock();
    while !(registry.closing && registry.runs.is_empty()) {
        registry = shared
            .changed
            .wait(registry)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if registry.input_ended && !registry.runs.is_empty() {
            // Nobody will answer API calls or send cancels any more: give the runs a grace
            // period, then cancel them, then stop waiting.
            drop(registry);
            wait_for_runs(&shared, config.eof_grace);
            for token in shared.lock().runs.values() {
                token.cancel("host connection closed");
            }
            wait_for_runs(&shared, config.cancel_grace);
            registry = shared.lock();
            break;
        }
    }
    let input_ended = registry.input_ended;
    drop(registry);
    if input_ended {
        // The reader thread has returned; collect its result.
        let _ = reader.join();
    }
    // Every line queued is written before the process may exit (the reader thread, if still
    // reading after a `shutdown`, holds the output too, so dropping ours would not do it).
    // A write that failed has failed the sends after it.
    let _ = out.close();
    Ok(())
}

fn wait_for_runs(shared: &Shared, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let mut registry = shared.lock();
    while !registry.runs.is_empty() {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            return;
        };
        registry = shared
            .changed
            .wait_timeout(registry, left)
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0;
    }
}

fn read_loop<R: Runner>(
    mut input: impl BufRead,
    out: &Arc<Output>,
    router: &Arc<ApiRouter>,
    shared: &Arc<Shared>,
    runner: &Arc<R>,
) {
    let mut line = Vec::new();
    loop {
        line.clear();
        match input.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<HostToRunner>(&line) {
            Ok(msg) => handle(msg, out, router, shared, runner),
            Err(e) => reject_line(&line, &e, out),
        }
    }
    router.close(&host_gone());
    let mut registry = shared.lock();
    registry.closing = true;
    registry.input_ended = true;
    shared.changed.notify_all();
}

fn handle<R: Runner>(
    msg: HostToRunner,
    out: &Arc<Output>,
    router: &Arc<ApiRouter>,
    shared: &Arc<Shared>,
    runner: &Arc<R>,
) {
    match msg {
        HostToRunner::Run {
            run_id,
            runner: runner_id,
            context,
        } => {
            let wire_id = run_id.to_string();
            let cancel = CancelToken::new();
            {
                let mut registry = shared.lock();
                if registry.closing {
                    drop(registry);
                    refuse_run(&wire_id, out, "runner is shutting down");
                    return;
                }
                if registry.runs.contains_key(&wire_id) {
                    // A duplicate run id would mix two result streams; the first run wins.
                    drop(registry);
                    log(
                        out,
                        LogLevel::Error,
                        format!("duplicate run {wire_id} ignored"),
                        Some(&wire_id),
                    );
                    return;
                }
                registry.runs.insert(wire_id.clone(), cancel.clone());
            }
            let api = HostApi::new(
                wire_id.clone(),
                router.clone(),
                cancel.clone(),
                deadline_of(&context),
            );
            let run = Run {
                run_id,
                runner: runner_id,
                context: *context,
                cancel,
                api,
            };
            let emitter = Emitter::new(wire_id.clone(), out.clone());
            let (shared2, runner2) = (shared.clone(), runner.clone());
            let spawned = shared.threads.execute(Box::new(move || {
                execute(&*runner2, &run, &emitter);
                let mut registry = shared2.lock();
                registry.runs.remove(&wire_id);
                shared2.changed.notify_all();
            }));
            if let Err(e) = spawned {
                // Out of threads: fail the run instead of leaving it hanging.
                let wire_id = run_id.to_string();
                shared.lock().runs.remove(&wire_id);
                refuse_run(&wire_id, out, &format!("cannot start run thread: {e}"));
            }
        }
        HostToRunner::Cancel { run_id, reason } => {
            let wire_id = run_id.to_string();
            let token = shared.lock().runs.get(&wire_id).cloned();
            if let Some(token) = token {
                token.cancel(reason);
                router.fail_run(&wire_id, &cancelled_error());
            }
        }
        HostToRunner::ApiResult(result) => router.route_result(result),
        HostToRunner::ApiChunk { id, data } => router.route_chunk(&id, data),
        HostToRunner::Shutdown {} => {
            let mut registry = shared.lock();
            registry.closing = true;
            shared.changed.notify_all();
        }
    }
}

/// Runs the runner and guarantees the run ends: a terminal result (if the runner emitted
/// none and the outcome calls for one) and `done`.
fn execute<R: Runner>(runner: &R, run: &Run, out: &Emitter) {
    let outcome = catch_unwind(AssertUnwindSafe(|| runner.run(run, out)));
    let failure = match outcome {
        Ok(Ok(())) if run.is_cancelled() => Some(RunError::new(
            run_failure::CANCELLED,
            run.cancel_token()
                .reason()
                .unwrap_or_else(|| "cancelled".into()),
        )),
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Some(RunError::runner(format!("runner panicked: {what}")))
        }
    };
    if let Some(e) = failure {
        // Finished (a terminal result is already out) is the normal case here.
        let _ = out.run_failed_with(&e.code, e.message, e.retryable);
    }
    let _ = out.done();
}

fn refuse_run(wire_id: &str, out: &Arc<Output>, reason: &str) {
    let emitter = Emitter::new(wire_id.to_owned(), out.clone());
    let _ = emitter.run_failed_with(run_failure::RUNNER_ERROR, reason, true);
    let _ = emitter.done();
}

/// A host line the SDK cannot use. If it is a `run` whose context does not parse (a newer
/// host), the run is failed so it does not hang; anything else is logged back to the host.
fn reject_line(line: &[u8], error: &serde_json::Error, out: &Arc<Output>) {
    let value: Option<Value> = serde_json::from_slice(line).ok();
    let op = value
        .as_ref()
        .and_then(|v| v.get("op"))
        .and_then(Value::as_str);
    let run_id = value
        .as_ref()
        .and_then(|v| v.get("run_id"))
        .and_then(Value::as_str);
    if let (Some("run"), Some(run_id)) = (op, run_id) {
        let emitter = Emitter::new(run_id.to_owned(), out.clone());
        let _ = emitter.run_failed(
            run_failure::RUNNER_ERROR,
            format!("invalid run message: {error}"),
        );
        let _ = emitter.done();
        return;
    }
    log(
        out,
        LogLevel::Error,
        format!("unusable host message ignored: {error}"),
        run_id,
    );
}

fn log(out: &Output, level: LogLevel, message: String, run_id: Option<&str>) {
    let _ = out.send(&RunnerToHost::Log {
        level,
        message,
        run_id: run_id.map(str::to_owned),
    });
}

#[cfg(test)]
mod tests;
