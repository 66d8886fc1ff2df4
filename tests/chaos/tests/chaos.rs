//! The chaos suite's one test: every scenario of the profile in turn, on one set of own
//! services and one cluster (see the `sb_chaos` crate docs). Starting a broker takes
//! seconds, so the scenarios share them, and every scenario heals its fault before the next.
//!
//! ```text
//! cargo nextest run -p sb-chaos                       # short profile (scripts/test runs it)
//! SWITCHBOARD_CHAOS=full cargo nextest run -p sb-chaos --no-capture   # or scripts/chaos
//! ```

use std::time::Duration;

use sb_chaos::load::{Api, LOAD_BOT};
use sb_chaos::scenarios::{self, Context, HEARTBEAT_INTERVAL, LEASE_GRACE, LEASE_TTL};
use sb_chaos::services::{Binaries, OwnServices};
use sb_chaos::{Profile, markdown_table};
use sb_tests::TEST_SHARED;
use sb_tests::cluster::{ClusterSpec, TestCluster};
use serde_json::json;

fn secs(d: Duration) -> String {
    format!("{}s", d.as_secs())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos() {
    let binaries = match Binaries::find() {
        Ok(binaries) => binaries,
        Err(missing) => {
            assert!(
                std::env::var_os("SWITCHBOARD_TEST_REQUIRE_SERVICES").is_none(),
                "the chaos suite needs the service binaries; missing: {missing}"
            );
            eprintln!("SKIPPED: the chaos suite needs the service binaries; missing: {missing}");
            return;
        }
    };
    let profile = Profile::from_env().expect("the chaos profile");
    let out = profile.output_dir();
    std::fs::create_dir_all(&out).expect("target/chaos");
    eprintln!(
        "chaos profile {}: {:?}, scenarios {:?}",
        profile.name,
        profile.load,
        profile.faults.iter().map(|f| f.name()).collect::<Vec<_>>()
    );

    // Declared before the cluster: dropped after it (its cleanup uses them).
    let mut services = OwnServices::start(binaries)
        .await
        .expect("the chaos suite's own services start");
    let spec = ClusterSpec {
        gateways: 1,
        orchestrators: 2,
        workers: 2,
        env: Vec::new(),
    }
    .env(
        "SWITCHBOARD__WORKER__HEARTBEAT_INTERVAL",
        &secs(HEARTBEAT_INTERVAL),
    )
    .env("SWITCHBOARD__WORKER__LEASE_TTL", &secs(LEASE_TTL))
    .env("SWITCHBOARD__WORKER__SLOTS", "32")
    .env("SWITCHBOARD__ORCHESTRATOR__LEASE_GRACE", &secs(LEASE_GRACE))
    .env(
        "SWITCHBOARD__ORCHESTRATOR__REAPER_INTERVAL",
        &secs(scenarios::REAPER_INTERVAL),
    )
    .env("SWITCHBOARD__ORCHESTRATOR__DEFAULT_RUN_TIMEOUT", "120s")
    // A short wait for a pooled connection: a database outage then surfaces as errors during
    // the outage (as on a loaded machine or a dead host) instead of being hidden by the
    // pool's wait, so `restart_postgres` exercises every consumer's error path.
    .env("SWITCHBOARD__DATABASE__CONNECT_TIMEOUT", "1s")
    .env("SWITCHBOARD__ORCHESTRATOR__MEMBERSHIP_HEARTBEAT", "1s")
    .env("SWITCHBOARD__ORCHESTRATOR__MEMBERSHIP_TTL", "3s")
    .env(
        "SWITCHBOARD__LIMITS__RUN_ITEMS_MAX",
        &scenarios::RUN_ITEMS_MAX.to_string(),
    );
    let mut cluster = TestCluster::spawn_on(services.urls().clone(), spec)
        .await
        .expect("the chaos cluster starts");
    cluster
        .create_agent(json!({
            "name": "chaos",
            "runner_id": TEST_SHARED,
            "scope": {"bot_id": LOAD_BOT},
        }))
        .await
        .expect("the load's agent is created");
    let api = Api::new(cluster.gateway_urls(), cluster.api_key());

    let mut reports = Vec::new();
    {
        let mut ctx = Context {
            services: &mut services,
            cluster: &mut cluster,
            api,
            load: profile.load.clone(),
        };
        for fault in &profile.faults {
            let report = scenarios::run(&mut ctx, *fault).await;
            let text = serde_json::to_string_pretty(&report).expect("a JSON report");
            eprintln!("chaos {}: {text}", report.scenario);
            std::fs::write(out.join(format!("{}.json", report.scenario)), &text)
                .expect("the scenario report is written");
            reports.push(report);
        }
    }
    let summary = json!({"profile": profile.name, "load": profile.load, "scenarios": reports});
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&summary).expect("JSON"),
    )
    .expect("summary.json");
    let table = markdown_table(&reports);
    std::fs::write(out.join("summary.md"), &table).expect("summary.md");
    eprintln!("{table}\nreports in {}", out.display());

    let failed: Vec<String> = reports
        .iter()
        .filter(|r| !r.violations.is_empty())
        .map(|r| format!("{}: {}", r.scenario, r.violations.join("; ")))
        .collect();
    if !failed.is_empty() {
        eprintln!("cluster logs: {}", cluster.logs_dir().display());
    }
    assert!(
        failed.is_empty(),
        "chaos guarantees broken:\n{}",
        failed.join("\n")
    );
}
