//! Artifacts (metadata) and their inline bytes.

use sea_orm_migration::prelude::*;

use crate::common::{
    bigint_null, bytes, id, id_null, index, json_null, str_len, str_len_null, ts, ts_null,
    uuid_null,
};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Artifacts {
    Table,
    Id,
    WorkspaceId,
    ArtifactType,
    MimeType,
    Name,
    SizeBytes,
    Sha256,
    Source,
    Scope,
    StorageType,
    StorageKey,
    ConversationId,
    ThreadId,
    BotId,
    RunId,
    RunnerId,
    Metadata,
    ExpiresAt,
    CreatedAt,
}

#[derive(DeriveIden)]
enum ArtifactBlobs {
    Table,
    ArtifactId,
    Data,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Artifacts::Table)
                    .col(id(Artifacts::Id).primary_key())
                    .col(id(Artifacts::WorkspaceId))
                    .col(str_len(Artifacts::ArtifactType, 50))
                    .col(id_null(Artifacts::MimeType))
                    .col(id_null(Artifacts::Name))
                    .col(bigint_null(Artifacts::SizeBytes))
                    // Lower-case hex; verified against the bytes for inline artifacts.
                    .col(str_len_null(Artifacts::Sha256, 64))
                    .col(str_len(Artifacts::Source, 50))
                    // workspace/conversation/run/runner
                    .col(str_len(Artifacts::Scope, 32))
                    // inline (bytes in artifact_blobs), url, platform_ref, metadata_only
                    .col(str_len(Artifacts::StorageType, 32))
                    .col(ColumnDef::new(Artifacts::StorageKey).text().null())
                    .col(id_null(Artifacts::ConversationId))
                    .col(id_null(Artifacts::ThreadId))
                    .col(id_null(Artifacts::BotId))
                    .col(uuid_null(Artifacts::RunId))
                    .col(id_null(Artifacts::RunnerId))
                    .col(json_null(Artifacts::Metadata))
                    .col(ts_null(Artifacts::ExpiresAt))
                    .col(ts(Artifacts::CreatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "ix_artifacts_conversation",
                Artifacts::Table,
                [Artifacts::WorkspaceId, Artifacts::ConversationId],
            ))
            .await?;
        manager
            .create_index(index(
                "ix_artifacts_run",
                Artifacts::Table,
                [Artifacts::RunId],
            ))
            .await?;
        manager
            .create_index(index(
                "ix_artifacts_expires",
                Artifacts::Table,
                [Artifacts::ExpiresAt],
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(ArtifactBlobs::Table)
                    .col(id(ArtifactBlobs::ArtifactId).primary_key())
                    .col(bytes(ArtifactBlobs::Data))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_artifact_blobs_artifact")
                            .from(ArtifactBlobs::Table, ArtifactBlobs::ArtifactId)
                            .to(Artifacts::Table, Artifacts::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(ArtifactBlobs::Table).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(Artifacts::Table).to_owned())
            .await
    }
}
