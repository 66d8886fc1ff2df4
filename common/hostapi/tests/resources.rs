//! Model, tool and knowledge actions against real HTTP: a local OpenAI-compatible server
//! and a local HTTP tool server (axum, started per test), the registry on in-memory SQLite
//! and the memory session store. The API key and the tool header come from `PATH`, an
//! environment variable every test process has (setting variables needs `unsafe`), so the
//! tests can check that its value reaches the providers and never an answer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use sb_common::session::SessionStore;
use sb_common::session::memory::MemorySessionStore;
use sb_host_api::actions::{ActionDispatcher, ActionLimits};
use sb_host_api::api::{ApiStream, CallerIdentity};
use sb_host_api::api_gate::{Dispatcher, GatedCall};
use sb_host_api::providers::ProviderOptions;
use sb_protocol::error::AgentApiError;
use sb_protocol::host::AuthorizationSnapshot;
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::manifest::RunnerId;
use sb_protocol::wire::HostToRunner;
use sb_store::{ModelKind, NewKbDocument, NewModel, NewTool, SqlStore, SqlStoreOptions, Stores};
use serde_json::{Value, json};
use tokio::sync::mpsc;

const RUNNER: &str = "plugin:acme/agent/default";
const SECRET_ENV: &str = "PATH";

/// Provider options for the fake provider on loopback: `egress.allow` covers loopback and
/// `secrets.allow` names [`SECRET_ENV`], as an operator running a local model server would
/// configure.
fn local() -> ProviderOptions {
    local_policies(ProviderOptions::default())
}

/// `options` with the egress and secret policies of [`local`].
fn local_policies(options: ProviderOptions) -> ProviderOptions {
    ProviderOptions {
        egress: sb_common::egress::EgressPolicy::from_config(&sb_common::config::EgressConfig {
            allow: vec!["127.0.0.0/8".into()],
        }),
        secrets: sb_common::secrets::SecretPolicy::from_config(&sb_common::config::SecretsConfig {
            allow: vec![SECRET_ENV.into(), "SB_TEST_SURELY_UNSET_VARIABLE".into()],
        }),
        ..options
    }
}

fn secret() -> String {
    std::env::var(SECRET_ENV).expect("PATH is set")
}

#[derive(Default)]
struct Seen {
    flaky: AtomicU32,
    broken: AtomicU32,
    tool_runs: AtomicU32,
    bad_auth: AtomicU32,
}

fn check_auth(seen: &Seen, headers: &HeaderMap, name: &str, expected: &str) {
    if headers.get(name).and_then(|v| v.to_str().ok()) != Some(expected) {
        seen.bad_auth.fetch_add(1, Ordering::SeqCst);
    }
}

fn sse(events: &[&str]) -> Response {
    let body: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    ([("content-type", "text/event-stream")], body).into_response()
}

/// The `hello` stream of [`chat`] as a provider may frame it: CRLF and CR-only line ends, one
/// JSON chunk spread over two `data:` lines, comments, `id` and `retry` lines — sent in 7-byte
/// pieces, so line ends (a CRLF pair included) and UTF-8 sequences are split across reads.
fn framed_sse(usage: &Value) -> Response {
    let body = format!(
        ": connected\r\n\r\n\
         retry: 1000\r\nid: 1\r\ndata: {{\"choices\":[{{\"delta\":\r\n\
         data: {{\"role\":\"assistant\",\"content\":\"hél\"}}}}]}}\r\n\r\n\
         data: {{\"choices\":[{{\"delta\":{{\"content\":\"lo\"}}}}]}}\r\r\
         : keep-alive\n\n\
         data: {{\"choices\":[],\"usage\":{usage}}}\n\n\
         data: [DONE]\r\r"
    );
    let pieces: Vec<Result<bytes::Bytes, std::convert::Infallible>> = body
        .into_bytes()
        .chunks(7)
        .map(|piece| Ok(bytes::Bytes::copy_from_slice(piece)))
        .collect();
    (
        [("content-type", "text/event-stream")],
        axum::body::Body::from_stream(futures::stream::iter(pieces)),
    )
        .into_response()
}

async fn chat(State(seen): State<Arc<Seen>>, headers: HeaderMap, body: String) -> Response {
    check_auth(
        &seen,
        &headers,
        "authorization",
        &format!("Bearer {}", secret()),
    );
    let req: Value = serde_json::from_str(&body).unwrap();
    let model = req["model"].as_str().unwrap_or_default().to_owned();
    let stream = req["stream"] == json!(true);
    let usage = json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5});
    match (model.as_str(), stream) {
        ("broken", _) => {
            seen.broken.fetch_add(1, Ordering::SeqCst);
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
        ("slow", _) => {
            tokio::time::sleep(Duration::from_secs(3)).await;
            StatusCode::OK.into_response()
        }
        // Accepts the request and never sends the response headers.
        ("hang", _) => std::future::pending().await,
        ("flaky", _) if seen.flaky.fetch_add(1, Ordering::SeqCst) == 0 => {
            (StatusCode::TOO_MANY_REQUESTS, "slow down").into_response()
        }
        ("tools", false) => axum::Json(json!({
            "choices": [{"message": {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}}
            ]}}],
            "usage": usage,
        }))
        .into_response(),
        ("badsse", true) => sse(&[r#"{"choices":[{"delta":{"content":"ok"}}]}"#, "{not json"]),
        ("framed", true) => framed_sse(&usage),
        ("tools", true) => sse(&[
            r#"{"choices":[{"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"call_9","function":{"name":"weather","arguments":""}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"Oslo\"}"}}]}}]}"#,
            "[DONE]",
        ]),
        (_, true) => sse(&[
            r#"{"choices":[{"delta":{"role":"assistant"}}]}"#,
            r#"{"choices":[{"delta":{"content":"hel"}}]}"#,
            r#"{"choices":[{"delta":{"content":"lo"}}]}"#,
            &format!(r#"{{"choices":[],"usage":{usage}}}"#),
            "[DONE]",
        ]),
        (_, false) => {
            // extra_args arrive merged: model's, overridden by the call's
            let content = format!("hello t={}", req["temperature"]);
            axum::Json(json!({
                "choices": [{"message": {"role": "assistant", "content": content}}],
                "usage": usage,
            }))
            .into_response()
        }
    }
}

async fn rerank(body: String) -> Response {
    let req: Value = serde_json::from_str(&body).unwrap();
    let n = req["documents"].as_array().map_or(0, Vec::len);
    let results: Vec<Value> = (0..n)
        .map(|i| {
            let score = [0.1, 0.9, 0.5, 0.3][i % 4];
            json!({"index": i, "relevance_score": score})
        })
        .collect();
    axum::Json(json!({"results": results})).into_response()
}

async fn tool(State(seen): State<Arc<Seen>>, headers: HeaderMap, body: String) -> Response {
    check_auth(&seen, &headers, "x-api-key", &secret());
    let n = seen.tool_runs.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let params: Value = serde_json::from_str(&body).unwrap();
    axum::Json(json!({"echo": params, "execution": n})).into_response()
}

async fn big_tool() -> Response {
    "x".repeat(500).into_response()
}

async fn failing_tool() -> Response {
    StatusCode::INTERNAL_SERVER_ERROR.into_response()
}

async fn serve(seen: Arc<Seen>) -> String {
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/rerank", post(rerank))
        .route("/tool", post(tool))
        .route("/big", post(big_tool))
        .route("/fail", post(failing_tool))
        .with_state(seen);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

struct Fx {
    dispatcher: ActionDispatcher,
    stores: Stores,
    caller: CallerIdentity,
    seen: Arc<Seen>,
    base: String,
}

struct Ids {
    models: Vec<(String, String)>,
    kb: String,
    other_kb: String,
}

fn ws() -> WorkspaceId {
    WorkspaceId::new("default").unwrap()
}

async fn fixture() -> (Fx, Ids) {
    let sql = SqlStore::connect(
        "sqlite::memory:",
        &SqlStoreOptions {
            migrate: true,
            ..SqlStoreOptions::default()
        },
    )
    .await
    .unwrap();
    let stores = Stores::from_sql(sql);
    let sessions = Arc::new(MemorySessionStore::new());
    let dispatcher = ActionDispatcher::new(
        stores.clone(),
        sessions,
        ActionLimits {
            rate_limit: None,
            ..ActionLimits::default()
        },
    )
    .with_provider_options(ProviderOptions {
        model_timeout: Duration::from_millis(500),
        stream_idle_timeout: Duration::from_millis(500),
        max_attempts: 3,
        backoff_base: Duration::from_millis(10),
        ..local()
    });
    let seen = Arc::new(Seen::default());
    let base = serve(seen.clone()).await;
    let r = &stores.resources;
    let mut models = Vec::new();
    for (name, kind) in [
        ("plain", ModelKind::Llm),
        ("tools", ModelKind::Llm),
        ("flaky", ModelKind::Llm),
        ("broken", ModelKind::Llm),
        ("slow", ModelKind::Llm),
        ("hang", ModelKind::Llm),
        ("badsse", ModelKind::Llm),
        ("framed", ModelKind::Llm),
        ("rr", ModelKind::Rerank),
    ] {
        let m = r
            .create_model(NewModel {
                workspace_id: ws(),
                name: name.into(),
                kind,
                base_url: format!("{base}/v1"),
                model_name: name.into(),
                api_key_env: Some(SECRET_ENV.into()),
                context_window: Some(8192),
                extra_args: Some(json!({"temperature": 0.5})),
            })
            .await
            .unwrap();
        models.push((name.to_owned(), m.model_id.to_string()));
    }
    for (name, path, headers) in [
        ("echo", "/tool", json!({"X-Api-Key": SECRET_ENV})),
        ("big", "/big", json!({})),
        ("fail", "/fail", json!({})),
        (
            "unset",
            "/tool",
            json!({"X-Api-Key": "SB_TEST_SURELY_UNSET_VARIABLE"}),
        ),
    ] {
        r.create_tool(NewTool {
            workspace_id: ws(),
            name: name.into(),
            kind: "http".into(),
            description: format!("{name} tool"),
            parameters: json!({"type": "object"}),
            config: json!({"url": format!("{base}{path}"), "timeout_ms": 2000,
                           "max_response_bytes": 1_000_000, "headers_env": headers}),
        })
        .await
        .unwrap();
    }
    let kb = r.create_kb(&ws(), "handbook", None).await.unwrap();
    let other = r.create_kb(&ws(), "other", None).await.unwrap();
    for (kb_id, title, text) in [
        (
            kb.kb_id,
            "leave",
            "Annual leave: every employee gets 25 days of annual leave.",
        ),
        (
            kb.kb_id,
            "travel",
            "Travel expenses are refunded. Leave the receipts with finance.",
        ),
        (kb.kb_id, "food", "The canteen opens at noon."),
        (other.kb_id, "x", "annual leave annual leave"),
    ] {
        r.add_document(NewKbDocument {
            workspace_id: ws(),
            kb_id,
            title: title.into(),
            text: text.into(),
            artifact_id: None,
            metadata: json!({}),
        })
        .await
        .unwrap();
    }
    let runner: RunnerId = RUNNER.parse().unwrap();
    (
        Fx {
            dispatcher,
            stores,
            caller: CallerIdentity::for_runner(&runner),
            seen,
            base,
        },
        Ids {
            models,
            kb: kb.kb_id.to_string(),
            other_kb: other.kb_id.to_string(),
        },
    )
}

impl Ids {
    fn model(&self, name: &str) -> String {
        self.models
            .iter()
            .find(|(n, _)| n == name)
            .unwrap()
            .1
            .clone()
    }

    /// A snapshot granting every model (invoke, stream, rerank), the tools and the first
    /// knowledge base, with `budgets`.
    fn snap(&self, budgets: Value) -> AuthorizationSnapshot {
        let runner: RunnerId = RUNNER.parse().unwrap();
        let models: Vec<Value> = self
            .models
            .iter()
            .map(|(_, id)| json!({"model_id": id, "operations": ["invoke", "stream", "rerank"]}))
            .collect();
        let tools: Vec<Value> = ["echo", "big", "fail", "unset", "ghost"]
            .iter()
            .map(|t| json!({"tool_name": t, "operations": ["detail", "call"]}))
            .collect();
        serde_json::from_value(json!({
            "run_id": RunId::new(),
            "plugin_id": runner.plugin_id(),
            "runner_id": RUNNER,
            "binding_id": "b",
            "workspace_id": "default",
            "conversation_id": "c1",
            "resources": {
                "models": models,
                "tools": tools,
                "knowledge_bases": [{"kb_id": self.kb, "operations": ["retrieve"]}],
            },
            "available_apis": {},
            "state_policy": {},
            "budgets": budgets,
        }))
        .unwrap()
    }
}

impl Fx {
    async fn call_with(
        &self,
        snap: &AuthorizationSnapshot,
        action: &str,
        params: Value,
        stream: &ApiStream,
    ) -> Result<Value, AgentApiError> {
        let call = GatedCall {
            caller: &self.caller,
            run_id: snap.run_id,
            action,
            snapshot: snap,
        };
        self.dispatcher.dispatch(call, params, stream).await
    }

    async fn call(
        &self,
        snap: &AuthorizationSnapshot,
        action: &str,
        params: Value,
    ) -> Result<Value, AgentApiError> {
        let (tx, _rx) = mpsc::channel(64);
        self.call_with(snap, action, params, &ApiStream::new("1", tx))
            .await
    }
}

fn code(r: &Result<Value, AgentApiError>) -> &str {
    match r {
        Ok(_) => "ok",
        Err(e) => e.code.as_str(),
    }
}

fn assert_no_secret(v: &impl std::fmt::Debug) {
    let text = format!("{v:?}");
    assert!(!text.contains(&secret()), "secret leaked: {text}");
}

fn messages() -> Value {
    json!([{"role": "user", "content": "hi"}])
}

/// `snap` with a run deadline `left` from now.
fn with_deadline(mut snap: AuthorizationSnapshot, left: Duration) -> AuthorizationSnapshot {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    snap.deadline_at = Some((now + left).as_secs_f64());
    snap
}

/// Runs `call`, failing the test if it has not ended after `limit` (the bug under test is
/// a call that never ends; the test must not hang with it).
async fn ends_within<T>(limit: Duration, call: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(limit, call)
        .await
        .unwrap_or_else(|_| panic!("the call did not end within {limit:?}"))
}

#[tokio::test]
async fn invoke_llm_plain_tools_retries_and_failures() {
    let (f, ids) = fixture().await;
    let s = ids.snap(json!({}));
    let ok = f
        .call(
            &s,
            "invoke_llm",
            json!({"model_id": ids.model("plain"), "messages": messages(), "extra_args": {"temperature": 0.1}}),
        )
        .await
        .unwrap();
    assert_eq!(ok["message"]["role"], "assistant");
    assert_eq!(ok["message"]["content"], "hello t=0.1");
    assert_eq!(ok["usage"]["total_tokens"], 5);
    assert_no_secret(&ok);

    // the seed's parameter name works too; the model's extra_args apply
    let ok = f
        .call(
            &s,
            "invoke_llm",
            json!({"llm_model_uuid": ids.model("plain"), "messages": messages()}),
        )
        .await
        .unwrap();
    assert_eq!(ok["message"]["content"], "hello t=0.5");

    let tools = f
        .call(
            &s,
            "invoke_llm",
            json!({"model_id": ids.model("tools"), "messages": messages(),
                   "funcs": [{"name": "weather", "parameters": {"type": "object"}}]}),
        )
        .await
        .unwrap();
    let call = &tools["message"]["tool_calls"][0];
    assert_eq!(call["id"], "call_1");
    assert_eq!(call["function"]["name"], "weather");
    assert_eq!(call["function"]["arguments"], "{\"city\":\"Oslo\"}");

    // 429 then success: retried
    let flaky = f
        .call(
            &s,
            "invoke_llm",
            json!({"model_id": ids.model("flaky"), "messages": messages()}),
        )
        .await;
    assert_eq!(code(&flaky), "ok", "{flaky:?}");
    assert_eq!(f.seen.flaky.load(Ordering::SeqCst), 2);

    let broken = f
        .call(
            &s,
            "invoke_llm",
            json!({"model_id": ids.model("broken"), "messages": messages()}),
        )
        .await;
    assert_eq!(code(&broken), "unavailable");
    assert!(broken.as_ref().unwrap_err().retryable);
    assert_no_secret(&broken);

    let slow = f
        .call(
            &s,
            "invoke_llm",
            json!({"model_id": ids.model("slow"), "messages": messages()}),
        )
        .await;
    assert_eq!(code(&slow), "deadline_exceeded", "{slow:?}");

    // a granted id the registry does not know; the rerank model is not an llm
    let ghost = RunId::new().to_string();
    let mut s2 = s.clone();
    s2.resources.models.push(
        serde_json::from_value(json!({"model_id": ghost, "operations": ["invoke"]})).unwrap(),
    );
    let missing = f
        .call(
            &s2,
            "invoke_llm",
            json!({"model_id": ghost, "messages": messages()}),
        )
        .await;
    assert_eq!(code(&missing), "not_found");
    let wrong_kind = f
        .call(
            &s,
            "invoke_llm",
            json!({"model_id": ids.model("rr"), "messages": messages()}),
        )
        .await;
    assert_eq!(code(&wrong_kind), "not_found");
    assert_eq!(f.seen.bad_auth.load(Ordering::SeqCst), 0);
}

/// The `[providers]` section decides how often a failing model call is tried: the options
/// a dispatcher is built with come from the loaded configuration, as in the worker and the
/// gateway, and every attempt reaches the provider.
#[tokio::test]
async fn configured_max_attempts_bound_the_provider_calls() {
    let (mut f, ids) = fixture().await;
    let s = ids.snap(json!({}));
    for (max_attempts, expected_total) in [("5", 5), ("1", 6)] {
        let config = sb_common::config::ConfigLoader::new()
            .without_file()
            .env([("SWITCHBOARD__PROVIDERS__MAX_ATTEMPTS", max_attempts)])
            .set("providers.retry_backoff", "1ms")
            .load()
            .unwrap();
        f.dispatcher = f.dispatcher.with_provider_options(ProviderOptions {
            ..local_policies(ProviderOptions::from_config(&config.providers))
        });
        let broken = f
            .call(
                &s,
                "invoke_llm",
                json!({"model_id": ids.model("broken"), "messages": messages()}),
            )
            .await;
        assert_eq!(code(&broken), "unavailable", "{broken:?}");
        assert_eq!(
            f.seen.broken.load(Ordering::SeqCst),
            expected_total,
            "max_attempts = {max_attempts}"
        );
    }
}

/// The provider's stream is read as server-sent events by the book, whatever its framing.
#[tokio::test]
async fn invoke_llm_stream_reads_any_event_stream_framing() {
    let (f, ids) = fixture().await;
    let s = ids.snap(json!({}));
    let (tx, mut rx) = mpsc::channel(64);
    let done = f
        .call_with(
            &s,
            "invoke_llm_stream",
            json!({"model_id": ids.model("framed"), "messages": messages()}),
            &ApiStream::new(1u64, tx),
        )
        .await
        .unwrap();
    assert_eq!(done["message"]["content"], "héllo");
    assert_eq!(done["usage"]["total_tokens"], 5);
    let mut chunks = Vec::new();
    while let Ok(HostToRunner::ApiChunk { data, .. }) = rx.try_recv() {
        chunks.push(data["chunk"]["content"].as_str().unwrap().to_owned());
    }
    assert_eq!(chunks, vec!["hél", "lo"]);
}

#[tokio::test]
async fn invoke_llm_stream_forwards_chunks_and_ends_with_usage() {
    let (f, ids) = fixture().await;
    let s = ids.snap(json!({}));
    let (tx, mut rx) = mpsc::channel(64);
    let stream = ApiStream::new("7", tx);
    let done = f
        .call_with(
            &s,
            "invoke_llm_stream",
            json!({"model_id": ids.model("plain"), "messages": messages()}),
            &stream,
        )
        .await
        .unwrap();
    assert_eq!(done["usage"]["total_tokens"], 5);
    assert_eq!(done["message"]["content"], "hello");
    let mut chunks = Vec::new();
    while let Ok(HostToRunner::ApiChunk { id, data }) = rx.try_recv() {
        assert_eq!(id.as_str(), Some("7"));
        chunks.push(data["chunk"]["content"].as_str().unwrap().to_owned());
    }
    assert_eq!(chunks, vec!["hel", "lo"]);

    let (tx, _rx) = mpsc::channel(64);
    let tools = f
        .call_with(
            &s,
            "invoke_llm_stream",
            json!({"model_id": ids.model("tools"), "messages": messages()}),
            &ApiStream::new("8", tx),
        )
        .await
        .unwrap();
    assert_eq!(tools["message"]["tool_calls"][0]["id"], "call_9");
    assert_eq!(
        tools["message"]["tool_calls"][0]["function"]["arguments"],
        "{\"city\":\"Oslo\"}"
    );

    let bad = f
        .call(
            &s,
            "invoke_llm_stream",
            json!({"model_id": ids.model("badsse"), "messages": messages()}),
        )
        .await;
    assert_eq!(code(&bad), "runtime_error", "{bad:?}");
    let broken = f
        .call(
            &s,
            "invoke_llm_stream",
            json!({"model_id": ids.model("broken"), "messages": messages()}),
        )
        .await;
    assert_eq!(code(&broken), "unavailable");
    assert_eq!(f.seen.bad_auth.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn rerank_sorts_caps_and_cuts() {
    let (f, ids) = fixture().await;
    let s = ids.snap(json!({}));
    let r = f
        .call(
            &s,
            "invoke_rerank",
            json!({"rerank_model_uuid": ids.model("rr"), "query": "q",
                   "documents": ["a", "b", "c", "d"], "top_k": 3}),
        )
        .await
        .unwrap();
    let order: Vec<&str> = r["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["document"].as_str().unwrap())
        .collect();
    assert_eq!(order, vec!["b", "c", "d"]);
    let many: Vec<String> = (0..65).map(|i| format!("d{i}")).collect();
    let too_many = f
        .call(
            &s,
            "invoke_rerank",
            json!({"rerank_model_uuid": ids.model("rr"), "query": "q", "documents": many}),
        )
        .await;
    assert_eq!(code(&too_many), "invalid_argument");
    // an llm id is not a rerank model
    let wrong = f
        .call(
            &s,
            "invoke_rerank",
            json!({"rerank_model_uuid": ids.model("plain"), "query": "q", "documents": ["a"]}),
        )
        .await;
    assert_eq!(code(&wrong), "not_found");
}

/// `limits.rerank_documents_max` is the cap `invoke_rerank` enforces, and its refusal names
/// the configured limit.
#[tokio::test]
async fn configured_rerank_documents_max_caps_rerank_calls() {
    let (f, ids) = fixture().await;
    let s = ids.snap(json!({}));
    let config = sb_common::config::ConfigLoader::new()
        .without_file()
        .env([("SWITCHBOARD__LIMITS__RERANK_DOCUMENTS_MAX", "3")])
        .load()
        .unwrap();
    let dispatcher = ActionDispatcher::new(
        f.stores.clone(),
        Arc::new(MemorySessionStore::new()),
        ActionLimits {
            rate_limit: None,
            ..ActionLimits::from_config(&config.limits)
        },
    )
    .with_provider_options(local());
    let f = Fx { dispatcher, ..f };
    let rerank = |n: usize| {
        let documents: Vec<String> = (0..n).map(|i| format!("d{i}")).collect();
        json!({"rerank_model_uuid": ids.model("rr"), "query": "q", "documents": documents})
    };
    let at_cap = f.call(&s, "invoke_rerank", rerank(3)).await;
    assert_eq!(code(&at_cap), "ok", "{at_cap:?}");
    let over = f.call(&s, "invoke_rerank", rerank(4)).await.unwrap_err();
    assert_eq!(over.code, "invalid_argument");
    assert_eq!(
        over.message,
        "at most 3 documents can be reranked in one call"
    );
    assert_eq!(over.details["limit"], 3);
    assert_eq!(over.details["size"], 4);
}

/// A provider that accepts a stream request and never sends the response headers: the
/// opening is bounded by `model_timeout`, and by the run deadline when that comes first,
/// and fails as a timed-out plain call does.
#[tokio::test]
async fn opening_a_stream_is_bounded_by_the_model_timeout_and_the_deadline() {
    let (f, ids) = fixture().await;
    let p = json!({"model_id": ids.model("hang"), "messages": messages()});
    // model_timeout (500 ms in the fixture) first
    let s = ids.snap(json!({}));
    let started = std::time::Instant::now();
    let hung = ends_within(
        Duration::from_secs(10),
        f.call(&s, "invoke_llm_stream", p.clone()),
    )
    .await;
    assert_eq!(code(&hung), "deadline_exceeded", "{hung:?}");
    assert!(started.elapsed() >= Duration::from_millis(500));
    let plain = f.call(&s, "invoke_llm", p.clone()).await;
    assert_eq!(code(&plain), code(&hung), "the same code as a plain call");

    // the run deadline first
    let f = Fx {
        dispatcher: f.dispatcher.with_provider_options(ProviderOptions {
            model_timeout: Duration::from_secs(60),
            ..local()
        }),
        ..f
    };
    let s = with_deadline(ids.snap(json!({})), Duration::from_millis(300));
    let started = std::time::Instant::now();
    let hung = ends_within(Duration::from_secs(10), f.call(&s, "invoke_llm_stream", p)).await;
    assert_eq!(code(&hung), "deadline_exceeded", "{hung:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// A retry whose backoff would end after the run deadline is not attempted: the call ends
/// at once as out of run time, naming the last failure, instead of sleeping past the run.
#[tokio::test]
async fn retries_stop_at_the_run_deadline() {
    let (f, ids) = fixture().await;
    let f = Fx {
        dispatcher: f.dispatcher.with_provider_options(ProviderOptions {
            max_attempts: 10,
            backoff_base: Duration::from_secs(1),
            ..local()
        }),
        ..f
    };
    let p = json!({"model_id": ids.model("broken"), "messages": messages()});
    for action in ["invoke_llm", "invoke_llm_stream"] {
        let before = f.seen.broken.load(Ordering::SeqCst);
        let s = with_deadline(ids.snap(json!({})), Duration::from_millis(500));
        let started = std::time::Instant::now();
        let out = ends_within(Duration::from_secs(10), f.call(&s, action, p.clone()))
            .await
            .unwrap_err();
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{action} waited {:?}",
            started.elapsed()
        );
        assert_eq!(out.code, "deadline_exceeded", "{action}: {out:?}");
        assert!(!out.retryable);
        assert!(out.message.contains("answered http 500"), "{}", out.message);
        assert_eq!(f.seen.broken.load(Ordering::SeqCst), before + 1, "{action}");
    }
    // without a deadline the configured attempts are all made
    let f = Fx {
        dispatcher: f.dispatcher.with_provider_options(ProviderOptions {
            max_attempts: 3,
            backoff_base: Duration::from_millis(1),
            ..local()
        }),
        ..f
    };
    let before = f.seen.broken.load(Ordering::SeqCst);
    let out = f.call(&ids.snap(json!({})), "invoke_llm", p).await;
    assert_eq!(code(&out), "unavailable");
    assert_eq!(f.seen.broken.load(Ordering::SeqCst), before + 3);
}

/// A provider whose host drops connection attempts (a listener whose accept queue is
/// full) fails after the client's connect timeout as unreachable, and is retried, instead
/// of holding each attempt until the model timeout.
#[tokio::test]
async fn connecting_to_a_provider_is_bounded() {
    let (f, ids) = fixture().await;
    // Backlog 0 admits one queued connection (never accepted); the kernel then drops
    // further SYNs, so the provider's connects hang.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    let _queued = std::net::TcpStream::connect(addr).unwrap();
    let model = f
        .stores
        .resources
        .create_model(NewModel {
            workspace_id: ws(),
            name: "unreachable".into(),
            kind: ModelKind::Llm,
            base_url: format!("http://{addr}/v1"),
            model_name: "unreachable".into(),
            api_key_env: None,
            context_window: None,
            extra_args: None,
        })
        .await
        .unwrap();
    let id = model.model_id.to_string();
    let mut s = ids.snap(json!({}));
    s.resources
        .models
        .push(serde_json::from_value(json!({"model_id": id, "operations": ["invoke"]})).unwrap());
    let f = Fx {
        dispatcher: f.dispatcher.with_provider_options(ProviderOptions {
            model_timeout: Duration::from_secs(30),
            max_attempts: 2,
            backoff_base: Duration::from_millis(1),
            connect_timeout: Duration::from_millis(200),
            ..local()
        }),
        ..f
    };
    let started = std::time::Instant::now();
    let out = ends_within(
        Duration::from_secs(10),
        f.call(
            &s,
            "invoke_llm",
            json!({"model_id": id, "messages": messages()}),
        ),
    )
    .await;
    assert_eq!(code(&out), "unavailable", "{out:?}");
    // two attempts of 200 ms each
    assert!(started.elapsed() >= Duration::from_millis(400));
    drop(listener);
}

#[tokio::test]
async fn model_budgets_refuse_and_stay_exhausted() {
    let (f, ids) = fixture().await;
    let s = ids.snap(json!({"max_model_calls": 2}));
    let p = json!({"model_id": ids.model("plain"), "messages": messages()});
    let rerank = json!({"model_id": ids.model("rr"), "query": "q", "documents": ["a"]});
    assert_eq!(code(&f.call(&s, "invoke_llm", p.clone()).await), "ok");
    assert_eq!(code(&f.call(&s, "invoke_llm", p.clone()).await), "ok");
    let third = f.call(&s, "invoke_llm", p.clone()).await;
    assert_eq!(code(&third), "budget_exceeded");
    assert_eq!(third.unwrap_err().details["budget"], "model_calls");
    assert_eq!(
        code(&f.call(&s, "invoke_rerank", rerank.clone()).await),
        "budget_exceeded"
    );

    // output: "hello t=0.5" is 11 characters; a 15-character budget takes one answer, then
    // refuses the second whole (never a truncated answer) and stays exhausted.
    let s = ids.snap(json!({"max_model_output_chars": 15}));
    assert_eq!(code(&f.call(&s, "invoke_llm", p.clone()).await), "ok");
    let over = f.call(&s, "invoke_llm", p.clone()).await;
    assert_eq!(code(&over), "budget_exceeded");
    let (tx, mut rx) = mpsc::channel(64);
    let streamed = f
        .call_with(
            &s,
            "invoke_llm_stream",
            json!({"model_id": ids.model("plain"), "messages": messages()}),
            &ApiStream::new("s", tx),
        )
        .await;
    assert_eq!(code(&streamed), "budget_exceeded");
    assert_eq!(
        streamed.unwrap_err().details["budget"],
        "model_output_chars"
    );
    assert!(rx.try_recv().is_err(), "no chunk past an exhausted budget");

    // Past an exhausted output budget the provider is not called at all, so no model call
    // is spent on it: with 3 model calls, two were used above and the third is still free.
    let s = ids.snap(json!({"max_model_output_chars": 15, "max_model_calls": 3}));
    assert_eq!(code(&f.call(&s, "invoke_llm", p.clone()).await), "ok");
    assert_eq!(
        code(&f.call(&s, "invoke_llm", p.clone()).await),
        "budget_exceeded"
    );
    for _ in 0..3 {
        let refused = f.call(&s, "invoke_llm", p.clone()).await;
        assert_eq!(refused.unwrap_err().details["budget"], "model_output_chars");
    }
    assert_eq!(
        code(&f.call(&s, "invoke_rerank", rerank.clone()).await),
        "ok"
    );
    // A zero output budget refuses every model answer up front.
    let s = ids.snap(json!({"max_model_output_chars": 0, "max_model_calls": 1}));
    let refused = f.call(&s, "invoke_llm", p.clone()).await;
    assert_eq!(refused.unwrap_err().details["budget"], "model_output_chars");
    assert_eq!(code(&f.call(&s, "invoke_rerank", rerank).await), "ok");
}

#[tokio::test]
async fn tools_detail_call_budgets_and_failures() {
    let (f, ids) = fixture().await;
    let s = ids.snap(json!({"max_tool_calls": 3, "max_tool_result_chars": 100}));
    let d = f
        .call(&s, "get_tool_detail", json!({"tool_name": "echo"}))
        .await
        .unwrap();
    assert_eq!(d["tool"]["name"], "echo");
    assert_eq!(d["tool"]["parameters"]["type"], "object");
    let r = f
        .call(
            &s,
            "call_tool",
            json!({"tool_name": "echo", "parameters": {"city": "Oslo"}}),
        )
        .await
        .unwrap();
    assert_eq!(r["result"]["echo"]["city"], "Oslo");
    assert_no_secret(&r);
    assert_eq!(f.seen.bad_auth.load(Ordering::SeqCst), 0);

    let big = f
        .call(
            &s,
            "call_tool",
            json!({"tool_name": "big", "parameters": {}}),
        )
        .await;
    assert_eq!(code(&big), "budget_exceeded", "{big:?}");
    assert_eq!(big.unwrap_err().details["budget"], "tool_result_chars");
    let fail = f
        .call(
            &s,
            "call_tool",
            json!({"tool_name": "fail", "parameters": {}}),
        )
        .await;
    assert_eq!(code(&fail), "unavailable");
    // 3 tool calls charged: the budget is exhausted for good
    let more = f
        .call(
            &s,
            "call_tool",
            json!({"tool_name": "echo", "parameters": {}}),
        )
        .await;
    assert_eq!(code(&more), "budget_exceeded");

    let s = ids.snap(json!({}));
    let unset = f
        .call(
            &s,
            "call_tool",
            json!({"tool_name": "unset", "parameters": {}}),
        )
        .await;
    assert_eq!(code(&unset), "unavailable");
    assert!(
        unset
            .unwrap_err()
            .message
            .contains("SB_TEST_SURELY_UNSET_VARIABLE"),
        "the variable name (not a secret) tells the operator what to set"
    );
    let ghost = f
        .call(
            &s,
            "call_tool",
            json!({"tool_name": "ghost", "parameters": {}}),
        )
        .await;
    assert_eq!(code(&ghost), "not_found");
    let _ = &f.base;
}

/// `limits.tool_response_bytes_max` and `limits.tool_timeout_max` bound every tool call,
/// including a tool registered with a larger cap and timeout (before the ceilings were
/// lowered): the oversized answer fails as one over the tool's own cap does, and the slow
/// one as a timed-out call does.
#[tokio::test]
async fn configured_tool_ceilings_bound_tools_registered_above_them() {
    let (f, ids) = fixture().await;
    let s = ids.snap(json!({}));
    let big = json!({"tool_name": "big", "parameters": {}});
    let slow = json!({"tool_name": "echo", "parameters": {}});
    // Registered with a 1,000,000-byte cap and a 2 s timeout: both answer as registered.
    assert_eq!(code(&f.call(&s, "call_tool", big.clone()).await), "ok");
    assert_eq!(code(&f.call(&s, "call_tool", slow.clone()).await), "ok");

    let config = sb_common::config::ConfigLoader::new()
        .without_file()
        .env([
            ("SWITCHBOARD__LIMITS__TOOL_RESPONSE_BYTES_MAX", "100"),
            ("SWITCHBOARD__LIMITS__TOOL_TIMEOUT_MAX", "50ms"),
        ])
        .load()
        .unwrap();
    let dispatcher = ActionDispatcher::new(
        f.stores.clone(),
        Arc::new(MemorySessionStore::new()),
        ActionLimits {
            rate_limit: None,
            ..ActionLimits::from_config(&config.limits)
        },
    )
    .with_provider_options(local());
    let f = Fx { dispatcher, ..f };
    let too_big = f.call(&s, "call_tool", big).await.unwrap_err();
    assert_eq!(too_big.code, "payload_too_large", "{too_big:?}");
    assert_eq!(
        too_big.message,
        "tool big response is larger than 100 bytes"
    );
    // The tool answers after 150 ms; the 50 ms ceiling ends the call long before its 2 s.
    let timed_out = ends_within(Duration::from_secs(1), f.call(&s, "call_tool", slow))
        .await
        .unwrap_err();
    assert_eq!(timed_out.code, "deadline_exceeded", "{timed_out:?}");
}

#[tokio::test]
async fn idempotent_tool_calls_execute_once() {
    let (f, ids) = fixture().await;
    let s = ids.snap(json!({}));
    let p = json!({"tool_name": "echo", "parameters": {"a": 1, "b": [1, 2]}, "call_id": "c-1"});
    let calls = (0..5).map(|_| f.call(&s, "call_tool", p.clone()));
    let results = futures::future::join_all(calls).await;
    for r in &results {
        assert_eq!(code(r), "ok", "{r:?}");
        assert_eq!(r.as_ref().unwrap()["result"]["execution"], 1);
    }
    assert_eq!(f.seen.tool_runs.load(Ordering::SeqCst), 1);
    // later, with the keys in another order: replayed
    let again = f
        .call(
            &s,
            "call_tool",
            json!({"call_id": "c-1", "parameters": {"b": [1, 2], "a": 1}, "tool_name": "echo"}),
        )
        .await
        .unwrap();
    assert_eq!(again["result"]["execution"], 1);
    assert_eq!(f.seen.tool_runs.load(Ordering::SeqCst), 1);
    // same id, other parameters
    let conflict = f
        .call(
            &s,
            "call_tool",
            json!({"tool_name": "echo", "parameters": {"a": 2}, "call_id": "c-1"}),
        )
        .await;
    assert_eq!(code(&conflict), "conflict");
    // another run may use the same call id
    let other_run = ids.snap(json!({}));
    let r = f.call(&other_run, "call_tool", p.clone()).await.unwrap();
    assert_eq!(r["result"]["execution"], 2);
}

#[tokio::test]
async fn lost_tool_outcome_is_unknown_and_never_reexecuted() {
    let (f, ids) = fixture().await;
    let s = ids.snap(json!({}));
    let _ = &f.stores;
    // A claim left behind by an executor that died long ago (no outcome recorded).
    let sessions = Arc::new(MemorySessionStore::new());
    let dispatcher = ActionDispatcher::new(
        f.stores.clone(),
        sessions.clone(),
        ActionLimits {
            rate_limit: None,
            ..ActionLimits::default()
        },
    )
    .with_provider_options(local());
    let hash = {
        // the same normalization the host uses is internal; a stale claim with any hash
        // of this tool+parameters is produced by claiming once through the dispatcher and
        // overwriting its timestamp
        let call = GatedCall {
            caller: &f.caller,
            run_id: s.run_id,
            action: "call_tool",
            snapshot: &s,
        };
        let (tx, _rx) = mpsc::channel(8);
        let p = json!({"tool_name": "echo", "parameters": {"q": 1}, "call_id": "lost"});
        dispatcher
            .dispatch(call, p, &ApiStream::new("1", tx))
            .await
            .unwrap();
        let key = format!("tool_call:{}:lost", s.run_id);
        let stored: Value =
            serde_json::from_slice(&sessions.get(&key).await.unwrap().unwrap()).unwrap();
        let stale = json!({"hash": stored["hash"], "claimed_at_ms": 1});
        sessions
            .set_ex(&key, stale.to_string().as_bytes(), Duration::from_secs(60))
            .await
            .unwrap();
        stored["hash"].clone()
    };
    assert!(hash.is_string());
    let runs_before = f.seen.tool_runs.load(Ordering::SeqCst);
    let call = GatedCall {
        caller: &f.caller,
        run_id: s.run_id,
        action: "call_tool",
        snapshot: &s,
    };
    let (tx, _rx) = mpsc::channel(8);
    let r = dispatcher
        .dispatch(
            call,
            json!({"tool_name": "echo", "parameters": {"q": 1}, "call_id": "lost"}),
            &ApiStream::new("1", tx),
        )
        .await;
    assert_eq!(code(&r), "tool_outcome_unknown");
    assert_eq!(f.seen.tool_runs.load(Ordering::SeqCst), runs_before);
}

#[tokio::test]
async fn knowledge_retrieval_ranks_and_respects_grants() {
    let (f, ids) = fixture().await;
    let s = ids.snap(json!({}));
    let r = f
        .call(
            &s,
            "retrieve_knowledge",
            json!({"kb_id": ids.kb, "query_text": "annual leave"}),
        )
        .await
        .unwrap();
    let results = r["results"].as_array().unwrap();
    // Any word matches: the chunk with both words first, then the one with "Leave" only.
    assert_eq!(results.len(), 2, "{r}");
    assert_eq!(results[0]["title"], "leave");
    assert_eq!(results[1]["title"], "travel");
    assert_eq!(results[0]["score"].as_f64().unwrap().floor(), 2.0, "{r}");
    assert_eq!(results[1]["score"].as_f64().unwrap().floor(), 1.0, "{r}");
    assert!(results[0]["document_id"].is_string());
    // Stemmed: a plural finds the singular.
    let r = f
        .call(
            &s,
            "retrieve_knowledge",
            json!({"kb_id": ids.kb, "query_text": "How many leaves does an employee get?"}),
        )
        .await
        .unwrap();
    assert_eq!(r["results"][0]["title"], "leave", "{r}");

    let r = f
        .call(
            &s,
            "retrieve_knowledge",
            json!({"kb_id": ids.kb, "query_text": "leave", "top_k": 1}),
        )
        .await
        .unwrap();
    let results = r["results"].as_array().unwrap();
    assert_eq!(results.len(), 1);
    assert_eq!(results[0]["title"], "leave", "the denser match ranks first");

    // a knowledge base of the workspace that this run was not granted
    let e = f
        .call(
            &s,
            "retrieve_knowledge",
            json!({"kb_id": ids.other_kb, "query_text": "leave"}),
        )
        .await;
    assert_eq!(code(&e), "unauthorized");
    let e = f
        .call(
            &s,
            "retrieve_knowledge",
            json!({"kb_id": ids.kb, "query_text": "leave", "filters": {"author": "x"}}),
        )
        .await;
    assert_eq!(code(&e), "invalid_argument");
    let e = f
        .call(
            &s,
            "retrieve_knowledge",
            json!({"kb_id": ids.kb, "query_text": "leave", "top_k": 0}),
        )
        .await;
    assert_eq!(code(&e), "invalid_argument");
}

/// Log output written into memory, to check what the host logs.
#[derive(Clone, Default)]
struct LogBuf(Arc<std::sync::Mutex<Vec<u8>>>);

thread_local! {
    /// The capture of the test running on this thread, and the least severe level it keeps.
    static CAPTURE: std::cell::RefCell<Option<(LogBuf, tracing::Level)>> =
        const { std::cell::RefCell::new(None) };
}

/// Ends this thread's capture when dropped.
struct CaptureGuard;

impl Drop for CaptureGuard {
    fn drop(&mut self) {
        CAPTURE.with(|c| c.borrow_mut().take());
    }
}

impl LogBuf {
    /// Captures what this thread logs at `level` and above until the guard is dropped (a
    /// `#[tokio::test]` runs on one thread, so that is everything the test logs).
    ///
    /// One global subscriber (debug and above, every crate) routes each event to the
    /// capture of the thread that emits it. A subscriber per test (`set_default`) would
    /// race: tests running in parallel on other threads register the same callsites, and
    /// tracing's cached interest of a callsite can end up computed without this thread's
    /// subscriber, silently dropping its events.
    fn capture(level: tracing::Level) -> (Self, CaptureGuard) {
        static GLOBAL: std::sync::Once = std::sync::Once::new();
        GLOBAL.call_once(|| {
            let subscriber = tracing_subscriber::fmt()
                .with_writer(CaptureRouter)
                .with_max_level(tracing::Level::DEBUG)
                .with_ansi(false)
                .finish();
            tracing::subscriber::set_global_default(subscriber)
                .expect("no other global subscriber in this test binary");
        });
        let logs = Self::default();
        CAPTURE.with(|c| *c.borrow_mut() = Some((logs.clone(), level)));
        (logs, CaptureGuard)
    }

    /// Everything logged so far.
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

impl std::io::Write for LogBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The global subscriber's writer: the emitting thread's capture, if it keeps the event's
/// level, else nowhere.
struct CaptureRouter;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for CaptureRouter {
    type Writer = Box<dyn std::io::Write>;

    fn make_writer(&'a self) -> Self::Writer {
        Box::new(std::io::sink())
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        CAPTURE.with(|c| match &*c.borrow() {
            Some((logs, level)) if meta.level() <= level => {
                Box::new(logs.clone()) as Box<dyn std::io::Write>
            }
            _ => Box::new(std::io::sink()),
        })
    }
}

/// Every model and tool call is logged (with its run, duration and outcome), and neither
/// the logs (down to debug, every crate) nor the answers contain the API key or the tool
/// header value.
#[tokio::test]
async fn calls_are_logged_without_secrets() {
    let (logs, _guard) = LogBuf::capture(tracing::Level::DEBUG);
    let (f, ids) = fixture().await;
    let s = ids.snap(json!({}));
    let mut answers = Vec::new();
    for (action, params) in [
        (
            "invoke_llm",
            json!({"model_id": ids.model("plain"), "messages": messages()}),
        ),
        (
            "invoke_llm",
            json!({"model_id": ids.model("broken"), "messages": messages()}),
        ),
        (
            "invoke_llm_stream",
            json!({"model_id": ids.model("plain"), "messages": messages()}),
        ),
        (
            "call_tool",
            json!({"tool_name": "echo", "parameters": {"a": 1}}),
        ),
        ("call_tool", json!({"tool_name": "fail", "parameters": {}})),
    ] {
        answers.push(f.call(&s, action, params).await);
    }
    assert_eq!(
        answers.iter().map(code).collect::<Vec<_>>(),
        vec!["ok", "unavailable", "ok", "ok", "unavailable"]
    );
    assert_no_secret(&answers);
    let text = logs.text();
    assert!(text.contains("model called"), "{text}");
    assert!(text.contains("model call failed"), "{text}");
    assert!(text.contains("tool called"), "{text}");
    assert!(text.contains(&s.run_id.to_string()), "{text}");
    assert!(!text.contains(&secret()), "a secret was logged");
    assert_eq!(f.seen.bad_auth.load(Ordering::SeqCst), 0);
}

/// A model answer refused for the output budget still logs the usage the provider reported
/// (the work was done, and billed), and a tool call logs the size of its result.
#[tokio::test]
async fn refused_answers_still_log_their_usage() {
    let (logs, _guard) = LogBuf::capture(tracing::Level::INFO);
    let (f, ids) = fixture().await;
    let s = ids.snap(json!({"max_model_output_chars": 1, "max_tool_result_chars": 1}));
    let model = f
        .call(
            &s,
            "invoke_llm",
            json!({"model_id": ids.model("plain"), "messages": messages()}),
        )
        .await;
    assert_eq!(code(&model), "budget_exceeded");
    let tool = f
        .call(
            &s,
            "call_tool",
            json!({"tool_name": "echo", "parameters": {"a": 1}}),
        )
        .await;
    assert_eq!(code(&tool), "budget_exceeded");
    let text = logs.text();
    let line = |needle: &str| {
        text.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?} in {text}"))
            .to_owned()
    };
    let model_line = line("model call failed");
    for part in [
        s.run_id.to_string().as_str(),
        "outcome=budget_exceeded",
        "duration_ms=",
        "\"total_tokens\":5",
    ] {
        assert!(model_line.contains(part), "{part:?} not in {model_line}");
    }
    let tool_line = line("tool call failed");
    for part in ["outcome=budget_exceeded", "duration_ms=", "result_chars="] {
        assert!(tool_line.contains(part), "{part:?} not in {tool_line}");
    }
}
