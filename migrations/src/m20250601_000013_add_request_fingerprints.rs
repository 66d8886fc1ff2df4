//! Request fingerprints for idempotency (issue 14, seed 004) and what the turn API needs on
//! top of the tables of `m20250601_000008`:
//!
//! - `event_log.request_hash`: sha256 hex of the normalized ingest request. A second ingest
//!   with the same idempotency key and another fingerprint is refused (`409 conflict`)
//!   instead of being answered with the first event. Rows written before this migration have
//!   no fingerprint and keep the old behaviour (the key alone decides).
//! - `turn_sessions.runner_id`: the runner of the session's agent, fixed at creation.
//! - `turn_idempotency.event_id`: the `message.received` event a turn was ingested as, so a
//!   turn that never became a run (unrouted, rejected) can say why; and a unique index on
//!   `turn_idempotency.run_id` (the turn id) for reading a turn by its id.
//!
//! All columns are nullable, so no data migration is needed.

use sea_orm_migration::prelude::*;

use crate::common::{id_null, str_len_null, unique_index, uuid_null};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum EventLog {
    Table,
    RequestHash,
}

#[derive(DeriveIden)]
enum TurnSessions {
    Table,
    RunnerId,
}

#[derive(DeriveIden)]
enum TurnIdempotency {
    Table,
    RunId,
    EventId,
}

/// sha256, hex.
const HASH_LEN: u32 = 64;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // One column per statement: SQLite's ALTER TABLE adds one column at a time.
        manager
            .alter_table(
                Table::alter()
                    .table(EventLog::Table)
                    .add_column(str_len_null(EventLog::RequestHash, HASH_LEN))
                    .to_owned(),
            )
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table(TurnSessions::Table)
                    .add_column(id_null(TurnSessions::RunnerId))
                    .to_owned(),
            )
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table(TurnIdempotency::Table)
                    .add_column(uuid_null(TurnIdempotency::EventId))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(unique_index(
                "ux_turn_idempotency_run",
                TurnIdempotency::Table,
                [TurnIdempotency::RunId],
            ))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_index(
                Index::drop()
                    .name("ux_turn_idempotency_run")
                    .table(TurnIdempotency::Table)
                    .to_owned(),
            )
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table(TurnIdempotency::Table)
                    .drop_column(TurnIdempotency::EventId)
                    .to_owned(),
            )
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table(TurnSessions::Table)
                    .drop_column(TurnSessions::RunnerId)
                    .to_owned(),
            )
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table(EventLog::Table)
                    .drop_column(EventLog::RequestHash)
                    .to_owned(),
            )
            .await
    }
}
