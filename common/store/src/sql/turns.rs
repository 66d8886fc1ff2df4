//! [`TurnStore`] on SQL.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::{AgentId, EventId, RunId, WorkspaceId};
use sea_orm::sea_query::{Expr, ExprTrait as _, OnConflict, Query};
use sea_orm::{ColumnTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect, Set};
use uuid::Uuid;

use super::entity::{turn_idempotency, turn_session};
use super::events::append_in;
use super::{ID_LEN, SqlStore, UniqueRow, check_required, now, workspace};
use crate::error::{Result, StoreError};
use crate::events::is_valid_idempotency_key;
use crate::page::{
    CursorKind, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT, Page, clamp_limit, decode_key, encode_key,
};
use crate::turns::{
    NewTurn, NewTurnSession, TurnRecord, TurnSessionRecord, TurnStore, session_conversation_id,
};

fn session_record(m: turn_session::Model) -> Result<TurnSessionRecord> {
    Ok(TurnSessionRecord {
        id: m.id,
        workspace_id: workspace(m.workspace_id)?,
        agent_id: AgentId::from_uuid(m.agent_id),
        runner_id: m.runner_id,
        conversation_id: m.conversation_id,
        metadata: m.metadata,
        closed_at: m.closed_at,
        created_at: m.created_at,
    })
}

fn turn_record(m: turn_idempotency::Model) -> TurnRecord {
    TurnRecord {
        session_id: m.session_id,
        idempotency_key: m.idempotency_key,
        request_hash: m.request_hash,
        run_id: RunId::from_uuid(m.run_id),
        event_id: m.event_id.map(EventId::from_uuid),
        created_at: m.created_at,
    }
}

fn session_cursor(record: &TurnSessionRecord) -> String {
    encode_key(CursorKind::Session, &record.id.to_string())
}

/// The stored identity of `(session, key)` against the fingerprint asked with it: the same
/// turn, or `conflict`.
fn replay(existing: turn_idempotency::Model, request_hash: &str) -> Result<(TurnRecord, bool)> {
    if existing.request_hash == request_hash {
        Ok((turn_record(existing), false))
    } else {
        Err(StoreError::Conflict(
            "this idempotency key was already used with a different request in this session".into(),
        ))
    }
}

#[async_trait]
impl TurnStore for SqlStore {
    async fn create_session(&self, session: NewTurnSession) -> Result<TurnSessionRecord> {
        check_required("runner_id", &session.runner_id, ID_LEN)?;
        if session.metadata.as_ref().is_some_and(|m| !m.is_object()) {
            return Err(StoreError::invalid("`metadata` must be a JSON object"));
        }
        let id = Uuid::now_v7();
        let row = turn_session::ActiveModel {
            id: Set(id),
            workspace_id: Set(session.workspace_id.as_str().to_owned()),
            agent_id: Set(session.agent_id.into_uuid()),
            conversation_id: Set(session_conversation_id(id)),
            metadata: Set(session.metadata),
            closed_at: Set(None),
            created_at: Set(now()),
            runner_id: Set(Some(session.runner_id)),
        };
        let model = turn_session::Entity::insert(row)
            .exec_with_returning(self.writer())
            .await?;
        session_record(model)
    }

    async fn get_session(
        &self,
        workspace_id: &WorkspaceId,
        id: Uuid,
    ) -> Result<Option<TurnSessionRecord>> {
        turn_session::Entity::find_by_id(id)
            .filter(turn_session::Column::WorkspaceId.eq(workspace_id.as_str()))
            .all(&self.db)
            .await?
            .unique_row()
            .map(session_record)
            .transpose()
    }

    async fn list_sessions(
        &self,
        workspace_id: &WorkspaceId,
        cursor: Option<String>,
        limit: Option<i64>,
    ) -> Result<Page<TurnSessionRecord>> {
        let limit = clamp_limit(limit, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT);
        let mut select = turn_session::Entity::find()
            .filter(turn_session::Column::WorkspaceId.eq(workspace_id.as_str()));
        if let Some(cursor) = cursor {
            let after = Uuid::parse_str(&decode_key(CursorKind::Session, &cursor)?)
                .map_err(|_| StoreError::invalid("invalid cursor"))?;
            select = select.filter(turn_session::Column::Id.gt(after));
        }
        let records = select
            .order_by_asc(turn_session::Column::Id)
            .limit(limit + 1)
            .all(&self.db)
            .await?
            .into_iter()
            .map(session_record)
            .collect::<Result<Vec<_>>>()?;
        Ok(Page::from_overfetch(records, limit, session_cursor))
    }

    async fn close_session(
        &self,
        workspace_id: &WorkspaceId,
        id: Uuid,
    ) -> Result<Option<TurnSessionRecord>> {
        turn_session::Entity::update_many()
            .col_expr(turn_session::Column::ClosedAt, Expr::value(Some(now())))
            .filter(turn_session::Column::Id.eq(id))
            .filter(turn_session::Column::WorkspaceId.eq(workspace_id.as_str()))
            .filter(turn_session::Column::ClosedAt.is_null())
            .exec(self.writer())
            .await?;
        self.get_session(workspace_id, id).await
    }

    async fn start_turn(&self, turn: NewTurn) -> Result<(TurnRecord, bool)> {
        if !is_valid_idempotency_key(&turn.idempotency_key) {
            return Err(StoreError::invalid(
                "invalid `idempotency_key`: must be 1-128 characters of [A-Za-z0-9-_.:]",
            ));
        }
        let workspace_id = turn.event.workspace_id.as_str().to_owned();
        let event_id = turn.event.id.unwrap_or_default();
        let txn = self.write_txn().await?;
        let session = turn_session::Entity::find_by_id(turn.session_id)
            .filter(turn_session::Column::WorkspaceId.eq(workspace_id))
            .all(&txn)
            .await?
            .unique_row()
            .ok_or_else(|| {
                StoreError::NotFound(format!("session {} not found", turn.session_id))
            })?;
        let find_existing = || {
            turn_idempotency::Entity::find()
                .filter(turn_idempotency::Column::SessionId.eq(turn.session_id))
                .filter(turn_idempotency::Column::IdempotencyKey.eq(turn.idempotency_key.clone()))
        };
        if let Some(existing) = find_existing().all(&txn).await?.unique_row() {
            return replay(existing, &turn.request_hash);
        }
        if session.closed_at.is_some() {
            return Err(StoreError::Conflict(format!(
                "session {} is closed and takes no new turns",
                turn.session_id
            )));
        }
        let row = turn_idempotency::ActiveModel {
            session_id: Set(turn.session_id),
            idempotency_key: Set(turn.idempotency_key.clone()),
            request_hash: Set(turn.request_hash.clone()),
            run_id: Set(turn.run_id.into_uuid()),
            created_at: Set(now()),
            event_id: Set(Some(event_id.into_uuid())),
        };
        // A racing start with the same key (Postgres: waits for the winner's commit) ends
        // with one identity; the loser answers from the winner's row.
        let inserted = turn_idempotency::Entity::insert(row)
            .on_conflict(
                OnConflict::columns([
                    turn_idempotency::Column::SessionId,
                    turn_idempotency::Column::IdempotencyKey,
                ])
                .do_nothing()
                .to_owned(),
            )
            .exec_with_returning_many(&txn)
            .await?;
        let Some(model) = inserted.into_iter().next() else {
            let existing = find_existing()
                .all(&txn)
                .await?
                .unique_row()
                .ok_or_else(|| StoreError::Corrupt("turn conflict without a stored turn".into()))?;
            return replay(existing, &turn.request_hash);
        };
        let mut event = turn.event;
        event.id = Some(event_id);
        append_in(&txn, event, turn.outbox).await?;
        txn.commit().await?;
        Ok((turn_record(model), true))
    }

    async fn get_turn(&self, run_id: RunId) -> Result<Option<TurnRecord>> {
        Ok(turn_idempotency::Entity::find()
            .filter(turn_idempotency::Column::RunId.eq(run_id.into_uuid()))
            .all(&self.db)
            .await?
            .unique_row()
            .map(turn_record))
    }

    async fn delete_closed_identities(
        &self,
        closed_before: DateTime<Utc>,
        batch: u64,
    ) -> Result<u64> {
        // The turn id is unique (`ux_turn_idempotency_run`), so a batch is a list of them.
        let victims = Query::select()
            .column((turn_idempotency::Entity, turn_idempotency::Column::RunId))
            .from(turn_idempotency::Entity)
            .inner_join(
                turn_session::Entity,
                Expr::col((turn_session::Entity, turn_session::Column::Id)).equals((
                    turn_idempotency::Entity,
                    turn_idempotency::Column::SessionId,
                )),
            )
            .and_where(
                Expr::col((turn_session::Entity, turn_session::Column::ClosedAt)).lt(closed_before),
            )
            .limit(Ord::max(batch, 1))
            .to_owned();
        let res = turn_idempotency::Entity::delete_many()
            .filter(turn_idempotency::Column::RunId.in_subquery(victims))
            .exec(self.writer())
            .await?;
        Ok(res.rows_affected)
    }
}
