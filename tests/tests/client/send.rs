//! `switchboard send` (in process) against the stand-in gateway: the reply to its end
//! across a dropped stream, new conversations, failures and claimed events.

use std::process::ExitCode;

use clap::Parser as _;
use sb_tests::stand_in_gateway::{Script, TEST_KEY, TestGateway};
use switchboard::cli::send::{SendArgs, run};
use switchboard::cli::{Cli, Command};

fn send_args(url: &str, extra: &[&str]) -> SendArgs {
    let mut argv = vec![
        "switchboard",
        "send",
        "hello big world",
        "--url",
        url,
        "--timeout",
        "20",
    ];
    argv.extend_from_slice(extra);
    match Cli::try_parse_from(argv).unwrap().command {
        Command::Send(a) => a,
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn send_follows_the_reply_to_the_end() {
    let gw = TestGateway::start(Script {
        drop_after: vec![2],
        ..Script::default()
    })
    .await;
    let code = run(
        send_args(&gw.url(), &["--conversation", "c7"]),
        Some(TEST_KEY.into()),
    )
    .await
    .unwrap();
    assert_eq!(code, ExitCode::SUCCESS);
    let stats = gw.stats();
    assert_eq!(stats.conversations, vec!["c7".to_owned()]);
    assert_eq!(stats.texts, vec!["hello big world".to_owned()]);
    assert_eq!(stats.run_streams, 1, "resumed once");

    // A new conversation id each time when none is given.
    run(send_args(&gw.url(), &[]), Some(TEST_KEY.into()))
        .await
        .unwrap();
    let conversations = gw.stats().conversations;
    assert!(conversations[1].starts_with("cli-"), "{conversations:?}");
}

#[tokio::test]
async fn send_fails_on_run_failure_unrouted_event_and_bad_key() {
    let gw = TestGateway::start(Script {
        fail_with: Some("runner.crashed"),
        ..Script::default()
    })
    .await;
    let err = run(send_args(&gw.url(), &[]), Some(TEST_KEY.into()))
        .await
        .unwrap_err();
    assert!(
        format!("{err:#}").contains("scripted failure (runner.crashed)"),
        "{err:#}"
    );

    let err = run(send_args(&gw.url(), &[]), Some("wrong".into()))
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("--api-key"), "{err:#}");

    let gw = TestGateway::start(Script {
        event_status: "unrouted",
        ..Script::default()
    })
    .await;
    let err = run(send_args(&gw.url(), &[]), Some(TEST_KEY.into()))
        .await
        .unwrap_err();
    assert!(
        format!("{err:#}").contains("not routed to any agent: no binding matched"),
        "{err:#}"
    );
}

#[tokio::test]
async fn claimed_events_are_not_an_error() {
    let gw = TestGateway::start(Script {
        event_status: "claimed",
        ..Script::default()
    })
    .await;
    let code = run(send_args(&gw.url(), &[]), Some(TEST_KEY.into()))
        .await
        .unwrap();
    assert_eq!(code, ExitCode::SUCCESS);
}
