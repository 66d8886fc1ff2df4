//! Models, tools and knowledge bases end to end (issue 6), in embedded and in cluster mode.
//!
//! A real runner process built on the `sb-runner` SDK (`sb-api-runner` as plugin
//! `sdk-api-resources`, see tests/runners) runs scripts of Host API calls against resources
//! an operator registered through the gateway's API (`POST /v1/models`, `/v1/tools`,
//! `/v1/knowledge-bases` and its documents) and granted through the agent: the resource
//! policy grants the LLMs, tools and knowledge bases, the runner config selects the rerank
//! model (a policy never grants one, host-behaviour §8). The model provider
//! (OpenAI-compatible chat completions, plain and SSE, and `/rerank`) and the HTTP tools are
//! one local axum server started by the test ([`serve`]). The scripts run through the shared
//! [`sb_tests::script`] helpers.
//!
//! [`scenario`] is written once against a [`Client`] and run in both modes, so every grant,
//! refusal and budget of SPEC §8 is observed with its code on the embedded host (SQLite,
//! memory sessions, in-memory bus) and on separate processes (Postgres, Redis, RabbitMQ).
//! It makes three runs of one agent:
//! - [`happy_path`]: a streamed and a plain model call, a tool's detail, an idempotent tool
//!   call (replayed, then `conflict` with other parameters), knowledge retrieval, and the
//!   resources the run's context lists;
//! - [`refusals`]: every kind of resource not granted or unknown (`unauthorized`), a rerank
//!   over its 64 documents (`invalid_argument`) and within them (sorted), provider failures
//!   (`500` → `unavailable`, `429` retried), the per-result tool budget at and past its
//!   limit, and the model output budget staying exhausted;
//! - [`budgets`]: the model-call and tool-call budgets: exactly the limit succeeds, every
//!   later call of the kind is `budget_exceeded` and reaches no provider.
//!
//! The API key: the registry stores the *name* of an environment variable, read by the
//! worker. The embedded worker runs in the test process, which can only offer a variable it
//! already has (setting one needs `unsafe`), so its key is `PATH`; the cluster's workers get a
//! dedicated variable with a random value. Either way the fake provider and the tool (through
//! `headers_env`) must receive the value, and it must appear in no registry response, no run
//! answer and (cluster) no process log.
//!
//! Needs the binaries: `cargo build --workspace --bins` (scripts/test does it).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use sb_protocol::ids::RunId;
use sb_tests::cluster::{ClusterSpec, Role, TestCluster as Deployment};
use sb_tests::script::{
    Report, agent, code, details, ok, report, require_api_runner, serve_local, start_script, unique,
};
use sb_tests::{Client, TestCluster, wait_for};
use serde_json::{Value, json};

const RUNNER: &str = "plugin:switchboard-tests/sdk-api-resources/default";
/// The per-run budgets of SPEC §8 (the defaults: the agent overrides none).
const MAX_MODEL_CALLS: usize = 16;
const MAX_TOOL_CALLS: usize = 32;
const MAX_TOOL_RESULT_CHARS: usize = 100_000;
const MAX_MODEL_OUTPUT_CHARS: usize = 100_000;
/// Most documents of one rerank call (SPEC §13).
const MAX_RERANK_DOCUMENTS: usize = 64;
/// Context window of the first granted LLM, which the run's metadata reports.
const CONTEXT_WINDOW: u64 = 8192;

/// The environment variable the workers read the model API key and the tool header from.
struct Secret {
    /// Its name, as registered.
    env: String,
    /// Its value, which only the workers and the fake server know.
    value: String,
}

impl Secret {
    /// `PATH`: the embedded worker shares the test process's environment.
    fn path() -> Self {
        Self {
            env: "PATH".to_owned(),
            value: std::env::var("PATH").expect("PATH is set"),
        }
    }

    /// A dedicated variable with a random value, for worker processes.
    fn random() -> Self {
        Self {
            env: "SB_TEST_MODEL_KEY".to_owned(),
            value: format!("sk-test-{}", uuid::Uuid::new_v4().simple()),
        }
    }

    /// Panics when `what` shows the value.
    #[track_caller]
    fn assert_absent(&self, what: &str, shown: &impl std::fmt::Display) {
        assert!(
            !shown.to_string().contains(&self.value),
            "the value of {} leaked into {what}",
            self.env
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The fake provider and tools
// ---------------------------------------------------------------------------------------------

/// Requests the fake server received.
#[derive(Default)]
struct Seen {
    /// Chat completion requests that carried the key (any model).
    chat: AtomicU32,
    /// Requests for model `broken` (always `500`).
    broken: AtomicU32,
    /// Requests for model `flaky` (`429` first, then answers).
    flaky: AtomicU32,
    /// Rerank requests that carried the key.
    rerank: AtomicU32,
    /// Executions of tool `echo`.
    echo: AtomicU32,
    /// Requests without the key (answered `401`).
    bad_auth: AtomicU32,
}

fn count(counter: &AtomicU32) -> u32 {
    counter.load(Ordering::SeqCst)
}

struct Fake {
    secret: String,
    seen: Seen,
}

impl Fake {
    /// Whether header `name` is exactly `expected`; counts the requests where it is not.
    fn authorized(&self, headers: &HeaderMap, name: &str, expected: &str) -> bool {
        let ok = headers.get(name).and_then(|v| v.to_str().ok()) == Some(expected);
        if !ok {
            self.seen.bad_auth.fetch_add(1, Ordering::SeqCst);
        }
        ok
    }

    fn bearer(&self, headers: &HeaderMap) -> bool {
        self.authorized(headers, "authorization", &format!("Bearer {}", self.secret))
    }
}

fn parse(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or(Value::Null)
}

/// The fake reranker's score of document `i`: distinct for 64 documents (7 is coprime to
/// 64) and not monotonic in `i`, so the host's sorting shows.
fn rerank_score(i: usize) -> f64 {
    ((i * 7) % 64) as f64 / 64.0
}

/// Chat completions. Model `broken` answers `500`, model `flaky` `429` the first time; any
/// other answers `hello` (streamed as `hel`, `lo`, then usage), or, when the request has a
/// `size` (an `extra_args` field the host merges into the body), that many characters.
async fn chat(State(fake): State<Arc<Fake>>, headers: HeaderMap, body: String) -> Response {
    if !fake.bearer(&headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    fake.seen.chat.fetch_add(1, Ordering::SeqCst);
    let req = parse(&body);
    match req["model"].as_str() {
        Some("broken") => {
            fake.seen.broken.fetch_add(1, Ordering::SeqCst);
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        }
        Some("flaky") if fake.seen.flaky.fetch_add(1, Ordering::SeqCst) == 0 => {
            return StatusCode::TOO_MANY_REQUESTS.into_response();
        }
        _ => {}
    }
    if req["stream"] == true {
        let body: String = [
            r#"{"choices":[{"delta":{"role":"assistant"}}]}"#,
            r#"{"choices":[{"delta":{"content":"hel"}}]}"#,
            r#"{"choices":[{"delta":{"content":"lo"}}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}"#,
            "[DONE]",
        ]
        .iter()
        .map(|e| format!("data: {e}\n\n"))
        .collect();
        return ([("content-type", "text/event-stream")], body).into_response();
    }
    let content = req["size"].as_u64().map_or_else(
        || "hello".to_owned(),
        |n| "v".repeat(usize::try_from(n).unwrap_or(0)),
    );
    axum::Json(json!({
        "choices": [{"message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }))
    .into_response()
}

/// Scores every document with [`rerank_score`], in request order (the host sorts).
async fn rerank(State(fake): State<Arc<Fake>>, headers: HeaderMap, body: String) -> Response {
    if !fake.bearer(&headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    fake.seen.rerank.fetch_add(1, Ordering::SeqCst);
    let n = parse(&body)["documents"].as_array().map_or(0, Vec::len);
    let results: Vec<Value> = (0..n)
        .map(|i| json!({"index": i, "relevance_score": rerank_score(i)}))
        .collect();
    axum::Json(json!({"results": results})).into_response()
}

/// Tool `echo`: needs the key in `x-api-key`; answers its parameters and its execution count.
async fn echo(State(fake): State<Arc<Fake>>, headers: HeaderMap, body: String) -> Response {
    if !fake.authorized(&headers, "x-api-key", &fake.secret) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let n = fake.seen.echo.fetch_add(1, Ordering::SeqCst) + 1;
    axum::Json(json!({"echo": parse(&body), "execution": n})).into_response()
}

/// Tool `sized`: a text of `chars` characters.
async fn sized(body: String) -> Response {
    let n = parse(&body)["chars"].as_u64().unwrap_or(0);
    "x".repeat(usize::try_from(n).unwrap_or(0)).into_response()
}

/// Tool `fail`.
async fn fail() -> Response {
    StatusCode::INTERNAL_SERVER_ERROR.into_response()
}

/// Starts the fake provider and tools, expecting `secret` as the key; returns the base URL.
async fn serve(secret: &Secret) -> (String, Arc<Fake>) {
    let fake = Arc::new(Fake {
        secret: secret.value.clone(),
        seen: Seen::default(),
    });
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/rerank", post(rerank))
        .route("/tools/echo", post(echo))
        .route("/tools/sized", post(sized))
        .route("/tools/fail", post(fail))
        .with_state(Arc::clone(&fake));
    (serve_local(app).await, fake)
}

// ---------------------------------------------------------------------------------------------
// The registry, as an operator fills it
// ---------------------------------------------------------------------------------------------

/// Ids the registry returned.
struct Registry {
    /// LLM `fake-1`, the first granted (its context window is the run's).
    model: String,
    /// LLM `broken` (granted).
    broken: String,
    /// LLM `flaky` (granted).
    flaky: String,
    /// LLM registered but not granted.
    ungranted: String,
    /// Rerank model, selected by the runner config.
    reranker: String,
    /// Granted knowledge base.
    kb: String,
    /// Knowledge base with the same documents, not granted.
    other_kb: String,
}

/// `POST path` must answer `201`; returns the body, checked for the secret.
async fn create(client: &Client, secret: &Secret, path: &str, body: Value) -> Value {
    let response = client.post(path, &body).await.expect(201);
    secret.assert_absent(&format!("POST {path}"), &response.body);
    response.body
}

/// Registers the models, tools and knowledge bases through the API, and checks that the
/// registry shows the key's variable name and never its value.
async fn register(client: &Client, base: &str, secret: &Secret) -> Registry {
    let add_model = |name: &str, kind: &str| {
        let body = json!({
            "name": name,
            "kind": kind,
            "base_url": format!("{base}/v1"),
            "model_name": name,
            "api_key_env": secret.env,
            "context_window": CONTEXT_WINDOW,
        });
        async move {
            let created = create(client, secret, "/v1/models", body).await;
            assert_eq!(created["api_key_env"], secret.env.as_str(), "{created}");
            created["model_id"].as_str().expect("model_id").to_owned()
        }
    };
    let model = add_model("fake-1", "llm").await;
    let broken = add_model("broken", "llm").await;
    let flaky = add_model("flaky", "llm").await;
    let ungranted = add_model("ungranted", "llm").await;
    let reranker = add_model("reranker", "rerank").await;
    for (name, path, headers_env) in [
        ("echo", "echo", json!({"x-api-key": secret.env})),
        ("sized", "sized", json!({})),
        ("fail", "fail", json!({})),
        ("hidden", "echo", json!({"x-api-key": secret.env})),
    ] {
        let created = create(
            client,
            secret,
            "/v1/tools",
            json!({
                "name": name,
                "description": format!("test tool {name}"),
                "parameters": {"type": "object"},
                "kind": "http",
                "url": format!("{base}/tools/{path}"),
                "timeout_ms": 10_000,
                "headers_env": headers_env,
            }),
        )
        .await;
        assert_eq!(created["headers_env"], headers_env, "{created}");
    }
    let mut kbs = Vec::new();
    for name in ["handbook", "other-handbook"] {
        let kb = create(client, secret, "/v1/knowledge-bases", json!({"name": name})).await;
        let kb_id = kb["kb_id"].as_str().expect("kb_id").to_owned();
        for (title, text) in [
            (
                "leave",
                "Annual leave is 25 days. Leave requests go to your manager.",
            ),
            (
                "expenses",
                "Travel expenses are reimbursed within 30 days of the claim.",
            ),
        ] {
            let path = format!("/v1/knowledge-bases/{kb_id}/documents");
            create(client, secret, &path, json!({"title": title, "text": text})).await;
        }
        kbs.push(kb_id);
    }
    for path in ["/v1/models", "/v1/tools", "/v1/knowledge-bases"] {
        let listed = client.get(path).await.expect(200).body;
        secret.assert_absent(&format!("GET {path}"), &listed);
    }
    Registry {
        model,
        broken,
        flaky,
        ungranted,
        reranker,
        kb: kbs.remove(0),
        other_kb: kbs.remove(0),
    }
}

// ---------------------------------------------------------------------------------------------
// Scripts
// ---------------------------------------------------------------------------------------------

/// A step and the code its outcome must have (`ok` for a success).
type Check = (Value, &'static str);

/// `call(action, params)`.
fn call(action: &str, params: Value) -> Value {
    json!({"do": "call", "action": action, "params": params})
}

/// `call_stream(action, params)`: the outcome adds the streamed `chunks`.
fn stream(action: &str, params: Value) -> Value {
    json!({"do": "call_stream", "action": action, "params": params})
}

fn messages() -> Value {
    json!([{"role": "user", "content": "hi"}])
}

fn llm(model: &str) -> Value {
    json!({"llm_model_uuid": model, "messages": messages()})
}

fn documents(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("doc-{i}")).collect()
}

/// `call_tool` of tool `name`, with a `call_id` (the idempotency key) when given.
fn tool_call(name: &str, parameters: Value, call_id: Option<&str>) -> Value {
    let mut params = json!({"tool_name": name, "parameters": parameters});
    if let Some(id) = call_id {
        params["call_id"] = json!(id);
    }
    call("call_tool", params)
}

/// `invoke_rerank` with `model` over `n` [`documents`], cut to `top_k` when given.
fn rerank_call(model: &str, n: usize, top_k: Option<usize>) -> Value {
    let mut params = json!({"rerank_model_uuid": model, "query": "q", "documents": documents(n)});
    if let Some(k) = top_k {
        params["top_k"] = json!(k);
    }
    call("invoke_rerank", params)
}

/// `retrieve_knowledge` of `query` from knowledge base `kb`.
fn retrieve_call(kb: &str, query: &str) -> Value {
    call(
        "retrieve_knowledge",
        json!({"kb_id": kb, "query_text": query}),
    )
}

/// One line per step (action, code, error message), for failure messages: the outcomes
/// themselves can hold 100 000 characters.
fn describe(checks: &[Check], outcomes: &[Value]) -> String {
    checks
        .iter()
        .zip(outcomes)
        .enumerate()
        .map(|(i, ((step, want), got))| {
            let mark = if code(got) == *want { " " } else { "!" };
            let action = step["action"].as_str().unwrap_or_default();
            let message = got["error"]["message"].as_str().unwrap_or_default();
            format!(
                "{mark} {i}: {} {action}: want {want}, got {} {message}",
                step["do"].as_str().unwrap_or_default(),
                code(got),
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The agent of a [`scenario`], its conversation, and what its runs are checked against.
struct Scene<'a> {
    client: &'a Client,
    secret: &'a Secret,
    conversation: String,
    reg: Registry,
    fake: Arc<Fake>,
}

impl Scene<'_> {
    /// Runs `checks` as one script of a run in the conversation, asserts that the run
    /// completed, the code of every outcome and the secret's absence from every result;
    /// returns the run and its outcomes, in step order.
    async fn run_checked(&self, checks: &[Check]) -> (RunId, Vec<Value>) {
        let steps: Vec<&Value> = checks.iter().map(|(step, _)| step).collect();
        let (_, run_id) = start_script(self.client, &self.conversation, &json!(steps)).await;
        let Report {
            run,
            items,
            outcomes,
        } = report(self.client, run_id).await;
        assert_eq!(run["status"], "completed", "{run}");
        assert_eq!(
            outcomes.len(),
            checks.len(),
            "{}",
            describe(checks, &outcomes)
        );
        let codes: Vec<&str> = outcomes.iter().map(code).collect();
        let wanted: Vec<&str> = checks.iter().map(|(_, want)| *want).collect();
        assert_eq!(codes, wanted, "\n{}", describe(checks, &outcomes));
        for item in &items {
            self.secret
                .assert_absent(&format!("a result of run {run_id}"), &json!(item));
        }
        (run_id, outcomes)
    }
}

// ---------------------------------------------------------------------------------------------
// The scenario
// ---------------------------------------------------------------------------------------------

/// Registers the resources, creates the agent and makes the three runs (see the module
/// docs); returns their ids.
async fn scenario(client: &Client, secret: &Secret) -> Vec<RunId> {
    let (base, fake) = serve(secret).await;
    let reg = register(client, &base, secret).await;
    let conversation = unique("res");
    agent(
        client,
        &conversation,
        RUNNER,
        json!({
            "runner_config": {"reranker": reg.reranker},
            "resource_policy": {
                "allowed_model_uuids": [reg.model, reg.broken, reg.flaky],
                "allowed_tool_names": ["echo", "sized", "fail"],
                "allowed_kb_uuids": [reg.kb],
            },
        }),
    )
    .await;
    let scene = Scene {
        client,
        secret,
        conversation,
        reg,
        fake,
    };
    let runs = vec![
        happy_path(&scene).await,
        refusals(&scene).await,
        budgets(&scene).await,
    ];
    assert_eq!(
        count(&scene.fake.seen.bad_auth),
        0,
        "every provider and tool request carried the key"
    );
    runs
}

async fn happy_path(scene: &Scene<'_>) -> RunId {
    let (reg, fake) = (&scene.reg, &scene.fake);
    let echo = |parameters: Value, call_id: Option<&str>| tool_call("echo", parameters, call_id);
    let checks: Vec<Check> = vec![
        (stream("invoke_llm_stream", llm(&reg.model)), "ok"),
        (call("invoke_llm", llm(&reg.model)), "ok"),
        (call("get_tool_detail", json!({"tool_name": "echo"})), "ok"),
        (echo(json!({"x": 1}), Some("c1")), "ok"),
        // The same call id and parameters: replayed, not executed again.
        (echo(json!({"x": 1}), Some("c1")), "ok"),
        (echo(json!({"x": 2}), Some("c1")), "conflict"),
        // Without a call id every call executes.
        (echo(json!({"x": 2}), None), "ok"),
        (retrieve_call(&reg.kb, "annual leave"), "ok"),
        (json!({"do": "context"}), "ok"),
    ];
    let (run_id, o) = scene.run_checked(&checks).await;

    let streamed = ok(&o[0]);
    let chunks: Vec<&str> = streamed["chunks"]
        .as_array()
        .expect("chunks")
        .iter()
        .map(|c| c["chunk"]["content"].as_str().expect("chunk content"))
        .collect();
    assert_eq!(
        chunks,
        vec!["hel", "lo"],
        "chunks as the provider streamed them"
    );
    assert_eq!(streamed["data"]["message"]["content"], "hello");
    assert_eq!(streamed["data"]["usage"]["total_tokens"], 3);
    assert_eq!(ok(&o[1])["message"]["content"], "hello");
    assert_eq!(ok(&o[1])["usage"]["total_tokens"], 3);
    assert_eq!(ok(&o[2])["tool"]["name"], "echo");
    assert_eq!(ok(&o[2])["tool"]["parameters"]["type"], "object");
    assert_eq!(
        ok(&o[3])["result"],
        json!({"echo": {"x": 1}, "execution": 1})
    );
    assert_eq!(ok(&o[4]), ok(&o[3]), "replayed, not re-executed");
    assert_eq!(details(&o[5])["call_id"], "c1");
    assert_eq!(ok(&o[6])["result"]["execution"], 2);
    assert_eq!(count(&fake.seen.echo), 2);

    let hits = ok(&o[7])["results"].as_array().expect("results");
    let titles: Vec<&str> = hits.iter().filter_map(|h| h["title"].as_str()).collect();
    assert_eq!(titles, vec!["leave"], "only the document with those words");
    assert!(
        hits[0]["score"].as_f64().is_some_and(|s| s > 0.0),
        "{hits:?}"
    );
    assert!(
        hits[0]["content"]
            .as_str()
            .is_some_and(|c| c.contains("Annual leave"))
    );

    let ctx = ok(&o[8]);
    assert_eq!(
        ctx["runtime"]["metadata"]["model_context_window_tokens"],
        CONTEXT_WINDOW
    );
    let granted = |kind: &str, id: &str| -> BTreeMap<String, Value> {
        ctx["resources"][kind]
            .as_array()
            .expect("resource list")
            .iter()
            .map(|r| (r[id].as_str().unwrap().to_owned(), r["operations"].clone()))
            .collect()
    };
    let llm_ops = json!(["invoke", "stream"]);
    assert_eq!(
        granted("models", "model_id"),
        BTreeMap::from([
            (reg.reranker.clone(), json!(["rerank"])),
            (reg.model.clone(), llm_ops.clone()),
            (reg.broken.clone(), llm_ops.clone()),
            (reg.flaky.clone(), llm_ops),
        ]),
        "the policy's LLMs and the config's reranker, not the ungranted model"
    );
    let tool_ops = json!(["detail", "call"]);
    assert_eq!(
        granted("tools", "tool_name"),
        BTreeMap::from(["echo", "fail", "sized"].map(|t| (t.to_owned(), tool_ops.clone()))),
    );
    assert_eq!(
        granted("knowledge_bases", "kb_id"),
        BTreeMap::from([(reg.kb.clone(), json!(["list", "retrieve"]))])
    );
    run_id
}

async fn refusals(scene: &Scene<'_>) -> RunId {
    let (reg, fake) = (&scene.reg, &scene.fake);
    let unknown = uuid::Uuid::new_v4().to_string();
    let tool = |name: &str, parameters: Value| tool_call(name, parameters, None);
    let retrieve = |kb: &str| retrieve_call(kb, "leave");
    let mut verbose = llm(&reg.model);
    verbose["extra_args"] = json!({"size": MAX_MODEL_OUTPUT_CHARS + 1});
    let checks: Vec<Check> = vec![
        // Step 4 (SPEC §8): what the run was not granted is refused, whether it exists
        // (registered but not granted, or granted for another operation) or not.
        (call("invoke_llm", llm(&reg.ungranted)), "unauthorized"),
        (
            stream("invoke_llm_stream", llm(&reg.ungranted)),
            "unauthorized",
        ),
        (call("invoke_llm", llm(&unknown)), "unauthorized"),
        (call("invoke_llm", llm(&reg.reranker)), "unauthorized"),
        (rerank_call(&reg.model, 3, None), "unauthorized"),
        (
            call("get_tool_detail", json!({"tool_name": "hidden"})),
            "unauthorized",
        ),
        (tool("hidden", json!({})), "unauthorized"),
        (tool("ghost", json!({})), "unauthorized"),
        (retrieve(&reg.other_kb), "unauthorized"),
        (retrieve(&unknown), "unauthorized"),
        // Rerank: at most 64 documents; the answer is sorted by score and cut to top_k.
        (
            rerank_call(&reg.reranker, MAX_RERANK_DOCUMENTS + 1, None),
            "invalid_argument",
        ),
        (
            rerank_call(&reg.reranker, MAX_RERANK_DOCUMENTS, Some(3)),
            "ok",
        ),
        // Provider failures: a 500 (retried, then mapped), a 429 (retried, then answered),
        // a failing tool (never retried).
        (call("invoke_llm", llm(&reg.broken)), "unavailable"),
        (call("invoke_llm", llm(&reg.flaky)), "ok"),
        (tool("fail", json!({})), "unavailable"),
        // The tool result budget is per result: at the limit it is whole, past it refused.
        (tool("sized", json!({"chars": MAX_TOOL_RESULT_CHARS})), "ok"),
        (
            tool("sized", json!({"chars": MAX_TOOL_RESULT_CHARS + 1})),
            "budget_exceeded",
        ),
        // The model output budget is per run: once exceeded, even a short answer is refused.
        (call("invoke_llm", verbose), "budget_exceeded"),
        (call("invoke_llm", llm(&reg.model)), "budget_exceeded"),
    ];
    let (run_id, o) = scene.run_checked(&checks).await;

    assert!(
        o[0]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("is not authorized for operation invoke")),
        "the seed's wording: {}",
        o[0]
    );
    assert_eq!(details(&o[10])["limit"], MAX_RERANK_DOCUMENTS);
    let mut expected: Vec<usize> = (0..MAX_RERANK_DOCUMENTS).collect();
    expected.sort_by(|a, b| rerank_score(*b).total_cmp(&rerank_score(*a)));
    let ranked: Vec<(u64, String)> = ok(&o[11])["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| {
            (
                r["index"].as_u64().expect("index"),
                r["document"].as_str().expect("document").to_owned(),
            )
        })
        .collect();
    let best: Vec<(u64, String)> = expected[..3]
        .iter()
        .map(|&i| (i as u64, format!("doc-{i}")))
        .collect();
    assert_eq!(ranked, best, "best first, cut to top_k");
    assert_eq!(
        count(&fake.seen.rerank),
        1,
        "refused reranks reach no provider"
    );

    let broken = &o[12]["error"];
    assert_eq!(broken["retryable"], true, "{broken}");
    let attempts = sb_host_api::providers::ProviderOptions::default().max_attempts;
    assert_eq!(count(&fake.seen.broken), attempts, "a 500 is retried");
    assert_eq!(ok(&o[13])["message"]["content"], "hello");
    assert_eq!(count(&fake.seen.flaky), 2, "one 429, then the answer");
    assert_eq!(details(&o[14])["tool_name"], "fail");

    let whole = ok(&o[15])["result"].as_str().expect("a text result");
    assert_eq!(
        whole.chars().count(),
        MAX_TOOL_RESULT_CHARS,
        "not truncated"
    );
    let over = details(&o[16]);
    assert_eq!(over["budget"], "tool_result_chars", "{over}");
    assert_eq!(over["limit"], MAX_TOOL_RESULT_CHARS);
    for exhausted in [&o[17], &o[18]] {
        let d = details(exhausted);
        assert_eq!(d["budget"], "model_output_chars", "{d}");
        assert_eq!(d["limit"], MAX_MODEL_OUTPUT_CHARS);
    }
    run_id
}

async fn budgets(scene: &Scene<'_>) -> RunId {
    let (reg, fake) = (&scene.reg, &scene.fake);
    let (chat_before, echo_before) = (count(&fake.seen.chat), count(&fake.seen.echo));
    let rerank_before = count(&fake.seen.rerank);
    let echo = |n: usize, call_id: Option<&str>| tool_call("echo", json!({"n": n}), call_id);
    let mut checks: Vec<Check> = Vec::new();
    // Plain and streamed calls share the model-call budget.
    for i in 0..MAX_MODEL_CALLS {
        let step = if i % 2 == 0 {
            call("invoke_llm", llm(&reg.model))
        } else {
            stream("invoke_llm_stream", llm(&reg.model))
        };
        checks.push((step, "ok"));
    }
    let model_refused = checks.len();
    checks.extend([
        (call("invoke_llm", llm(&reg.model)), "budget_exceeded"),
        (
            stream("invoke_llm_stream", llm(&reg.model)),
            "budget_exceeded",
        ),
        (rerank_call(&reg.reranker, 2, None), "budget_exceeded"),
    ]);
    for i in 0..MAX_TOOL_CALLS {
        checks.push((echo(i, None), "ok"));
    }
    let tool_refused = checks.len();
    checks.extend([
        (echo(MAX_TOOL_CALLS, None), "budget_exceeded"),
        (echo(MAX_TOOL_CALLS, Some("late")), "budget_exceeded"),
        // Neither a tool's detail nor knowledge retrieval is budgeted.
        (call("get_tool_detail", json!({"tool_name": "echo"})), "ok"),
        (retrieve_call(&reg.kb, "expenses"), "ok"),
    ]);
    let (run_id, o) = scene.run_checked(&checks).await;

    for refused in &o[model_refused..model_refused + 3] {
        let d = details(refused);
        assert_eq!(d["budget"], "model_calls", "{d}");
        assert_eq!(d["limit"], MAX_MODEL_CALLS);
    }
    for refused in &o[tool_refused..tool_refused + 2] {
        let d = details(refused);
        assert_eq!(d["budget"], "tool_calls", "{d}");
        assert_eq!(d["limit"], MAX_TOOL_CALLS);
    }
    let executions: Vec<u64> = o[model_refused + 3..tool_refused]
        .iter()
        .map(|x| ok(x)["result"]["execution"].as_u64().expect("execution"))
        .collect();
    let expected: Vec<u64> = (1..=MAX_TOOL_CALLS as u64)
        .map(|n| n + u64::from(echo_before))
        .collect();
    assert_eq!(executions, expected, "every admitted call executed once");
    assert_eq!(
        count(&fake.seen.chat) - chat_before,
        MAX_MODEL_CALLS as u32,
        "refused model calls reach no provider"
    );
    assert_eq!(count(&fake.seen.rerank), rerank_before);
    assert_eq!(
        count(&fake.seen.echo) - echo_before,
        MAX_TOOL_CALLS as u32,
        "refused tool calls reach no tool"
    );
    run_id
}

// ---------------------------------------------------------------------------------------------
// The two modes
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_runs_get_granted_resources_refusals_and_budgets() {
    require_api_runner();
    // As an operator with a local model server configures it: loopback reachable, the key's
    // variable made available.
    let cluster = TestCluster::builder()
        .config("egress.allow", "127.0.0.0/8")
        .config("secrets.allow", "PATH")
        .start()
        .await;
    scenario(cluster.client(), &Secret::path()).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_runs_get_granted_resources_refusals_and_budgets() {
    require_api_runner();
    let secret = Secret::random();
    let spec = ClusterSpec {
        gateways: 1,
        orchestrators: 1,
        workers: 1,
        env: Vec::new(),
    }
    .env(&secret.env, &secret.value)
    .env("SWITCHBOARD__EGRESS__ALLOW", "127.0.0.0/8")
    .env("SWITCHBOARD__SECRETS__ALLOW", &secret.env)
    // At least the default level whatever the developer's RUST_LOG, and the worker (which
    // reads the key) at debug, with the Host API it serves (whose providers retry), so the
    // log check below covers its retry messages too.
    .env("RUST_LOG", "info,sb_worker=debug,sb_host_api=debug");
    let Some(deployment) = Deployment::spawn_or_skip(spec).await else {
        return;
    };
    let runs = scenario(&deployment.client(0), &secret).await;

    // Host-side calls are logged with their run; the key is in no log line of any process.
    let last = runs.last().expect("runs").to_string();
    wait_for("the worker to log the last run's calls", || async {
        let models = deployment.log_lines(Role::Worker, &["model called", &last]);
        let tools = deployment.log_lines(Role::Worker, &["tool called", &last]);
        (!models.is_empty() && !tools.is_empty()).then_some(())
    })
    .await;
    let refused = runs[1].to_string();
    assert!(
        !deployment
            .log_lines(
                Role::Worker,
                &["model call failed", &refused, "unavailable"]
            )
            .is_empty(),
        "{}",
        deployment.log_tail("worker-0", 40)
    );
    for role in [Role::Gateway, Role::Orchestrator, Role::Worker] {
        let leaked = deployment.log_lines(role, &[&secret.value]);
        assert!(leaked.is_empty(), "the key was logged: {leaked:?}");
    }
}
