//! `switchboard bench` (in process) against the stand-in gateway: every run over the
//! conversations, and failed, lost and gapped runs accounted for.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser as _;
use sb_tests::stand_in_gateway::{Script, TEST_KEY, TestGateway};
use switchboard::cli::bench::{
    BenchArgs, Plan, Report, RunOutcome, Tally, bench_text, one_run, run,
};
use switchboard::cli::{Cli, Command};
use switchboard::client::GatewayClient;

fn bench_args(url: &str, extra: &[&str]) -> BenchArgs {
    let mut argv = vec!["switchboard", "bench", "--url", url, "--json"];
    argv.extend_from_slice(extra);
    match Cli::try_parse_from(argv).unwrap().command {
        Command::Bench(a) => a,
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn bench_runs_every_run_over_the_conversations() {
    let gw = TestGateway::start(Script {
        drop_after: vec![1, 0, 2],
        ..Script::default()
    })
    .await;
    let args = bench_args(
        &gw.url(),
        &[
            "--runs",
            "20",
            "--concurrency",
            "4",
            "--conversations",
            "3",
            "--text-words",
            "5",
        ],
    );
    let code = run(args, Some(TEST_KEY.into())).await.unwrap();
    assert_eq!(code, ExitCode::SUCCESS);
    let stats = gw.stats();
    assert_eq!(stats.events_created, 20);
    let mut conversations = stats.conversations.clone();
    conversations.sort();
    conversations.dedup();
    assert_eq!(conversations.len(), 3, "{conversations:?}");
    assert!(
        stats
            .texts
            .iter()
            .all(|t| t == "alpha bravo charlie delta echo")
    );
    let mut keys = stats.idempotency_keys.clone();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 20, "one key per run (re-posts reuse theirs)");
}

#[tokio::test]
async fn bench_accounts_for_failed_and_lost_runs() {
    // Every run fails with a code.
    let gw = TestGateway::start(Script {
        fail_with: Some("runner.crashed"),
        ..Script::default()
    })
    .await;
    let args = bench_args(&gw.url(), &["--runs", "5", "--concurrency", "2"]);
    assert_eq!(
        run(args, Some(TEST_KEY.into())).await.unwrap(),
        ExitCode::FAILURE
    );

    // Every run stalls: lost by timeout, all of them.
    let gw = TestGateway::start(Script {
        stall_after: Some(1),
        ..Script::default()
    })
    .await;
    let mut tally = Tally::default();
    let plan = test_plan(&gw.url(), 3, Duration::from_millis(300));
    for i in 0..3 {
        tally.record(&one_run(&plan, i).await.0);
    }
    let report = Report::new(&tally, Duration::from_secs(1));
    assert_eq!((report.runs, report.lost), (3, 3));
    assert_eq!(report.lost_reasons.get("timeout"), Some(&3));

    // A missing item is caught.
    let gw = TestGateway::start(Script {
        skip_sequence: Some(2),
        ..Script::default()
    })
    .await;
    let plan = test_plan(&gw.url(), 1, Duration::from_secs(10));
    assert_eq!(
        one_run(&plan, 0).await.0,
        RunOutcome::Failed {
            code: "client.sequence_gap".into()
        }
    );
}

fn test_plan(url: &str, runs: u32, run_timeout: Duration) -> Plan {
    Plan::new(
        GatewayClient::new(url, Some(TEST_KEY)).unwrap(),
        runs,
        1,
        run_timeout,
        bench_text(3),
        "t".into(),
    )
}
