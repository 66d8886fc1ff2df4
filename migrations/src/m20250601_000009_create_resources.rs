//! Workspace resources behind the Host API (SPEC §8): models, tools and knowledge bases
//! (documents and full-text indexed chunks).

use sea_orm_migration::prelude::*;

use crate::common::{
    bigint, bigint_null, boolean, create_full_text, drop_full_text, id, id_null, index, json,
    json_null, seq_pk, str_len, text, text_null, ts, unique_index, uuid,
};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Models {
    Table,
    Id,
    WorkspaceId,
    Name,
    Kind,
    BaseUrl,
    Model,
    ApiKeyEnv,
    ContextWindow,
    Abilities,
    ExtraArgs,
    Enabled,
    CreatedAt,
    UpdatedAt,
}

#[derive(DeriveIden)]
enum Tools {
    Table,
    Id,
    WorkspaceId,
    Name,
    Kind,
    Description,
    Parameters,
    Config,
    Enabled,
    CreatedAt,
    UpdatedAt,
}

#[derive(DeriveIden)]
enum KnowledgeBases {
    Table,
    Id,
    WorkspaceId,
    Name,
    Description,
    Config,
    CreatedAt,
    UpdatedAt,
}

#[derive(DeriveIden)]
enum KbDocuments {
    Table,
    Id,
    KbId,
    WorkspaceId,
    Name,
    MimeType,
    SizeBytes,
    Sha256,
    ArtifactId,
    Status,
    Error,
    Metadata,
    CreatedAt,
    UpdatedAt,
}

#[derive(DeriveIden)]
enum KbChunks {
    Table,
    Seq,
    Id,
    DocumentId,
    KbId,
    WorkspaceId,
    ChunkIndex,
    Content,
    Metadata,
    CreatedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Models::Table)
                    .col(uuid(Models::Id).primary_key())
                    .col(id(Models::WorkspaceId))
                    .col(id(Models::Name))
                    // chat/rerank/embedding
                    .col(str_len(Models::Kind, 32))
                    // OpenAI-compatible endpoint base URL
                    .col(text(Models::BaseUrl))
                    // the provider's model name
                    .col(id(Models::Model))
                    // name of the environment variable holding the API key (never the key)
                    .col(id_null(Models::ApiKeyEnv))
                    .col(bigint_null(Models::ContextWindow))
                    // e.g. ["func_call", "vision"]
                    .col(json(Models::Abilities))
                    .col(json_null(Models::ExtraArgs))
                    .col(boolean(Models::Enabled))
                    .col(ts(Models::CreatedAt))
                    .col(ts(Models::UpdatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(unique_index(
                "ux_models_workspace_name",
                Models::Table,
                [Models::WorkspaceId, Models::Name],
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Tools::Table)
                    .col(uuid(Tools::Id).primary_key())
                    .col(id(Tools::WorkspaceId))
                    .col(id(Tools::Name))
                    // http/mcp
                    .col(str_len(Tools::Kind, 32))
                    .col(text(Tools::Description))
                    // JSON schema of the call parameters
                    .col(json(Tools::Parameters))
                    // kind-specific: url, timeout, headers, response cap, …
                    .col(json(Tools::Config))
                    .col(boolean(Tools::Enabled))
                    .col(ts(Tools::CreatedAt))
                    .col(ts(Tools::UpdatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(unique_index(
                "ux_tools_workspace_name",
                Tools::Table,
                [Tools::WorkspaceId, Tools::Name],
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(KnowledgeBases::Table)
                    .col(uuid(KnowledgeBases::Id).primary_key())
                    .col(id(KnowledgeBases::WorkspaceId))
                    .col(id(KnowledgeBases::Name))
                    .col(text_null(KnowledgeBases::Description))
                    // chunking and retrieval settings
                    .col(json_null(KnowledgeBases::Config))
                    .col(ts(KnowledgeBases::CreatedAt))
                    .col(ts(KnowledgeBases::UpdatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(unique_index(
                "ux_knowledge_bases_workspace_name",
                KnowledgeBases::Table,
                [KnowledgeBases::WorkspaceId, KnowledgeBases::Name],
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(KbDocuments::Table)
                    .col(uuid(KbDocuments::Id).primary_key())
                    .col(uuid(KbDocuments::KbId))
                    .col(id(KbDocuments::WorkspaceId))
                    .col(id(KbDocuments::Name))
                    .col(id_null(KbDocuments::MimeType))
                    .col(bigint(KbDocuments::SizeBytes))
                    .col(str_len(KbDocuments::Sha256, 64))
                    // the uploaded original, when kept
                    .col(id_null(KbDocuments::ArtifactId))
                    // pending/ready/failed
                    .col(str_len(KbDocuments::Status, 32))
                    .col(text_null(KbDocuments::Error))
                    .col(json_null(KbDocuments::Metadata))
                    .col(ts(KbDocuments::CreatedAt))
                    .col(ts(KbDocuments::UpdatedAt))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_kb_documents_kb")
                            .from(KbDocuments::Table, KbDocuments::KbId)
                            .to(KnowledgeBases::Table, KnowledgeBases::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "ix_kb_documents_kb",
                KbDocuments::Table,
                [KbDocuments::KbId],
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(KbChunks::Table)
                    .col(seq_pk(KbChunks::Seq))
                    .col(uuid(KbChunks::Id).unique_key())
                    .col(uuid(KbChunks::DocumentId))
                    .col(uuid(KbChunks::KbId))
                    .col(id(KbChunks::WorkspaceId))
                    .col(bigint(KbChunks::ChunkIndex))
                    .col(text(KbChunks::Content))
                    .col(json_null(KbChunks::Metadata))
                    .col(ts(KbChunks::CreatedAt))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_kb_chunks_document")
                            .from(KbChunks::Table, KbChunks::DocumentId)
                            .to(KbDocuments::Table, KbDocuments::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(unique_index(
                "ux_kb_chunks_document_index",
                KbChunks::Table,
                [KbChunks::DocumentId, KbChunks::ChunkIndex],
            ))
            .await?;
        manager
            .create_index(index("ix_kb_chunks_kb", KbChunks::Table, [KbChunks::KbId]))
            .await?;
        create_full_text(manager, "kb_chunks", "content", "seq").await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        drop_full_text(manager, "kb_chunks").await?;
        for table in [
            KbChunks::Table.into_iden(),
            KbDocuments::Table.into_iden(),
            KnowledgeBases::Table.into_iden(),
            Tools::Table.into_iden(),
            Models::Table.into_iden(),
        ] {
            manager
                .drop_table(Table::drop().table(table).to_owned())
                .await?;
        }
        Ok(())
    }
}
