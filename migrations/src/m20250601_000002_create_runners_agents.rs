//! Runner descriptors registered by workers, and product-level agents (SPEC §5).

use sea_orm_migration::prelude::*;

use crate::common::{
    boolean, id, id_null, index, json, str_len, text_null, ts, unique_index, uuid,
};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Runners {
    Table,
    Id,
    PluginId,
    Pool,
    Version,
    Descriptor,
    SeenAt,
}

#[derive(DeriveIden)]
enum Agents {
    Table,
    Id,
    WorkspaceId,
    Name,
    Description,
    RunnerId,
    RunnerConfig,
    EventTypes,
    Scope,
    BotId,
    Channel,
    ConversationId,
    ActorId,
    Filters,
    ResourcePolicy,
    StatePolicy,
    DeliveryPolicy,
    Enabled,
    CreatedAt,
    UpdatedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Runners::Table)
                    // `plugin:<author>/<plugin>/<runner>`
                    .col(id(Runners::Id).primary_key())
                    .col(id(Runners::PluginId))
                    .col(id(Runners::Pool))
                    .col(str_len(Runners::Version, 64))
                    .col(json(Runners::Descriptor))
                    .col(ts(Runners::SeenAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index("ix_runners_pool", Runners::Table, [Runners::Pool]))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Agents::Table)
                    .col(uuid(Agents::Id).primary_key())
                    .col(id(Agents::WorkspaceId))
                    .col(id(Agents::Name))
                    .col(text_null(Agents::Description))
                    .col(id(Agents::RunnerId))
                    .col(json(Agents::RunnerConfig))
                    .col(json(Agents::EventTypes))
                    .col(json(Agents::Scope))
                    // Denormalised from `scope` so the resolver can prefilter in SQL.
                    .col(id_null(Agents::BotId))
                    .col(id_null(Agents::Channel))
                    .col(id_null(Agents::ConversationId))
                    .col(id_null(Agents::ActorId))
                    .col(json(Agents::Filters))
                    .col(json(Agents::ResourcePolicy))
                    .col(json(Agents::StatePolicy))
                    .col(json(Agents::DeliveryPolicy))
                    .col(boolean(Agents::Enabled))
                    .col(ts(Agents::CreatedAt))
                    .col(ts(Agents::UpdatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(unique_index(
                "ux_agents_workspace_name",
                Agents::Table,
                [Agents::WorkspaceId, Agents::Name],
            ))
            .await?;
        manager
            .create_index(index(
                "ix_agents_workspace_enabled",
                Agents::Table,
                [Agents::WorkspaceId, Agents::Enabled],
            ))
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Agents::Table).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(Runners::Table).to_owned())
            .await
    }
}
