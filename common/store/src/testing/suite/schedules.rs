//! Schedule store contract tests: workspace-scoped CRUD and paging, firing exactly once per
//! fire time together with the event it ingests.

use chrono::{TimeDelta, Utc};
use sb_protocol::error::ErrorCode;
use sb_protocol::ids::WorkspaceId;
use serde_json::json;

use super::{assert_code, drain_outbox, message, other_ws, outbox_msg, ws};
use crate::testing::TestDb;
use crate::*;

fn new_schedule(workspace_id: WorkspaceId, kind: ScheduleKind, spec: &str) -> NewSchedule {
    NewSchedule {
        workspace_id,
        name: Some("tick".into()),
        kind,
        spec: spec.into(),
        event: json!({"request": {}}),
        enabled: true,
    }
}

/// The firing of `schedule` due now, as the scheduler builds it.
fn firing(schedule: &ScheduleRecord, next: Option<chrono::DateTime<Utc>>) -> ScheduleFiring {
    let fire_at = schedule.next_fire_at.expect("a due schedule");
    let mut event = message("c-sched", "tick");
    event.workspace_id = schedule.workspace_id.clone();
    event.idempotency_key = Some(crate::schedules::firing_key(schedule.id, fire_at));
    ScheduleFiring {
        schedule_id: schedule.id,
        fire_at,
        next_fire_at: next,
        event,
        outbox: vec![outbox_msg("sched")],
    }
}

/// Create computes the first fire time; get, list and delete see one workspace only;
/// lists page in creation order; bad specs and cursors are `invalid_argument`.
pub async fn schedule_crud_is_workspace_scoped_and_paged(db: &TestDb) {
    let store = &db.stores.schedules;
    let before = Utc::now();
    let first = store
        .create(new_schedule(ws(), ScheduleKind::Interval, "15m"))
        .await
        .unwrap();
    let next = first.next_fire_at.unwrap();
    assert!(next >= before + TimeDelta::minutes(15));
    assert!(next <= Utc::now() + TimeDelta::minutes(15));
    assert_eq!(first.kind, ScheduleKind::Interval);
    assert_eq!(first.name.as_deref(), Some("tick"));
    assert!(first.enabled);
    assert_eq!(first.last_fired_at, None);
    let second = store
        .create(new_schedule(ws(), ScheduleKind::Cron, "*/5 * * * *"))
        .await
        .unwrap();
    let third = store
        .create(new_schedule(
            ws(),
            ScheduleKind::Once,
            "2030-01-01T00:00:00Z",
        ))
        .await
        .unwrap();
    let foreign = store
        .create(new_schedule(other_ws(), ScheduleKind::Interval, "1h"))
        .await
        .unwrap();

    assert_eq!(
        store.get(&ws(), first.id).await.unwrap(),
        Some(first.clone())
    );
    assert_eq!(store.get(&ws(), foreign.id).await.unwrap(), None);

    let page = store.list(&ws(), None, Some(2)).await.unwrap();
    assert_eq!(
        page.items.iter().map(|s| s.id).collect::<Vec<_>>(),
        vec![first.id, second.id]
    );
    assert!(page.has_more);
    let rest = store.list(&ws(), page.next_cursor, Some(2)).await.unwrap();
    assert_eq!(
        rest.items.iter().map(|s| s.id).collect::<Vec<_>>(),
        vec![third.id]
    );
    assert!(!rest.has_more);
    assert_code(
        store.list(&ws(), Some("nope".into()), None).await,
        ErrorCode::InvalidArgument,
    );

    for (kind, spec) in [
        (ScheduleKind::Interval, "often"),
        (ScheduleKind::Cron, "* * *"),
        (ScheduleKind::Once, "later"),
    ] {
        assert_code(
            store.create(new_schedule(ws(), kind, spec)).await,
            ErrorCode::InvalidArgument,
        );
    }

    assert!(!store.delete(&ws(), foreign.id).await.unwrap());
    assert!(store.delete(&ws(), first.id).await.unwrap());
    assert!(!store.delete(&ws(), first.id).await.unwrap());
    assert_eq!(store.get(&ws(), first.id).await.unwrap(), None);
    assert!(store.get(&other_ws(), foreign.id).await.unwrap().is_some());
}

/// A due schedule fires once per fire time: the compare-and-set advances it and the
/// event with its outbox row is written with it; firing the same time again writes
/// nothing.
pub async fn schedule_fire_advances_and_ingests_once(db: &TestDb) {
    let store = &db.stores.schedules;
    let created = store
        .create(new_schedule(ws(), ScheduleKind::Interval, "1s"))
        .await
        .unwrap();
    let fire_at = created.next_fire_at.unwrap();
    assert!(store.due(Utc::now(), 10).await.unwrap().is_empty());
    let due = store.due(fire_at, 10).await.unwrap();
    assert_eq!(
        due.iter().map(|s| s.id).collect::<Vec<_>>(),
        vec![created.id]
    );

    let next = fire_at + TimeDelta::seconds(1);
    let (event, was_created) = store
        .fire(firing(&due[0], Some(next)))
        .await
        .unwrap()
        .expect("the first firing wins");
    assert!(was_created);
    assert_eq!(
        event.idempotency_key,
        Some(crate::schedules::firing_key(created.id, fire_at))
    );
    assert_eq!(db.stores.events.get(event.id).await.unwrap(), Some(event));
    assert_eq!(drain_outbox(db).await.len(), 1);

    let after = store.get(&ws(), created.id).await.unwrap().unwrap();
    assert_eq!(after.next_fire_at, Some(next));
    assert_eq!(after.last_fired_at, Some(fire_at));
    assert!(after.enabled);
    assert!(store.due(fire_at, 10).await.unwrap().is_empty());

    // The same firing again (a scheduler with a stale read): nothing is written.
    assert_eq!(store.fire(firing(&due[0], Some(next))).await.unwrap(), None);
    assert!(drain_outbox(db).await.is_empty());
    let events = db.stores.events.page(EventQuery::new(ws())).await.unwrap();
    assert_eq!(events.items.len(), 1);

    // A deleted schedule does not fire.
    store.delete(&ws(), created.id).await.unwrap();
    assert_eq!(store.fire(firing(&after, None)).await.unwrap(), None);
}

/// A firing without a next time disables the schedule: it is never due again.
pub async fn schedule_once_fires_then_is_disabled(db: &TestDb) {
    let store = &db.stores.schedules;
    let created = store
        .create(new_schedule(
            ws(),
            ScheduleKind::Once,
            "2020-01-01T00:00:00Z",
        ))
        .await
        .unwrap();
    let due = store.due(Utc::now(), 10).await.unwrap();
    assert_eq!(due.len(), 1, "a past one-shot is due at once");
    assert!(store.fire(firing(&due[0], None)).await.unwrap().is_some());
    let after = store.get(&ws(), created.id).await.unwrap().unwrap();
    assert!(!after.enabled);
    assert_eq!(after.next_fire_at, None);
    assert!(after.last_fired_at.is_some());
    assert!(
        store
            .due(Utc::now() + TimeDelta::days(3650), 10)
            .await
            .unwrap()
            .is_empty()
    );
}

/// Schedulers racing on the same firing: exactly one wins, one event is written.
pub async fn schedule_concurrent_fires_have_one_winner(db: &TestDb) {
    let created = db
        .stores
        .schedules
        .create(new_schedule(ws(), ScheduleKind::Interval, "1s"))
        .await
        .unwrap();
    let next = created.next_fire_at.unwrap() + TimeDelta::seconds(1);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let stores = db.stores.clone();
        let firing = firing(&created, Some(next));
        tasks.push(tokio::spawn(async move {
            stores.schedules.fire(firing).await.unwrap()
        }));
    }
    let mut winners = 0;
    for task in tasks {
        if task.await.unwrap().is_some() {
            winners += 1;
        }
    }
    assert_eq!(winners, 1);
    assert_eq!(drain_outbox(db).await.len(), 1);
    let events = db.stores.events.page(EventQuery::new(ws())).await.unwrap();
    assert_eq!(events.items.len(), 1);
}

/// An event the log refuses rolls the claim back: the schedule stays due.
pub async fn schedule_fire_with_invalid_event_writes_nothing(db: &TestDb) {
    let store = &db.stores.schedules;
    let created = store
        .create(new_schedule(ws(), ScheduleKind::Interval, "1s"))
        .await
        .unwrap();
    let mut bad = firing(
        &created,
        Some(created.next_fire_at.unwrap() + TimeDelta::seconds(1)),
    );
    bad.event.event_type = String::new();
    assert_code(store.fire(bad).await, ErrorCode::InvalidArgument);
    assert_eq!(
        store.get(&ws(), created.id).await.unwrap(),
        Some(created.clone())
    );
    assert!(drain_outbox(db).await.is_empty());
    assert_eq!(
        store
            .due(created.next_fire_at.unwrap(), 10)
            .await
            .unwrap()
            .len(),
        1
    );
}
