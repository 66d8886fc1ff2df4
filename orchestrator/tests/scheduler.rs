//! The scheduler against a real database: schedulers of several orchestrators racing on the
//! same due schedules fire each fire time exactly once.

use std::collections::BTreeSet;
use std::sync::Arc;

use chrono::Utc;
use sb_common::bus::memory::MemoryBus;
use sb_common::bus::topology::TopologyOptions;
use sb_common::session::memory::MemorySessionStore;
use sb_orchestrator::OrchestratorOptions;
use sb_orchestrator::scheduler::Scheduler;
use sb_protocol::host::AgentEventEnvelope;
use sb_protocol::ids::{EventId, WorkspaceId};
use sb_store::{EventQuery, NewSchedule, ScheduleKind, ScheduledEvent};
use serde_json::json;

mod support;

/// A SQLite file (pooled connections, so the schedulers really run concurrently), removed
/// when dropped.
struct TempDb(std::path::PathBuf);

impl Drop for TempDb {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut path = self.0.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
}

fn template(conversation: &str) -> serde_json::Value {
    let envelope: AgentEventEnvelope = serde_json::from_value(json!({
        "event_id": EventId::new(),
        "workspace_id": "default",
        "event_type": "message.received",
        "source": "scheduler",
        "conversation_id": conversation,
        "input": {"text": "tick", "contents": [{"type": "text", "text": "tick"}]},
        "delivery": {"surface": "api"}
    }))
    .unwrap();
    serde_json::to_value(ScheduledEvent {
        request: json!({}),
        envelope,
        input_summary: "tick".into(),
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_schedulers_fire_each_due_schedule_once() {
    let db = TempDb(std::env::temp_dir().join(format!("sb-sched-{}.db", uuid::Uuid::new_v4())));
    let stores = support::sqlite_stores(&format!("sqlite://{}?mode=rwc", db.0.display())).await;
    let bus = Arc::new(MemoryBus::new());
    let topology = support::declare(
        bus.as_ref(),
        &TopologyOptions {
            name_prefix: support::unique_name_prefix(),
            ..TopologyOptions::default()
        },
    )
    .await;
    let deps = support::deps(
        bus,
        Arc::new(MemorySessionStore::new()),
        stores.clone(),
        topology,
    );
    let ws = WorkspaceId::default_workspace();
    let mut schedules = BTreeSet::new();
    for i in 0..12 {
        let created = stores
            .schedules
            .create(NewSchedule {
                workspace_id: ws.clone(),
                name: None,
                kind: ScheduleKind::Once,
                spec: "2020-01-01T00:00:00Z".into(),
                event: template(&format!("c{i}")),
                enabled: true,
            })
            .await
            .unwrap();
        schedules.insert(created.id);
    }
    // Not due: never fired.
    stores
        .schedules
        .create(NewSchedule {
            workspace_id: ws.clone(),
            name: None,
            kind: ScheduleKind::Interval,
            spec: "1h".into(),
            event: template("later"),
            enabled: true,
        })
        .await
        .unwrap();

    let options = Arc::new(OrchestratorOptions::default());
    let first = Scheduler::new(deps.clone(), Arc::clone(&options));
    let second = Scheduler::new(deps.clone(), Arc::clone(&options));
    let (a, b) = tokio::join!(first.fire_due(), second.fire_due());
    let (a, b) = (a.unwrap(), b.unwrap());
    let fired: BTreeSet<EventId> = a.iter().chain(&b).copied().collect();
    assert_eq!(
        a.len() + b.len(),
        12,
        "each schedule fired once: {a:?} {b:?}"
    );
    assert_eq!(fired.len(), 12);

    // One event per schedule in the log, each announced once.
    let mut query = EventQuery::new(ws.clone());
    query.limit = Some(100);
    let events = stores.events.page(query).await.unwrap().items;
    assert_eq!(events.len(), 12);
    let fired_schedules: BTreeSet<uuid::Uuid> = events
        .iter()
        .map(|e| e.metadata["schedule_id"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(fired_schedules, schedules);
    let outbox = stores
        .outbox
        .claim(100, std::time::Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(outbox.len(), 12);

    // Nothing is due any more: the one-shots are disabled, the interval is in an hour.
    assert!(first.fire_due().await.unwrap().is_empty());
    assert!(
        stores
            .schedules
            .due(Utc::now(), 100)
            .await
            .unwrap()
            .is_empty()
    );
}
