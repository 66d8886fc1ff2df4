//! API key roles (SPEC §14): `api_keys.role`, `admin` (every route, including agents, the
//! resource registry, schedules and keys) or `client` (what an application needs: events,
//! runs, turns, sessions, conversations, streams).
//!
//! The column is not null with `'admin'` as its default, so every key that existed before
//! this migration keeps exactly the power it had (before roles, every key could do
//! everything) without a data migration. New keys always get an explicit role from the store.

use sea_orm_migration::prelude::*;

use crate::common::str_len;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum ApiKeys {
    Table,
    Role,
}

/// Longest role name the column holds (`admin`, `client`, with room for a later one).
const ROLE_LEN: u32 = 16;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(ApiKeys::Table)
                    .add_column(str_len(ApiKeys::Role, ROLE_LEN).default("admin"))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(ApiKeys::Table)
                    .drop_column(ApiKeys::Role)
                    .to_owned(),
            )
            .await
    }
}
