//! Issue 14 items 6-7 end to end in cluster mode: the scenarios of
//! [`sb_tests::addressing`] against `switchboard` processes on RabbitMQ, Redis and Postgres
//! ([`sb_tests::cluster`]). Skipped, with a message, when a service is unreachable. Build
//! the binaries first: `cargo build --workspace --bins` (`scripts/test` does).

use sb_tests::ECHO;
use sb_tests::addressing::{
    conversation_stream_scenario, deliver_at_scenario, direct_agents_scenario,
};
use sb_tests::cluster::{ClusterSpec, TestCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_agents_delayed_events_and_conversation_streams_in_cluster_mode() {
    let Some(cluster) = TestCluster::spawn_or_skip(ClusterSpec::default()).await else {
        return;
    };
    let client = cluster.client(0);
    direct_agents_scenario(&client, ECHO).await;
    deliver_at_scenario(&client).await;
    conversation_stream_scenario(&client).await;
    // The stream of a conversation resumed on another gateway.
    if cluster.gateway_urls().len() > 1 {
        conversation_stream_scenario(&cluster.client(1)).await;
    }
}
