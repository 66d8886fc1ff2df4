//! Tests of the start and of the recovery pass as embedded mode runs it (on SQLite and the
//! memory bus, watched through the stop sequence's backlog).

use std::sync::Arc;

use sb_common::bus::memory::MemoryBus;
use sb_common::bus::topology::{Topology, declare_topology};
use sb_common::config::SwitchboardConfig;
use sb_common::session::memory::MemorySessionStore;
use sb_common::shutdown::Shutdown;
use sb_orchestrator::catalog::StoreCatalog;
use sb_orchestrator::recovery::{RECOVERY_PAGE, recover};
use sb_orchestrator::{OrchestratorDeps, OrchestratorOptions};
use sb_protocol::error::run_failure;
use sb_protocol::ids::{EventId, RunId, WorkspaceId};
use sb_store::{EventRecord, EventStatus, RunOutcome, RunStatus, SqlStore, Stores};

use super::stop::Backlog;
use super::*;

#[test]
fn role_names() {
    assert_eq!(Roles::ALL.names(), "gateway+orchestrator+worker");
    assert_eq!(Roles::WORKER.names(), "worker");
    assert_eq!(
        Roles {
            gateway: false,
            orchestrator: false,
            worker: false
        }
        .names(),
        "none"
    );
}

/// What a recovery test runs on: SQLite in memory and the memory bus, as the default
/// configuration (`switchboard dev`) sets them up, and the orchestrator's dependencies over
/// them.
struct Recovering {
    stores: Stores,
    bus: MemoryBus,
    topology: Topology,
    deps: OrchestratorDeps,
    options: Arc<OrchestratorOptions>,
}

impl Recovering {
    async fn new() -> Self {
        let config = SwitchboardConfig::default();
        let store = SqlStore::connect("sqlite::memory:", &store_options(&config))
            .await
            .unwrap();
        let stores = Stores::from_sql(store);
        let bus = MemoryBus::new();
        let topology = declare_topology(&bus, &topology_options(&config).unwrap())
            .await
            .unwrap();
        let deps = OrchestratorDeps {
            bus: Arc::new(bus.clone()),
            sessions: Arc::new(MemorySessionStore::with_prefix(
                config.sessions.key_prefix.clone(),
            )),
            stores: stores.clone(),
            topology: topology.clone(),
            catalog: Arc::new(StoreCatalog::new(stores.resources.clone())),
        };
        Self {
            stores,
            bus,
            topology,
            deps,
            options: Arc::new(OrchestratorOptions::from_config(&config)),
        }
    }
}

/// A restart after a long outage finds more of each kind of left-over work than one
/// page holds: every piece is recovered once, in log and ledger order, across
/// workspaces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_pages_through_everything_an_outage_left() {
    use sb_store::{EventStatusUpdate, NewEvent, NewRun};

    let Recovering {
        stores,
        bus,
        topology,
        deps,
        options,
    } = Recovering::new().await;

    let workspaces = [
        WorkspaceId::default_workspace(),
        WorkspaceId::new("other").unwrap(),
    ];
    let append = |i: usize, status: EventStatus| {
        let mut event = NewEvent::new(workspaces[i % 2].clone(), "message.received", "api");
        event.conversation_id = Some(format!("c{i}"));
        event.status = status;
        let stores = stores.clone();
        async move { stores.events.append(event, Vec::new()).await.unwrap().0 }
    };
    let run_for = |event: &EventRecord| {
        let run = NewRun {
            id: None,
            workspace_id: event.workspace_id.clone(),
            event_id: event.id,
            agent_id: None,
            runner_id: crate::builtin::ECHO_RUNNER_ID.into(),
            pool: "default".into(),
            conversation_id: event.conversation_id.clone(),
            thread_id: None,
            bot_id: None,
            deadline_at: None,
            attempt: 1,
        };
        let stores = stores.clone();
        async move { stores.runs.create_run(run).await.unwrap().0 }
    };
    let dispatch = |event: &EventRecord, run: RunId| {
        let update = EventStatusUpdate {
            run_id: Some(run),
            ..EventStatusUpdate::status(EventStatus::Dispatched)
        };
        let (stores, id) = (stores.clone(), event.id);
        async move { stores.events.update_status(id, update).await.unwrap() }
    };

    let more_than_a_page = usize::try_from(RECOVERY_PAGE).unwrap() + 1;
    let (mut never_routed, mut never_started, mut running) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..more_than_a_page {
        never_routed.push(append(i, EventStatus::Received).await.id);

        let event = append(i, EventStatus::Received).await;
        let run = run_for(&event).await;
        dispatch(&event, run.id).await;
        never_started.push(event.id);

        let event = append(i, EventStatus::Received).await;
        let run = run_for(&event).await;
        dispatch(&event, run.id).await;
        assert!(stores.runs.claim_run(run.id, "gone").await.unwrap());
        running.push(run.id);
    }
    // A run created just before the crash, its event not yet marked dispatched: the
    // event is published once, as a received one.
    run_for(&stores.events.get(never_routed[3]).await.unwrap().unwrap()).await;
    // Work that ended, or was never going to run, stays as it is.
    append(0, EventStatus::Unrouted).await;
    let event = append(1, EventStatus::Received).await;
    let done = run_for(&event).await;
    dispatch(&event, done.id).await;
    stores
        .runs
        .finish_run(done.id, RunOutcome::completed())
        .await
        .unwrap();

    let report = recover(&deps, &options).await.unwrap();
    let expected: Vec<EventId> = never_routed.into_iter().chain(never_started).collect();
    // Counts first: a paging mistake shows as a short (or long) list.
    assert_eq!(report.interrupted.len(), running.len());
    assert_eq!(report.republished.len(), expected.len());
    assert_eq!(report.interrupted, running);
    assert_eq!(report.republished, expected);
    assert_eq!(Backlog::of(&topology).count(&bus), expected.len());
    for run_id in running {
        let run = stores.runs.get_run(run_id).await.unwrap().unwrap();
        assert_eq!(run.status, RunStatus::Interrupted);
        assert_eq!(run.error_code.as_deref(), Some(run_failure::INTERRUPTED));
    }
    let done = stores.runs.get_run(done.id).await.unwrap().unwrap();
    assert_eq!(done.status, RunStatus::Completed);
}

/// Issue 15 findings 4 and 6: the recovery ends each run it finds `running` with exactly
/// one terminal item, stored with the status: its own, if the previous process stored it
/// before the crash (the run ends with the runner's outcome), else `interrupted` after its
/// last item.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_ends_each_run_with_exactly_one_terminal_item() {
    use sb_store::{EventStatusUpdate, NewEvent, NewRun, NewRunEvent};

    let Recovering {
        stores,
        deps,
        options,
        ..
    } = Recovering::new().await;
    let mut runs = Vec::new();
    for _ in 0..2 {
        let event = NewEvent::new(WorkspaceId::default_workspace(), "message.received", "api");
        let event = stores.events.append(event, Vec::new()).await.unwrap().0;
        let run = NewRun {
            id: None,
            workspace_id: event.workspace_id.clone(),
            event_id: event.id,
            agent_id: None,
            runner_id: crate::builtin::ECHO_RUNNER_ID.into(),
            pool: "default".into(),
            conversation_id: None,
            thread_id: None,
            bot_id: None,
            deadline_at: None,
            attempt: 1,
        };
        let run = stores.runs.create_run(run).await.unwrap().0;
        let update = EventStatusUpdate {
            run_id: Some(run.id),
            ..EventStatusUpdate::status(EventStatus::Dispatched)
        };
        stores.events.update_status(event.id, update).await.unwrap();
        assert!(stores.runs.claim_run(run.id, "gone").await.unwrap());
        runs.push(run.id);
    }
    let item = |run_id, sequence, result_type: &str| NewRunEvent {
        run_id,
        sequence,
        result_type: result_type.to_owned(),
        data: serde_json::json!({"type": result_type, "data": {}}).into(),
        ends_run: None,
        transcript: None,
    };
    let (partial, finished) = (runs[0], runs[1]);
    stores
        .runs
        .insert_event(item(partial, 1, "message.delta"))
        .await
        .unwrap();
    stores
        .runs
        .insert_event(item(finished, 1, "run.completed"))
        .await
        .unwrap();

    recover(&deps, &options).await.unwrap();

    let types = |run_id| {
        let stores = stores.clone();
        async move {
            stores
                .runs
                .events_after(run_id, 0, 100)
                .await
                .unwrap()
                .into_iter()
                .map(|e| (e.sequence, e.result_type))
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        types(partial).await,
        [
            (1, "message.delta".to_owned()),
            (2, "run.failed".to_owned())
        ]
    );
    let run = stores.runs.get_run(partial).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Interrupted);
    assert_eq!(types(finished).await, [(1, "run.completed".to_owned())]);
    let run = stores.runs.get_run(finished).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Completed, "the runner's own outcome");
}

#[tokio::test]
async fn start_refuses_a_triggered_shutdown_and_a_taken_port() {
    let shutdown = Shutdown::new();
    shutdown.trigger();
    let config = sb_common::config::ConfigLoader::new()
        .without_file()
        .set("database.url", "sqlite::memory:")
        .load()
        .unwrap();
    assert!(matches!(
        start(config.clone(), shutdown).await,
        Err(StartError::Shutdown(_))
    ));

    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut config = config;
    config.gateway.http_addr = taken.local_addr().unwrap();
    let err = start(config, Shutdown::new()).await.unwrap_err();
    assert!(matches!(err, StartError::Listen { .. }), "{err}");
}
