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
use sb_tests::TestCluster;
use sb_tests::script::{
    API, assert_codes, details, ok, patch_agent, require_api_runner, script, serve_local, unique,
};
use serde_json::{Value, json};

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
    let base = serve_local(Router::new().route("/tool", post(tool))).await;
    format!("{base}/tool")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_tool_call_budget_is_enforced_per_run() {
    require_api_runner();
    let executions = Arc::new(AtomicU32::new(0));
    let url = counting_tool(executions.clone()).await;
    // The tool is a local server: loopback must be reachable (as `switchboard dev` allows).
    let cluster = TestCluster::builder()
        .config("egress.allow", "127.0.0.0/8")
        .start()
        .await;
    let client = cluster.client();
    client
        .post(
            "/v1/tools",
            &json!({"name": "count", "description": "counts", "parameters": {"type": "object"},
                    "kind": "http", "url": url, "timeout_ms": 5000}),
        )
        .await
        .expect(201);
    let conversation = unique("budget");
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
    let o = script(client, &conversation, steps.clone()).await;
    // The 2nd call passes the agent's budget of 1 (the default is 32); once exhausted the
    // budget stays exhausted for the run.
    assert_codes(&o, &["ok", "budget_exceeded", "budget_exceeded"]);
    assert_eq!(ok(&o[0])["result"]["echo"]["n"], 1);
    assert_eq!(details(&o[1])["budget"], "tool_calls", "{o:#?}");
    assert_eq!(details(&o[1])["limit"], 1, "{o:#?}");
    assert_eq!(
        executions.load(Ordering::SeqCst),
        1,
        "refused calls never reach the tool"
    );

    // A changed override applies to the next run, which starts with a fresh budget.
    patch_agent(
        client,
        &agent_id,
        &json!({"budgets": {"max_tool_calls": 2}}),
    )
    .await
    .expect(200);
    let o = script(client, &conversation, steps).await;
    assert_codes(&o, &["ok", "ok", "budget_exceeded"]);
    assert_eq!(details(&o[2])["limit"], 2, "{o:#?}");
    assert_eq!(executions.load(Ordering::SeqCst), 3);
    cluster.shutdown().await;
}
