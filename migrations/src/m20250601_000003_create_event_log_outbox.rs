//! The append-only event log (with its `seq` cursor) and the transactional outbox.
//!
//! `event_log.seq` is the primary key so that SQLite can use its rowid as the
//! auto-increment cursor; the host-generated event id is a unique UUID column.

use sea_orm_migration::prelude::*;

use crate::common::{
    bigint, bytes, id, id_null, index, json_null, seq_pk, str_len, str_len_null, text_null, ts,
    ts_null, unique_index, uuid, uuid_null,
};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum EventLog {
    Table,
    Seq,
    Id,
    WorkspaceId,
    IdempotencyKey,
    EventType,
    Source,
    EventTime,
    BotId,
    ConversationId,
    ThreadId,
    ActorType,
    ActorId,
    ActorName,
    SubjectType,
    SubjectId,
    InputSummary,
    Envelope,
    RawRef,
    Status,
    Reason,
    RunId,
    RunnerId,
    ClaimedByRunId,
    Metadata,
    CreatedAt,
    UpdatedAt,
}

#[derive(DeriveIden)]
enum Outbox {
    Table,
    Id,
    Exchange,
    RoutingKey,
    Body,
    Headers,
    CreatedAt,
    AvailableAt,
    LockedUntil,
    PublishedAt,
    Attempts,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(EventLog::Table)
                    .col(seq_pk(EventLog::Seq))
                    .col(uuid(EventLog::Id).unique_key())
                    .col(id(EventLog::WorkspaceId))
                    // 1–128 chars of [A-Za-z0-9-_.:] (validated by the gateway).
                    .col(str_len_null(EventLog::IdempotencyKey, 128))
                    .col(str_len(EventLog::EventType, 100))
                    .col(str_len(EventLog::Source, 50))
                    .col(ts_null(EventLog::EventTime))
                    .col(id_null(EventLog::BotId))
                    .col(id_null(EventLog::ConversationId))
                    .col(id_null(EventLog::ThreadId))
                    .col(str_len_null(EventLog::ActorType, 50))
                    .col(id_null(EventLog::ActorId))
                    .col(id_null(EventLog::ActorName))
                    .col(str_len_null(EventLog::SubjectType, 50))
                    .col(id_null(EventLog::SubjectId))
                    // At most 1000 characters (cut by the store).
                    .col(text_null(EventLog::InputSummary))
                    .col(json_null(EventLog::Envelope))
                    .col(id_null(EventLog::RawRef))
                    // received/dispatched/claimed/unrouted/rejected/scheduled
                    .col(str_len(EventLog::Status, 32))
                    .col(text_null(EventLog::Reason))
                    .col(uuid_null(EventLog::RunId))
                    .col(id_null(EventLog::RunnerId))
                    .col(uuid_null(EventLog::ClaimedByRunId))
                    .col(json_null(EventLog::Metadata))
                    .col(ts(EventLog::CreatedAt))
                    .col(ts(EventLog::UpdatedAt))
                    .to_owned(),
            )
            .await?;
        // NULL keys are distinct on both backends, so events without a key never collide.
        manager
            .create_index(unique_index(
                "ux_event_log_workspace_idempotency",
                EventLog::Table,
                [EventLog::WorkspaceId, EventLog::IdempotencyKey],
            ))
            .await?;
        manager
            .create_index(index(
                "ix_event_log_conversation_seq",
                EventLog::Table,
                [
                    EventLog::WorkspaceId,
                    EventLog::ConversationId,
                    EventLog::Seq,
                ],
            ))
            .await?;
        manager
            .create_index(index(
                "ix_event_log_created",
                EventLog::Table,
                [EventLog::CreatedAt],
            ))
            .await?;
        manager
            .create_index(index(
                "ix_event_log_run",
                EventLog::Table,
                [EventLog::RunId],
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Outbox::Table)
                    .col(seq_pk(Outbox::Id))
                    .col(id(Outbox::Exchange))
                    .col(id(Outbox::RoutingKey))
                    .col(bytes(Outbox::Body))
                    .col(json_null(Outbox::Headers))
                    .col(ts(Outbox::CreatedAt))
                    .col(ts(Outbox::AvailableAt))
                    .col(ts_null(Outbox::LockedUntil))
                    .col(ts_null(Outbox::PublishedAt))
                    .col(bigint(Outbox::Attempts).default(0))
                    .to_owned(),
            )
            .await?;
        // The relay only ever scans unpublished rows; a partial index keeps that scan small
        // however many published rows are waiting for cleanup.
        manager
            .create_index(
                index(
                    "ix_outbox_unpublished",
                    Outbox::Table,
                    [Outbox::AvailableAt, Outbox::Id],
                )
                .and_where(Expr::col(Outbox::PublishedAt).is_null())
                .take(),
            )
            .await?;
        manager
            .create_index(index(
                "ix_outbox_published",
                Outbox::Table,
                [Outbox::PublishedAt],
            ))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Outbox::Table).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(EventLog::Table).to_owned())
            .await
    }
}
