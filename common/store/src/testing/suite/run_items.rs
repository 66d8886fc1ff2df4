//! Run ledger contract tests on result items: idempotent, ordered items and batches, the
//! one terminal item (the host's finalizer racing the run's own), and retention.

use chrono::{TimeDelta, Utc};
use sb_protocol::error::ErrorCode;
use sb_protocol::ids::RunId;
use serde_json::json;

use super::{assert_code, create_run, run_event, stored_items, transcript_rows, ws};
use crate::testing::TestDb;
use crate::*;

fn terminal_event(run_id: RunId, sequence: i64, result_type: &str) -> NewRunEvent {
    NewRunEvent {
        run_id,
        sequence,
        result_type: result_type.to_owned(),
        data: json!({"type": result_type, "data": {}}).into(),
        ends_run: None,
        transcript: None,
    }
}

fn is_terminal_type(result_type: &str) -> bool {
    matches!(result_type, "run.completed" | "run.failed")
}

/// A new terminal item with `ends_run` ends its active run, and a new item with a
/// `transcript` row writes it, in the same commit, alone or in a batch of many runs, through
/// both `insert_event` and `insert_events`; a duplicate, an item of an already ended run, an
/// existing transcript row and an invalid outcome change nothing.
pub async fn run_items_that_end_their_run_end_it_with_the_insert(db: &TestDb) {
    let ending = |run_id, sequence, outcome: RunOutcome| NewRunEvent {
        ends_run: Some(outcome),
        ..terminal_event(run_id, sequence, "run.failed")
    };
    let failed = || RunOutcome::with_error(RunStatus::Failed, "runner.crashed", "boom");

    // A batch: two runs streaming, one of them ending; its usage is kept.
    let a = create_run(db, None).await;
    let b = create_run(db, None).await;
    assert!(db.stores.runs.claim_run(a.id, "w1").await.unwrap());
    assert!(db.stores.runs.claim_run(b.id, "w1").await.unwrap());
    let mut completed = RunOutcome::completed();
    completed.usage = Some(json!({"output_tokens": 3}));
    let reply = |id: &str, text: &str| {
        let mut row =
            NewTranscriptItem::message(ws(), "c-items", a.event_id.to_string(), "assistant", text);
        row.id = Some(id.to_owned());
        row.run_id = Some(a.id);
        row.thread_id = Some("t-1".to_owned());
        row.runner_id = Some("plugin:x/y/z".to_owned());
        row.content_json =
            Some(json!({"role": "assistant", "content": [{"text": text, "n": 1.5}]}));
        row.metadata = json!({"k": "v \"quoted\" é"});
        Some(row)
    };
    let batch = vec![
        NewRunEvent {
            transcript: reply("a:assistant", "hello"),
            ..run_event(a.id, 1, "x")
        },
        run_event(b.id, 1, "y"),
        NewRunEvent {
            ends_run: Some(completed.clone()),
            ..terminal_event(a.id, 2, "run.completed")
        },
    ];
    assert_eq!(
        db.stores.runs.insert_events(batch.clone()).await.unwrap(),
        vec![true, true, true]
    );
    let run_a = db.stores.runs.get_run(a.id).await.unwrap().unwrap();
    assert_eq!(run_a.status, RunStatus::Completed);
    assert_eq!(run_a.last_sequence, 2);
    assert_eq!(run_a.usage, Some(json!({"output_tokens": 3})));
    assert!(run_a.ended_at.is_some());
    let run_b = db.stores.runs.get_run(b.id).await.unwrap().unwrap();
    assert_eq!(
        run_b.status,
        RunStatus::Running,
        "no ending item: still running"
    );
    assert_eq!(run_b.last_sequence, 1);

    let rows = transcript_rows(db, "c-items").await;
    assert_eq!(rows.len(), 1, "the new item's transcript row");
    assert_eq!(rows[0].id, "a:assistant");
    assert_eq!(rows[0].content.as_deref(), Some("hello"));
    assert_eq!(rows[0].run_id, Some(a.id));
    assert_eq!(rows[0].thread_id.as_deref(), Some("t-1"));
    assert_eq!(rows[0].bot_id, None);
    assert_eq!(rows[0].runner_id.as_deref(), Some("plugin:x/y/z"));
    assert_eq!(
        rows[0].content_json,
        Some(json!({"role": "assistant", "content": [{"text": "hello", "n": 1.5}]}))
    );
    assert_eq!(rows[0].artifact_refs, None);
    assert_eq!(rows[0].metadata, json!({"k": "v \"quoted\" é"}));

    // Again: nothing is new, the run keeps its end, and no transcript row is written (not
    // even another one that an item carries only now).
    let mut again = batch;
    again[0].transcript = reply("a:other", "hello again");
    assert_eq!(
        db.stores.runs.insert_events(again).await.unwrap(),
        vec![false, false, false]
    );
    assert_eq!(transcript_rows(db, "c-items").await.len(), 1);
    // An existing row with the id is kept.
    assert!(
        db.stores
            .runs
            .insert_event(NewRunEvent {
                transcript: reply("a:assistant", "changed"),
                ..run_event(b.id, 2, "z")
            })
            .await
            .unwrap()
    );
    let rows = transcript_rows(db, "c-items").await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].content.as_deref(), Some("hello"));

    // One item: ends the run with its error.
    assert!(
        db.stores
            .runs
            .insert_event(ending(b.id, 3, failed()))
            .await
            .unwrap()
    );
    let run_b = db.stores.runs.get_run(b.id).await.unwrap().unwrap();
    assert_eq!(run_b.status, RunStatus::Failed);
    assert_eq!(run_b.error_code.as_deref(), Some("runner.crashed"));
    assert_eq!(run_b.error_message.as_deref(), Some("boom"));

    // A run ended otherwise keeps that end when a new item says something else.
    let c = create_run(db, None).await;
    assert!(db.stores.runs.claim_run(c.id, "w1").await.unwrap());
    assert!(
        db.stores
            .runs
            .finish_run(
                c.id,
                RunOutcome::with_error(RunStatus::Cancelled, "cancelled", "stop")
            )
            .await
            .unwrap()
    );
    assert_eq!(
        db.stores
            .runs
            .insert_events(vec![ending(c.id, 1, failed())])
            .await
            .unwrap(),
        vec![true]
    );
    let run_c = db.stores.runs.get_run(c.id).await.unwrap().unwrap();
    assert_eq!(run_c.status, RunStatus::Cancelled);
    assert_eq!(run_c.error_code.as_deref(), Some("cancelled"));
    assert_eq!(run_c.last_sequence, 1);

    // An outcome that is not an end is refused, and nothing is stored.
    let d = create_run(db, None).await;
    let not_an_end = RunOutcome {
        status: RunStatus::Running,
        ..RunOutcome::completed()
    };
    assert_code(
        db.stores
            .runs
            .insert_events(vec![ending(d.id, 1, not_an_end)])
            .await,
        ErrorCode::InvalidArgument,
    );
    assert!(stored_items(db, d.id).await.is_empty());

    // So is a transcript row that does not validate (no conversation), with the batch's
    // other items and run ends, through both calls.
    let mut bad_row = reply("d:assistant", "hi");
    if let Some(row) = bad_row.as_mut() {
        row.conversation_id = String::new();
    }
    let bad = || NewRunEvent {
        transcript: bad_row.clone(),
        ..run_event(d.id, 2, "x")
    };
    assert_code(
        db.stores
            .runs
            .insert_events(vec![
                run_event(d.id, 1, "w"),
                bad(),
                ending(d.id, 3, failed()),
            ])
            .await,
        ErrorCode::InvalidArgument,
    );
    assert_code(
        db.stores.runs.insert_event(bad()).await,
        ErrorCode::InvalidArgument,
    );
    assert!(stored_items(db, d.id).await.is_empty());
    assert_eq!(
        db.stores.runs.get_run(d.id).await.unwrap().unwrap().status,
        RunStatus::Queued
    );
}

/// `finalize_run` stores the host-made terminal item and the terminal status in one
/// commit; it writes nothing for a run that already has a terminal item or already ended;
/// a second terminal item is never stored, at whatever sequence (issue 15, findings 4, 6).
pub async fn run_finalize_stores_the_item_with_the_status(db: &TestDb) {
    use sb_protocol::result::AgentRunResult;
    let interrupted =
        || RunOutcome::with_error(RunStatus::Interrupted, "interrupted", "worker lost");
    let item = || AgentRunResult::run_failed("interrupted", "worker lost", true);

    let run = create_run(db, None).await;
    assert!(db.stores.runs.claim_run(run.id, "w1").await.unwrap());
    db.stores
        .runs
        .insert_event(run_event(run.id, 1, "a"))
        .await
        .unwrap();
    assert_eq!(
        db.stores
            .runs
            .finalize_run(run.id, interrupted(), item())
            .await
            .unwrap(),
        Finalized::Ended { sequence: 2 }
    );
    let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(stored.status, RunStatus::Interrupted);
    assert_eq!(stored.error_code.as_deref(), Some("interrupted"));
    assert_eq!(stored.last_sequence, 2);
    assert!(stored.ended_at.is_some());
    let items = db.stores.runs.events_after(run.id, 1, 10).await.unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].sequence, 2);
    assert_eq!(items[0].result_type, "run.failed");
    assert_eq!(items[0].data["sequence"], json!(2));
    assert_eq!(items[0].data["run_id"], json!(run.id.to_string()));
    assert_eq!(items[0].data["data"]["code"], json!("interrupted"));
    assert_eq!(
        db.stores
            .runs
            .finalize_run(run.id, interrupted(), item())
            .await
            .unwrap(),
        Finalized::AlreadyEnded(RunStatus::Interrupted)
    );
    assert_eq!(
        stored_items(db, run.id).await.len(),
        2,
        "nothing written for an ended run"
    );

    // The run's own terminal item is stored but not applied yet: it is kept, not doubled.
    let own = create_run(db, None).await;
    assert!(db.stores.runs.claim_run(own.id, "w1").await.unwrap());
    assert!(
        db.stores
            .runs
            .insert_event(terminal_event(own.id, 1, "run.completed"))
            .await
            .unwrap()
    );
    assert_eq!(
        db.stores
            .runs
            .finalize_run(own.id, interrupted(), item())
            .await
            .unwrap(),
        Finalized::TerminalStored { sequence: 1 }
    );
    assert_eq!(
        db.stores
            .runs
            .get_run(own.id)
            .await
            .unwrap()
            .unwrap()
            .status,
        RunStatus::Running
    );
    // A second terminal item, alone or in a batch, is "not new" and not stored; nor is
    // anything after the terminal item.
    assert!(
        !db.stores
            .runs
            .insert_event(terminal_event(own.id, 2, "run.failed"))
            .await
            .unwrap()
    );
    assert_eq!(
        db.stores
            .runs
            .insert_events(vec![
                run_event(own.id, 2, "late"),
                terminal_event(own.id, 3, "run.failed"),
            ])
            .await
            .unwrap(),
        vec![false, false]
    );
    let items = stored_items(db, own.id).await;
    assert_eq!(
        items.iter().map(|e| e.sequence).collect::<Vec<_>>(),
        vec![1]
    );

    // A queued run can be finalized too (the reaper's deployment maximum).
    let queued = create_run(db, None).await;
    let timeout = RunOutcome::with_error(RunStatus::Timeout, "timeout", "too long");
    assert_eq!(
        db.stores
            .runs
            .finalize_run(
                queued.id,
                timeout.clone(),
                AgentRunResult::run_failed("timeout", "too long", true)
            )
            .await
            .unwrap(),
        Finalized::Ended { sequence: 1 }
    );

    assert_code(
        db.stores
            .runs
            .finalize_run(RunId::new(), timeout.clone(), item())
            .await,
        ErrorCode::NotFound,
    );
    let delta = AgentRunResult {
        result_type: "message.delta".into(),
        ..item()
    };
    assert_code(
        db.stores.runs.finalize_run(own.id, timeout, delta).await,
        ErrorCode::InvalidArgument,
    );
}

/// A worker that resumes after the host ended its run (stopped past its lease, then
/// continued) publishes items after the host's terminal item: none is stored, singly or
/// in a batch, and items up to the terminal one still are.
pub async fn run_items_after_the_terminal_item_are_not_stored(db: &TestDb) {
    use sb_protocol::result::AgentRunResult;
    let run = create_run(db, None).await;
    assert!(db.stores.runs.claim_run(run.id, "w1").await.unwrap());
    db.stores
        .runs
        .insert_event(run_event(run.id, 1, "a"))
        .await
        .unwrap();
    db.stores
        .runs
        .finalize_run(
            run.id,
            RunOutcome::with_error(RunStatus::Interrupted, "interrupted", "lease lost"),
            AgentRunResult::run_failed("interrupted", "lease lost", true),
        )
        .await
        .unwrap();
    // The worker's own items 2.. arrive late: 2 collides with the host's terminal item,
    // 3 and 4 come after it.
    let inserted = db
        .stores
        .runs
        .insert_events(vec![
            run_event(run.id, 2, "b"),
            run_event(run.id, 3, "c"),
            terminal_event(run.id, 4, "run.completed"),
        ])
        .await
        .unwrap();
    assert_eq!(inserted, vec![false, false, false]);
    assert!(
        !db.stores
            .runs
            .insert_event(run_event(run.id, 5, "d"))
            .await
            .unwrap()
    );
    let items = db.stores.runs.events_after(run.id, 0, 100).await.unwrap();
    let types: Vec<&str> = items.iter().map(|e| e.result_type.as_str()).collect();
    assert_eq!(types, ["message.delta", "run.failed"], "{items:?}");
    let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(stored.last_sequence, 2);

    // Another run in the same batch is unaffected.
    let other = create_run(db, None).await;
    let inserted = db
        .stores
        .runs
        .insert_events(vec![run_event(run.id, 6, "e"), run_event(other.id, 1, "x")])
        .await
        .unwrap();
    assert_eq!(inserted, vec![false, true]);
}

/// A finalizer (the reaper) racing the run's own last items (the worker finishing at the
/// same moment): exactly one terminal item is stored, and a terminal status always comes
/// with it.
pub async fn run_finalize_races_the_runs_own_terminal_item(db: &TestDb) {
    use sb_protocol::result::AgentRunResult;
    for _ in 0..8 {
        let run = create_run(db, None).await;
        assert!(db.stores.runs.claim_run(run.id, "w1").await.unwrap());
        db.stores
            .runs
            .insert_event(run_event(run.id, 1, "a"))
            .await
            .unwrap();
        let stores = db.stores.clone();
        let reaper = tokio::spawn(async move {
            stores
                .runs
                .finalize_run(
                    run.id,
                    RunOutcome::with_error(RunStatus::Timeout, "timeout", "late"),
                    AgentRunResult::run_failed("timeout", "late", true),
                )
                .await
                .unwrap()
        });
        let stores = db.stores.clone();
        let worker = tokio::spawn(async move {
            stores
                .runs
                .insert_events(vec![
                    run_event(run.id, 2, "b"),
                    terminal_event(run.id, 3, "run.completed"),
                ])
                .await
                .unwrap()
        });
        let finalized = reaper.await.unwrap();
        let inserted = worker.await.unwrap();
        let items = db.stores.runs.events_after(run.id, 0, 100).await.unwrap();
        let terminals: Vec<_> = items
            .iter()
            .filter(|e| is_terminal_type(&e.result_type))
            .collect();
        assert_eq!(terminals.len(), 1, "{finalized:?} {inserted:?} {items:?}");
        let status = db
            .stores
            .runs
            .get_run(run.id)
            .await
            .unwrap()
            .unwrap()
            .status;
        match finalized {
            Finalized::Ended { sequence } => {
                assert_eq!(terminals[0].sequence, i64::try_from(sequence).unwrap());
                assert_eq!(status, RunStatus::Timeout);
            }
            Finalized::TerminalStored { sequence } => {
                assert_eq!(sequence, 3);
                assert_eq!(inserted, vec![true, true]);
                assert_eq!(status, RunStatus::Running);
            }
            Finalized::AlreadyEnded(status) => panic!("unexpected end: {status}"),
        }
    }
}

/// `(run_id, sequence)` is stored once; reads are ordered and start after the cursor.
pub async fn run_events_are_idempotent_and_ordered(db: &TestDb) {
    let run = create_run(db, None).await;
    for seq in [2, 1, 3] {
        assert!(
            db.stores
                .runs
                .insert_event(run_event(run.id, seq, &format!("s{seq}")))
                .await
                .unwrap()
        );
    }
    assert!(
        !db.stores
            .runs
            .insert_event(run_event(run.id, 2, "duplicate"))
            .await
            .unwrap()
    );
    assert_eq!(
        db.stores
            .runs
            .get_run(run.id)
            .await
            .unwrap()
            .unwrap()
            .last_sequence,
        3
    );
    // A late lower sequence does not lower last_sequence.
    assert!(
        !db.stores
            .runs
            .insert_event(run_event(run.id, 1, "dup"))
            .await
            .unwrap()
    );
    assert_eq!(
        db.stores
            .runs
            .get_run(run.id)
            .await
            .unwrap()
            .unwrap()
            .last_sequence,
        3
    );

    let all = db.stores.runs.events_after(run.id, 0, 100).await.unwrap();
    assert_eq!(
        all.iter().map(|e| e.sequence).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert_eq!(
        all[1].data,
        json!({"type": "message.delta", "data": {"chunk": "s2"}}),
        "first write wins"
    );
    assert_eq!(all[1].result_type, "message.delta");
    let after = db.stores.runs.events_after(run.id, 1, 1).await.unwrap();
    assert_eq!(
        after.iter().map(|e| e.sequence).collect::<Vec<_>>(),
        vec![2]
    );
    assert!(
        db.stores
            .runs
            .events_after(run.id, 3, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        db.stores
            .runs
            .events_after(run.id, 0, 0)
            .await
            .unwrap()
            .len(),
        1,
        "limit clamps to 1"
    );

    assert_code(
        db.stores
            .runs
            .insert_event(run_event(RunId::new(), 1, "x"))
            .await,
        ErrorCode::NotFound,
    );
    assert_code(
        db.stores.runs.insert_event(run_event(run.id, 0, "x")).await,
        ErrorCode::InvalidArgument,
    );
}

/// A batch reports per row whether it was new and bumps every run's last_sequence.
pub async fn run_insert_events_batch_reports_new_rows(db: &TestDb) {
    let a = create_run(db, None).await;
    let b = create_run(db, None).await;
    db.stores
        .runs
        .insert_event(run_event(a.id, 1, "old"))
        .await
        .unwrap();
    let flags = db
        .stores
        .runs
        .insert_events(vec![
            run_event(a.id, 1, "dup of stored"),
            run_event(a.id, 2, "new"),
            run_event(b.id, 5, "new"),
            run_event(a.id, 2, "dup in batch"),
            run_event(b.id, 4, "new"),
        ])
        .await
        .unwrap();
    assert_eq!(flags, vec![false, true, true, false, true]);
    assert_eq!(
        db.stores
            .runs
            .get_run(a.id)
            .await
            .unwrap()
            .unwrap()
            .last_sequence,
        2
    );
    assert_eq!(
        db.stores
            .runs
            .get_run(b.id)
            .await
            .unwrap()
            .unwrap()
            .last_sequence,
        5
    );
    let b_events = stored_items(db, b.id).await;
    assert_eq!(
        b_events.iter().map(|e| e.sequence).collect::<Vec<_>>(),
        vec![4, 5]
    );
    assert!(
        db.stores
            .runs
            .insert_events(vec![])
            .await
            .unwrap()
            .is_empty()
    );
    // A large batch crosses the chunk boundary.
    let many: Vec<_> = (10..1210).map(|s| run_event(a.id, s, "bulk")).collect();
    let flags = db.stores.runs.insert_events(many).await.unwrap();
    assert_eq!(flags.len(), 1200);
    assert!(flags.iter().all(|f| *f));
    assert_eq!(
        db.stores
            .runs
            .get_run(a.id)
            .await
            .unwrap()
            .unwrap()
            .last_sequence,
        1209
    );
    // A batch with an item of a run that does not exist is refused whole: `not_found`, and
    // the other run's item is not stored either (the caller then inserts item by item).
    let c = create_run(db, None).await;
    assert_code(
        db.stores
            .runs
            .insert_events(vec![
                run_event(c.id, 1, "of a run"),
                run_event(RunId::new(), 1, "of no run"),
            ])
            .await,
        ErrorCode::NotFound,
    );
    assert!(stored_items(db, c.id).await.is_empty());
    assert_eq!(
        db.stores
            .runs
            .insert_events(vec![run_event(c.id, 1, "of a run")])
            .await
            .unwrap(),
        vec![true]
    );
}

/// Retention removes the result items of ended runs and marks them expired.
pub async fn run_expire_events(db: &TestDb) {
    let ended = create_run(db, None).await;
    let active = create_run(db, None).await;
    for run in [ended.id, active.id] {
        db.stores
            .runs
            .insert_events(vec![run_event(run, 1, "a"), run_event(run, 2, "b")])
            .await
            .unwrap();
    }
    db.stores
        .runs
        .finish_run(ended.id, RunOutcome::completed())
        .await
        .unwrap();
    let cutoff = Utc::now() + TimeDelta::seconds(5);
    assert_eq!(
        db.stores
            .runs
            .expire_events(Utc::now() - TimeDelta::hours(1), 10)
            .await
            .unwrap(),
        0
    );
    assert_eq!(db.stores.runs.expire_events(cutoff, 10).await.unwrap(), 1);
    assert_eq!(
        db.stores.runs.expire_events(cutoff, 10).await.unwrap(),
        0,
        "already expired"
    );
    assert!(stored_items(db, ended.id).await.is_empty());
    assert_eq!(stored_items(db, active.id).await.len(), 2);
    let stored = db.stores.runs.get_run(ended.id).await.unwrap().unwrap();
    assert!(stored.events_expired_at.is_some());
    assert_eq!(stored.last_sequence, 2);
}
