//! The Host API end to end (SPEC §8, host-behaviour §22 and Appendix B 16–31, 35–40): real
//! runner processes built on the `sb-runner` SDK call every action through the worker, and
//! remote runners call it over HTTP (`POST /v1/host/{action}`) with their run's token.
//!
//! The scripted runner is `sb-api-runner` (tests/src/bin), driven through
//! [`sb_tests::script`]: its input text is a JSON array of steps, and it reports one outcome
//! per step (`{"do", "ok", "data" | "error"}`) in its `message.completed`. Two plugins run
//! it: `sdk-api` (asks for every permission and for steering) and `sdk-api-bare` (asks for
//! nothing). Misuse of run ids by a runner process is driven with `sb-test-runner`'s
//! `api_foreign`.
//!
//! The refusal scenarios are plain `async fn`s over a [`Client`] and the deployment's
//! [`Stores`]; `in_both_modes!` runs each in embedded mode (`embedded::<name>`) and in
//! cluster mode (`cluster_mode::<name>`: two gateway, two orchestrator and two worker
//! processes on Postgres, Redis and RabbitMQ), so the host refuses the same things wherever
//! the run, its session and its caller live.
//!
//! Needs the runner binaries and the `switchboard` binary: `cargo build --workspace --bins`
//! (scripts/test does it). The cluster-mode tests also need the local Postgres, Redis and
//! RabbitMQ (skipped, with a message, when one is unreachable).

use chrono::Utc;
use sb_protocol::ids::{EventId, RunId, WorkspaceId};
use sb_store::{ArtifactScope, NewArtifact, Stores};
use sb_tests::cluster::{ClusterSpec, TestCluster as Deployment};
use sb_tests::script::{
    API, API_PLUGIN, BARE, agent, announced, assert_codes, assert_remote_refused, audit_rows,
    cancel, content_of, ok, open_barrier, outcomes, patch_agent, remote, require_api_runner,
    script, start_script, unique, wait_claimed,
};
use sb_tests::{Client, ClusterBuilder, TEST_PER_RUN, TEST_SHARED, TestCluster, wait_for};
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

async fn start(builder: ClusterBuilder) -> TestCluster {
    require_api_runner();
    builder.start().await
}

async fn cluster() -> TestCluster {
    start(TestCluster::builder()).await
}

/// A deployment of separate processes, two of each role (so the runner, its session, the
/// ingesting gateway and the routing orchestrator are spread over processes), or `None` when
/// a service is unreachable.
async fn deployment() -> Option<Deployment> {
    require_api_runner();
    Deployment::spawn_or_skip(ClusterSpec::default()).await
}

/// Instantiates each scenario (`async fn(&Client, &Stores)`) twice: `embedded::<name>` on the
/// in-process harness and `cluster_mode::<name>` on a [`deployment`], through its first
/// gateway and with stores on its schema.
macro_rules! in_both_modes {
    ($($scenario:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    let cluster = super::cluster().await;
                    super::$scenario(cluster.client(), cluster.stores()).await;
                    cluster.shutdown().await;
                }
            )*
        }

        mod cluster_mode {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    let Some(deployment) = super::deployment().await else {
                        return;
                    };
                    let stores = sb_store::Stores::from_sql(deployment.store().clone());
                    super::$scenario(&deployment.client(0), &stores).await;
                }
            )*
        }
    };
}

in_both_modes!(
    every_action_answers_through_the_sdk,
    refusals_carry_their_protocol_codes,
    apis_the_run_was_not_granted_are_refused,
    run_ids_of_ended_runs_and_of_other_processes_are_refused,
    state_is_per_binding_and_its_policy_is_frozen_at_run_start,
);

/// An inline artifact of workspace `default` in `conversation` with `scope`.
fn artifact(id: &str, conversation: Option<&str>, scope: ArtifactScope) -> NewArtifact {
    let mut a = NewArtifact::inline(
        WorkspaceId::default_workspace(),
        "file",
        "api",
        scope,
        b"hello artifact".to_vec(),
    );
    a.id = Some(id.to_owned());
    a.name = Some("hello.txt".into());
    a.mime_type = Some("text/plain".into());
    a.conversation_id = conversation.map(str::to_owned);
    a
}

// ---------------------------------------------------------------------------------------------
// Every action through the SDK
// ---------------------------------------------------------------------------------------------

/// Every action answers through the SDK (run in both modes by `in_both_modes!`).
async fn every_action_answers_through_the_sdk(client: &Client, stores: &Stores) {
    let conversation = unique("all");
    agent(
        client,
        &conversation,
        API,
        json!({"resource_policy": {"allow_workspace_storage": true}}),
    )
    .await;
    let art = unique("art");
    stores
        .artifacts
        .put(artifact(
            &art,
            Some(&conversation),
            ArtifactScope::Conversation,
        ))
        .await
        .unwrap();

    let steps = json!([
        {"do": "get_host_version"},
        {"do": "call", "action": "ping", "params": {}},
        {"do": "context"},
        {"do": "history_search", "query": "needle"},
        {"do": "history_page"},
        {"do": "event_get", "event_id": "$event_id"},
        {"do": "event_page"},
        {"do": "artifact_metadata", "artifact_id": art},
        {"do": "artifact_read", "artifact_id": art, "offset": 6, "limit": 3},
        {"do": "state_set", "scope": "conversation", "key": "k", "value": {"n": 1}},
        {"do": "state_get", "scope": "conversation", "key": "k"},
        {"do": "state_list", "scope": "conversation"},
        {"do": "state_delete", "scope": "conversation", "key": "k"},
        {"do": "state_get", "scope": "conversation", "key": "k"},
        {"do": "storage_set", "owner": "plugin", "key": "p", "text": "plugin bytes"},
        {"do": "storage_get", "owner": "plugin", "key": "p"},
        {"do": "storage_keys", "owner": "plugin"},
        {"do": "storage_delete", "owner": "plugin", "key": "p"},
        {"do": "storage_set", "owner": "workspace", "key": "w", "text": "shared"},
        {"do": "call", "action": "get_binary_storage", "params": {"owner_type": "workspace", "key": "w"}},
        {"do": "storage_keys", "owner": "workspace"},
        {"do": "steering_pull"},
        {"do": "call", "action": "invoke_llm", "params": {"llm_model_uuid": "m1", "messages": []}},
        {"do": "call_stream", "action": "invoke_llm_stream", "params": {"llm_model_uuid": "m1", "messages": []}},
        {"do": "call", "action": "invoke_rerank", "params": {"rerank_model_uuid": "r1", "query": "q", "documents": []}},
        {"do": "call", "action": "get_tool_detail", "params": {"tool_name": "t1"}},
        {"do": "call", "action": "call_tool", "params": {"tool_name": "t1", "parameters": {}}},
        {"do": "call", "action": "retrieve_knowledge", "params": {"kb_id": "kb1", "query_text": "q"}},
        {"do": "call", "action": "get_config_file", "params": {"file_key": "f1"}},
        {"do": "call", "action": "get_prompt", "params": {}},
    ]);
    let (event_id, run_id) = start_script(client, &conversation, &steps).await;
    let o = outcomes(client, run_id).await;
    assert_codes(
        &o,
        &[
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            // models, tools, knowledge bases and files exist nowhere, so none is granted;
            // the prompt API is off (no query-backed runs)
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "unauthorized",
        ],
    );
    // get_host_version, ping
    assert_eq!(ok(&o[0])["protocol"], "v1");
    assert!(ok(&o[0])["version"].as_str().is_some_and(|v| !v.is_empty()));
    assert_eq!(ok(&o[1]), &json!({}));
    // the context: the frozen grants, and the remote Host API of the run
    let ctx = ok(&o[2]);
    assert_eq!(ctx["run_id"], run_id.to_string());
    let apis = &ctx["context"]["available_apis"];
    for flag in [
        "history_page",
        "history_search",
        "event_get",
        "event_page",
        "artifact_metadata",
        "artifact_read",
        "state",
        "storage",
        "steering_pull",
    ] {
        assert_eq!(apis[flag], true, "{flag}: {apis}");
    }
    assert_eq!(apis["prompt_get"], false);
    assert_eq!(ctx["resources"]["storage"]["workspace_storage"], true);
    assert_eq!(ctx["runtime"]["metadata"]["host_api"]["url"], "/v1/host");
    let token = ctx["runtime"]["metadata"]["host_api"]["token"]
        .as_str()
        .unwrap();
    assert_eq!(token.len(), 43, "32 random bytes, base64url");
    assert!(
        ctx["state"]["conversation"]["external.conversation_id"] == conversation,
        "the state snapshot seeds the conversation id: {}",
        ctx["state"]
    );
    // history: the event's own user row is in the transcript, and searchable
    let found = ok(&o[3]);
    assert!(
        found["items"].as_array().is_some_and(|i| !i.is_empty()),
        "{found}"
    );
    assert_eq!(found["query"], "needle");
    let page = ok(&o[4])["items"].as_array().unwrap().clone();
    assert!(
        page.iter().any(|i| i["role"] == "user"
            && i["event_id"] == event_id.to_string()
            && i["content"].as_str().is_some_and(|c| c.contains("needle"))),
        "{page:?}"
    );
    // events: the run's own event
    assert_eq!(ok(&o[5])["event_id"], event_id.to_string());
    assert_eq!(ok(&o[5])["event_type"], "message.received");
    assert!(
        ok(&o[6])["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["event_id"] == event_id.to_string()),
        "{}",
        o[6]
    );
    // artifacts: public metadata, and a range read
    let meta = ok(&o[7]);
    assert_eq!(meta["artifact_id"], art);
    assert_eq!(meta["name"], "hello.txt");
    assert_eq!(meta["size_bytes"], 14);
    assert!(meta.get("storage_key").is_none() && meta.get("workspace_id").is_none());
    let read = ok(&o[8]);
    assert_eq!(read["content_base64"], "YXJ0", "`art`: {read}");
    assert_eq!(
        (read["offset"].as_u64(), read["has_more"].as_bool()),
        (Some(6), Some(true))
    );
    // state round trip
    assert_eq!(ok(&o[10])["value"], json!({"n": 1}));
    assert_eq!(ok(&o[11])["keys"], json!(["k"]), "{}", o[11]);
    assert_eq!(ok(&o[12])["success"], true);
    assert_eq!(ok(&o[13])["value"], Value::Null);
    // plugin and workspace storage (the seed's action name is an alias)
    assert_eq!(ok(&o[15])["value_base64"], "cGx1Z2luIGJ5dGVz");
    assert_eq!(ok(&o[16])["keys"], json!(["p"]));
    assert_eq!(ok(&o[19])["value_base64"], "c2hhcmVk");
    assert_eq!(ok(&o[20])["keys"], json!(["w"]));
    assert_eq!(
        stores.storage.get("plugin", API_PLUGIN, "p").await.unwrap(),
        None,
        "deleted"
    );
    assert_eq!(
        stores
            .storage
            .get("workspace", "default", "w")
            .await
            .unwrap()
            .as_deref(),
        Some(&b"shared"[..]),
        "owned by the run's workspace"
    );
    // steering: nothing queued
    assert_eq!(ok(&o[21])["items"], json!([]));
    // the refusals name what was refused
    assert!(
        o[26]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("for this agent run"),
        "{}",
        o[26]
    );
}

// ---------------------------------------------------------------------------------------------
// Refusals
// ---------------------------------------------------------------------------------------------

/// Every refusal of the validation pipeline, with its protocol code (SPEC §8 steps 5–6,
/// host-behaviour §22.2 and Appendix B 29–31).
async fn refusals_carry_their_protocol_codes(client: &Client, stores: &Stores) {
    let conversation = unique("refuse");
    let other = unique("other");
    agent(client, &conversation, API, json!({})).await;
    // An event of another conversation (answered by the default echo agent).
    let other_event = client.send_message(&other, "elsewhere").await;
    client.wait_routed(other_event).await;

    // Artifacts around the run (host-behaviour §22.2 access matrix).
    stores
        .tenancy
        .ensure_workspace(&WorkspaceId::new("elsewhere").unwrap())
        .await
        .unwrap();
    let ids: Vec<String> = (0..6).map(|i| unique(&format!("a{i}"))).collect();
    let mut foreign_ws = artifact(&ids[0], Some(&conversation), ArtifactScope::Conversation);
    foreign_ws.workspace_id = WorkspaceId::new("elsewhere").unwrap();
    let mut foreign_run = artifact(&ids[2], Some(&conversation), ArtifactScope::Run);
    foreign_run.run_id = Some(RunId::new());
    let mut expired = artifact(&ids[4], Some(&conversation), ArtifactScope::Conversation);
    expired.expires_at = Some(Utc::now() - chrono::Duration::seconds(5));
    for a in [
        foreign_ws,
        artifact(&ids[1], Some(&other), ArtifactScope::Conversation),
        foreign_run,
        artifact(&ids[3], None, ArtifactScope::Conversation),
        expired,
        artifact(&ids[5], Some(&conversation), ArtifactScope::Conversation),
    ] {
        stores.artifacts.put(a).await.unwrap();
    }
    let readable = &ids[5];

    let o = script(
        client,
        &conversation,
        json!([
            // another conversation's history and events (SPEC §8 step 5)
            {"do": "history_page", "conversation_id": other},
            {"do": "event_page", "conversation_id": other},
            {"do": "history_search", "query": "elsewhere", "filters": {"conversation_id": other}},
            {"do": "event_get", "event_id": other_event.to_string()},
            {"do": "event_get", "event_id": EventId::new().to_string()},
            // artifacts: another workspace's is invisible; another conversation's, another
            // run's, a global one are out of scope; an expired one is gone
            {"do": "artifact_metadata", "artifact_id": ids[0]},
            {"do": "artifact_read", "artifact_id": ids[0]},
            {"do": "artifact_metadata", "artifact_id": ids[1]},
            {"do": "artifact_metadata", "artifact_id": ids[2]},
            {"do": "artifact_metadata", "artifact_id": ids[3]},
            {"do": "artifact_metadata", "artifact_id": ids[4]},
            {"do": "artifact_read", "artifact_id": ids[4]},
            // malformed arguments (step 6)
            {"do": "call", "action": "artifact_read", "params": {"artifact_id": readable, "offset": -1}},
            {"do": "call", "action": "artifact_read", "params": {"artifact_id": readable, "limit": 0}},
            {"do": "call", "action": "artifact_read", "params": {"artifact_id": readable, "offset": "x"}},
            {"do": "call", "action": "artifact_metadata", "params": {}},
            {"do": "history_page", "before_cursor": "garbage"},
            {"do": "call", "action": "event_get", "params": {}},
            // state (host-behaviour §22.2, Appendix B 29)
            {"do": "call", "action": "state_get", "params": {"key": "k"}},
            {"do": "call", "action": "state_get", "params": {"scope": "conversation"}},
            {"do": "call", "action": "state_set", "params": {"scope": "conversation", "key": "k"}},
            {"do": "state_get", "scope": "subject", "key": "k"},
            {"do": "state_get", "scope": "galaxy", "key": "k"},
            {"do": "state_set", "scope": "conversation", "key": "big", "value_size": 300_000},
            // steering pull limits (Appendix B 30): SPEC §8 step 6 clamps a limit to
            // [1, 100] (the seed refused ≤ 0); a limit that is not an integer is refused
            {"do": "call", "action": "steering_pull", "params": {"limit": 0}},
            {"do": "call", "action": "steering_pull", "params": {"limit": "many"}},
            {"do": "steering_pull", "limit": 1000},
            // storage (Appendix B 31): another area, another owner, a missing key, the
            // workspace area the policy does not grant, bad base64
            {"do": "call", "action": "storage_get", "params": {"owner_type": "galaxy", "key": "k"}},
            {"do": "call", "action": "storage_get", "params": {"owner_type": "plugin", "owner": "someone/else", "key": "k"}},
            {"do": "storage_get", "owner": "plugin", "key": "missing"},
            {"do": "storage_set", "owner": "workspace", "key": "w", "text": "x"},
            {"do": "call", "action": "storage_set", "params": {"owner_type": "plugin", "key": "k", "value_base64": "***"}},
            // an action that does not exist, a tool call without its parameters
            {"do": "call", "action": "teleport", "params": {}},
            {"do": "call", "action": "call_tool", "params": {"tool_name": "t1"}},
            // the readable artifact is readable
            {"do": "artifact_read", "artifact_id": readable},
        ]),
    )
    .await;
    assert_codes(
        &o,
        &[
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "not_found",
            "not_found",
            "not_found",
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "not_found",
            "not_found",
            "invalid_argument",
            "invalid_argument",
            "invalid_argument",
            "invalid_argument",
            "invalid_argument",
            "invalid_argument",
            "invalid_argument",
            "invalid_argument",
            "invalid_argument",
            "unauthorized",
            "unauthorized",
            "payload_too_large",
            "ok",
            "invalid_argument",
            "ok",
            "unauthorized",
            "unauthorized",
            "not_found",
            "unauthorized",
            "invalid_argument",
            "not_found",
            "unauthorized",
            "ok",
        ],
    );
    // The seed's wording, lowercased.
    let message = |i: usize| o[i]["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        message(0).contains("is not accessible by this run"),
        "{}",
        message(0)
    );
    assert!(message(7).contains("access denied"), "{}", message(7));
    assert!(
        message(21).contains("is not enabled by binding policy"),
        "{}",
        message(21)
    );
    assert_eq!(o[23]["error"]["details"]["limit"], 256 * 1024, "{}", o[23]);
    assert_eq!(o[26]["data"]["items"], json!([]));
    assert_eq!(
        ok(&o[34])["content_base64"],
        "aGVsbG8gYXJ0aWZhY3Q=",
        "`hello artifact`"
    );
}

/// A runner that asked for nothing is granted nothing, and an agent that turns state off
/// takes the state API away.
async fn apis_the_run_was_not_granted_are_refused(client: &Client, _stores: &Stores) {
    let conversation = unique("bare");
    agent(client, &conversation, BARE, json!({})).await;
    let o = script(
        client,
        &conversation,
        json!([
            {"do": "history_page"},
            {"do": "history_search", "query": "x"},
            {"do": "event_get", "event_id": "$event_id"},
            {"do": "event_page"},
            {"do": "artifact_metadata", "artifact_id": "a"},
            {"do": "artifact_read", "artifact_id": "a"},
            {"do": "steering_pull"},
            {"do": "storage_get", "owner": "plugin", "key": "k"},
            {"do": "storage_keys", "owner": "workspace"},
            // state is the agent's policy, not a manifest permission: on by default
            {"do": "state_set", "scope": "conversation", "key": "k", "value": 1},
            {"do": "context"},
        ]),
    )
    .await;
    assert_codes(
        &o,
        &[
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "unauthorized",
            "ok",
            "ok",
        ],
    );
    assert_eq!(
        o[0]["error"]["message"],
        "history page access not authorized"
    );
    let apis = &ok(&o[10])["context"]["available_apis"];
    assert_eq!(
        apis,
        &json!({
            "history_page": false, "history_search": false, "event_get": false,
            "event_page": false, "artifact_metadata": false, "artifact_read": false,
            "state": true, "storage": false, "steering_pull": false, "prompt_get": false,
        }),
        "what the runner is told is what the host enforces"
    );

    // An agent that turns state off: the flag is off and every state call is refused.
    let conversation = unique("stateless");
    agent(
        client,
        &conversation,
        BARE,
        json!({"state_policy": {"enable_state": false}}),
    )
    .await;
    let o = script(
        client,
        &conversation,
        json!([
            {"do": "state_get", "scope": "conversation", "key": "k"},
            {"do": "state_list", "scope": "conversation"},
            {"do": "context"},
        ]),
    )
    .await;
    assert_codes(&o, &["unauthorized", "unauthorized", "ok"]);
    assert_eq!(ok(&o[2])["context"]["available_apis"]["state"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn size_caps_and_the_rate_limit_apply_per_run() {
    // Storage values up to 64 bytes; 6 admitted calls per run per 6 s.
    let cluster = start(
        TestCluster::builder()
            .config("limits.storage_value_bytes", 64)
            .config("limits.proxy_calls_per_second", 1)
            .config("limits.proxy_calls_burst", 6),
    )
    .await;
    let client = cluster.client();
    let conversation = unique("caps");
    agent(client, &conversation, API, json!({})).await;
    let o = script(
        client,
        &conversation,
        json!([
            // refused for its size before it is counted
            {"do": "storage_set", "owner": "plugin", "key": "k", "text": "x".repeat(65)},
            {"do": "storage_set", "owner": "plugin", "key": "k", "text": "x".repeat(64)},
            // an upsert replaces the value
            {"do": "storage_set", "owner": "plugin", "key": "k", "text": "second"},
            {"do": "storage_get", "owner": "plugin", "key": "k"},
            {"do": "get_host_version"},
            {"do": "get_host_version"},
            {"do": "get_host_version"},
            {"do": "get_host_version"},
        ]),
    )
    .await;
    assert_codes(
        &o,
        &[
            "payload_too_large",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "rate_limited",
        ],
    );
    assert_eq!(o[0]["error"]["details"]["limit"], 64);
    assert_eq!(ok(&o[3])["value_base64"], "c2Vjb25k", "`second`");
    assert_eq!(o[7]["error"]["retryable"], true);
    // Another run has its own budget of calls.
    let o = script(client, &conversation, json!([{"do": "get_host_version"}])).await;
    assert_codes(&o, &["ok"]);
    cluster.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Run ids: ended runs and other processes
// ---------------------------------------------------------------------------------------------

/// The `api_result` an `sb-test-runner` run reported for `api_foreign <run_id> [action]`.
async fn foreign_call(client: &Client, conversation: &str, run_id: RunId, action: &str) -> Value {
    let event = client
        .send_message(conversation, &format!("api_foreign {run_id} {action}"))
        .await;
    let run = client.run_of(event).await;
    client.wait_run_terminal(run).await;
    let items = client.run_events(run, 0).await;
    let text = items
        .iter()
        .find(|i| i.result_type == "message.completed")
        .and_then(|i| content_of(i, "message"))
        .unwrap_or_else(|| panic!("no report: {items:?}"));
    serde_json::from_str(&text).unwrap()
}

/// A runner process may only name its own active runs: another plugin's run, another
/// process's run of the same plugin and a run that ended are all refused.
async fn run_ids_of_ended_runs_and_of_other_processes_are_refused(
    client: &Client,
    _stores: &Stores,
) {
    let shared = unique("shared");
    client.conversation_agent(&shared, TEST_SHARED).await;
    let per_run = unique("per-run");
    client.conversation_agent(&per_run, TEST_PER_RUN).await;

    // An active run of the `sdk-api` process.
    let active = unique("active");
    agent(client, &active, API, json!({})).await;
    let (_, run_a) = start_script(
        client,
        &active,
        &json!([{"do": "announce"}, {"do": "wait_cancel"}]),
    )
    .await;
    announced(client, run_a).await;
    // An active run of another `test-per-run` process (same plugin as the caller below).
    let waiting = client.send_message(&per_run, "cancellable").await;
    let run_p = client.run_of(waiting).await;
    wait_for("the per-run runner to start", || async {
        let run = client.get_run(run_p).await;
        (run["status"] == "running").then_some(())
    })
    .await;

    // Another plugin's process, then another process of the same plugin: not a run of the
    // calling process, refused before any host code sees it.
    for action in ["get_host_version", "history_page", "state_get"] {
        let answer = foreign_call(client, &shared, run_a, action).await;
        assert_eq!(answer["ok"], false, "{answer}");
        assert_eq!(answer["error"]["code"], "not_found", "{answer}");
    }
    let answer = foreign_call(client, &per_run, run_p, "get_host_version").await;
    assert_eq!(answer["error"]["code"], "not_found", "{answer}");

    // A run that ended: its id is refused to everybody, its own plugin included.
    let finished = unique("finished");
    agent(client, &finished, API, json!({})).await;
    let (_, ended) = start_script(client, &finished, &json!([{"do": "get_host_version"}])).await;
    outcomes(client, ended).await;
    let answer = foreign_call(client, &shared, ended, "get_host_version").await;
    assert_eq!(answer["error"]["code"], "not_found", "{answer}");
    assert_eq!(
        answer["error"]["message"],
        format!("run session {ended} not found or expired")
    );

    cancel(client, run_a).await;
    cancel(client, run_p).await;
    let run = client.wait_run_terminal(run_a).await;
    assert_eq!(run["status"], "cancelled", "{run}");
    client.wait_run_terminal(run_p).await;
}

// ---------------------------------------------------------------------------------------------
// Remote runners over HTTP
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_runners_call_with_their_run_token() {
    let cluster = cluster().await;
    let client = cluster.client();
    let base = client.base_url().to_owned();
    let (conv_a, conv_b) = (unique("remote-a"), unique("remote-b"));
    agent(client, &conv_a, API, json!({})).await;
    agent(client, &conv_b, API, json!({})).await;
    let waiting = json!([{"do": "announce"}, {"do": "wait_cancel"}]);
    let (event_a, run_a) = start_script(client, &conv_a, &waiting).await;
    let (_, run_b) = start_script(client, &conv_b, &waiting).await;
    let (url, token_a) = announced(client, run_a).await;
    let (_, token_b) = announced(client, run_b).await;
    assert_eq!(url, "/v1/host");
    assert_ne!(token_a, token_b);

    // The token opens the run's Host API, with the same pipeline as the stdio wire.
    let (status, body) = remote(
        &base,
        &url,
        Some(&token_a),
        run_a,
        "get_host_version",
        json!({}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"]["protocol"], "v1");
    let (status, body) = remote(
        &base,
        &url,
        Some(&token_a),
        run_a,
        "state_set",
        json!({"scope": "conversation", "key": "remote", "value": "from http"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = remote(
        &base,
        &url,
        Some(&token_a),
        run_a,
        "event_get",
        json!({"event_id": event_a}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"]["event_id"], event_a.to_string());
    let (status, body) = remote(
        &base,
        &url,
        Some(&token_a),
        run_a,
        "storage_set",
        json!({"owner_type": "plugin", "key": "remote", "value_base64": "aGk="}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        cluster
            .stores()
            .storage
            .get("plugin", API_PLUGIN, "remote")
            .await
            .unwrap()
            .as_deref(),
        Some(&b"hi"[..]),
        "owned by the run's plugin"
    );
    // Another conversation's history is refused over HTTP too.
    let answer = remote(
        &base,
        &url,
        Some(&token_a),
        run_a,
        "history_page",
        json!({"conversation_id": conv_b}),
    )
    .await;
    assert_remote_refused(&answer, 401, "unauthorized");

    // Wrong, missing, or another run's token.
    let answer = remote(
        &base,
        &url,
        Some("not-a-token"),
        run_a,
        "get_host_version",
        json!({}),
    )
    .await;
    assert_remote_refused(&answer, 401, "unauthorized");
    let answer = remote(&base, &url, None, run_a, "get_host_version", json!({})).await;
    assert_remote_refused(&answer, 401, "unauthorized");
    let answer = remote(
        &base,
        &url,
        Some(&token_b),
        run_a,
        "get_host_version",
        json!({}),
    )
    .await;
    assert_remote_refused(&answer, 401, "unauthorized");
    let answer = remote(
        &base,
        &url,
        Some(&token_a),
        run_b,
        "get_host_version",
        json!({}),
    )
    .await;
    assert_remote_refused(&answer, 401, "unauthorized");
    // The API key of the workspace is not a run token.
    let key = cluster.process().api_key().unwrap().to_owned();
    let answer = remote(
        &base,
        &url,
        Some(&key),
        run_a,
        "get_host_version",
        json!({}),
    )
    .await;
    assert_remote_refused(&answer, 401, "unauthorized");

    // The token dies with the session.
    cancel(client, run_a).await;
    let run = client.wait_run_terminal(run_a).await;
    assert_eq!(run["status"], "cancelled", "{run}");
    let answer = remote(
        &base,
        &url,
        Some(&token_a),
        run_a,
        "get_host_version",
        json!({}),
    )
    .await;
    // Answered as any token that is not a live run's (the gateway says nothing about
    // whether the run exists).
    assert_remote_refused(&answer, 401, "unauthorized");
    // The other run is unaffected.
    let (status, _) = remote(
        &base,
        &url,
        Some(&token_b),
        run_b,
        "get_host_version",
        json!({}),
    )
    .await;
    assert_eq!(status, 200);
    cancel(client, run_b).await;
    client.wait_run_terminal(run_b).await;

    // What the remote runner wrote is there for the next run of the conversation.
    let o = script(
        client,
        &conv_a,
        json!([{"do": "state_get", "scope": "conversation", "key": "remote"}]),
    )
    .await;
    assert_eq!(ok(&o[0])["value"], "from http");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_way_a_run_ends_closes_its_host_api() {
    // Appendix B 37: the session is gone after a failure and after a deadline, not only
    // after a success or a cancel.
    let cluster = cluster().await;
    let client = cluster.client();
    let base = client.base_url().to_owned();
    let conversation = unique("ends");
    agent(client, &conversation, API, json!({})).await;
    let late = unique("late");
    agent(client, &late, API, json!({"runner_config": {"timeout": 2}})).await;

    let (_, failed) = start_script(
        client,
        &conversation,
        &json!([{"do": "announce"}, {"do": "fail"}]),
    )
    .await;
    let (url, token_failed) = announced(client, failed).await;
    let run = client.wait_run_terminal(failed).await;
    assert_eq!(run["status"], "failed", "{run}");

    let (_, timed_out) = start_script(
        client,
        &late,
        &json!([{"do": "announce"}, {"do": "wait_cancel", "timeout_ms": 60_000}]),
    )
    .await;
    let (_, token_late) = announced(client, timed_out).await;
    let run = client.wait_run_terminal(timed_out).await;
    assert!(
        matches!(
            run["status"].as_str(),
            Some("timeout" | "failed" | "cancelled")
        ),
        "{run}"
    );

    let (_, completed) = start_script(client, &conversation, &json!([{"do": "announce"}])).await;
    let (_, token_done) = announced(client, completed).await;
    let run = client.wait_run_terminal(completed).await;
    assert_eq!(run["status"], "completed", "{run}");

    for (run_id, token) in [
        (failed, &token_failed),
        (timed_out, &token_late),
        (completed, &token_done),
    ] {
        let answer = remote(
            &base,
            &url,
            Some(token),
            run_id,
            "get_host_version",
            json!({}),
        )
        .await;
        assert_remote_refused(&answer, 401, "unauthorized");
    }
    cluster.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// State: bindings, aliases, frozen policy, state.updated
// ---------------------------------------------------------------------------------------------

/// State is keyed by binding: another agent in the same conversation sees none of it; and the
/// state policy is frozen when a run starts.
async fn state_is_per_binding_and_its_policy_is_frozen_at_run_start(
    client: &Client,
    stores: &Stores,
) {
    let conversation = unique("state");
    let agent_a = agent(client, &conversation, API, json!({})).await;

    let o = script(
        client,
        &conversation,
        json!([
            {"do": "state_set", "scope": "conversation", "key": "k", "value": "from-a"},
            {"do": "state_set", "scope": "actor", "key": "ak", "value": 1},
            // `conversation_id` is an alias of `external.conversation_id` (Appendix B 16)
            {"do": "state_set", "scope": "conversation", "key": "conversation_id", "value": "aliased"},
            {"do": "state_get", "scope": "conversation", "key": "external.conversation_id"},
            {"do": "state_set", "scope": "conversation", "key": "a1", "value": 1},
            {"do": "state_set", "scope": "conversation", "key": "a2", "value": 2},
            {"do": "state_list", "scope": "conversation", "prefix": "a", "limit": 1},
            {"do": "state_list", "scope": "conversation", "prefix": "a"},
            {"do": "state_delete", "scope": "conversation", "key": "a2"},
            {"do": "state_delete", "scope": "conversation", "key": "a2"},
        ]),
    )
    .await;
    assert_codes(&o, &["ok"; 10]);
    assert_eq!(ok(&o[3])["value"], "aliased");
    assert_eq!(ok(&o[6])["keys"], json!(["a1"]));
    assert_eq!(ok(&o[6])["has_more"], true);
    assert_eq!(ok(&o[7])["keys"], json!(["a1", "a2"]));
    assert_eq!(ok(&o[7])["has_more"], false);
    assert_eq!(ok(&o[8])["success"], true, "a row was removed");
    assert_eq!(ok(&o[9])["success"], false, "nothing left to remove");

    // The next run of the same agent sees it, in the Host API and in its state snapshot.
    let o = script(
        client,
        &conversation,
        json!([
            {"do": "state_get", "scope": "conversation", "key": "k"},
            {"do": "state_get", "scope": "actor", "key": "ak"},
            {"do": "context"},
        ]),
    )
    .await;
    assert_eq!(ok(&o[0])["value"], "from-a");
    assert_eq!(ok(&o[1])["value"], 1);
    assert_eq!(ok(&o[2])["state"]["conversation"]["k"], "from-a");

    // Another agent (another binding) in the same conversation cannot see it.
    patch_agent(client, &agent_a, &json!({"enabled": false})).await;
    let agent_b = agent(client, &conversation, API, json!({})).await;
    let o = script(
        client,
        &conversation,
        json!([
            {"do": "state_get", "scope": "conversation", "key": "k"},
            {"do": "state_get", "scope": "actor", "key": "ak"},
            {"do": "state_list", "scope": "conversation", "prefix": "a"},
        ]),
    )
    .await;
    assert_eq!(ok(&o[0])["value"], Value::Null);
    assert_eq!(ok(&o[1])["value"], Value::Null);
    assert_eq!(ok(&o[2])["keys"], json!([]));

    // The policy is frozen when a run starts: turning state off does not affect a run in
    // flight, only the next one.
    let barrier = unique("go");
    let (_, run_id) = start_script(
        client,
        &conversation,
        &json!([
            {"do": "announce"},
            {"do": "wait_storage", "owner": "plugin", "key": barrier},
            {"do": "state_set", "scope": "conversation", "key": "frozen", "value": true},
            {"do": "state_get", "scope": "conversation", "key": "frozen"},
        ]),
    )
    .await;
    announced(client, run_id).await;
    patch_agent(
        client,
        &agent_b,
        &json!({"state_policy": {"enable_state": false}}),
    )
    .await;
    open_barrier(stores, &barrier).await;
    let o = outcomes(client, run_id).await;
    assert_codes(&o, &["ok", "ok", "ok", "ok"]);
    assert_eq!(ok(&o[3])["value"], true);
    let o = script(
        client,
        &conversation,
        json!([{"do": "state_get", "scope": "conversation", "key": "frozen"}]),
    )
    .await;
    assert_codes(&o, &["unauthorized"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_and_artifact_results_are_applied_for_later_runs() {
    // Appendix B 35 and 36: `state.updated` and `artifact.created` results are side effects,
    // visible to the next run through the Host API.
    let cluster = cluster().await;
    let client = cluster.client();
    let conversation = unique("results");
    agent(client, &conversation, API, json!({})).await;
    let art = unique("made");
    let (_, first) = start_script(
        client,
        &conversation,
        &json!([
            {"do": "emit", "type": "state.updated", "data": {"scope": "conversation", "key": "from_result", "value": 42}},
            // a scope the policy does not enable is dropped; the run does not fail
            {"do": "emit", "type": "state.updated", "data": {"scope": "subject", "key": "x", "value": 1}},
            {"do": "emit", "type": "artifact.created", "data": {
                "artifact_type": "file", "artifact_id": art, "name": "note.txt",
                "mime_type": "text/plain", "content_base64": "bWFkZSBieSBhIHJ1bg=="}},
        ]),
    )
    .await;
    outcomes(client, first).await;
    let run = client.wait_run_terminal(first).await;
    assert_eq!(run["status"], "completed", "{run}");
    let rows = audit_rows(cluster.stores(), &conversation, "artifact.created").await;
    assert_eq!(rows.len(), 1, "one artifact.created row: {rows:?}");

    let o = script(
        client,
        &conversation,
        json!([
            {"do": "state_get", "scope": "conversation", "key": "from_result"},
            {"do": "artifact_metadata", "artifact_id": art},
            {"do": "artifact_read", "artifact_id": art},
        ]),
    )
    .await;
    assert_codes(&o, &["ok", "ok", "ok"]);
    assert_eq!(ok(&o[0])["value"], 42);
    assert_eq!(ok(&o[1])["source"], "runner");
    assert_eq!(ok(&o[1])["run_id"], first.to_string());
    assert_eq!(ok(&o[1])["size_bytes"], 13);
    assert_eq!(ok(&o[2])["content_base64"], "bWFkZSBieSBhIHJ1bg==");

    // Content that is not strict base64 is a protocol error of the run.
    let (_, bad) = start_script(
        client,
        &conversation,
        &json!([
            {"do": "emit", "type": "artifact.created", "data": {"artifact_type": "file", "content_base64": "%%%"}},
        ]),
    )
    .await;
    let run = client.wait_run_terminal(bad).await;
    assert_eq!(run["status"], "failed", "{run}");
    let items = client.run_events(bad, 0).await;
    let failure = items
        .iter()
        .find(|i| i.result_type == "run.failed")
        .unwrap_or_else(|| panic!("{items:?}"));
    assert_eq!(failure.data["code"], "runner.protocol_error", "{failure:?}");
    cluster.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Steering
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steering_is_pulled_in_order_audited_and_dropped_when_unpulled() {
    let cluster = cluster().await;
    let client = cluster.client();
    let stores = cluster.stores();
    let conversation = unique("steer");
    agent(client, &conversation, API, json!({})).await;

    let barrier = unique("go");
    let (_, run_id) = start_script(
        client,
        &conversation,
        &json!([
            {"do": "announce"},
            {"do": "wait_storage", "owner": "plugin", "key": barrier},
            {"do": "steering_pull", "mode": "one"},
            {"do": "steering_pull"},
            {"do": "steering_pull"},
        ]),
    )
    .await;
    announced(client, run_id).await;
    let first = client.send_message(&conversation, "first").await;
    wait_claimed(client, first, run_id).await;
    let second = client.send_message(&conversation, "second").await;
    wait_claimed(client, second, run_id).await;
    open_barrier(stores, &barrier).await;
    let o = outcomes(client, run_id).await;
    assert_codes(&o, &["ok", "ok", "ok", "ok", "ok"]);
    let pulled = |i: usize| -> Vec<String> {
        o[i]["data"]["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|item| item["event"]["event_id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(pulled(2), [first.to_string()], "one: the oldest only");
    assert_eq!(pulled(3), [second.to_string()], "all: the rest, in order");
    assert!(pulled(4).is_empty());
    assert_eq!(o[2]["data"]["items"][0]["input"]["text"], "first");

    // One `steering.injected` row per pulled item (Appendix B 30).
    let rows = audit_rows(stores, &conversation, "steering.injected").await;
    let sources: Vec<&str> = rows
        .iter()
        .map(|r| r.metadata["steering"]["source_event_id"].as_str().unwrap())
        .collect();
    assert_eq!(sources, [first.to_string(), second.to_string()], "{rows:?}");
    assert!(rows.iter().all(|r| r.run_id == Some(run_id)));

    // An item the run never pulls is dropped when it ends, with an audit row (Appendix B 40).
    let barrier = unique("go");
    let (_, run_id) = start_script(
        client,
        &conversation,
        &json!([
            {"do": "announce"},
            {"do": "wait_storage", "owner": "plugin", "key": barrier},
        ]),
    )
    .await;
    announced(client, run_id).await;
    let unpulled = client.send_message(&conversation, "never read").await;
    wait_claimed(client, unpulled, run_id).await;
    open_barrier(stores, &barrier).await;
    outcomes(client, run_id).await;
    let rows = wait_for("the steering.dropped row", || async {
        let rows = audit_rows(stores, &conversation, "steering.dropped").await;
        (!rows.is_empty()).then_some(rows)
    })
    .await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        rows[0].metadata["steering"]["source_event_id"],
        unpulled.to_string()
    );
    assert_eq!(rows[0].metadata["steering"]["reason"], "run_ended");
    cluster.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Cluster mode
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_mode_runners_and_remote_runners_share_one_pipeline() {
    require_api_runner();
    let spec = ClusterSpec {
        gateways: 2,
        orchestrators: 1,
        workers: 1,
        env: Vec::new(),
    };
    let Some(deployment) = Deployment::spawn_or_skip(spec).await else {
        return;
    };
    let ingest = deployment.client(0);
    let other_gateway = deployment.client(1);
    let base = other_gateway.base_url().to_owned();
    let (conversation, elsewhere) = (unique("cluster"), unique("cluster-other"));
    agent(&ingest, &conversation, API, json!({})).await;

    // Through the SDK, in a worker process, against Redis sessions and Postgres.
    let o = script(
        &ingest,
        &conversation,
        json!([
            {"do": "get_host_version"},
            {"do": "state_set", "scope": "conversation", "key": "k", "value": "v"},
            {"do": "state_get", "scope": "conversation", "key": "k"},
            {"do": "storage_set", "owner": "plugin", "key": "k", "text": "bytes"},
            {"do": "storage_get", "owner": "plugin", "key": "k"},
            {"do": "history_page"},
            {"do": "event_get", "event_id": "$event_id"},
            {"do": "steering_pull"},
            {"do": "history_page", "conversation_id": elsewhere},
            {"do": "state_get", "scope": "galaxy", "key": "k"},
            {"do": "call", "action": "teleport", "params": {}},
        ]),
    )
    .await;
    assert_codes(
        &o,
        &[
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "unauthorized",
            "unauthorized",
            "not_found",
        ],
    );
    assert_eq!(ok(&o[2])["value"], "v");

    // Over HTTP, on a gateway process that neither ingested the event nor hosts the run.
    let (_, run_id) = start_script(
        &ingest,
        &conversation,
        &json!([{"do": "announce"}, {"do": "wait_cancel"}]),
    )
    .await;
    let (url, token) = announced(&ingest, run_id).await;
    let (status, body) = remote(
        &base,
        &url,
        Some(&token),
        run_id,
        "state_get",
        json!({"scope": "conversation", "key": "k"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"]["value"], "v");
    let answer = remote(
        &base,
        &url,
        Some("wrong"),
        run_id,
        "get_host_version",
        json!({}),
    )
    .await;
    assert_remote_refused(&answer, 401, "unauthorized");
    cancel(&ingest, run_id).await;
    ingest.wait_run_terminal(run_id).await;
    let answer = remote(
        &base,
        &url,
        Some(&token),
        run_id,
        "get_host_version",
        json!({}),
    )
    .await;
    assert_remote_refused(&answer, 401, "unauthorized");
}
