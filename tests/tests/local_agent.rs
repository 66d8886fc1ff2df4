//! The official local agent end to end (issue 13): a real model-backed default agent, in
//! embedded and in cluster mode, and the one configuration step of `switchboard dev`.
//!
//! The model is a local OpenAI-compatible server started by the test ([`serve`]): chat
//! completions streamed as SSE (text deltas, and tool calls in the OpenAI delta format),
//! a model that always answers `503` (the primary, so every run falls back), and an HTTP
//! tool. The registry and the agent are set up as an operator would: the dev model by the
//! bootstrap (embedded; `dev.model_url` / `dev.model`) or through the API (cluster), the
//! fallback model, the tool and a knowledge base through the API, granted by patching the
//! default agent.
//!
//! [`conversation`] is written once against a [`Client`] and run in both modes: a first
//! message streams its answer as deltas, calls the tool (under a run-unique `call_id`) and
//! uses the knowledge-base chunk; a second message in the same conversation sees the first
//! turn. Both runs complete, and the ledger holds their tool calls and summed usage.
//!
//! [`dev_cli_bootstraps_the_local_agent_and_stays_echo_without_a_model`] drives the
//! `switchboard dev` binary itself: echo on a fresh data directory, the local agent with
//! `--model-url`/`--model` (answering through the fake model), echo again without, and the
//! same model (not a second one) when the flags come back.
//!
//! Needs the binaries: `cargo build --workspace --bins` (scripts/test does it).

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use sb_common::session::SessionStore;
use sb_protocol::ids::RunId;
use sb_tests::cluster::{ClusterSpec, TestCluster as Deployment, switchboard_bin};
use sb_tests::script::{content_of, serve_local, unique};
use sb_tests::{Client, StreamFrom, TestCluster, repo_dir, runner_binary, wait_for};
use serde_json::{Value, json};
use switchboard::builtin::{ECHO_RUNNER_ID, LOCAL_AGENT_RUNNER_ID};
use switchboard::default_agent::{Desired, agent_fields};

/// The primary model's name at the fake server: it always answers `503`.
const PRIMARY: &str = "primary-down";
/// The fallback model's name: it answers.
const FALLBACK: &str = "fallback";
/// The tool the model calls.
const TOOL: &str = "lookup_policy";
/// The knowledge-base chunk the first answer must be given.
const CHUNK: &str = "Annual leave is 25 days per year. Requests go to your manager.";
/// The first message (every word is in [`CHUNK`], so the full-text search finds it).
const FIRST: &str = "annual leave days";
/// The second message.
const SECOND: &str = "thank you";
/// The answer to a message that needs no tool, as streamed.
const REPLY: [&str; 2] = ["Happy ", "to help."];

// ---------------------------------------------------------------------------------------------
// The fake model server and tool
// ---------------------------------------------------------------------------------------------

/// What the fake server saw.
struct Fake {
    /// The bearer token every model request must carry.
    key: String,
    /// Requests for [`PRIMARY`] (each answered `503`).
    primary: AtomicU32,
    /// Chat requests for any other model, in arrival order.
    chats: Mutex<Vec<Value>>,
    /// Bodies of the tool's executions.
    tool_calls: Mutex<Vec<Value>>,
    /// Model requests without the key (answered `401`).
    bad_auth: AtomicU32,
}

impl Fake {
    fn chats(&self) -> Vec<Value> {
        self.chats.lock().unwrap().clone()
    }

    fn tool_calls(&self) -> Vec<Value> {
        self.tool_calls.lock().unwrap().clone()
    }
}

fn sse(events: &[Value]) -> Response {
    let mut body: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    body.push_str("data: [DONE]\n\n");
    ([("content-type", "text/event-stream")], body).into_response()
}

fn text_stream(pieces: &[&str], usage: Value) -> Response {
    let mut events =
        vec![json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})];
    events.extend(
        pieces
            .iter()
            .map(|p| json!({"choices": [{"index": 0, "delta": {"content": p}}]})),
    );
    events.push(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}));
    events.push(json!({"choices": [], "usage": usage}));
    sse(&events)
}

/// Chat completions. [`PRIMARY`] answers `503`. Any other model: a tool result last →
/// the answer built from it; the tool offered and a message about leave → a call of the
/// tool (its arguments split over two deltas, as OpenAI streams them); else [`REPLY`].
async fn chat(State(fake): State<Arc<Fake>>, headers: HeaderMap, body: String) -> Response {
    let bearer = headers.get("authorization").and_then(|v| v.to_str().ok());
    if bearer != Some(format!("Bearer {}", fake.key).as_str()) {
        fake.bad_auth.fetch_add(1, Ordering::SeqCst);
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let req: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    if req["model"] == PRIMARY {
        fake.primary.fetch_add(1, Ordering::SeqCst);
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    fake.chats.lock().unwrap().push(req.clone());
    let last = req["messages"]
        .as_array()
        .and_then(|m| m.last())
        .cloned()
        .unwrap_or(Value::Null);
    let tools_offered = req["tools"].as_array().is_some_and(|t| !t.is_empty());
    if last["role"] == "tool" {
        let result: Value =
            serde_json::from_str(last["content"].as_str().unwrap_or("")).unwrap_or(Value::Null);
        let days = format!("{} ", result["days"]);
        return text_stream(
            &["You get ", &days, "days of annual leave."],
            json!({"prompt_tokens": 80, "completion_tokens": 6, "total_tokens": 86}),
        );
    }
    let about_leave = last["content"]
        .as_str()
        .is_some_and(|c| c.contains("leave"));
    if tools_offered && about_leave {
        return sse(&[
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": null,
                "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                "function": {"name": TOOL, "arguments": ""}}]}}]}),
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "function": {"arguments": "{\"topic\":"}}]}}]}),
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "function": {"arguments": "\"leave\"}"}}]}}]}),
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
            json!({"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 5, "total_tokens": 55}}),
        ]);
    }
    text_stream(
        &REPLY,
        json!({"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44}),
    )
}

/// The tool: the policy for `topic`.
async fn lookup_policy(State(fake): State<Arc<Fake>>, body: String) -> Response {
    let args: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    fake.tool_calls.lock().unwrap().push(args.clone());
    axum::Json(json!({"days": 25, "topic": args["topic"]})).into_response()
}

/// Starts the fake server expecting `key`; returns its base URL and what it sees.
async fn serve(key: &str) -> (String, Arc<Fake>) {
    let fake = Arc::new(Fake {
        key: key.to_owned(),
        primary: AtomicU32::new(0),
        chats: Mutex::new(Vec::new()),
        tool_calls: Mutex::new(Vec::new()),
        bad_auth: AtomicU32::new(0),
    });
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route(&format!("/tools/{TOOL}"), post(lookup_policy))
        .with_state(Arc::clone(&fake));
    (serve_local(app).await, fake)
}

// ---------------------------------------------------------------------------------------------
// The conversation, in either mode
// ---------------------------------------------------------------------------------------------

/// The workspace's agent named `default` (the bootstrap's, or the one the test made so).
async fn default_agent(client: &Client) -> Value {
    let agents = client.get("/v1/agents").await.expect(200).body;
    agents["items"]
        .as_array()
        .expect("agents")
        .iter()
        .find(|a| a["name"] == "default")
        .cloned()
        .unwrap_or_else(|| panic!("no default agent: {agents}"))
}

/// `PATCH /v1/agents/{id}`.
async fn patch(client: &Client, agent_id: &str, body: &Value) -> Value {
    sb_tests::script::patch_agent(client, agent_id, body)
        .await
        .body
}

/// Registers the fallback model, the tool and the knowledge base, and grants them to the
/// default agent: the model as its fallback, the tool and the base in its policy.
async fn grant_resources(client: &Client, base: &str, key_env: &str) {
    let fallback = client
        .post(
            "/v1/models",
            &json!({"name": "fallback", "kind": "llm", "base_url": format!("{base}/v1"),
                    "model_name": FALLBACK, "api_key_env": key_env, "context_window": 8192}),
        )
        .await
        .expect(201);
    let fallback = fallback.str("model_id").to_owned();
    client
        .post(
            "/v1/tools",
            &json!({"name": TOOL, "description": "The company policy on a topic",
                    "kind": "http", "url": format!("{base}/tools/{TOOL}"), "timeout_ms": 10_000,
                    "parameters": {"type": "object", "required": ["topic"],
                                   "properties": {"topic": {"type": "string"}}}}),
        )
        .await
        .expect(201);
    let kb = client
        .post("/v1/knowledge-bases", &json!({"name": unique("handbook")}))
        .await
        .expect(201);
    let kb = kb.str("kb_id").to_owned();
    client
        .post(
            &format!("/v1/knowledge-bases/{kb}/documents"),
            &json!({"title": "leave", "text": CHUNK}),
        )
        .await
        .expect(201);

    let agent = default_agent(client).await;
    let mut config = agent["runner_config"].clone();
    config["model"]["fallbacks"] = json!([fallback]);
    let mut policy = agent["resource_policy"].clone();
    let mut models = policy["allowed_model_uuids"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    models.push(json!(fallback));
    policy["allowed_model_uuids"] = json!(models);
    policy["allowed_tool_names"] = json!([TOOL]);
    policy["allowed_kb_uuids"] = json!([kb]);
    let agent_id = agent["agent_id"].as_str().expect("agent_id");
    patch(
        client,
        agent_id,
        &json!({"runner_config": config, "resource_policy": policy}),
    )
    .await;
}

/// Waits until the run's session is gone: a message sent before could still be claimed by
/// the ending run as steering input (the local agent declares `steering`), instead of
/// starting the next turn.
async fn wait_session_ended(sessions: &dyn SessionStore, run_id: RunId) {
    wait_for(&format!("the session of run {run_id} to end"), || async {
        let session = sessions.get_session(&run_id).await.expect("session store");
        session.is_none().then_some(())
    })
    .await;
}

/// The texts of a run's `message.delta` items.
fn deltas(items: &[sb_protocol::result::AgentRunResult]) -> Vec<String> {
    items
        .iter()
        .filter(|i| i.result_type == "message.delta")
        .filter_map(|i| content_of(i, "chunk"))
        .collect()
}

/// One message to the default agent in `conversation`; returns the run, completed.
async fn turn(client: &Client, conversation: &str, text: &str) -> (RunId, Value) {
    let event = client.send_message(conversation, text).await;
    let run_id = client.run_of(event).await;
    let run = client.wait_run_terminal(run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    (run_id, run)
}

/// The two turns (see the module docs). `attempts` is the providers' `max_attempts`: the
/// host retries the primary's `503` that often before the runner falls back.
async fn conversation(client: &Client, sessions: &dyn SessionStore, fake: &Fake, attempts: u32) {
    let conversation = unique("leave");

    // Turn 1: knowledge, fallback, a tool call, streamed deltas.
    let (run_id, run) = turn(client, &conversation, FIRST).await;
    let items = client.run_events(run_id, 0).await;
    let types: Vec<&str> = items.iter().map(|i| i.result_type.as_str()).collect();
    assert_eq!(
        types,
        [
            "tool.call.started",
            "tool.call.completed",
            "message.delta",
            "message.delta",
            "message.delta",
            "message.completed",
            "run.completed"
        ],
        "{items:?}"
    );
    assert_eq!(
        deltas(&items),
        ["You get ", "25 ", "days of annual leave."],
        "each delta as the model produced it"
    );
    assert_eq!(
        content_of(&items[5], "message").as_deref(),
        Some("You get 25 days of annual leave.")
    );
    let started = &items[0].data;
    assert_eq!(started["tool_name"], TOOL);
    assert_eq!(started["parameters"], json!({"topic": "leave"}));
    let call_id = started["tool_call_id"].as_str().expect("a call id");
    assert!(call_id.starts_with("r1.0."), "{call_id}");
    assert_eq!(items[1].data["tool_call_id"], call_id);
    assert_eq!(
        items[1].data["result"],
        json!({"days": 25, "topic": "leave"})
    );
    assert_eq!(
        fake.tool_calls(),
        [json!({"topic": "leave"})],
        "executed once"
    );
    // Usage of both model calls, summed, on the run (from its terminal item).
    let usage = &run["usage"];
    assert_eq!(usage["prompt_tokens"], 130, "{run}");
    assert_eq!(usage["total_tokens"], 141, "{run}");
    assert_eq!(usage["model_calls"], 2, "{run}");
    assert_eq!(usage["tool_calls"], 1, "{run}");
    // The primary failed (retried by the host), the fallback answered both rounds.
    assert_eq!(fake.primary.load(Ordering::SeqCst), attempts);
    let chats = fake.chats();
    assert_eq!(chats.len(), 2, "{chats:?}");
    let first = chats[0]["messages"].as_array().expect("messages");
    let system = first[0]["content"].as_str().expect("a system message");
    assert!(
        system.contains(CHUNK),
        "the knowledge chunk reaches the model: {system}"
    );
    assert_eq!(
        first.last().unwrap(),
        &json!({"role": "user", "content": FIRST})
    );
    assert_eq!(chats[0]["stream"], true);
    assert_eq!(chats[0]["tools"][0]["function"]["name"], TOOL);
    assert_eq!(
        chats[0]["tools"][0]["function"]["parameters"]["required"],
        json!(["topic"])
    );
    let second = chats[1]["messages"].as_array().expect("messages");
    assert_eq!(second.last().unwrap()["role"], "tool");
    // The live stream of the run replays the same items in order.
    let frames = client
        .stream_run(run_id, StreamFrom::Start)
        .await
        .until_terminal()
        .await;
    let events: Vec<&str> = frames.iter().map(|f| f.event.as_str()).collect();
    assert_eq!(events, types);

    // Turn 2: the previous turn is in the history the model gets.
    wait_session_ended(sessions, run_id).await;
    let (run_id, run) = turn(client, &conversation, SECOND).await;
    let items = client.run_events(run_id, 0).await;
    assert_eq!(deltas(&items), REPLY);
    assert_eq!(run["usage"]["total_tokens"], 44, "{run}");
    let chats = fake.chats();
    assert_eq!(chats.len(), 3);
    let messages: Vec<(String, String)> = chats[2]["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap_or_default().to_owned(),
                m["content"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    let expected = [
        ("user", FIRST),
        ("assistant", "You get 25 days of annual leave."),
        ("user", SECOND),
    ];
    assert_eq!(messages[0].0, "system");
    assert_eq!(
        messages[1..]
            .iter()
            .map(|(r, c)| (r.as_str(), c.as_str()))
            .collect::<Vec<_>>(),
        expected
    );
    assert_eq!(fake.primary.load(Ordering::SeqCst), 2 * attempts);
    let transcript = client.transcript(&conversation).await;
    assert_eq!(transcript.len(), 4, "{transcript:?}");
    assert_eq!(fake.bad_auth.load(Ordering::SeqCst), 0);
}

fn attempts() -> u32 {
    sb_host_api::providers::ProviderOptions::default().max_attempts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_default_local_agent_streams_calls_tools_uses_knowledge_and_history() {
    let _ = runner_binary("local-agent");
    // The embedded worker shares the test process's environment: `PATH` is the key.
    let key = std::env::var("PATH").expect("PATH is set");
    let (base, fake) = serve(&key).await;
    let cluster = TestCluster::builder()
        .config("egress.allow", "127.0.0.0/8")
        .config("secrets.allow", "PATH")
        .config("providers.retry_backoff", "10ms")
        .config("dev.model_url", format!("{base}/v1"))
        .config("dev.model", PRIMARY)
        .config("dev.model_key_env", "PATH")
        .start()
        .await;
    let client = cluster.client();

    // The bootstrap registered the model and made the default agent the local agent on it.
    let report = cluster
        .process()
        .bootstrap()
        .unwrap()
        .agent
        .clone()
        .unwrap();
    let model = report.model.expect("the dev model");
    assert_eq!(report.runner_id.as_deref(), Some(LOCAL_AGENT_RUNNER_ID));
    let agent = default_agent(client).await;
    assert_eq!(agent["runner_id"], LOCAL_AGENT_RUNNER_ID);
    assert_eq!(
        agent["runner_config"]["model"]["primary"],
        model.model_id.to_string()
    );
    assert_eq!(
        agent["resource_policy"]["allowed_model_uuids"],
        json!([model.model_id.to_string()])
    );
    let models = client.get("/v1/models").await.expect(200).body;
    assert_eq!(models["items"][0]["name"], "default", "{models}");
    assert_eq!(models["items"][0]["model_name"], PRIMARY);
    assert_eq!(models["items"][0]["api_key_env"], "PATH");

    grant_resources(client, &base, "PATH").await;
    let sessions = Arc::clone(cluster.process().sessions());
    conversation(client, sessions.as_ref(), &fake, attempts()).await;

    // A restart keeps the agent as the operator extended it, and the model as it was.
    let (report, cluster) = cluster.restart().await;
    assert!(report.is_clean(), "{report:?}");
    let again = cluster
        .process()
        .bootstrap()
        .unwrap()
        .agent
        .clone()
        .unwrap();
    assert_eq!(again.change, switchboard::default_agent::Change::Unchanged);
    assert_eq!(again.model.unwrap().model_id, model.model_id);
    let agent = default_agent(cluster.client()).await;
    assert_eq!(
        agent["resource_policy"]["allowed_tool_names"],
        json!([TOOL])
    );
    assert_eq!(
        agent["runner_config"]["model"]["fallbacks"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_default_local_agent_streams_calls_tools_uses_knowledge_and_history() {
    let _ = runner_binary("local-agent");
    let key_env = "SB_TEST_LOCAL_AGENT_KEY";
    let key = format!("sk-test-{}", uuid::Uuid::new_v4().simple());
    let (base, fake) = serve(&key).await;
    let spec = ClusterSpec {
        gateways: 1,
        orchestrators: 1,
        workers: 1,
        env: Vec::new(),
    }
    .env(key_env, &key)
    .env("SWITCHBOARD__EGRESS__ALLOW", "127.0.0.0/8")
    .env("SWITCHBOARD__SECRETS__ALLOW", key_env)
    .env("SWITCHBOARD__PROVIDERS__RETRY_BACKOFF", "10ms");
    let Some(deployment) = Deployment::spawn_or_skip(spec).await else {
        return;
    };
    let client = deployment.client(0);

    // A cluster has no bootstrap: the operator registers the model and makes the
    // workspace-wide agent (the harness's echo agent) the local agent on it, with the same
    // fields `switchboard dev` would write.
    let primary = client
        .post(
            "/v1/models",
            &json!({"name": "default", "kind": "llm", "base_url": format!("{base}/v1"),
                    "model_name": PRIMARY, "api_key_env": key_env}),
        )
        .await
        .expect(201);
    let primary = primary.str("model_id").to_owned();
    let echo = client
        .get(&format!("/v1/agents/{}", deployment.agent_id()))
        .await
        .expect(200)
        .body;
    assert_eq!(echo["runner_id"], ECHO_RUNNER_ID);
    let (config, policy) = agent_fields(
        Desired::LocalAgent { model_id: &primary },
        echo["runner_id"].as_str(),
        &echo["runner_config"],
        &echo["resource_policy"],
    );
    patch(
        &client,
        deployment.agent_id(),
        &json!({"name": "default", "runner_id": LOCAL_AGENT_RUNNER_ID,
                "runner_config": config, "resource_policy": policy}),
    )
    .await;

    grant_resources(&client, &base, key_env).await;
    let sessions = sb_common::session::redis::RedisSessionStore::connect(
        &sb_common::session::redis::RedisOptions::new(
            deployment.services().redis_url.clone(),
            deployment.config().sessions.key_prefix.clone(),
        ),
    )
    .await
    .expect("redis");
    conversation(&client, &sessions, &fake, attempts()).await;
}

// ---------------------------------------------------------------------------------------------
// `switchboard dev` itself
// ---------------------------------------------------------------------------------------------

/// A running `switchboard dev` and what its banner said.
struct Dev {
    child: Child,
    banner: String,
    client: Client,
}

impl Dev {
    /// Starts `switchboard dev` on `data_dir` with `extra` flags and waits for its banner.
    fn start(data_dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(switchboard_bin().expect("the switchboard binary"));
        let runners = repo_dir().join("runners");
        command
            .args(["dev", "--http-addr", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .arg("--runners-dir")
            .arg(&runners)
            .args(extra)
            // Not the checkout: no ./switchboard.toml of the developer's is read.
            .current_dir(data_dir)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(
                std::fs::File::create(data_dir.join(format!("dev-{}.log", unique("run"))))
                    .expect("a log file"),
            );
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("SWITCHBOARD__") {
                command.env_remove(key);
            }
        }
        command.envs(env.iter().copied());
        let mut child = command.spawn().expect("switchboard dev starts");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut banner = String::new();
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                banner.push_str(&line);
                banner.push('\n');
                if line.starts_with("Stop with Ctrl-C") {
                    let _ = tx.send(banner.clone());
                }
            }
        });
        let banner = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("switchboard dev printed its banner");
        let url = banner
            .lines()
            .find_map(|l| {
                let rest = l.trim().strip_prefix("API")?.trim();
                rest.starts_with("http").then(|| rest.to_owned())
            })
            .expect("the API address in the banner");
        let key = std::fs::read_to_string(data_dir.join("api-key")).expect("the API key file");
        Self {
            child,
            banner,
            client: Client::new(&url, key.trim()),
        }
    }

    /// SIGTERM, then waits for the exit.
    fn stop(mut self) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).unwrap());
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "switchboard dev exited with {status}");
                return;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!("switchboard dev did not stop on SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The runner of the workspace's only agent, which must be named `default`.
async fn only_agent(client: &Client) -> Value {
    let agents = client.get("/v1/agents").await.expect(200).body;
    let items = agents["items"].as_array().expect("agents");
    assert_eq!(items.len(), 1, "{agents}");
    assert_eq!(items[0]["name"], "default", "{agents}");
    items[0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_cli_bootstraps_the_local_agent_and_stays_echo_without_a_model() {
    let _ = runner_binary("local-agent");
    let _ = runner_binary("echo");
    let key_env = "SB_TEST_DEV_MODEL_KEY";
    let key = format!("sk-dev-{}", uuid::Uuid::new_v4().simple());
    let (base, fake) = serve(&key).await;
    let dir = tempfile::tempdir().unwrap();
    let model_url = format!("{base}/v1");
    let with_model = [
        "--model-url",
        model_url.as_str(),
        "--model",
        FALLBACK,
        "--model-key-env",
        key_env,
    ];
    let env = [(key_env, key.as_str())];

    // A fresh data directory without a model: the echo agent, and the banner says so.
    let dev = Dev::start(dir.path(), &[], &env);
    assert!(
        dev.banner
            .contains(&format!("answers message.received with {ECHO_RUNNER_ID}")),
        "{}",
        dev.banner
    );
    assert!(
        dev.banner
            .contains("model     none: the default agent echoes"),
        "{}",
        dev.banner
    );
    assert_eq!(only_agent(&dev.client).await["runner_id"], ECHO_RUNNER_ID);
    dev.stop();

    // One configuration step: the local agent on that model, answering through it.
    let dev = Dev::start(dir.path(), &with_model, &env);
    assert!(
        dev.banner.contains(&format!(
            "(updated) answers message.received with {LOCAL_AGENT_RUNNER_ID}"
        )),
        "{}",
        dev.banner
    );
    assert!(
        dev.banner
            .contains(&format!("model     {FALLBACK} at {model_url}")),
        "{}",
        dev.banner
    );
    assert!(
        dev.banner.contains(key_env),
        "the key's variable is allowed: {}",
        dev.banner
    );
    let agent = only_agent(&dev.client).await;
    assert_eq!(agent["runner_id"], LOCAL_AGENT_RUNNER_ID);
    let models = dev.client.get("/v1/models").await.expect(200).body;
    let model_id = models["items"][0]["model_id"].as_str().unwrap().to_owned();
    assert_eq!(
        agent["runner_config"]["model"]["primary"],
        model_id.as_str()
    );
    assert_eq!(models["items"][0]["api_key_env"], key_env);
    let (run_id, _) = turn(&dev.client, "dev-cli", "hello there").await;
    let items = dev.client.run_events(run_id, 0).await;
    assert_eq!(deltas(&items), REPLY, "the model's answer, streamed");
    assert_eq!(fake.chats().len(), 1);
    dev.stop();

    // The flags dropped: echo again.
    let dev = Dev::start(dir.path(), &[], &env);
    assert_eq!(only_agent(&dev.client).await["runner_id"], ECHO_RUNNER_ID);
    assert!(dev.banner.contains("model     none"), "{}", dev.banner);
    dev.stop();

    // The flags again: the same model, updated in place, not a second one.
    let dev = Dev::start(dir.path(), &with_model, &env);
    assert_eq!(
        only_agent(&dev.client).await["runner_id"],
        LOCAL_AGENT_RUNNER_ID
    );
    let models = dev.client.get("/v1/models").await.expect(200).body;
    let items = models["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{models}");
    assert_eq!(items[0]["model_id"], model_id.as_str());
    dev.stop();
    assert_eq!(fake.bad_auth.load(Ordering::SeqCst), 0);
}
