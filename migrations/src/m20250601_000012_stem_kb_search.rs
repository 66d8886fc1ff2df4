//! Knowledge base search that matches the way users ask (issue 13): the full-text index of
//! `kb_chunks.content` is rebuilt with English stemming ([`TextSearch::English`]: Postgres
//! `english`, SQLite FTS5 `porter`), so `refund` finds "Refunds are issued…" and `configure`
//! finds "configured". Every chunk stored before this migration is re-indexed in it.
//!
//! Transcript search keeps its exact-word index (`simple`): its contract is whole words.

use sea_orm_migration::prelude::*;

use crate::common::{TextSearch, rebuild_full_text};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        rebuild_full_text(manager, "kb_chunks", "content", "seq", TextSearch::English).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        rebuild_full_text(manager, "kb_chunks", "content", "seq", TextSearch::Simple).await
    }
}
