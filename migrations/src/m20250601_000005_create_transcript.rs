//! The conversation transcript (user, assistant and non-message items) with full-text search.
//!
//! `seq` is the primary key (and SQLite rowid, used by the FTS5 table); the transcript id is
//! a unique text column.

use sea_orm_migration::prelude::*;

use crate::common::{
    create_full_text, drop_full_text, id, id_null, index, json_null, seq_pk, str_len, text_null,
    ts, uuid_null,
};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Transcript {
    Table,
    Seq,
    Id,
    WorkspaceId,
    ConversationId,
    ThreadId,
    BotId,
    EventId,
    RunId,
    RunnerId,
    Role,
    ItemType,
    Content,
    ContentJson,
    ArtifactRefs,
    Metadata,
    CreatedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Transcript::Table)
                    .col(seq_pk(Transcript::Seq))
                    .col(id(Transcript::Id).unique_key())
                    .col(id(Transcript::WorkspaceId))
                    .col(id(Transcript::ConversationId))
                    .col(id_null(Transcript::ThreadId))
                    .col(id_null(Transcript::BotId))
                    .col(id(Transcript::EventId))
                    .col(uuid_null(Transcript::RunId))
                    .col(id_null(Transcript::RunnerId))
                    .col(str_len(Transcript::Role, 50))
                    .col(str_len(Transcript::ItemType, 50))
                    // At most 4000 characters (cut by the store); `content_json` keeps all.
                    .col(text_null(Transcript::Content))
                    .col(json_null(Transcript::ContentJson))
                    .col(json_null(Transcript::ArtifactRefs))
                    .col(json_null(Transcript::Metadata))
                    .col(ts(Transcript::CreatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "ix_transcript_conversation_seq",
                Transcript::Table,
                [
                    Transcript::WorkspaceId,
                    Transcript::ConversationId,
                    Transcript::Seq,
                ],
            ))
            .await?;
        manager
            .create_index(index(
                "ix_transcript_created",
                Transcript::Table,
                [Transcript::CreatedAt],
            ))
            .await?;
        manager
            .create_index(index(
                "ix_transcript_run",
                Transcript::Table,
                [Transcript::RunId],
            ))
            .await?;
        create_full_text(manager, "transcript", "content", "seq").await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        drop_full_text(manager, "transcript").await?;
        manager
            .drop_table(Table::drop().table(Transcript::Table).to_owned())
            .await
    }
}
