//! The turn API (sessions, turns, snapshots) and the idempotency rule of `POST /v1/events`
//! (issue 14): contracts and refusals through the real router over SQLite. Nothing routes
//! events here; runs are written into the ledger directly to play the orchestrator and the
//! worker.

mod support;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use chrono::Utc;
use sb_protocol::ids::{AgentId, EventId, RunId, WorkspaceId};
use sb_store::{NewAgent, NewRun, NewRunEvent, RunOutcome, RunStatus, RunnerRow};
use serde_json::{Value, json};
use support::Harness;
use tower::ServiceExt;

const RUNNER: &str = "plugin:acme/echo/default";

async fn harness() -> Harness {
    Harness::start(sb_gateway::GatewayOptions::default()).await
}

impl Harness {
    /// `POST /v1/events` with `Idempotency-Key: key`: status, body, whether replayed.
    async fn ingest_keyed(&self, key: &str, body: &Value) -> (StatusCode, Value, bool) {
        let request = Request::post("/v1/events")
            .header(header::AUTHORIZATION, format!("Bearer {}", self.key))
            .header(header::CONTENT_TYPE, "application/json")
            .header("idempotency-key", key)
            .body(Body::from(body.to_string()))
            .unwrap();
        let response = self.app().oneshot(request).await.unwrap();
        let status = response.status();
        let replayed = response.headers().get("idempotent-replayed").is_some();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            replayed,
        )
    }

    /// An enabled `message.received` agent of `workspace` on the echo runner.
    async fn agent(&self, workspace: &str, enabled: bool) -> AgentId {
        self.stores
            .runners
            .upsert(RunnerRow {
                id: RUNNER.into(),
                plugin_id: "acme/echo".into(),
                pool: "default".into(),
                version: "1.0.0".into(),
                descriptor: json!({"id": RUNNER, "label": {"en_US": "Echo"}}),
                seen_at: Utc::now(),
            })
            .await
            .unwrap();
        let agent = NewAgent {
            id: None,
            workspace_id: WorkspaceId::new(workspace).unwrap(),
            name: format!("agent-{}", uuid::Uuid::new_v4().simple()),
            description: None,
            runner_id: RUNNER.into(),
            runner_config: json!({}),
            event_types: json!(["message.received"]),
            scope: json!({}),
            filters: json!([]),
            resource_policy: json!({}),
            state_policy: json!({}),
            delivery_policy: json!({}),
            budgets: json!({}),
            enabled,
            routing: sb_store::AgentRouting::Scope,
        };
        self.stores.agents.create(agent).await.unwrap().id
    }
}

fn message(text: &str) -> Value {
    json!({
        "event_type": "message.received", "source": "api", "conversation_id": "c1",
        "input": {"text": text}
    })
}

#[tokio::test]
async fn events_idempotency_key_with_another_request_is_a_conflict() {
    let h = harness().await;
    let (status, first, replayed) = h.ingest_keyed("order-1", &message("hi")).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    assert!(!replayed);

    // Same key, same request (other key order and whitespace): the same event.
    let same: Value = serde_json::from_str(
        r#"{ "input": {"text": "hi"}, "conversation_id": "c1", "source": "api",
             "event_type": "message.received" }"#,
    )
    .unwrap();
    let (status, again, replayed) = h.ingest_keyed("order-1", &same).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    assert!(replayed);
    assert_eq!(again["event_id"], first["event_id"]);

    // Same key, another request: refused, and nothing was written.
    let (status, body, _) = h.ingest_keyed("order-1", &message("bye")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["code"], "conflict");
    let mut other_conversation = message("hi");
    other_conversation["conversation_id"] = json!("c2");
    let (status, _, _) = h.ingest_keyed("order-1", &other_conversation).await;
    assert_eq!(status, StatusCode::CONFLICT);

    // A client event_id is a key as well.
    let mut with_id = message("hi");
    with_id["event_id"] = json!("client-9");
    let (status, a) = h.call("POST", "/v1/events", Some(&with_id)).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let (_, b) = h.call("POST", "/v1/events", Some(&with_id)).await;
    assert_eq!(a["event_id"], b["event_id"]);
    with_id["input"]["text"] = json!("changed");
    let (status, _) = h.call("POST", "/v1/events", Some(&with_id)).await;
    assert_eq!(status, StatusCode::CONFLICT);

    // Keys outside 1-128 chars of [A-Za-z0-9-_.:] are refused.
    for bad in ["has space", "slash/es", &"k".repeat(129)] {
        let (status, body, _) = h.ingest_keyed(bad, &message("hi")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
    }
    let (status, _, _) = h.ingest_keyed(&"k".repeat(128), &message("hi")).await;
    assert_eq!(status, StatusCode::ACCEPTED);
}

#[tokio::test]
async fn sessions_are_created_listed_per_workspace_and_closed() {
    let h = harness().await;
    let client = h.client_key("default").await;
    let agent = h.agent("default", true).await;

    let (status, session) = h
        .call_as(
            &client,
            "POST",
            "/v1/sessions",
            Some(&json!({"agent_id": agent.to_string(), "metadata": {"app": "notes"}})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{session}");
    let id = session["session_id"].as_str().unwrap().to_owned();
    assert_eq!(session["agent_id"], agent.to_string());
    assert_eq!(session["runner_id"], RUNNER);
    assert_eq!(session["conversation_id"], format!("session:{id}"));
    assert_eq!(session["metadata"]["app"], "notes");
    assert!(session["created_at"].as_i64().is_some());

    // Refusals: unknown, disabled, other workspace's agent; bad metadata; unknown fields.
    let disabled = h.agent("default", false).await;
    let elsewhere = h.agent("other", true).await;
    for body in [
        json!({"agent_id": AgentId::new().to_string()}),
        json!({"agent_id": "not-an-id"}),
        json!({"agent_id": disabled.to_string()}),
        json!({"agent_id": elsewhere.to_string()}),
        json!({"agent_id": agent.to_string(), "metadata": [1]}),
        json!({"agent_id": agent.to_string(), "runner_id": "x"}),
    ] {
        let (status, err) = h
            .call_as(&client, "POST", "/v1/sessions", Some(&body))
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {err}");
    }

    // Paged, and only the caller's workspace.
    let (_, second) = h
        .call_as(
            &client,
            "POST",
            "/v1/sessions",
            Some(&json!({"agent_id": agent.to_string()})),
        )
        .await;
    let other_key = h.client_key("other").await;
    let (_, theirs) = h
        .call_as(
            &other_key,
            "POST",
            "/v1/sessions",
            Some(&json!({"agent_id": elsewhere.to_string()})),
        )
        .await;
    let (status, page) = h
        .call_as(&client, "GET", "/v1/sessions?limit=1", None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    assert_eq!(page["items"][0]["session_id"], session["session_id"]);
    assert_eq!(page["has_more"], true);
    let cursor = page["next_cursor"].as_str().unwrap();
    let (_, page) = h
        .call_as(
            &client,
            "GET",
            &format!("/v1/sessions?cursor={cursor}"),
            None,
        )
        .await;
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    assert_eq!(page["items"][0]["session_id"], second["session_id"]);
    assert_eq!(page["has_more"], false);
    let theirs_uri = format!("/v1/sessions/{}", theirs["session_id"].as_str().unwrap());
    assert_eq!(
        h.call_as(&client, "GET", &theirs_uri, None).await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        h.call_as(&client, "DELETE", &theirs_uri, None).await.0,
        StatusCode::NOT_FOUND
    );

    // Close: idempotent; later turns are refused, reads still work.
    let uri = format!("/v1/sessions/{id}");
    let (status, closed) = h.call_as(&client, "DELETE", &uri, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(closed["status"], "closed");
    let closed_at = closed["closed_at"].clone();
    let (_, again) = h.call_as(&client, "DELETE", &uri, None).await;
    assert_eq!(again["closed_at"], closed_at);
    let (status, body) = h
        .call_as(
            &client,
            "POST",
            &format!("{uri}/turns"),
            Some(&json!({"idempotency_key": "k1", "text": "hi"})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["code"], "conflict");
    let (status, history) = h
        .call_as(&client, "GET", &format!("{uri}/history"), None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(history["items"], json!([]));
}

#[tokio::test]
async fn turns_are_idempotent_and_snapshots_follow_the_run() {
    let h = harness().await;
    let client = h.client_key("default").await;
    let agent = h.agent("default", true).await;
    let (_, session) = h
        .call_as(
            &client,
            "POST",
            "/v1/sessions",
            Some(&json!({"agent_id": agent.to_string()})),
        )
        .await;
    let session_id = session["session_id"].as_str().unwrap().to_owned();
    let turns = format!("/v1/sessions/{session_id}/turns");
    let body = json!({"idempotency_key": "turn-1", "text": "hello there"});

    let (status, receipt) = h.call_as(&client, "POST", &turns, Some(&body)).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{receipt}");
    assert_eq!(receipt["session_id"], session_id);
    assert_eq!(receipt["status"], "queued");
    let turn_id: RunId = receipt["turn_id"].as_str().unwrap().parse().unwrap();

    // Same key + same request: the same turn; another request: 409; bad keys: 400.
    let (status, again) = h.call_as(&client, "POST", &turns, Some(&body)).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    assert_eq!(again["turn_id"], receipt["turn_id"]);
    let changed = json!({"idempotency_key": "turn-1", "text": "something else"});
    let (status, err) = h.call_as(&client, "POST", &turns, Some(&changed)).await;
    assert_eq!(status, StatusCode::CONFLICT, "{err}");
    for key in ["", "white space", &"k".repeat(129)] {
        let bad = json!({"idempotency_key": key, "text": "hi"});
        let (status, _) = h.call_as(&client, "POST", &turns, Some(&bad)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{key}");
    }
    let missing_text = json!({"idempotency_key": "turn-2"});
    assert_eq!(
        h.call_as(&client, "POST", &turns, Some(&missing_text))
            .await
            .0,
        StatusCode::BAD_REQUEST
    );
    let unknown_session = format!("/v1/sessions/{}/turns", uuid::Uuid::now_v7());
    assert_eq!(
        h.call_as(&client, "POST", &unknown_session, Some(&body))
            .await
            .0,
        StatusCode::NOT_FOUND
    );

    // One event in the session's conversation, pinned to the session's agent and turn id.
    let page = h
        .stores
        .events
        .page(sb_store::EventQuery::new(
            WorkspaceId::new("default").unwrap(),
        ))
        .await
        .unwrap();
    assert_eq!(page.items.len(), 1);
    let event = &page.items[0];
    assert_eq!(event.event_type, "message.received");
    assert_eq!(
        event.conversation_id.as_deref(),
        Some(format!("session:{session_id}").as_str())
    );
    assert_eq!(event.metadata["turn"]["turn_id"], turn_id.to_string());
    assert_eq!(event.metadata["turn"]["agent_id"], agent.to_string());
    assert_eq!(event.input_summary.as_deref(), Some("hello there"));

    // Queued: snapshot, wait at its timeout, no events, cancel says false.
    let turn_uri = format!("/v1/turns/{turn_id}");
    let (status, snap) = h.call_as(&client, "GET", &turn_uri, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(snap["status"], "queued");
    assert!(snap.get("result").is_none() && snap.get("failure").is_none());
    let (status, waited) = h
        .call_as(
            &client,
            "GET",
            &format!("{turn_uri}/wait?timeout_ms=30"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(waited["status"], "queued");
    let (_, events) = h
        .call_as(&client, "GET", &format!("{turn_uri}/events"), None)
        .await;
    assert_eq!(events["events"], json!([]));
    assert_eq!(events["gap"], false);
    assert_eq!(events["next_sequence"], 0);

    // Another workspace cannot see it.
    let other = h.client_key("other").await;
    assert_eq!(
        h.call_as(&other, "GET", &turn_uri, None).await.0,
        StatusCode::NOT_FOUND
    );

    // The orchestrator creates the run under the turn id; the worker runs and completes it.
    let runs = &h.stores.runs;
    let (run, _) = runs
        .create_run(NewRun {
            id: Some(turn_id),
            workspace_id: WorkspaceId::new("default").unwrap(),
            event_id: event.id,
            agent_id: Some(agent),
            runner_id: RUNNER.into(),
            pool: "default".into(),
            conversation_id: event.conversation_id.clone(),
            thread_id: None,
            bot_id: None,
            deadline_at: None,
            attempt: 1,
        })
        .await
        .unwrap();
    assert!(runs.claim_run(run.id, "w1").await.unwrap());
    let (_, snap) = h.call_as(&client, "GET", &turn_uri, None).await;
    assert_eq!(snap["status"], "running");
    let items = [
        (
            "message.delta",
            json!({"chunk": {"role": "assistant", "content": "hello "}}),
        ),
        (
            "tool.call.started",
            json!({"call_id": "call-1", "name": "search"}),
        ),
        (
            "message.completed",
            json!({"message": {"role": "assistant", "content": "hello there"}}),
        ),
        ("run.completed", json!({})),
    ];
    for (i, (kind, data)) in items.iter().enumerate() {
        let sequence = i64::try_from(i).unwrap() + 1;
        runs.insert_event(NewRunEvent {
            run_id: turn_id,
            sequence,
            result_type: (*kind).into(),
            data: json!({"run_id": turn_id.to_string(), "type": kind, "data": data, "sequence": sequence}).into(),
            ends_run: None,
            transcript: None,
        })
        .await
        .unwrap();
    }
    let mut outcome = RunOutcome::completed();
    outcome.usage = Some(json!({"input_tokens": 3, "output_tokens": 2}));
    assert!(runs.finish_run(turn_id, outcome).await.unwrap());

    let (_, done) = h
        .call_as(
            &client,
            "GET",
            &format!("{turn_uri}/wait?timeout_ms=5000"),
            None,
        )
        .await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["result"]["text"], "hello there");
    assert_eq!(done["result"]["usage"]["output_tokens"], 2);
    assert!(done.get("failure").is_none());

    // Events after a sequence, with the turn's ids on each.
    let (_, page) = h
        .call_as(
            &client,
            "GET",
            &format!("{turn_uri}/events?after_sequence=1&limit=2"),
            None,
        )
        .await;
    let got = page["events"].as_array().unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0]["sequence"], 2);
    assert_eq!(got[0]["type"], "tool.call.started");
    assert_eq!(got[0]["call_id"], "call-1");
    assert_eq!(got[0]["session_id"], session_id);
    assert_eq!(got[0]["turn_id"], turn_id.to_string());
    assert!(got[0]["timestamp"].as_i64().is_some());
    assert_eq!(page["next_sequence"], 3);
    assert_eq!(page["gap"], false);
    assert_eq!(page["snapshot"]["status"], "completed");

    // Cancel of a finished turn: false, result unchanged. Replay: the same, finished turn.
    let (status, cancel) = h
        .call_as(&client, "POST", &format!("{turn_uri}/cancel"), None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(cancel["cancelled"], false);
    assert_eq!(cancel["snapshot"]["result"]["text"], "hello there");
    let (_, replay) = h.call_as(&client, "POST", &turns, Some(&body)).await;
    assert_eq!(replay["turn_id"], turn_id.to_string());
    assert_eq!(replay["status"], "completed");
}

#[tokio::test]
async fn a_failed_or_cancelled_turn_has_a_failure_and_no_result() {
    let h = harness().await;
    let client = h.client_key("default").await;
    let agent = h.agent("default", true).await;
    let (_, session) = h
        .call_as(
            &client,
            "POST",
            "/v1/sessions",
            Some(&json!({"agent_id": agent.to_string()})),
        )
        .await;
    let turns = format!(
        "/v1/sessions/{}/turns",
        session["session_id"].as_str().unwrap()
    );
    let start = |key: &str| json!({"idempotency_key": key, "text": "hi"});
    let mut ids = Vec::new();
    for key in ["a", "b"] {
        let (_, receipt) = h.call_as(&client, "POST", &turns, Some(&start(key))).await;
        let turn_id: RunId = receipt["turn_id"].as_str().unwrap().parse().unwrap();
        let turn = h.stores.turns.get_turn(turn_id).await.unwrap().unwrap();
        h.stores
            .runs
            .create_run(NewRun {
                id: Some(turn_id),
                workspace_id: WorkspaceId::new("default").unwrap(),
                event_id: turn.event_id.unwrap_or_else(EventId::new),
                agent_id: Some(agent),
                runner_id: RUNNER.into(),
                pool: "default".into(),
                conversation_id: None,
                thread_id: None,
                bot_id: None,
                deadline_at: None,
                attempt: 1,
            })
            .await
            .unwrap();
        ids.push(turn_id);
    }
    // `a` is interrupted by a crash.
    h.stores
        .runs
        .finish_run(
            ids[0],
            RunOutcome::with_error(RunStatus::Interrupted, "worker_lost", "the worker died"),
        )
        .await
        .unwrap();
    let (_, snap) = h
        .call_as(&client, "GET", &format!("/v1/turns/{}", ids[0]), None)
        .await;
    assert_eq!(snap["status"], "failed");
    assert_eq!(snap["failure"]["code"], "interrupted");
    assert!(snap.get("result").is_none());

    // `b` is cancelled while queued: the intent is recorded, the snapshot stays honest.
    let (status, cancel) = h
        .call_as(
            &client,
            "POST",
            &format!("/v1/turns/{}/cancel", ids[1]),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(cancel["cancelled"], true);
    let run = h.stores.runs.get_run(ids[1]).await.unwrap().unwrap();
    assert!(run.cancel_requested_at.is_some());
}
