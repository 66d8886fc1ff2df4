//! Retention's store methods that the conformance suite does not cover, on SQLite and
//! PostgreSQL: the turn identities of closed sessions (`TurnStore::delete_closed_identities`)
//! and the bounded batches of result expiry (`RunLedger::expire_events`) that the
//! orchestrator's retention task drains.

use chrono::{TimeDelta, Utc};
use sb_protocol::ids::{AgentId, EventId, RunId, WorkspaceId};
use sb_store::testing::{TestDb, postgres_db, sqlite_file_db, sqlite_memory_db};
use sb_store::{NewEvent, NewRun, NewRunEvent, NewTurn, NewTurnSession, RunOutcome};
use serde_json::json;
use uuid::Uuid;

fn ws() -> WorkspaceId {
    WorkspaceId::new("retention").unwrap()
}

async fn session(db: &TestDb) -> Uuid {
    db.stores
        .turns
        .create_session(NewTurnSession {
            workspace_id: ws(),
            agent_id: AgentId::new(),
            runner_id: "plugin:acme/echo/default".into(),
            metadata: None,
        })
        .await
        .unwrap()
        .id
}

/// Starts turn `key` in `session`; returns its id.
async fn turn(db: &TestDb, session: Uuid, key: &str) -> RunId {
    let mut event = NewEvent::new(ws(), "message.received", "api");
    event.id = Some(EventId::new());
    event.conversation_id = Some(sb_store::session_conversation_id(session));
    let run_id = RunId::new();
    db.stores
        .turns
        .start_turn(NewTurn {
            session_id: session,
            idempotency_key: key.into(),
            request_hash: "a".repeat(64),
            run_id,
            event,
            outbox: vec![],
        })
        .await
        .unwrap();
    run_id
}

async fn closed_session_identities(db: TestDb) {
    let turns = &db.stores.turns;
    let open = session(&db).await;
    let closed = session(&db).await;
    let kept = turn(&db, open, "k").await;
    let mut gone = Vec::new();
    for key in ["k1", "k2", "k3"] {
        gone.push(turn(&db, closed, key).await);
    }
    turns.close_session(&ws(), closed).await.unwrap();

    // Closed just now: a cutoff before the close keeps everything.
    let before_close = Utc::now() - TimeDelta::hours(1);
    assert_eq!(
        turns
            .delete_closed_identities(before_close, 10)
            .await
            .unwrap(),
        0
    );
    // Later: the closed session's identities go in batches, the open one's stay.
    let later = Utc::now() + TimeDelta::days(8);
    assert_eq!(turns.delete_closed_identities(later, 2).await.unwrap(), 2);
    assert_eq!(turns.delete_closed_identities(later, 2).await.unwrap(), 1);
    assert_eq!(turns.delete_closed_identities(later, 2).await.unwrap(), 0);
    for run_id in gone {
        assert!(turns.get_turn(run_id).await.unwrap().is_none());
    }
    assert!(turns.get_turn(kept).await.unwrap().is_some());
    // The sessions themselves stay readable.
    assert!(turns.get_session(&ws(), closed).await.unwrap().is_some());
}

async fn result_expiry_in_batches(db: TestDb) {
    let runs = &db.stores.runs;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let (run, _) = runs
            .create_run(NewRun {
                id: None,
                workspace_id: ws(),
                event_id: EventId::new(),
                agent_id: None,
                runner_id: "plugin:acme/echo/default".into(),
                pool: "default".into(),
                conversation_id: None,
                thread_id: None,
                bot_id: None,
                deadline_at: None,
                attempt: 1,
            })
            .await
            .unwrap();
        runs.insert_event(NewRunEvent {
            run_id: run.id,
            sequence: 1,
            result_type: "run.completed".into(),
            data: json!({"type": "run.completed", "data": {}}).into(),
            ends_run: None,
            transcript: None,
        })
        .await
        .unwrap();
        assert!(
            runs.finish_run(run.id, RunOutcome::completed())
                .await
                .unwrap()
        );
        ids.push(run.id);
    }
    let later = Utc::now() + TimeDelta::days(2);
    assert_eq!(runs.expire_events(later, 2).await.unwrap(), 2);
    assert_eq!(runs.expire_events(later, 2).await.unwrap(), 1);
    assert_eq!(runs.expire_events(later, 2).await.unwrap(), 0);
    for id in ids {
        let run = runs.get_run(id).await.unwrap().unwrap();
        assert!(run.events_expired_at.is_some());
        assert!(runs.events_after(id, 0, 10).await.unwrap().is_empty());
    }
}

macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {
        mod sqlite_file {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::sqlite_file_db().await).await; })*
        }
        mod sqlite_memory {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::sqlite_memory_db().await).await; })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::postgres_db().await).await; })*
        }
    };
}

on_every_backend!(closed_session_identities, result_expiry_in_batches);
