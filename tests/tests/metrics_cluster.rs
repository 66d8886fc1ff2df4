//! Every role is scrapeable (issue 16, metrics): in a cluster of one gateway, one
//! orchestrator and one worker process, each serves `/metrics` (the gateway on its API
//! address, the others on `telemetry.metrics_listen`) along with `/healthz` and `/readyz`,
//! and the metrics of each role move when runs go through it.

use std::time::Duration;

use sb_tests::cluster::{ClusterSpec, Role, TestCluster};
use sb_tests::wait_for;

/// Runs pushed through the cluster before scraping.
const RUNS: usize = 5;

/// The series of `name` on a Prometheus text page: each one's labels part (`{…}`, or empty)
/// and its value as written.
fn series<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = (&'a str, &'a str)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(move |(series, value)| {
            let labels = series.strip_prefix(name)?;
            (labels.is_empty() || labels.starts_with('{')).then_some((labels, value))
        })
}

/// The value of the first series of `name` whose labels contain every `labels` pair, from a
/// Prometheus text page (`None` when no such series exists).
fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    series(text, name)
        .find(|(series, _)| labels.iter().all(|pair| series.contains(pair)))
        .and_then(|(_, value)| value.parse().ok())
}

/// The sum of every series of `name`.
fn total(text: &str, name: &str) -> f64 {
    series(text, name)
        .filter_map(|(_, value)| value.parse::<f64>().ok())
        .sum()
}

async fn scrape(http: &reqwest::Client, base: &str, path: &str) -> (u16, String) {
    let response = http
        .get(format!("{base}{path}"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {base}{path}: {e}"));
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_role_serves_metrics_that_move_with_runs() {
    let spec = ClusterSpec {
        gateways: 1,
        orchestrators: 1,
        workers: 1,
        ..ClusterSpec::default()
    }
    .env("SWITCHBOARD__TELEMETRY__METRICS_LISTEN", "127.0.0.1:0");
    let Some(cluster) = TestCluster::spawn_or_skip(spec).await else {
        return;
    };
    let client = cluster.client(0);
    for i in 0..RUNS {
        let event = client
            .send_message(&format!("metrics-{i}"), "hello metrics")
            .await;
        let run = client.run_of(event).await;
        client.wait_run_terminal(run).await;
    }

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("an HTTP client");
    let url = |role: Role| {
        let name = cluster.process_names_of(role)[0].clone();
        cluster
            .metrics_url_of(&name)
            .unwrap_or_else(|| panic!("{name} logged no metrics address"))
    };
    let (gateway, orchestrator, worker) = (
        url(Role::Gateway),
        url(Role::Orchestrator),
        url(Role::Worker),
    );

    for base in [&orchestrator, &worker] {
        assert_eq!(
            scrape(&http, base, "/healthz").await.0,
            200,
            "{base}/healthz"
        );
        let (status, body) = scrape(&http, base, "/readyz").await;
        assert_eq!(status, 200, "{base}/readyz: {body}");
        assert!(body.contains("\"ready\""), "{body}");
    }

    // The gateway: ingest and HTTP.
    let text = scrape(&http, &gateway, "/metrics").await.1;
    assert!(
        sample(&text, "sb_events_ingested_total", &["outcome=\"accepted\""]) >= Some(RUNS as f64),
        "{text}"
    );
    assert!(
        sample(&text, "sb_http_requests_total", &[]).is_some(),
        "{text}"
    );

    // The orchestrator: routing and the lag of the queues it consumes.
    let text = scrape(&http, &orchestrator, "/metrics").await.1;
    assert!(
        sample(&text, "sb_events_routed_total", &["outcome=\"dispatched\""]) >= Some(RUNS as f64),
        "{text}"
    );
    assert!(
        sample(&text, "sb_queue_lag_seconds_count", &[]) > Some(0.0),
        "{text}"
    );

    // The worker: run duration, first result, terminal runs (its result sink stores and
    // ends them), runner processes, queue lag. The gauge of active runs falls back to zero
    // once the runs have ended.
    let text = wait_for("the worker's metrics", || {
        let http = http.clone();
        let worker = worker.clone();
        async move {
            let text = scrape(&http, &worker, "/metrics").await.1;
            (sample(&text, "sb_runs_active", &[]) == Some(0.0)).then_some(text)
        }
    })
    .await;
    for (name, labels) in [
        (
            "sb_run_duration_seconds_count",
            &["status=\"completed\""][..],
        ),
        ("sb_run_first_result_seconds_count", &[][..]),
        ("sb_runs_total", &["status=\"completed\""][..]),
        ("sb_bus_consumed_total", &["disposition=\"ack\""][..]),
    ] {
        assert!(
            sample(&text, name, labels) >= Some(RUNS as f64),
            "{name} {labels:?} in\n{text}"
        );
    }
    assert!(
        sample(&text, "sb_queue_lag_seconds_count", &[]) > Some(0.0),
        "{text}"
    );
    assert!(
        sample(&text, "sb_runner_processes", &[]).is_some(),
        "no runner process gauge in\n{text}"
    );
    assert!(text.contains("# HELP sb_run_duration_seconds "), "{text}");
    // Settling is counted in frames: one per message at most (acks coalesce).
    let frames = total(&text, "sb_bus_settle_frames_total");
    assert!(
        frames > 0.0 && frames <= total(&text, "sb_bus_consumed_total"),
        "{frames} settle frames in\n{text}"
    );
}
