//! The turn API scenario of issue 14 (sessions, turns, wait, events, history, idempotency,
//! cancel), written once against a [`Client`] so that embedded and cluster mode run the
//! same steps.

use std::time::Duration;

use serde_json::{Value, json};

use crate::{Client, wait_for};

/// Creates the agent that answers `message.received` with `runner_id` in conversation
/// `scope_conversation` only (returns its id): a session pins it whatever its scope says.
async fn agent_on(client: &Client, runner_id: &str, scope_conversation: &str) -> String {
    client
        .create_agent(&json!({
            "name": format!("turns-{}", uuid::Uuid::new_v4().simple()),
            "runner_id": runner_id,
            "scope": {"conversation_id": scope_conversation},
        }))
        .await
        .expect(201)
        .str("agent_id")
        .to_owned()
}

async fn session(client: &Client, agent_id: &str) -> String {
    client
        .post("/v1/sessions", &json!({"agent_id": agent_id}))
        .await
        .expect(201)
        .str("session_id")
        .to_owned()
}

async fn wait_terminal(client: &Client, turn_id: &str) -> Value {
    for _ in 0..10 {
        let snapshot = client
            .get(&format!("/v1/turns/{turn_id}/wait?timeout_ms=5000"))
            .await
            .expect(200)
            .body;
        if !matches!(snapshot["status"].as_str(), Some("queued" | "running")) {
            return snapshot;
        }
    }
    panic!("turn {turn_id} did not end");
}

/// The whole scenario. `echo_runner` answers with the input text; `test_runner` is
/// `sb-test-runner` (its `cancellable` script waits for a cancel).
pub async fn turn_api_scenario(client: &Client, echo_runner: &str, test_runner: &str) {
    // A session on the echo runner, through an agent scoped to another conversation: the
    // session's agent wins over scope resolution (and over the workspace's default agent).
    let echo_agent = agent_on(client, echo_runner, "not-this-one").await;
    let session_id = session(client, &echo_agent).await;
    let got = client
        .get(&format!("/v1/sessions/{session_id}"))
        .await
        .expect(200);
    assert_eq!(got.body["agent_id"], echo_agent.as_str());
    assert_eq!(got.body["runner_id"], echo_runner);
    let listed = client.get("/v1/sessions?limit=100").await.expect(200).body;
    assert!(
        listed["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["session_id"] == session_id.as_str())
    );

    let turns = format!("/v1/sessions/{session_id}/turns");
    let request = json!({"idempotency_key": "turn:1", "text": "hello turn api"});
    let receipt = client.post(&turns, &request).await.expect(202);
    let turn_id = receipt.str("turn_id").to_owned();
    assert!(matches!(receipt.str("status"), "queued" | "running"));

    let done = wait_terminal(client, &turn_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["result"]["text"], "hello turn api", "{done}");
    assert!(done.get("failure").is_none());
    // The turn id is the run id.
    let run = client.get(&format!("/v1/runs/{turn_id}")).await.expect(200);
    assert_eq!(run.body["status"], "completed");
    assert_eq!(run.body["agent_id"], echo_agent.as_str(), "{}", run.body);

    // Events from the start, then resumed after a sequence.
    let all = client
        .get(&format!("/v1/turns/{turn_id}/events?after_sequence=0"))
        .await
        .expect(200)
        .body;
    let events = all["events"].as_array().unwrap();
    assert!(events.len() >= 2, "{all}");
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event["sequence"], i as u64 + 1);
        assert_eq!(event["turn_id"], turn_id.as_str());
        assert_eq!(event["session_id"], session_id.as_str());
        assert!(event["timestamp"].as_i64().is_some());
    }
    assert_eq!(events.last().unwrap()["type"], "run.completed");
    assert_eq!(all["gap"], false);
    assert_eq!(all["next_sequence"], events.len() as u64);
    assert_eq!(all["snapshot"]["status"], "completed");
    let rest = client
        .get(&format!("/v1/turns/{turn_id}/events?after_sequence=1"))
        .await
        .expect(200)
        .body;
    assert_eq!(rest["events"][0]["sequence"], 2);
    assert_eq!(rest["events"].as_array().unwrap().len(), events.len() - 1);

    // History: the user's message and the assistant's answer.
    let history = wait_for("the turn in the session history", || async {
        let page = client
            .get(&format!(
                "/v1/sessions/{session_id}/history?direction=forward"
            ))
            .await
            .expect(200)
            .body;
        let roles: Vec<String> = page["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|i| i["role"].as_str().map(str::to_owned))
            .collect();
        (roles.contains(&"user".to_owned()) && roles.contains(&"assistant".to_owned()))
            .then_some(page)
    })
    .await;
    assert_eq!(history["items"][0]["role"], "user", "{history}");
    assert_eq!(history["items"][0]["content"], "hello turn api");

    // Replay: the same turn, nothing re-run. Another request with the key: 409.
    let replay = client.post(&turns, &request).await.expect(202);
    assert_eq!(replay.str("turn_id"), turn_id);
    assert_eq!(replay.str("status"), "completed");
    let changed = json!({"idempotency_key": "turn:1", "text": "something else"});
    let conflict = client.post(&turns, &changed).await.expect(409);
    assert_eq!(conflict.str("code"), "conflict");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let runs = client
        .get(&format!("/v1/runs?conversation_id=session:{session_id}"))
        .await
        .expect(200)
        .body;
    assert_eq!(runs["items"].as_array().unwrap().len(), 1, "{runs}");

    // Cancel of a finished turn: false, result unchanged.
    let cancel = client
        .post(&format!("/v1/turns/{turn_id}/cancel"), &json!({}))
        .await
        .expect(200);
    assert_eq!(cancel.body["cancelled"], false);
    let after = client
        .get(&format!("/v1/turns/{turn_id}"))
        .await
        .expect(200);
    assert_eq!(after.body["result"]["text"], "hello turn api");

    // Cancel of a running turn: the runner stops, the turn ends `cancelled`.
    let slow_agent = agent_on(client, test_runner, "not-this-one-either").await;
    let slow_session = session(client, &slow_agent).await;
    let receipt = client
        .post(
            &format!("/v1/sessions/{slow_session}/turns"),
            &json!({"idempotency_key": "slow-1", "text": "cancellable"}),
        )
        .await
        .expect(202);
    let slow_turn = receipt.str("turn_id").to_owned();
    wait_for("the slow turn to run", || async {
        let snap = client
            .get(&format!("/v1/turns/{slow_turn}"))
            .await
            .expect(200)
            .body;
        (snap["status"] == "running" && snap["last_sequence"].as_i64() > Some(0)).then_some(())
    })
    .await;
    let cancel = client
        .post(&format!("/v1/turns/{slow_turn}/cancel"), &json!({}))
        .await
        .expect(200);
    assert_eq!(cancel.body["cancelled"], true, "{}", cancel.body);
    let ended = wait_terminal(client, &slow_turn).await;
    assert_eq!(ended["status"], "cancelled", "{ended}");
    assert_eq!(ended["failure"]["code"], "cancelled", "{ended}");
    assert!(ended.get("result").is_none());

    // A closed session refuses turns; its history stays readable.
    client
        .delete(&format!("/v1/sessions/{session_id}"))
        .await
        .expect(200);
    client
        .post(
            &turns,
            &json!({"idempotency_key": "turn:2", "text": "after close"}),
        )
        .await
        .expect(409);
    client
        .get(&format!("/v1/sessions/{session_id}/history"))
        .await
        .expect(200);
    client
        .get(&format!("/v1/turns/{turn_id}"))
        .await
        .expect(200);
}
