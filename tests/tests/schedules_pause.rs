//! A paused schedule does not fire in the orchestrator's scheduler, and a resumed one fires
//! again from now (embedded host: the real scheduler loop, every second).

use std::time::Duration;

use sb_tests::{TestCluster, wait_for};
use serde_json::json;

/// Runs of conversation `conversation` so far (each firing starts one on the default agent).
async fn runs(cluster: &TestCluster, conversation: &str) -> usize {
    let page = cluster
        .client()
        .get(&format!(
            "/v1/runs?conversation_id={conversation}&limit=100"
        ))
        .await
        .expect(200)
        .body;
    page["items"].as_array().map_or(0, Vec::len)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_schedule_does_not_fire_until_resumed() {
    let cluster = TestCluster::embedded().await;
    let client = cluster.client();
    let schedule = client
        .post(
            "/v1/schedules",
            &json!({"kind": "interval", "spec": "1s", "event": {
                "event_type": "message.received", "source": "api",
                "conversation_id": "ticks", "input": {"text": "tick"}}}),
        )
        .await
        .expect(201)
        .body;
    let path = format!(
        "/v1/schedules/{}",
        schedule["schedule_id"].as_str().unwrap()
    );
    wait_for("a first firing", || async {
        (runs(&cluster, "ticks").await >= 1).then_some(())
    })
    .await;

    let paused = client
        .patch(&path, &json!({"enabled": false}))
        .await
        .expect(200)
        .body;
    assert_eq!(paused["next_fire_at"], serde_json::Value::Null);
    // A firing that committed before the pause may still be starting its run.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let while_paused = runs(&cluster, "ticks").await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        runs(&cluster, "ticks").await,
        while_paused,
        "no firing while paused (the scheduler scans every second)"
    );

    client
        .patch(&path, &json!({"enabled": true}))
        .await
        .expect(200);
    wait_for("a firing after the resume", || async {
        (runs(&cluster, "ticks").await > while_paused).then_some(())
    })
    .await;
    cluster.shutdown().await;
}
