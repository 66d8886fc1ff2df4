//! `artifacts` table.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "artifacts")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub workspace_id: String,
    pub artifact_type: String,
    pub mime_type: Option<String>,
    pub name: Option<String>,
    pub size_bytes: Option<i64>,
    pub sha256: Option<String>,
    pub source: String,
    pub scope: String,
    pub storage_type: String,
    pub storage_key: Option<String>,
    pub conversation_id: Option<String>,
    pub thread_id: Option<String>,
    pub bot_id: Option<String>,
    pub run_id: Option<Uuid>,
    pub runner_id: Option<String>,
    #[sea_orm(column_type = "JsonBinary", nullable)]
    pub metadata: Option<Json>,
    pub expires_at: Option<DateTimeUtc>,
    pub created_at: DateTimeUtc,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
