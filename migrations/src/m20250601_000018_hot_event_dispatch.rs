//! An event's dispatch (`received → dispatched`, with its run id and routing metadata) as a
//! heap-only update on Postgres (issue 11): the index `ix_event_log_run (run_id)` is dropped,
//! and `event_log` leaves room in its pages for the new row versions (`fillfactor = 70`).
//!
//! Why: the dispatch sets `run_id`, and an indexed column changing makes Postgres write the
//! new row version into each of the table's six indexes. No query looks an event up by its
//! run: a run names its event (`runs.event_id`, unique), and an event's run is read from its
//! row by the event's id. With the index gone the dispatch changes no indexed column, so it
//! stays within its page when the page has room. Measured on the cluster benchmark: 0 % →
//! 70 % of the dispatches heap-only, WAL 14.0 → 13.1–13.3 KB per run. SQLite has no fill
//! factor (and writes the row in place either way).

use sea_orm_migration::prelude::*;

use crate::common::{allow_heap_only_updates, forbid_heap_only_updates};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// The index this migration drops (recreated by `down`).
const RUN: &str = "ix_event_log_run";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        allow_heap_only_updates(manager, "event_log", RUN).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        forbid_heap_only_updates(manager, "event_log", RUN, "run_id").await
    }
}
