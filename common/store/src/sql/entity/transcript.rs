//! `transcript` table.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "transcript")]
pub struct Model {
    #[sea_orm(primary_key)]
    pub seq: i64,
    pub id: String,
    pub workspace_id: String,
    pub conversation_id: String,
    pub thread_id: Option<String>,
    pub bot_id: Option<String>,
    pub event_id: String,
    pub run_id: Option<Uuid>,
    pub runner_id: Option<String>,
    pub role: String,
    pub item_type: String,
    pub content: Option<String>,
    #[sea_orm(column_type = "JsonBinary", nullable)]
    pub content_json: Option<Json>,
    #[sea_orm(column_type = "JsonBinary", nullable)]
    pub artifact_refs: Option<Json>,
    #[sea_orm(column_type = "JsonBinary", nullable)]
    pub metadata: Option<Json>,
    pub created_at: DateTimeUtc,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
