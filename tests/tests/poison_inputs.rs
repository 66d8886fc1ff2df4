//! Issue 15 finding 2: NUL characters (U+0000). PostgreSQL stores none in `text` or `jsonb`,
//! so a NUL in an ingest body, a name or a path id used to reach the store and answer `500`,
//! and a runner delta holding one failed its ledger insert and was dead-lettered, leaving the
//! run with a sequence silently missing. Now requests with a NUL are refused at the edge
//! (`400 invalid_argument`, the same in both modes), and NULs in runner output are replaced
//! with U+FFFD before the item gets its sequence.
//!
//! The same checks run in embedded mode (SQLite, memory bus) and in cluster mode (separate
//! processes on the local RabbitMQ, Redis and Postgres; skipped when a service is
//! unreachable; build the binaries first: `cargo build --workspace --bins`).

use sb_protocol::result::AgentRunResult;
use sb_tests::cluster::{ClusterSpec, TestCluster as Cluster};
use sb_tests::{Client, TEST_SHARED, TestCluster, message};
use serde_json::{Value, json};

/// A runner script whose delta carries a NUL. The script is the input text, so the NUL is
/// written as the JSON escape `\u0000` *inside* the text (a backslash and five characters,
/// which the gateway accepts); the runner's JSON parser turns it into the character.
fn nul_delta_script() -> String {
    let script = r#"[{"type":"message.delta","data":{"chunk":{"role":"assistant","content":"a\u0000b"}}},{"type":"message.completed","data":{"message":{"role":"assistant","content":"a\u0000b"}}}]"#;
    format!("raw {script}")
}

/// Every way a NUL can come in through the API is refused with `400 invalid_argument`.
async fn nul_requests_are_refused(client: &Client) {
    let mut bodies = Vec::new();
    let mut text = message("nul", "a\u{0}b");
    bodies.push(("input.text", text.clone()));
    text["input"]["text"] = json!("fine");
    text["actor"]["actor_name"] = json!("Ann\u{0}");
    bodies.push(("actor name", text.clone()));
    text["actor"]["actor_name"] = json!("Ann");
    text["data"] = json!({"k": "\u{0}"});
    bodies.push(("data", text.clone()));
    for (what, body) in &bodies {
        let answer = client.post("/v1/events", body).await;
        assert_refused(&answer.status, &answer.body, what);
    }
    let agent = client
        .post(
            "/v1/agents",
            &json!({"name": "a\u{0}", "runner_id": TEST_SHARED, "scope": {"bot_id": "nul"}}),
        )
        .await;
    assert_refused(&agent.status, &agent.body, "agent name");
    for path in [
        "/v1/conversations/a%00b/transcript",
        "/v1/runs/%00",
        "/v1/agents/%00",
        "/v1/runs?conversation_id=%00",
    ] {
        let answer = client.get(path).await;
        assert_refused(&answer.status, &answer.body, path);
    }
}

fn assert_refused(status: &u16, body: &Value, what: &str) {
    assert_eq!(*status, 400, "{what}: {body}");
    assert_eq!(body["code"], "invalid_argument", "{what}: {body}");
    assert!(
        body["message"].as_str().unwrap_or_default().contains("NUL"),
        "{what}: {body}"
    );
}

/// The run completed with a dense sequence, one terminal item, and U+FFFD where the NUL was.
fn assert_replaced(items: &[AgentRunResult]) {
    let sequences: Vec<u64> = items.iter().filter_map(|i| i.sequence).collect();
    assert_eq!(
        sequences,
        (1..=items.len() as u64).collect::<Vec<_>>(),
        "dense: {items:?}"
    );
    let types: Vec<&str> = items.iter().map(|i| i.result_type.as_str()).collect();
    assert_eq!(
        types,
        ["message.delta", "message.completed", "run.completed"],
        "{items:?}"
    );
    assert_eq!(items[0].data["chunk"]["content"], "a\u{FFFD}b");
    assert_eq!(items[1].data["message"]["content"], "a\u{FFFD}b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_characters_in_embedded_mode() {
    let cluster = TestCluster::embedded().await;
    let client = cluster.client();
    nul_requests_are_refused(client).await;

    client.conversation_agent("nul-runner", TEST_SHARED).await;
    let event = client.send_message("nul-runner", &nul_delta_script()).await;
    let run_id = client.run_of(event).await;
    let run = client.wait_run_terminal(run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_replaced(&client.run_events(run_id, 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_characters_in_cluster_mode_on_postgres() {
    let Some(cluster) = Cluster::spawn_or_skip(ClusterSpec::default()).await else {
        return;
    };
    let client = cluster.client(0);
    nul_requests_are_refused(&client).await;

    client.conversation_agent("nul-runner", TEST_SHARED).await;
    let body = message("nul-runner", &nul_delta_script());
    let accepted = client.post_event(&body, None).await.expect(202);
    let run_id = client
        .run_of(accepted.str("event_id").parse().unwrap())
        .await;
    let run = client.wait_run_terminal(run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_replaced(&client.run_events(run_id, 0).await);
}
