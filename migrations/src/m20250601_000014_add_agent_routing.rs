//! How an agent is reached (issue 14 item 6): `agents.routing`, `scope` or `direct`.
//!
//! A `scope` agent is a candidate of scope resolution (SPEC §5), as every agent was before
//! this migration; a `direct` agent is reached only when a request names it (`agent_id` on
//! `POST /v1/events`, or a session's turns) and never takes part in scope resolution or in
//! its conflict rule, so any number of them can sit beside one workspace-wide agent.
//!
//! The column is not null with `scope` as its default, so every existing agent keeps
//! exactly the routing it had without a data migration. (An event's explicit target is
//! part of its envelope, `metadata.target`, which the event log already keeps whole: no
//! column is needed for it.)

use sea_orm_migration::prelude::*;

use crate::common::str_len;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Agents {
    Table,
    Routing,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Agents::Table)
                    .add_column(str_len(Agents::Routing, 16).default("scope"))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Agents::Table)
                    .drop_column(Agents::Routing)
                    .to_owned(),
            )
            .await
    }
}
