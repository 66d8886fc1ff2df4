//! `schedules` table.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "schedules")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: Uuid,
    pub workspace_id: String,
    pub name: Option<String>,
    pub kind: String,
    pub spec: String,
    #[sea_orm(column_type = "JsonBinary")]
    pub event: Json,
    pub next_fire_at: Option<DateTimeUtc>,
    pub last_fired_at: Option<DateTimeUtc>,
    pub enabled: bool,
    pub created_at: DateTimeUtc,
    pub updated_at: DateTimeUtc,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
