//! The one finalize against a real SQLite ledger and the in-process session store: the
//! terminal item and status in one commit, the session's end with its steering audited, the
//! hand-over last, and exactly one terminal item whatever finalizes the run next.

use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use sb_common::session::memory::MemorySessionStore;
use sb_common::session::{SessionStore, run_handed_off_key, run_lease_key};
use sb_lifecycle::{Ended, FinalizeError, Finalizer, HandOver, Origin, RunRef, SessionEnd};
use sb_protocol::result::AgentRunResult;
use sb_store::testing::{TestDb, sqlite_memory_db, suite::create_run};
use sb_store::{EventQuery, NewRunEvent, RunOutcome, RunRecord, RunStatus, audit};
use serde_json::json;

const TTL: Duration = Duration::from_secs(60);

/// Records what it was handed; fails when told to.
#[derive(Default)]
struct Recorder {
    handed: Mutex<Vec<(u64, AgentRunResult, Origin)>>,
    fail: bool,
}

#[async_trait]
impl HandOver for Recorder {
    type Error = &'static str;

    async fn hand_over(
        &self,
        sequence: u64,
        item: AgentRunResult,
        origin: Origin,
    ) -> Result<(), &'static str> {
        self.handed.lock().unwrap().push((sequence, item, origin));
        if self.fail { Err("bus down") } else { Ok(()) }
    }
}

fn interrupted() -> (RunOutcome, AgentRunResult) {
    (
        RunOutcome::with_error(RunStatus::Interrupted, "interrupted", "worker lost"),
        AgentRunResult::run_failed("interrupted", "worker lost", true),
    )
}

fn run_ref(run: &RunRecord) -> RunRef<'_> {
    RunRef {
        run_id: run.id,
        runner_id: &run.runner_id,
        workspace_id: &run.workspace_id,
    }
}

/// Stores an item of `run` as its worker's result sink would (no side effects).
async fn store_item(db: &TestDb, run: &RunRecord, sequence: i64, result_type: &str) {
    let stored = db
        .stores
        .runs
        .insert_event(NewRunEvent {
            run_id: run.id,
            sequence,
            result_type: result_type.to_owned(),
            data: json!({"type": result_type, "data": {}}).into(),
            ends_run: None,
            transcript: None,
        })
        .await
        .unwrap();
    assert!(stored, "item {sequence} is new");
}

/// A claimed (running) run with one streamed item, a session and two unpulled steering items.
async fn running_run(db: &TestDb, sessions: &MemorySessionStore) -> RunRecord {
    let run = create_run(db, None).await;
    assert!(db.stores.runs.claim_run(run.id, "w1").await.unwrap());
    store_item(db, &run, 1, "message.delta").await;
    sessions
        .put_session(&run.id, &json!({"run_id": run.id}), TTL)
        .await
        .unwrap();
    for n in 0..2 {
        let item = json!({"event": {"event_id": format!("ev_{n}")}, "input": {"text": "more"}});
        sessions.steering_push(&run.id, &item, 10).await.unwrap();
    }
    run
}

async fn dropped_rows(db: &TestDb, run: &RunRecord) -> usize {
    let mut query = EventQuery::new(run.workspace_id.clone());
    query.event_types = vec![audit::STEERING_DROPPED.to_owned()];
    db.stores.events.page(query).await.unwrap().items.len()
}

fn finalizer<'a>(db: &'a TestDb, sessions: &'a MemorySessionStore) -> Finalizer<'a> {
    Finalizer {
        ledger: db.stores.runs.as_ref(),
        events: db.stores.events.as_ref(),
        sessions,
    }
}

#[tokio::test]
async fn a_host_made_item_ends_the_run_once_and_its_session_with_the_steering_audited() {
    let db = sqlite_memory_db().await;
    let sessions = MemorySessionStore::new();
    let run = running_run(&db, &sessions).await;
    let recorder = Recorder::default();
    let (outcome, item) = interrupted();

    let ended = finalizer(&db, &sessions)
        .finalize(run_ref(&run), outcome, item, SessionEnd::Host, &recorder)
        .await
        .unwrap();
    assert_eq!(
        ended,
        Some(Ended {
            sequence: 2,
            origin: Origin::HostMade,
            session_answered: true
        })
    );
    let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(stored.status, RunStatus::Interrupted);
    assert!(sessions.get_session(&run.id).await.unwrap().is_none());
    assert_eq!(dropped_rows(&db, &run).await, 2);
    {
        let handed = recorder.handed.lock().unwrap();
        assert_eq!(handed.len(), 1);
        let (sequence, item, origin) = &handed[0];
        assert_eq!((*sequence, *origin), (2, Origin::HostMade));
        // The envelope names the run and the sequence the ledger gave the item.
        assert_eq!(item.run_id, run.id.to_string());
        assert_eq!(item.sequence, Some(2));
    }

    // Whoever finalizes it next finds it ended: nothing stored, nothing handed over.
    let (outcome, item) = interrupted();
    let again = finalizer(&db, &sessions)
        .finalize(run_ref(&run), outcome, item, SessionEnd::Host, &recorder)
        .await
        .unwrap();
    assert_eq!(again, None);
    assert_eq!(recorder.handed.lock().unwrap().len(), 1);
    assert_eq!(stored_count(&db, &run).await, 2);
}

#[tokio::test]
async fn a_stored_terminal_item_ends_the_run_instead_of_a_host_made_one() {
    let db = sqlite_memory_db().await;
    let sessions = MemorySessionStore::new();
    let run = running_run(&db, &sessions).await;
    store_item(&db, &run, 2, "run.completed").await;
    let recorder = Recorder::default();
    let (outcome, item) = interrupted();

    let ended = finalizer(&db, &sessions)
        .finalize(run_ref(&run), outcome, item, SessionEnd::Host, &recorder)
        .await
        .unwrap()
        .expect("the stored item ends the run");
    assert_eq!((ended.sequence, ended.origin), (2, Origin::Stored));
    let (_, item, _) = recorder.handed.lock().unwrap()[0].clone();
    assert_eq!(item.result_type.as_str(), "run.completed");
    assert_eq!(item.sequence, Some(2));
    // The hand-over applies it; the ledger holds it once and nothing after it.
    assert_eq!(stored_count(&db, &run).await, 2);
    assert!(sessions.get_session(&run.id).await.unwrap().is_none());
}

#[tokio::test]
async fn a_holder_releases_its_lease_and_marks_the_run_handed_off() {
    let db = sqlite_memory_db().await;
    let sessions = MemorySessionStore::new();
    let run = running_run(&db, &sessions).await;
    let lease = run_lease_key(&run.id);
    assert!(sessions.acquire_lease(&lease, "w1", TTL).await.unwrap());
    let recorder = Recorder::default();
    let (outcome, item) = interrupted();
    let how = SessionEnd::Holder {
        holder: "w1",
        handed_off_ttl: TTL,
    };

    let ended = finalizer(&db, &sessions)
        .finalize(run_ref(&run), outcome, item, how, &recorder)
        .await
        .unwrap()
        .expect("ended");
    assert!(ended.session_answered);
    assert_eq!(sessions.lease_holder(&lease).await.unwrap(), None);
    assert!(
        sessions
            .get(&run_handed_off_key(&run.id))
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(dropped_rows(&db, &run).await, 2);
}

#[tokio::test]
async fn a_failed_hand_over_leaves_the_run_ended_for_a_retry_to_hand_over_again() {
    let db = sqlite_memory_db().await;
    let sessions = MemorySessionStore::new();
    let run = running_run(&db, &sessions).await;
    let failing = Recorder {
        fail: true,
        ..Recorder::default()
    };
    let (outcome, item) = interrupted();

    let error = finalizer(&db, &sessions)
        .finalize(run_ref(&run), outcome, item, SessionEnd::Host, &failing)
        .await
        .unwrap_err();
    let FinalizeError::HandOver { ended, error } = error else {
        panic!("expected a hand-over failure");
    };
    assert_eq!(error, "bus down");
    assert_eq!((ended.sequence, ended.origin), (2, Origin::HostMade));
    // Stored and ended: the ledger is the truth the next reader (or redelivery) starts from.
    let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(stored.status, RunStatus::Interrupted);
}

/// How many items the ledger holds for `run`.
async fn stored_count(db: &TestDb, run: &RunRecord) -> usize {
    db.stores
        .runs
        .events_after(run.id, 0, 10)
        .await
        .unwrap()
        .len()
}
