//! The retention task on a real store (SQLite) and session store (memory): what a pass
//! deletes, that it counts it, and that only the lease holder runs a pass.

use std::sync::Arc;

use chrono::{TimeDelta, Utc};
use sb_common::session::SessionStore;
use sb_common::session::memory::MemorySessionStore;
use sb_common::telemetry::{Metrics, names};
use sb_orchestrator::retention::{Retention, RetentionKind, RetentionPolicy};
use sb_protocol::ids::{AgentId, EventId, WorkspaceId};
use sb_store::{ArtifactScope, NewArtifact, NewEvent, NewRun, NewRunEvent, RunOutcome, Stores};
use serde_json::json;

mod support;

async fn stores() -> Stores {
    support::memory_stores().await
}

fn ws() -> WorkspaceId {
    WorkspaceId::new("retention").unwrap()
}

fn deleted(kind: RetentionKind) -> u64 {
    Metrics::global()
        .counter_value(names::RETENTION_DELETED_TOTAL, &[("kind", kind.as_str())])
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_deletes_what_is_past_retention_once_and_counts_it() {
    let stores = stores().await;
    let sessions: Arc<dyn SessionStore> = Arc::new(MemorySessionStore::new());

    // A finished run with two result items, an event, an expiring artifact.
    let (run, _) = stores
        .runs
        .create_run(NewRun {
            id: None,
            workspace_id: ws(),
            event_id: EventId::new(),
            agent_id: Some(AgentId::new()),
            runner_id: "plugin:acme/echo/echo".into(),
            pool: "default".into(),
            conversation_id: Some("c".into()),
            thread_id: None,
            bot_id: None,
            deadline_at: None,
            attempt: 1,
        })
        .await
        .unwrap();
    for sequence in 1..=2 {
        stores
            .runs
            .insert_event(NewRunEvent {
                run_id: run.id,
                sequence,
                result_type: "message.delta".into(),
                data: json!({"type": "message.delta", "data": {"chunk": "x"}}).into(),
                ends_run: None,
                transcript: None,
            })
            .await
            .unwrap();
    }
    assert!(
        stores
            .runs
            .finish_run(run.id, RunOutcome::completed())
            .await
            .unwrap()
    );
    stores
        .events
        .append(NewEvent::new(ws(), "message.received", "api"), vec![])
        .await
        .unwrap();
    let mut artifact =
        NewArtifact::inline(ws(), "file", "api", ArtifactScope::Workspace, b"x".to_vec());
    artifact.expires_at = Some(Utc::now() + TimeDelta::seconds(1));
    let artifact = stores.artifacts.put(artifact).await.unwrap();

    let policy = RetentionPolicy {
        batch_size: 1,
        ..RetentionPolicy::default()
    };
    let first = Retention::new(
        stores.clone(),
        Arc::clone(&sessions),
        policy.clone(),
        "orchestrator-a",
    );
    let second = Retention::new(
        stores.clone(),
        Arc::clone(&sessions),
        policy,
        "orchestrator-b",
    );

    // Now nothing is old enough.
    let report = first.pass(Utc::now()).await.unwrap().expect("holder");
    assert!(report.deleted.iter().all(|(_, n)| *n == 0), "{report:?}");
    // Another orchestrator does not run a pass while the first holds the lease.
    assert_eq!(second.pass(Utc::now()).await.unwrap(), None);

    // 31 days later: the run's items, the event and the artifact are gone.
    let before = [
        deleted(RetentionKind::RunResults),
        deleted(RetentionKind::EventLog),
        deleted(RetentionKind::Artifacts),
    ];
    let later = Utc::now() + TimeDelta::days(31);
    let report = first.pass(later).await.unwrap().expect("holder");
    assert_eq!(report.of(RetentionKind::RunResults), 1, "{report:?}");
    assert_eq!(report.of(RetentionKind::EventLog), 1, "{report:?}");
    assert_eq!(report.of(RetentionKind::Artifacts), 1, "{report:?}");
    let after = [
        deleted(RetentionKind::RunResults),
        deleted(RetentionKind::EventLog),
        deleted(RetentionKind::Artifacts),
    ];
    for (b, a) in before.iter().zip(after) {
        assert!(a > *b, "counted: {before:?} → {after:?}");
    }
    let stored = stores.runs.get_run(run.id).await.unwrap().unwrap();
    assert!(stored.events_expired_at.is_some());
    assert!(
        stores
            .runs
            .events_after(run.id, 0, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(stores.artifacts.metadata(&artifact.id).await.is_err());

    // Deletes are idempotent: a second pass finds nothing.
    let report = first.pass(later).await.unwrap().expect("holder");
    assert!(report.deleted.iter().all(|(_, n)| *n == 0), "{report:?}");

    // When the holder lets go (it died: its lease expired), another one takes over.
    sessions
        .release_lease(sb_orchestrator::retention::LEASE_KEY, "orchestrator-a")
        .await
        .unwrap();
    assert!(second.pass(later).await.unwrap().is_some());
    assert_eq!(first.pass(later).await.unwrap(), None);
}
