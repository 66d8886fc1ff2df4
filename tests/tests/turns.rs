//! The turn API end to end in embedded mode (issue 14): see [`sb_tests::turns`].
//!
//! Needs the runner binaries: `cargo build --workspace --bins` (scripts/test does it).

use sb_tests::turns::turn_api_scenario;
use sb_tests::{ECHO, TEST_SHARED, TestCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_and_turns_end_to_end() {
    let cluster = TestCluster::embedded().await;
    turn_api_scenario(cluster.client(), ECHO, TEST_SHARED).await;
    cluster.shutdown().await;
}
