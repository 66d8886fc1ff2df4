//! `outbox` table.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "outbox")]
pub struct Model {
    #[sea_orm(primary_key)]
    pub id: i64,
    pub exchange: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    #[sea_orm(column_type = "JsonBinary", nullable)]
    pub headers: Option<Json>,
    pub created_at: DateTimeUtc,
    pub available_at: DateTimeUtc,
    pub locked_until: Option<DateTimeUtc>,
    pub published_at: Option<DateTimeUtc>,
    pub attempts: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
