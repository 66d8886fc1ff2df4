//! API key roles, key administration (`/v1/keys`), revocation across gateways and the
//! per-key limits: the real router on in-memory SQLite, the memory bus and the memory
//! session store (shared by two gateways where a test needs two).

use std::num::NonZeroU32;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use axum::response::Response;
use chrono::Utc;
use sb_gateway::GatewayOptions;
use sb_gateway::limits::KeyLimitOptions;
use sb_protocol::ids::WorkspaceId;
use sb_protocol::result::AgentRunResult;
use sb_store::{EventQuery, KbSearch, NewRun, NewRunEvent, RunnerRow};
use serde_json::{Value, json};
use sha2::Digest as _;
use tower::ServiceExt;
use uuid::Uuid;

mod support;

use support::Harness;

const RUNNER: &str = "plugin:acme/echo/default";

async fn harness() -> Harness {
    Harness::start(GatewayOptions::default()).await
}

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

fn message(text: &str) -> Value {
    json!({
        "event_type": "message.received", "source": "api", "conversation_id": "c1",
        "actor": {"actor_type": "user", "actor_id": "u1"},
        "input": {"text": text}
    })
}

impl Harness {
    /// The id of `key`, as the ledger knows it.
    async fn key_id(&self, key: &str) -> Uuid {
        self.stores
            .tenancy
            .authenticate(key)
            .await
            .unwrap()
            .expect("a valid key")
            .key_id
    }

    /// `GET uri` with `key`, answering the raw response (streams stay open while it lives).
    async fn open(&self, key: &str, uri: &str) -> Response {
        let request = Request::get(uri)
            .header(header::AUTHORIZATION, format!("Bearer {key}"))
            .body(Body::empty())
            .unwrap();
        self.app().oneshot(request).await.unwrap()
    }

    /// A queued run of a freshly ingested event of workspace `default`.
    async fn run(&self) -> sb_protocol::ids::RunId {
        let (status, event) = self.call("POST", "/v1/events", Some(&message("hi"))).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{event}");
        let (run, _) = self
            .stores
            .runs
            .create_run(NewRun {
                id: None,
                workspace_id: WorkspaceId::default_workspace(),
                event_id: event["event_id"].as_str().unwrap().parse().unwrap(),
                agent_id: None,
                runner_id: RUNNER.into(),
                pool: "default".into(),
                conversation_id: Some("c1".into()),
                thread_id: None,
                bot_id: None,
                deadline_at: None,
                attempt: 1,
            })
            .await
            .unwrap();
        run.id
    }

    /// Events of workspace `default` in the event log.
    async fn event_count(&self) -> usize {
        self.stores
            .events
            .page(EventQuery::new(WorkspaceId::default_workspace()))
            .await
            .unwrap()
            .items
            .len()
    }
}

#[track_caller]
fn assert_code(answer: &(StatusCode, Value), status: StatusCode, code: &str) {
    assert_eq!(answer.0, status, "{}", answer.1);
    assert_eq!(answer.1["code"], code, "{}", answer.1);
    assert!(answer.1["message"].is_string(), "{}", answer.1);
}

/// Every admin route refuses a client key with `403 permission_denied` before reading the
/// body, and stores nothing; the admin key can do all of it; the client key keeps what an
/// application needs.
#[tokio::test]
async fn a_client_key_cannot_configure_the_workspace() {
    let h = harness().await;
    let client = h.client_key("default").await;
    h.stores
        .runners
        .upsert(RunnerRow {
            id: RUNNER.into(),
            plugin_id: "acme/echo".into(),
            pool: "default".into(),
            version: "1.0.0".into(),
            descriptor: json!({"id": RUNNER}),
            seen_at: Utc::now(),
        })
        .await
        .unwrap();

    // What the admin key creates, so the client can aim at existing things.
    let model = json!({"name": "m", "kind": "llm", "base_url": "https://models.example.com/v1",
                       "model_name": "x"});
    let tool = json!({"name": "t", "kind": "http", "url": "https://tools.example.com/t"});
    let agent = json!({"name": "echo", "runner_id": RUNNER});
    let schedule =
        json!({"name": "tick", "kind": "interval", "spec": "15m", "event": message("tick")});
    let (status, kb) = h
        .call("POST", "/v1/knowledge-bases", Some(&json!({"name": "kb"})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{kb}");
    let kb_id = kb["kb_id"].as_str().unwrap().to_owned();
    let (status, created_agent) = h.call("POST", "/v1/agents", Some(&agent)).await;
    assert_eq!(status, StatusCode::CREATED, "{created_agent}");
    let agent_id = created_agent["agent_id"].as_str().unwrap().to_owned();
    let (status, created_schedule) = h.call("POST", "/v1/schedules", Some(&schedule)).await;
    assert_eq!(status, StatusCode::CREATED, "{created_schedule}");
    let schedule_id = created_schedule["schedule_id"].as_str().unwrap().to_owned();
    let admin_key_id = h.key_id(&h.key).await;

    let agent_uri = format!("/v1/agents/{agent_id}");
    let schedule_uri = format!("/v1/schedules/{schedule_id}");
    let documents_uri = format!("/v1/knowledge-bases/{kb_id}/documents");
    let key_uri = format!("/v1/keys/{admin_key_id}");
    let refused: Vec<(&str, &str, Option<Value>)> = vec![
        ("POST", "/v1/models", Some(model.clone())),
        ("GET", "/v1/models", None),
        ("POST", "/v1/tools", Some(tool.clone())),
        ("GET", "/v1/tools", None),
        ("POST", "/v1/knowledge-bases", Some(json!({"name": "kb2"}))),
        ("GET", "/v1/knowledge-bases", None),
        (
            "POST",
            &documents_uri,
            Some(json!({"title": "t", "text": "secret plans"})),
        ),
        (
            "POST",
            "/v1/agents",
            Some(json!({"name": "evil", "runner_id": RUNNER})),
        ),
        // A body the handler would refuse: the role is checked first.
        ("POST", "/v1/agents", Some(json!({"bogus": true}))),
        ("PATCH", &agent_uri, Some(json!({"name": "renamed"}))),
        ("DELETE", &agent_uri, None),
        ("POST", "/v1/schedules", Some(schedule.clone())),
        ("GET", "/v1/schedules", None),
        ("GET", &schedule_uri, None),
        ("DELETE", &schedule_uri, None),
        ("GET", "/v1/runners", None),
        ("GET", "/v1/keys", None),
        ("POST", "/v1/keys", Some(json!({"role": "admin"}))),
        ("DELETE", &key_uri, None),
    ];
    for (method, uri, body) in &refused {
        let answer = h.call_as(&client, method, uri, body.as_ref()).await;
        assert_code(&answer, StatusCode::FORBIDDEN, "permission_denied");
        let text = answer.1["message"].as_str().unwrap();
        assert!(text.contains("admin"), "{method} {uri}: {text}");
    }

    // Nothing changed.
    let (_, models) = h.call("GET", "/v1/models", None).await;
    assert_eq!(models["items"], json!([]), "no model stored");
    let (_, tools) = h.call("GET", "/v1/tools", None).await;
    assert_eq!(tools["items"], json!([]), "no tool stored");
    let (_, kbs) = h.call("GET", "/v1/knowledge-bases", None).await;
    assert_eq!(kbs["items"].as_array().unwrap().len(), 1);
    let (status, read) = h.call("GET", &agent_uri, None).await;
    assert_eq!((status, &read["name"]), (StatusCode::OK, &json!("echo")));
    let (_, agents) = h.call("GET", "/v1/agents", None).await;
    assert_eq!(agents["items"].as_array().unwrap().len(), 1, "{agents}");
    let (_, schedules) = h.call("GET", "/v1/schedules", None).await;
    assert_eq!(schedules["items"].as_array().unwrap().len(), 1);
    let (_, keys) = h.call("GET", "/v1/keys", None).await;
    assert_eq!(
        keys["items"].as_array().unwrap().len(),
        2,
        "no key made: {keys}"
    );
    assert!(
        keys["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|k| k.get("revoked_at").is_none())
    );
    let hits = h
        .stores
        .resources
        .search_kb(KbSearch {
            workspace_id: WorkspaceId::default_workspace(),
            kb_id: kb_id.parse().unwrap(),
            query: "secret plans".into(),
            top_k: 5,
            document_ids: vec![],
        })
        .await
        .unwrap();
    assert!(hits.is_empty(), "no document stored: {hits:?}");

    // What the client may do.
    let (status, listed) = h.call_as(&client, "GET", "/v1/agents", None).await;
    assert_eq!(status, StatusCode::OK, "{listed}");
    assert_eq!(listed["items"][0]["agent_id"], json!(agent_id));
    let (status, _) = h.call_as(&client, "GET", &agent_uri, None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, event) = h
        .call_as(&client, "POST", "/v1/events", Some(&message("hello")))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{event}");
    let (status, _) = h.call_as(&client, "GET", "/v1/runs", None).await;
    assert_eq!(status, StatusCode::OK);

    // The admin key can do everything the client was refused.
    let (status, body) = h.call("POST", "/v1/models", Some(&model)).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) = h.call("POST", "/v1/tools", Some(&tool)).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) = h
        .call(
            "POST",
            &documents_uri,
            Some(&json!({"title": "t", "text": "plans"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) = h
        .call(
            "PATCH",
            &agent_uri,
            Some(&json!({"description": "the echo"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = h.call("GET", "/v1/runners", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = h
        .call("POST", "/v1/keys", Some(&json!({"role": "client"})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, _) = h.call("DELETE", &schedule_uri, None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _) = h.call("DELETE", &agent_uri, None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
}

/// `GET/POST /v1/keys`, `DELETE /v1/keys/{id}`: secrets shown once, listings without
/// secrets, workspace scoping, and a revoked key refused on its very next request.
#[tokio::test]
async fn keys_are_created_listed_and_revoked_through_the_api() {
    let h = harness().await;
    let (status, created) = h
        .call(
            "POST",
            "/v1/keys",
            Some(&json!({"name": " app ", "role": "client"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let secret = created["key"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("sb_") && secret.starts_with(created["prefix"].as_str().unwrap()));
    assert_eq!(created["role"], "client");
    assert_eq!(created["name"], "app");
    assert_eq!(created["current"], false);
    let new_id = created["key_id"].as_str().unwrap().to_owned();

    // The role is required and closed.
    for body in [
        json!({}),
        json!({"role": "root"}),
        json!({"role": "client", "x": 1}),
    ] {
        let answer = h.call("POST", "/v1/keys", Some(&body)).await;
        assert_code(&answer, StatusCode::BAD_REQUEST, "invalid_argument");
    }

    // The listing shows both keys, marks the caller's own, and holds no secret or hash.
    let (status, listed) = h.call("GET", "/v1/keys", None).await;
    assert_eq!(status, StatusCode::OK);
    let items = listed["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{listed}");
    assert_eq!(items[0]["role"], "admin");
    assert_eq!(items[0]["current"], true);
    assert_eq!(items[1]["key_id"], json!(new_id));
    let text = listed.to_string();
    for secret in [&secret, &h.key] {
        assert!(!text.contains(secret.as_str()), "{text}");
        assert!(!text.contains(&hex::encode(sha2::Sha256::digest(secret.as_bytes()))));
    }
    assert!(
        items
            .iter()
            .all(|k| k.get("key").is_none() && k.get("key_hash").is_none())
    );

    // The new key works, as a client key.
    let (status, _) = h.call_as(&secret, "GET", "/v1/runs", None).await;
    assert_eq!(status, StatusCode::OK);
    let answer = h.call_as(&secret, "GET", "/v1/keys", None).await;
    assert_code(&answer, StatusCode::FORBIDDEN, "permission_denied");

    // Another workspace's keys are not there for this one, and stay valid.
    let other = h.api_key("other").await;
    let other_id = h.key_id(&other).await;
    let answer = h
        .call("DELETE", &format!("/v1/keys/{other_id}"), None)
        .await;
    assert_code(&answer, StatusCode::NOT_FOUND, "not_found");
    let (status, _) = h.call_as(&other, "GET", "/v1/keys", None).await;
    assert_eq!(status, StatusCode::OK);
    for id in [Uuid::now_v7().to_string(), "not-a-key".to_owned()] {
        let answer = h.call("DELETE", &format!("/v1/keys/{id}"), None).await;
        assert_code(&answer, StatusCode::NOT_FOUND, "not_found");
    }

    // Revoked: refused on the very next request.
    let (status, _) = h.call("DELETE", &format!("/v1/keys/{new_id}"), None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let answer = h.call_as(&secret, "GET", "/v1/runs", None).await;
    assert_code(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    let (_, listed) = h.call("GET", "/v1/keys", None).await;
    assert!(listed["items"][1]["revoked_at"].is_i64(), "{listed}");
    // Again: harmless.
    let (status, _) = h.call("DELETE", &format!("/v1/keys/{new_id}"), None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);

    // An admin key may revoke itself; its next request is refused.
    let (_, second_admin) = h
        .call("POST", "/v1/keys", Some(&json!({"role": "admin"})))
        .await;
    let second = second_admin["key"].as_str().unwrap().to_owned();
    let second_id = second_admin["key_id"].as_str().unwrap();
    let (status, _) = h
        .call_as(&second, "DELETE", &format!("/v1/keys/{second_id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let answer = h.call_as(&second, "GET", "/v1/keys", None).await;
    assert_code(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    // The first admin key is untouched.
    let (status, _) = h.call("GET", "/v1/keys", None).await;
    assert_eq!(status, StatusCode::OK);
}

/// Two gateways on one database and one session store: a key both have cached and that one
/// of them revokes is refused by the other on its very next request.
#[tokio::test]
async fn a_revocation_reaches_a_second_gateway_that_cached_the_key() {
    let first = harness().await;
    let second = first.sibling().await;
    let key = first.client_key("default").await;
    for gateway in [&first, &second] {
        let (status, _) = gateway.call_as(&key, "GET", "/v1/runs", None).await;
        assert_eq!(status, StatusCode::OK);
    }
    assert!(
        !second.state.keys().is_empty(),
        "the second gateway cached the key"
    );
    let key_id = first.key_id(&key).await;

    let (status, _) = first
        .call("DELETE", &format!("/v1/keys/{key_id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let answer = second.call_as(&key, "GET", "/v1/runs", None).await;
    assert_code(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    let answer = first.call_as(&key, "GET", "/v1/runs", None).await;
    assert_code(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    // Other keys still work on both (re-looked-up after the cache was cleared).
    for gateway in [&first, &second] {
        let (status, _) = gateway.call("GET", "/v1/keys", None).await;
        assert_eq!(status, StatusCode::OK);
    }
}

/// Unknown tokens are not cached: a gateway's cache holds only keys that authenticated.
#[tokio::test]
async fn unknown_tokens_fill_no_cache() {
    let h = harness().await;
    for i in 0..20 {
        let answer = h
            .call_as(&format!("sb_guess{i}"), "GET", "/v1/runs", None)
            .await;
        assert_code(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    }
    assert!(h.state.keys().is_empty());
    let (status, _) = h.call("GET", "/v1/runs", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(h.state.keys().len(), 1);
}

/// Beyond its bucket a key gets `429 rate_limited` with `Retry-After`; other keys do not.
#[tokio::test]
async fn the_request_rate_is_limited_per_key() {
    let options = GatewayOptions {
        key_limits: KeyLimitOptions {
            requests_per_second: Some(nz(1)),
            requests_burst: nz(2),
            ..KeyLimitOptions::default()
        },
        ..GatewayOptions::default()
    };
    let h = Harness::start(options).await;
    let client = h.client_key("default").await;
    for _ in 0..2 {
        let (status, body) = h.call_as(&client, "GET", "/v1/runs", None).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let request = Request::get("/v1/runs")
        .header(header::AUTHORIZATION, format!("Bearer {client}"))
        .body(Body::empty())
        .unwrap();
    let response = h.app().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = response.headers()[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=2).contains(&retry_after), "{retry_after}");
    let body: Value = serde_json::from_slice(
        &axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(body["code"], "rate_limited");
    // Every route counts, and a refused request does nothing.
    let answer = h
        .call_as(&client, "POST", "/v1/events", Some(&message("x")))
        .await;
    assert_code(&answer, StatusCode::TOO_MANY_REQUESTS, "rate_limited");
    assert_eq!(h.event_count().await, 0);
    // Another key has its own bucket.
    let (status, _) = h.call("GET", "/v1/runs", None).await;
    assert_eq!(status, StatusCode::OK);
}

/// At most `streams_per_key` result streams per key: one more is `429 rate_limited` (and a
/// streamed ingest refused that way stores no event); the slot comes back when the client
/// drops its stream and when a stream ends.
#[tokio::test]
async fn open_streams_are_limited_per_key_and_given_back() {
    let mut options = GatewayOptions::default();
    options.key_limits.streams_per_key = nz(1);
    let h = Harness::start(options).await;
    let client = h.client_key("default").await;
    let client_id = h.key_id(&client).await;
    let run_id = h.run().await;
    let stream_uri = format!("/v1/runs/{run_id}/stream");

    // One stream open (the run has no result yet, so it stays open while held).
    let held = h.open(&client, &stream_uri).await;
    assert_eq!(held.status(), StatusCode::OK);
    assert_eq!(h.state.key_limits().open_streams(client_id), 1);
    let refused = h.open(&client, &stream_uri).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.headers().contains_key(header::RETRY_AFTER));
    let events_before = h.event_count().await;
    let answer = h
        .call_as(
            &client,
            "POST",
            "/v1/events?stream=true",
            Some(&message("more")),
        )
        .await;
    assert_code(&answer, StatusCode::TOO_MANY_REQUESTS, "rate_limited");
    assert_eq!(h.event_count().await, events_before, "nothing ingested");
    // Other keys have their own slots.
    let other = h.open(&h.key, &stream_uri).await;
    assert_eq!(other.status(), StatusCode::OK);
    drop(other);

    // The client goes away: the slot is free again.
    drop(held);
    assert_eq!(h.state.key_limits().open_streams(client_id), 0);

    // A stream that ends (the run's terminal item) gives its slot back too.
    let done = AgentRunResult::run_completed()
        .with_run_id(run_id)
        .with_sequence(1);
    h.stores
        .runs
        .insert_event(NewRunEvent {
            run_id,
            sequence: 1,
            result_type: done.result_type.clone(),
            data: sb_store::ItemJson::of(&done),
            ends_run: None,
            transcript: None,
        })
        .await
        .unwrap();
    let ended = h.open(&client, &stream_uri).await;
    assert_eq!(ended.status(), StatusCode::OK);
    let body = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        axum::body::to_bytes(ended.into_body(), usize::MAX),
    )
    .await
    .expect("the stream ends after the terminal item")
    .unwrap();
    assert!(String::from_utf8_lossy(&body).contains("run.completed"));
    assert_eq!(h.state.key_limits().open_streams(client_id), 0);
    let again = h.open(&client, &stream_uri).await;
    assert_eq!(again.status(), StatusCode::OK);
}
