//! Scoped agent state (small JSON with a CAS revision) and plugin/workspace binary storage.

use sea_orm_migration::prelude::*;

use crate::common::{bigint, bytes, id, json, ordered_key, str_len, ts};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum AgentState {
    Table,
    ScopeKey,
    Key,
    Scope,
    Value,
    Revision,
    CreatedAt,
    UpdatedAt,
}

#[derive(DeriveIden)]
enum Storage {
    Table,
    OwnerType,
    Owner,
    Key,
    Value,
    UpdatedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let backend = manager.get_database_backend();
        manager
            .create_table(
                Table::create()
                    .table(AgentState::Table)
                    // `<scope>:v2:<sha256 hex>`
                    .col(str_len(AgentState::ScopeKey, 512))
                    .col(ordered_key(AgentState::Key, 255, backend))
                    // conversation/actor/subject/runner
                    .col(str_len(AgentState::Scope, 32))
                    .col(json(AgentState::Value))
                    // 1 on insert, +1 on every write; compare-and-set token.
                    .col(bigint(AgentState::Revision))
                    .col(ts(AgentState::CreatedAt))
                    .col(ts(AgentState::UpdatedAt))
                    .primary_key(
                        Index::create()
                            .name("pk_agent_state")
                            .col(AgentState::ScopeKey)
                            .col(AgentState::Key),
                    )
                    .to_owned(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Storage::Table)
                    // plugin/workspace
                    .col(str_len(Storage::OwnerType, 32))
                    .col(id(Storage::Owner))
                    .col(ordered_key(Storage::Key, 255, backend))
                    .col(bytes(Storage::Value))
                    .col(ts(Storage::UpdatedAt))
                    .primary_key(
                        Index::create()
                            .name("pk_storage")
                            .col(Storage::OwnerType)
                            .col(Storage::Owner)
                            .col(Storage::Key),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Storage::Table).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(AgentState::Table).to_owned())
            .await
    }
}
