//! [`ScheduleStore`] on SQL.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::WorkspaceId;
use sea_orm::sea_query::{Expr, LockBehavior, LockType, Query};
use sea_orm::{ColumnTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect, Set};
use uuid::Uuid;

use super::entity::schedule;
use super::events::{append_in, event_record};
use super::{ID_LEN, SqlStore, UniqueRow, check_len_opt, micros, now, workspace};
use crate::error::{Result, StoreError};
use crate::events::EventRecord;
use crate::page::{
    CursorKind, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT, Page, clamp_limit, decode_key, encode_key,
};
use crate::schedules::{
    NewSchedule, ScheduleEdit, ScheduleFiring, ScheduleRecord, ScheduleSpec, ScheduleStore,
    next_fire_after_edit,
};

/// Attempts of [`ScheduleStore::update`]'s compare-and-set before it reports a conflict
/// (each lost attempt means a firing or another edit committed in between).
const UPDATE_ATTEMPTS: usize = 5;

/// Largest [`ScheduleStore::due`] read.
const MAX_DUE: u64 = 1000;

fn schedule_record(m: schedule::Model) -> Result<ScheduleRecord> {
    Ok(ScheduleRecord {
        id: m.id,
        workspace_id: workspace(m.workspace_id)?,
        name: m.name,
        kind: m
            .kind
            .parse()
            .map_err(|e: StoreError| StoreError::Corrupt(e.to_string()))?,
        spec: m.spec,
        event: m.event,
        next_fire_at: m.next_fire_at,
        last_fired_at: m.last_fired_at,
        enabled: m.enabled,
        created_at: m.created_at,
        updated_at: m.updated_at,
    })
}

fn schedule_cursor(record: &ScheduleRecord) -> String {
    encode_key(CursorKind::Schedule, &record.id.to_string())
}

#[async_trait]
impl ScheduleStore for SqlStore {
    async fn create(&self, schedule: NewSchedule) -> Result<ScheduleRecord> {
        check_len_opt("name", schedule.name.as_deref(), ID_LEN)?;
        if !schedule.event.is_object() {
            return Err(StoreError::invalid("`event` must be a JSON object"));
        }
        let now = now();
        let next_fire_at = ScheduleSpec::parse(schedule.kind, &schedule.spec)?
            .first_fire(now)
            .ok_or_else(|| StoreError::invalid("invalid `spec`: it never fires"))?;
        let row = schedule::ActiveModel {
            id: Set(Uuid::now_v7()),
            workspace_id: Set(schedule.workspace_id.as_str().to_owned()),
            name: Set(schedule.name),
            kind: Set(schedule.kind.as_str().to_owned()),
            spec: Set(schedule.spec),
            event: Set(schedule.event),
            next_fire_at: Set(Some(micros(next_fire_at))),
            last_fired_at: Set(None),
            enabled: Set(schedule.enabled),
            created_at: Set(now),
            updated_at: Set(now),
        };
        let model = schedule::Entity::insert(row)
            .exec_with_returning(self.writer())
            .await?;
        schedule_record(model)
    }

    async fn get(&self, workspace_id: &WorkspaceId, id: Uuid) -> Result<Option<ScheduleRecord>> {
        schedule::Entity::find_by_id(id)
            .filter(schedule::Column::WorkspaceId.eq(workspace_id.as_str()))
            .all(&self.db)
            .await?
            .unique_row()
            .map(schedule_record)
            .transpose()
    }

    async fn list(
        &self,
        workspace_id: &WorkspaceId,
        cursor: Option<String>,
        limit: Option<i64>,
    ) -> Result<Page<ScheduleRecord>> {
        let limit = clamp_limit(limit, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT);
        let mut select = schedule::Entity::find()
            .filter(schedule::Column::WorkspaceId.eq(workspace_id.as_str()));
        if let Some(cursor) = cursor {
            let after = Uuid::parse_str(&decode_key(CursorKind::Schedule, &cursor)?)
                .map_err(|_| StoreError::invalid("invalid cursor"))?;
            select = select.filter(schedule::Column::Id.gt(after));
        }
        let rows = select
            .order_by_asc(schedule::Column::Id)
            .limit(limit + 1)
            .all(&self.db)
            .await?;
        let records = rows
            .into_iter()
            .map(schedule_record)
            .collect::<Result<Vec<_>>>()?;
        Ok(Page::from_overfetch(records, limit, schedule_cursor))
    }

    async fn update(
        &self,
        workspace_id: &WorkspaceId,
        id: Uuid,
        edit: ScheduleEdit,
    ) -> Result<Option<ScheduleRecord>> {
        check_len_opt("name", edit.name.as_deref(), ID_LEN)?;
        if !edit.event.is_object() {
            return Err(StoreError::invalid("`event` must be a JSON object"));
        }
        for _ in 0..UPDATE_ATTEMPTS {
            let Some(current) = self.get(workspace_id, id).await? else {
                return Ok(None);
            };
            let next_fire_at = next_fire_after_edit(&current, &edit, now())?;
            let updated = schedule::Entity::update_many()
                .col_expr(schedule::Column::Name, Expr::value(edit.name.clone()))
                .col_expr(schedule::Column::Kind, Expr::value(edit.kind.as_str()))
                .col_expr(schedule::Column::Spec, Expr::value(edit.spec.clone()))
                .col_expr(schedule::Column::Event, Expr::value(edit.event.clone()))
                .col_expr(schedule::Column::Enabled, Expr::value(edit.enabled))
                .col_expr(
                    schedule::Column::NextFireAt,
                    Expr::value(next_fire_at.map(micros)),
                )
                .col_expr(schedule::Column::UpdatedAt, Expr::value(now()))
                .filter(schedule::Column::Id.eq(id))
                .filter(schedule::Column::WorkspaceId.eq(workspace_id.as_str()))
                // The compare-and-set: the row is still the one the edit was computed from.
                .filter(schedule::Column::UpdatedAt.eq(current.updated_at))
                .filter(match current.next_fire_at {
                    Some(at) => schedule::Column::NextFireAt.eq(at),
                    None => schedule::Column::NextFireAt.is_null(),
                })
                .exec(self.writer())
                .await?;
            if updated.rows_affected > 0 {
                return self.get(workspace_id, id).await;
            }
        }
        Err(StoreError::Conflict(format!(
            "schedule {id} changed during the edit; try again"
        )))
    }

    async fn delete(&self, workspace_id: &WorkspaceId, id: Uuid) -> Result<bool> {
        let res = schedule::Entity::delete_many()
            .filter(schedule::Column::Id.eq(id))
            .filter(schedule::Column::WorkspaceId.eq(workspace_id.as_str()))
            .exec(self.writer())
            .await?;
        Ok(res.rows_affected > 0)
    }

    async fn due(&self, now: DateTime<Utc>, limit: u64) -> Result<Vec<ScheduleRecord>> {
        schedule::Entity::find()
            .filter(schedule::Column::Enabled.eq(true))
            .filter(schedule::Column::NextFireAt.lte(now))
            .order_by_asc(schedule::Column::NextFireAt)
            .order_by_asc(schedule::Column::Id)
            .limit(limit.clamp(1, MAX_DUE))
            .all(&self.db)
            .await?
            .into_iter()
            .map(schedule_record)
            .collect()
    }

    async fn fire(&self, firing: ScheduleFiring) -> Result<Option<(EventRecord, bool)>> {
        let fire_at = micros(firing.fire_at);
        let still_due = || {
            sea_orm::Condition::all()
                .add(schedule::Column::Id.eq(firing.schedule_id))
                .add(schedule::Column::Enabled.eq(true))
                .add(schedule::Column::NextFireAt.eq(fire_at))
        };
        // Postgres: the subquery skips a row another scheduler is firing right now (it
        // returns at once instead of waiting for that transaction), and the outer
        // conditions are re-checked on the locked row version. SQLite: the write
        // transaction holds the database write lock (the lock clause is not rendered).
        let locked = Query::select()
            .column(schedule::Column::Id)
            .from(schedule::Entity)
            .cond_where(still_due())
            .lock_with_behavior(LockType::Update, LockBehavior::SkipLocked)
            .to_owned();
        let txn = self.write_txn().await?;
        let advanced = schedule::Entity::update_many()
            .col_expr(
                schedule::Column::NextFireAt,
                Expr::value(firing.next_fire_at.map(micros)),
            )
            .col_expr(schedule::Column::LastFiredAt, Expr::value(Some(fire_at)))
            .col_expr(
                schedule::Column::Enabled,
                Expr::value(firing.next_fire_at.is_some()),
            )
            .col_expr(schedule::Column::UpdatedAt, Expr::value(now()))
            .filter(schedule::Column::Id.in_subquery(locked))
            .filter(still_due())
            .exec(&txn)
            .await?;
        if advanced.rows_affected == 0 {
            txn.rollback().await?;
            return Ok(None);
        }
        let (model, created) = append_in(&txn, firing.event, firing.outbox).await?;
        txn.commit().await?;
        Ok(Some((event_record(model)?, created)))
    }
}
