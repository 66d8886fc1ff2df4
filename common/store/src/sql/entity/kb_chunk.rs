//! `kb_chunks` table (the generated `content_tsv` column of Postgres is left out: it is
//! only read by search SQL).

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "kb_chunks")]
pub struct Model {
    #[sea_orm(primary_key)]
    pub seq: i64,
    pub id: Uuid,
    pub document_id: Uuid,
    pub kb_id: Uuid,
    pub workspace_id: String,
    pub chunk_index: i64,
    pub content: String,
    #[sea_orm(column_type = "JsonBinary", nullable)]
    pub metadata: Option<Json>,
    pub created_at: DateTimeUtc,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
