//! Retention and artifacts over HTTP end to end (issue 14 items 4 and 5): see
//! [`sb_tests::retention`]. Embedded mode (SQLite) here, with `retention.run_results`
//! shortened to a second; the same scenarios on RabbitMQ, Redis and Postgres follow
//! (skipped, with a message, when a service is unreachable).
//!
//! Needs the runner binaries: `cargo build --workspace --bins` (scripts/test does it).

use sb_tests::cluster::{ClusterSpec, TestCluster as Cluster};
use sb_tests::retention::{artifacts_scenario, result_expiry_scenario, retention_settings};
use sb_tests::{ECHO, TestCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_expire_and_artifacts_download_in_embedded_mode() {
    let mut builder = TestCluster::builder();
    for (key, value) in retention_settings() {
        builder = builder.config(key, value);
    }
    let cluster = builder.start().await;
    result_expiry_scenario(cluster.client(), ECHO).await;
    artifacts_scenario(cluster.client()).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_expire_and_artifacts_download_in_cluster_mode() {
    let mut spec = ClusterSpec::default();
    for (key, value) in retention_settings() {
        let var = format!("SWITCHBOARD__{}", key.to_uppercase().replace('.', "__"));
        spec = spec.env(&var, value);
    }
    let Some(cluster) = Cluster::spawn_or_skip(spec).await else {
        return;
    };
    result_expiry_scenario(&cluster.client(0), ECHO).await;
    artifacts_scenario(&cluster.client(0)).await;
}
