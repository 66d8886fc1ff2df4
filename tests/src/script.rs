//! Scripted Host API runs, shared by the end-to-end suites (`tests/tests/host_api.rs`,
//! `tests/tests/cluster_conversations.rs`, `tests/tests/resources.rs`,
//! `tests/tests/budgets.rs`) and usable with either harness: every helper that drives a
//! run takes a [`Client`] (the embedded [`TestCluster`](crate::TestCluster)'s or one of a
//! [`cluster::TestCluster`](crate::cluster::TestCluster)'s gateways) and, where it reads or
//! writes the database directly, the deployment's [`Stores`].
//!
//! The scripted runner is `sb-api-runner` (`tests/src/bin`): the input text of a message is a
//! JSON array of steps, and the run reports one outcome per step (`{"do", "ok", "data" |
//! "error"}`) in its `message.completed`. Two plugins run it: [`API`] (every permission, and
//! steering) and [`BARE`] (no permission, no steering).
//!
//! # Layout
//! - [`agent`], [`patch_agent`]: agents bound to a runner for one conversation;
//! - [`start_script`], [`report`], [`outcomes`], [`script`]: post a script, collect what it
//!   reported;
//! - [`code`], [`ok`], [`details`], [`assert_codes`]: check the outcomes;
//! - [`serve_local`]: the fake model providers and HTTP tools a script calls;
//! - [`announced`], [`remote`], [`assert_remote_refused`]: the remote Host API of a run;
//! - [`cancel`], [`wait_claimed`], [`open_barrier`], [`audit_rows`]: act on and observe a run
//!   while it is active.

use std::time::Duration;

use sb_protocol::ids::{EventId, RunId, WorkspaceId};
use sb_protocol::result::AgentRunResult;
use sb_store::{EventQuery, EventRecord, Stores};
use serde_json::{Value, json};

use crate::{ApiResponse, Client, runner_binary, wait_for};

/// `sb-api-runner` with every permission and steering.
pub const API: &str = "plugin:switchboard-tests/sdk-api/default";
/// The plugin identity of [`API`] (the owner of its plugin storage).
pub const API_PLUGIN: &str = "switchboard-tests/sdk-api";
/// `sb-api-runner` without any permission and without steering: every message of a
/// conversation goes through the agent's concurrency policy.
pub const BARE: &str = "plugin:switchboard-tests/sdk-api-bare/default";

/// Panics with the build command unless the `sb-api-runner` binary exists (the harnesses
/// only check for the runners every suite needs).
pub fn require_api_runner() {
    let _ = runner_binary("sb-api-runner");
}

/// `<prefix>-<random>`: conversation, agent and artifact names that no other test uses.
#[must_use]
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// Creates an agent for `conversation` bound to `runner`; `extra` adds or replaces fields of
/// the body (policies, `runner_config`). Returns its id.
///
/// An agent scoped to a conversation is more specific than the workspace-wide echo agent both
/// harnesses start with, so it alone answers that conversation.
pub async fn agent(client: &Client, conversation: &str, runner: &str, extra: Value) -> String {
    let mut body = json!({
        "name": unique("agent"),
        "runner_id": runner,
        "scope": {"conversation_id": conversation},
    });
    for (k, v) in extra.as_object().expect("extra is an object") {
        body[k] = v.clone();
    }
    let created = client.create_agent(&body).await.expect(201);
    created.str("agent_id").to_owned()
}

/// `PATCH /v1/agents/{id}` with `body`; panics unless the gateway accepts it (any `2xx`).
/// Returns the response, for callers that check the exact status or the updated agent.
pub async fn patch_agent(client: &Client, agent_id: &str, body: &Value) -> ApiResponse {
    let response = Client::send(
        client
            .request(reqwest::Method::PATCH, &format!("/v1/agents/{agent_id}"))
            .json(body),
    )
    .await;
    assert!(
        (200..300).contains(&response.status),
        "patch refused: {} {}",
        response.status,
        response.body
    );
    response
}

/// Posts `steps` as a message in `conversation`; returns the event and its run.
pub async fn start_script(client: &Client, conversation: &str, steps: &Value) -> (EventId, RunId) {
    let event = client.send_message(conversation, &steps.to_string()).await;
    let run_id = client.run_of(event).await;
    (event, run_id)
}

/// The text of a message-like item (`data.message.content` or `data.chunk.content`).
#[must_use]
pub fn content_of(item: &AgentRunResult, key: &str) -> Option<String> {
    match item.data.get(key)?.get("content")? {
        Value::String(text) => Some(text.clone()),
        Value::Array(blocks) => Some(
            blocks
                .iter()
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect(),
        ),
        _ => None,
    }
}

/// What an ended scripted run left behind.
#[derive(Debug)]
pub struct Report {
    /// The run (`GET /v1/runs/{id}`) in its terminal status.
    pub run: Value,
    /// Every result item of the run, in sequence order.
    pub items: Vec<AgentRunResult>,
    /// The outcomes it reported, one per step that ran.
    pub outcomes: Vec<Value>,
}

/// Waits for the run to end and returns what it left: the run, its result items and the
/// outcomes it reported. Panics, with the run's items, when it reported none.
///
/// The run's status becomes terminal when its result is persisted, a moment before the worker
/// ends its session; until then, a message in the same conversation could still be claimed
/// as steering by the ending run. So this also waits until the run's remote Host API refuses
/// the run's own token (`unauthorized`: its session is gone), which checks on the way that
/// every run's token dies with it.
pub async fn report(client: &Client, run_id: RunId) -> Report {
    let run = client.wait_run_terminal(run_id).await;
    let items = client.run_events(run_id, 0).await;
    let text = items
        .iter()
        .find(|i| i.result_type == "message.completed")
        .and_then(|i| content_of(i, "message"))
        .unwrap_or_else(|| panic!("run {run_id} reported nothing: {run} {items:?}"));
    let report: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("bad report ({e}): {text}"));
    assert_eq!(report["run_id"], run_id.to_string(), "{report}");
    let url = report["host_api"]["url"].as_str().expect("a host api url");
    let token = report["host_api"]["token"]
        .as_str()
        .expect("a host api token");
    wait_for(&format!("the session of run {run_id} to end"), || async {
        let (status, body) = remote(
            client.base_url(),
            url,
            Some(token),
            run_id,
            "get_host_version",
            json!({}),
        )
        .await;
        // 401: the token no longer opens a live run (the session is gone).
        assert!(matches!(status, 200 | 401), "{status} {body}");
        (status == 401).then_some(())
    })
    .await;
    Report {
        run,
        items,
        outcomes: report["outcomes"].as_array().expect("outcomes").clone(),
    }
}

/// Waits for the run to end and returns the outcomes it reported (see [`report`]).
pub async fn outcomes(client: &Client, run_id: RunId) -> Vec<Value> {
    report(client, run_id).await.outcomes
}

/// Runs a script in `conversation` and returns its outcomes, one per step.
pub async fn script(client: &Client, conversation: &str, steps: Value) -> Vec<Value> {
    let (_, run_id) = start_script(client, conversation, &steps).await;
    let outcomes = outcomes(client, run_id).await;
    assert_eq!(
        outcomes.len(),
        steps.as_array().expect("steps are an array").len(),
        "{outcomes:?}"
    );
    outcomes
}

/// An outcome's code: `"ok"` for a success, else its error's code (`"?"` when it has none).
#[must_use]
pub fn code(outcome: &Value) -> &str {
    if outcome["ok"] == true {
        "ok"
    } else {
        outcome["error"]["code"].as_str().unwrap_or("?")
    }
}

/// The data of a successful outcome.
#[track_caller]
#[must_use]
pub fn ok(outcome: &Value) -> &Value {
    assert_eq!(outcome["ok"], true, "expected success: {outcome}");
    &outcome["data"]
}

/// The error `details` of a failed outcome; panics unless it failed, and when it carries data
/// besides its error.
#[track_caller]
#[must_use]
pub fn details(outcome: &Value) -> &Value {
    assert!(outcome["ok"] == false, "expected a failure: {outcome}");
    assert!(outcome.get("data").is_none(), "an error carries no data");
    &outcome["error"]["details"]
}

/// Asserts each outcome's code (`"ok"` for a success), naming the step on failure.
#[track_caller]
pub fn assert_codes(outcomes: &[Value], expected: &[&str]) {
    assert_eq!(outcomes.len(), expected.len(), "{outcomes:#?}");
    for (i, (outcome, want)) in outcomes.iter().zip(expected).enumerate() {
        assert_eq!(code(outcome), *want, "step {i}: {outcome}");
    }
}

/// The remote Host API of an active run, from its `announce` delta: `(url path, token)`.
/// Returning proves the run is executing in a runner process right now.
pub async fn announced(client: &Client, run_id: RunId) -> (String, String) {
    wait_for(&format!("run {run_id} to announce itself"), || async {
        let items = client.run_events(run_id, 0).await;
        items
            .iter()
            .filter(|i| i.result_type == "message.delta")
            .filter_map(|i| content_of(i, "chunk"))
            .filter_map(|text| serde_json::from_str::<Value>(&text).ok())
            .find(|v| v["run_id"] == run_id.to_string())
            .map(|v| {
                (
                    v["host_api"]["url"].as_str().unwrap_or_default().to_owned(),
                    v["host_api"]["token"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                )
            })
    })
    .await
}

/// A remote runner: `POST {base}{url}/{action}` with `token` for `run_id`; the status and the
/// JSON body (`null` when the body is not JSON).
pub async fn remote(
    base: &str,
    url: &str,
    token: Option<&str>,
    run_id: RunId,
    action: &str,
    params: Value,
) -> (u16, Value) {
    let mut request = reqwest::Client::new()
        .post(format!("{base}{url}/{action}"))
        .json(&json!({"run_id": run_id, "params": params}));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = tokio::time::timeout(Duration::from_secs(30), request.send())
        .await
        .expect("the remote call timed out")
        .expect("the remote call failed");
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, body)
}

/// Asserts a remote refusal: status, code and the runner-facing error shape.
#[track_caller]
pub fn assert_remote_refused(answer: &(u16, Value), status: u16, code: &str) {
    assert_eq!(answer.0, status, "{}", answer.1);
    assert_eq!(answer.1["code"], code, "{}", answer.1);
    assert!(answer.1["retryable"].is_boolean(), "{}", answer.1);
    assert!(answer.1["details"].is_object(), "{}", answer.1);
}

/// `POST /v1/runs/{id}/cancel`; panics unless the gateway accepts it.
pub async fn cancel(client: &Client, run_id: RunId) {
    let response = client
        .post(&format!("/v1/runs/{run_id}/cancel"), &json!({}))
        .await;
    assert!(
        (200..300).contains(&response.status),
        "cancel refused: {}",
        response.body
    );
}

/// Waits until `event_id` was routed, and asserts it was claimed as steering by `run_id`.
pub async fn wait_claimed(client: &Client, event_id: EventId, run_id: RunId) {
    let event = client.wait_routed(event_id).await;
    assert_eq!(event["status"], "claimed", "{event}");
    assert_eq!(event["claimed_by_run_id"], run_id.to_string(), "{event}");
}

/// Opens a `wait_storage` barrier of the [`API`] plugin: a run waiting on `key` in its plugin
/// storage goes on.
pub async fn open_barrier(stores: &Stores, key: &str) {
    stores
        .storage
        .set("plugin", API_PLUGIN, key, b"go".to_vec())
        .await
        .expect("the barrier key is written");
}

/// Event-log rows of `event_type` in `conversation` (workspace `default`), oldest first.
pub async fn audit_rows(stores: &Stores, conversation: &str, event_type: &str) -> Vec<EventRecord> {
    let mut query = EventQuery::new(WorkspaceId::default_workspace());
    query.conversation_id = Some(conversation.to_owned());
    query.event_types = vec![event_type.to_owned()];
    query.limit = Some(100);
    let mut rows = stores.events.page(query).await.expect("event page").items;
    rows.reverse();
    rows
}

/// Serves `app` on a free port of 127.0.0.1 until the test ends; returns its base URL
/// (`http://127.0.0.1:<port>`).
///
/// The fake model providers and HTTP tools the suites register: the host reaches them from a
/// worker over the network like any registered provider or tool, so they need a real socket
/// (the worker is the test process in embedded mode, a separate process in cluster mode).
pub async fn serve_local(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a local port");
    let addr = listener.local_addr().expect("the local address");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}
