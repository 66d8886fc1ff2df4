//! Schedules (cron / interval / one-shot delayed events) and the turn API's sessions and
//! idempotency records (SPEC §10.2).

use sea_orm_migration::prelude::*;

use crate::common::{
    boolean, id, id_null, index, json, json_null, str_len, text, ts, ts_null, uuid,
};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Schedules {
    Table,
    Id,
    WorkspaceId,
    Name,
    Kind,
    Spec,
    Event,
    NextFireAt,
    LastFiredAt,
    Enabled,
    CreatedAt,
    UpdatedAt,
}

#[derive(DeriveIden)]
enum TurnSessions {
    Table,
    Id,
    WorkspaceId,
    AgentId,
    ConversationId,
    Metadata,
    ClosedAt,
    CreatedAt,
}

#[derive(DeriveIden)]
enum TurnIdempotency {
    Table,
    SessionId,
    IdempotencyKey,
    RequestHash,
    RunId,
    CreatedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Schedules::Table)
                    .col(uuid(Schedules::Id).primary_key())
                    .col(id(Schedules::WorkspaceId))
                    .col(id_null(Schedules::Name))
                    // cron/interval/once
                    .col(str_len(Schedules::Kind, 16))
                    // cron expression, interval (humantime) or RFC 3339 instant
                    .col(text(Schedules::Spec))
                    // the event to ingest when the schedule fires
                    .col(json(Schedules::Event))
                    .col(ts_null(Schedules::NextFireAt))
                    .col(ts_null(Schedules::LastFiredAt))
                    .col(boolean(Schedules::Enabled))
                    .col(ts(Schedules::CreatedAt))
                    .col(ts(Schedules::UpdatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "ix_schedules_due",
                Schedules::Table,
                [Schedules::Enabled, Schedules::NextFireAt],
            ))
            .await?;
        manager
            .create_index(index(
                "ix_schedules_workspace",
                Schedules::Table,
                [Schedules::WorkspaceId],
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(TurnSessions::Table)
                    .col(uuid(TurnSessions::Id).primary_key())
                    .col(id(TurnSessions::WorkspaceId))
                    .col(uuid(TurnSessions::AgentId))
                    // the conversation this session's turns run in
                    .col(id(TurnSessions::ConversationId))
                    .col(json_null(TurnSessions::Metadata))
                    .col(ts_null(TurnSessions::ClosedAt))
                    .col(ts(TurnSessions::CreatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "ix_turn_sessions_workspace_created",
                TurnSessions::Table,
                [TurnSessions::WorkspaceId, TurnSessions::CreatedAt],
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(TurnIdempotency::Table)
                    .col(uuid(TurnIdempotency::SessionId))
                    .col(str_len(TurnIdempotency::IdempotencyKey, 128))
                    // sha256 hex of the normalised request: same key + other request → 409
                    .col(str_len(TurnIdempotency::RequestHash, 64))
                    .col(uuid(TurnIdempotency::RunId))
                    .col(ts(TurnIdempotency::CreatedAt))
                    .primary_key(
                        Index::create()
                            .name("pk_turn_idempotency")
                            .col(TurnIdempotency::SessionId)
                            .col(TurnIdempotency::IdempotencyKey),
                    )
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_turn_idempotency_session")
                            .from(TurnIdempotency::Table, TurnIdempotency::SessionId)
                            .to(TurnSessions::Table, TurnSessions::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(TurnIdempotency::Table).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(TurnSessions::Table).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(Schedules::Table).to_owned())
            .await
    }
}
