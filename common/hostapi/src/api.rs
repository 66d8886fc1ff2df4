//! The Host API boundary as a transport sees it (SPEC §8): the [`HostApi`] trait, who is
//! calling ([`CallerIdentity`], over which [`Connection`]) and where the answer goes
//! ([`ApiStream`]).
//!
//! A transport establishes the caller and hands the call to a [`HostApi`]. The worker's runner
//! host validates the *connection* side of a call — the caller is the plugin whose process
//! sent the line, and the run is an active run of that very process — and the gateway's
//! remote Host API establishes the caller from the run's token. The [`Connection`] travels
//! with the call so that the gate checks the same facts again (SPEC §14: defence in depth).
//!
//! Behind the gate, a [`Dispatcher`] serves the [`GatedCall`]s that passed it: the action
//! servers (`actions::ActionDispatcher`, `basic::BasicHostApi`) implement it, the gate
//! (`api_gate::ApiGate`) calls it, and neither needs the other's module.

use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use sb_protocol::error::AgentApiError;
use sb_protocol::host::AuthorizationSnapshot;
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::manifest::RunnerId;
use sb_protocol::wire::{ApiCallId, ApiResult, HostToRunner};
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// Who is calling: derived by the worker from the process connection, **never** read from
/// a message (a runner cannot claim to be another plugin, workspace or run).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CallerIdentity {
    /// The runner the process was started for.
    pub runner_id: RunnerId,
    /// `<author>/<plugin>`: the identity compared with the run session's plugin identity.
    pub plugin_id: String,
    /// The runner process the call came over: its workspace and its current runs. `None`
    /// for a caller that is not a worker's process connection (the gateway's remote Host
    /// API, whose caller is established by the run's own token instead).
    pub connection: Option<Connection>,
}

impl CallerIdentity {
    /// The identity of `runner_id`'s plugin, not bound to a connection.
    #[must_use]
    pub fn for_runner(runner_id: &RunnerId) -> Self {
        Self {
            runner_id: runner_id.clone(),
            plugin_id: runner_id.plugin_id(),
            connection: None,
        }
    }

    /// The identity of a process of `runner_id` speaking over `connection`.
    #[must_use]
    pub fn for_connection(runner_id: &RunnerId, connection: Connection) -> Self {
        Self {
            connection: Some(connection),
            ..Self::for_runner(runner_id)
        }
    }
}

/// One runner process connection as the Host API sees it (SPEC §14 "a shared runner
/// process is bound to one workspace"): the workspace every run on it belongs to, and the
/// runs it hosts right now. The runner host keeps the run set current (a run is added before
/// the runner hears of it and removed when it ends); clones share it.
///
/// Two connections are equal when they are the same connection (same run set), not when
/// they merely host the same runs.
#[derive(Debug, Clone)]
pub struct Connection {
    workspace_id: WorkspaceId,
    runs: Arc<Mutex<HashSet<RunId>>>,
}

impl Connection {
    /// A connection of a process bound to `workspace_id`, hosting no run yet.
    #[must_use]
    pub fn new(workspace_id: WorkspaceId) -> Self {
        Self::hosting(workspace_id, [])
    }

    /// A connection bound to `workspace_id` that hosts `runs` (tests of a gate).
    #[must_use]
    pub fn hosting(workspace_id: WorkspaceId, runs: impl IntoIterator<Item = RunId>) -> Self {
        Self {
            workspace_id,
            runs: Arc::new(Mutex::new(runs.into_iter().collect())),
        }
    }

    /// The workspace the process is bound to.
    #[must_use]
    pub fn workspace_id(&self) -> &WorkspaceId {
        &self.workspace_id
    }

    /// Whether `run_id` is one of the runs the process hosts right now.
    #[must_use]
    pub fn hosts(&self, run_id: RunId) -> bool {
        self.lock().contains(&run_id)
    }

    /// How many runs the process hosts right now.
    #[must_use]
    pub fn run_count(&self) -> usize {
        self.lock().len()
    }

    /// Adds `run_id` to the runs the process hosts. Only the runner host that owns the
    /// connection calls this, before the runner hears of the run.
    pub fn attach(&self, run_id: RunId) {
        self.lock().insert(run_id);
    }

    /// Removes `run_id` from the runs the process hosts. Only the runner host that owns the
    /// connection calls this, when the run ends.
    pub fn detach(&self, run_id: RunId) {
        self.lock().remove(&run_id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<RunId>> {
        self.runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl PartialEq for Connection {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.runs, &other.runs)
    }
}

impl Eq for Connection {}

impl Hash for Connection {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Equal connections share the run set, hence the workspace.
        self.workspace_id.hash(state);
    }
}

/// The answer channel of one Host API call: its streamed parts (`api_chunk`) and its one
/// final `api_result`.
///
/// **Exactly one answer per call.** Two parties may try to answer a call: the task serving
/// it ([`ApiStream::answer`] with the outcome) and the runner host when the call's run ends
/// first (`not_found`). Whoever comes first writes the answer; the other is told it lost and
/// writes nothing. Chunks are written only before the answer. The check and the hand-over
/// to the writer happen under one lock, with the writer's capacity reserved beforehand, so
/// an answer can never be queued behind a racing second answer or a late chunk, whatever the
/// scheduling. Clones share the same answer state.
#[derive(Debug, Clone)]
pub struct ApiStream {
    call_id: ApiCallId,
    out: mpsc::Sender<HostToRunner>,
    answered: Arc<Mutex<bool>>,
}

impl ApiStream {
    /// A stream writing `api_chunk`s and the `api_result` of call `call_id` into `out` (the
    /// process writer; a plain channel in tests).
    #[must_use]
    pub fn new(call_id: impl Into<ApiCallId>, out: mpsc::Sender<HostToRunner>) -> Self {
        Self {
            call_id: call_id.into(),
            out,
            answered: Arc::new(Mutex::new(false)),
        }
    }

    /// The call id chunks and the answer are tagged with.
    #[must_use]
    pub fn call_id(&self) -> &ApiCallId {
        &self.call_id
    }

    /// Sends one chunk. Returns false if the call was already answered or the process is gone
    /// (stop producing chunks).
    pub async fn send(&self, data: Value) -> bool {
        self.write(
            HostToRunner::ApiChunk {
                id: self.call_id.clone(),
                data,
            },
            false,
        )
        .await
    }

    /// Writes the call's final answer, unless it was already answered. Returns whether this
    /// answer was the one written.
    pub async fn answer(&self, outcome: Result<Value, AgentApiError>) -> bool {
        let answer = ApiResult::from_result(self.call_id.clone(), outcome);
        self.write(HostToRunner::ApiResult(answer), true).await
    }

    /// Whether the final answer has been handed to the writer.
    #[must_use]
    pub fn is_answered(&self) -> bool {
        *self.lock()
    }

    async fn write(&self, message: HostToRunner, is_answer: bool) -> bool {
        // Reserve first (this may wait for the writer), decide and hand over under the lock.
        let Ok(permit) = self.out.reserve().await else {
            return false;
        };
        let mut answered = self.lock();
        if *answered {
            return false;
        }
        *answered = is_answer;
        permit.send(message);
        true
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, bool> {
        self.answered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Serves Host API actions for runner processes.
///
/// Contract:
/// - Called only for a `run_id` that is an active run of the calling process; `caller` is
///   that process's identity, with its [`Connection`] (workspace and current runs), and an
///   implementation that authorizes must refuse a run that is not one of the connection's
///   or whose workspace is not the connection's. The implementation still performs every check of SPEC §8 that
///   needs host state (session exists, identity matches the session, deadline, snapshot,
///   scope, arguments, size, rate and budgets), in that order.
/// - Streams parts of the answer through `stream` (e.g. `invoke_llm_stream`), then returns
///   the final `data`, which the caller writes as the answer. Chunks sent after that, or
///   after the call was answered otherwise (its run ended), are not written: `stream.send`
///   then answers false.
/// - The future may be dropped when the run ends (cancel, deadline, crash): implementations
///   must tolerate cancellation at any await point.
/// - Errors are structured [`AgentApiError`]s with codes from the closed set.
#[async_trait]
pub trait HostApi: Send + Sync + 'static {
    async fn call(
        &self,
        caller: &CallerIdentity,
        run_id: RunId,
        action: &str,
        params: Value,
        stream: &ApiStream,
    ) -> Result<Value, AgentApiError>;
}

/// The host version reported to runners (`get_host_version`).
pub const HOST_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The Host API protocol version reported by `get_host_version`.
pub const PROTOCOL_VERSION: &str = "v1";

/// The answer of `get_host_version`, the same from every implementation:
/// `{"version": HOST_VERSION, "protocol": PROTOCOL_VERSION, "host": "switchboard"}`.
#[must_use]
pub fn host_version() -> Value {
    json!({
        "version": HOST_VERSION,
        "protocol": PROTOCOL_VERSION,
        "host": "switchboard",
    })
}

/// A call that passed the gate: the action code gets the frozen snapshot with it.
#[derive(Debug, Clone, Copy)]
pub struct GatedCall<'a> {
    /// Who is calling (from the process connection).
    pub caller: &'a CallerIdentity,
    /// The run.
    pub run_id: RunId,
    /// The action name as sent by the runner.
    pub action: &'a str,
    /// The run's authorization, as frozen at run start.
    pub snapshot: &'a AuthorizationSnapshot,
}

/// Serves Host API actions after the gate.
///
/// # Contract
/// - Called only for calls that passed steps 1–3 of SPEC §8; the implementation performs the
///   remaining steps (4: API flag / resource grant in `call.snapshot`, 5: scope, 6: arguments,
///   7: size, rate, budgets) in that order, then the action.
/// - An action it does not know is `not_found`; a known action it cannot serve for this run is
///   `unauthorized` (never a fake success).
/// - May stream parts of the answer through `stream` before returning the final data.
/// - Must tolerate being dropped at any await point (the run ended).
#[async_trait]
pub trait Dispatcher: Send + Sync + 'static {
    /// Serves one gated call.
    async fn dispatch(
        &self,
        call: GatedCall<'_>,
        params: Value,
        stream: &ApiStream,
    ) -> Result<Value, AgentApiError>;
}

#[async_trait]
impl<D: Dispatcher + ?Sized> Dispatcher for Arc<D> {
    async fn dispatch(
        &self,
        call: GatedCall<'_>,
        params: Value,
        stream: &ApiStream,
    ) -> Result<Value, AgentApiError> {
        (**self).dispatch(call, params, stream).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sb_protocol::error::ErrorCode;

    #[tokio::test]
    async fn api_stream_tags_chunks_with_the_call_id() {
        let (tx, mut rx) = mpsc::channel(4);
        let stream = ApiStream::new("42", tx);
        assert!(stream.send(json!("part")).await);
        assert_eq!(
            rx.recv().await,
            Some(HostToRunner::ApiChunk {
                id: "42".into(),
                data: json!("part")
            })
        );
        drop(rx);
        assert!(!stream.send(json!("x")).await);
    }

    #[tokio::test]
    async fn a_call_is_answered_once_and_no_chunk_follows_the_answer() {
        let (tx, mut rx) = mpsc::channel(8);
        let stream = ApiStream::new(7u64, tx);
        let host_side = stream.clone();
        assert!(stream.send(json!(1)).await);
        assert!(!stream.is_answered());
        assert!(stream.answer(Ok(json!({"v": 1}))).await);
        assert!(host_side.is_answered());
        // The run's end comes second: nothing more is written, chunks included.
        assert!(
            !host_side
                .answer(Err(AgentApiError::new(ErrorCode::NotFound, "gone")))
                .await
        );
        assert!(!stream.send(json!(2)).await);
        drop((stream, host_side));
        let mut written = Vec::new();
        while let Some(message) = rx.recv().await {
            written.push(message);
        }
        assert_eq!(
            written,
            vec![
                HostToRunner::ApiChunk {
                    id: 7u64.into(),
                    data: json!(1)
                },
                HostToRunner::ApiResult(ApiResult::success(7u64, json!({"v": 1}))),
            ]
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn racing_answers_write_exactly_one() {
        for _ in 0..200 {
            let (tx, mut rx) = mpsc::channel(8);
            let stream = ApiStream::new("r", tx);
            let (a, b) = (stream.clone(), stream.clone());
            let first = tokio::spawn(async move { a.answer(Ok(json!("served"))).await });
            let second = tokio::spawn(async move {
                b.answer(Err(AgentApiError::new(ErrorCode::NotFound, "ended")))
                    .await
            });
            let (first, second) = (first.await.unwrap(), second.await.unwrap());
            assert!(first ^ second, "exactly one answer wins");
            drop(stream);
            let mut answers = 0;
            while rx.recv().await.is_some() {
                answers += 1;
            }
            assert_eq!(answers, 1);
        }
    }
}
