//! The run ledger and every result item of every run.

use sea_orm_migration::prelude::*;

use crate::common::{
    bigint, id, id_null, index, json, json_null, str_len, str_len_null, text_null, ts, ts_null,
    uuid, uuid_null,
};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Runs {
    Table,
    Id,
    WorkspaceId,
    EventId,
    AgentId,
    RunnerId,
    Pool,
    ConversationId,
    ThreadId,
    BotId,
    Status,
    ErrorCode,
    ErrorMessage,
    Attempt,
    WorkerId,
    CreatedAt,
    StartedAt,
    EndedAt,
    DeadlineAt,
    CancelRequestedAt,
    CancelReason,
    LastSequence,
    Usage,
    EventsExpiredAt,
}

#[derive(DeriveIden)]
enum RunEvents {
    Table,
    RunId,
    Sequence,
    ResultType,
    Data,
    CreatedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Runs::Table)
                    .col(uuid(Runs::Id).primary_key())
                    .col(id(Runs::WorkspaceId))
                    // One event → at most one run: a redelivered event reuses the run.
                    .col(uuid(Runs::EventId).unique_key())
                    .col(uuid_null(Runs::AgentId))
                    .col(id(Runs::RunnerId))
                    .col(id(Runs::Pool))
                    .col(id_null(Runs::ConversationId))
                    .col(id_null(Runs::ThreadId))
                    .col(id_null(Runs::BotId))
                    // queued/running/completed/failed/cancelled/timeout/interrupted
                    .col(str_len(Runs::Status, 32))
                    .col(str_len_null(Runs::ErrorCode, 64))
                    .col(text_null(Runs::ErrorMessage))
                    .col(bigint(Runs::Attempt).default(1))
                    .col(id_null(Runs::WorkerId))
                    .col(ts(Runs::CreatedAt))
                    .col(ts_null(Runs::StartedAt))
                    .col(ts_null(Runs::EndedAt))
                    .col(ts_null(Runs::DeadlineAt))
                    .col(ts_null(Runs::CancelRequestedAt))
                    .col(text_null(Runs::CancelReason))
                    .col(bigint(Runs::LastSequence).default(0))
                    .col(json_null(Runs::Usage))
                    // Set when retention deleted this run's result items.
                    .col(ts_null(Runs::EventsExpiredAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "ix_runs_conversation_created",
                Runs::Table,
                [Runs::WorkspaceId, Runs::ConversationId, Runs::CreatedAt],
            ))
            .await?;
        manager
            .create_index(index(
                "ix_runs_status_deadline",
                Runs::Table,
                [Runs::Status, Runs::DeadlineAt],
            ))
            .await?;
        manager
            .create_index(index(
                "ix_runs_workspace_created",
                Runs::Table,
                [Runs::WorkspaceId, Runs::CreatedAt],
            ))
            .await?;
        manager
            .create_index(index("ix_runs_ended", Runs::Table, [Runs::EndedAt]))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(RunEvents::Table)
                    .col(uuid(RunEvents::RunId))
                    // Assigned by the worker: 1, 2, 3, … within one run.
                    .col(bigint(RunEvents::Sequence))
                    .col(str_len(RunEvents::ResultType, 100))
                    .col(json(RunEvents::Data))
                    .col(ts(RunEvents::CreatedAt))
                    .primary_key(
                        Index::create()
                            .name("pk_run_events")
                            .col(RunEvents::RunId)
                            .col(RunEvents::Sequence),
                    )
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_run_events_run")
                            .from(RunEvents::Table, RunEvents::RunId)
                            .to(Runs::Table, Runs::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(RunEvents::Table).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(Runs::Table).to_owned())
            .await
    }
}
