//! [`EventLog`] and [`Outbox`] on SQL.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::{EventId, RunId};
use sea_orm::sea_query::{Expr, LockBehavior, LockType, OnConflict, Query};
use sea_orm::{
    ActiveModelTrait, ActiveValue::NotSet, ColumnTrait, Condition, ConnectionTrait,
    DatabaseTransaction, DbBackend, EntityTrait, FromQueryResult, IntoActiveModel, PaginatorTrait,
    QueryFilter, QueryOrder, QuerySelect, Set, Statement,
};
use serde_json::Value;

use super::entity::{event_log, outbox};
use super::{
    ID_LEN, SqlStore, UniqueRow, check_len, check_len_opt, check_required, metadata_in,
    metadata_out, now, workspace,
};
use crate::error::{Result, StoreError, is_unique_violation};
use crate::events::{
    EventLog, EventQuery, EventRecord, EventRouting, EventStatus, EventStatusUpdate,
    MAX_INPUT_SUMMARY_CHARS, NewEvent, NewOutboxMessage, Outbox, OutboxMessage,
    is_valid_idempotency_key, truncate_chars,
};
use crate::page::{
    CursorKind, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT, Page, ThreadFilter, clamp_limit, decode_seq,
    encode_seq,
};

/// `workspace_id, status, reason, run_id, claimed_by_run_id` of an event row.
type RoutingColumns = (
    String,
    String,
    Option<String>,
    Option<uuid::Uuid>,
    Option<uuid::Uuid>,
);

/// Largest outbox claim.
const MAX_OUTBOX_CLAIM: u64 = 1000;

fn validate_event(event: &NewEvent) -> Result<()> {
    check_required("event_type", &event.event_type, 100)?;
    check_required("source", &event.source, 50)?;
    if let Some(key) = &event.idempotency_key {
        if !is_valid_idempotency_key(key) {
            return Err(StoreError::invalid(
                "idempotency key must be 1-128 characters of [A-Za-z0-9-_.:]",
            ));
        }
    }
    for (field, value, max) in [
        ("bot_id", &event.bot_id, ID_LEN),
        ("conversation_id", &event.conversation_id, ID_LEN),
        ("thread_id", &event.thread_id, ID_LEN),
        ("actor_type", &event.actor_type, 50),
        ("actor_id", &event.actor_id, ID_LEN),
        ("actor_name", &event.actor_name, ID_LEN),
        ("subject_type", &event.subject_type, 50),
        ("subject_id", &event.subject_id, ID_LEN),
        ("raw_ref", &event.raw_ref, ID_LEN),
        ("runner_id", &event.runner_id, ID_LEN),
    ] {
        check_len_opt(field, value.as_deref(), max)?;
    }
    Ok(())
}

fn validate_outbox(message: &NewOutboxMessage) -> Result<()> {
    check_required("exchange", &message.exchange, ID_LEN)?;
    check_len("routing_key", &message.routing_key, ID_LEN)
}

pub(super) fn event_record(m: event_log::Model) -> Result<EventRecord> {
    Ok(EventRecord {
        id: EventId::from_uuid(m.id),
        cursor: encode_seq(CursorKind::Event, m.seq),
        seq: m.seq,
        workspace_id: workspace(m.workspace_id)?,
        idempotency_key: m.idempotency_key,
        event_type: m.event_type,
        source: m.source,
        event_time: m.event_time,
        bot_id: m.bot_id,
        conversation_id: m.conversation_id,
        thread_id: m.thread_id,
        actor_type: m.actor_type,
        actor_id: m.actor_id,
        actor_name: m.actor_name,
        subject_type: m.subject_type,
        subject_id: m.subject_id,
        input_summary: m.input_summary,
        envelope: m.envelope,
        raw_ref: m.raw_ref,
        status: m
            .status
            .parse()
            .map_err(|e: StoreError| StoreError::Corrupt(e.to_string()))?,
        reason: m.reason,
        run_id: m.run_id.map(RunId::from_uuid),
        runner_id: m.runner_id,
        claimed_by_run_id: m.claimed_by_run_id.map(RunId::from_uuid),
        metadata: metadata_out(m.metadata),
        created_at: m.created_at,
        updated_at: m.updated_at,
    })
}

fn outbox_message(m: outbox::Model) -> OutboxMessage {
    OutboxMessage {
        id: m.id,
        exchange: m.exchange,
        routing_key: m.routing_key,
        body: m.body,
        headers: m.headers,
        created_at: m.created_at,
        available_at: m.available_at,
        locked_until: m.locked_until,
        attempts: m.attempts,
    }
}

fn outbox_models(messages: Vec<NewOutboxMessage>, now: DateTime<Utc>) -> Vec<outbox::ActiveModel> {
    messages
        .into_iter()
        .map(|m| outbox::ActiveModel {
            id: NotSet,
            exchange: Set(m.exchange),
            routing_key: Set(m.routing_key),
            body: Set(m.body),
            headers: Set(m.headers),
            created_at: Set(now),
            available_at: Set(m.available_at.map_or(now, super::micros)),
            locked_until: Set(None),
            published_at: Set(None),
            attempts: Set(0),
        })
        .collect()
}

async fn insert_outbox<C: ConnectionTrait>(
    db: &C,
    messages: Vec<NewOutboxMessage>,
    now: DateTime<Utc>,
) -> Result<Vec<i64>> {
    if messages.is_empty() {
        return Ok(Vec::new());
    }
    let mut rows = outbox::Entity::insert_many(outbox_models(messages, now))
        .exec_with_returning(db)
        .await?;
    rows.sort_by_key(|m| m.id);
    Ok(rows.into_iter().map(|m| m.id).collect())
}

/// An event ready to append: its row and what resolving an idempotency conflict needs.
struct Append {
    row: event_log::ActiveModel,
    id: EventId,
    workspace_id: String,
    key: Option<String>,
    request_hash: Option<String>,
    now: DateTime<Utc>,
}

impl Append {
    /// Validates `event` and its `outbox` messages and builds the row.
    fn new(event: NewEvent, outbox: &[NewOutboxMessage]) -> Result<Self> {
        validate_event(&event)?;
        for message in outbox {
            validate_outbox(message)?;
        }
        let now = now();
        let id = event.id.unwrap_or_default();
        let workspace_id = event.workspace_id.as_str().to_owned();
        let key = event.idempotency_key.clone();
        let request_hash = event.request_hash.clone();
        let row = event_log::ActiveModel {
            seq: NotSet,
            id: Set(id.into_uuid()),
            workspace_id: Set(workspace_id.clone()),
            idempotency_key: Set(event.idempotency_key),
            request_hash: Set(event.request_hash),
            event_type: Set(event.event_type),
            source: Set(event.source),
            event_time: Set(event.event_time.map(super::micros)),
            bot_id: Set(event.bot_id),
            conversation_id: Set(event.conversation_id),
            thread_id: Set(event.thread_id),
            actor_type: Set(event.actor_type),
            actor_id: Set(event.actor_id),
            actor_name: Set(event.actor_name),
            subject_type: Set(event.subject_type),
            subject_id: Set(event.subject_id),
            input_summary: Set(event
                .input_summary
                .map(|s| truncate_chars(&s, MAX_INPUT_SUMMARY_CHARS))),
            envelope: Set(event.envelope),
            raw_ref: Set(event.raw_ref),
            status: Set(event.status.as_str().to_owned()),
            reason: Set(event.reason),
            run_id: Set(event.run_id.map(RunId::into_uuid)),
            runner_id: Set(event.runner_id),
            claimed_by_run_id: Set(event.claimed_by_run_id.map(RunId::into_uuid)),
            metadata: Set(metadata_in("metadata", event.metadata)?),
            created_at: Set(now),
            updated_at: Set(now),
        };
        Ok(Self {
            row,
            id,
            workspace_id,
            key,
            request_hash,
            now,
        })
    }

    /// The insert, `ON CONFLICT` on the idempotency index only: two appends with the same
    /// key (even racing ones, on Postgres the second waits for the first to commit) end with
    /// one row, and the loser reads the winner's event ([`Self::replay`]).
    fn insert(&self) -> sea_orm::Insert<event_log::ActiveModel> {
        event_log::Entity::insert(self.row.clone()).on_conflict(
            OnConflict::columns([
                event_log::Column::WorkspaceId,
                event_log::Column::IdempotencyKey,
            ])
            .do_nothing()
            .to_owned(),
        )
    }

    /// The error of a failed insert: a taken event id is a conflict.
    fn insert_error(&self, e: sea_orm::DbErr) -> StoreError {
        if is_unique_violation(&e) {
            StoreError::Conflict(format!("event {} already exists", self.id))
        } else {
            e.into()
        }
    }

    /// The event stored under this append's idempotency key (the insert did nothing): the
    /// same request again gets it back, another request with the key is a conflict.
    async fn replay<C: ConnectionTrait>(&self, db: &C) -> Result<event_log::Model> {
        let existing = event_log::Entity::find()
            .filter(event_log::Column::WorkspaceId.eq(self.workspace_id.clone()))
            .filter(event_log::Column::IdempotencyKey.eq(self.key.clone()))
            .all(db)
            .await?
            .unique_row()
            .ok_or_else(|| {
                StoreError::Corrupt("idempotency conflict without a stored event".into())
            })?;
        if let (Some(asked), Some(stored)) = (&self.request_hash, &existing.request_hash) {
            if asked != stored {
                return Err(StoreError::Conflict(
                    "this idempotency key was already used with a different request".into(),
                ));
            }
        }
        Ok(existing)
    }

    /// The event insert and its outbox rows as **one** Postgres statement (a data-modifying
    /// `WITH`): the outbox rows are written only if the event was, and the statement is
    /// atomic on its own, so an ingest costs one round trip and one commit instead of four
    /// (`BEGIN`, two inserts, `COMMIT`). It returns the event row, or no row on an
    /// idempotency conflict.
    fn postgres_statement(&self, outbox: Vec<NewOutboxMessage>) -> Statement {
        let mut insert = self.insert();
        sea_orm::QueryTrait::query(&mut insert).returning_all();
        let built = sea_orm::QueryTrait::build(&insert, DbBackend::Postgres);
        let mut values = built.values.map(|v| v.0).unwrap_or_default();
        let mut rows = Vec::with_capacity(outbox.len());
        for message in outbox {
            let available_at = message.available_at.map_or(self.now, super::micros);
            super::push_values_row(
                &mut rows,
                &mut values,
                vec![
                    (message.exchange.into(), "text"),
                    (message.routing_key.into(), "text"),
                    (message.body.into(), "bytea"),
                    (message.headers.into(), "jsonb"),
                    (self.now.into(), "timestamptz"),
                    (available_at.into(), "timestamptz"),
                ],
            );
        }
        let sql = if rows.is_empty() {
            built.sql
        } else {
            format!(
                "WITH e AS ({event}), o AS (INSERT INTO outbox (exchange, routing_key, body, \
                 headers, created_at, available_at, attempts) SELECT v.*, 0 FROM (VALUES \
                 {rows}) AS v WHERE EXISTS (SELECT 1 FROM e)) SELECT * FROM e",
                event = built.sql,
                rows = rows.join(", ")
            )
        };
        Statement::from_sql_and_values(DbBackend::Postgres, sql, values)
    }
}

/// [`EventLog::append`] inside the caller's write transaction `txn` (validation, the
/// idempotent insert, the outbox rows), so another write can commit or roll back with it:
/// a schedule's firing advances the schedule in the same transaction. Returns the stored
/// row and whether this call created it.
pub(super) async fn append_in(
    txn: &DatabaseTransaction,
    event: NewEvent,
    outbox: Vec<NewOutboxMessage>,
) -> Result<(event_log::Model, bool)> {
    let append = Append::new(event, &outbox)?;
    let inserted = append
        .insert()
        .exec_with_returning_many(txn)
        .await
        .map_err(|e| append.insert_error(e))?;
    Ok(match inserted.into_iter().next() {
        Some(model) => {
            insert_outbox(txn, outbox, append.now).await?;
            (model, true)
        }
        None => (append.replay(txn).await?, false),
    })
}

#[async_trait]
impl EventLog for SqlStore {
    async fn append(
        &self,
        event: NewEvent,
        outbox: Vec<NewOutboxMessage>,
    ) -> Result<(EventRecord, bool)> {
        if self.backend() == DbBackend::Postgres {
            let append = Append::new(event, &outbox)?;
            let row = self
                .writer()
                .query_one_raw(append.postgres_statement(outbox))
                .await
                .map_err(|e| append.insert_error(e))?;
            let (model, created) = match row {
                Some(row) => (event_log::Model::from_query_result(&row, "")?, true),
                None => (append.replay(self.writer()).await?, false),
            };
            return Ok((event_record(model)?, created));
        }
        let txn = self.write_txn().await?;
        let (model, created) = append_in(&txn, event, outbox).await?;
        txn.commit().await?;
        Ok((event_record(model)?, created))
    }

    async fn get(&self, id: EventId) -> Result<Option<EventRecord>> {
        event_log::Entity::find()
            .filter(event_log::Column::Id.eq(id.into_uuid()))
            .all(&self.db)
            .await?
            .unique_row()
            .map(event_record)
            .transpose()
    }

    async fn routing(&self, id: EventId) -> Result<Option<EventRouting>> {
        let row: Option<RoutingColumns> = event_log::Entity::find()
            .select_only()
            .columns([
                event_log::Column::WorkspaceId,
                event_log::Column::Status,
                event_log::Column::Reason,
                event_log::Column::RunId,
                event_log::Column::ClaimedByRunId,
            ])
            .filter(event_log::Column::Id.eq(id.into_uuid()))
            .into_tuple()
            .all(&self.db)
            .await?
            .unique_row();
        row.map(
            |(workspace_id, status, reason, run_id, claimed_by_run_id)| {
                Ok(EventRouting {
                    workspace_id: workspace(workspace_id)?,
                    status: status
                        .parse()
                        .map_err(|e: StoreError| StoreError::Corrupt(e.to_string()))?,
                    reason,
                    run_id: run_id.map(RunId::from_uuid),
                    claimed_by_run_id: claimed_by_run_id.map(RunId::from_uuid),
                })
            },
        )
        .transpose()
    }

    async fn update_status(
        &self,
        id: EventId,
        mut update: EventStatusUpdate,
    ) -> Result<EventRecord> {
        let merge = take_merge(&mut update)?;
        // One statement where the backend can merge in place: every Postgres update (jsonb
        // `-` and `||`), and SQLite's unless a key cannot be a JSON path label. Routing
        // writes this once per event, so it is on every run's path.
        if merges_in_place(self.backend(), merge.as_ref()) {
            let model = status_update(self.backend(), id, update, merge)
                .exec_with_returning(self.writer())
                .await?
                .unique_row()
                .ok_or_else(|| StoreError::not_found(format!("event {id}")))?;
            return event_record(model);
        }
        let txn = self.write_txn().await?;
        let model = merge_status_in(&txn, id, update, merge).await?;
        txn.commit().await?;
        event_record(model)
    }

    async fn page(&self, query: EventQuery) -> Result<Page<EventRecord>> {
        let limit = clamp_limit(query.limit, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT);
        let before = query
            .before_cursor
            .as_deref()
            .map(|c| decode_seq(CursorKind::Event, c))
            .transpose()?;
        let after = query
            .after_cursor
            .as_deref()
            .map(|c| decode_seq(CursorKind::Event, c))
            .transpose()?;
        let mut select = event_log::Entity::find()
            .filter(event_log::Column::WorkspaceId.eq(query.workspace_id.as_str()));
        if let Some(conversation) = query.conversation_id {
            select = select.filter(event_log::Column::ConversationId.eq(conversation));
        }
        if let Some(bot) = query.bot_id {
            select = select.filter(event_log::Column::BotId.eq(bot));
        }
        match query.thread {
            ThreadFilter::Any => {}
            ThreadFilter::Exactly(Some(thread)) => {
                select = select.filter(event_log::Column::ThreadId.eq(thread));
            }
            ThreadFilter::Exactly(None) => {
                select = select.filter(event_log::Column::ThreadId.is_null());
            }
        }
        if !query.event_types.is_empty() {
            select = select.filter(event_log::Column::EventType.is_in(query.event_types));
        }
        if let Some(before) = before {
            select = select.filter(event_log::Column::Seq.lt(before));
        }
        select = if let Some(after) = after {
            select
                .filter(event_log::Column::Seq.gt(after))
                .order_by_asc(event_log::Column::Seq)
        } else {
            select.order_by_desc(event_log::Column::Seq)
        };
        let rows = select.limit(limit + 1).all(&self.db).await?;
        let records = rows
            .into_iter()
            .map(event_record)
            .collect::<Result<Vec<_>>>()?;
        Ok(Page::from_overfetch(records, limit, |r| r.cursor.clone()))
    }

    async fn with_status(
        &self,
        status: EventStatus,
        cursor: Option<String>,
        limit: Option<i64>,
    ) -> Result<Page<EventRecord>> {
        let limit = clamp_limit(limit, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT);
        let mut select =
            event_log::Entity::find().filter(event_log::Column::Status.eq(status.as_str()));
        if let Some(cursor) = cursor {
            let after = decode_seq(CursorKind::Event, &cursor)?;
            select = select.filter(event_log::Column::Seq.gt(after));
        }
        let rows = select
            .order_by_asc(event_log::Column::Seq)
            .limit(limit + 1)
            .all(&self.db)
            .await?;
        let records = rows
            .into_iter()
            .map(event_record)
            .collect::<Result<Vec<_>>>()?;
        Ok(Page::from_overfetch(records, limit, |r| r.cursor.clone()))
    }

    async fn delete_older_than(&self, before: DateTime<Utc>, batch: u64) -> Result<u64> {
        let victims = Query::select()
            .column(event_log::Column::Seq)
            .from(event_log::Entity)
            .and_where(event_log::Column::CreatedAt.lt(before))
            .order_by(event_log::Column::Seq, sea_orm::Order::Asc)
            .limit(batch.max(1))
            .to_owned();
        let res = event_log::Entity::delete_many()
            .filter(event_log::Column::Seq.in_subquery(victims))
            .exec(self.writer())
            .await?;
        Ok(res.rows_affected)
    }
}

/// The `metadata_merge` of `update`, taken out of it: a JSON object or nothing.
fn take_merge(update: &mut EventStatusUpdate) -> Result<Option<serde_json::Map<String, Value>>> {
    match update.metadata_merge.take() {
        None => Ok(None),
        Some(Value::Object(map)) => Ok(Some(map)),
        Some(_) => Err(StoreError::invalid("metadata_merge must be a JSON object")),
    }
}

/// Whether `backend` can merge `merge` into the stored metadata in place
/// ([`status_update`]): Postgres always, SQLite unless a key has no [`sqlite_path_label`]
/// (then only the read-modify-write, [`merge_status_in`], can merge it).
fn merges_in_place(backend: DbBackend, merge: Option<&serde_json::Map<String, Value>>) -> bool {
    backend == DbBackend::Postgres
        || merge.is_none_or(|m| m.keys().all(|k| sqlite_path_label(k).is_some()))
}

/// [`EventLog::update_status`] of event `id` as one `UPDATE` (`RETURNING` is up to the
/// caller), the metadata merged in place: jsonb `-` and `||` on Postgres, `json_set` and
/// `json_remove` on SQLite. Atomic like the read-modify-write transaction
/// ([`merge_status_in`]) it replaces, in one round trip instead of four (`BEGIN`, `SELECT`,
/// `UPDATE`, `COMMIT`). Only where [`merges_in_place`] says so.
fn status_update(
    backend: DbBackend,
    id: EventId,
    update: EventStatusUpdate,
    merge: Option<serde_json::Map<String, Value>>,
) -> sea_orm::UpdateMany<event_log::Entity> {
    let mut statement = event_log::Entity::update_many()
        .col_expr(
            event_log::Column::Status,
            Expr::value(update.status.as_str()),
        )
        .col_expr(event_log::Column::UpdatedAt, Expr::value(now()));
    if let Some(reason) = update.reason {
        statement = statement.col_expr(event_log::Column::Reason, Expr::value(reason));
    }
    if let Some(run_id) = update.run_id {
        statement = statement.col_expr(event_log::Column::RunId, Expr::value(run_id.into_uuid()));
    }
    if let Some(run_id) = update.claimed_by_run_id {
        statement = statement.col_expr(
            event_log::Column::ClaimedByRunId,
            Expr::value(run_id.into_uuid()),
        );
    }
    if let Some(merge) = merge.filter(|m| !m.is_empty()) {
        statement = statement.col_expr(
            event_log::Column::Metadata,
            match backend {
                DbBackend::Postgres => postgres_metadata_merge(merge),
                _ => sqlite_metadata_merge(merge),
            },
        );
    }
    statement.filter(event_log::Column::Id.eq(id.into_uuid()))
}

/// [`EventLog::update_status`] as a read-modify-write inside the caller's transaction `txn`
/// (the row locked on Postgres, SQLite's write lock already held, so concurrent merges
/// serialise instead of overwriting each other).
async fn merge_status_in<C: ConnectionTrait>(
    txn: &C,
    id: EventId,
    update: EventStatusUpdate,
    merge: Option<serde_json::Map<String, Value>>,
) -> Result<event_log::Model> {
    let current = event_log::Entity::find()
        .filter(event_log::Column::Id.eq(id.into_uuid()))
        .lock(LockType::Update)
        .all(txn)
        .await?
        .unique_row()
        .ok_or_else(|| StoreError::not_found(format!("event {id}")))?;
    let mut metadata = match current.metadata.clone() {
        Some(Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    let mut row = current.into_active_model();
    row.status = Set(update.status.as_str().to_owned());
    if let Some(reason) = update.reason {
        row.reason = Set(Some(reason));
    }
    if let Some(run_id) = update.run_id {
        row.run_id = Set(Some(run_id.into_uuid()));
    }
    if let Some(run_id) = update.claimed_by_run_id {
        row.claimed_by_run_id = Set(Some(run_id.into_uuid()));
    }
    if let Some(merge) = merge {
        for (k, v) in merge {
            if v.is_null() {
                metadata.remove(&k);
            } else {
                metadata.insert(k, v);
            }
        }
        row.metadata = Set(metadata_in("metadata", Value::Object(metadata))?);
    }
    row.updated_at = Set(now());
    Ok(row.update(txn).await?)
}

/// [`EventLog::update_status`] inside the caller's transaction `txn` (one statement where
/// the backend can merge in place, else the read-modify-write).
pub(super) async fn update_status_in<C: ConnectionTrait>(
    txn: &C,
    id: EventId,
    mut update: EventStatusUpdate,
) -> Result<()> {
    let merge = take_merge(&mut update)?;
    let backend = txn.get_database_backend();
    if merges_in_place(backend, merge.as_ref()) {
        if status_update(backend, id, update, merge)
            .exec(txn)
            .await?
            .rows_affected
            == 0
        {
            return Err(StoreError::not_found(format!("event {id}")));
        }
    } else {
        merge_status_in(txn, id, update, merge).await?;
    }
    Ok(())
}

/// The one-statement update of event `id` on Postgres (where every update is one
/// statement), for a part of a data-modifying `WITH`.
pub(super) fn postgres_status_update(
    id: EventId,
    mut update: EventStatusUpdate,
) -> Result<sea_orm::UpdateMany<event_log::Entity>> {
    let merge = take_merge(&mut update)?;
    Ok(status_update(DbBackend::Postgres, id, update, merge))
}

/// `metadata` merged with `merge` on Postgres: `coalesce(metadata, '{}')`, minus the keys
/// merged as `null`, `||` the others (top-level keys, right wins), `NULL` when empty (the
/// stored form of `{}`).
fn postgres_metadata_merge(
    merge: serde_json::Map<String, Value>,
) -> sea_orm::sea_query::SimpleExpr {
    let (removed, set): (Vec<_>, Vec<_>) = merge.into_iter().partition(|(_, v)| v.is_null());
    let mut sql = String::from(r#"coalesce("metadata", '{}'::jsonb)"#);
    let mut values: Vec<sea_orm::Value> = Vec::new();
    // sea-query's Postgres placeholders are `$n`, numbered within this expression.
    for (key, _) in removed {
        values.push(key.into());
        sql = format!("({sql} - (${})::text)", values.len());
    }
    if !set.is_empty() {
        sql = format!("({sql} || (${})::jsonb)", values.len() + 1);
        let object: serde_json::Map<String, Value> = set.into_iter().collect();
        values.push(Value::Object(object).to_string().into());
    }
    Expr::cust_with_values(format!("nullif({sql}, '{{}}'::jsonb)"), values)
}

/// `metadata` merged with `merge` on SQLite (every key has a path label, see
/// [`sqlite_path_label`]).
fn sqlite_metadata_merge(merge: serde_json::Map<String, Value>) -> sea_orm::sea_query::SimpleExpr {
    // coalesce(metadata, '{}') → json_remove(…, removed keys) → json_set(…, key,
    // json(value), …) → NULL when empty (the stored form of `{}`).
    let mut sql = String::from(r#"coalesce("metadata", '{}')"#);
    let mut values: Vec<sea_orm::Value> = Vec::new();
    let (removed, set): (Vec<_>, Vec<_>) = merge.into_iter().partition(|(_, v)| v.is_null());
    if !removed.is_empty() {
        sql = format!("json_remove({sql}{})", ", ?".repeat(removed.len()));
        values.extend(
            removed
                .iter()
                .filter_map(|(k, _)| sqlite_path_label(k))
                .map(Into::into),
        );
    }
    if !set.is_empty() {
        sql = format!("json_set({sql}{})", ", ?, json(?)".repeat(set.len()));
        for (k, v) in &set {
            values.push(sqlite_path_label(k).unwrap_or_default().into());
            values.push(v.to_string().into());
        }
    }
    Expr::cust_with_values(format!("nullif({sql}, '{{}}')"), values)
}

/// The SQLite JSON path of a top-level object key (`$."key"`), or `None` for a key that a
/// quoted path label cannot hold (a `"` or a backslash; such merges take the transaction
/// path).
fn sqlite_path_label(key: &str) -> Option<String> {
    (!key.contains(['"', '\\'])).then(|| format!("$.\"{key}\""))
}

#[async_trait]
impl Outbox for SqlStore {
    async fn enqueue(&self, messages: Vec<NewOutboxMessage>) -> Result<Vec<i64>> {
        for message in &messages {
            validate_outbox(message)?;
        }
        insert_outbox(self.writer(), messages, now()).await
    }

    async fn claim(&self, limit: u64, lease: Duration) -> Result<Vec<OutboxMessage>> {
        let limit = limit.clamp(1, MAX_OUTBOX_CLAIM);
        let now = now();
        let until = now
            + chrono::Duration::from_std(lease)
                .map_err(|_| StoreError::invalid("lease is too long"))?;
        let lease_free = || {
            Condition::any()
                .add(outbox::Column::LockedUntil.is_null())
                .add(outbox::Column::LockedUntil.lte(now))
        };
        // Postgres: the subquery skips rows another relay is claiming right now, and the
        // outer conditions are re-checked on the locked row version. SQLite: the statement
        // runs under the database write lock (the lock clause is not rendered).
        let candidates = Query::select()
            .column(outbox::Column::Id)
            .from(outbox::Entity)
            .and_where(outbox::Column::PublishedAt.is_null())
            .and_where(outbox::Column::AvailableAt.lte(now))
            .cond_where(lease_free())
            .order_by(outbox::Column::Id, sea_orm::Order::Asc)
            .limit(limit)
            .lock_with_behavior(LockType::Update, LockBehavior::SkipLocked)
            .to_owned();
        let mut rows = outbox::Entity::update_many()
            .col_expr(outbox::Column::LockedUntil, Expr::value(until))
            .col_expr(
                outbox::Column::Attempts,
                // Fully qualified: importing `ExprTrait` would shadow `Ord::max` & co.
                sea_orm::sea_query::ExprTrait::add(Expr::col(outbox::Column::Attempts), 1),
            )
            .filter(outbox::Column::Id.in_subquery(candidates))
            .filter(outbox::Column::PublishedAt.is_null())
            .filter(lease_free())
            .exec_with_returning(self.writer())
            .await?;
        rows.sort_by_key(|m| m.id);
        Ok(rows.into_iter().map(outbox_message).collect())
    }

    async fn pending(&self) -> Result<u64> {
        Ok(outbox::Entity::find()
            .filter(outbox::Column::PublishedAt.is_null())
            .count(&self.db)
            .await?)
    }

    async fn mark_published(&self, ids: &[i64]) -> Result<()> {
        let now = now();
        for chunk in ids.chunks(super::IN_CHUNK) {
            outbox::Entity::update_many()
                .col_expr(outbox::Column::PublishedAt, Expr::value(now))
                .col_expr(
                    outbox::Column::LockedUntil,
                    Expr::value(Option::<DateTime<Utc>>::None),
                )
                .filter(outbox::Column::Id.is_in(chunk.iter().copied()))
                .filter(outbox::Column::PublishedAt.is_null())
                .exec(self.writer())
                .await?;
        }
        Ok(())
    }

    async fn release(&self, ids: &[i64]) -> Result<()> {
        for chunk in ids.chunks(super::IN_CHUNK) {
            outbox::Entity::update_many()
                .col_expr(
                    outbox::Column::LockedUntil,
                    Expr::value(Option::<DateTime<Utc>>::None),
                )
                .filter(outbox::Column::Id.is_in(chunk.iter().copied()))
                .filter(outbox::Column::PublishedAt.is_null())
                .exec(self.writer())
                .await?;
        }
        Ok(())
    }

    async fn delete_published_before(&self, before: DateTime<Utc>, batch: u64) -> Result<u64> {
        let victims = Query::select()
            .column(outbox::Column::Id)
            .from(outbox::Entity)
            .and_where(outbox::Column::PublishedAt.lt(before))
            .order_by(outbox::Column::Id, sea_orm::Order::Asc)
            .limit(batch.max(1))
            .to_owned();
        let res = outbox::Entity::delete_many()
            .filter(outbox::Column::Id.in_subquery(victims))
            .exec(self.writer())
            .await?;
        Ok(res.rows_affected)
    }
}
