//! The client against the real host: gateway, orchestrator and worker with the echo runner
//! on the in-memory harness ([`TestCluster`], the library's `switchboard::testing` host).
//!
//! This checks what the stand-in gateway of the other tests cannot: the real SSE framing,
//! the `x-event-id` header, the real error frames, the real routing and result sink, and the
//! real ledger-then-live stream.

use std::time::Duration;

use sb_tests::TestCluster;
use switchboard::client::{FollowOptions, GatewayClient, NewEvent};
use tokio::time::Instant;

/// Text of a message the host leaves unrouted (sent to a host without agents).
const UNROUTABLE: &str = "nobody listens";

/// The real host and its admin key.
struct Gateway {
    url: String,
    key: String,
    _cluster: TestCluster,
}

/// A host with the workspace-wide echo agent.
async fn start() -> Gateway {
    on(TestCluster::embedded().await)
}

/// A host without any agent: every event is unrouted.
async fn start_without_agents() -> Gateway {
    on(TestCluster::builder().without_default_agent().start().await)
}

fn on(cluster: TestCluster) -> Gateway {
    Gateway {
        url: cluster.client().base_url().to_owned(),
        key: cluster.client().key().expect("a key").to_owned(),
        _cluster: cluster,
    }
}

fn options() -> FollowOptions {
    FollowOptions {
        deadline: Some(Instant::now() + Duration::from_secs(20)),
        ..FollowOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_a_run_through_the_real_gateway() {
    let gw = start().await;
    let client = GatewayClient::new(&gw.url, Some(&gw.key)).unwrap();
    let mut follower = client.follow(
        NewEvent::message("c1", "u1", "hello big world"),
        "real-1".into(),
        options(),
    );
    let mut items = Vec::new();
    while let Some(item) = follower.next().await.unwrap() {
        items.push(item);
    }
    let seen: Vec<(Option<u64>, &str)> = items
        .iter()
        .map(|i| (i.sequence, i.result_type.as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            (Some(1), "message.delta"),
            (Some(2), "message.delta"),
            (Some(3), "message.delta"),
            (Some(4), "message.completed"),
            (Some(5), "run.completed"),
        ]
    );
    assert!(follower.event_id().is_some(), "x-event-id header read");
    assert_eq!(follower.run_id(), Some(items[0].run_id.as_str()));
    assert_eq!(follower.reconnects(), 0);

    // The same idempotency key again: the same event and run, streamed from the ledger.
    let mut again = client.follow(
        NewEvent::message("c1", "u1", "hello big world"),
        "real-1".into(),
        options(),
    );
    let mut count = 0;
    while let Some(item) = again.next().await.unwrap() {
        assert_eq!(item.run_id, items[0].run_id);
        count += 1;
    }
    assert_eq!(count, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_unrouted_events_and_bad_keys_from_the_real_gateway() {
    let gw = start_without_agents().await;
    let client = GatewayClient::new(&gw.url, Some(&gw.key)).unwrap();
    let mut follower = client.follow(
        NewEvent::message("c2", "u1", UNROUTABLE),
        "real-2".into(),
        options(),
    );
    let err = follower.next().await.unwrap_err();
    assert_eq!(err.code(), "event.unrouted", "{err}");
    // The orchestrator's reason (the stand-in's "no binding matched").
    assert!(err.to_string().contains("binding.not_found"), "{err}");

    let client = GatewayClient::new(&gw.url, Some("sbk_wrong")).unwrap();
    let mut follower = client.follow(
        NewEvent::message("c2", "u1", "hi"),
        "real-3".into(),
        options(),
    );
    assert_eq!(follower.next().await.unwrap_err().code(), "unauthorized");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_and_send_run_against_the_real_gateway() {
    use clap::Parser as _;
    use switchboard::cli::{Cli, Command};

    let gw = start().await;
    let argv = [
        "switchboard",
        "bench",
        "--url",
        &gw.url,
        "--runs",
        "12",
        "--concurrency",
        "4",
        "--conversations",
        "3",
        "--text-words",
        "6",
        "--run-timeout",
        "20",
        "--json",
    ];
    let Command::Bench(args) = Cli::try_parse_from(argv).unwrap().command else {
        panic!()
    };
    let code = switchboard::cli::bench::run(args, Some(gw.key.clone()))
        .await
        .unwrap();
    assert_eq!(code, std::process::ExitCode::SUCCESS);

    let argv = [
        "switchboard",
        "send",
        "hi there",
        "--url",
        &gw.url,
        "--timeout",
        "20",
    ];
    let Command::Send(args) = Cli::try_parse_from(argv).unwrap().command else {
        panic!()
    };
    let code = switchboard::cli::send::run(args, Some(gw.key.clone()))
        .await
        .unwrap();
    assert_eq!(code, std::process::ExitCode::SUCCESS);
}

/// The bench's host stages read the ledger's stamps of real runs: each run's three spans are
/// counted, and they add up to no more than the time the runs took from post to end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_stages_read_the_real_ledger() {
    use switchboard::cli::bench::{RunIds, stages};

    let gw = start().await;
    let client = GatewayClient::new(&gw.url, Some(&gw.key)).unwrap();
    let mut runs = Vec::new();
    let started = Instant::now();
    for i in 0..3 {
        let mut follower = client.follow(
            NewEvent::message(&format!("stages-{i}"), "u1", "one two three"),
            format!("stages-{i}"),
            options(),
        );
        while follower.next().await.unwrap().is_some() {}
        runs.push(RunIds {
            event_id: follower.event_id().unwrap().to_owned(),
            run_id: follower.run_id().unwrap().to_owned(),
        });
    }
    let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
    // A run the gateway does not know is left out, not counted as zero.
    runs.push(RunIds {
        event_id: runs[0].event_id.clone(),
        run_id: uuid::Uuid::new_v4().to_string(),
    });
    let stages = stages::read(&client, &runs)
        .await
        .expect("stamps of the real runs");
    assert_eq!(stages.runs, 3);
    let p99 = |p: switchboard::cli::bench::Percentiles| p.p99.expect("a sample");
    let total = p99(stages.route) + p99(stages.claim) + p99(stages.execute);
    assert!(
        total <= elapsed_ms + 3.0,
        "stages {stages:?} exceed the {elapsed_ms} ms the runs took"
    );
}

/// The JSON helper behind `switchboard models|tools|kb` against the real routes: created
/// resources come back, and the gateway's refusals surface with their code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_resources_through_the_real_gateway() {
    let gw = start().await;
    let client = GatewayClient::new(&gw.url, Some(&gw.key)).unwrap();
    let model = client
        .json(
            reqwest::Method::POST,
            "/v1/models",
            Some(&serde_json::json!({
                "name": "m", "kind": "llm", "base_url": "https://api.example.com/v1",
                "model_name": "x"
            })),
        )
        .await
        .unwrap();
    assert!(model["model_id"].is_string());
    let list = client
        .json(reqwest::Method::GET, "/v1/models", None)
        .await
        .unwrap();
    assert_eq!(list["items"][0]["model_id"], model["model_id"]);
    let err = client
        .json(
            reqwest::Method::POST,
            "/v1/tools",
            Some(&serde_json::json!({"name": "t", "kind": "mcp", "url": "http://x"})),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("invalid_argument"), "{err}");
}

/// `switchboard keys create --url`, `keys list` and `keys revoke` through the real routes:
/// a client key by default, the secret alone on stdout, admin-only listing, and a revoked
/// key refused on its next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_managed_through_the_real_gateway() {
    use clap::Parser as _;
    use switchboard::cli::keys::{
        KeysArgs, KeysCommand, create_through, list_through, revoke_through,
    };
    use switchboard::cli::{Cli, Command};

    let gw = start().await;
    let admin = GatewayClient::new(&gw.url, Some(&gw.key)).unwrap();
    let argv = [
        "switchboard",
        "keys",
        "create",
        "--url",
        &gw.url,
        "--name",
        "app",
    ];
    let Command::Keys(KeysArgs {
        command: KeysCommand::Create(args),
    }) = Cli::try_parse_from(argv).unwrap().command
    else {
        panic!()
    };
    let mut out = Vec::new();
    let created = create_through(&admin, &args, &mut out).await.unwrap();
    let printed = String::from_utf8(out).unwrap();
    let secret = printed.trim_end_matches('\n');
    assert!(
        secret.starts_with("sb_") && !secret.contains('\n'),
        "{printed:?}"
    );
    assert_eq!(
        created["role"], "client",
        "client by default through the gateway"
    );
    assert!(
        created.get("key").is_none(),
        "the secret went to stdout only"
    );

    let items = list_through(&admin).await.unwrap();
    assert_eq!(items.len(), 2);
    assert!(!serde_json::to_string(&items).unwrap().contains(secret));

    let app = GatewayClient::new(&gw.url, Some(secret)).unwrap();
    let err = list_through(&app).await.unwrap_err().to_string();
    assert!(err.contains("permission_denied"), "{err}");
    app.json(reqwest::Method::GET, "/v1/runs", None)
        .await
        .expect("a client key reads runs");

    let key_id: uuid::Uuid = created["key_id"].as_str().unwrap().parse().unwrap();
    revoke_through(&admin, key_id).await.unwrap();
    let err = app
        .json(reqwest::Method::GET, "/v1/runs", None)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("unauthorized"), "{err}");
    let err = revoke_through(&admin, uuid::Uuid::now_v7())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("not_found"), "{err}");
}
