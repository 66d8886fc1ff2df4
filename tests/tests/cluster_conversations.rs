//! Steering and the conversation concurrency policy (SPEC §7, host-behaviour §11, §15) end to
//! end in cluster mode: two gateway, two orchestrator and two worker processes on RabbitMQ,
//! Redis and Postgres ([`sb_tests::cluster`]), real runner processes (`sb-api-runner`, driven
//! through [`sb_tests::script`]), and the messages of one conversation posted through both
//! gateways (they still reach one events shard, hence one orchestrator at a time).
//!
//! The orchestrator's own suite (`orchestrator/tests/conversations.rs`) checks the routing
//! decisions with in-process routers; this suite checks what they look like from outside, in
//! the event log and the run ledger of a deployment:
//! - `parallel`: a second message starts a second run while the first one executes;
//! - `enqueue`: messages sent while a run is active stay `received` with
//!   `metadata.concurrency.status = queued`, then start one at a time, in arrival order, each
//!   only once the run before it ended;
//! - `interrupt`: a message cancels the active run (`cancelled`, the reason naming the event)
//!   and starts its own;
//! - `reject`: a message sent while a run is active is `rejected` (`conversation.busy`) and
//!   starts nothing; once the run ended, the conversation accepts messages again;
//! - steering: every message sent to an active steering run is claimed by it exactly once,
//!   starts no run, and is pulled by the run in order.
//!
//! Runs are held open by the runner itself, never by sleeping: `wait_cancel` (released by
//! `POST /v1/runs/{id}/cancel`) or a `wait_storage` barrier (released by writing the key).
//! The policy agents use `sdk-api-bare`, which does not declare steering, so no message is
//! absorbed into an active run and every one meets the policy.
//!
//! The services are required; a test is skipped (with a message) only when one of them is
//! unreachable. Build the binaries first: `cargo build --workspace --bins` (`scripts/test`
//! does).

use sb_protocol::ids::{EventId, RunId, WorkspaceId};
use sb_store::{RunFilter, RunRecord, Stores};
use sb_tests::Client;
use sb_tests::cluster::{ClusterSpec, TestCluster};
use sb_tests::script::{
    API, BARE, agent, announced, assert_codes, audit_rows, cancel, open_barrier, outcomes,
    require_api_runner, script, start_script, unique, wait_claimed,
};
use sb_tests::wait_for;
use serde_json::{Value, json};

/// Two processes of each role, or `None` (the test returns) when a service is unreachable.
///
/// The reapers' sweep of parked conversations is pushed out of the tests' way (its first
/// round runs at start): it is a safety net that may also release a parked event once the
/// active run's session is gone, a moment before the run's terminal status is recorded. With
/// only the result sink releasing parked events, "the next run is created after the previous
/// one ended" holds to the microsecond in the ledger, which the `enqueue` scenario asserts.
async fn deployment() -> Option<TestCluster> {
    require_api_runner();
    let spec = ClusterSpec::default().env("SWITCHBOARD__ORCHESTRATOR__REAPER_INTERVAL", "1h");
    TestCluster::spawn_or_skip(spec).await
}

/// Clients of both gateways and stores on the deployment's schema.
fn handles(deployment: &TestCluster) -> ([Client; 2], Stores) {
    let gateways = [deployment.client(0), deployment.client(1)];
    let stores = Stores::from_sql(deployment.store().clone());
    (gateways, stores)
}

/// A script that announces its run, then waits for the host's cancel.
fn hold() -> Value {
    json!([{"do": "announce"}, {"do": "wait_cancel"}])
}

/// An `sdk-api-bare` agent for `conversation` with the concurrency `policy`.
async fn policy_agent(client: &Client, conversation: &str, policy: &str) {
    agent(
        client,
        conversation,
        BARE,
        json!({"delivery_policy": {"concurrency": policy}}),
    )
    .await;
}

/// Every run of `conversation`, oldest first (by creation time).
async fn runs_of(stores: &Stores, conversation: &str) -> Vec<RunRecord> {
    let mut filter = RunFilter::workspace(WorkspaceId::default_workspace());
    filter.conversation_id = Some(conversation.to_owned());
    let mut runs = stores
        .runs
        .list_runs(filter, None, Some(100))
        .await
        .expect("the runs of the conversation")
        .items;
    runs.sort_by_key(|r| (r.created_at, r.id));
    runs
}

/// Cancels a held run through the API and returns it once it ended `cancelled`.
async fn release(client: &Client, run_id: RunId) -> Value {
    cancel(client, run_id).await;
    let run = client.wait_run_terminal(run_id).await;
    assert_eq!(run["status"], "cancelled", "{run}");
    run
}

/// The `metadata.concurrency` of an event.
fn concurrency_of(event: &Value) -> &Value {
    &event["metadata"]["concurrency"]
}

/// Waits until `event_id` is parked by `enqueue`, and returns the event.
async fn wait_parked(client: &Client, event_id: EventId) -> Value {
    wait_for(&format!("event {event_id} to be parked"), || async {
        let event = client.get_event(event_id).await;
        (concurrency_of(&event)["status"] == "queued").then_some(event)
    })
    .await
}

/// Asserts that a parked event is still waiting: `received`, no run, queued.
#[track_caller]
fn assert_still_parked(event: &Value) {
    assert_eq!(event["status"], "received", "{event}");
    assert_eq!(event["run_id"], Value::Null, "{event}");
    assert_eq!(concurrency_of(event)["status"], "queued", "{event}");
}

// ---------------------------------------------------------------------------------------------
// Concurrency policies
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_concurrency_policy_holds_across_processes() {
    let Some(deployment) = deployment().await else {
        return;
    };
    let (gateways, stores) = handles(&deployment);
    // Independent conversations with an agent each; one after the other so that a failure
    // names its policy.
    parallel_runs_side_by_side(&gateways, &stores).await;
    enqueue_runs_one_at_a_time_in_arrival_order(&gateways, &stores).await;
    interrupt_cancels_the_active_run_and_starts(&gateways, &stores).await;
    reject_refuses_while_busy(&gateways, &stores).await;
}

/// `parallel`: a second message starts a second run while the first still executes.
async fn parallel_runs_side_by_side([first_gw, second_gw]: &[Client; 2], stores: &Stores) {
    let conversation = unique("parallel");
    policy_agent(first_gw, &conversation, "parallel").await;
    let (_, first) = start_script(first_gw, &conversation, &hold()).await;
    announced(first_gw, first).await;

    let (second_event, second) = start_script(second_gw, &conversation, &hold()).await;
    assert_ne!(first, second);
    announced(second_gw, second).await;
    // Both execute at once: the first is still running, untouched, while the second runs.
    let run = first_gw.get_run(first).await;
    assert_eq!(run["status"], "running", "{run}");
    assert_eq!(run["cancel_requested_at"], Value::Null, "{run}");
    let event = second_gw.get_event(second_event).await;
    assert_eq!(event["status"], "dispatched", "{event}");
    assert_eq!(
        concurrency_of(&event),
        &Value::Null,
        "started alongside: {event}"
    );

    for run_id in [first, second] {
        let run = release(first_gw, run_id).await;
        assert_eq!(run["cancel_reason"], "cancelled via api", "{run}");
    }
    let runs = runs_of(stores, &conversation).await;
    assert_eq!(runs.len(), 2, "{runs:?}");
    let (a, b) = (&runs[0], &runs[1]);
    assert!(
        b.started_at.expect("started") < a.ended_at.expect("ended"),
        "the second run started only after the first ended: {runs:?}"
    );
}

/// `enqueue`: messages sent while a run is active wait, then start one at a time, in arrival
/// order, each once the run before it ended.
async fn enqueue_runs_one_at_a_time_in_arrival_order(gateways: &[Client; 2], stores: &Stores) {
    let conversation = unique("enqueue");
    policy_agent(&gateways[0], &conversation, "enqueue").await;
    let (first_event, first) = start_script(&gateways[0], &conversation, &hold()).await;
    announced(&gateways[0], first).await;

    // Three messages while the first run is active, through alternating gateways; each is
    // parked before the next is sent, which makes the send order the arrival order.
    let mut parked = Vec::new();
    for i in 0..3 {
        let gateway = &gateways[(i + 1) % 2];
        let event_id = gateway
            .send_message(&conversation, &hold().to_string())
            .await;
        let event = wait_parked(gateway, event_id).await;
        assert_still_parked(&event);
        let concurrency = concurrency_of(&event);
        assert_eq!(concurrency["policy"], "enqueue", "{event}");
        assert_eq!(
            concurrency["queued_behind"],
            json!([first.to_string()]),
            "{event}"
        );
        let ticket = concurrency["ticket"]
            .as_str()
            .unwrap_or_else(|| panic!("a parked event has a ticket: {event}"))
            .to_owned();
        parked.push((event_id, ticket));
    }
    assert!(
        parked.windows(2).all(|w| w[0].1 < w[1].1),
        "the queue is in arrival order: {parked:?}"
    );
    assert_eq!(runs_of(stores, &conversation).await.len(), 1);

    // Each end releases exactly the next message, and only that one.
    let mut started = vec![(first_event, first)];
    let mut active = first;
    for (i, &(event_id, _)) in parked.iter().enumerate() {
        for &(later, _) in &parked[i..] {
            assert_still_parked(&gateways[0].get_event(later).await);
        }
        let gateway = &gateways[i % 2];
        release(gateway, active).await;
        let next = gateway.run_of(event_id).await;
        announced(gateway, next).await;
        let event = gateway.get_event(event_id).await;
        assert_eq!(concurrency_of(&event)["status"], "started", "{event}");
        started.push((event_id, next));
        active = next;
    }
    release(&gateways[1], active).await;

    // The ledger: one run per message, created in arrival order, none overlapping another.
    let runs = runs_of(stores, &conversation).await;
    let ledger: Vec<(EventId, RunId)> = runs.iter().map(|r| (r.event_id, r.id)).collect();
    assert_eq!(ledger, started, "{runs:?}");
    for pair in runs.windows(2) {
        let (before, after) = (&pair[0], &pair[1]);
        let ended = before.ended_at.expect("ended");
        assert!(
            after.created_at >= ended && after.started_at.expect("started") >= ended,
            "run {} began before run {} ended: {runs:?}",
            after.id,
            before.id
        );
    }
}

/// `interrupt`: a message cancels the active run and starts its own.
async fn interrupt_cancels_the_active_run_and_starts(
    [first_gw, second_gw]: &[Client; 2],
    stores: &Stores,
) {
    let conversation = unique("interrupt");
    policy_agent(first_gw, &conversation, "interrupt").await;
    let (_, first) = start_script(first_gw, &conversation, &hold()).await;
    announced(first_gw, first).await;

    let steps = json!([{"do": "get_host_version"}]);
    let (next_event, second) = start_script(second_gw, &conversation, &steps).await;
    assert_ne!(first, second);
    let event = second_gw.get_event(next_event).await;
    assert_eq!(
        concurrency_of(&event),
        &json!({"policy": "interrupt", "interrupted_run_ids": [first.to_string()]}),
        "{event}"
    );

    // The interrupted run was cancelled by the host, for that event.
    let run = first_gw.wait_run_terminal(first).await;
    assert_eq!(run["status"], "cancelled", "{run}");
    assert_eq!(
        run["cancel_reason"],
        format!("interrupted by event {next_event} of the conversation"),
        "{run}"
    );
    let items = first_gw.run_events(first, 0).await;
    let terminal = items.last().expect("the interrupted run has items");
    assert_eq!(terminal.result_type, "run.failed", "{items:?}");
    assert_eq!(terminal.data["code"], "cancelled", "{items:?}");

    // The new run is not cancelled and completes.
    assert_codes(&outcomes(second_gw, second).await, &["ok"]);
    let run = second_gw.get_run(second).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["cancel_requested_at"], Value::Null, "{run}");
    assert_eq!(runs_of(stores, &conversation).await.len(), 2);
}

/// `reject`: a message sent while a run is active is refused and starts nothing.
async fn reject_refuses_while_busy([first_gw, second_gw]: &[Client; 2], stores: &Stores) {
    let conversation = unique("reject");
    policy_agent(first_gw, &conversation, "reject").await;
    let (_, first) = start_script(first_gw, &conversation, &hold()).await;
    announced(first_gw, first).await;

    let busy = second_gw
        .send_message(&conversation, &json!([]).to_string())
        .await;
    let event = second_gw.wait_routed(busy).await;
    assert_eq!(event["status"], "rejected", "{event}");
    assert_eq!(event["reason"], "conversation.busy", "{event}");
    assert_eq!(event["run_id"], Value::Null, "{event}");
    assert_eq!(
        concurrency_of(&event),
        &json!({"policy": "reject", "active_run_ids": [first.to_string()]}),
        "{event}"
    );
    let runs = runs_of(stores, &conversation).await;
    assert_eq!(
        runs.iter().map(|r| r.id).collect::<Vec<_>>(),
        [first],
        "a rejected event starts no run"
    );

    // The refusal did not touch the active run; once it ended, messages are accepted again.
    let run = release(first_gw, first).await;
    assert_eq!(run["cancel_reason"], "cancelled via api", "{run}");
    let o = script(
        second_gw,
        &conversation,
        json!([{"do": "get_host_version"}]),
    )
    .await;
    assert_codes(&o, &["ok"]);
    assert_eq!(runs_of(stores, &conversation).await.len(), 2);
}

// ---------------------------------------------------------------------------------------------
// Steering
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steering_is_claimed_exactly_once_under_two_orchestrators() {
    const MESSAGES: usize = 10;
    let Some(deployment) = deployment().await else {
        return;
    };
    let (gateways, stores) = handles(&deployment);
    let conversation = unique("steer");
    agent(&gateways[0], &conversation, API, json!({})).await;

    let barrier = unique("go");
    let (_, run_id) = start_script(
        &gateways[0],
        &conversation,
        &json!([
            {"do": "announce"},
            {"do": "wait_storage", "owner": "plugin", "key": barrier},
            {"do": "steering_pull", "limit": 100},
            {"do": "steering_pull"},
        ]),
    )
    .await;
    announced(&gateways[0], run_id).await;

    // Through alternating gateways, each read back through the other one; each is claimed
    // before the next is sent, which makes the send order the arrival order.
    let mut sent = Vec::with_capacity(MESSAGES);
    for i in 0..MESSAGES {
        let event_id = gateways[i % 2]
            .send_message(&conversation, &format!("steer {i}"))
            .await;
        wait_claimed(&gateways[(i + 1) % 2], event_id, run_id).await;
        sent.push(event_id);
    }
    for &event_id in &sent {
        let event = gateways[0].get_event(event_id).await;
        assert_eq!(
            event["run_id"],
            Value::Null,
            "a claimed message has no run: {event}"
        );
        assert_eq!(event["metadata"]["steering"]["status"], "queued", "{event}");
        assert_eq!(
            event["metadata"]["steering"]["claimed_runner_id"], API,
            "{event}"
        );
    }

    let sent: Vec<String> = sent.iter().map(ToString::to_string).collect();
    open_barrier(&stores, &barrier).await;
    let o = outcomes(&gateways[0], run_id).await;
    assert_codes(&o, &["ok", "ok", "ok", "ok"]);
    let pulled: Vec<&str> = o[2]["data"]["items"]
        .as_array()
        .expect("pulled items")
        .iter()
        .map(|item| item["event"]["event_id"].as_str().expect("an event id"))
        .collect();
    assert_eq!(pulled, sent, "every message once, in arrival order");
    let texts: Vec<&str> = o[2]["data"]["items"]
        .as_array()
        .expect("pulled items")
        .iter()
        .map(|item| item["input"]["text"].as_str().expect("a text"))
        .collect();
    let expected: Vec<String> = (0..MESSAGES).map(|i| format!("steer {i}")).collect();
    assert_eq!(texts, expected);
    assert_eq!(o[3]["data"]["items"], json!([]), "nothing is pulled twice");

    // One `steering.injected` audit row per message, and one run for the whole conversation.
    let rows = audit_rows(&stores, &conversation, "steering.injected").await;
    let sources: Vec<&str> = rows
        .iter()
        .map(|r| {
            r.metadata["steering"]["source_event_id"]
                .as_str()
                .expect("a source event")
        })
        .collect();
    assert_eq!(sources, sent, "{rows:?}");
    assert!(rows.iter().all(|r| r.run_id == Some(run_id)), "{rows:?}");
    assert!(
        audit_rows(&stores, &conversation, "steering.dropped")
            .await
            .is_empty(),
        "nothing was left unpulled"
    );
    let runs = runs_of(&stores, &conversation).await;
    assert_eq!(
        runs.iter().map(|r| r.id).collect::<Vec<_>>(),
        [run_id],
        "claimed messages start no run"
    );
    let run = gateways[1].get_run(run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
}
