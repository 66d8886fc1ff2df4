//! Blocking Host API client (SPEC §8).
//!
//! A call writes `{"op":"api","id","run_id","action","params"}` with a fresh id and blocks the
//! calling thread until the reader thread routes the matching `api_result` (and any
//! `api_chunk`s before it) back by id. The wait is bounded by the run's deadline and ends early
//! with `cancelled` if the host cancels the run, or `unavailable` if the host stops answering
//! (stdin closed).
//!
//! The typed helpers only build `params`; the host validates everything (authorization, scope,
//! limits) against the run's frozen snapshot, so a helper never checks permissions locally.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use base64::Engine as _;
use sb_protocol::error::{AgentApiError, ErrorCode};
use sb_protocol::wire::{ApiCallId, ApiResult, RunnerToHost};
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::cancel::CancelToken;
use crate::output::Output;

/// Host API action names (snake_case, PROTOCOL_V1 §8 / host-behaviour §22.3), as constants
/// for `HostApi::call`. They are read from the protocol's one action table
/// ([`Action`](sb_protocol::action::Action)), so the SDK sends exactly the names the host
/// parses.
pub mod actions {
    pub use sb_protocol::action::Action;

    /// The seed alias of `action` (a compile error for an action without one).
    const fn alias(action: Action) -> &'static str {
        match action.seed_alias() {
            Some(alias) => alias,
            None => panic!("action has no seed alias"),
        }
    }

    pub const HISTORY_PAGE: &str = Action::HistoryPage.name();
    pub const HISTORY_SEARCH: &str = Action::HistorySearch.name();
    pub const EVENT_GET: &str = Action::EventGet.name();
    pub const EVENT_PAGE: &str = Action::EventPage.name();
    pub const ARTIFACT_METADATA: &str = Action::ArtifactMetadata.name();
    pub const ARTIFACT_READ: &str = Action::ArtifactRead.name();
    pub const STATE_GET: &str = Action::StateGet.name();
    pub const STATE_SET: &str = Action::StateSet.name();
    pub const STATE_DELETE: &str = Action::StateDelete.name();
    pub const STATE_LIST: &str = Action::StateList.name();
    /// Plugin / workspace binary storage (`owner_type` `plugin` | `workspace`): the canonical
    /// names, which the typed helpers send.
    pub const STORAGE_GET: &str = Action::StorageGet.name();
    pub const STORAGE_SET: &str = Action::StorageSet.name();
    pub const STORAGE_DELETE: &str = Action::StorageDelete.name();
    pub const STORAGE_KEYS: &str = Action::StorageKeys.name();
    /// The seed host's names of the storage actions; the host still accepts them as aliases
    /// of `STORAGE_*`.
    pub const GET_BINARY_STORAGE: &str = alias(Action::StorageGet);
    pub const SET_BINARY_STORAGE: &str = alias(Action::StorageSet);
    pub const DELETE_BINARY_STORAGE: &str = alias(Action::StorageDelete);
    pub const GET_BINARY_STORAGE_KEYS: &str = alias(Action::StorageKeys);
    pub const GET_HOST_VERSION: &str = Action::GetHostVersion.name();
    pub const STEERING_PULL: &str = Action::SteeringPull.name();
    pub const INVOKE_LLM: &str = Action::InvokeLlm.name();
    pub const INVOKE_LLM_STREAM: &str = Action::InvokeLlmStream.name();
    pub const CALL_TOOL: &str = Action::CallTool.name();
    pub const GET_TOOL_DETAIL: &str = Action::GetToolDetail.name();
    pub const INVOKE_RERANK: &str = Action::InvokeRerank.name();
    pub const RETRIEVE_KNOWLEDGE: &str = Action::RetrieveKnowledge.name();
}

enum Reply {
    Chunk(Value),
    Final(Result<Value, AgentApiError>),
}

struct PendingCall {
    run_id: String,
    tx: mpsc::Sender<Reply>,
}

#[derive(Default)]
struct Pending {
    calls: HashMap<String, PendingCall>,
    /// Set when the host can no longer answer (stdin closed): new calls fail at once.
    closed: bool,
}

/// State shared by every run's [`HostApi`] and the reader thread.
pub(crate) struct ApiRouter {
    out: Arc<Output>,
    next_id: AtomicU64,
    pending: Mutex<Pending>,
}

impl ApiRouter {
    pub(crate) fn new(out: Arc<Output>) -> Self {
        Self {
            out,
            next_id: AtomicU64::new(1),
            pending: Mutex::new(Pending::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Routes a final answer. Answers for unknown ids (the call already timed out, the host
    /// is confused, or `id: null`, the host's refusal of a call it could not read) are
    /// ignored. This client writes string ids only, so only string ids can be its own.
    pub(crate) fn route_result(&self, result: ApiResult) {
        let Some(id) = result.id.as_ref().and_then(ApiCallId::as_str) else {
            return;
        };
        let call = self.lock().calls.remove(id);
        if let Some(call) = call {
            let _ = call.tx.send(Reply::Final(result.into_result()));
        }
    }

    pub(crate) fn route_chunk(&self, id: &ApiCallId, data: Value) {
        let Some(id) = id.as_str() else {
            return;
        };
        let pending = self.lock();
        if let Some(call) = pending.calls.get(id) {
            let _ = call.tx.send(Reply::Chunk(data));
        }
    }

    /// Fails every in-flight call of `run_id` (the run was cancelled).
    pub(crate) fn fail_run(&self, run_id: &str, error: &AgentApiError) {
        let mut pending = self.lock();
        let ids: Vec<String> = pending
            .calls
            .iter()
            .filter(|(_, c)| c.run_id == run_id)
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            if let Some(call) = pending.calls.remove(&id) {
                let _ = call.tx.send(Reply::Final(Err(error.clone())));
            }
        }
    }

    /// Fails every in-flight call and refuses new ones (the host stopped answering).
    pub(crate) fn close(&self, error: &AgentApiError) {
        let mut pending = self.lock();
        pending.closed = true;
        for (_, call) in pending.calls.drain() {
            let _ = call.tx.send(Reply::Final(Err(error.clone())));
        }
    }

    fn start(
        &self,
        run_id: &str,
        action: &str,
        params: Value,
    ) -> Result<(String, mpsc::Receiver<Reply>), AgentApiError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed).to_string();
        let (tx, rx) = mpsc::channel();
        {
            let mut pending = self.lock();
            if pending.closed {
                return Err(host_gone());
            }
            pending.calls.insert(
                id.clone(),
                PendingCall {
                    run_id: run_id.to_owned(),
                    tx,
                },
            );
        }
        let msg = RunnerToHost::Api {
            id: ApiCallId::Text(id.clone()),
            run_id: run_id.to_owned(),
            action: action.to_owned(),
            params,
        };
        if let Err(e) = self.out.send(&msg) {
            self.lock().calls.remove(&id);
            return Err(AgentApiError::new(
                ErrorCode::Unavailable,
                format!("writing to the host failed: {e}"),
            ));
        }
        Ok((id, rx))
    }

    fn forget(&self, id: &str) {
        self.lock().calls.remove(id);
    }
}

pub(crate) fn host_gone() -> AgentApiError {
    AgentApiError::new(ErrorCode::Unavailable, "host connection closed")
}

/// The Host API for one run. Clone it freely (e.g. into helper threads).
#[derive(Clone)]
pub struct HostApi {
    run_id: String,
    router: Arc<ApiRouter>,
    cancel: CancelToken,
    deadline: Option<SystemTime>,
}

impl HostApi {
    pub(crate) fn new(
        run_id: String,
        router: Arc<ApiRouter>,
        cancel: CancelToken,
        deadline: Option<SystemTime>,
    ) -> Self {
        Self {
            run_id,
            router,
            cancel,
            deadline,
        }
    }

    /// Calls `action` with `params` and waits for the answer.
    ///
    /// Errors: whatever the host answers (`unauthorized`, `not_found`, …), `deadline_exceeded`
    /// when the run's deadline passes first, `cancelled` when the run is cancelled while
    /// waiting, `unavailable` when the host connection is gone.
    pub fn call(&self, action: &str, params: Value) -> Result<Value, AgentApiError> {
        self.call_stream(action, params, |_| {})
    }

    /// Like [`HostApi::call`], passing each streamed `api_chunk` to `on_chunk` (in order)
    /// before the final answer is returned. Used by `invoke_llm_stream`.
    pub fn call_stream(
        &self,
        action: &str,
        params: Value,
        mut on_chunk: impl FnMut(Value),
    ) -> Result<Value, AgentApiError> {
        if self.cancel.is_cancelled() {
            return Err(cancelled());
        }
        let (id, rx) = self.router.start(&self.run_id, action, params)?;
        loop {
            let reply = match self.deadline {
                None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(deadline) => {
                    let remaining = deadline
                        .duration_since(SystemTime::now())
                        .unwrap_or_default();
                    rx.recv_timeout(remaining)
                }
            };
            match reply {
                Ok(Reply::Chunk(data)) => on_chunk(data),
                Ok(Reply::Final(outcome)) => return outcome,
                Err(RecvTimeoutError::Timeout) => {
                    self.router.forget(&id);
                    return Err(AgentApiError::new(
                        ErrorCode::DeadlineExceeded,
                        format!("run deadline passed while waiting for `{action}`"),
                    ));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.router.forget(&id);
                    return Err(host_gone());
                }
            }
        }
    }

    /// `history_page`: transcript items of the run's conversation.
    pub fn history_page(&self, params: &HistoryPageParams) -> Result<Value, AgentApiError> {
        self.call(actions::HISTORY_PAGE, to_params(params))
    }

    /// `history_search`.
    pub fn history_search(&self, params: &HistorySearchParams) -> Result<Value, AgentApiError> {
        self.call(actions::HISTORY_SEARCH, to_params(params))
    }

    /// `event_get`.
    pub fn event_get(&self, event_id: &str) -> Result<Value, AgentApiError> {
        self.call(actions::EVENT_GET, json!({ "event_id": event_id }))
    }

    /// `event_page`.
    pub fn event_page(&self, params: &EventPageParams) -> Result<Value, AgentApiError> {
        self.call(actions::EVENT_PAGE, to_params(params))
    }

    /// `artifact_metadata`.
    pub fn artifact_metadata(&self, artifact_id: &str) -> Result<Value, AgentApiError> {
        self.call(
            actions::ARTIFACT_METADATA,
            json!({ "artifact_id": artifact_id }),
        )
    }

    /// `artifact_read` from `offset`, at most `limit` bytes (host default 1 MiB).
    pub fn artifact_read(
        &self,
        artifact_id: &str,
        offset: u64,
        limit: Option<u64>,
    ) -> Result<Value, AgentApiError> {
        let mut params = json!({ "artifact_id": artifact_id, "offset": offset });
        if let Some(limit) = limit {
            params["limit"] = json!(limit);
        }
        self.call(actions::ARTIFACT_READ, params)
    }

    /// `state_get` (scope: `conversation`, `actor`, `subject` or `runner`).
    pub fn state_get(&self, scope: &str, key: &str) -> Result<Value, AgentApiError> {
        self.call(actions::STATE_GET, json!({ "scope": scope, "key": key }))
    }

    /// `state_set`.
    pub fn state_set(&self, scope: &str, key: &str, value: Value) -> Result<Value, AgentApiError> {
        self.call(
            actions::STATE_SET,
            json!({ "scope": scope, "key": key, "value": value }),
        )
    }

    /// `state_delete`.
    pub fn state_delete(&self, scope: &str, key: &str) -> Result<Value, AgentApiError> {
        self.call(actions::STATE_DELETE, json!({ "scope": scope, "key": key }))
    }

    /// `state_list`, optionally by key prefix.
    pub fn state_list(
        &self,
        scope: &str,
        prefix: Option<&str>,
        limit: Option<u32>,
    ) -> Result<Value, AgentApiError> {
        let mut params = json!({ "scope": scope });
        if let Some(prefix) = prefix {
            params["prefix"] = json!(prefix);
        }
        if let Some(limit) = limit {
            params["limit"] = json!(limit);
        }
        self.call(actions::STATE_LIST, params)
    }

    /// `storage_get`. The owner (this plugin, or the run's workspace) is derived by the
    /// host from the connection, never sent.
    pub fn storage_get(&self, owner: StorageOwner, key: &str) -> Result<Value, AgentApiError> {
        self.call(
            actions::STORAGE_GET,
            json!({ "owner_type": owner, "key": key }),
        )
    }

    /// `storage_set` (`value` is sent base64-encoded).
    pub fn storage_set(
        &self,
        owner: StorageOwner,
        key: &str,
        value: &[u8],
    ) -> Result<Value, AgentApiError> {
        let encoded = base64::engine::general_purpose::STANDARD.encode(value);
        self.call(
            actions::STORAGE_SET,
            json!({ "owner_type": owner, "key": key, "value_base64": encoded }),
        )
    }

    /// `storage_delete`.
    pub fn storage_delete(&self, owner: StorageOwner, key: &str) -> Result<Value, AgentApiError> {
        self.call(
            actions::STORAGE_DELETE,
            json!({ "owner_type": owner, "key": key }),
        )
    }

    /// `storage_keys`.
    pub fn storage_keys(&self, owner: StorageOwner) -> Result<Value, AgentApiError> {
        self.call(actions::STORAGE_KEYS, json!({ "owner_type": owner }))
    }

    /// `get_host_version`.
    pub fn get_host_version(&self) -> Result<Value, AgentApiError> {
        self.call(actions::GET_HOST_VERSION, json!({}))
    }

    /// `steering_pull`: `mode` is `all` (default) or `one`.
    pub fn steering_pull(
        &self,
        mode: Option<&str>,
        limit: Option<u32>,
    ) -> Result<Value, AgentApiError> {
        let mut params = json!({});
        if let Some(mode) = mode {
            params["mode"] = json!(mode);
        }
        if let Some(limit) = limit {
            params["limit"] = json!(limit);
        }
        self.call(actions::STEERING_PULL, params)
    }
}

impl HostApi {
    /// `invoke_llm`: one chat completion with model `model_id` (an id from
    /// `ctx.resources.models`). `messages` are OpenAI-style chat messages, `funcs` tool
    /// definitions (`{name, description, parameters}`), `extra_args` extra request fields.
    /// Answers `{message, usage}`.
    pub fn invoke_llm(
        &self,
        model_id: &str,
        messages: &[Value],
        funcs: &[Value],
        extra_args: Option<&Map<String, Value>>,
    ) -> Result<Value, AgentApiError> {
        self.call(
            actions::INVOKE_LLM,
            llm_params(model_id, messages, funcs, extra_args),
        )
    }

    /// `invoke_llm_stream`: like [`HostApi::invoke_llm`], passing each streamed
    /// `{chunk: MessageChunk}` to `on_chunk` as the model produces it; the answer is the
    /// assembled `{message, usage}`.
    pub fn invoke_llm_stream(
        &self,
        model_id: &str,
        messages: &[Value],
        funcs: &[Value],
        extra_args: Option<&Map<String, Value>>,
        on_chunk: impl FnMut(Value),
    ) -> Result<Value, AgentApiError> {
        self.call_stream(
            actions::INVOKE_LLM_STREAM,
            llm_params(model_id, messages, funcs, extra_args),
            on_chunk,
        )
    }

    /// `invoke_rerank`: `documents` ranked against `query`, best first, at most `top_k`.
    pub fn invoke_rerank(
        &self,
        model_id: &str,
        query: &str,
        documents: &[Value],
        top_k: Option<u32>,
    ) -> Result<Value, AgentApiError> {
        let mut params =
            json!({"rerank_model_uuid": model_id, "query": query, "documents": documents});
        if let Some(k) = top_k {
            params["top_k"] = json!(k);
        }
        self.call(actions::INVOKE_RERANK, params)
    }

    /// `get_tool_detail`: `{tool: {name, description, parameters, …}}`.
    pub fn get_tool_detail(&self, tool_name: &str) -> Result<Value, AgentApiError> {
        self.call(actions::GET_TOOL_DETAIL, json!({ "tool_name": tool_name }))
    }

    /// `call_tool` with its `parameters` object. With a `call_id`, the host executes the
    /// call at most once per run and id (a repeat answers the first outcome).
    pub fn call_tool(
        &self,
        tool_name: &str,
        parameters: &Map<String, Value>,
        call_id: Option<&str>,
    ) -> Result<Value, AgentApiError> {
        let mut params = json!({"tool_name": tool_name, "parameters": parameters});
        if let Some(id) = call_id {
            params["call_id"] = json!(id);
        }
        self.call(actions::CALL_TOOL, params)
    }

    /// `retrieve_knowledge`: the chunks of knowledge base `kb_id` best matching `query_text`
    /// (`top_k` from 1 to 50, host default 5).
    pub fn retrieve_knowledge(
        &self,
        kb_id: &str,
        query_text: &str,
        top_k: Option<u32>,
    ) -> Result<Value, AgentApiError> {
        let mut params = json!({"kb_id": kb_id, "query_text": query_text});
        if let Some(k) = top_k {
            params["top_k"] = json!(k);
        }
        self.call(actions::RETRIEVE_KNOWLEDGE, params)
    }
}

fn llm_params(
    model_id: &str,
    messages: &[Value],
    funcs: &[Value],
    extra_args: Option<&Map<String, Value>>,
) -> Value {
    let mut params = json!({"llm_model_uuid": model_id, "messages": messages});
    if !funcs.is_empty() {
        params["funcs"] = json!(funcs);
    }
    if let Some(extra) = extra_args.filter(|e| !e.is_empty()) {
        params["extra_args"] = Value::Object(extra.clone());
    }
    params
}

fn cancelled() -> AgentApiError {
    AgentApiError::new(ErrorCode::Cancelled, "run was cancelled")
}

pub(crate) fn cancelled_error() -> AgentApiError {
    cancelled()
}

fn to_params<T: Serialize>(params: &T) -> Value {
    serde_json::to_value(params).unwrap_or_else(|_| json!({}))
}

/// Whose binary storage a storage call addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageOwner {
    /// This plugin's private storage.
    Plugin,
    /// The run's workspace storage.
    Workspace,
}

/// Parameters of `history_page`; unset fields take the host defaults (limit 50, backward).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HistoryPageParams {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub before_cursor: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_cursor: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    /// `backward` or `forward`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub direction: Option<String>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub include_artifacts: bool,
}

/// Parameters of `history_search`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct HistorySearchParams {
    pub query: String,
    /// `{conversation_id?, roles?, item_types?}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filters: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
}

/// Parameters of `event_page`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct EventPageParams {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_types: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub before_cursor: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runner's stdout as a channel of written chunks: whole lines, one per chunk here,
    /// since each helper below waits for its answer before the next writes.
    struct Lines(mpsc::Sender<Vec<u8>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let _ = self.0.send(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    type Helper = fn(&HostApi) -> Result<Value, AgentApiError>;

    type Call = Box<dyn FnOnce(&HostApi) -> Result<Value, AgentApiError> + Send>;

    #[test]
    fn model_tool_and_knowledge_helpers_build_the_documented_params() {
        let (tx, rx) = mpsc::channel();
        let router = Arc::new(ApiRouter::new(Arc::new(
            Output::new(Box::new(Lines(tx))).unwrap(),
        )));
        let api = HostApi::new("run-1".into(), router.clone(), CancelToken::new(), None);
        let messages = [json!({"role": "user", "content": "hi"})];
        let parameters = json!({"q": 1}).as_object().cloned().unwrap();
        let extra = json!({"temperature": 0}).as_object().cloned().unwrap();
        let cases: Vec<(Call, &str, Value)> = vec![
            (
                Box::new(move |api| api.invoke_llm("m1", &messages, &[], None)),
                "invoke_llm",
                json!({"llm_model_uuid": "m1", "messages": [{"role": "user", "content": "hi"}]}),
            ),
            (
                Box::new(move |api| {
                    api.invoke_llm_stream("m1", &[], &[json!({"name": "f"})], Some(&extra), |_| {})
                }),
                "invoke_llm_stream",
                json!({"llm_model_uuid": "m1", "messages": [], "funcs": [{"name": "f"}],
                       "extra_args": {"temperature": 0}}),
            ),
            (
                Box::new(|api| api.invoke_rerank("r1", "q", &[json!("d")], Some(2))),
                "invoke_rerank",
                json!({"rerank_model_uuid": "r1", "query": "q", "documents": ["d"], "top_k": 2}),
            ),
            (
                Box::new(|api| api.get_tool_detail("t")),
                "get_tool_detail",
                json!({"tool_name": "t"}),
            ),
            (
                Box::new(move |api| api.call_tool("t", &parameters, Some("c1"))),
                "call_tool",
                json!({"tool_name": "t", "parameters": {"q": 1}, "call_id": "c1"}),
            ),
            (
                Box::new(|api| api.retrieve_knowledge("kb", "leave", None)),
                "retrieve_knowledge",
                json!({"kb_id": "kb", "query_text": "leave"}),
            ),
        ];
        for (helper, action, params) in cases {
            let caller = api.clone();
            let call = std::thread::spawn(move || helper(&caller));
            let line = rx
                .recv_timeout(std::time::Duration::from_secs(10))
                .expect("the helper wrote its call");
            let sent: Value = serde_json::from_slice(&line).unwrap();
            assert_eq!(sent["action"], action);
            assert_eq!(sent["params"], params, "{action}");
            let id = sent["id"].as_str().unwrap().to_owned();
            router.route_result(ApiResult::success(id, json!({"done": action})));
            assert_eq!(call.join().unwrap().unwrap(), json!({"done": action}));
        }
    }

    #[test]
    fn storage_helpers_send_the_canonical_action_names() {
        let (tx, rx) = mpsc::channel();
        let router = Arc::new(ApiRouter::new(Arc::new(
            Output::new(Box::new(Lines(tx))).unwrap(),
        )));
        let api = HostApi::new("run-1".into(), router.clone(), CancelToken::new(), None);
        let cases: [(Helper, &str, Value); 4] = [
            (
                |api| api.storage_get(StorageOwner::Plugin, "k"),
                "storage_get",
                json!({"owner_type": "plugin", "key": "k"}),
            ),
            (
                |api| api.storage_set(StorageOwner::Workspace, "k", b"hi"),
                "storage_set",
                json!({"owner_type": "workspace", "key": "k", "value_base64": "aGk="}),
            ),
            (
                |api| api.storage_delete(StorageOwner::Plugin, "k"),
                "storage_delete",
                json!({"owner_type": "plugin", "key": "k"}),
            ),
            (
                |api| api.storage_keys(StorageOwner::Workspace),
                "storage_keys",
                json!({"owner_type": "workspace"}),
            ),
        ];
        for (helper, action, params) in cases {
            let caller = api.clone();
            let call = std::thread::spawn(move || helper(&caller));
            let line = rx
                .recv_timeout(std::time::Duration::from_secs(10))
                .expect("the helper wrote its call");
            let sent: Value = serde_json::from_slice(&line).unwrap();
            assert_eq!(sent["op"], "api");
            assert_eq!(sent["run_id"], "run-1");
            assert_eq!(sent["action"], action);
            assert_eq!(sent["params"], params, "{action}");
            let id = sent["id"].as_str().unwrap().to_owned();
            router.route_result(ApiResult::success(id, json!({"done": action})));
            assert_eq!(call.join().unwrap().unwrap(), json!({"done": action}));
        }
    }
}
