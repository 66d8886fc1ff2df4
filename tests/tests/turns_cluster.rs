//! The turn API end to end in cluster mode (issue 14): the scenario of
//! [`sb_tests::turns`] against `switchboard` processes on RabbitMQ, Redis and Postgres
//! ([`sb_tests::cluster`]). Skipped, with a message, when a service is unreachable. Build
//! the binaries first: `cargo build --workspace --bins` (`scripts/test` does).

use sb_tests::cluster::{ClusterSpec, TestCluster};
use sb_tests::turns::turn_api_scenario;
use sb_tests::{ECHO, TEST_SHARED};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_and_turns_end_to_end_in_cluster_mode() {
    let Some(cluster) = TestCluster::spawn_or_skip(ClusterSpec::default()).await else {
        return;
    };
    turn_api_scenario(&cluster.client(0), ECHO, TEST_SHARED).await;
}
