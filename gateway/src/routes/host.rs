//! `POST /v1/host/{action}`: the Host API for runners that run outside a worker (SPEC §8),
//! e.g. an external harness driving its own agent loop.
//!
//! ```text
//!  Authorization: Bearer <run token>           (ctx.runtime.metadata.host_api.token)
//!  {"run_id": "...", "params": {...}}
//!      │
//!      ├─ bearer token present ───────────────── no ──▶ 401 unauthorized "missing run token"
//!      ├─ body {run_id, params} ──────────────── bad ─▶ 400 invalid_argument
//!      ├─ session of run_id exists, has a plugin
//!      │  identity, and the token's SHA-256
//!      │  equals the frozen one ──────────────── no ──▶ 401 unauthorized (one answer for all three)
//!      └─ ApiGate → ActionDispatcher (the workers' pipeline: session, identity, deadline,
//!         grants, scope, arguments, size, rate) with caller = the session's plugin identity
//!      ▼
//!  200 {"data": <answer>}            or   <status of the code> {code, message, retryable, details}
//! ```
//!
//! The token is what a runner process's connection is on the stdio wire: the proof of
//! identity. It is minted per run by the orchestrator, and only its digest is frozen into the
//! run's session, so it authenticates exactly one run and stops working when the session
//! ends (terminal result, cancel, deadline). A run without a live session, a token of another
//! run and any other bearer value all get the same `401` (same status, same body), so a
//! caller without the token learns nothing, not even whether a run id is live; the digests
//! are compared in constant time, and a call for a missing session hashes the token all the
//! same. Only a caller holding the right token can see other answers.
//!
//! Everything after the token check is the same code the workers run ([`sb_host_api::api_gate`],
//! [`sb_host_api::actions`]) against the same session store and database, so a call is judged
//! identically over both transports, and the per-run rate limit is shared between them.
//! This route is the Host API's HTTP transport, as the worker's runner host is its stdio one.
//!
//! Streamed answers: HTTP has no `api_chunk`. The parts a streaming action produces are
//! collected and returned with the final data as `{"data": ..., "chunks": [...]}` (the key is
//! absent when nothing was streamed); a remote runner that needs tokens as they are produced
//! must run inside a worker. Request bodies are capped by `gateway.max_body_bytes`, so a
//! storage value above that cap can only be written from a worker.

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use sb_host_api::api::{ApiStream, CallerIdentity, HostApi};
use sb_host_api::api_gate::decode_snapshot;
use sb_protocol::error::{AgentApiError, ErrorCode};
use sb_protocol::host::{AuthorizationSnapshot, host_api_token};
use sb_protocol::ids::RunId;
use sb_protocol::wire::HostToRunner;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::auth::bearer_token;
use crate::error::{ApiError, ApiJson, ApiPath, ApiResult};
use crate::state::AppState;

/// Body of `POST /v1/host/{action}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HostCall {
    /// The run the call is made for; the bearer token must be this run's.
    pub run_id: RunId,
    /// The action's parameters (an object; absent = `{}`).
    #[serde(default)]
    pub params: Value,
}

/// A successful answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct HostAnswer {
    /// What the action returned (the `data` of an `api_result` on the stdio wire).
    pub data: Value,
    /// The parts a streaming action produced before its final data, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<Value>,
}

/// The refusal of a missing, malformed or wrong token.
fn bad_token(what: &str) -> ApiError {
    ApiError::new(
        ErrorCode::Unauthorized,
        format!("{what} (expected `Authorization: Bearer <run token>` from ctx.runtime.metadata.host_api)"),
    )
    .for_runner()
}

/// The one refusal of a call that does not hold `run_id`'s token, whatever the reason (no
/// live session, another token, a session without identity): it depends on the request only.
fn not_the_runs_token(run_id: RunId) -> ApiError {
    bad_token(&format!(
        "the bearer token is not the host api token of a live run {run_id}"
    ))
}

/// Who may call for this run: the session's plugin, if `token` is the run's.
fn authenticate(snapshot: &AuthorizationSnapshot, token: &str) -> Result<CallerIdentity, ApiError> {
    // Compared first, so the time taken does not depend on the identity check below.
    let accepted = snapshot.accepts_host_api_token(token);
    if snapshot.plugin_id.trim().is_empty() {
        tracing::error!(run_id = %snapshot.run_id, "run session has no plugin identity");
        return Err(not_the_runs_token(snapshot.run_id));
    }
    if !accepted {
        return Err(not_the_runs_token(snapshot.run_id));
    }
    Ok(CallerIdentity {
        runner_id: snapshot.runner_id.clone(),
        plugin_id: snapshot.plugin_id.clone(),
        // Not a worker's process connection: the token ties the caller to this one run.
        connection: None,
    })
}

/// Digest compared against when the run has no session, so that answer takes the time of a
/// wrong token (a SHA-256 and a full-length comparison).
const NO_SESSION_DIGEST: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// `POST /v1/host/{action}`.
#[utoipa::path(
    post,
    path = "/v1/host/{action}",
    tag = "host",
    params(("action" = String, Path, description = "Host API action, e.g. `model.generate`")),
    request_body = HostCall,
    responses(
        (status = 200, description = "The action's answer", body = HostAnswer),
        (status = 400, description = "Refused by the Host API pipeline (runner error shape: `retryable`, `details`)", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn call(
    State(state): State<AppState>,
    action: Result<ApiPath<String>, ApiError>,
    headers: HeaderMap,
    body: Result<ApiJson<HostCall>, ApiError>,
) -> ApiResult<Json<HostAnswer>> {
    let ApiPath(action) = action.map_err(ApiError::for_runner)?;
    let token = headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .ok_or_else(|| bad_token("missing run token"))?;
    let ApiJson(HostCall { run_id, params }) = body.map_err(ApiError::for_runner)?;

    let Some(session) = state
        .sessions()
        .get_session(&run_id)
        .await
        .map_err(|e| ApiError::from(e).for_runner())?
    else {
        std::hint::black_box(host_api_token::matches(
            NO_SESSION_DIGEST,
            std::hint::black_box(token),
        ));
        return Err(not_the_runs_token(run_id));
    };
    let snapshot = decode_snapshot(session).map_err(|reason| {
        tracing::error!(%run_id, %reason, "run session does not hold an authorization snapshot");
        ApiError::from_agent(AgentApiError::new(
            ErrorCode::Internal,
            "internal host error",
        ))
    })?;
    if snapshot.run_id != run_id {
        tracing::error!(%run_id, stored = %snapshot.run_id, "run session belongs to another run");
        return Err(ApiError::from_agent(AgentApiError::new(
            ErrorCode::Internal,
            "internal host error",
        )));
    }
    let caller = authenticate(&snapshot, token)?;

    let (outcome, chunks) =
        serve_collecting(state.host_api().as_ref(), &caller, run_id, &action, params).await;
    match outcome {
        Ok(data) => Ok(Json(HostAnswer { data, chunks })),
        Err(error) => Err(ApiError::from_agent(error)),
    }
}

/// Runs one call through `host_api`, collecting the parts it streams while it runs (the
/// stream's sender lives in the call's future, so the collector ends when the call does).
async fn serve_collecting(
    host_api: &dyn HostApi,
    caller: &CallerIdentity,
    run_id: RunId,
    action: &str,
    params: Value,
) -> (Result<Value, AgentApiError>, Vec<Value>) {
    let (tx, mut rx) = mpsc::channel::<HostToRunner>(64);
    let served = async move {
        let stream = ApiStream::new(format!("http-{run_id}"), tx);
        host_api.call(caller, run_id, action, params, &stream).await
    };
    let collected = async move {
        let mut chunks = Vec::new();
        while let Some(message) = rx.recv().await {
            if let HostToRunner::ApiChunk { data, .. } = message {
                chunks.push(data);
            }
        }
        chunks
    };
    tokio::join!(served, collected)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn snapshot(plugin_id: &str, token: Option<&str>) -> AuthorizationSnapshot {
        serde_json::from_value(json!({
            "run_id": RunId::new(), "plugin_id": plugin_id, "runner_id": "plugin:a/b/c",
            "binding_id": "x", "workspace_id": "default", "resources": {},
            "available_apis": {}, "state_policy": {}, "budgets": {},
            "host_api_token_sha256": token.map(host_api_token::digest),
        }))
        .unwrap()
    }

    /// Streams `n` chunks (`n` = `params.n`), then answers `{"done": n}`.
    struct Streaming;

    #[async_trait::async_trait]
    impl HostApi for Streaming {
        async fn call(
            &self,
            _caller: &CallerIdentity,
            _run_id: RunId,
            action: &str,
            params: Value,
            stream: &ApiStream,
        ) -> Result<Value, AgentApiError> {
            if action != "invoke_llm_stream" {
                return Err(AgentApiError::new(ErrorCode::NotFound, "no such action"));
            }
            let n = params["n"].as_u64().unwrap_or(0);
            for i in 0..n {
                assert!(stream.send(json!({"chunk": i})).await);
            }
            Ok(json!({"done": n}))
        }
    }

    #[tokio::test]
    async fn streamed_parts_are_collected_with_the_final_data() {
        let caller = CallerIdentity::for_runner(&"plugin:a/b/c".parse().unwrap());
        let run_id = RunId::new();
        // more chunks than the channel holds: the collector runs alongside the call
        let (outcome, chunks) = serve_collecting(
            &Streaming,
            &caller,
            run_id,
            "invoke_llm_stream",
            json!({"n": 200}),
        )
        .await;
        assert_eq!(outcome.unwrap(), json!({"done": 200}));
        assert_eq!(chunks.len(), 200);
        assert_eq!(chunks[0], json!({"chunk": 0}));
        assert_eq!(chunks[199], json!({"chunk": 199}));
        let (outcome, chunks) =
            serve_collecting(&Streaming, &caller, run_id, "ping", json!({})).await;
        assert_eq!(outcome.unwrap_err().code, "not_found");
        assert!(chunks.is_empty());
        let answer = serde_json::to_value(HostAnswer {
            data: json!(1),
            chunks: Vec::new(),
        })
        .unwrap();
        assert_eq!(answer, json!({"data": 1}), "no `chunks` key without chunks");
    }

    #[test]
    fn the_token_establishes_the_sessions_identity() {
        let s = snapshot("a/b", Some("tok"));
        let caller = authenticate(&s, "tok").unwrap();
        assert_eq!(caller.plugin_id, "a/b");
        assert_eq!(caller.runner_id.to_string(), "plugin:a/b/c");
        assert_eq!(
            authenticate(&s, "tok2").unwrap_err().code(),
            ErrorCode::Unauthorized
        );
        // a run without a token accepts none
        let s = snapshot("a/b", None);
        assert_eq!(
            authenticate(&s, "").unwrap_err().code(),
            ErrorCode::Unauthorized
        );
        // a session without an identity accepts nobody, even with its token, and says so
        // exactly as for a wrong token
        let s = snapshot(" ", Some("tok"));
        let e = authenticate(&s, "tok").unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unauthorized);
        assert_eq!(
            e.message(),
            authenticate(&s, "wrong").unwrap_err().message()
        );
    }
}
