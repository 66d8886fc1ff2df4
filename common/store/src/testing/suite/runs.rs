//! Run ledger contract tests on the run records: creation per event, claims, terminal
//! states, cancellation, listings, reading one status across workspaces, deadlines.

use chrono::{TimeDelta, Utc};
use sb_protocol::error::ErrorCode;
use sb_protocol::ids::{EventId, RunId};
use serde_json::json;

use super::{assert_code, create_run, message, new_run, other_ws, transcript_rows, ws};
use crate::testing::TestDb;
use crate::*;

/// One event has one run; a redelivered event gets the same run back.
pub async fn run_create_is_idempotent_on_event(db: &TestDb) {
    let mut new = new_run(Some("c1"));
    new.deadline_at = Some(Utc::now() + TimeDelta::seconds(300));
    let (run, created) = db.stores.runs.create_run(new.clone()).await.unwrap();
    assert!(created);
    assert_eq!(run.status, RunStatus::Queued);
    assert_eq!(run.last_sequence, 0);
    assert_eq!(run.attempt, 1);
    assert_eq!(run.event_id, new.event_id);
    assert_eq!(run.conversation_id.as_deref(), Some("c1"));
    assert_eq!(run.runner_id, "plugin:acme/echo/echo");
    let (again, created) = db.stores.runs.create_run(new.clone()).await.unwrap();
    assert!(!created);
    assert_eq!(again, run);
    assert_eq!(db.stores.runs.get_run(run.id).await.unwrap().unwrap(), run);
    assert!(
        db.stores
            .runs
            .get_run(RunId::new())
            .await
            .unwrap()
            .is_none()
    );

    // Reusing the run id for another event is a conflict.
    let mut clash = new_run(Some("c1"));
    clash.id = Some(run.id);
    assert_code(db.stores.runs.create_run(clash).await, ErrorCode::Conflict);
}

/// A stored message event of conversation `c1`.
async fn appended(db: &TestDb, text: &str) -> EventRecord {
    let (event, _) = db
        .stores
        .events
        .append(message("c1", text), Vec::new())
        .await
        .unwrap();
    event
}

/// The latest transcript cursor of conversation `c1`.
async fn c1_cursor(db: &TestDb) -> Option<String> {
    db.stores
        .transcript
        .latest_cursor(&ws(), "c1")
        .await
        .unwrap()
}

/// The start of run `id` for event `event_id` of conversation `c1` with its user row `text`.
fn run_start(event_id: EventId, id: RunId, text: &str) -> RunStart {
    let mut run = new_run(Some("c1"));
    run.id = Some(id);
    run.event_id = event_id;
    let mut row = NewTranscriptItem::message(ws(), "c1", event_id.to_string(), "user", text);
    row.id = Some(format!("{event_id}:user"));
    RunStart {
        run,
        user_transcript: Some(row),
        event: EventStatusUpdate {
            status: EventStatus::Dispatched,
            reason: None,
            run_id: Some(id),
            claimed_by_run_id: None,
            metadata_merge: None,
        },
        reads: StartReads::default(),
    }
}

/// `start_run` writes the run, the user transcript row and the event's dispatch in one
/// commit; for an event that has a run already, or that does not exist, it writes nothing.
pub async fn run_start_writes_the_run_the_user_row_and_the_dispatch_at_once(db: &TestDb) {
    let event = appended(db, "hello").await;
    // Metadata and a reason the start's update must merge with and keep.
    let mut earlier = EventStatusUpdate::status(EventStatus::Received);
    earlier.reason = Some("queued behind another".into());
    earlier.metadata_merge = Some(json!({"keep": 1, "gone": 2}));
    db.stores
        .events
        .update_status(event.id, earlier)
        .await
        .unwrap();
    let start = |id: RunId| {
        let mut start = run_start(event.id, id, "hello");
        start.event.metadata_merge = Some(json!({"routing": {"pool": "default"}, "gone": null}));
        start
    };

    let id = RunId::new();
    let run = db
        .stores
        .runs
        .start_run(start(id))
        .await
        .unwrap()
        .unwrap()
        .run;
    assert_eq!((run.id, run.event_id), (id, event.id));
    assert_eq!(run.status, RunStatus::Queued);
    assert_eq!(db.stores.runs.get_run(id).await.unwrap().unwrap(), run);
    let stored = db.stores.events.get(event.id).await.unwrap().unwrap();
    assert_eq!(stored.status, EventStatus::Dispatched);
    assert_eq!(stored.run_id, Some(id));
    assert_eq!(stored.reason.as_deref(), Some("queued behind another"));
    assert_eq!(
        stored.metadata,
        json!({"keep": 1, "routing": {"pool": "default"}})
    );
    let rows = transcript_rows(db, "c1").await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].content.as_deref(), Some("hello"));

    // Again with another id (a redelivery): nothing is written, the first run stays.
    let mut again = start(RunId::new());
    again.event.metadata_merge = Some(json!({"routing": {"pool": "other"}}));
    assert_eq!(db.stores.runs.start_run(again).await.unwrap(), None);
    let stored = db.stores.events.get(event.id).await.unwrap().unwrap();
    assert_eq!(stored.run_id, Some(id));
    assert_eq!(stored.metadata["routing"], json!({"pool": "default"}));
    assert_eq!(transcript_rows(db, "c1").await.len(), 1);
    assert_eq!(
        db.stores.runs.create_run(start(id).run).await.unwrap(),
        (run, false)
    );

    // No such event: `not_found`, and no run.
    let mut orphan = start(RunId::new());
    orphan.run.event_id = EventId::new();
    let orphan_id = orphan.run.id.unwrap();
    assert_code(db.stores.runs.start_run(orphan).await, ErrorCode::NotFound);
    assert!(db.stores.runs.get_run(orphan_id).await.unwrap().is_none());

    // The run id of another event is a conflict; a run without an id is refused.
    let other = appended(db, "again").await;
    let mut clash = start(id);
    clash.run.event_id = other.id;
    clash.user_transcript = None;
    assert_code(db.stores.runs.start_run(clash).await, ErrorCode::Conflict);
    let mut unnamed = start(id);
    unnamed.run.event_id = other.id;
    unnamed.run.id = None;
    assert_code(
        db.stores.runs.start_run(unnamed).await,
        ErrorCode::InvalidArgument,
    );
    assert_eq!(
        db.stores
            .events
            .get(other.id)
            .await
            .unwrap()
            .unwrap()
            .status,
        EventStatus::Received
    );
}

/// A start's reads see the ledger before its writes: the conversation's latest transcript
/// cursor before the event's user row, and every value of each scope asked for (a scope
/// without values is there, empty); nothing is read that was not asked for.
pub async fn run_start_reads_the_cursor_before_its_user_row_and_the_state(db: &TestDb) {
    let earlier = appended(db, "earlier").await;
    let row = NewTranscriptItem::message(ws(), "c1", earlier.id.to_string(), "user", "earlier");
    db.stores.transcript.append(row).await.unwrap();
    let before = c1_cursor(db).await;
    assert!(before.is_some());
    for (key, value) in [("a", json!(1)), ("b", json!({"x": [true]}))] {
        db.stores
            .state
            .set(StateWrite {
                scope_key: "conversation:v2:s1".into(),
                scope: "conversation".into(),
                key: key.into(),
                value,
                if_revision: None,
            })
            .await
            .unwrap();
    }

    let events = [appended(db, "one").await, appended(db, "two").await];
    let mut reading = run_start(events[0].id, RunId::new(), "one");
    reading.reads = StartReads {
        latest_cursor: true,
        state_scopes: vec!["conversation:v2:s1".into(), "actor:v2:none".into()],
    };
    let silent = run_start(events[1].id, RunId::new(), "two");
    let mut answers = db.stores.runs.start_runs(vec![reading, silent]).await;
    let silent = answers.pop().unwrap().unwrap().unwrap();
    let reading = answers.pop().unwrap().unwrap().unwrap();

    assert_eq!(reading.latest_cursor, before);
    assert_eq!(
        reading.state,
        std::collections::BTreeMap::from([
            ("actor:v2:none".to_owned(), Default::default()),
            (
                "conversation:v2:s1".to_owned(),
                std::collections::BTreeMap::from([
                    ("a".to_owned(), json!(1)),
                    ("b".to_owned(), json!({"x": [true]})),
                ]),
            ),
        ])
    );
    assert_eq!((silent.latest_cursor, silent.state.len()), (None, 0));
    // The user rows were written after the reads.
    let after = c1_cursor(db).await;
    assert_ne!(after, before);
    assert_eq!(transcript_rows(db, "c1").await.len(), 3);

    // A start whose user row exists already (an earlier attempt wrote it) keeps that row.
    let again = appended(db, "again").await;
    let mut row = NewTranscriptItem::message(ws(), "c1", again.id.to_string(), "user", "again");
    row.id = Some(format!("{}:user", again.id));
    db.stores.transcript.append(row).await.unwrap();
    let started = db
        .stores
        .runs
        .start_run(run_start(again.id, RunId::new(), "again"))
        .await
        .unwrap();
    assert!(started.is_some());
    assert_eq!(transcript_rows(db, "c1").await.len(), 4);

    // In one batch, each start gets its own reads whatever the others ask: one that reads
    // nothing first, one reading a conversation without rows and a scope, one reading `c1`
    // and scopes it shares with the other.
    let c1_now = c1_cursor(db).await;
    let events = [
        appended(db, "first").await,
        appended(db, "second").await,
        appended(db, "third").await,
    ];
    let silent = run_start(events[0].id, RunId::new(), "first");
    let mut elsewhere = run_start(events[1].id, RunId::new(), "second");
    elsewhere.run.conversation_id = Some("c-empty".into());
    elsewhere.user_transcript = None;
    elsewhere.reads = StartReads {
        latest_cursor: true,
        state_scopes: vec!["actor:v2:none".into()],
    };
    let mut here = run_start(events[2].id, RunId::new(), "third");
    here.reads = StartReads {
        latest_cursor: true,
        state_scopes: vec!["actor:v2:none".into(), "conversation:v2:s1".into()],
    };
    let answers: Vec<_> = db
        .stores
        .runs
        .start_runs(vec![silent, elsewhere, here])
        .await
        .into_iter()
        .map(|answer| answer.unwrap().unwrap())
        .map(|started| (started.latest_cursor, started.state))
        .collect();
    let scope = |values: &[(&str, serde_json::Value)]| {
        values
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    assert_eq!(answers[0], (None, Default::default()));
    assert_eq!(
        answers[1],
        (None, [("actor:v2:none".to_owned(), scope(&[]))].into())
    );
    assert_eq!(
        answers[2],
        (
            c1_now,
            [
                ("actor:v2:none".to_owned(), scope(&[])),
                (
                    "conversation:v2:s1".to_owned(),
                    scope(&[("a", json!(1)), ("b", json!({"x": [true]}))])
                ),
            ]
            .into()
        )
    );

    // A scope key the state store refuses is refused here too, and nothing is written.
    let bad = appended(db, "bad").await;
    let mut refused = run_start(bad.id, RunId::new(), "bad");
    refused.reads.state_scopes = vec![String::new()];
    let refused_id = refused.run.id.unwrap();
    assert_code(
        db.stores.runs.start_run(refused).await,
        ErrorCode::InvalidArgument,
    );
    assert!(db.stores.runs.get_run(refused_id).await.unwrap().is_none());
}

/// `start_runs` starts the runs of several events in one call, each answered as `start_run`
/// would answer it alone: a start that fails (a run id another start of the batch takes, a
/// missing event, a run without an id) fails alone, the others are written.
pub async fn run_starts_of_many_events_fail_alone(db: &TestDb) {
    let mut events = Vec::new();
    for text in ["one", "two", "three", "four"] {
        events.push(appended(db, text).await);
    }
    let start = |event: &EventRecord, id: RunId| run_start(event.id, id, "hi");

    // Two good starts: both written in one call.
    let (a, b) = (RunId::new(), RunId::new());
    let started = db
        .stores
        .runs
        .start_runs(vec![start(&events[0], a), start(&events[1], b)])
        .await;
    let ids: Vec<_> = started
        .into_iter()
        .map(|s| s.unwrap().map(|started| started.run.id))
        .collect();
    assert_eq!(ids, [Some(a), Some(b)]);
    assert_eq!(transcript_rows(db, "c1").await.len(), 2);

    // A mixed batch: a redelivery (nothing written), a clash with `a`'s id, a missing event,
    // a run without an id and a good start, each with its own answer.
    let mut orphan = start(&events[2], RunId::new());
    orphan.run.event_id = EventId::new();
    let orphan_id = orphan.run.id.unwrap();
    let mut unnamed = start(&events[2], RunId::new());
    unnamed.run.id = None;
    let c = RunId::new();
    let answers = db
        .stores
        .runs
        .start_runs(vec![
            start(&events[0], RunId::new()),
            start(&events[3], a),
            orphan,
            unnamed,
            start(&events[2], c),
        ])
        .await;
    let mut answers = answers.into_iter();
    assert_eq!(answers.next().unwrap().unwrap(), None);
    assert_code(answers.next().unwrap(), ErrorCode::Conflict);
    assert_code(answers.next().unwrap(), ErrorCode::NotFound);
    assert_code(answers.next().unwrap(), ErrorCode::InvalidArgument);
    assert_eq!(
        answers
            .next()
            .unwrap()
            .unwrap()
            .map(|started| started.run.id),
        Some(c)
    );
    assert!(answers.next().is_none());
    assert!(db.stores.runs.get_run(orphan_id).await.unwrap().is_none());
    for (event, run) in events.iter().zip([a, b, c]) {
        let stored = db.stores.events.get(event.id).await.unwrap().unwrap();
        assert_eq!(stored.status, EventStatus::Dispatched);
        assert_eq!(stored.run_id, Some(run));
    }
    assert_eq!(transcript_rows(db, "c1").await.len(), 3);
    let clashed = db.stores.events.get(events[3].id).await.unwrap().unwrap();
    assert_eq!(
        (clashed.status, clashed.run_id),
        (EventStatus::Received, None)
    );
    assert!(db.stores.runs.start_runs(Vec::new()).await.is_empty());
}

/// `claim_runs` claims several runs in one call: only those still queued, once.
pub async fn run_claims_of_many_runs_at_once(db: &TestDb) {
    let (a, b, c) = (
        create_run(db, None).await.id,
        create_run(db, None).await.id,
        create_run(db, None).await.id,
    );
    let claimed = db.stores.runs.claim_runs(&[a, b], "w1").await.unwrap();
    assert_eq!(claimed, [a, b].into_iter().collect());
    let claimed = db
        .stores
        .runs
        .claim_runs(&[a, c, RunId::new()], "w2")
        .await
        .unwrap();
    assert_eq!(claimed, [c].into_iter().collect());
    for (run, worker) in [(a, "w1"), (b, "w1"), (c, "w2")] {
        let stored = db.stores.runs.get_run(run).await.unwrap().unwrap();
        assert_eq!(stored.status, RunStatus::Running);
        assert_eq!(stored.worker_id.as_deref(), Some(worker));
    }
    assert!(
        db.stores
            .runs
            .claim_runs(&[], "w1")
            .await
            .unwrap()
            .is_empty()
    );
    assert_code(
        db.stores.runs.claim_runs(&[a], "").await,
        ErrorCode::InvalidArgument,
    );
}

/// Among many concurrent claimers exactly one wins.
pub async fn run_claim_race_has_exactly_one_winner(db: &TestDb) {
    let run = create_run(db, Some("c1")).await;
    let mut tasks = Vec::new();
    for i in 0..16 {
        let stores = db.stores.clone();
        tasks.push(tokio::spawn(async move {
            let worker = format!("worker-{i}");
            let won = stores.runs.claim_run(run.id, &worker).await.unwrap();
            (worker, won)
        }));
    }
    let mut winners = Vec::new();
    for task in tasks {
        let (worker, won) = task.await.unwrap();
        if won {
            winners.push(worker);
        }
    }
    assert_eq!(winners.len(), 1);
    let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(stored.status, RunStatus::Running);
    assert_eq!(stored.worker_id.as_deref(), Some(winners[0].as_str()));
    assert!(stored.started_at.is_some());
    assert!(!db.stores.runs.claim_run(RunId::new(), "w").await.unwrap());
}

/// Terminal states never change.
pub async fn run_terminal_states_are_final(db: &TestDb) {
    let run = create_run(db, None).await;
    assert!(db.stores.runs.claim_run(run.id, "w1").await.unwrap());
    let mut done = RunOutcome::completed();
    done.usage = Some(json!({"tokens": 3}));
    assert!(db.stores.runs.finish_run(run.id, done).await.unwrap());
    let failed = RunOutcome::with_error(RunStatus::Failed, "runtime_error", "late");
    assert!(!db.stores.runs.finish_run(run.id, failed).await.unwrap());
    assert!(!db.stores.runs.claim_run(run.id, "w2").await.unwrap());
    let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(stored.status, RunStatus::Completed);
    assert_eq!(stored.error_code, None);
    assert_eq!(stored.usage, Some(json!({"tokens": 3})));
    assert!(stored.ended_at.is_some());
    assert_eq!(stored.worker_id.as_deref(), Some("w1"));

    // A queued run can end without ever running (cancel before start, reaper).
    let queued = create_run(db, None).await;
    let cancelled = RunOutcome::with_error(RunStatus::Cancelled, "cancelled", "user");
    assert!(
        db.stores
            .runs
            .finish_run(queued.id, cancelled)
            .await
            .unwrap()
    );
    let stored = db.stores.runs.get_run(queued.id).await.unwrap().unwrap();
    assert_eq!(stored.status, RunStatus::Cancelled);
    assert_eq!(stored.error_code.as_deref(), Some("cancelled"));
    assert_eq!(stored.error_message.as_deref(), Some("user"));
    assert!(!db.stores.runs.claim_run(queued.id, "w").await.unwrap());

    let not_terminal = RunOutcome {
        status: RunStatus::Running,
        ..RunOutcome::completed()
    };
    assert_code(
        db.stores.runs.finish_run(run.id, not_terminal).await,
        ErrorCode::InvalidArgument,
    );
}

/// Concurrent finishers: the first wins, the others change nothing.
pub async fn run_finish_race_has_exactly_one_winner(db: &TestDb) {
    let run = create_run(db, None).await;
    let statuses = [
        RunStatus::Completed,
        RunStatus::Failed,
        RunStatus::Cancelled,
        RunStatus::Timeout,
        RunStatus::Interrupted,
    ];
    let mut tasks = Vec::new();
    for status in statuses {
        let stores = db.stores.clone();
        tasks.push(tokio::spawn(async move {
            let outcome = RunOutcome::with_error(status, status.as_str(), "race");
            (
                status,
                stores.runs.finish_run(run.id, outcome).await.unwrap(),
            )
        }));
    }
    let mut winners = Vec::new();
    for task in tasks {
        let (status, won) = task.await.unwrap();
        if won {
            winners.push(status);
        }
    }
    assert_eq!(winners.len(), 1);
    let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(stored.status, winners[0]);
    assert_eq!(stored.error_code.as_deref(), Some(winners[0].as_str()));
}

/// The first cancel request is recorded; later ones report what they found.
pub async fn run_request_cancel(db: &TestDb) {
    let run = create_run(db, None).await;
    assert_eq!(
        db.stores
            .runs
            .request_cancel(run.id, Some("user".into()))
            .await
            .unwrap(),
        CancelOutcome::Requested
    );
    assert_eq!(
        db.stores
            .runs
            .request_cancel(run.id, Some("again".into()))
            .await
            .unwrap(),
        CancelOutcome::AlreadyRequested
    );
    let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
    assert!(stored.cancel_requested_at.is_some());
    assert_eq!(stored.cancel_reason.as_deref(), Some("user"));
    assert_eq!(
        stored.status,
        RunStatus::Queued,
        "a request does not end the run"
    );

    let done = create_run(db, None).await;
    db.stores
        .runs
        .finish_run(done.id, RunOutcome::completed())
        .await
        .unwrap();
    assert_eq!(
        db.stores.runs.request_cancel(done.id, None).await.unwrap(),
        CancelOutcome::AlreadyFinished(RunStatus::Completed)
    );
    assert!(
        db.stores
            .runs
            .get_run(done.id)
            .await
            .unwrap()
            .unwrap()
            .cancel_requested_at
            .is_none()
    );
    assert_code(
        db.stores.runs.request_cancel(RunId::new(), None).await,
        ErrorCode::NotFound,
    );
}

/// Runs are listed newest first with filters and opaque cursors.
pub async fn run_list_filters_and_pages(db: &TestDb) {
    let mut ids = Vec::new();
    for i in 0..5 {
        let run = create_run(db, Some(if i < 3 { "c1" } else { "c2" })).await;
        ids.push(run.id);
    }
    db.stores
        .runs
        .finish_run(ids[0], RunOutcome::completed())
        .await
        .unwrap();
    let mut other = new_run(Some("c1"));
    other.workspace_id = other_ws();
    db.stores.runs.create_run(other).await.unwrap();

    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = db
            .stores
            .runs
            .list_runs(RunFilter::workspace(ws()), cursor.clone(), Some(2))
            .await
            .unwrap();
        seen.extend(page.items.iter().map(|r| r.id));
        if !page.has_more {
            break;
        }
        cursor = page.next_cursor;
    }
    let mut expected = ids.clone();
    expected.reverse();
    assert_eq!(seen, expected);

    let mut filter = RunFilter::workspace(ws());
    filter.conversation_id = Some("c1".into());
    filter.statuses = vec![RunStatus::Queued];
    let page = db.stores.runs.list_runs(filter, None, None).await.unwrap();
    assert_eq!(
        page.items.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![ids[2], ids[1]]
    );
    let mut filter = RunFilter::workspace(ws());
    filter.runner_id = Some("nope".into());
    assert!(
        db.stores
            .runs
            .list_runs(filter, None, None)
            .await
            .unwrap()
            .items
            .is_empty()
    );
    assert_code(
        db.stores
            .runs
            .list_runs(RunFilter::workspace(ws()), Some("bad".into()), None)
            .await,
        ErrorCode::InvalidArgument,
    );
}

/// Every run [`RunLedger::runs_with_status`] returns, following `next_cursor` with pages
/// of `limit` and calling `each` on every run before reading the next page (the caller
/// may change the run); checks the shape of each page on the way.
async fn runs_with_status<F, Fut>(
    db: &TestDb,
    status: RunStatus,
    limit: i64,
    mut each: F,
) -> Vec<RunId>
where
    F: FnMut(RunRecord) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = db
            .stores
            .runs
            .runs_with_status(status, cursor, Some(limit))
            .await
            .unwrap();
        assert!(page.items.len() as i64 <= limit, "{page:?}");
        assert!(page.items.iter().all(|r| r.status == status), "{page:?}");
        for run in page.items {
            seen.push(run.id);
            each(run).await;
        }
        let Some(next) = page.next_cursor else {
            assert!(!page.has_more);
            return seen;
        };
        cursor = Some(next);
    }
}

/// `runs_with_status` reads one status across every workspace, oldest first, in bounded
/// pages that neither skip nor repeat a run when the caller finishes the runs it reads.
pub async fn run_with_status_pages_across_workspaces(db: &TestDb) {
    // Workspaces alternate; runs are left queued, running or completed in turn.
    let (mut queued, mut running, mut completed) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..9 {
        let mut new = new_run(Some("c"));
        if i % 2 == 1 {
            new.workspace_id = other_ws();
        }
        let (run, _) = db.stores.runs.create_run(new).await.unwrap();
        match i % 3 {
            0 => queued.push(run.id),
            1 => {
                assert!(db.stores.runs.claim_run(run.id, "w").await.unwrap());
                running.push(run.id);
            }
            _ => {
                let done = RunOutcome::completed();
                assert!(db.stores.runs.finish_run(run.id, done).await.unwrap());
                completed.push(run.id);
            }
        }
    }
    let ignore = |_| async {};
    assert_eq!(
        runs_with_status(db, RunStatus::Queued, 2, ignore).await,
        queued
    );
    assert_eq!(
        runs_with_status(db, RunStatus::Completed, 100, ignore).await,
        completed
    );
    assert!(
        runs_with_status(db, RunStatus::Timeout, 10, ignore)
            .await
            .is_empty()
    );

    // Finishing every run as it is read (what the start-up recovery does) reaches each
    // running run exactly once, however the pages fall.
    let interrupt = |run: RunRecord| async move {
        let outcome = RunOutcome::with_error(RunStatus::Interrupted, "interrupted", "gone");
        assert!(db.stores.runs.finish_run(run.id, outcome).await.unwrap());
    };
    assert_eq!(
        runs_with_status(db, RunStatus::Running, 1, interrupt).await,
        running
    );
    assert!(
        runs_with_status(db, RunStatus::Running, 10, ignore)
            .await
            .is_empty()
    );
    assert_eq!(
        runs_with_status(db, RunStatus::Interrupted, 2, ignore).await,
        running
    );

    // Limits are clamped to [1, 100]; foreign or malformed cursors are invalid_argument.
    let one = db
        .stores
        .runs
        .runs_with_status(RunStatus::Queued, None, Some(0))
        .await
        .unwrap();
    assert_eq!(one.items.len(), 1);
    assert!(one.has_more);
    let event = db
        .stores
        .events
        .append(message("c", "x"), vec![])
        .await
        .unwrap()
        .0;
    for bad in [String::from("garbage"), String::new(), event.cursor] {
        assert_code(
            db.stores
                .runs
                .runs_with_status(RunStatus::Queued, Some(bad), None)
                .await,
            ErrorCode::InvalidArgument,
        );
    }
}

/// Only active runs past their deadline are reported; conversation lookups see active runs.
pub async fn run_deadlines_and_active_runs(db: &TestDb) {
    let now = Utc::now();
    let mk = |conv: &str, deadline: Option<TimeDelta>| {
        let mut r = new_run(Some(conv));
        r.deadline_at = deadline.map(|d| now + d);
        r
    };
    let (late_running, _) = db
        .stores
        .runs
        .create_run(mk("c1", Some(TimeDelta::seconds(-20))))
        .await
        .unwrap();
    db.stores
        .runs
        .claim_run(late_running.id, "w")
        .await
        .unwrap();
    let (late_queued, _) = db
        .stores
        .runs
        .create_run(mk("c1", Some(TimeDelta::seconds(-10))))
        .await
        .unwrap();
    let (late_done, _) = db
        .stores
        .runs
        .create_run(mk("c1", Some(TimeDelta::seconds(-30))))
        .await
        .unwrap();
    db.stores
        .runs
        .finish_run(late_done.id, RunOutcome::completed())
        .await
        .unwrap();
    db.stores
        .runs
        .create_run(mk("c1", Some(TimeDelta::seconds(60))))
        .await
        .unwrap();
    db.stores.runs.create_run(mk("c2", None)).await.unwrap();

    let late = db.stores.runs.runs_past_deadline(now, 10).await.unwrap();
    assert_eq!(
        late.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![late_running.id, late_queued.id]
    );
    assert_eq!(
        db.stores
            .runs
            .runs_past_deadline(now, 1)
            .await
            .unwrap()
            .len(),
        1
    );

    let active = db
        .stores
        .runs
        .active_runs_for_conversation(&ws(), "c1")
        .await
        .unwrap();
    assert_eq!(active.len(), 3);
    assert!(active.iter().all(|r| !r.status.is_terminal()));
    assert!(
        active
            .windows(2)
            .all(|w| w[0].created_at <= w[1].created_at)
    );
    assert!(
        db.stores
            .runs
            .active_runs_for_conversation(&other_ws(), "c1")
            .await
            .unwrap()
            .is_empty()
    );
}
