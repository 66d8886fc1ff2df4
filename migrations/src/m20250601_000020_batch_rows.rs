//! `sb_batch_rows(jsonb)` on Postgres (issue 11): the rows of a hot statement's `jsonb` batch,
//! which the planner counts as one row.
//!
//! Why: a hot statement takes its batch as one `jsonb` array, so its text is fixed and each
//! connection plans it once and keeps the generic plan. `jsonb_to_recordset` counts every
//! array as 100 rows, so while a ledger table is small, reading it whole costs less than 100
//! probes by key, and a plan made then keeps reading it whole however large it grows (until
//! statistics are gathered again: never, without autovacuum). The run start's update of its
//! events did so: on the cluster benchmark, from an empty ledger, 285 scans read 437,000
//! `event_log` rows per 3,000 runs, a cost that grows with the ledger. A batch is one write
//! tick (one to a few dozen rows), so one row is the truer count, and with it a probe by key
//! is the cheaper plan at every table size.
//!
//! PL/pgSQL because it keeps its one inner plan for the session: a set-returning SQL function
//! is either inlined (and its row count lost with it) or planned again at every call. SQLite
//! keeps no generic plans, and reads its batches with `json_each`.

use sea_orm_migration::prelude::*;

use crate::common::on_postgres;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        on_postgres(
            manager,
            "CREATE OR REPLACE FUNCTION sb_batch_rows(batch jsonb) RETURNS SETOF jsonb \
             LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE ROWS 1 \
             AS $$ BEGIN RETURN QUERY SELECT jsonb_array_elements(batch); END $$",
        )
        .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        on_postgres(manager, "DROP FUNCTION IF EXISTS sb_batch_rows(jsonb)").await
    }
}
