//! Per-agent budget overrides (SPEC §8): `agents.budgets`, a JSON object holding the budgets
//! the agent sets (`max_model_calls`, `max_tool_calls`, `max_tool_result_chars`,
//! `max_model_output_chars`); a budget it leaves out keeps the host default.
//!
//! The column is not null with `{}` as its default, so every agent that existed before this
//! migration keeps exactly the budgets it had (the defaults) without a data migration.

use sea_orm_migration::prelude::*;

use crate::common::json;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Agents {
    Table,
    Budgets,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // `'{}'` is a JSON object literal on both backends (`jsonb` on Postgres casts it,
        // SQLite keeps it as text).
        manager
            .alter_table(
                Table::alter()
                    .table(Agents::Table)
                    .add_column(json(Agents::Budgets).default("{}"))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Agents::Table)
                    .drop_column(Agents::Budgets)
                    .to_owned(),
            )
            .await
    }
}
