//! End-to-end scenarios in embedded mode: the whole system in this process (as
//! `switchboard dev` runs it), driven over HTTP, executing real runner processes.
//!
//! Needs the runner binaries: `cargo build --workspace --bins` (scripts/test does it).
//!
//! Misbehaving runs go to `sb-test-runner` (its first input word picks the script: `crash`,
//! `garbage`, `empty`, `huge`, `unknown`, `fail`, `slow <n>`, …) through an agent scoped to
//! the test's conversation, which wins over the workspace-wide echo agent of the bootstrap.

use std::collections::BTreeSet;

use futures::future::join_all;
use sb_protocol::ids::{EventId, RunId, WorkspaceId};
use sb_protocol::result::AgentRunResult;
use sb_store::{EventQuery, EventStatus, EventStatusUpdate, NewAgent, NewEvent, NewRun};
use sb_tests::{ECHO, StreamFrom, TEST_PER_RUN, TEST_SHARED, TestCluster, message, wait_for};
use serde_json::{Value, json};

fn types(items: &[AgentRunResult]) -> Vec<&str> {
    items.iter().map(|i| i.result_type.as_str()).collect()
}

fn sequences(items: &[AgentRunResult]) -> Vec<u64> {
    items
        .iter()
        .map(|i| i.sequence.expect("a sequence"))
        .collect()
}

fn text_of(item: &AgentRunResult, path: &[&str]) -> String {
    text_path(&Value::Object(item.data.clone()), path)
}

fn text_path(value: &Value, path: &[&str]) -> String {
    let mut value = value;
    for key in path {
        value = &value[*key];
    }
    value.as_str().unwrap_or_default().to_owned()
}

/// Checks the invariants every finished run has: sequences 1..=n without gap or duplicate,
/// exactly one terminal item, and it is the last.
fn assert_dense_with_one_terminal(run_id: RunId, items: &[AgentRunResult]) {
    let expected: Vec<u64> = (1..=items.len() as u64).collect();
    assert_eq!(
        sequences(items),
        expected,
        "run {run_id}: {:?}",
        types(items)
    );
    let terminals = items.iter().filter(|i| i.is_terminal()).count();
    assert_eq!(terminals, 1, "run {run_id}: {:?}", types(items));
    assert!(
        items.last().is_some_and(AgentRunResult::is_terminal),
        "run {run_id}"
    );
}

/// Runs `text` in `conversation` (routed to `runner` through a conversation agent) and returns
/// the run id and its result items once it has ended.
async fn run_on(
    cluster: &TestCluster,
    runner: &str,
    conversation: &str,
    text: &str,
) -> (RunId, Value, Vec<AgentRunResult>) {
    let client = cluster.client();
    client.conversation_agent(conversation, runner).await;
    let event = client.send_message(conversation, text).await;
    let run_id = client.run_of(event).await;
    let run = client.wait_run_terminal(run_id).await;
    let items = client.run_events(run_id, 0).await;
    assert_dense_with_one_terminal(run_id, &items);
    (run_id, run, items)
}

fn failure_code(items: &[AgentRunResult]) -> Option<String> {
    items
        .iter()
        .find(|i| i.result_type == "run.failed")
        .and_then(|i| i.data.get("code"))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_streams_word_by_word_and_records_the_transcript() {
    let cluster = TestCluster::embedded().await;
    let client = cluster.client();

    // The worker registered the bundled runners.
    let runners = client.get("/v1/runners").await.expect(200).body;
    let ids: BTreeSet<&str> = runners["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["runner_id"].as_str())
        .collect();
    for id in [ECHO, TEST_SHARED, TEST_PER_RUN] {
        assert!(ids.contains(id), "{id} not registered: {ids:?}");
    }

    let event = client.send_message("happy", "hello big world").await;
    let run_id = client.run_of(event).await;
    let frames = client.stream_run(run_id, StreamFrom::Start).await;
    assert_eq!(frames.status, 200);
    let frames = frames.until_terminal().await;

    let events: Vec<&str> = frames.iter().map(|f| f.event.as_str()).collect();
    assert_eq!(
        events,
        [
            "message.delta",
            "message.delta",
            "message.delta",
            "message.completed",
            "run.completed"
        ]
    );
    let ids: Vec<u64> = frames.iter().map(sb_tests::SseFrame::sequence).collect();
    assert_eq!(ids, [1, 2, 3, 4, 5]);
    let chunks: Vec<String> = frames[..3]
        .iter()
        .map(|f| text_path(&f.json(), &["data", "chunk", "content"]))
        .collect();
    assert_eq!(chunks, ["hello ", "big ", "world"]);
    assert_eq!(
        text_path(&frames[3].json(), &["data", "message", "content"]),
        "hello big world"
    );
    for frame in &frames {
        assert_eq!(frame.result().run_id, run_id.to_string());
    }

    // The run's path, in milliseconds: ingested, routed (the run created), claimed, ended.
    let run = client.get_run(run_id).await;
    let event_view = client
        .get(&format!("/v1/events/{event}"))
        .await
        .expect(200)
        .body;
    sb_tests::assert_run_path_in_order(&event_view, &run);

    // The ledger holds exactly what was streamed.
    let items = client.run_events(run_id, 0).await;
    assert_dense_with_one_terminal(run_id, &items);
    assert_eq!(
        items,
        frames
            .iter()
            .map(sb_tests::SseFrame::result)
            .collect::<Vec<_>>()
    );

    let run = client.wait_run_terminal(run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["last_sequence"], 5);
    let event = client.get_event(event).await;
    assert_eq!(event["status"], "dispatched");
    assert_eq!(event["run_id"], run_id.to_string());

    // The transcript has the user's message and the assistant's answer, in that order.
    let transcript = wait_for("the assistant's transcript row", || async {
        let items = client.transcript("happy").await;
        items
            .iter()
            .any(|i| i["role"] == "assistant")
            .then_some(items)
    })
    .await;
    let rows: Vec<(String, String)> = transcript
        .iter()
        .filter(|i| i["item_type"] == "message")
        .map(|i| {
            (
                i["role"].as_str().unwrap_or_default().to_owned(),
                i["content"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("user".to_owned(), "hello big world".to_owned()),
            ("assistant".to_owned(), "hello big world".to_owned())
        ],
        "{transcript:?}"
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_can_answer_with_the_run_stream() {
    let cluster = TestCluster::embedded().await;
    let client = cluster.client();
    let response = reqwest::Client::new()
        .post(format!("{}/v1/events?stream=true", client.base_url()))
        .bearer_auth(cluster.process().api_key().unwrap())
        .json(&message("inline", "one two"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let event_id: EventId = response.headers()["x-event-id"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let body = response.text().await.unwrap();
    let mut parser = sb_tests::SseParser::default();
    let frames = parser.push(body.as_bytes());
    let events: Vec<&str> = frames.iter().map(|f| f.event.as_str()).collect();
    assert_eq!(
        events,
        [
            "message.delta",
            "message.delta",
            "message.completed",
            "run.completed"
        ]
    );
    let run_id = client.run_of(event_id).await;
    assert_eq!(frames[0].result().run_id, run_id.to_string());
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_streams_have_no_gap_and_no_duplicate() {
    let cluster = TestCluster::embedded().await;
    let client = cluster.client();
    client.conversation_agent("resume", TEST_SHARED).await;

    // A run that streams live for a while (40 deltas 5 ms apart).
    let event = client.send_message("resume", "slow 40").await;
    let run_id = client.run_of(event).await;

    // A client reads 7 items and goes away; it comes back with Last-Event-ID.
    let first = client
        .stream_run(run_id, StreamFrom::Start)
        .await
        .take(7)
        .await;
    let last_seen = first.last().unwrap().sequence();
    let rest = client
        .stream_run(run_id, StreamFrom::LastEventId(last_seen))
        .await
        .until_terminal()
        .await;
    let mut seen: Vec<u64> = first.iter().map(sb_tests::SseFrame::sequence).collect();
    seen.extend(rest.iter().map(sb_tests::SseFrame::sequence));
    let items = client.run_events(run_id, 0).await;
    assert_dense_with_one_terminal(run_id, &items);
    assert_eq!(seen, sequences(&items), "resumed with Last-Event-ID");
    assert_eq!(items.len(), 40 + 2);

    // Another client goes away mid-stream and resumes with after_sequence.
    let event = client.send_message("resume", "slow 30").await;
    let run_id = client.run_of(event).await;
    let first = client
        .stream_run(run_id, StreamFrom::Start)
        .await
        .take(3)
        .await;
    let rest = client
        .stream_run(
            run_id,
            StreamFrom::AfterSequence(first.last().unwrap().sequence()),
        )
        .await
        .until_terminal()
        .await;
    let mut seen: Vec<u64> = first.iter().map(sb_tests::SseFrame::sequence).collect();
    seen.extend(rest.iter().map(sb_tests::SseFrame::sequence));
    let items = client.run_events(run_id, 0).await;
    assert_eq!(seen, sequences(&items), "resumed with after_sequence");

    // Resuming a finished run replays the ledger after the given point.
    let tail = client
        .stream_run(run_id, StreamFrom::AfterSequence(29))
        .await
        .until_terminal()
        .await;
    let tail: Vec<u64> = tail.iter().map(sb_tests::SseFrame::sequence).collect();
    assert_eq!(tail, (30..=items.len() as u64).collect::<Vec<_>>());
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_idempotency_key_gives_the_same_event_and_one_run() {
    let cluster = TestCluster::embedded().await;
    let client = cluster.client();

    let body = message("idem", "only once");
    let first = client.post_event(&body, Some("order-42")).await.expect(202);
    let again = client.post_event(&body, Some("order-42")).await.expect(202);
    assert_eq!(first.str("event_id"), again.str("event_id"));
    assert!(first.headers.get("idempotent-replayed").is_none());
    assert_eq!(again.headers["idempotent-replayed"], "true");

    // Concurrent retries of one request also collapse onto the first event.
    let body = message("idem", "concurrent");
    let responses = join_all((0..8).map(|_| client.post_event(&body, Some("retry-7")))).await;
    let ids: BTreeSet<String> = responses
        .into_iter()
        .map(|r| r.expect(202).str("event_id").to_owned())
        .collect();
    assert_eq!(ids.len(), 1, "{ids:?}");

    // A client event_id is an idempotency key too.
    let mut with_id = message("idem", "client id");
    with_id["event_id"] = json!("client-event-1");
    let a = client.post_event(&with_id, None).await.expect(202);
    let b = client.post_event(&with_id, None).await.expect(202);
    assert_eq!(a.str("event_id"), b.str("event_id"));

    for event in [
        first.str("event_id"),
        ids.first().unwrap().as_str(),
        a.str("event_id"),
    ] {
        let run_id = client.run_of(event.parse().unwrap()).await;
        let run = client.wait_run_terminal(run_id).await;
        assert_eq!(run["status"], "completed");
    }
    // Exactly one run per distinct event.
    let runs = client
        .get("/v1/runs?conversation_id=idem&limit=100")
        .await
        .expect(200)
        .body;
    assert_eq!(runs["items"].as_array().unwrap().len(), 3, "{runs}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_no_agent_handles_is_unrouted() {
    let cluster = TestCluster::builder().without_default_agent().start().await;
    let client = cluster.client();
    let event = client.send_message("nobody", "is anyone there").await;
    let routed = client.wait_routed(event).await;
    assert_eq!(routed["status"], "unrouted", "{routed}");
    assert_eq!(routed["reason"], "binding.not_found", "{routed}");
    assert!(routed["run_id"].is_null());
    let runs = client.get("/v1/runs").await.expect(200).body;
    assert!(runs["items"].as_array().unwrap().is_empty(), "{runs}");

    // An event type no agent handles is unrouted the same way, even with agents present.
    client
        .create_agent(&json!({"name": "echo", "runner_id": ECHO}))
        .await
        .expect(201);
    let response = client
        .post_event(
            &json!({"event_type": "group.member_joined", "source": "api", "conversation_id": "g1"}),
            None,
        )
        .await
        .expect(202);
    let routed = client
        .wait_routed(response.str("event_id").parse().unwrap())
        .await;
    assert_eq!(routed["status"], "unrouted", "{routed}");
    assert_eq!(routed["reason"], "binding.not_found", "{routed}");
    cluster.shutdown().await;
}

/// `POST /v1/agents` refuses an agent that would tie with an existing one (409), so the API
/// cannot create an ambiguity. A tie can still exist in the table (written by another tool,
/// or left by an older version), and the resolver must then refuse to pick one: the tie is
/// created through the store here, below the API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tied_agents_leave_the_event_unrouted_as_ambiguous() {
    let cluster = TestCluster::embedded().await;
    let client = cluster.client();
    client.conversation_agent("tie", TEST_SHARED).await;
    let conflict = client
        .create_agent(&json!({
            "name": "second", "runner_id": ECHO, "scope": {"conversation_id": "tie"},
        }))
        .await
        .expect(409);
    assert_eq!(conflict.body["code"], "conflict", "{}", conflict.body);

    cluster
        .stores()
        .agents
        .create(NewAgent {
            id: None,
            workspace_id: WorkspaceId::default_workspace(),
            name: "second".into(),
            description: None,
            runner_id: ECHO.into(),
            runner_config: json!({}),
            event_types: json!(["message.received"]),
            scope: json!({"conversation_id": "tie"}),
            filters: json!([]),
            resource_policy: json!({}),
            state_policy: json!({}),
            delivery_policy: json!({}),
            budgets: json!({}),
            enabled: true,
            routing: sb_store::AgentRouting::Scope,
        })
        .await
        .unwrap();
    let event = client.send_message("tie", "which one").await;
    let routed = client.wait_routed(event).await;
    assert_eq!(routed["status"], "unrouted", "{routed}");
    assert_eq!(routed["reason"], "binding.ambiguous", "{routed}");
    assert!(routed["run_id"].is_null());

    // Other conversations still go to the workspace-wide agent.
    let event = client.send_message("elsewhere", "fine").await;
    let run_id = client.run_of(event).await;
    assert_eq!(
        client.wait_run_terminal(run_id).await["status"],
        "completed"
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_reported_failure_fails_the_run() {
    let cluster = TestCluster::embedded().await;
    let (_, run, items) = run_on(&cluster, TEST_SHARED, "fail", "fail").await;
    assert_eq!(types(&items), ["run.failed"]);
    assert_eq!(failure_code(&items).as_deref(), Some("runner.error"));
    assert_eq!(
        text_path(&json!(items[0].data), &["error"]),
        "scripted failure"
    );
    assert_eq!(run["status"], "failed", "{run}");
    assert_eq!(run["error"]["code"], "runner.error", "{run}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_runner_fails_its_run_and_is_restarted() {
    let cluster = TestCluster::embedded().await;
    let (run_id, run, items) = run_on(&cluster, TEST_SHARED, "crash", "crash").await;
    assert_eq!(types(&items), ["message.delta", "run.failed"], "{run_id}");
    assert_eq!(failure_code(&items).as_deref(), Some("runner.crashed"));
    assert_eq!(run["status"], "failed");
    assert_eq!(run["error"]["code"], "runner.crashed", "{run}");

    // The next run of the same runner gets a new process.
    let client = cluster.client();
    let event = client.send_message("crash", "back again").await;
    let run_id = client.run_of(event).await;
    let run = client.wait_run_terminal(run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_output_is_a_protocol_error() {
    let cluster = TestCluster::embedded().await;
    let (_, run, items) = run_on(&cluster, TEST_PER_RUN, "garbage", "garbage").await;
    assert_eq!(
        failure_code(&items).as_deref(),
        Some("runner.protocol_error"),
        "{:?}",
        types(&items)
    );
    assert_eq!(run["status"], "failed");
    assert_eq!(run["error"]["code"], "runner.protocol_error", "{run}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_output_is_not_a_silent_success() {
    let cluster = TestCluster::embedded().await;
    let (_, run, items) = run_on(&cluster, TEST_SHARED, "empty", "empty").await;
    assert_eq!(types(&items), ["run.failed"]);
    assert_eq!(failure_code(&items).as_deref(), Some("runner.empty_output"));
    assert_eq!(run["status"], "failed");
    cluster.shutdown().await;
}

/// `tool.call.*` telemetry (PROTOCOL_V1: lenient, never validated) is sequenced, kept in the
/// run ledger exactly as sent and served by `GET /v1/runs/{id}/events`, but it is not a
/// message: it reaches no transcript, and a run that emits only telemetry still fails with
/// `runner.empty_output`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_call_telemetry_is_kept_in_the_ledger_but_is_not_a_message() {
    let cluster = TestCluster::embedded().await;
    let started = json!({"type": "tool.call.started", "data": {
        "tool_call_id": "call-1", "tool_name": "search", "parameters": {"q": "leave"}}});
    let completed = json!({"type": "tool.call.completed", "data": {
        "tool_call_id": "call-1", "tool_name": "search", "result": {"hits": 2},
        "duration_ms": 12, "extra": "kept"}});
    let answer = json!({"type": "message.completed",
        "data": {"message": {"role": "assistant", "content": "found 2"}}});
    let script = json!([started, completed, answer]);
    let (run_id, run, items) =
        run_on(&cluster, TEST_SHARED, "telemetry", &format!("raw {script}")).await;
    assert_eq!(
        types(&items),
        [
            "tool.call.started",
            "tool.call.completed",
            "message.completed",
            "run.completed"
        ],
        "{run_id}"
    );
    assert_eq!(json!(items[0].data), started["data"]);
    assert_eq!(json!(items[1].data), completed["data"], "kept as sent");
    assert!(items.iter().all(|i| i.run_id == run_id.to_string()));
    assert_eq!(run["status"], "completed", "{run}");
    // Paging the ledger past the telemetry starts after it.
    let client = cluster.client();
    assert_eq!(
        types(&client.run_events(run_id, 2).await),
        ["message.completed", "run.completed"]
    );
    let transcript = wait_for("the assistant's transcript row", || async {
        let items = client.transcript("telemetry").await;
        items
            .iter()
            .any(|i| i["role"] == "assistant")
            .then_some(items)
    })
    .await;
    let rows: Vec<(&str, &str)> = transcript
        .iter()
        .map(|i| {
            (
                i["role"].as_str().unwrap_or_default(),
                i["item_type"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [("user", "message"), ("assistant", "message")],
        "telemetry is not transcribed"
    );

    // Telemetry alone, even with junk data, is recorded, and the run is still empty.
    let only = json!([
        {"type": "tool.call.started", "data": "junk"},
        {"type": "tool.call.completed", "data": {"tool_call_id": "call-2"}}
    ]);
    let event = client
        .send_message("telemetry", &format!("raw {only}"))
        .await;
    let run_id = client.run_of(event).await;
    let run = client.wait_run_terminal(run_id).await;
    let items = client.run_events(run_id, 0).await;
    assert_dense_with_one_terminal(run_id, &items);
    assert_eq!(
        types(&items),
        ["tool.call.started", "tool.call.completed", "run.failed"]
    );
    assert_eq!(json!(items[0].data), json!({"value": "junk"}));
    assert_eq!(failure_code(&items).as_deref(), Some("runner.empty_output"));
    assert_eq!(run["status"], "failed", "{run}");
    assert_eq!(run["error"]["code"], "runner.empty_output", "{run}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_results_are_truncated_or_refused() {
    let cluster = TestCluster::embedded().await;
    // A 2 MiB delta is cut to a short text with a marker; the run goes on.
    let (_, run, items) = run_on(&cluster, TEST_SHARED, "huge", "huge").await;
    assert_eq!(
        types(&items),
        ["message.delta", "message.completed", "run.completed"]
    );
    let content = text_path(&json!(items[0].data), &["chunk", "content"]);
    assert!(
        content.len() < 20_000 && content.ends_with("...[truncated]"),
        "{} bytes",
        content.len()
    );
    assert_eq!(run["status"], "completed");

    // A 2 MiB state value cannot be cut: the run fails.
    let client = cluster.client();
    let event = client.send_message("huge", "hugestate").await;
    let run_id = client.run_of(event).await;
    let run = client.wait_run_terminal(run_id).await;
    let items = client.run_events(run_id, 0).await;
    assert_dense_with_one_terminal(run_id, &items);
    assert_eq!(
        failure_code(&items).as_deref(),
        Some("runner.protocol_error")
    );
    assert_eq!(run["status"], "failed");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_result_types_are_dropped() {
    let cluster = TestCluster::embedded().await;
    let (_, run, items) = run_on(&cluster, TEST_SHARED, "unknown", "unknown a b").await;
    assert_eq!(
        types(&items),
        [
            "message.delta",
            "message.delta",
            "message.completed",
            "run.completed"
        ]
    );
    assert_eq!(text_of(&items[2], &["message", "content"]), "a b");
    assert_eq!(run["status"], "completed");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_conversations_at_once() {
    const N: usize = 200;
    let cluster = TestCluster::embedded().await;
    let client = cluster.client();
    let events: Vec<EventId> = join_all((0..N).map(|i| async move {
        client
            .send_message(&format!("crowd-{i}"), &format!("message number {i}"))
            .await
    }))
    .await;
    let runs: Vec<RunId> = join_all(events.iter().map(|e| client.run_of(*e))).await;
    assert_eq!(
        runs.iter().collect::<BTreeSet<_>>().len(),
        N,
        "one run per event"
    );

    let results = join_all(runs.iter().enumerate().map(|(i, run_id)| async move {
        let run = client.wait_run_terminal(*run_id).await;
        let items = client.run_events(*run_id, 0).await;
        (i, *run_id, run, items)
    }))
    .await;
    for (i, run_id, run, items) in results {
        assert_eq!(run["status"], "completed", "{run}");
        assert_eq!(run["conversation_id"], format!("crowd-{i}"));
        assert_dense_with_one_terminal(run_id, &items);
        assert_eq!(
            types(&items),
            [
                "message.delta",
                "message.delta",
                "message.delta",
                "message.completed",
                "run.completed"
            ],
            "run {run_id}"
        );
        assert_eq!(
            text_of(&items[3], &["message", "content"]),
            format!("message number {i}")
        );
    }
    cluster.shutdown().await;
}

/// Runs in flight and jobs still waiting when the process is asked to stop: the drain
/// finishes what it can within the drain timeout, cancels what is still running, and
/// everything else resumes after a restart on the same data directory. No accepted event is
/// lost and none gets two runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_loses_no_accepted_event() {
    let cluster = TestCluster::builder()
        .without_default_agent()
        .config("worker.slots", 2)
        .config("worker.drain_timeout", "1s")
        .config("worker.cancel_grace", "1s")
        .start()
        .await;
    let client = cluster.client().clone();
    client
        .create_agent(&json!({"name": "scripted", "runner_id": TEST_SHARED}))
        .await
        .expect(201);

    // One run that only ends when cancelled, running before the stop.
    let stuck = client.send_message("stuck", "cancellable").await;
    let stuck_run = client.run_of(stuck).await;
    wait_for("the cancellable run to start", || async {
        (client.get_run(stuck_run).await["status"] == "running").then_some(())
    })
    .await;
    // Then more work than one slot can finish before the drain timeout.
    let mut events = Vec::new();
    for i in 0..12 {
        events.push(client.send_message(&format!("busy-{i}"), "slow 100").await);
    }

    let (report, cluster) = cluster.restart().await;
    assert_eq!(report.failure, None);
    assert_eq!(
        report.work_handed_over,
        Some(false),
        "one slot is busy with the cancellable run: jobs were still waiting at the drain timeout"
    );
    let worker = report.worker.expect("the worker drained");
    assert_eq!(worker.cancelled_runs, [stuck_run], "{worker:?}");
    assert!(worker.forced_runs.is_empty(), "{worker:?}");
    // Work the previous process did not get to was picked up again.
    assert!(
        !cluster.process().recovery().republished.is_empty(),
        "{:?}",
        cluster.process().recovery()
    );
    assert!(cluster.process().recovery().interrupted.is_empty());

    let client = cluster.client();
    let run = client.wait_run_terminal(stuck_run).await;
    assert_eq!(run["status"], "cancelled", "{run}");
    assert_eq!(run["error"]["code"], "cancelled", "{run}");
    let items = client.run_events(stuck_run, 0).await;
    assert_dense_with_one_terminal(stuck_run, &items);

    let mut runs = BTreeSet::new();
    for event in &events {
        let run_id = client.run_of(*event).await;
        let run = client.wait_run_terminal(run_id).await;
        assert_eq!(run["status"], "completed", "{run}");
        let items = client.run_events(run_id, 0).await;
        assert_dense_with_one_terminal(run_id, &items);
        assert_eq!(items.len(), 100 + 2);
        runs.insert(run_id);
    }
    assert_eq!(runs.len(), events.len());
    let all = client.get("/v1/runs?limit=100").await.expect(200).body;
    assert_eq!(
        all["items"].as_array().unwrap().len(),
        events.len() + 1,
        "one run per event"
    );
    let report = cluster.shutdown().await;
    assert!(report.is_clean(), "{report:?}");
}

/// What a crash leaves in the ledger, and the in-process bus cannot remember: an accepted
/// event whose message was lost, and a run that was executing. The next start routes the
/// event and ends the run `interrupted` (never re-executed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_recovers_what_a_crash_left_behind() {
    let cluster = TestCluster::embedded().await;
    let client = cluster.client().clone();
    let template = client.send_message("before", "left behind").await;
    let template_run = client.run_of(template).await;
    client.wait_run_terminal(template_run).await;
    let stores = cluster.stores().clone();
    let record = stores.events.get(template).await.unwrap().unwrap();

    // An accepted event whose bus message was lost (no outbox row: "already published").
    let lost = EventId::new();
    let mut envelope = record.envelope.clone().unwrap();
    envelope["event_id"] = json!(lost.to_string());
    envelope["conversation_id"] = json!("lost");
    let mut new_event = NewEvent::new(WorkspaceId::default_workspace(), "message.received", "api");
    new_event.id = Some(lost);
    new_event.conversation_id = Some("lost".into());
    new_event.input_summary = record.input_summary.clone();
    new_event.envelope = Some(envelope);
    stores.events.append(new_event, Vec::new()).await.unwrap();

    // A run a worker had claimed when the process died.
    let orphan_event = EventId::new();
    let mut new_event = NewEvent::new(WorkspaceId::default_workspace(), "message.received", "api");
    new_event.id = Some(orphan_event);
    new_event.conversation_id = Some("orphan".into());
    stores.events.append(new_event, Vec::new()).await.unwrap();
    let (orphan, _) = stores
        .runs
        .create_run(NewRun {
            id: None,
            workspace_id: WorkspaceId::default_workspace(),
            event_id: orphan_event,
            agent_id: None,
            runner_id: ECHO.into(),
            pool: "default".into(),
            conversation_id: Some("orphan".into()),
            thread_id: None,
            bot_id: None,
            deadline_at: None,
            attempt: 1,
        })
        .await
        .unwrap();
    let dispatched = EventStatusUpdate {
        run_id: Some(orphan.id),
        ..EventStatusUpdate::status(EventStatus::Dispatched)
    };
    stores
        .events
        .update_status(orphan_event, dispatched)
        .await
        .unwrap();
    assert!(
        stores
            .runs
            .claim_run(orphan.id, "worker-gone")
            .await
            .unwrap()
    );

    let (_, cluster) = cluster.restart().await;
    let recovery = cluster.process().recovery().clone();
    assert_eq!(recovery.interrupted, [orphan.id]);
    assert_eq!(recovery.republished, [lost]);

    let client = cluster.client();
    let run_id = client.run_of(lost).await;
    let run = client.wait_run_terminal(run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    let items = client.run_events(run_id, 0).await;
    assert_eq!(
        text_of(&items[items.len() - 2], &["message", "content"]),
        "left behind"
    );

    let run = client.get_run(orphan.id).await;
    assert_eq!(run["status"], "interrupted", "{run}");
    assert_eq!(run["error"]["code"], "interrupted", "{run}");
    let items = client.run_events(orphan.id, 0).await;
    assert_dense_with_one_terminal(orphan.id, &items);
    assert_eq!(failure_code(&items).as_deref(), Some("interrupted"));
    // A stream of the interrupted run ends instead of waiting forever.
    let frames = client
        .stream_run(orphan.id, StreamFrom::Start)
        .await
        .until_terminal()
        .await;
    assert_eq!(frames.last().unwrap().event, "run.failed");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bootstrap_keeps_its_key_and_agent_across_restarts() {
    let cluster = TestCluster::embedded().await;
    let first = cluster.process().bootstrap().unwrap().clone();
    assert!(first.api_key_created);
    assert!(first.default_agent.is_some());
    assert_eq!(first.api_key_file, cluster.data_dir().join("api-key"));
    assert_eq!(
        std::fs::read_to_string(&first.api_key_file).unwrap().trim(),
        first.api_key
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&first.api_key_file)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    // Requests without the key are refused.
    let anonymous = cluster.client().with_key(None);
    assert_eq!(anonymous.get("/v1/agents").await.status, 401);

    let (report, cluster) = cluster.restart().await;
    assert!(report.is_clean(), "{report:?}");
    let second = cluster.process().bootstrap().unwrap().clone();
    assert_eq!(second.api_key, first.api_key);
    assert!(!second.api_key_created);
    assert_eq!(second.default_agent, None);
    let agents = cluster.client().get("/v1/agents").await.expect(200).body;
    let agents = agents["items"].as_array().unwrap();
    assert_eq!(agents.len(), 1, "{agents:?}");
    assert_eq!(agents[0]["runner_id"], ECHO);

    // A key file that no longer matches the database is replaced.
    std::fs::write(&first.api_key_file, "sb_not-a-real-key\n").unwrap();
    let (_, cluster) = cluster.restart().await;
    let third = cluster.process().bootstrap().unwrap().clone();
    assert!(third.api_key_created);
    assert_ne!(third.api_key, first.api_key);
    cluster.client().get("/v1/agents").await.expect(200);
    cluster.shutdown().await;
}

/// A schedule turns into events that enter the pipeline like ingested ones: an interval
/// schedule bound (through the workspace-wide echo agent) produces completed runs, each
/// firing with its own idempotency key; once deleted it fires no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interval_schedule_produces_runs_until_deleted() {
    let cluster = TestCluster::builder()
        .config("orchestrator.scheduler_interval", "200ms")
        .start()
        .await;
    let client = cluster.client();
    let created = client
        .post(
            "/v1/schedules",
            &json!({"kind": "interval", "spec": "1s", "event": message("sched", "tick")}),
        )
        .await
        .expect(201);
    let schedule_id = created.str("schedule_id").to_owned();

    let fired = || async {
        let mut query = EventQuery::new(WorkspaceId::default_workspace());
        query.conversation_id = Some("sched".into());
        query.limit = Some(100);
        cluster.stores().events.page(query).await.unwrap().items
    };
    let events = wait_for("two firings", || async {
        let events = fired().await;
        (events.len() >= 2).then_some(events)
    })
    .await;
    let keys: BTreeSet<String> = events
        .iter()
        .map(|e| e.idempotency_key.clone().expect("a firing key"))
        .collect();
    assert_eq!(keys.len(), events.len(), "one key per firing: {keys:?}");
    for key in &keys {
        assert!(
            key.starts_with(&format!("schedule:{schedule_id}:")),
            "{key}"
        );
    }
    for event in &events {
        let run_id = client.run_of(event.id).await;
        let run = client.wait_run_terminal(run_id).await;
        assert_eq!(run["status"], "completed", "{run}");
        let items = client.run_events(run_id, 0).await;
        assert_dense_with_one_terminal(run_id, &items);
    }

    client
        .delete(&format!("/v1/schedules/{schedule_id}"))
        .await
        .expect(204);
    // A firing that committed before the delete is counted here; none can follow it.
    let after_delete = fired().await.len();
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    assert_eq!(
        fired().await.len(),
        after_delete,
        "a deleted schedule fired"
    );
    client
        .get(&format!("/v1/schedules/{schedule_id}"))
        .await
        .expect(404);
    cluster.shutdown().await;
}

/// Issue 15 finding 6: a run without a deadline is bounded by `limits.run_max_duration`. The
/// reaper finalizes it `timeout` with one terminal item and cancels it on its worker (whose
/// own late `cancelled` terminal item is refused), so it neither lives forever nor ends twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_without_a_deadline_ends_at_the_deployment_maximum() {
    let cluster = TestCluster::builder()
        .config("limits.run_max_duration", "2s")
        .config("orchestrator.reaper_interval", "200ms")
        .start()
        .await;
    let client = cluster.client();
    sb_tests::script::agent(
        client,
        "forever",
        TEST_SHARED,
        json!({"runner_config": {"timeout": 0}}),
    )
    .await;
    let event = client.send_message("forever", "cancellable").await;
    let run_id = client.run_of(event).await;
    let run = client.wait_run_terminal(run_id).await;
    assert_eq!(run["status"], "timeout", "{run}");
    assert!(run["deadline_at"].is_null(), "{run}");
    let frames = client
        .stream_run(run_id, StreamFrom::Start)
        .await
        .until_terminal()
        .await;
    assert_eq!(frames.last().unwrap().event, "run.failed");
    // The worker's own terminal item (cancelled) arrives later and is not stored.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let items = client.run_events(run_id, 0).await;
    assert_dense_with_one_terminal(run_id, &items);
    assert_eq!(failure_code(&items).as_deref(), Some("timeout"));
    assert_eq!(client.get_run(run_id).await["status"], "timeout");
    cluster.shutdown().await;
}
