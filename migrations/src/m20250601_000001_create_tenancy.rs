//! Tenancy: workspaces and their API keys (SHA-256 hashes only; the plaintext is shown once).

use sea_orm_migration::prelude::*;

use crate::common::{id, index, str_len, str_len_null, ts, ts_null, uuid};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
pub enum Workspaces {
    Table,
    Id,
    CreatedAt,
}

#[derive(DeriveIden)]
enum ApiKeys {
    Table,
    Id,
    WorkspaceId,
    Name,
    KeyHash,
    Prefix,
    CreatedAt,
    RevokedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Workspaces::Table)
                    .col(id(Workspaces::Id).primary_key())
                    .col(ts(Workspaces::CreatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(ApiKeys::Table)
                    .col(uuid(ApiKeys::Id).primary_key())
                    .col(id(ApiKeys::WorkspaceId))
                    .col(str_len_null(ApiKeys::Name, 255))
                    // Lower-case hex SHA-256 of the plaintext key.
                    .col(str_len(ApiKeys::KeyHash, 64).unique_key())
                    // The first characters of the key, for humans telling keys apart.
                    .col(str_len(ApiKeys::Prefix, 32))
                    .col(ts(ApiKeys::CreatedAt))
                    .col(ts_null(ApiKeys::RevokedAt))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_api_keys_workspace")
                            .from(ApiKeys::Table, ApiKeys::WorkspaceId)
                            .to(Workspaces::Table, Workspaces::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "ix_api_keys_workspace",
                ApiKeys::Table,
                [ApiKeys::WorkspaceId],
            ))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(ApiKeys::Table).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(Workspaces::Table).to_owned())
            .await
    }
}
