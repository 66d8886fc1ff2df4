//! Event log contract tests: append (idempotency keys, fingerprints, the outbox rows
//! written with the event), status updates and metadata merges, pages and cursors, retention,
//! and reading one status across workspaces.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{TimeDelta, Utc};
use sb_protocol::error::{ErrorCode, HasErrorCode as _};
use sb_protocol::ids::{EventId, RunId};
use serde_json::{Value, json};

use super::{assert_code, drain_outbox, message, other_ws, outbox_msg, ws};
use crate::testing::TestDb;
use crate::*;

/// Appended events read back field for field, with increasing seqs and opaque cursors.
pub async fn event_append_roundtrips_and_orders(db: &TestDb) {
    let mut first = message("c1", "hello");
    first.bot_id = Some("bot".into());
    first.thread_id = Some("t".into());
    first.actor_type = Some("user".into());
    first.actor_id = Some("u1".into());
    first.actor_name = Some("Ada".into());
    first.subject_type = Some("message".into());
    first.subject_id = Some("m1".into());
    first.event_time = Some(Utc::now());
    first.envelope = Some(json!({"input": {"text": "hello"}}));
    first.raw_ref = Some("artifact-1".into());
    first.metadata = json!({"k": "v"});
    first.runner_id = Some("plugin:a/b/c".into());
    let (a, created) = db
        .stores
        .events
        .append(first.clone(), vec![])
        .await
        .unwrap();
    assert!(created);
    let (b, _) = db
        .stores
        .events
        .append(message("c1", "second"), vec![])
        .await
        .unwrap();
    let (c, _) = db
        .stores
        .events
        .append(message("c2", "third"), vec![])
        .await
        .unwrap();
    assert!(a.seq < b.seq && b.seq < c.seq);
    assert_ne!(a.cursor, a.seq.to_string(), "cursors are opaque");

    let got = db.stores.events.get(a.id).await.unwrap().unwrap();
    assert_eq!(got, a);
    assert_eq!(got.workspace_id, ws());
    assert_eq!(got.event_type, "message.received");
    assert_eq!(got.source, "host_adapter");
    assert_eq!(got.status, EventStatus::Received);
    assert_eq!(got.bot_id.as_deref(), Some("bot"));
    assert_eq!(got.thread_id.as_deref(), Some("t"));
    assert_eq!(got.actor_name.as_deref(), Some("Ada"));
    assert_eq!(got.subject_id.as_deref(), Some("m1"));
    assert_eq!(got.envelope, first.envelope);
    assert_eq!(got.raw_ref.as_deref(), Some("artifact-1"));
    assert_eq!(got.metadata, json!({"k": "v"}));
    assert_eq!(got.runner_id.as_deref(), Some("plugin:a/b/c"));
    assert_eq!(
        got.event_time.unwrap().timestamp_micros(),
        first.event_time.unwrap().timestamp_micros()
    );
    // A missing event is None; an empty metadata object reads back as `{}`.
    assert!(
        db.stores
            .events
            .get(EventId::new())
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        db.stores.events.get(b.id).await.unwrap().unwrap().metadata,
        json!({})
    );
}

/// The same idempotency key in the same workspace writes nothing the second time.
pub async fn event_append_dedupes_on_idempotency_key(db: &TestDb) {
    let mut event = message("c1", "hi");
    event.idempotency_key = Some("key-1".into());
    let (first, created) = db
        .stores
        .events
        .append(event.clone(), vec![outbox_msg("a")])
        .await
        .unwrap();
    assert!(created);
    event.input_summary = Some("different payload".into());
    let (second, created) = db
        .stores
        .events
        .append(event.clone(), vec![outbox_msg("b")])
        .await
        .unwrap();
    assert!(!created);
    assert_eq!(second, first);
    let claimed = drain_outbox(db).await;
    assert_eq!(claimed.len(), 1, "the duplicate enqueued nothing");
    assert_eq!(claimed[0].routing_key, "a");
    assert_eq!(claimed[0].body, b"body-a");

    // Keys are per workspace.
    event.workspace_id = other_ws();
    let (third, created) = db.stores.events.append(event, vec![]).await.unwrap();
    assert!(created);
    assert_ne!(third.id, first.id);

    // Invalid keys are rejected.
    let mut bad = message("c1", "x");
    bad.idempotency_key = Some("no spaces allowed".into());
    assert_code(
        db.stores.events.append(bad, vec![]).await,
        ErrorCode::InvalidArgument,
    );
}

/// Same key + same fingerprint → the first event; another fingerprint → `conflict`,
/// nothing written. Without a fingerprint on either side, the key alone decides.
pub async fn event_append_refuses_a_key_with_another_fingerprint(db: &TestDb) {
    let mut event = message("c1", "hi");
    event.idempotency_key = Some("fp-1".into());
    event.request_hash = Some("a".repeat(64));
    let (first, created) = db
        .stores
        .events
        .append(event.clone(), vec![outbox_msg("a")])
        .await
        .unwrap();
    assert!(created);
    let (again, created) = db
        .stores
        .events
        .append(event.clone(), vec![outbox_msg("b")])
        .await
        .unwrap();
    assert!(!created);
    assert_eq!(again.id, first.id);
    let mut other = event.clone();
    other.request_hash = Some("b".repeat(64));
    assert_code(
        db.stores.events.append(other, vec![outbox_msg("c")]).await,
        ErrorCode::Conflict,
    );
    let mut unhashed = event;
    unhashed.request_hash = None;
    let (old_style, created) = db.stores.events.append(unhashed, vec![]).await.unwrap();
    assert!(!created);
    assert_eq!(old_style.id, first.id);
    assert_eq!(drain_outbox(db).await.len(), 1, "only the first enqueued");
}

/// Racing appends with one key create exactly one event and one outbox row.
pub async fn event_append_concurrent_same_key_creates_one(db: &TestDb) {
    let mut tasks = Vec::new();
    for i in 0..8 {
        let stores = db.stores.clone();
        tasks.push(tokio::spawn(async move {
            let mut event = message("c1", &format!("attempt {i}"));
            event.idempotency_key = Some("same".into());
            stores
                .events
                .append(event, vec![outbox_msg("k")])
                .await
                .unwrap()
        }));
    }
    let mut ids = HashSet::new();
    let mut created = 0;
    for task in tasks {
        let (record, was_created) = task.await.unwrap();
        ids.insert(record.id);
        created += usize::from(was_created);
    }
    assert_eq!(created, 1);
    assert_eq!(ids.len(), 1);
    assert_eq!(drain_outbox(db).await.len(), 1);
}

/// An append that fails leaves neither the event nor its outbox rows behind.
pub async fn event_append_failure_writes_no_outbox(db: &TestDb) {
    let (first, _) = db
        .stores
        .events
        .append(message("c1", "a"), vec![])
        .await
        .unwrap();
    let mut again = message("c1", "b");
    again.id = Some(first.id);
    assert_code(
        db.stores.events.append(again, vec![outbox_msg("x")]).await,
        ErrorCode::Conflict,
    );
    assert!(drain_outbox(db).await.is_empty());
    let before = db.stores.events.page(EventQuery::new(ws())).await.unwrap();
    assert_eq!(before.items.len(), 1);
    // Invalid outbox rows fail the whole append.
    assert_code(
        db.stores
            .events
            .append(
                message("c1", "c"),
                vec![NewOutboxMessage::new("", "k", vec![])],
            )
            .await,
        ErrorCode::InvalidArgument,
    );
    let after = db.stores.events.page(EventQuery::new(ws())).await.unwrap();
    assert_eq!(after.items.len(), before.items.len());
}

/// `input_summary` keeps 1000 characters and cuts longer text to 997 + `...`.
pub async fn event_input_summary_is_truncated(db: &TestDb) {
    let exact = "é".repeat(1000);
    let (a, _) = db
        .stores
        .events
        .append(message("c", &exact), vec![])
        .await
        .unwrap();
    assert_eq!(a.input_summary.as_deref(), Some(exact.as_str()));
    let (b, _) = db
        .stores
        .events
        .append(message("c", &"x".repeat(5000)), vec![])
        .await
        .unwrap();
    let summary = b.input_summary.unwrap();
    assert_eq!(summary.chars().count(), 1000);
    assert_eq!(summary, format!("{}...", "x".repeat(997)));
}

/// Status updates set the given fields and merge metadata keys.
pub async fn event_update_status_merges_metadata(db: &TestDb) {
    let mut event = message("c1", "hi");
    event.metadata = json!({"keep": 1, "drop": 2});
    let (e, _) = db.stores.events.append(event, vec![]).await.unwrap();
    let run = RunId::new();
    let updated = db
        .stores
        .events
        .update_status(
            e.id,
            EventStatusUpdate {
                status: EventStatus::Claimed,
                reason: Some("steering".into()),
                run_id: Some(run),
                claimed_by_run_id: Some(run),
                metadata_merge: Some(json!({"drop": null, "steering": {"status": "queued"}})),
            },
        )
        .await
        .unwrap();
    assert_eq!(updated.status, EventStatus::Claimed);
    assert_eq!(updated.reason.as_deref(), Some("steering"));
    assert_eq!(updated.run_id, Some(run));
    assert_eq!(updated.claimed_by_run_id, Some(run));
    assert_eq!(
        updated.metadata,
        json!({"keep": 1, "steering": {"status": "queued"}})
    );
    assert!(updated.updated_at >= e.updated_at);
    assert_eq!(db.stores.events.get(e.id).await.unwrap().unwrap(), updated);

    // Fields left None are kept.
    let again = db
        .stores
        .events
        .update_status(e.id, EventStatusUpdate::status(EventStatus::Dispatched))
        .await
        .unwrap();
    assert_eq!(again.status, EventStatus::Dispatched);
    assert_eq!(again.reason.as_deref(), Some("steering"));
    assert_eq!(again.metadata, updated.metadata);

    assert_code(
        db.stores
            .events
            .update_status(
                EventId::new(),
                EventStatusUpdate::status(EventStatus::Unrouted),
            )
            .await,
        ErrorCode::NotFound,
    );
    let mut bad = EventStatusUpdate::status(EventStatus::Unrouted);
    bad.metadata_merge = Some(json!([1]));
    assert_code(
        db.stores.events.update_status(e.id, bad).await,
        ErrorCode::InvalidArgument,
    );
}

/// A metadata merge replaces each top-level value whole (nested nulls and arrays are
/// kept as given), takes any key (dots, quotes, backslashes, non-ASCII), and removing
/// every key leaves `{}`.
pub async fn event_update_status_merge_replaces_whole_values(db: &TestDb) {
    let events = &db.stores.events;
    let mut event = message("c1", "hi");
    event.metadata = json!({"a.b": 1, "keep": {"x": 1, "y": 2}});
    let (e, _) = events.append(event, vec![]).await.unwrap();
    let merge = |m: Value| EventStatusUpdate {
        metadata_merge: Some(m),
        ..EventStatusUpdate::status(EventStatus::Dispatched)
    };
    let updated = events
        .update_status(
            e.id,
            merge(json!({
                "a.b": null,
                "keep": {"x": 3},
                "new": {"n": null, "list": [1, null, "s"]},
                "ünï": "v",
                "": 0,
            })),
        )
        .await
        .unwrap();
    let expected = json!({
        "keep": {"x": 3},
        "new": {"n": null, "list": [1, null, "s"]},
        "ünï": "v",
        "": 0,
    });
    assert_eq!(updated.metadata, expected);
    assert_eq!(events.get(e.id).await.unwrap().unwrap().metadata, expected);

    let updated = events
        .update_status(
            e.id,
            merge(json!({"quo\"te": 1, "back\\slash": [2], "ünï": null})),
        )
        .await
        .unwrap();
    assert_eq!(
        updated.metadata,
        json!({
            "keep": {"x": 3},
            "new": {"n": null, "list": [1, null, "s"]},
            "": 0,
            "quo\"te": 1,
            "back\\slash": [2],
        })
    );

    let emptied = events
        .update_status(
            e.id,
            merge(
                json!({"keep": null, "new": null, "": null, "quo\"te": null, "back\\slash": null}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(emptied.metadata, json!({}));
    assert_eq!(events.get(e.id).await.unwrap().unwrap(), emptied);
    assert_eq!(emptied.status, EventStatus::Dispatched);
}

/// `routing` says what `get` says about the routing, as the status changes.
pub async fn event_routing_follows_the_status(db: &TestDb) {
    let events = &db.stores.events;
    let (e, _) = events.append(message("c1", "hi"), vec![]).await.unwrap();
    let routing = events.routing(e.id).await.unwrap().unwrap();
    assert_eq!(routing.status, EventStatus::Received);
    assert_eq!(routing, EventRouting::from(&e));

    let run = RunId::new();
    let mut update = EventStatusUpdate::status(EventStatus::Dispatched);
    update.run_id = Some(run);
    update.metadata_merge = Some(json!({"authorization": {"big": "document"}}));
    let dispatched = events.update_status(e.id, update).await.unwrap();
    let routing = events.routing(e.id).await.unwrap().unwrap();
    assert_eq!(routing.run_id, Some(run));
    assert_eq!(routing, EventRouting::from(&dispatched));

    let mut update = EventStatusUpdate::status(EventStatus::Unrouted);
    update.reason = Some("binding.not_found".into());
    update.claimed_by_run_id = Some(run);
    let unrouted = events.update_status(e.id, update).await.unwrap();
    let routing = events.routing(e.id).await.unwrap().unwrap();
    assert_eq!(routing.reason.as_deref(), Some("binding.not_found"));
    assert_eq!(routing, EventRouting::from(&unrouted));

    assert_eq!(events.routing(EventId::new()).await.unwrap(), None);
}

/// Concurrent metadata merges do not lose each other's keys.
pub async fn event_update_status_concurrent_merges_keep_all_keys(db: &TestDb) {
    let (e, _) = db
        .stores
        .events
        .append(message("c1", "hi"), vec![])
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..10 {
        let stores = db.stores.clone();
        tasks.push(tokio::spawn(async move {
            let mut update = EventStatusUpdate::status(EventStatus::Dispatched);
            update.metadata_merge = Some(json!({ format!("k{i}"): i }));
            stores.events.update_status(e.id, update).await.unwrap();
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let meta = db.stores.events.get(e.id).await.unwrap().unwrap().metadata;
    for i in 0..10 {
        assert_eq!(meta[format!("k{i}")], json!(i), "{meta}");
    }
}

/// Pages: newest first, `after_cursor` oldest first, filters, strict threads.
pub async fn event_page_orders_filters_and_follows_cursors(db: &TestDb) {
    let mut seqs = Vec::new();
    for i in 0..7 {
        let mut e = message("conv-a", &format!("a{i}"));
        e.thread_id = (i % 2 == 1).then(|| "t1".to_owned());
        e.bot_id = Some(if i < 5 { "bot-1" } else { "bot-2" }.into());
        if i == 6 {
            e.event_type = "artifact.created".into();
        }
        seqs.push(db.stores.events.append(e, vec![]).await.unwrap().0.seq);
    }
    db.stores
        .events
        .append(message("conv-b", "b"), vec![])
        .await
        .unwrap();

    // Backward pages of 3 until the end.
    let mut query = EventQuery::new(ws());
    query.conversation_id = Some("conv-a".into());
    query.limit = Some(3);
    let mut seen = Vec::new();
    loop {
        let page = db.stores.events.page(query.clone()).await.unwrap();
        assert!(page.items.len() <= 3);
        seen.extend(page.items.iter().map(|e| e.seq));
        assert_eq!(
            page.prev_cursor,
            page.items.first().map(|e| e.cursor.clone())
        );
        if !page.has_more {
            assert!(page.next_cursor.is_none());
            break;
        }
        query.before_cursor = page.next_cursor;
    }
    let mut expected = seqs.clone();
    expected.reverse();
    assert_eq!(seen, expected);

    // Forward from a cursor.
    let all = db
        .stores
        .events
        .page({
            let mut q = EventQuery::new(ws());
            q.conversation_id = Some("conv-a".into());
            q
        })
        .await
        .unwrap();
    let third_oldest = all.items.iter().find(|e| e.seq == seqs[2]).unwrap();
    let mut q = EventQuery::new(ws());
    q.conversation_id = Some("conv-a".into());
    q.after_cursor = Some(third_oldest.cursor.clone());
    q.limit = Some(2);
    let page = db.stores.events.page(q).await.unwrap();
    assert_eq!(
        page.items.iter().map(|e| e.seq).collect::<Vec<_>>(),
        seqs[3..5]
    );
    assert!(page.has_more);

    // Strict thread filter: None matches only rows without a thread.
    let mut q = EventQuery::new(ws());
    q.conversation_id = Some("conv-a".into());
    q.thread = ThreadFilter::Exactly(None);
    let page = db.stores.events.page(q.clone()).await.unwrap();
    assert_eq!(page.items.len(), 4);
    assert!(page.items.iter().all(|e| e.thread_id.is_none()));
    q.thread = ThreadFilter::Exactly(Some("t1".into()));
    assert_eq!(db.stores.events.page(q).await.unwrap().items.len(), 3);

    // Bot, type and workspace filters.
    let mut q = EventQuery::new(ws());
    q.bot_id = Some("bot-2".into());
    assert_eq!(db.stores.events.page(q).await.unwrap().items.len(), 2);
    let mut q = EventQuery::new(ws());
    q.event_types = vec!["artifact.created".into()];
    let page = db.stores.events.page(q).await.unwrap();
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].seq, seqs[6]);
    assert!(
        db.stores
            .events
            .page(EventQuery::new(other_ws()))
            .await
            .unwrap()
            .items
            .is_empty()
    );
    // Whole workspace: 8 events.
    assert_eq!(
        db.stores
            .events
            .page(EventQuery::new(ws()))
            .await
            .unwrap()
            .items
            .len(),
        8
    );
}

/// Limits are clamped to [1, 100]; foreign or malformed cursors are invalid_argument.
pub async fn event_page_clamps_limits_and_rejects_bad_cursors(db: &TestDb) {
    for i in 0..101 {
        db.stores
            .events
            .append(message("c", &format!("{i}")), vec![])
            .await
            .unwrap();
    }
    let mut q = EventQuery::new(ws());
    q.limit = Some(0);
    assert_eq!(
        db.stores.events.page(q.clone()).await.unwrap().items.len(),
        1
    );
    q.limit = Some(-5);
    assert_eq!(
        db.stores.events.page(q.clone()).await.unwrap().items.len(),
        1
    );
    q.limit = Some(1000);
    let page = db.stores.events.page(q.clone()).await.unwrap();
    assert_eq!(page.items.len(), 100);
    assert!(page.has_more);
    q.limit = None;
    assert_eq!(
        db.stores.events.page(q.clone()).await.unwrap().items.len(),
        50
    );

    for bad in ["garbage", "42", "", "%%%"] {
        let mut q = EventQuery::new(ws());
        q.before_cursor = Some(bad.into());
        assert_code(db.stores.events.page(q).await, ErrorCode::InvalidArgument);
    }
    // A transcript cursor is not an event cursor.
    let item = db
        .stores
        .transcript
        .append(NewTranscriptItem::message(ws(), "c", "e", "user", "x"))
        .await
        .unwrap();
    let mut q = EventQuery::new(ws());
    q.after_cursor = Some(item.cursor);
    assert_code(db.stores.events.page(q).await, ErrorCode::InvalidArgument);
}

/// Retention deletes old events in bounded batches.
pub async fn event_delete_older_than(db: &TestDb) {
    for i in 0..5 {
        db.stores
            .events
            .append(message("c", &format!("{i}")), vec![])
            .await
            .unwrap();
    }
    let future = Utc::now() + TimeDelta::seconds(5);
    assert_eq!(
        db.stores
            .events
            .delete_older_than(Utc::now() - TimeDelta::hours(1), 10)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        db.stores.events.delete_older_than(future, 3).await.unwrap(),
        3
    );
    assert_eq!(
        db.stores.events.delete_older_than(future, 3).await.unwrap(),
        2
    );
    assert!(
        db.stores
            .events
            .page(EventQuery::new(ws()))
            .await
            .unwrap()
            .items
            .is_empty()
    );
}

/// Every event [`EventLog::with_status`] returns from `cursor` on, following
/// `next_cursor` with pages of `limit`; checks the shape of each page on the way.
async fn events_with_status(
    db: &TestDb,
    status: EventStatus,
    mut cursor: Option<String>,
    limit: i64,
) -> Vec<EventId> {
    let mut seen = Vec::new();
    loop {
        let page = db
            .stores
            .events
            .with_status(status, cursor, Some(limit))
            .await
            .unwrap();
        assert!(page.items.len() as i64 <= limit, "{page:?}");
        assert!(page.items.iter().all(|e| e.status == status), "{page:?}");
        assert!(
            page.items.windows(2).all(|w| w[0].seq < w[1].seq),
            "{page:?}"
        );
        seen.extend(page.items.iter().map(|e| e.id));
        let Some(next) = page.next_cursor else {
            assert!(!page.has_more);
            return seen;
        };
        assert!(page.has_more);
        assert_eq!(Some(&next), page.items.last().map(|e| &e.cursor));
        cursor = Some(next);
    }
}

/// `with_status` reads one status across every workspace, oldest first, in bounded
/// pages that neither skip nor repeat an event when statuses change between pages.
pub async fn event_with_status_pages_across_workspaces(db: &TestDb) {
    let to = |status| EventStatusUpdate::status(status);
    // Workspaces alternate; every third event is routed.
    let (mut received, mut dispatched) = (Vec::new(), Vec::new());
    for i in 0..9 {
        let mut e = message("c", &format!("{i}"));
        if i % 2 == 1 {
            e.workspace_id = other_ws();
        }
        let (event, _) = db.stores.events.append(e, vec![]).await.unwrap();
        if i % 3 == 2 {
            db.stores
                .events
                .update_status(event.id, to(EventStatus::Dispatched))
                .await
                .unwrap();
            dispatched.push(event.id);
        } else {
            received.push(event.id);
        }
    }
    assert_eq!(
        events_with_status(db, EventStatus::Received, None, 2).await,
        received
    );
    assert_eq!(
        events_with_status(db, EventStatus::Dispatched, None, 100).await,
        dispatched
    );
    assert!(
        events_with_status(db, EventStatus::Claimed, None, 10)
            .await
            .is_empty()
    );

    // Statuses change after the first page: an event already read and one not read yet
    // leave `received`, a routed one further on returns to it, and a new one arrives.
    let first = db
        .stores
        .events
        .with_status(EventStatus::Received, None, Some(2))
        .await
        .unwrap();
    assert_eq!(
        first.items.iter().map(|e| e.id).collect::<Vec<_>>(),
        received[..2]
    );
    for (id, status) in [
        (received[0], EventStatus::Dispatched),
        (received[3], EventStatus::Unrouted),
        (dispatched[1], EventStatus::Received),
    ] {
        db.stores
            .events
            .update_status(id, to(status))
            .await
            .unwrap();
    }
    let (late, _) = db
        .stores
        .events
        .append(message("c", "late"), vec![])
        .await
        .unwrap();
    assert_eq!(
        events_with_status(db, EventStatus::Received, first.next_cursor, 2).await,
        [
            received[2],
            dispatched[1],
            received[4],
            received[5],
            late.id
        ]
    );

    // Limits are clamped to [1, 100]; foreign or malformed cursors are invalid_argument.
    let one = db
        .stores
        .events
        .with_status(EventStatus::Received, None, Some(0))
        .await
        .unwrap();
    assert_eq!(one.items.len(), 1);
    assert!(one.has_more);
    for bad in ["garbage", "42", ""] {
        assert_code(
            db.stores
                .events
                .with_status(EventStatus::Received, Some(bad.into()), None)
                .await,
            ErrorCode::InvalidArgument,
        );
    }
    let item = db
        .stores
        .transcript
        .append(NewTranscriptItem::message(ws(), "c", "e", "user", "x"))
        .await
        .unwrap();
    assert_code(
        db.stores
            .events
            .with_status(EventStatus::Received, Some(item.cursor), None)
            .await,
        ErrorCode::InvalidArgument,
    );
}

/// A batch of appends in one commit: each request has its own outcome (created, replayed,
/// refused) as if appended alone, and with a lease the rows available now come back leased.
pub async fn event_append_batch_answers_each_request(db: &TestDb) {
    let (stored, _) = db
        .stores
        .events
        .append(message("c0", "stored"), vec![])
        .await
        .unwrap();
    let keyed = |text: &str, key: &str, hash: &str| {
        let mut event = message("c1", text);
        event.idempotency_key = Some(key.into());
        event.request_hash = Some(hash.repeat(64));
        event
    };
    let mut taken_id = message("c1", "taken id");
    taken_id.id = Some(stored.id);
    let mut delayed = outbox_msg("later");
    delayed.available_at = Some(Utc::now() + TimeDelta::hours(1));
    let request = |event: NewEvent, outbox: Vec<NewOutboxMessage>| AppendRequest { event, outbox };
    let mut plain = message("c1", "plain");
    plain.envelope = Some(json!({"input": {"text": "plain"}, "n": 1.5, "list": [1, null]}));
    plain.metadata = json!({"k": "v"});
    plain.event_time = Some(Utc::now());
    let batch = vec![
        request(keyed("first", "k1", "a"), vec![outbox_msg("k1")]),
        request(plain, vec![outbox_msg("p1"), delayed]),
        // The same key and request as the first: its event back, nothing written.
        request(keyed("first", "k1", "a"), vec![outbox_msg("k1-again")]),
        // The same key, another request: refused alone.
        request(keyed("other", "k1", "b"), vec![outbox_msg("k1-other")]),
        // Invalid: refused alone.
        request(
            message("c1", "bad"),
            vec![NewOutboxMessage::new("", "k", vec![])],
        ),
        // A taken event id fails a shared statement: the others still get written.
        request(taken_id, vec![outbox_msg("taken")]),
        request(message("c2", "last"), vec![]),
    ];
    let lease = Duration::from_secs(60);
    let outcomes = db.stores.events.append_batch(batch, Some(lease)).await;
    assert_eq!(outcomes.len(), 7);
    let ok = |i: usize| outcomes[i].as_ref().unwrap();
    assert!(ok(0).created && ok(1).created && ok(6).created);
    assert!(!ok(2).created);
    assert_eq!(ok(2).record.id, ok(0).record.id);
    assert!(ok(2).leased.is_empty());
    for (i, code) in [
        (3, ErrorCode::Conflict),
        (4, ErrorCode::InvalidArgument),
        (5, ErrorCode::Conflict),
    ] {
        let error = outcomes[i].as_ref().unwrap_err();
        assert_eq!(error.code(), code, "request {i}: {error}");
    }
    assert_eq!(ok(1).record.input_summary.as_deref(), Some("plain"));
    // Each created record is the stored event, exactly as a read gives it back.
    for i in [0, 1, 6] {
        let got = db
            .stores
            .events
            .get(ok(i).record.id)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, ok(i).record, "request {i}");
    }
    // Leased: the rows available now, as a claim would have left them; not the delayed row.
    let keys = |rows: &[OutboxMessage]| {
        rows.iter()
            .map(|r| r.routing_key.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(keys(&ok(0).leased), ["k1"]);
    assert_eq!(keys(&ok(1).leased), ["p1"]);
    assert!(ok(6).leased.is_empty());
    assert!(
        ok(0).leased[0].id < ok(1).leased[0].id,
        "ids in request order"
    );
    for row in ok(0).leased.iter().chain(&ok(1).leased) {
        assert_eq!(row.attempts, 1);
        assert!(row.locked_until.is_some_and(|until| until > Utc::now()));
        assert_eq!(row.exchange, "switchboard.events");
    }
    // Nothing to claim while leased; the events are stored once each.
    assert!(drain_outbox(db).await.is_empty());
    let page = db.stores.events.page(EventQuery::new(ws())).await.unwrap();
    assert_eq!(page.items.len(), 4, "stored, first, plain, last");
    // The leased rows are real rows: published, they are done; the delayed one stays pending.
    let ids: Vec<i64> = ok(0)
        .leased
        .iter()
        .chain(&ok(1).leased)
        .map(|r| r.id)
        .collect();
    db.stores.outbox.mark_published(&ids).await.unwrap();
    assert_eq!(db.stores.outbox.pending().await.unwrap(), 1);
}

/// Without a lease a batch writes its rows unleased, for any relay to claim; leased rows
/// whose lease runs out are claimable again (the relay that held them died).
pub async fn event_append_batch_leases_only_when_asked(db: &TestDb) {
    let request = |text: &str| AppendRequest {
        event: message("c1", text),
        outbox: vec![outbox_msg(text)],
    };
    let outcomes = db
        .stores
        .events
        .append_batch(vec![request("a"), request("b")], None)
        .await;
    assert!(
        outcomes
            .iter()
            .all(|o| o.as_ref().is_ok_and(|a| a.created && a.leased.is_empty()))
    );
    let claimed = drain_outbox(db).await;
    assert_eq!(
        claimed
            .iter()
            .map(|r| r.routing_key.as_str())
            .collect::<Vec<_>>(),
        ["a", "b"]
    );

    let outcomes = db
        .stores
        .events
        .append_batch(vec![request("c")], Some(Duration::from_millis(200)))
        .await;
    let leased = &outcomes[0].as_ref().unwrap().leased;
    assert_eq!(leased.len(), 1);
    assert!(drain_outbox(db).await.is_empty());
    tokio::time::sleep(Duration::from_millis(400)).await;
    let again = drain_outbox(db).await;
    assert_eq!(
        again.iter().map(|r| r.id).collect::<Vec<_>>(),
        [leased[0].id]
    );
    assert_eq!(again[0].attempts, 2);
    // An empty batch is no error.
    assert!(
        db.stores
            .events
            .append_batch(Vec::new(), None)
            .await
            .is_empty()
    );
}

/// `get_many` reads several events at once, answered by position.
pub async fn event_get_many_answers_by_position(db: &TestDb) {
    let (a, _) = db
        .stores
        .events
        .append(message("c1", "a"), Vec::new())
        .await
        .unwrap();
    let (b, _) = db
        .stores
        .events
        .append(message("c2", "b"), Vec::new())
        .await
        .unwrap();
    let found = db
        .stores
        .events
        .get_many(&[b.id, EventId::new(), a.id, b.id])
        .await
        .unwrap();
    assert_eq!(found, [Some(b.clone()), None, Some(a), Some(b)]);
    assert!(db.stores.events.get_many(&[]).await.unwrap().is_empty());
}
