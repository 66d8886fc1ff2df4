//! The run pipeline in cluster mode: two gateways, two orchestrators and two workers, each its
//! own `switchboard` process, on the local RabbitMQ, Redis and Postgres
//! ([`sb_tests::cluster`]). Every hand-over of a run crosses a process boundary, and the
//! tests check what SPEC §2 and §11 promise across them: dense ordered result sequences,
//! gap-free resume on any gateway, idempotent ingest, a job executed once however often it
//! is delivered, and a crashed worker's run ending `interrupted` without being replayed.
//!
//! The services are required; a test is skipped (with a message) only when one of them is
//! unreachable. Build the binaries first: `cargo build --workspace --bins` (`scripts/test`
//! does).

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use sb_common::bus::amqp::{AmqpBus, AmqpOptions};
use sb_common::bus::topology::runs_routing_key;
use sb_common::bus::{Bus as _, ConsumeOptions, PublishOptions, QueueSpec};
use sb_protocol::ids::{EventId, RunId};
use sb_protocol::messages::{RunJob, decode};
use sb_protocol::result::AgentRunResult;
use sb_tests::cluster::{ClusterSpec, Role, TestCluster, child_processes};
use sb_tests::{Client, SseFrame, SseParser, StreamFrom, TEST_PER_RUN, TEST_SHARED, message};
use serde_json::{Value, json};

/// Events with this bot id go to the test agent (a bot scope is more specific than the
/// workspace-wide echo agent).
const TEST_BOT: &str = "tests";
/// Longest wait for a streamed run.
const STREAM_TIMEOUT: Duration = Duration::from_secs(90);

/// Starts a cluster, or returns from the test when a service is unreachable.
macro_rules! cluster {
    ($spec:expr) => {
        match TestCluster::spawn_or_skip($spec).await {
            Some(cluster) => cluster,
            None => return,
        }
    };
}

/// A `message.received` for the test agent.
fn test_message(conversation: &str, text: &str) -> Value {
    let mut body = message(conversation, text);
    body["bot_id"] = json!(TEST_BOT);
    body
}

/// Creates the agent that handles [`test_message`]s with `runner_id`.
async fn add_test_agent(cluster: &TestCluster, runner_id: &str) {
    cluster
        .create_agent(json!({
            "name": "tests",
            "runner_id": runner_id,
            "scope": {"bot_id": TEST_BOT},
        }))
        .await
        .expect("the test agent is created");
}

/// `POST /v1/events?stream=true` on `client`: the event id and the frames, up to the
/// terminal (or `error`) frame, or the first `take` frames (then the connection is dropped).
async fn ingest_stream(
    http: &reqwest::Client,
    client: &Client,
    api_key: &str,
    body: &Value,
    take: Option<usize>,
) -> (EventId, Vec<SseFrame>) {
    let response = http
        .post(format!("{}/v1/events?stream=true", client.base_url()))
        .bearer_auth(api_key)
        .json(body)
        .send()
        .await
        .expect("the streaming ingest is answered");
    let status = response.status().as_u16();
    let event_id = response
        .headers()
        .get("x-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    if status != 200 {
        let text = response.text().await.unwrap_or_default();
        panic!(
            "POST /v1/events?stream=true on {}: {status} {text}",
            client.base_url()
        );
    }
    let event_id = event_id.expect("X-Event-Id names the event");
    let mut parser = SseParser::default();
    let mut chunks = response.bytes_stream();
    let mut frames = Vec::new();
    let deadline = tokio::time::Instant::now() + STREAM_TIMEOUT;
    loop {
        let chunk = tokio::time::timeout_at(deadline, chunks.next())
            .await
            .unwrap_or_else(|_| panic!("stream of event {event_id} stalled; frames: {frames:?}"));
        let Some(chunk) = chunk else {
            return (event_id, frames);
        };
        for frame in parser.push(&chunk.expect("the stream body")) {
            let last = frame.is_terminal() || frame.event == "error";
            frames.push(frame);
            if last || take.is_some_and(|n| frames.len() >= n) {
                return (event_id, frames);
            }
        }
    }
}

/// A stream's frames with the time each one was read, until the terminal frame.
async fn timed_frames(client: &Client, run_id: RunId) -> Vec<(SseFrame, Instant)> {
    let mut stream = client.stream_run(run_id, StreamFrom::Start).await;
    assert_eq!(stream.status, 200, "stream of run {run_id}");
    let mut frames = Vec::new();
    while let Some(frame) = stream.next_frame().await {
        let last = frame.is_terminal() || frame.event == "error";
        frames.push((frame, Instant::now()));
        if last {
            return frames;
        }
    }
    panic!("the stream of run {run_id} ended without a terminal frame");
}

/// Checks that `frames` are result items with sequences `after + 1, after + 2, …` (the SSE
/// `id` equal to the item's `sequence`) and that only the last one is terminal, when
/// `terminal_expected`.
#[track_caller]
fn assert_dense(frames: &[SseFrame], after: u64, terminal_expected: bool) {
    assert!(!frames.is_empty(), "no frames");
    for (i, frame) in frames.iter().enumerate() {
        assert_ne!(frame.event, "error", "error frame: {}", frame.data);
        let expected = after + 1 + i as u64;
        assert_eq!(frame.sequence(), expected, "frame {i}: {frames:?}");
        assert_eq!(frame.result().sequence, Some(expected), "frame {i} data");
        assert_eq!(
            frame.event,
            frame.result().result_type,
            "frame {i} event name"
        );
        let last = i + 1 == frames.len();
        assert_eq!(
            frame.is_terminal(),
            last && terminal_expected,
            "terminal frames must be exactly the last one: {frames:?}"
        );
    }
}

/// Checks that stored items are `1..=n` with exactly one terminal item, the last.
#[track_caller]
fn assert_dense_items(items: &[AgentRunResult]) {
    assert!(!items.is_empty(), "no items");
    for (i, item) in items.iter().enumerate() {
        assert_eq!(item.sequence, Some(i as u64 + 1), "item {i}");
        assert_eq!(
            item.is_terminal(),
            i + 1 == items.len(),
            "item {i}: {item:?}"
        );
    }
}

fn results(frames: &[SseFrame]) -> Vec<AgentRunResult> {
    frames.iter().map(SseFrame::result).collect()
}

fn run_id_of(frames: &[SseFrame]) -> RunId {
    frames[0]
        .result()
        .run_id
        .parse()
        .expect("the frames name their run")
}

/// The text of a `message.delta` item.
fn delta_text(item: &AgentRunResult) -> String {
    match &item.data["chunk"]["content"] {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
        other => panic!("delta without text content: {other}"),
    }
}

fn types(items: &[AgentRunResult]) -> Vec<&str> {
    items.iter().map(|i| i.result_type.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_happy_path_through_each_gateway() {
    let cluster = cluster!(ClusterSpec::default());
    let http = reqwest::Client::new();
    for gw in 0..2 {
        let conversation = format!("happy-{gw}");
        let (event_id, frames) = ingest_stream(
            &http,
            &cluster.client(gw),
            cluster.api_key(),
            &message(&conversation, "hello big world"),
            None,
        )
        .await;
        assert_dense(&frames, 0, true);
        let items = results(&frames);
        assert_eq!(
            types(&items),
            [
                "message.delta",
                "message.delta",
                "message.delta",
                "message.completed",
                "run.completed"
            ]
        );
        let text: String = items[..3].iter().map(delta_text).collect();
        assert_eq!(text, "hello big world");

        // The other gateway reads the same run from the ledger.
        let other = cluster.client(gw + 1);
        let run_id = run_id_of(&frames);
        let run = other.wait_run_terminal(run_id).await;
        assert_eq!(run["status"], "completed", "{run}");
        assert_eq!(run["event_id"], event_id.to_string());
        assert_eq!(run["conversation_id"], conversation.as_str());
        assert!(
            cluster
                .worker_ids()
                .iter()
                .any(|w| run["worker_id"] == w.as_str()),
            "executed by one of the cluster's workers: {run}"
        );
        assert_eq!(other.run_events(run_id, 0).await, items, "ledger = stream");
        let event = other.get_event(event_id).await;
        assert_eq!(event["status"], "dispatched");
        assert_eq!(event["run_id"], run_id.to_string());
        sb_tests::assert_run_path_in_order(&event, &run);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_on_any_gateway_has_no_gap_and_no_duplicate() {
    let cluster = cluster!(ClusterSpec::default());
    add_test_agent(&cluster, TEST_SHARED).await;
    let http = reqwest::Client::new();
    // 400 deltas 5 ms apart: the run is still producing while the client hops gateways.
    let (_, first) = ingest_stream(
        &http,
        &cluster.client(0),
        cluster.api_key(),
        &test_message("resume", "slow 400"),
        Some(10),
    )
    .await;
    assert_dense(&first, 0, false);
    assert_eq!(first.len(), 10);
    let run_id = run_id_of(&first);

    // Reconnect on gateway 1 with `after_sequence`, leave again after 30 items…
    let second = cluster
        .client(1)
        .stream_run(run_id, StreamFrom::AfterSequence(10))
        .await
        .take(30)
        .await;
    assert_dense(&second, 10, false);
    // …and come back to gateway 0 the way an EventSource does, with `Last-Event-ID`.
    let third = cluster
        .client(0)
        .stream_run(run_id, StreamFrom::LastEventId(40))
        .await
        .until_terminal()
        .await;
    assert_dense(&third, 40, true);

    let all: Vec<SseFrame> = first.into_iter().chain(second).chain(third).collect();
    assert_dense(&all, 0, true);
    let items = results(&all);
    assert_eq!(
        items.len(),
        402,
        "400 deltas, message.completed, run.completed"
    );
    let deltas: Vec<String> = items[..400].iter().map(delta_text).collect();
    let expected: Vec<String> = (0..400).map(|i| format!("{i} ")).collect();
    assert_eq!(deltas, expected, "every delta once, in order");
    assert_eq!(items[401].result_type, "run.completed");

    // The ledger holds exactly what was streamed, and so does a resume from the middle.
    assert_eq!(cluster.client(1).run_events(run_id, 0).await, items);
    let tail = cluster
        .client(1)
        .stream_run(run_id, StreamFrom::AfterSequence(390))
        .await
        .until_terminal()
        .await;
    assert_dense(&tail, 390, true);
    assert_eq!(results(&tail), items[390..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_is_idempotent_across_gateways() {
    let cluster = cluster!(ClusterSpec::default());
    let (c0, c1) = (cluster.client(0), cluster.client(1));

    // One after the other, on different gateways.
    let body = message("idem-1", "same words");
    let first = c0.post_event(&body, Some("idem-key-1")).await.expect(202);
    assert!(first.headers.get("idempotent-replayed").is_none());
    let again = c1.post_event(&body, Some("idem-key-1")).await.expect(202);
    assert_eq!(again.str("event_id"), first.str("event_id"));
    assert_eq!(
        again
            .headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );

    // At the same time, on both gateways: one event, exactly one request creates it.
    let body = message("idem-2", "raced words");
    let answers = futures::future::join_all((0..8).map(|i| {
        let client = cluster.client(i);
        let body = body.clone();
        async move { client.post_event(&body, Some("idem-key-2")).await }
    }))
    .await;
    let ids: HashSet<String> = answers
        .iter()
        .map(|a| {
            assert_eq!(a.status, 202, "{}", a.body);
            a.str("event_id").to_owned()
        })
        .collect();
    assert_eq!(ids.len(), 1, "one event for one key: {ids:?}");
    let created = answers
        .iter()
        .filter(|a| a.headers.get("idempotent-replayed").is_none())
        .count();
    assert_eq!(created, 1, "exactly one request created the event");

    // A client `event_id` is an idempotency key too.
    let mut body = message("idem-3", "client id");
    body["event_id"] = json!("client-event-1");
    let a = c0.post_event(&body, None).await.expect(202);
    let b = c1.post_event(&body, None).await.expect(202);
    assert_eq!(a.str("event_id"), b.str("event_id"));
    assert_ne!(
        a.str("event_id"),
        "client-event-1",
        "the host assigns its own id"
    );

    // Each event ran once.
    for (conversation, event_id) in [
        ("idem-1", first.str("event_id").to_owned()),
        ("idem-2", ids.into_iter().next().unwrap()),
        ("idem-3", a.str("event_id").to_owned()),
    ] {
        let run_id = c1.run_of(event_id.parse().unwrap()).await;
        let run = c0.wait_run_terminal(run_id).await;
        assert_eq!(run["status"], "completed", "{run}");
        let runs = c0
            .get(&format!("/v1/runs?conversation_id={conversation}"))
            .await
            .expect(200)
            .body;
        assert_eq!(
            runs["items"].as_array().map(Vec::len),
            Some(1),
            "one run in {conversation}: {runs}"
        );
        assert_dense_items(&c1.run_events(run_id, 0).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_conversations_at_once() {
    let cluster = cluster!(ClusterSpec::default());
    let http = reqwest::Client::new();
    let started = Instant::now();
    let streams = futures::future::join_all((0..100).map(|i| {
        let (http, client, key) = (
            http.clone(),
            cluster.client(i),
            cluster.api_key().to_owned(),
        );
        async move {
            let text = format!("conversation {i} says hello");
            let body = message(&format!("many-{i}"), &text);
            let (_, frames) = ingest_stream(&http, &client, &key, &body, None).await;
            (text, frames)
        }
    }))
    .await;
    let elapsed = started.elapsed();

    let mut run_ids = HashSet::new();
    for (text, frames) in &streams {
        assert_dense(frames, 0, true);
        let items = results(frames);
        assert_eq!(
            items.len(),
            6,
            "4 deltas, message.completed, run.completed: {items:?}"
        );
        let streamed: String = items[..4].iter().map(delta_text).collect();
        assert_eq!(&streamed, text);
        assert_eq!(items[5].result_type, "run.completed");
        assert!(run_ids.insert(run_id_of(frames)), "one run per event");
    }

    // The ledger agrees, read through the other gateway; both workers took a share.
    let mut workers = BTreeSet::new();
    for (i, (_, frames)) in streams.iter().enumerate() {
        let client = cluster.client(i + 1);
        let run_id = run_id_of(frames);
        assert_eq!(client.run_events(run_id, 0).await, results(frames));
        let run = client.wait_run_terminal(run_id).await;
        assert_eq!(run["status"], "completed", "{run}");
        workers.insert(run["worker_id"].as_str().unwrap_or_default().to_owned());
    }
    let expected: BTreeSet<String> = cluster.worker_ids().into_iter().collect();
    assert_eq!(workers, expected, "every worker executed some of the runs");
    // The shard queues are spread over both orchestrators rather than all consumed by the
    // first one started: each saw the other in the member registry (a two-member set is
    // logged as `members={"a", "b"}`) and consumes some of the 16 events and results shards
    // (unless rendezvous hashing gave one all 16: odds 2^-15).
    let processes = |needles: &[&str]| -> BTreeSet<String> {
        cluster
            .log_lines(Role::Orchestrator, needles)
            .iter()
            .filter_map(|line| line.split(':').next().map(str::to_owned))
            .collect()
    };
    let both = BTreeSet::from(["orchestrator-0".to_owned(), "orchestrator-1".to_owned()]);
    // (The one started first sees the other on its next heartbeat, within 2 s of the start.)
    wait_until("each orchestrator sees two members", || {
        processes(&["orchestrator members changed", "\", \""]) == both
    })
    .await;
    assert_eq!(
        processes(&["consuming a shard"]),
        both,
        "both orchestrators consume shards"
    );
    eprintln!("100 concurrent streamed runs across the cluster in {elapsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_streams_a_run_it_did_not_ingest() {
    let cluster = cluster!(ClusterSpec::default());
    add_test_agent(&cluster, TEST_SHARED).await;
    let (c0, c1) = (cluster.client(0), cluster.client(1));
    // About 3 s of output (600 deltas, 5 ms apart).
    let accepted = c0
        .post_event(&test_message("elsewhere", "slow 600"), None)
        .await
        .expect(202);
    let run_id = c1.run_of(accepted.str("event_id").parse().unwrap()).await;

    let (on_1, on_0) = tokio::join!(timed_frames(&c1, run_id), timed_frames(&c0, run_id));
    let frames_1: Vec<SseFrame> = on_1.iter().map(|(f, _)| f.clone()).collect();
    let frames_0: Vec<SseFrame> = on_0.iter().map(|(f, _)| f.clone()).collect();
    assert_dense(&frames_1, 0, true);
    assert_eq!(
        results(&frames_1),
        results(&frames_0),
        "both gateways stream the same run"
    );
    assert_eq!(frames_1.len(), 602);
    assert_eq!(c1.run_events(run_id, 0).await, results(&frames_1));

    // Live delivery, not the ledger safety net: the stream opened while the run was producing
    // (its frames arrive over seconds), and never waited anywhere near the 5 s ledger poll.
    let spread = on_1.last().unwrap().1 - on_1[0].1;
    assert!(
        spread > Duration::from_millis(500),
        "the run was still producing: {spread:?}"
    );
    let max_gap = on_1
        .windows(2)
        .map(|w| w[1].1 - w[0].1)
        .max()
        .unwrap_or_default();
    assert!(
        max_gap < Duration::from_secs(3),
        "items reached gateway 1 live (largest gap {max_gap:?}; the ledger poll is 5 s)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_delivered_three_times_executes_once() {
    // Short leases: a duplicate that finds the lease held waits one TTL before dropping.
    let spec = ClusterSpec::default()
        .env("SWITCHBOARD__WORKER__HEARTBEAT_INTERVAL", "1s")
        .env("SWITCHBOARD__WORKER__LEASE_TTL", "3s");
    let cluster = cluster!(spec);
    add_test_agent(&cluster, TEST_PER_RUN).await;
    let (c0, c1) = (cluster.client(0), cluster.client(1));

    // Tap the runs exchange: a second queue bound to the pool's key gets a copy of each job.
    let topology = cluster.topology().unwrap();
    let bus = AmqpBus::connect(AmqpOptions::new(
        cluster.services().amqp_url.clone(),
        "sb-tests job tap",
    ))
    .await
    .unwrap();
    let tap = QueueSpec::exclusive(format!("{}.tap", topology.runs_exchange()))
        .bind(topology.runs_exchange(), runs_routing_key("default"));
    let mut tapped = bus
        .subscribe(&tap, ConsumeOptions::prefetch(8))
        .await
        .unwrap();

    // Per-run runner processes of the workers before the run (none are expected).
    let runners = |cluster: &TestCluster| -> usize {
        cluster
            .worker_pids()
            .iter()
            .map(|(_, pid)| child_processes(*pid, "sb-test-runner").len())
            .sum()
    };
    let baseline = runners(&cluster);

    // About 1.5 s of output.
    let accepted = c0
        .post_event(&test_message("dup", "slow 300"), None)
        .await
        .expect(202);
    let copy = tokio::time::timeout(Duration::from_secs(30), tapped.next())
        .await
        .expect("the job is published")
        .unwrap();
    let body = copy.body.clone();
    copy.ack().await.unwrap();
    let job: RunJob = decode(&body).expect("a run job");
    let run_id = c1.run_of(accepted.str("event_id").parse().unwrap()).await;
    assert_eq!(job.run_id, run_id);

    // The same job twice more, while the first delivery executes.
    for _ in 0..2 {
        bus.publish(
            &topology.runs_exchange(),
            &runs_routing_key("default"),
            body.clone(),
            PublishOptions::default(),
        )
        .await
        .unwrap();
    }
    let mut most = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        most = most.max(runners(&cluster).saturating_sub(baseline));
        let run = c1.get_run(run_id).await;
        if !matches!(run["status"].as_str(), Some("queued" | "running")) {
            break;
        }
        assert!(Instant::now() < deadline, "run did not end: {run}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(most, 1, "one runner process executed the run");

    // Both duplicates were delivered to a worker and dropped there.
    let dropped = |cluster: &TestCluster| {
        cluster
            .log_lines(Role::Worker, &[&run_id.to_string(), "dropped"])
            .len()
    };
    wait_until("the two duplicates to be dropped", || {
        dropped(&cluster) >= 2
    })
    .await;

    let items = c0.run_events(run_id, 0).await;
    assert_dense_items(&items);
    assert_eq!(
        items.len(),
        302,
        "300 deltas, message.completed, run.completed"
    );
    assert_eq!(items[301].result_type, "run.completed");
    let run = c0.get_run(run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["attempt"], 1, "{run}");
    let runs = c0
        .get("/v1/runs?conversation_id=dup")
        .await
        .expect(200)
        .body;
    assert_eq!(runs["items"].as_array().map(Vec::len), Some(1), "{runs}");

    // A late duplicate, after the end, changes nothing either.
    bus.publish(
        &topology.runs_exchange(),
        &runs_routing_key("default"),
        body,
        PublishOptions::default(),
    )
    .await
    .unwrap();
    wait_until("the late duplicate to be dropped", || {
        dropped(&cluster) >= 3
    })
    .await;
    assert_eq!(c1.run_events(run_id, 0).await, items);
    assert_eq!(c1.get_run(run_id).await["status"], "completed");
    drop(tapped);
    let _ = bus.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_interrupts_its_run_and_the_other_worker_carries_on() {
    // Short leases so the crash is noticed within seconds (the defaults are 3 s / 10 s).
    let spec = ClusterSpec::default()
        .env("SWITCHBOARD__WORKER__HEARTBEAT_INTERVAL", "1s")
        .env("SWITCHBOARD__WORKER__LEASE_TTL", "3s")
        .env("SWITCHBOARD__ORCHESTRATOR__LEASE_GRACE", "2s")
        .env("SWITCHBOARD__ORCHESTRATOR__REAPER_INTERVAL", "1s");
    let mut cluster = cluster!(spec);
    add_test_agent(&cluster, TEST_SHARED).await;
    let (c0, c1) = (cluster.client(0), cluster.client(1));

    // About 15 s of output: it is certainly still running when its worker dies.
    let accepted = c0
        .post_event(&test_message("victim", "slow 3000"), None)
        .await
        .expect(202);
    let run_id = c0.run_of(accepted.str("event_id").parse().unwrap()).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let running = loop {
        let run = c1.get_run(run_id).await;
        if run["status"] == "running" && run["last_sequence"].as_i64().unwrap_or(0) >= 20 {
            break run;
        }
        assert!(Instant::now() < deadline, "run never got going: {run}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let victim = running["worker_id"].as_str().unwrap().to_owned();
    let survivor = cluster
        .worker_ids()
        .into_iter()
        .find(|w| *w != victim)
        .expect("two workers");
    cluster.kill_worker(&victim).unwrap();

    let run = c1.wait_run_terminal(run_id).await;
    assert_eq!(run["status"], "interrupted", "{run}");
    // The terminal item is stored with the status (one commit); the result sink applies and
    // delivers it.
    let items = wait_for_terminal_item(&c0, run_id).await;
    assert_dense_items(&items);
    let (terminal, before) = items.split_last().unwrap();
    assert_eq!(terminal.result_type, "run.failed", "{terminal:?}");
    assert_eq!(terminal.data["code"], "interrupted", "{terminal:?}");
    assert!(
        before.iter().all(|i| i.result_type == "message.delta"),
        "only the deltas produced before the crash: {:?}",
        types(before)
    );
    assert!(
        before.len() >= 20 && before.len() < 3000,
        "{} deltas",
        before.len()
    );
    let deltas: Vec<String> = before.iter().map(delta_text).collect();
    let expected: Vec<String> = (0..before.len()).map(|i| format!("{i} ")).collect();
    assert_eq!(
        deltas, expected,
        "no delta twice: the run was not executed again"
    );

    // Nothing is appended later: the redelivered job is not executed again.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(c1.run_events(run_id, 0).await, items);
    assert_eq!(c1.get_run(run_id).await["status"], "interrupted");

    // New runs complete, on the surviving worker, through either gateway.
    let http = reqwest::Client::new();
    for i in 0..6 {
        let client = cluster.client(i);
        let (_, frames) = ingest_stream(
            &http,
            &client,
            cluster.api_key(),
            &message(&format!("after-{i}"), "still here"),
            None,
        )
        .await;
        assert_dense(&frames, 0, true);
        assert_eq!(frames.last().unwrap().event, "run.completed");
        let run = client.wait_run_terminal(run_id_of(&frames)).await;
        assert_eq!(run["worker_id"], survivor.as_str(), "{run}");
    }
}

/// The run's stored items once the last one is terminal (polled for up to 30 s).
async fn wait_for_terminal_item(client: &Client, run_id: RunId) -> Vec<AgentRunResult> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let items = client.run_events(run_id, 0).await;
        if items.last().is_some_and(AgentRunResult::is_terminal) {
            return items;
        }
        assert!(
            Instant::now() < deadline,
            "run {run_id} has no terminal item: {:?}",
            types(&items)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `condition` every 100 ms for up to 30 s.
async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Issue 15 finding 1: a conversation id of the longest accepted length (255 characters,
/// multi-byte ones and topic syntax included) once made the live-delivery routing key exceed
/// AMQP's 255-byte limit; the sink retried the refused publish forever, stalling its shard,
/// and the reaper later gave the run a second terminal item. Now the key's words are bounded
/// (`topology::key_segment`), so the run streams live and ends once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_id_of_255_characters_streams_live_and_ends_once() {
    let cluster = cluster!(ClusterSpec::default());
    add_test_agent(&cluster, TEST_SHARED).await;
    let http = reqwest::Client::new();
    let conversation = format!("{}.*#{}", "é".repeat(126), "c".repeat(126));
    assert_eq!(conversation.chars().count(), 255);
    let (_, frames) = ingest_stream(
        &http,
        &cluster.client(0),
        cluster.api_key(),
        &test_message(&conversation, "slow 50"),
        None,
    )
    .await;
    assert_dense(&frames, 0, true);
    let run_id = run_id_of(&frames);
    let other = cluster.client(1);
    let run = other.wait_run_terminal(run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["conversation_id"], conversation.as_str());
    let items = other.run_events(run_id, 0).await;
    assert_eq!(items, results(&frames), "ledger = stream");
    let terminal = items.iter().filter(|i| i.is_terminal()).count();
    assert_eq!(
        terminal,
        1,
        "exactly one terminal item: {:?}",
        types(&items)
    );
    // The other gateway follows the run's conversation live as well.
    let (_, again) = ingest_stream(
        &http,
        &cluster.client(1),
        cluster.api_key(),
        &test_message(&conversation, "slow 5"),
        None,
    )
    .await;
    assert_dense(&again, 0, true);
}

/// Deletes every Redis key of the cluster: what a Redis restart without persistence leaves
/// (only this cluster's own key prefix; the shared Redis is never restarted).
async fn empty_the_session_store(cluster: &TestCluster) {
    use sb_common::session::redis::{RedisOptions, RedisSessionStore};
    let options = RedisOptions::new(
        cluster.services().redis_url.clone(),
        cluster.config().sessions.key_prefix.clone(),
    );
    let store = RedisSessionStore::connect(&options).await.unwrap();
    assert!(store.delete_all().await.unwrap() > 0, "the run had keys");
}

/// Issue 15 finding 3: the session store comes back empty while runs execute. Their workers
/// re-establish the leases (and the sessions that validate runner callbacks): every run
/// completes with a dense stream and one terminal item, none is cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_store_that_comes_back_empty_cancels_no_healthy_run() {
    let spec = ClusterSpec::default()
        .env("SWITCHBOARD__WORKER__HEARTBEAT_INTERVAL", "300ms")
        .env("SWITCHBOARD__WORKER__LEASE_TTL", "1s")
        .env("SWITCHBOARD__ORCHESTRATOR__LEASE_GRACE", "3s")
        .env("SWITCHBOARD__ORCHESTRATOR__REAPER_INTERVAL", "500ms");
    let cluster = cluster!(spec);
    add_test_agent(&cluster, TEST_SHARED).await;
    let client = cluster.client(0);
    let mut runs = Vec::new();
    for i in 0..4 {
        // About 3 s each: many heartbeats and lease TTLs after the store is emptied.
        let accepted = client
            .post_event(&test_message(&format!("flush-{i}"), "slow 600"), None)
            .await
            .expect(202);
        runs.push(
            client
                .run_of(accepted.str("event_id").parse().unwrap())
                .await,
        );
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for run_id in &runs {
        loop {
            let run = client.get_run(*run_id).await;
            if run["status"] == "running" && run["last_sequence"].as_i64().unwrap_or(0) >= 5 {
                break;
            }
            assert!(Instant::now() < deadline, "run never got going: {run}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    empty_the_session_store(&cluster).await;
    for run_id in runs {
        let run = client.wait_run_terminal(run_id).await;
        assert_eq!(run["status"], "completed", "{run}");
        let items = wait_for_terminal_item(&client, run_id).await;
        assert_dense_items(&items);
        assert_eq!(items.iter().filter(|i| i.is_terminal()).count(), 1);
        assert_eq!(items.last().unwrap().result_type, "run.completed");
    }
}

/// Issue 15 findings 3 and 6: a worker dies *and* the session store loses its keys, so the
/// redelivered job finds no session (no proof of a crash) and is dropped. The run must not
/// linger: the reaper sees it `running` without a lease for longer than the grace and
/// finalizes it `interrupted`, with exactly one terminal item after the items it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_worker_and_session_are_both_lost_is_reaped_interrupted() {
    let spec = ClusterSpec::default()
        .env("SWITCHBOARD__WORKER__HEARTBEAT_INTERVAL", "1s")
        .env("SWITCHBOARD__WORKER__LEASE_TTL", "3s")
        .env("SWITCHBOARD__ORCHESTRATOR__LEASE_GRACE", "2s")
        .env("SWITCHBOARD__ORCHESTRATOR__REAPER_INTERVAL", "1s");
    let mut cluster = cluster!(spec);
    add_test_agent(&cluster, TEST_SHARED).await;
    let client = cluster.client(0);
    let accepted = client
        .post_event(&test_message("lost", "slow 3000"), None)
        .await
        .expect(202);
    let run_id = client
        .run_of(accepted.str("event_id").parse().unwrap())
        .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let running = loop {
        let run = client.get_run(run_id).await;
        if run["status"] == "running" && run["last_sequence"].as_i64().unwrap_or(0) >= 20 {
            break run;
        }
        assert!(Instant::now() < deadline, "run never got going: {run}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let victim = running["worker_id"].as_str().unwrap().to_owned();
    cluster.kill_worker(&victim).unwrap();
    empty_the_session_store(&cluster).await;

    let run = client.wait_run_terminal(run_id).await;
    assert_eq!(run["status"], "interrupted", "{run}");
    let items = wait_for_terminal_item(&client, run_id).await;
    assert_dense_items(&items);
    let (terminal, before) = items.split_last().unwrap();
    assert_eq!(terminal.result_type, "run.failed", "{terminal:?}");
    assert_eq!(terminal.data["code"], "interrupted", "{terminal:?}");
    assert!(before.iter().all(|i| !i.is_terminal()));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        client.run_events(run_id, 0).await,
        items,
        "nothing appended later"
    );
}
