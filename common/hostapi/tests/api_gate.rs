//! The Host API gate: validation order of SPEC §8 steps 1–3, then the inner dispatcher,
//! called directly with a hand-built caller identity and connection (the same gate through a
//! real runner process is `worker/tests/api_gate.rs`).

use std::sync::Arc;
use std::time::Duration;

use sb_common::session::SessionStore;
use sb_common::session::memory::MemorySessionStore;
use sb_common::telemetry::{Metrics, names};
use sb_host_api::api::{
    ApiStream, CallerIdentity, Connection, HOST_VERSION, HostApi, PROTOCOL_VERSION,
};
use sb_host_api::api_gate::ApiGate;
use sb_host_api::basic::BasicHostApi;
use sb_host_api::testing::{now_secs, snapshot, snapshot_in};
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::manifest::RunnerId;
use serde_json::{Value, json};
use tokio::sync::mpsc;

const RUNNER: &str = "plugin:acme/agent/default";

struct Fixture {
    sessions: Arc<MemorySessionStore>,
    gate: ApiGate<BasicHostApi>,
    caller: CallerIdentity,
    stream: ApiStream,
    _chunks: mpsc::Receiver<sb_protocol::wire::HostToRunner>,
}

fn fixture() -> Fixture {
    let sessions = Arc::new(MemorySessionStore::new());
    let gate = ApiGate::new(sessions.clone(), BasicHostApi);
    let runner: RunnerId = RUNNER.parse().unwrap();
    let (tx, rx) = mpsc::channel(8);
    Fixture {
        sessions,
        gate,
        caller: CallerIdentity::for_runner(&runner),
        stream: ApiStream::new("1", tx),
        _chunks: rx,
    }
}

impl Fixture {
    async fn session(&self, run_id: RunId, runner: &str, deadline_at: Option<f64>) {
        let runner: RunnerId = runner.parse().unwrap();
        self.sessions
            .put_session(
                &run_id,
                &snapshot(run_id, &runner, deadline_at),
                Duration::from_secs(60),
            )
            .await
            .unwrap();
    }

    async fn call(
        &self,
        run_id: RunId,
        action: &str,
    ) -> Result<Value, sb_protocol::error::AgentApiError> {
        self.gate
            .call(&self.caller, run_id, action, json!({}), &self.stream)
            .await
    }
}

fn calls(action: &str, result: &str) -> u64 {
    Metrics::global()
        .counter_value(
            names::PROXY_CALLS_TOTAL,
            &[("action", action), ("result", result)],
        )
        .unwrap_or(0)
}

#[tokio::test]
async fn no_session_is_not_found() {
    let f = fixture();
    let run_id = RunId::new();
    let e = f.call(run_id, "get_host_version").await.unwrap_err();
    assert_eq!(e.code, "not_found");
    assert_eq!(
        e.message,
        format!("run session {run_id} not found or expired")
    );
    assert!(!e.retryable);

    // An ended session is gone for good, even for the run's own plugin.
    f.session(run_id, RUNNER, None).await;
    assert!(f.call(run_id, "get_host_version").await.is_ok());
    f.sessions.end_session(&run_id).await.unwrap();
    assert_eq!(
        f.call(run_id, "get_host_version").await.unwrap_err().code,
        "not_found"
    );
}

#[tokio::test]
async fn another_plugin_is_unauthorized_before_the_deadline_is_checked() {
    let f = fixture();
    let run_id = RunId::new();
    // Another plugin's run whose deadline also passed: identity is checked first.
    f.session(
        run_id,
        "plugin:other/agent/default",
        Some(now_secs() - 10.0),
    )
    .await;
    let e = f.call(run_id, "get_host_version").await.unwrap_err();
    assert_eq!(e.code, "unauthorized", "{e:?}");
    // Same plugin, another runner of it: the identity is the plugin's.
    let run_id = RunId::new();
    f.session(run_id, "plugin:acme/agent/other", None).await;
    assert!(f.call(run_id, "get_host_version").await.is_ok());
}

#[tokio::test]
async fn a_passed_deadline_is_deadline_exceeded() {
    let f = fixture();
    let run_id = RunId::new();
    f.session(run_id, RUNNER, Some(now_secs() - 0.5)).await;
    let before = calls("get_host_version", "deadline_exceeded");
    let e = f.call(run_id, "get_host_version").await.unwrap_err();
    assert_eq!(e.code, "deadline_exceeded");
    assert!(
        calls("get_host_version", "deadline_exceeded") > before,
        "counted by action and outcome"
    );
    // A deadline in the future passes.
    let run_id = RunId::new();
    f.session(run_id, RUNNER, Some(now_secs() + 60.0)).await;
    assert!(f.call(run_id, "get_host_version").await.is_ok());
}

#[tokio::test]
async fn get_host_version_answers_and_other_actions_are_refused_honestly() {
    let f = fixture();
    let run_id = RunId::new();
    f.session(run_id, RUNNER, None).await;
    let before = calls("get_host_version", "ok");
    let v = f.call(run_id, "get_host_version").await.unwrap();
    assert_eq!(v["version"], HOST_VERSION);
    assert_eq!(v["protocol"], PROTOCOL_VERSION);
    assert!(calls("get_host_version", "ok") > before);

    let e = f.call(run_id, "call_tool").await.unwrap_err();
    assert_eq!(e.code, "unauthorized");
    let before = calls("unknown", "not_found");
    let e = f.call(run_id, "format_disk").await.unwrap_err();
    assert_eq!(e.code, "not_found");
    assert!(
        calls("unknown", "not_found") > before,
        "unknown actions share one label"
    );
}

#[tokio::test]
async fn storage_actions_are_known_and_counted_by_name() {
    let f = fixture();
    let run_id = RunId::new();
    f.session(run_id, RUNNER, None).await;
    // The canonical names and the seed aliases are both protocol actions: refused honestly
    // (no grant) rather than `not_found`, and each counted under its own label.
    for action in [
        "storage_get",
        "storage_set",
        "storage_delete",
        "storage_keys",
        "get_binary_storage",
        "get_binary_storage_keys",
    ] {
        let before = calls(action, "unauthorized");
        let e = f.call(run_id, action).await.unwrap_err();
        assert_eq!(e.code, "unauthorized", "{action}");
        assert!(
            calls(action, "unauthorized") > before,
            "{action} is labelled by name, not `unknown`"
        );
    }
}

#[tokio::test]
async fn a_corrupt_session_is_an_internal_error_not_a_pass() {
    let f = fixture();
    let run_id = RunId::new();
    f.sessions
        .put_session(&run_id, &json!({"hello": "world"}), Duration::from_secs(60))
        .await
        .unwrap();
    let e = f.call(run_id, "get_host_version").await.unwrap_err();
    assert_eq!(e.code, "internal");
    assert_eq!(e.message, "internal host error");
}

#[tokio::test]
async fn a_session_without_a_plugin_identity_authorizes_nobody() {
    let f = fixture();
    let runner: RunnerId = RUNNER.parse().unwrap();
    // A caller whose identity is empty too (no runner can have one; a remote caller takes
    // the session's) must not pass by comparing equal.
    let anonymous = CallerIdentity {
        runner_id: runner.clone(),
        plugin_id: String::new(),
        connection: None,
    };
    for plugin_id in ["", "  "] {
        let run_id = RunId::new();
        let mut snap = snapshot(run_id, &runner, None);
        snap["plugin_id"] = json!(plugin_id);
        f.sessions
            .put_session(&run_id, &snap, Duration::from_secs(60))
            .await
            .unwrap();
        for caller in [&f.caller, &anonymous] {
            let e = f
                .gate
                .call(caller, run_id, "get_host_version", json!({}), &f.stream)
                .await
                .unwrap_err();
            assert_eq!(e.code, "unauthorized", "{plugin_id:?}: {e:?}");
            assert_eq!(
                e.message,
                format!("run session {run_id} has no plugin identity")
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The caller's connection (SPEC §14): defence in depth behind the runner host.

fn ws(id: &str) -> WorkspaceId {
    WorkspaceId::new(id).unwrap()
}

async fn session_in(f: &Fixture, workspace: &str, run_id: RunId) {
    let runner: RunnerId = RUNNER.parse().unwrap();
    f.sessions
        .put_session(
            &run_id,
            &snapshot_in(&ws(workspace), run_id, &runner, None),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
}

async fn call_over(
    f: &Fixture,
    connection: Connection,
    run_id: RunId,
) -> Result<Value, sb_protocol::error::AgentApiError> {
    let runner: RunnerId = RUNNER.parse().unwrap();
    let caller = CallerIdentity::for_connection(&runner, connection);
    f.gate
        .call(&caller, run_id, "get_host_version", json!({}), &f.stream)
        .await
}

#[tokio::test]
async fn a_connection_may_call_only_for_its_own_current_runs() {
    let f = fixture();
    let (own, foreign) = (RunId::new(), RunId::new());
    session_in(&f, "alpha", own).await;
    // Same plugin, same workspace, live session: still not this connection's run.
    session_in(&f, "alpha", foreign).await;
    let connection = Connection::hosting(ws("alpha"), [own]);

    assert!(call_over(&f, connection.clone(), own).await.is_ok());
    let e = call_over(&f, connection.clone(), foreign)
        .await
        .unwrap_err();
    assert_eq!(e.code, "not_found");
    // Exactly the answer for a run without a session: nothing is learnt about it.
    let missing = RunId::new();
    let e2 = call_over(&f, Connection::hosting(ws("alpha"), [missing]), missing)
        .await
        .unwrap_err();
    assert_eq!(
        e.message,
        e2.message
            .replace(&missing.to_string(), &foreign.to_string())
    );
}

#[tokio::test]
async fn a_connection_of_one_workspace_cannot_act_for_a_run_of_another() {
    let f = fixture();
    let beta_run = RunId::new();
    session_in(&f, "beta", beta_run).await;

    // A process of alpha calling with beta's run id: the run is not its own.
    let e = call_over(&f, Connection::hosting(ws("alpha"), []), beta_run)
        .await
        .unwrap_err();
    assert_eq!(e.code, "not_found");

    // Even if the run were (wrongly) hosted on alpha's process, the gate refuses it.
    let e = call_over(&f, Connection::hosting(ws("alpha"), [beta_run]), beta_run)
        .await
        .unwrap_err();
    assert_eq!(e.code, "unauthorized");
    assert!(e.message.contains("workspace"), "{e:?}");

    // Beta's own process is served.
    let ok = call_over(&f, Connection::hosting(ws("beta"), [beta_run]), beta_run)
        .await
        .unwrap();
    assert_eq!(ok["version"], HOST_VERSION);
}
