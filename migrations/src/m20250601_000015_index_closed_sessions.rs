//! An index on `turn_sessions.closed_at` for retention (issue 14): the identities of sessions
//! closed more than `retention.closed_session_identities` ago are deleted in batches, each
//! batch a range read of this index instead of a scan of every session.

use sea_orm_migration::prelude::*;

use crate::common::index;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum TurnSessions {
    Table,
    ClosedAt,
}

const INDEX: &str = "ix_turn_sessions_closed";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_index(index(INDEX, TurnSessions::Table, [TurnSessions::ClosedAt]))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_index(
                Index::drop()
                    .name(INDEX)
                    .table(TurnSessions::Table)
                    .to_owned(),
            )
            .await
    }
}
