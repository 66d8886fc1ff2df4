//! `runs` table.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "runs")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: Uuid,
    pub workspace_id: String,
    pub event_id: Uuid,
    pub agent_id: Option<Uuid>,
    pub runner_id: String,
    pub pool: String,
    pub conversation_id: Option<String>,
    pub thread_id: Option<String>,
    pub bot_id: Option<String>,
    pub status: String,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub attempt: i64,
    pub worker_id: Option<String>,
    pub created_at: DateTimeUtc,
    pub started_at: Option<DateTimeUtc>,
    pub ended_at: Option<DateTimeUtc>,
    pub deadline_at: Option<DateTimeUtc>,
    pub cancel_requested_at: Option<DateTimeUtc>,
    pub cancel_reason: Option<String>,
    pub last_sequence: i64,
    #[sea_orm(column_type = "JsonBinary", nullable)]
    pub usage: Option<Json>,
    pub events_expired_at: Option<DateTimeUtc>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
