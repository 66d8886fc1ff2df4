//! The client against the real gateway (`sb_gateway::serve` on a loopback port, in-memory
//! SQLite, the memory bus), with the orchestrator and the result sink played by a small
//! task that routes every received event straight to an echo "run": it writes the results
//! to the ledger and publishes them live, as the real result sink does.
//!
//! This checks what the stand-in gateway of the other tests cannot: the real SSE framing,
//! the `x-event-id` header, the real error frames, and the real ledger-then-live stream.

use std::sync::Arc;
use std::time::Duration;

use sb_common::bus::memory::MemoryBus;
use sb_common::bus::topology::{
    Topology, TopologyOptions, declare_topology, deliveries_routing_key,
};
use sb_common::bus::{Bus, PublishOptions};
use sb_common::session::memory::MemorySessionStore;
use sb_common::shutdown::Shutdown;
use sb_gateway::{GatewayDeps, GatewayOptions};
use sb_protocol::content::Message;
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::messages::{DeliveryMessage, ResultMessage, encode};
use sb_protocol::result::AgentRunResult;
use sb_store::{
    ApiKeyRole, EventQuery, EventStatus, EventStatusUpdate, NewRun, NewRunEvent, SqlStore,
    SqlStoreOptions, Stores,
};
use tokio::time::Instant;

use super::{FollowOptions, GatewayClient, NewEvent};

/// Text of a message the fake orchestrator leaves unrouted.
const UNROUTABLE: &str = "nobody listens";

struct Gateway {
    url: String,
    key: String,
    shutdown: Shutdown,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}

async fn start() -> Gateway {
    let store = SqlStore::connect(
        "sqlite::memory:",
        &SqlStoreOptions {
            migrate: true,
            ..SqlStoreOptions::default()
        },
    )
    .await
    .expect("sqlite");
    let stores = Stores::from_sql(store);
    let bus = Arc::new(MemoryBus::new());
    let topology = declare_topology(
        bus.as_ref(),
        &TopologyOptions {
            name_prefix: format!("test-{}.switchboard", uuid::Uuid::new_v4().simple()),
            ..TopologyOptions::default()
        },
    )
    .await
    .expect("topology");
    let key = stores
        .tenancy
        .create_api_key(
            &WorkspaceId::default_workspace(),
            Some("cli-test"),
            ApiKeyRole::Admin,
        )
        .await
        .unwrap()
        .plaintext;
    let shutdown = Shutdown::new();
    let deps = GatewayDeps {
        stores: stores.clone(),
        bus: bus.clone(),
        sessions: Arc::new(MemorySessionStore::new()),
        topology: topology.clone(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let mut options = GatewayOptions::default();
    options.stream.keep_alive = Duration::from_millis(500);
    tokio::spawn(sb_gateway::serve(listener, deps, options, shutdown.clone()));
    tokio::spawn(fake_orchestrator(stores, bus, topology, shutdown.clone()));
    Gateway { url, key, shutdown }
}

/// Routes every `received` event: unrouted if its text is [`UNROUTABLE`], else a run that
/// echoes the text word by word.
async fn fake_orchestrator(
    stores: Stores,
    bus: Arc<MemoryBus>,
    topology: Topology,
    shutdown: Shutdown,
) {
    let token = shutdown.token();
    while !token.is_cancelled() {
        let page = stores
            .events
            .page(EventQuery::new(WorkspaceId::default_workspace()))
            .await
            .unwrap();
        for event in page
            .items
            .into_iter()
            .filter(|e| e.status == EventStatus::Received)
        {
            let text = event.input_summary.clone().unwrap_or_default();
            if text == UNROUTABLE {
                let update = EventStatusUpdate {
                    reason: Some("no binding matched".into()),
                    ..EventStatusUpdate::status(EventStatus::Unrouted)
                };
                stores.events.update_status(event.id, update).await.unwrap();
                continue;
            }
            let (run, _) = stores
                .runs
                .create_run(NewRun {
                    id: None,
                    workspace_id: WorkspaceId::default_workspace(),
                    event_id: event.id,
                    agent_id: None,
                    runner_id: "plugin:switchboard/echo/default".into(),
                    pool: "default".into(),
                    conversation_id: event.conversation_id.clone(),
                    thread_id: None,
                    bot_id: None,
                    deadline_at: None,
                    attempt: 1,
                })
                .await
                .unwrap();
            let update = EventStatusUpdate {
                run_id: Some(run.id),
                ..EventStatusUpdate::status(EventStatus::Dispatched)
            };
            stores.events.update_status(event.id, update).await.unwrap();
            let sink = Sink {
                stores: stores.clone(),
                bus: bus.clone(),
                topology: topology.clone(),
                conversation: event.conversation_id.clone(),
                run_id: run.id,
            };
            tokio::spawn(sink.echo(text));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Persists then publishes one run's results, like the result sink.
struct Sink {
    stores: Stores,
    bus: Arc<MemoryBus>,
    topology: Topology,
    conversation: Option<String>,
    run_id: RunId,
}

impl Sink {
    async fn echo(self, text: String) {
        let words: Vec<&str> = text.split_whitespace().collect();
        let mut results: Vec<AgentRunResult> = words
            .iter()
            .enumerate()
            .map(|(i, w)| {
                AgentRunResult::delta(if i + 1 == words.len() {
                    (*w).to_owned()
                } else {
                    format!("{w} ")
                })
            })
            .collect();
        results.push(AgentRunResult::completed(Message::assistant(text.clone())));
        results.push(AgentRunResult::run_completed());
        for (i, result) in results.into_iter().enumerate() {
            self.emit(i as u64 + 1, result).await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    async fn emit(&self, sequence: u64, result: AgentRunResult) {
        let result = result.with_run_id(self.run_id).with_sequence(sequence);
        self.stores
            .runs
            .insert_event(NewRunEvent {
                run_id: self.run_id,
                sequence: sequence as i64,
                result_type: result.result_type.clone(),
                data: serde_json::to_value(&result).unwrap(),
            })
            .await
            .unwrap();
        let message = DeliveryMessage::from(ResultMessage::new(
            self.run_id,
            WorkspaceId::default_workspace(),
            self.conversation.clone(),
            sequence,
            result,
        ));
        self.bus
            .publish(
                &self.topology.deliveries_exchange(),
                &deliveries_routing_key("default", self.conversation.as_deref(), &self.run_id),
                encode(&message).into(),
                PublishOptions::best_effort(),
            )
            .await
            .unwrap();
    }
}

fn options() -> FollowOptions {
    FollowOptions {
        deadline: Some(Instant::now() + Duration::from_secs(20)),
        ..FollowOptions::default()
    }
}

#[tokio::test]
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

#[tokio::test]
async fn reports_unrouted_events_and_bad_keys_from_the_real_gateway() {
    let gw = start().await;
    let client = GatewayClient::new(&gw.url, Some(&gw.key)).unwrap();
    let mut follower = client.follow(
        NewEvent::message("c2", "u1", UNROUTABLE),
        "real-2".into(),
        options(),
    );
    let err = follower.next().await.unwrap_err();
    assert_eq!(err.code(), "event.unrouted", "{err}");
    assert!(err.to_string().contains("no binding matched"), "{err}");

    let client = GatewayClient::new(&gw.url, Some("sbk_wrong")).unwrap();
    let mut follower = client.follow(
        NewEvent::message("c2", "u1", "hi"),
        "real-3".into(),
        options(),
    );
    assert_eq!(follower.next().await.unwrap_err().code(), "unauthorized");
}

#[tokio::test]
async fn bench_and_send_run_against_the_real_gateway() {
    use crate::cli::{Cli, Command};
    use clap::Parser as _;

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
    let code = crate::cli::bench::run(args, Some(gw.key.clone()))
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
    let code = crate::cli::send::run(args, Some(gw.key.clone()))
        .await
        .unwrap();
    assert_eq!(code, std::process::ExitCode::SUCCESS);
}

/// The JSON helper behind `switchboard models|tools|kb` against the real routes: created
/// resources come back, and the gateway's refusals surface with their code.
#[tokio::test]
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
#[tokio::test]
async fn keys_are_managed_through_the_real_gateway() {
    use crate::cli::keys::{KeysArgs, KeysCommand, create_through, list_through, revoke_through};
    use crate::cli::{Cli, Command};
    use clap::Parser as _;

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
