//! At most one terminal result item per run (issue 15, finding 6): a partial unique index on
//! `run_events (run_id)` over the terminal result types (`run.completed`, `run.failed`).
//!
//! A run's terminal item may come from its worker, from the reaper (deadline, lost lease,
//! deployment maximum) or from the embedded recovery, and these can race: the worker's last
//! items are still in flight when the reaper gives up on the run. Sequences alone do not stop
//! a second terminal item (the reaper takes the first free sequence, the worker's terminal
//! item arrives with a later one), so the database does: the second insert is a conflict the
//! ledger reports as "not new", and it is neither applied nor delivered.
//!
//! Ledgers written before this migration may hold a run with two terminal items (the faults
//! issue 15 measured); the later ones are removed first, keeping the terminal item readers
//! saw first (the lowest sequence), so the index can be built. Both SQLite and Postgres
//! support partial indexes with the same syntax.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

/// The index name (also dropped by `down`).
const INDEX: &str = "ux_run_events_one_terminal";

/// The terminal result types, as an SQL list.
const TERMINAL_TYPES: &str = "('run.completed', 'run.failed')";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        db.execute_unprepared(&format!(
            "DELETE FROM run_events WHERE result_type IN {TERMINAL_TYPES} AND EXISTS \
             (SELECT 1 FROM run_events AS first WHERE first.run_id = run_events.run_id \
             AND first.result_type IN {TERMINAL_TYPES} AND first.sequence < run_events.sequence)"
        ))
        .await?;
        db.execute_unprepared(&format!(
            "CREATE UNIQUE INDEX {INDEX} ON run_events (run_id) WHERE result_type IN {TERMINAL_TYPES}"
        ))
        .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .get_connection()
            .execute_unprepared(&format!("DROP INDEX {INDEX}"))
            .await?;
        Ok(())
    }
}
