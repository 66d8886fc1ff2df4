//! The remote Host API (`POST /v1/host/{action}`): the real router (`app(state).oneshot`) on
//! in-memory SQLite and the memory session store, with run sessions written as the
//! orchestrator writes them (the authorization snapshot with the run token's digest).

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use axum::response::Response;
use sb_common::session::SessionStore;
use sb_gateway::GatewayOptions;
use sb_host_api::actions::RateLimit;
use sb_protocol::host::host_api_token;
use sb_protocol::ids::RunId;
use serde_json::{Value, json};
use tower::ServiceExt;

const RUNNER: &str = "plugin:acme/agent/default";

mod support;

use support::Harness;

async fn harness_with(options: GatewayOptions) -> Harness {
    Harness::start(options).await
}

async fn harness() -> Harness {
    harness_with(GatewayOptions::default()).await
}

fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The session the orchestrator writes for a run of `RUNNER` in conversation `c1` with
/// plugin storage and history granted, whose remote token is `token`.
fn snapshot(run_id: RunId, token: &str, patch: Value) -> Value {
    let mut snap = json!({
        "run_id": run_id,
        "plugin_id": "acme/agent",
        "runner_id": RUNNER,
        "binding_id": format!("agent_default_{RUNNER}"),
        "workspace_id": "default",
        "conversation_id": "c1",
        "resources": {"storage": {"plugin_storage": true, "workspace_storage": false}},
        "available_apis": {"history_page": true, "storage": true},
        "state_policy": {},
        "budgets": {},
        "deadline_at": now_secs() + 300.0,
        "host_api_token_sha256": host_api_token::digest(token),
    });
    for (k, v) in patch.as_object().unwrap() {
        snap[k] = v.clone();
    }
    snap
}

impl Harness {
    /// A run with a session and its token.
    async fn run(&self, patch: Value) -> (RunId, String) {
        let run_id = RunId::new();
        let token = format!("tok-{}", uuid::Uuid::new_v4().simple());
        self.sessions
            .put_session(
                &run_id,
                &snapshot(run_id, &token, patch),
                Duration::from_secs(60),
            )
            .await
            .unwrap();
        (run_id, token)
    }

    async fn send(&self, request: Request<Body>) -> (StatusCode, Value) {
        let response: Response = self.app().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        (status, body)
    }

    async fn host_call(
        &self,
        action: &str,
        bearer: Option<&str>,
        body: &Value,
    ) -> (StatusCode, Value) {
        let mut request = Request::post(format!("/v1/host/{action}"))
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(token) = bearer {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        self.send(request.body(Body::from(body.to_string())).unwrap())
            .await
    }

    async fn call_run(
        &self,
        action: &str,
        token: &str,
        run_id: RunId,
        params: Value,
    ) -> (StatusCode, Value) {
        self.host_call(
            action,
            Some(token),
            &json!({"run_id": run_id, "params": params}),
        )
        .await
    }
}

/// The runner-facing error shape, with the expected code and status.
#[track_caller]
fn assert_refused(answer: &(StatusCode, Value), status: StatusCode, code: &str) {
    let (got, body) = answer;
    assert_eq!(*got, status, "{body}");
    assert_eq!(body["code"], code, "{body}");
    assert!(body["message"].is_string(), "{body}");
    assert!(body["retryable"].is_boolean(), "{body}");
    assert!(body["details"].is_object(), "{body}");
}

#[tokio::test]
async fn the_run_token_opens_the_runs_host_api() {
    let h = harness().await;
    let (run_id, token) = h.run(json!({})).await;
    let (status, body) = h
        .call_run("get_host_version", &token, run_id, json!({}))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["data"]["host"], "switchboard");
    assert_eq!(body["data"]["protocol"], "v1");
    assert!(body.get("chunks").is_none(), "nothing was streamed: {body}");
    // `params` may be omitted
    let (status, _) = h
        .host_call("get_host_version", Some(&token), &json!({"run_id": run_id}))
        .await;
    assert_eq!(status, StatusCode::OK);

    // The actions behind the token are the workers' own: plugin storage round trip, owned
    // by the session's plugin.
    let (status, body) = h
        .call_run(
            "storage_set",
            &token,
            run_id,
            json!({"owner_type": "plugin", "key": "k", "value_base64": "aGk="}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = h
        .call_run(
            "get_binary_storage",
            &token,
            run_id,
            json!({"owner_type": "plugin", "key": "k"}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["data"]["value_base64"], "aGk=");
    let stored = h
        .stores
        .storage
        .get("plugin", "acme/agent", "k")
        .await
        .unwrap();
    assert_eq!(stored.as_deref(), Some(&b"hi"[..]));
    // history of the run's conversation (empty), but not of another one
    let (status, body) = h.call_run("history_page", &token, run_id, json!({})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["data"]["items"], json!([]));
    let answer = h
        .call_run(
            "history_page",
            &token,
            run_id,
            json!({"conversation_id": "c2"}),
        )
        .await;
    assert_refused(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
}

#[tokio::test]
async fn wrong_missing_or_foreign_tokens_are_unauthorized() {
    let h = harness().await;
    let (run_a, token_a) = h.run(json!({})).await;
    let (run_b, token_b) = h.run(json!({})).await;

    let answer = h
        .call_run("get_host_version", "not-the-token", run_a, json!({}))
        .await;
    assert_refused(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    assert_eq!(answer.1["retryable"], false);

    // another run's token, for either run
    let answer = h
        .call_run("get_host_version", &token_b, run_a, json!({}))
        .await;
    assert_refused(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    let answer = h
        .call_run("get_host_version", &token_a, run_b, json!({}))
        .await;
    assert_refused(&answer, StatusCode::UNAUTHORIZED, "unauthorized");

    // no bearer at all, or another scheme
    let answer = h
        .host_call("get_host_version", None, &json!({"run_id": run_a}))
        .await;
    assert_refused(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    let request = Request::post("/v1/host/get_host_version")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::AUTHORIZATION, format!("Basic {token_a}"))
        .body(Body::from(json!({"run_id": run_a}).to_string()))
        .unwrap();
    assert_refused(
        &h.send(request).await,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );

    // an API key is not a run token
    let key = h.key.clone();
    let answer = h.call_run("get_host_version", &key, run_a, json!({})).await;
    assert_refused(&answer, StatusCode::UNAUTHORIZED, "unauthorized");

    // a run that never had a token accepts none
    let run_c = RunId::new();
    let mut snap = snapshot(run_c, "x", json!({}));
    snap.as_object_mut()
        .unwrap()
        .remove("host_api_token_sha256");
    h.sessions
        .put_session(&run_c, &snap, Duration::from_secs(60))
        .await
        .unwrap();
    let answer = h.call_run("get_host_version", "x", run_c, json!({})).await;
    assert_refused(&answer, StatusCode::UNAUTHORIZED, "unauthorized");

    // a session without a plugin identity authorizes nobody, even with the right token
    let (run_d, token_d) = h.run(json!({"plugin_id": ""})).await;
    let answer = h
        .call_run("get_host_version", &token_d, run_d, json!({}))
        .await;
    assert_refused(&answer, StatusCode::UNAUTHORIZED, "unauthorized");

    // the right token still works
    let (status, _) = h
        .call_run("get_host_version", &token_a, run_a, json!({}))
        .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn the_token_dies_with_the_session() {
    let h = harness().await;
    let (run_id, token) = h.run(json!({})).await;
    let (status, _) = h
        .call_run("get_host_version", &token, run_id, json!({}))
        .await;
    assert_eq!(status, StatusCode::OK);
    h.sessions.end_session(&run_id).await.unwrap();
    let answer = h
        .call_run("get_host_version", &token, run_id, json!({}))
        .await;
    assert_refused(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    assert_eq!(answer.1["retryable"], false);
}

/// Without the run's token nothing can be learnt about a run: an unknown run, an ended one,
/// a live one with a wrong token and a session without identity answer the same status and
/// the same body, byte for byte.
#[tokio::test]
async fn unknown_sessions_and_bad_tokens_answer_identically() {
    let h = harness().await;
    let (live, token) = h.run(json!({})).await;
    let (ended, ended_token) = h.run(json!({})).await;
    h.sessions.end_session(&ended).await.unwrap();
    let (anonymous, anonymous_token) = h.run(json!({"plugin_id": " "})).await;
    let unknown = RunId::new();

    // The answer for run `run_id` must not depend on the session behind it.
    let answer_for = |run_id: RunId, bearer: String| {
        let h = &h;
        async move {
            // One request id for all, so the bodies (which carry it) compare.
            let request = Request::post("/v1/host/get_host_version")
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::AUTHORIZATION, format!("Bearer {bearer}"))
                .header("x-request-id", "same-for-every-case")
                .body(Body::from(json!({"run_id": run_id}).to_string()))
                .unwrap();
            let response: Response = h.app().oneshot(request).await.unwrap();
            let status = response.status();
            let headers = response.headers().clone();
            let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .unwrap();
            (
                status,
                headers.get(header::WWW_AUTHENTICATE).cloned(),
                bytes,
            )
        }
    };
    // Every run id once with the same foreign bearer (another run's token), and each refused
    // case with its own pairing, re-pointed at one run id so the bodies compare.
    let (reference_status, reference_auth, reference_body) =
        answer_for(live, "tok-wrong".into()).await;
    assert_eq!(reference_status, StatusCode::UNAUTHORIZED);
    for run_id in [ended, anonymous, unknown] {
        let (status, auth, body) = answer_for(run_id, "tok-wrong".into()).await;
        assert_eq!(status, reference_status, "{run_id}");
        assert_eq!(auth, reference_auth, "{run_id}");
        let expected = String::from_utf8(reference_body.to_vec())
            .unwrap()
            .replace(&live.to_string(), &run_id.to_string());
        assert_eq!(
            String::from_utf8(body.to_vec()).unwrap(),
            expected,
            "{run_id}"
        );
    }
    // The right tokens of the ended and the anonymous run change nothing either.
    for (run_id, bearer) in [(ended, ended_token), (anonymous, anonymous_token)] {
        let (status, _, body) = answer_for(run_id, bearer).await;
        let (wrong_status, _, wrong_body) = answer_for(run_id, "tok-wrong".into()).await;
        assert_eq!((status, body), (wrong_status, wrong_body), "{run_id}");
    }
    // The live run's token still works.
    let (status, _, _) = answer_for(live, token).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn the_pipeline_refusals_keep_their_codes_and_statuses() {
    let mut options = GatewayOptions::default();
    options.host_api.rate_limit = Some(RateLimit {
        max_calls: 3,
        window: Duration::from_secs(60),
    });
    let h = harness_with(options).await;
    let (run_id, token) = h.run(json!({})).await;

    // unknown action
    let answer = h.call_run("format_disk", &token, run_id, json!({})).await;
    assert_refused(&answer, StatusCode::NOT_FOUND, "not_found");
    // an ungranted tool, with the seed's wording
    let answer = h
        .call_run(
            "call_tool",
            &token,
            run_id,
            json!({"tool_name": "search", "parameters": {}}),
        )
        .await;
    assert_refused(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    assert!(
        answer.1["message"]
            .as_str()
            .unwrap()
            .contains("authorized for operation call for this agent run"),
        "{}",
        answer.1
    );
    // argument errors
    let answer = h.call_run("storage_get", &token, run_id, json!([1])).await;
    assert_refused(&answer, StatusCode::BAD_REQUEST, "invalid_argument");
    let answer = h
        .call_run(
            "history_page",
            &token,
            run_id,
            json!({"before_cursor": "not-a-cursor"}),
        )
        .await;
    assert_refused(&answer, StatusCode::BAD_REQUEST, "invalid_argument");

    // the per-run rate limit (3 admitted calls per minute; refusals above were not all
    // admitted, so spend the rest first)
    let mut limited = None;
    for _ in 0..5 {
        let answer = h
            .call_run("get_host_version", &token, run_id, json!({}))
            .await;
        if answer.0 != StatusCode::OK {
            limited = Some(answer);
            break;
        }
    }
    let answer = limited.expect("the rate limit is reached within 5 calls");
    assert_refused(&answer, StatusCode::TOO_MANY_REQUESTS, "rate_limited");
    assert_eq!(answer.1["retryable"], true);
    assert_eq!(answer.1["details"]["limit"], 3);

    // a passed deadline
    let (run_late, token_late) = h.run(json!({"deadline_at": now_secs() - 1.0})).await;
    let answer = h
        .call_run("get_host_version", &token_late, run_late, json!({}))
        .await;
    assert_refused(&answer, StatusCode::GATEWAY_TIMEOUT, "deadline_exceeded");
}

#[tokio::test]
async fn malformed_bodies_are_invalid_arguments_in_the_runner_shape() {
    let h = harness().await;
    let (run_id, token) = h.run(json!({})).await;
    for body in [
        json!({}),
        json!({"run_id": "not-a-uuid"}),
        json!({"run_id": run_id, "extra": 1}),
        json!({"run_id": run_id, "params": {}, "action": "ping"}),
        json!("run"),
    ] {
        let answer = h.host_call("get_host_version", Some(&token), &body).await;
        assert_eq!(answer.0, StatusCode::BAD_REQUEST, "{body}: {}", answer.1);
        assert_refused(&answer, StatusCode::BAD_REQUEST, "invalid_argument");
    }
    let request = Request::post("/v1/host/get_host_version")
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from("{not json"))
        .unwrap();
    assert_refused(
        &h.send(request).await,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
    );
    // the route only answers POST: 405 with `Allow`
    let request = Request::get("/v1/host/get_host_version")
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Body::empty())
        .unwrap();
    let response = h.app().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(response.headers()[header::ALLOW], "POST");
}
