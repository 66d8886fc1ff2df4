//! A result item's run is checked by the ledger's insert statement on Postgres, not by a
//! foreign key (issue 11): `fk_run_events_run` is dropped there.
//!
//! Why: a foreign key checks every inserted item with its own lookup of the run row, which
//! also takes a `FOR KEY SHARE` lock on it — ten lookups and locks of one row for a run of
//! ten items. The result sink's statement now checks each batch's runs once and inserts
//! nothing when one is missing (the caller gets `not_found`, as the violated key answered).
//! Runs are never deleted, so the key's `ON DELETE CASCADE` had nothing to do. Measured on
//! the cluster benchmark (three alternating pairs at 64 in flight, the constraint dropped
//! and put back by hand): Postgres 0.44–0.52 → 0.37–0.42 ms per run, 918–935 → 945–960
//! runs/s. SQLite keeps its key: its check is a B-tree probe without a lock, and dropping a
//! key there means rebuilding the table.

use sea_orm_migration::prelude::*;

use crate::common::on_postgres;

#[derive(DeriveMigrationName)]
pub struct Migration;

/// The constraint this migration drops (recreated by `down`).
const RUN_KEY: &str = "fk_run_events_run";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        on_postgres(
            manager,
            &format!("ALTER TABLE run_events DROP CONSTRAINT IF EXISTS {RUN_KEY}"),
        )
        .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        on_postgres(
            manager,
            &format!(
                "ALTER TABLE run_events ADD CONSTRAINT {RUN_KEY} FOREIGN KEY (run_id) \
                 REFERENCES runs (id) ON DELETE CASCADE"
            ),
        )
        .await
    }
}
