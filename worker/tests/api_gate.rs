//! The Host API gate through a real runner process (the worker's stdio transport): the
//! caller identity and connection come from the process, and the answers travel the wire.
//! The gate's own order is tested directly in `common/hostapi/tests/api_gate.rs`.

mod support;

use std::time::Duration;

use sb_common::session::SessionStore;
use sb_host_api::api::{HOST_VERSION, PROTOCOL_VERSION};
use sb_host_api::testing::{now_secs, snapshot};
use sb_protocol::manifest::RunnerId;
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// Through a real runner process: the caller identity comes from the connection.
// ---------------------------------------------------------------------------------------------

/// Runs `api <action>` on the scripted runner and returns the api_result it reported.
async fn api_via_runner(h: &mut support::Harness, job: &sb_protocol::messages::RunJob) -> Value {
    h.publish_job(job).await;
    let results = h.results_until_terminal().await;
    let completed = results
        .iter()
        .find(|m| m.result.known_type() == Some(sb_protocol::result::ResultType::MessageCompleted))
        .unwrap_or_else(|| panic!("no report in {results:?}"));
    let text = completed.result.data["message"]["content"]
        .as_str()
        .unwrap();
    serde_json::from_str(text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_process_gets_the_host_version_through_the_gate() {
    let mut h = support::Harness::start(|_, _| {}).await;
    let job = h
        .prepare_run(support::SCRIPTED, "api get_host_version")
        .await;
    let answer = api_via_runner(&mut h, &job).await;
    assert_eq!(answer["ok"], true, "{answer}");
    assert_eq!(answer["data"]["version"], HOST_VERSION);
    assert_eq!(answer["data"]["protocol"], PROTOCOL_VERSION);

    let job = h.prepare_run(support::SCRIPTED, "api call_tool").await;
    let answer = api_via_runner(&mut h, &job).await;
    assert_eq!(answer["error"]["code"], "unauthorized", "{answer}");

    // Another run's id is refused before any host code sees it.
    let job = h.prepare_run(support::SCRIPTED, "api_foreign").await;
    let answer = api_via_runner(&mut h, &job).await;
    assert_eq!(answer["error"]["code"], "not_found", "{answer}");
    h.stop().await;
}

/// Calls the host can answer only with an error — malformed params, an unknown action, no
/// `run_id` — are answered with their code through the real gate and dispatcher, with the
/// call's id echoed as written, and the run completes normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacceptable_calls_are_answered_and_the_run_goes_on() {
    let mut h = support::Harness::start(|_, _| {}).await;
    let lines = json!([
        {"op": "api", "id": 1, "run_id": "$RUN", "action": "get_host_version", "params": 5},
        {"op": "api", "id": "2", "run_id": "$RUN", "action": "teleport", "params": {}},
        {"op": "api", "id": 3, "action": "get_host_version", "params": {}},
        {"op": "api", "id": 4, "run_id": "$RUN", "action": "get_host_version"},
    ]);
    let job = h
        .prepare_run(support::SCRIPTED, &format!("wire 4 {lines}"))
        .await;
    h.publish_job(&job).await;
    let results = h.results_until_terminal().await;
    let last = results.last().unwrap();
    assert_eq!(
        last.result.known_type(),
        Some(sb_protocol::result::ResultType::RunCompleted),
        "{results:?}"
    );
    let report = results
        .iter()
        .find(|m| m.result.known_type() == Some(sb_protocol::result::ResultType::MessageCompleted))
        .unwrap();
    let answers: Vec<Value> =
        serde_json::from_str(report.result.data["message"]["content"].as_str().unwrap()).unwrap();
    let code_of = |id: Value| {
        let answer = answers
            .iter()
            .find(|a| a["id"] == id)
            .unwrap_or_else(|| panic!("no answer for {id}: {answers:?}"));
        answer["error"]["code"].clone()
    };
    assert_eq!(code_of(json!(1)), "invalid_argument");
    assert_eq!(code_of(json!("2")), "not_found");
    assert_eq!(code_of(json!(3)), "invalid_argument");
    let ok = answers.iter().find(|a| a["id"] == 4).unwrap();
    assert_eq!(ok["ok"], true, "{ok}");
    assert!(ok["id"].is_u64(), "the integer id comes back as an integer");
    assert_eq!(ok["data"]["version"], HOST_VERSION);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_process_is_checked_against_the_session_in_order() {
    let mut h = support::Harness::start(|_, _| {}).await;

    // 1. No session (expired or never written): not_found.
    let job = h
        .prepare_run(support::SCRIPTED, "api get_host_version")
        .await;
    h.sessions.end_session(&job.run_id).await.unwrap();
    let answer = api_via_runner(&mut h, &job).await;
    assert_eq!(answer["error"]["code"], "not_found", "{answer}");
    assert_eq!(
        answer["error"]["message"],
        format!("run session {} not found or expired", job.run_id)
    );

    // 2. The session was frozen for another plugin: unauthorized (even with a passed deadline).
    let job = h
        .prepare_run(support::SCRIPTED, "api get_host_version")
        .await;
    let other: RunnerId = "plugin:someone/else/default".parse().unwrap();
    h.sessions
        .put_session(
            &job.run_id,
            &snapshot(job.run_id, &other, Some(now_secs() - 5.0)),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    let answer = api_via_runner(&mut h, &job).await;
    assert_eq!(answer["error"]["code"], "unauthorized", "{answer}");

    // 3. The session's deadline passed: deadline_exceeded.
    let job = h
        .prepare_run(support::SCRIPTED, "api get_host_version")
        .await;
    let runner: RunnerId = support::SCRIPTED.parse().unwrap();
    h.sessions
        .put_session(
            &job.run_id,
            &snapshot(job.run_id, &runner, Some(now_secs() - 5.0)),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    let answer = api_via_runner(&mut h, &job).await;
    assert_eq!(answer["error"]["code"], "deadline_exceeded", "{answer}");
    h.stop().await;
}
