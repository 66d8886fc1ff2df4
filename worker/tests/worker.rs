//! The worker service end to end on memory backends with real runner processes.

mod support;

use std::time::Duration;

use sb_common::bus::{Bus, PublishOptions};
use sb_common::session::{STEERING_CAP, SessionStore, cancel_flag_key, run_handed_off_key};
use sb_host_api::testing::now_secs;
use sb_protocol::ids::WorkspaceId;
use sb_protocol::result::ResultType;
use sb_store::{EventQuery, RunStatus};
use sb_worker::service::lease_key;
use support::{ECHO, Harness};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_and_its_results_are_published_in_order() {
    let mut h = Harness::start(|_, _| {}).await;
    // Registration: the runner of the worker's pool is in the runners table.
    let row = h
        .stores
        .runners
        .get(ECHO)
        .await
        .unwrap()
        .expect("echo registered");
    assert_eq!(row.pool, "default");
    assert_eq!(row.plugin_id, "switchboard/echo");
    assert_eq!(row.descriptor["id"], ECHO);
    assert_eq!(h.worker().runners().len(), 2);

    let job = h.prepare_run(ECHO, "hello big world").await;
    let run_id = job.run_id;
    h.publish_job(&job).await;
    let results = h.results_until_terminal().await;

    let sequences: Vec<u64> = results.iter().map(|m| m.sequence).collect();
    assert_eq!(
        sequences,
        vec![1, 2, 3, 4, 5],
        "dense worker-assigned sequences"
    );
    let types: Vec<_> = results
        .iter()
        .map(|m| m.result.known_type().unwrap())
        .collect();
    assert_eq!(
        types,
        vec![
            ResultType::MessageDelta,
            ResultType::MessageDelta,
            ResultType::MessageDelta,
            ResultType::MessageCompleted,
            ResultType::RunCompleted
        ]
    );
    assert_eq!(results.iter().filter(|m| m.result.is_terminal()).count(), 1);
    for m in &results {
        assert_eq!(m.run_id, run_id);
        assert_eq!(m.workspace_id, WorkspaceId::default_workspace());
        assert_eq!(m.conversation_id.as_deref(), Some("conv-1"));
        assert_eq!(m.result.sequence, Some(m.sequence));
        assert_eq!(m.result.run_id, run_id.to_string());
    }
    assert_eq!(results[0].result.data["chunk"]["content"], "hello ");

    // End of run: job acked, session ended, lease released, claim recorded.
    h.jobs_settled().await;
    let sessions = h.sessions.clone();
    let deadline = tokio::time::Instant::now() + support::WAIT;
    while sessions.get_session(&run_id).await.unwrap().is_some()
        || h.sessions
            .lease_holder(&lease_key(&run_id))
            .await
            .unwrap()
            .is_some()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "session ended and lease released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let run = h.stores.runs.get_run(run_id).await.unwrap().unwrap();
    assert_eq!(
        run.status,
        RunStatus::Running,
        "the terminal status is the result sink's to write"
    );
    assert_eq!(run.worker_id.as_deref(), Some(h.worker().id()));
    // Cancel messages reach the worker through its one `cancel.*` binding, run or no run: a
    // late cancel for the ended run is routable, and ignored.
    let late_cancel = h
        .bus
        .publish(
            &h.topology.control_exchange(),
            &sb_common::bus::topology::control_routing_key(&run_id),
            "{}".into(),
            PublishOptions::default(),
        )
        .await;
    assert!(late_cancel.is_ok(), "{late_cancel:?}");
    assert!(h.worker().active_runs().is_empty());

    let report = h.stop().await;
    assert!(report.cancelled_runs.is_empty() && report.forced_runs.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_runs_each_get_their_own_ordered_stream() {
    let mut h = Harness::start(|_, _| {}).await;
    let mut jobs = Vec::new();
    for i in 0..12 {
        let job = h.prepare_run(ECHO, &format!("run {i} says hi")).await;
        h.publish_job(&job).await;
        jobs.push(job);
    }
    let mut per_run: std::collections::HashMap<_, Vec<u64>> = std::collections::HashMap::new();
    let mut terminals = 0;
    while terminals < jobs.len() {
        let m = h.next_result().await;
        if m.result.is_terminal() {
            terminals += 1;
        }
        per_run.entry(m.run_id).or_default().push(m.sequence);
    }
    assert_eq!(per_run.len(), jobs.len());
    for (run, seqs) in per_run {
        assert_eq!(
            seqs,
            (1..=seqs.len() as u64).collect::<Vec<_>>(),
            "run {run} in order"
        );
        assert_eq!(seqs.len(), 6, "4 deltas + completed + run.completed");
    }
    h.jobs_settled().await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_delivery_of_the_same_job_executes_once() {
    let mut h = Harness::start(|_, _| {}).await;
    let job = h.prepare_run(ECHO, "only once").await;
    h.publish_job(&job).await;
    h.publish_job(&job).await;
    let results = h.results_until_terminal().await;
    assert_eq!(
        results.iter().map(|m| m.sequence).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    h.jobs_settled().await;
    assert!(
        h.no_result_within(Duration::from_millis(500))
            .await
            .is_none(),
        "the duplicate produced results"
    );

    // A late redelivery after the run ended (its session gone, the sink not caught up yet)
    // is dropped as well, not finalized as interrupted.
    h.publish_job(&job).await;
    h.jobs_settled().await;
    assert!(
        h.no_result_within(Duration::from_millis(500))
            .await
            .is_none(),
        "the late duplicate produced results"
    );
    assert_eq!(
        h.stores
            .runs
            .get_run(job.run_id)
            .await
            .unwrap()
            .unwrap()
            .status,
        RunStatus::Running
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_job_of_a_started_run_is_finalized_interrupted() {
    let mut h = Harness::start(|_, _| {}).await;
    let job = h.prepare_run(ECHO, "never run twice").await;
    let run_id = job.run_id;
    // A worker claimed the run, then died: its lease is still alive for a moment.
    assert!(
        h.stores
            .runs
            .claim_run(run_id, "dead-worker")
            .await
            .unwrap()
    );
    assert!(
        h.sessions
            .acquire_lease(
                &lease_key(&run_id),
                "dead-worker",
                Duration::from_millis(300)
            )
            .await
            .unwrap()
    );
    h.sessions
        .steering_push(
            &run_id,
            &serde_json::json!({"event": {"event_id": "e-steer"}}),
            100,
        )
        .await
        .unwrap();
    h.publish_job(&job).await;

    let results = h.results_until_terminal().await;
    assert_eq!(results.len(), 1, "never re-executed: {results:?}");
    let terminal = &results[0];
    assert_eq!(terminal.sequence, 1);
    assert_eq!(terminal.result.known_type(), Some(ResultType::RunFailed));
    assert_eq!(terminal.result.data["code"], "interrupted");
    assert_eq!(terminal.result.data["retryable"], true);
    let run = h.stores.runs.get_run(run_id).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Interrupted);
    assert_eq!(run.error_code.as_deref(), Some("interrupted"));
    // Issue 15 finding 4: the terminal item is in the ledger with the status (no result sink
    // runs here), exactly as published, so a stream reader that sees `interrupted` finds it.
    let stored = h.stores.runs.events_after(run_id, 0, 10).await.unwrap();
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert_eq!(stored[0].sequence, 1);
    assert_eq!(
        stored[0].data,
        serde_json::to_value(&terminal.result).unwrap(),
        "the sink finds the published item stored as is"
    );
    h.jobs_settled().await;
    assert!(
        h.sessions.get_session(&run_id).await.unwrap().is_none(),
        "session ended"
    );
    assert!(
        h.sessions
            .lease_holder(&lease_key(&run_id))
            .await
            .unwrap()
            .is_none(),
        "lease released"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_flag_set_before_start_finishes_the_run_cancelled() {
    let mut h = Harness::start(|_, _| {}).await;
    let job = h.prepare_run(ECHO, "too late").await;
    h.sessions
        .set_ex(
            &cancel_flag_key(&job.run_id),
            b"user cancelled",
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    h.publish_job(&job).await;
    let results = h.results_until_terminal().await;
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0].sequence, 1);
    assert_eq!(results[0].result.data["code"], "cancelled");
    assert_eq!(results[0].result.data["error"], "user cancelled");
    h.jobs_settled().await;
    assert!(h.sessions.get_session(&job.run_id).await.unwrap().is_none());
    h.stop().await;
}

/// The end of a run (one `end_run` step) leaves the run's session, cancel flag and lease
/// gone and its hand-off marker set to the worker, also for a run that never started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_run_leaves_only_its_hand_off_marker() {
    let mut h = Harness::start(|_, _| {}).await;
    let cancelled = h.prepare_run(ECHO, "never starts").await;
    h.sessions
        .set_ex(
            &cancel_flag_key(&cancelled.run_id),
            b"user cancelled",
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    h.publish_job(&cancelled).await;
    h.results_until_terminal().await;
    let ran = h.prepare_run(ECHO, "runs").await;
    h.publish_job(&ran).await;
    h.results_until_terminal().await;
    h.jobs_settled().await;
    let worker_id = h.worker().id().to_owned();
    for run_id in [cancelled.run_id, ran.run_id] {
        assert!(h.sessions.get_session(&run_id).await.unwrap().is_none());
        assert!(
            h.sessions
                .get(&cancel_flag_key(&run_id))
                .await
                .unwrap()
                .is_none()
        );
        assert!(
            h.sessions
                .lease_holder(&lease_key(&run_id))
                .await
                .unwrap()
                .is_none()
        );
        assert_eq!(
            h.sessions
                .get(&run_handed_off_key(&run_id))
                .await
                .unwrap()
                .as_deref(),
            Some(worker_id.as_bytes())
        );
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steering_items_the_run_never_pulled_are_audited_as_dropped() {
    let mut h = Harness::start(|_, _| {}).await;
    let job = h.prepare_run(ECHO, "busy").await;
    let run_id = job.run_id;
    // Follow-up messages the orchestrator claimed for the run (the `SteeringItem` shape);
    // the echo runner never pulls them. `follow-1` is pushed twice, as a redelivered event
    // would be: its audit must still append once.
    let item = |event_id: &str, text: &str| {
        serde_json::json!({
            "claimed_run_id": run_id.to_string(),
            "runner_id": ECHO,
            "claimed_at": 1_700_000_100,
            "event": {"event_id": event_id, "event_type": "message.received", "source": "api"},
            "conversation": {"conversation_id": "conv-1", "bot_id": "bot", "workspace_id": "default"},
            "actor": {"actor_type": "user", "actor_id": "u1"},
            "input": {"text": text, "contents": [{"type": "image", "base64": "AAAA"}]},
            "metadata": {},
        })
    };
    for (event_id, text) in [
        ("follow-1", "and one more"),
        ("follow-2", "and another"),
        ("follow-1", "and one more"),
    ] {
        let outcome = h
            .sessions
            .steering_push(&run_id, &item(event_id, text), STEERING_CAP)
            .await
            .unwrap();
        assert!(outcome.is_accepted(), "{outcome:?}");
    }
    h.publish_job(&job).await;
    let results = h.results_until_terminal().await;
    assert_eq!(
        results.last().unwrap().result.known_type(),
        Some(ResultType::RunCompleted)
    );
    // The job is acked only after the session ended and the audits were written.
    h.jobs_settled().await;
    assert!(h.sessions.get_session(&run_id).await.unwrap().is_none());
    assert_eq!(h.sessions.steering_len(&run_id).await.unwrap(), 0);

    let mut q = EventQuery::new(WorkspaceId::default_workspace());
    q.event_types = vec!["steering.dropped".into()];
    let rows = h.stores.events.page(q).await.unwrap().items;
    let mut keys: Vec<_> = rows
        .iter()
        .map(|r| r.idempotency_key.clone().unwrap())
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        vec![
            format!("steering.dropped:{run_id}:follow-1"),
            format!("steering.dropped:{run_id}:follow-2"),
        ],
        "one row per dropped item, the duplicate appended once"
    );
    let row = rows
        .iter()
        .find(|r| r.metadata["steering"]["source_event_id"] == "follow-2")
        .unwrap();
    assert_eq!(row.source, "host");
    assert_eq!(row.run_id, Some(run_id));
    assert_eq!(row.runner_id.as_deref(), Some(ECHO));
    assert_eq!(row.conversation_id.as_deref(), Some("conv-1"));
    assert_eq!(row.actor_id.as_deref(), Some("u1"));
    assert_eq!(row.input_summary.as_deref(), Some("and another"));
    assert_eq!(row.metadata["steering"]["status"], "dropped");
    assert_eq!(row.metadata["steering"]["reason"], "run_ended");
    assert_eq!(
        row.metadata["steering"]["claimed_run_id"],
        run_id.to_string()
    );
    let stored = row.envelope.as_ref().unwrap();
    assert_eq!(
        stored["input"]["contents"][0]["content_redacted"], true,
        "the stored copy is redacted"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_past_its_deadline_times_out_without_running() {
    let mut h = Harness::start(|_, _| {}).await;
    let job = h
        .prepare_run_with(ECHO, "slow queue", Some(now_secs() - 1.0))
        .await;
    h.publish_job(&job).await;
    let results = h.results_until_terminal().await;
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0].result.data["code"], "timeout");
    h.jobs_settled().await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_for_a_runner_not_hosted_here_fails_clearly() {
    let mut h = Harness::start(|_, _| {}).await;
    let job = h
        .prepare_run("plugin:acme/missing/default", "anyone?")
        .await;
    h.publish_job(&job).await;
    let results = h.results_until_terminal().await;
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0].result.data["code"], "runner.error");
    assert!(
        results[0].result.data["error"]
            .as_str()
            .unwrap()
            .contains("plugin:acme/missing/default")
    );
    h.jobs_settled().await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_job_is_dead_lettered() {
    let mut h = Harness::start(|_, _| {}).await;
    h.bus
        .publish(
            &h.topology.runs_exchange(),
            "default",
            r#"{"schema":"switchboard.job/9"}"#.into(),
            PublishOptions::default(),
        )
        .await
        .unwrap();
    let dead = h.topology.dead_queue().name;
    let bus = h.bus.clone();
    h.eventually("the bad job in the dead-letter queue", move || {
        bus.ready_count(&dead) == Some(1)
    })
    .await;
    h.jobs_settled().await;
    assert!(
        h.no_result_within(Duration::from_millis(200))
            .await
            .is_none()
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_over_the_item_limit_ends_with_one_too_many_items_failure() {
    let mut h = Harness::start(|_, config| {
        config.limits.run_items_max = std::num::NonZeroU64::new(5).unwrap();
    })
    .await;

    // 3 deltas, `message.completed`, `run.completed`: exactly the limit, the runner's own
    // terminal item is accepted.
    let job = h.prepare_run(ECHO, "hello big world").await;
    h.publish_job(&job).await;
    let results = h.results_until_terminal().await;
    assert_eq!(results.len(), 5);
    assert_eq!(
        results[4].result.known_type(),
        Some(ResultType::RunCompleted)
    );
    h.jobs_settled().await;

    // 50 deltas: the fifth item is the synthesized failure, the rest are dropped as late.
    let job = h.prepare_run(support::SCRIPTED, "slow 50").await;
    h.publish_job(&job).await;
    let results = h.results_until_terminal().await;
    let sequences: Vec<u64> = results.iter().map(|m| m.sequence).collect();
    assert_eq!(sequences, vec![1, 2, 3, 4, 5], "dense, and capped");
    assert!(results.iter().all(|m| m.run_id == job.run_id));
    assert!(
        results[..4]
            .iter()
            .all(|m| m.result.known_type() == Some(ResultType::MessageDelta))
    );
    let last = &results[4].result;
    assert_eq!(last.known_type(), Some(ResultType::RunFailed));
    assert_eq!(last.data["code"], "runner.too_many_items");
    assert_eq!(
        h.no_result_within(Duration::from_millis(500)).await,
        None,
        "nothing after the one terminal item"
    );
    h.jobs_settled().await;
    let report = h.stop().await;
    assert!(report.forced_runs.is_empty());
}
