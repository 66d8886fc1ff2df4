//! `event_log` table.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "event_log")]
pub struct Model {
    #[sea_orm(primary_key)]
    pub seq: i64,
    pub id: Uuid,
    pub workspace_id: String,
    pub idempotency_key: Option<String>,
    pub request_hash: Option<String>,
    pub event_type: String,
    pub source: String,
    pub event_time: Option<DateTimeUtc>,
    pub bot_id: Option<String>,
    pub conversation_id: Option<String>,
    pub thread_id: Option<String>,
    pub actor_type: Option<String>,
    pub actor_id: Option<String>,
    pub actor_name: Option<String>,
    pub subject_type: Option<String>,
    pub subject_id: Option<String>,
    pub input_summary: Option<String>,
    #[sea_orm(column_type = "JsonBinary", nullable)]
    pub envelope: Option<Json>,
    pub raw_ref: Option<String>,
    pub status: String,
    pub reason: Option<String>,
    pub run_id: Option<Uuid>,
    pub runner_id: Option<String>,
    pub claimed_by_run_id: Option<Uuid>,
    #[sea_orm(column_type = "JsonBinary", nullable)]
    pub metadata: Option<Json>,
    pub created_at: DateTimeUtc,
    pub updated_at: DateTimeUtc,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
