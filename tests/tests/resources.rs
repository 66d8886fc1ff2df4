//! Models, tools and knowledge bases end to end (issue 6): a real runner process built on
//! the `sb-runner` SDK (`sb-api-runner`, see tests/host_api.rs) calls a streaming model, an
//! HTTP tool (idempotently) and a knowledge base through the worker of an embedded host.
//! The model provider and the tool are local axum servers started by the test; the
//! resources are registered in the cluster's registry and granted by the agent's resource
//! policy, which is what makes the orchestrator's store-backed catalog grant them.
//!
//! Needs the runner binaries: `cargo build --workspace --bins` (scripts/test does it).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::Router;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use sb_protocol::result::AgentRunResult;
use sb_store::{ModelKind, NewKbDocument, NewModel, NewTool};
use sb_tests::{Client, TestCluster, runner_binary};
use serde_json::{Value, json};

const API: &str = "plugin:switchboard-tests/sdk-api/default";
/// Holds the "API key" and the tool header value: every process has it, and setting an
/// environment variable needs `unsafe`.
const SECRET_ENV: &str = "PATH";

fn secret() -> String {
    std::env::var(SECRET_ENV).expect("PATH is set")
}

async fn providers(tool_runs: Arc<AtomicU32>) -> String {
    async fn chat(headers: HeaderMap) -> Response {
        if headers.get("authorization").and_then(|v| v.to_str().ok())
            != Some(format!("Bearer {}", secret()).as_str())
        {
            return axum::http::StatusCode::UNAUTHORIZED.into_response();
        }
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
        ([("content-type", "text/event-stream")], body).into_response()
    }
    let runs = tool_runs.clone();
    let tool = move |body: String| {
        let runs = runs.clone();
        async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let params: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
            axum::Json(json!({"echo": params, "execution": n}))
        }
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/tool", post(tool));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

/// The outcomes `sb-api-runner` reported in its `message.completed`.
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
async fn a_runner_streams_a_model_calls_a_tool_and_retrieves_knowledge() {
    let _ = runner_binary("sb-api-runner");
    let tool_runs = Arc::new(AtomicU32::new(0));
    let base = providers(tool_runs.clone()).await;
    let cluster = TestCluster::builder().start().await;
    let ws = sb_protocol::ids::WorkspaceId::default_workspace();
    let r = &cluster.stores().resources;
    let model = r
        .create_model(NewModel {
            workspace_id: ws.clone(),
            name: "fake".into(),
            kind: ModelKind::Llm,
            base_url: format!("{base}/v1"),
            model_name: "fake-1".into(),
            api_key_env: Some(SECRET_ENV.into()),
            context_window: Some(8192),
            extra_args: None,
        })
        .await
        .unwrap();
    r.create_tool(NewTool {
        workspace_id: ws.clone(),
        name: "echo".into(),
        kind: "http".into(),
        description: "echoes".into(),
        parameters: json!({"type": "object"}),
        config: json!({"url": format!("{base}/tool"), "timeout_ms": 5000}),
    })
    .await
    .unwrap();
    let kb = r.create_kb(&ws, "handbook", None).await.unwrap();
    let other = r.create_kb(&ws, "secret-handbook", None).await.unwrap();
    for kb_id in [kb.kb_id, other.kb_id] {
        r.add_document(NewKbDocument {
            workspace_id: ws.clone(),
            kb_id,
            title: "leave".into(),
            text: "Annual leave is 25 days.".into(),
            artifact_id: None,
            metadata: json!({}),
        })
        .await
        .unwrap();
    }

    let client = cluster.client();
    let conversation = format!("res-{}", uuid::Uuid::new_v4().simple());
    let created = client
        .create_agent(&json!({
            "name": format!("agent-{conversation}"),
            "runner_id": API,
            "scope": {"conversation_id": conversation},
            "resource_policy": {
                "allowed_model_uuids": [model.model_id.to_string()],
                "allowed_tool_names": ["echo"],
                "allowed_kb_uuids": [kb.kb_id.to_string()],
            },
        }))
        .await
        .expect(201);
    let _ = created.str("agent_id");

    let messages = json!([{"role": "user", "content": "hi"}]);
    let steps = json!([
        {"do": "call_stream", "action": "invoke_llm_stream",
         "params": {"llm_model_uuid": model.model_id.to_string(), "messages": messages}},
        {"do": "call", "action": "call_tool",
         "params": {"tool_name": "echo", "parameters": {"x": 1}, "call_id": "c1"}},
        {"do": "call", "action": "call_tool",
         "params": {"tool_name": "echo", "parameters": {"x": 1}, "call_id": "c1"}},
        {"do": "call", "action": "call_tool",
         "params": {"tool_name": "echo", "parameters": {"x": 2}, "call_id": "c1"}},
        {"do": "call", "action": "retrieve_knowledge",
         "params": {"kb_id": kb.kb_id.to_string(), "query_text": "annual leave"}},
        {"do": "call", "action": "retrieve_knowledge",
         "params": {"kb_id": other.kb_id.to_string(), "query_text": "leave"}},
        {"do": "context"},
    ]);
    let o = outcomes(client, &conversation, &steps).await;
    let codes: Vec<&str> = o.iter().map(code).collect();
    assert_eq!(
        codes,
        vec!["ok", "ok", "ok", "conflict", "ok", "unauthorized", "ok"],
        "{o:#?}"
    );
    let chunks: Vec<&str> = o[0]["data"]["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["chunk"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(chunks, vec!["hel", "lo"]);
    assert_eq!(o[0]["data"]["data"]["usage"]["total_tokens"], 3);
    assert_eq!(o[1]["data"]["result"]["echo"]["x"], 1);
    assert_eq!(o[2]["data"], o[1]["data"], "replayed, not re-executed");
    assert_eq!(tool_runs.load(Ordering::SeqCst), 1);
    assert_eq!(o[4]["data"]["results"][0]["title"], "leave");
    let ctx = &o[6]["data"];
    assert_eq!(
        ctx["runtime"]["metadata"]["model_context_window_tokens"],
        8192
    );
    let granted: Vec<&str> = ctx["resources"]["knowledge_bases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["kb_id"].as_str().unwrap())
        .collect();
    assert_eq!(granted, vec![kb.kb_id.to_string().as_str()]);
    assert!(!o.iter().any(|x| x.to_string().contains(&secret())));
}
