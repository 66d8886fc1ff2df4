//! Issue 14 items 6 and 7, written once against a [`Client`] so that embedded and cluster
//! mode run the same steps: agents addressed directly (`agent_id` on ingest, `routing:
//! "direct"` agents beside the workspace's scope-routed agent, the event wait), delayed
//! events (`deliver_at`), and the resumable stream of a whole conversation.
//!
//! Each scenario expects the workspace to have exactly one enabled, workspace-wide,
//! scope-routed agent on the echo runner (the embedded default agent, the cluster's `echo`).

use std::time::{Duration, Instant};

use chrono::{SecondsFormat, Utc};
use serde_json::{Value, json};

use crate::{Client, SseFrame, SseStream, message};

/// The workspace's scope-routed, workspace-wide agent.
async fn scope_agent(client: &Client) -> String {
    let agents = client.get("/v1/agents?limit=100").await.expect(200).body;
    let mut found: Vec<&Value> = agents["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| {
            let workspace_wide = a["scope"]
                .as_object()
                .is_none_or(|scope| scope.values().all(Value::is_null));
            a["enabled"] == true && a["routing"] == "scope" && workspace_wide
        })
        .collect();
    assert_eq!(found.len(), 1, "one workspace-wide scope agent: {agents}");
    found.pop().unwrap()["agent_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// `GET /v1/events/{id}/wait` until the event is routed (bounded).
async fn wait_routed(client: &Client, event_id: &str) -> Value {
    let started = Instant::now();
    loop {
        let event = client
            .get(&format!("/v1/events/{event_id}/wait?timeout_ms=5000"))
            .await
            .expect(200)
            .body;
        if !matches!(event["status"].as_str(), Some("received" | "scheduled")) {
            return event;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "event {event_id} was not routed: {event}"
        );
    }
}

async fn run_terminal(client: &Client, run_id: &str) -> Value {
    let started = Instant::now();
    loop {
        let run = client
            .get(&format!("/v1/runs/{run_id}"))
            .await
            .expect(200)
            .body;
        if !matches!(run["status"].as_str(), Some("queued" | "running")) {
            return run;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "run {run_id} did not end: {run}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// Direct agents and `agent_id` on ingest (item 6).
pub async fn direct_agents_scenario(client: &Client, echo_runner: &str) {
    let default_agent = scope_agent(client).await;

    // A second workspace-wide agent routed by scope is ambiguous: refused, and the refusal
    // says how to have two agents.
    let refused = client
        .create_agent(&json!({"name": unique("second"), "runner_id": echo_runner}))
        .await
        .expect(409);
    assert!(
        refused.str("message").contains("direct"),
        "{}",
        refused.body
    );

    // Any number of direct agents coexist beside it.
    let mut direct = Vec::new();
    for _ in 0..2 {
        let created = client
            .create_agent(&json!({
                "name": unique("direct"),
                "runner_id": echo_runner,
                "routing": "direct",
            }))
            .await
            .expect(201);
        assert_eq!(created.body["routing"], "direct");
        direct.push(created.str("agent_id").to_owned());
    }
    let bad = client
        .create_agent(
            &json!({"name": unique("x"), "runner_id": echo_runner, "routing": "sideways"}),
        )
        .await
        .expect(400);
    assert_eq!(bad.body["code"], "invalid_argument");

    // Scope resolution ignores them: an event naming no agent goes to the scope agent.
    let conversation = unique("addr");
    let plain = client
        .post_event(&message(&conversation, "to whoever"), None)
        .await
        .expect(202);
    assert!(
        plain.body.get("run_id").is_none(),
        "routing is asynchronous: {}",
        plain.body
    );
    let routed = wait_routed(client, plain.str("event_id")).await;
    assert_eq!(routed["status"], "dispatched", "{routed}");
    assert!(routed["agent_id"].is_null());
    let run = run_terminal(client, routed["run_id"].as_str().unwrap()).await;
    assert_eq!(run["agent_id"], default_agent.as_str(), "{run}");

    // Named, each direct agent handles its event, whatever the scopes say.
    for agent_id in &direct {
        let mut body = message(&conversation, "to you");
        body["agent_id"] = json!(agent_id);
        let accepted = client.post_event(&body, None).await.expect(202);
        let routed = wait_routed(client, accepted.str("event_id")).await;
        assert_eq!(routed["status"], "dispatched", "{routed}");
        assert_eq!(routed["agent_id"], agent_id.as_str());
        let run_id = routed["run_id"].as_str().unwrap();
        let run = run_terminal(client, run_id).await;
        assert_eq!(run["agent_id"], agent_id.as_str(), "{run}");
        assert_eq!(run["status"], "completed", "{run}");
        // A replay of the routed event answers with its run id at once.
        let key = unique("key");
        let first = client.post_event(&body, Some(&key)).await.expect(202);
        let event_id = first.str("event_id").to_owned();
        let routed = wait_routed(client, &event_id).await;
        let replay = client.post_event(&body, Some(&key)).await.expect(202);
        assert_eq!(replay.str("event_id"), event_id);
        assert_eq!(replay.body["run_id"], routed["run_id"], "{}", replay.body);
        // The same key naming another agent is another request.
        let mut other = body.clone();
        other["agent_id"] = json!(default_agent);
        client.post_event(&other, Some(&key)).await.expect(409);
    }
    // The scope agent can be named too.
    let mut body = message(&conversation, "to the default");
    body["agent_id"] = json!(default_agent);
    let accepted = client.post_event(&body, None).await.expect(202);
    let routed = wait_routed(client, accepted.str("event_id")).await;
    let run = run_terminal(client, routed["run_id"].as_str().unwrap()).await;
    assert_eq!(run["agent_id"], default_agent.as_str());

    // A session reaches a direct agent.
    let session = client
        .post("/v1/sessions", &json!({"agent_id": direct[0]}))
        .await
        .expect(201);
    let turn = client
        .post(
            &format!("/v1/sessions/{}/turns", session.str("session_id")),
            &json!({"idempotency_key": "direct:1", "text": "by session"}),
        )
        .await
        .expect(202);
    let turn_id = turn.str("turn_id");
    let done = client
        .get(&format!("/v1/turns/{turn_id}/wait?timeout_ms=20000"))
        .await
        .expect(200)
        .body;
    assert_eq!(done["status"], "completed", "{done}");
    let run = run_terminal(client, turn_id).await;
    assert_eq!(run["agent_id"], direct[0].as_str(), "{run}");
    assert_eq!(run["status"], "completed", "{run}");

    // Refusals, before anything is stored: a malformed or unknown agent, a disabled one, one
    // that does not handle the event type.
    for agent_id in [json!("nope"), json!(uuid::Uuid::now_v7().to_string())] {
        let mut body = message(&conversation, "x");
        body["agent_id"] = agent_id;
        let refused = client.post_event(&body, None).await.expect(400);
        assert_eq!(refused.body["code"], "invalid_argument");
        assert!(
            refused.str("message").contains("`agent_id`"),
            "{}",
            refused.body
        );
    }
    let disabled = client
        .create_agent(&json!({
            "name": unique("off"),
            "runner_id": echo_runner,
            "routing": "direct",
            "enabled": false,
        }))
        .await
        .expect(201);
    let mut body = message(&conversation, "x");
    body["agent_id"] = json!(disabled.str("agent_id"));
    let refused = client.post_event(&body, None).await.expect(400);
    assert!(
        refused.str("message").contains("disabled"),
        "{}",
        refused.body
    );
    let body = json!({
        "event_type": "group.member_joined",
        "source": "api",
        "conversation_id": conversation,
        "agent_id": direct[1],
    });
    let refused = client.post_event(&body, None).await.expect(400);
    assert!(
        refused.str("message").contains("does not handle"),
        "{}",
        refused.body
    );

    // A target disabled between ingest and routing: unrouted, with the reason.
    let mut body = message(&conversation, "too late");
    body["agent_id"] = json!(direct[1]);
    body["deliver_at"] = json!(in_ms(1500));
    let accepted = client.post_event(&body, None).await.expect(202);
    assert_eq!(accepted.body["status"], "scheduled");
    client
        .patch(
            &format!("/v1/agents/{}", direct[1]),
            &json!({"enabled": false}),
        )
        .await
        .expect(200);
    let routed = wait_routed(client, accepted.str("event_id")).await;
    assert_eq!(routed["status"], "unrouted", "{routed}");
    assert_eq!(routed["reason"], "binding.target_unavailable", "{routed}");

    // The wait of an unknown event is 404; of a malformed id too.
    let missing = uuid::Uuid::now_v7();
    client
        .get(&format!("/v1/events/{missing}/wait"))
        .await
        .expect(404);
    client
        .get("/v1/events/nope/wait?timeout_ms=1")
        .await
        .expect(404);
    client
        .get(&format!(
            "/v1/events/{}/wait?timeout=1",
            accepted.str("event_id")
        ))
        .await
        .expect(400);
}

/// RFC 3339 time `ms` from now.
fn in_ms(ms: i64) -> String {
    (Utc::now() + chrono::TimeDelta::milliseconds(ms)).to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Delayed events (item 7, SPEC §10.1).
pub async fn deliver_at_scenario(client: &Client) {
    let conversation = unique("later");
    // Due in 2 s: accepted now as `scheduled`, routed only then.
    let mut body = message(&conversation, "later please");
    let due = Utc::now() + chrono::TimeDelta::milliseconds(2000);
    body["deliver_at"] = json!(due.to_rfc3339_opts(SecondsFormat::Millis, true));
    let accepted = client.post_event(&body, Some("later:1")).await.expect(202);
    assert_eq!(accepted.body["status"], "scheduled", "{}", accepted.body);
    assert_eq!(accepted.body["deliver_at"], due.timestamp());
    let event_id = accepted.str("event_id").to_owned();
    let early = client
        .get(&format!("/v1/events/{event_id}/wait?timeout_ms=500"))
        .await
        .expect(200)
        .body;
    assert_eq!(
        early["status"], "scheduled",
        "not routed before its time: {early}"
    );
    assert!(early["run_id"].is_null());
    // The same request again is the same event; another time with the key is another.
    let replay = client.post_event(&body, Some("later:1")).await.expect(202);
    assert_eq!(replay.str("event_id"), event_id);
    let mut moved = body.clone();
    moved["deliver_at"] = json!(due.timestamp() + 60);
    client.post_event(&moved, Some("later:1")).await.expect(409);

    let routed = wait_routed(client, &event_id).await;
    assert_eq!(routed["status"], "dispatched", "{routed}");
    let run = run_terminal(client, routed["run_id"].as_str().unwrap()).await;
    assert_eq!(run["status"], "completed", "{run}");
    let created = run["created_at"].as_i64().unwrap();
    assert!(
        created >= due.timestamp(),
        "the run started at {created}, before the event was due ({})",
        due.timestamp()
    );

    // In the past (or epoch seconds now): delivered at once.
    let mut body = message(&conversation, "now");
    body["deliver_at"] = json!(Utc::now().timestamp() - 60);
    let accepted = client.post_event(&body, None).await.expect(202);
    assert_eq!(accepted.body["status"], "received");
    let routed = wait_routed(client, accepted.str("event_id")).await;
    assert_eq!(routed["status"], "dispatched");

    // Refused: unreadable, too far ahead, or with `?stream=true`.
    for bad in [json!("next tuesday"), json!(-5), json!(true)] {
        let mut body = message(&conversation, "x");
        body["deliver_at"] = bad.clone();
        let refused = client.post_event(&body, None).await.expect(400);
        assert!(
            refused.str("message").contains("`deliver_at`"),
            "{bad}: {}",
            refused.body
        );
    }
    let mut body = message(&conversation, "x");
    body["deliver_at"] = json!(Utc::now().timestamp() + 400 * 24 * 3600);
    let refused = client.post_event(&body, None).await.expect(400);
    assert!(
        refused.str("message").contains("deliver_at_max_delay"),
        "{}",
        refused.body
    );
    let mut body = message(&conversation, "x");
    body["deliver_at"] = json!(in_ms(60_000));
    let refused = client
        .post("/v1/events?stream=true", &body)
        .await
        .expect(400);
    assert!(
        refused.str("message").contains("stream"),
        "{}",
        refused.body
    );
}

/// Frames of `stream` until `runs` terminal items have arrived.
async fn frames_until_terminals(stream: &mut SseStream, runs: usize) -> Vec<SseFrame> {
    let mut frames = Vec::new();
    let mut terminals = 0;
    while terminals < runs {
        let frame = stream
            .next_frame()
            .await
            .expect("the conversation stream ended");
        assert_ne!(frame.event, "error", "{frame:?}");
        terminals += usize::from(frame.is_terminal());
        frames.push(frame);
    }
    frames
}

/// `(run_id, sequence)` of each frame, checking it is tagged and its id is a position.
fn keys(frames: &[SseFrame]) -> Vec<(String, u64)> {
    frames
        .iter()
        .map(|f| {
            let item = f.json();
            assert!(
                f.id.as_deref().is_some_and(|id| id.starts_with("c1.")),
                "a conversation position as id: {f:?}"
            );
            (
                item["run_id"].as_str().unwrap().to_owned(),
                item["sequence"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// The items of each run are dense from 1 and end with the terminal item.
fn assert_whole_runs(frames: &[SseFrame]) -> Vec<String> {
    let mut runs: Vec<String> = Vec::new();
    let mut by_run: std::collections::BTreeMap<String, Vec<(u64, bool)>> = Default::default();
    for (frame, (run, sequence)) in frames.iter().zip(keys(frames)) {
        if !runs.contains(&run) {
            runs.push(run.clone());
        }
        by_run
            .entry(run)
            .or_default()
            .push((sequence, frame.is_terminal()));
    }
    for (run, items) in &by_run {
        let sequences: Vec<u64> = items.iter().map(|(s, _)| *s).collect();
        let expected: Vec<u64> = (1..=items.len() as u64).collect();
        assert_eq!(sequences, expected, "run {run}: no gap, no duplicate");
        assert!(
            items.last().unwrap().1,
            "run {run} ends with its terminal item"
        );
    }
    runs
}

/// The conversation stream (item 7): every run, tagged, gap-free, resumable.
pub async fn conversation_stream_scenario(client: &Client) {
    let conversation = unique("conv-stream");
    let path = format!("/v1/conversations/{conversation}/stream");
    // Opened before anything happens: it gets every run that starts later.
    let mut live = client.open_stream(&path, None).await;
    assert_eq!(live.status, 200);
    let mut runs = Vec::new();
    let mut frames = Vec::new();
    for text in ["first", "second", "third"] {
        let event = client.send_message(&conversation, text).await;
        let routed = wait_routed(client, &event.to_string()).await;
        runs.push(routed["run_id"].as_str().unwrap().to_owned());
        frames.extend(frames_until_terminals(&mut live, 1).await);
    }
    assert_eq!(assert_whole_runs(&frames), runs, "every run, in order");
    // Each item is the run's own result, tagged with the run.
    let first = frames[0].json();
    assert_eq!(first["run_id"], runs[0].as_str());
    drop(live);

    // Resume after the first run's terminal frame: the other two runs, whole, and nothing
    // of the first.
    let first_end = frames
        .iter()
        .position(|f| f.is_terminal())
        .expect("a terminal frame");
    let cursor = frames[first_end].id.clone().unwrap();
    let mut resumed = client.open_stream(&path, Some(&cursor)).await;
    let again = frames_until_terminals(&mut resumed, 2).await;
    assert_eq!(
        keys(&again),
        keys(&frames[first_end + 1..]),
        "no gap, no duplicate"
    );
    drop(resumed);

    // Resume in the middle of a run (after its first item): the rest of it, then the rest.
    let cursor = frames[0].id.clone().unwrap();
    let mut resumed = client.open_stream(&path, Some(&cursor)).await;
    let again = frames_until_terminals(&mut resumed, 3).await;
    assert_eq!(keys(&again), keys(&frames[1..]));
    drop(resumed);
    // The same position as `?cursor=`.
    let mut resumed = client
        .open_stream(&format!("{path}?cursor={cursor}"), None)
        .await;
    let again = frames_until_terminals(&mut resumed, 3).await;
    assert_eq!(keys(&again), keys(&frames[1..]));
    drop(resumed);

    // `?since_ms=0`: every run from the start, finished ones included.
    let mut replay = client
        .open_stream(&format!("{path}?since_ms=0"), None)
        .await;
    let all = frames_until_terminals(&mut replay, 3).await;
    assert_eq!(keys(&all), keys(&frames));

    // Live again after the replay: a fourth run arrives on the same stream.
    let event = client.send_message(&conversation, "fourth").await;
    let routed = wait_routed(client, &event.to_string()).await;
    let more = frames_until_terminals(&mut replay, 1).await;
    assert_eq!(
        assert_whole_runs(&more),
        vec![routed["run_id"].as_str().unwrap().to_owned()]
    );
    drop(replay);

    // A fresh stream leaves out runs that ended before it opened.
    let mut fresh = client.open_stream(&path, None).await;
    let event = client.send_message(&conversation, "fifth").await;
    let routed = wait_routed(client, &event.to_string()).await;
    let only = frames_until_terminals(&mut fresh, 1).await;
    assert_eq!(
        assert_whole_runs(&only),
        vec![routed["run_id"].as_str().unwrap().to_owned()]
    );
    drop(fresh);

    // Overlapping runs (the default `parallel` policy): a position inside their interleaving
    // resumes each run exactly where that frame left it.
    let overlapping = unique("conv-parallel");
    let path = format!("/v1/conversations/{overlapping}/stream");
    let mut live = client.open_stream(&path, None).await;
    let (a, b, c) = tokio::join!(
        client.send_message(&overlapping, "one"),
        client.send_message(&overlapping, "two"),
        client.send_message(&overlapping, "three"),
    );
    for event in [a, b, c] {
        wait_routed(client, &event.to_string()).await;
    }
    let interleaved = frames_until_terminals(&mut live, 3).await;
    assert_eq!(assert_whole_runs(&interleaved).len(), 3);
    drop(live);
    let all = keys(&interleaved);
    for cut in [0, interleaved.len() / 2, interleaved.len() - 2] {
        let cursor = interleaved[cut].id.clone().unwrap();
        let mut resumed = client.open_stream(&path, Some(&cursor)).await;
        let expected: std::collections::BTreeSet<_> = all[cut + 1..].iter().cloned().collect();
        let mut rest = Vec::new();
        while rest.len() < expected.len() {
            let frame = resumed.next_frame().await.expect("the stream ended");
            rest.push(frame);
        }
        let got: Vec<_> = keys(&rest);
        let got_set: std::collections::BTreeSet<_> = got.iter().cloned().collect();
        assert_eq!(
            got.len(),
            got_set.len(),
            "no duplicate after position {cut}"
        );
        assert_eq!(got_set, expected, "exactly what followed position {cut}");
    }

    // A position that is not one is refused before streaming.
    for bad in ["7", "c1.x", "c1.5.nope:1"] {
        let response = client.open_stream(&path, Some(bad)).await;
        assert_eq!(response.status, 400, "{bad}");
    }
}
