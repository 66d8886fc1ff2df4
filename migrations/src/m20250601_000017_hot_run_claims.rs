//! A run's claim (`queued → running`) as a heap-only update on Postgres (issue 11): the
//! index `ix_runs_status_deadline (status, deadline_at)` is dropped, and `runs` leaves room
//! in its pages for the new row versions (`fillfactor = 70`).
//!
//! Why: every status change wrote a new entry into each of the table's six indexes, because
//! `status` was an indexed column. Postgres updates a row within its page (HOT: no index
//! entry at all) only when no indexed column changes and the page has room. The claim
//! changes `status`, `worker_id` and `started_at`, none of them indexed now; the end still
//! sets the indexed `ended_at`. Each run now writes 5 + 0 + 5 index entries (insert, claim,
//! end) instead of 6 + 6 + 6.
//!
//! The queries that found active runs through the dropped index (the reaper's deadline and
//! lease sweeps, the embedded recovery) say `ended_at IS NULL` as well, which every
//! `queued`/`running` run satisfies (`ended_at` is set exactly when a run ends): both
//! backends answer them from `ix_runs_ended`, whose entries without an end are exactly the
//! runs in flight. SQLite has no fill factor.

use sea_orm_migration::prelude::*;

use crate::common::{allow_heap_only_updates, forbid_heap_only_updates};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// The index this migration drops (recreated by `down`).
const STATUS_DEADLINE: &str = "ix_runs_status_deadline";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        allow_heap_only_updates(manager, "runs", STATUS_DEADLINE).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        forbid_heap_only_updates(manager, "runs", STATUS_DEADLINE, "status, deadline_at").await
    }
}
