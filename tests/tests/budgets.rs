//! Per-agent budget overrides end to end (SPEC §8): an agent created through the gateway
//! with `budgets` runs a real runner process (`sb-api-runner`, on the `sb-runner` SDK) whose
//! Host API calls are refused with `budget_exceeded` past the agent's own limit, not the
//! host default. The HTTP tool is a local axum server started by the test and registered
//! through `POST /v1/tools`.
//!
//! Needs the runner binaries: `cargo build --workspace --bins` (scripts/test does it).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::Router;
use axum::routing::post;
use sb_protocol::result::AgentRunResult;
use sb_tests::{Client, TestCluster, runner_binary};
use serde_json::{Value, json};

const API: &str = "plugin:switchboard-tests/sdk-api/default";

/// An HTTP tool that counts its executions; returns its URL.
async fn counting_tool(executions: Arc<AtomicU32>) -> String {
    let tool = move |body: String| {
        let executions = executions.clone();
        async move {
            let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
            let params: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
            axum::Json(json!({"echo": params, "execution": n}))
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().route("/tool", post(tool));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}/tool")
}

/// Runs `steps` in `conversation` and returns the outcomes `sb-api-runner` reported.
async fn outcomes(client: &Client, conversation: &str, steps: &Value) -> Vec<Value> {
    let event = client.send_message(conversation, &steps.to_string()).await;
    let run_id = client.run_of(event).await;
    let run = client.wait_run_terminal(run_id).await;
    let items: Vec<AgentRunResult> = client.run_events(run_id, 0).await;
    let text = items
        .iter()
        .find(|i| i.result_type == "message.completed")
        .and_then(|i| i.data["message"]["content"].as_str().map(str::to_owned))
        .unwrap_or_else(|| panic!("run {run_id} reported nothing: {run} {items:?}"));
    let report: Value = serde_json::from_str(&text).unwrap();
    report["outcomes"].as_array().expect("outcomes").clone()
}

fn code(outcome: &Value) -> &str {
    if outcome["ok"] == true {
        "ok"
    } else {
        outcome["error"]["code"].as_str().unwrap_or("?")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_tool_call_budget_is_enforced_per_run() {
    let _ = runner_binary("sb-api-runner");
    let executions = Arc::new(AtomicU32::new(0));
    let url = counting_tool(executions.clone()).await;
    let cluster = TestCluster::builder().start().await;
    let client = cluster.client();
    client
        .post(
            "/v1/tools",
            &json!({"name": "count", "description": "counts", "parameters": {"type": "object"},
                    "kind": "http", "url": url, "timeout_ms": 5000}),
        )
        .await
        .expect(201);
    let conversation = format!("budget-{}", uuid::Uuid::new_v4().simple());
    let agent = client
        .create_agent(&json!({
            "name": format!("agent-{conversation}"),
            "runner_id": API,
            "scope": {"conversation_id": conversation},
            "resource_policy": {"allowed_tool_names": ["count"]},
            "budgets": {"max_tool_calls": 1},
        }))
        .await
        .expect(201);
    assert_eq!(agent.body["budgets"], json!({"max_tool_calls": 1}));
    let agent_id = agent.str("agent_id").to_owned();

    let call = |n: u32| {
        json!({"do": "call", "action": "call_tool",
               "params": {"tool_name": "count", "parameters": {"n": n}}})
    };
    let steps = json!([call(1), call(2), call(3)]);
    let o = outcomes(client, &conversation, &steps).await;
    let codes: Vec<&str> = o.iter().map(code).collect();
    // The 2nd call passes the agent's budget of 1 (the default is 32); once exhausted the
    // budget stays exhausted for the run.
    assert_eq!(
        codes,
        ["ok", "budget_exceeded", "budget_exceeded"],
        "{o:#?}"
    );
    assert_eq!(o[0]["data"]["result"]["echo"]["n"], 1);
    assert_eq!(o[1]["error"]["details"]["budget"], "tool_calls", "{o:#?}");
    assert_eq!(o[1]["error"]["details"]["limit"], 1, "{o:#?}");
    assert_eq!(
        executions.load(Ordering::SeqCst),
        1,
        "refused calls never reach the tool"
    );

    // A changed override applies to the next run, which starts with a fresh budget.
    let response = reqwest::Client::new()
        .patch(format!("{}/v1/agents/{agent_id}", client.base_url()))
        .bearer_auth(cluster.process().api_key().expect("a key"))
        .json(&json!({"budgets": {"max_tool_calls": 2}}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let o = outcomes(client, &conversation, &steps).await;
    let codes: Vec<&str> = o.iter().map(code).collect();
    assert_eq!(codes, ["ok", "ok", "budget_exceeded"], "{o:#?}");
    assert_eq!(o[2]["error"]["details"]["limit"], 2, "{o:#?}");
    assert_eq!(executions.load(Ordering::SeqCst), 3);
    cluster.shutdown().await;
}
