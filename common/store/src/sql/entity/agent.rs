//! `agents` table.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "agents")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: Uuid,
    pub workspace_id: String,
    pub name: String,
    pub description: Option<String>,
    pub runner_id: String,
    #[sea_orm(column_type = "JsonBinary")]
    pub runner_config: Json,
    #[sea_orm(column_type = "JsonBinary")]
    pub event_types: Json,
    #[sea_orm(column_type = "JsonBinary")]
    pub scope: Json,
    pub bot_id: Option<String>,
    pub channel: Option<String>,
    pub conversation_id: Option<String>,
    pub actor_id: Option<String>,
    #[sea_orm(column_type = "JsonBinary")]
    pub filters: Json,
    #[sea_orm(column_type = "JsonBinary")]
    pub resource_policy: Json,
    #[sea_orm(column_type = "JsonBinary")]
    pub state_policy: Json,
    #[sea_orm(column_type = "JsonBinary")]
    pub delivery_policy: Json,
    #[sea_orm(column_type = "JsonBinary")]
    pub budgets: Json,
    pub enabled: bool,
    pub routing: String,
    pub created_at: DateTimeUtc,
    pub updated_at: DateTimeUtc,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
