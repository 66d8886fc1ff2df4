//! Direct agents, `agent_id` and `deliver_at` on ingest, the event wait and the
//! conversation stream end to end in embedded mode (issue 14 items 6-7): see
//! [`sb_tests::addressing`].
//!
//! Needs the runner binaries: `cargo build --workspace --bins` (scripts/test does it).

use sb_tests::addressing::{
    conversation_stream_scenario, deliver_at_scenario, direct_agents_scenario,
};
use sb_tests::{ECHO, TestCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_agents_and_agent_id_on_ingest() {
    let cluster = TestCluster::embedded().await;
    direct_agents_scenario(cluster.client(), ECHO).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_events_are_routed_at_their_time() {
    let cluster = TestCluster::embedded().await;
    deliver_at_scenario(cluster.client()).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_streams_every_run_resumably() {
    let cluster = TestCluster::embedded().await;
    conversation_stream_scenario(cluster.client()).await;
    cluster.shutdown().await;
}

/// A delayed event survives a restart: accepted, the process stops before it is due, and
/// the next process routes it at its time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_event_survives_a_restart() {
    let cluster = TestCluster::embedded().await;
    let mut body = sb_tests::message("restart-later", "after the restart");
    let due = chrono::Utc::now() + chrono::TimeDelta::milliseconds(2500);
    body["deliver_at"] = serde_json::json!(due.to_rfc3339());
    let accepted = cluster.client().post_event(&body, None).await.expect(202);
    assert_eq!(accepted.body["status"], "scheduled");
    let event_id: sb_protocol::ids::EventId = accepted.str("event_id").parse().unwrap();
    let (_, cluster) = cluster.restart().await;
    let run_id = cluster.client().run_of(event_id).await;
    let run = cluster.client().wait_run_terminal(run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert!(run["created_at"].as_i64().unwrap() >= due.timestamp());
    cluster.shutdown().await;
}
