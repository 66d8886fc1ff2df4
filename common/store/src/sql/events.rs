//! [`EventLog`] and [`Outbox`] on SQL.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::{EventId, RunId};
use sea_orm::sea_query::{Expr, LockBehavior, LockType, OnConflict, Query};
use sea_orm::{
    ActiveModelTrait, ActiveValue::NotSet, ColumnTrait, Condition, ConnectionTrait,
    DatabaseTransaction, DbBackend, EntityTrait, IntoActiveModel, PaginatorTrait, QueryFilter,
    QueryOrder, QuerySelect, QueryTrait as _, Set, Statement, TryIntoModel as _,
};
use serde_json::Value;

use super::entity::{event_log, outbox};
use super::script::Script;
use super::shared::Shared;
use super::{
    ID_LEN, SqlStore, UniqueRow, check_len, check_len_opt, check_required, metadata_in,
    metadata_out, now, workspace,
};
use crate::error::{Result, StoreError, is_unique_violation};
use crate::events::{
    AppendRequest, Appended, EventLog, EventQuery, EventRecord, EventRouting, EventStatus,
    EventStatusUpdate, MAX_INPUT_SUMMARY_CHARS, NewEvent, NewOutboxMessage, Outbox, OutboxMessage,
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

fn outbox_models(
    messages: Vec<NewOutboxMessage>,
    now: DateTime<Utc>,
    until: Option<DateTime<Utc>>,
) -> Vec<outbox::ActiveModel> {
    messages
        .into_iter()
        .map(|m| {
            let leased = leased_until(&m, now, until);
            outbox::ActiveModel {
                id: NotSet,
                exchange: Set(m.exchange),
                routing_key: Set(m.routing_key),
                body: Set(m.body),
                headers: Set(m.headers),
                created_at: Set(now),
                available_at: Set(m.available_at.map_or(now, super::micros)),
                locked_until: Set(leased),
                published_at: Set(None),
                attempts: Set(i64::from(leased.is_some())),
            }
        })
        .collect()
}

/// The lease an appended outbox row is written with ([`EventLog::append_batch`]): `until`
/// for a row available now, none for a row due later (a relay claims it when due).
fn leased_until(
    message: &NewOutboxMessage,
    now: DateTime<Utc>,
    until: Option<DateTime<Utc>>,
) -> Option<DateTime<Utc>> {
    until.filter(|_| message.available_at.is_none_or(|at| at <= now))
}

/// The end of a lease of `lease` taken at `now` (claims, and rows appended leased).
fn lease_end(now: DateTime<Utc>, lease: Duration) -> Result<DateTime<Utc>> {
    chrono::Duration::from_std(lease)
        .map(|lease| now + lease)
        .map_err(|_| lease_too_long())
}

fn lease_too_long() -> StoreError {
    StoreError::invalid("lease is too long")
}

async fn insert_outbox<C: ConnectionTrait>(
    db: &C,
    messages: Vec<NewOutboxMessage>,
    now: DateTime<Utc>,
    until: Option<DateTime<Utc>>,
) -> Result<Vec<outbox::Model>> {
    if messages.is_empty() {
        return Ok(Vec::new());
    }
    insert_outbox_rows(db, outbox_models(messages, now, until)).await
}

/// Inserts outbox rows in one statement; returns them sorted by id (= in `rows`' order).
async fn insert_outbox_rows<C: ConnectionTrait>(
    db: &C,
    rows: Vec<outbox::ActiveModel>,
) -> Result<Vec<outbox::Model>> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let mut rows = outbox::Entity::insert_many(rows)
        .exec_with_returning(db)
        .await?;
    rows.sort_by_key(|m| m.id);
    Ok(rows)
}

/// Outbox rows per insert of [`sqlite_outbox_insert`] (ten parameters each: far below
/// SQLite's limit).
const OUTBOX_INSERT_CHUNK: usize = 500;

/// The name the SQLite outbox insert returns its ids under, so they are told apart from the
/// events' rows returned by the same script.
const OUTBOX_ID: &str = "outbox_id";

/// The columns [`sqlite_outbox_insert`] writes, in order (all but the generated `id`).
const OUTBOX_INSERT_COLUMNS: [outbox::Column; 9] = [
    outbox::Column::Exchange,
    outbox::Column::RoutingKey,
    outbox::Column::Body,
    outbox::Column::Headers,
    outbox::Column::CreatedAt,
    outbox::Column::AvailableAt,
    outbox::Column::LockedUntil,
    outbox::Column::PublishedAt,
    outbox::Column::Attempts,
];

/// The insert of a batch's outbox rows on SQLite, in the statement after the events' insert:
/// a message is written only if its event's row exists, and since the events' insert fails
/// whole on a taken event id, an event whose row exists was written by that insert (a
/// request whose idempotency key was taken writes no row, and so no message). The rows are
/// [`outbox_models`]' (the lease is decided there); returns the ids written, named
/// [`OUTBOX_ID`]. Every column of [`OUTBOX_INSERT_COLUMNS`] must be set on each row: one left
/// unset fails the statement's building (a bug) instead of writing `NULL`.
fn sqlite_outbox_insert(rows: &[(EventId, outbox::ActiveModel)]) -> Result<Statement> {
    let columns: Vec<String> = OUTBOX_INSERT_COLUMNS
        .iter()
        .map(|column| format!("\"{}\"", sea_orm::IdenStatic::as_str(column)))
        .collect();
    let selected: Vec<String> = (2..=OUTBOX_INSERT_COLUMNS.len() + 1)
        .map(|i| format!("v.column{i}"))
        .collect();
    let placeholders = format!("(?{})", ", ?".repeat(OUTBOX_INSERT_COLUMNS.len()));
    let mut sql = format!(
        r#"INSERT INTO "outbox" ({})
SELECT {} FROM (VALUES "#,
        columns.join(", "),
        selected.join(", "),
    );
    let mut values: Vec<sea_orm::Value> =
        Vec::with_capacity(rows.len() * (OUTBOX_INSERT_COLUMNS.len() + 1));
    for (i, (event_id, row)) in rows.iter().enumerate() {
        if i > 0 {
            sql.push_str(", ");
        }
        sql.push_str(&placeholders);
        values.push(event_id.into_uuid().into());
        for column in OUTBOX_INSERT_COLUMNS {
            let value = row.get(column).into_value().ok_or_else(|| {
                StoreError::Database(sea_orm::DbErr::Custom(format!(
                    "outbox column {} not set",
                    sea_orm::IdenStatic::as_str(&column)
                )))
            })?;
            values.push(value);
        }
    }
    sql.push_str(
        r#") AS v
WHERE EXISTS (SELECT 1 FROM "event_log" e WHERE e."id" = v.column1)
RETURNING "id" AS "#,
    );
    sql.push_str(OUTBOX_ID);
    Ok(Statement::from_sql_and_values(
        DbBackend::Sqlite,
        sql,
        values,
    ))
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

    /// The event as stored under `seq` by an insert of [`Self::row`]: every other column is
    /// the row's own, so nothing but the number needs reading back.
    fn stored(&self, seq: i64) -> Result<event_log::Model> {
        let mut row = self.row.clone();
        row.seq = Set(seq);
        Ok(row.try_into_model()?)
    }

    /// The outcome of this append when its insert stored it under `seq`, with the outbox
    /// rows it wrote `leased`.
    fn created(&self, seq: i64, leased: Vec<OutboxMessage>) -> Result<Appended> {
        let record = event_record(self.stored(seq)?)?;
        Ok(Appended {
            record,
            created: true,
            leased,
        })
    }

    /// The outbox rows this append wrote leased (those available now, when a lease `until`
    /// was asked), from its `outbox` messages and their row ids in the same order. `ids` is
    /// asked only for as many ids as there are messages (`zip` asks `outbox` first), so a
    /// shared iterator yields the next append's ids after this one's.
    fn leased(
        &self,
        outbox: &[NewOutboxMessage],
        ids: impl Iterator<Item = Option<i64>>,
        until: Option<DateTime<Utc>>,
    ) -> Vec<OutboxMessage> {
        outbox
            .iter()
            .zip(ids)
            .filter_map(|(message, id)| {
                let locked_until = leased_until(message, self.now, until)?;
                Some(leased_row(message, id?, self.now, locked_until))
            })
            .collect()
    }

    /// The insert, `ON CONFLICT` on the idempotency index only: two appends with the same
    /// key (even racing ones, on Postgres the second waits for the first to commit) end with
    /// one row, and the loser reads the winner's event ([`Self::replay`]).
    fn insert(&self) -> sea_orm::Insert<event_log::ActiveModel> {
        event_log::Entity::insert(self.row.clone()).on_conflict(Self::on_idempotency_conflict())
    }

    /// `ON CONFLICT (workspace_id, idempotency_key) DO NOTHING`.
    fn on_idempotency_conflict() -> OnConflict {
        OnConflict::columns([
            event_log::Column::WorkspaceId,
            event_log::Column::IdempotencyKey,
        ])
        .do_nothing()
        .to_owned()
    }

    /// The error of a failed insert: a taken event id is a conflict.
    fn insert_error(&self, e: sea_orm::DbErr) -> StoreError {
        if is_unique_violation(&e) {
            StoreError::Conflict(format!("event {} already exists", self.id))
        } else {
            e.into()
        }
    }

    /// The row as an element of [`APPEND_EVENTS_SQL`]'s first parameter, at position `ord`.
    fn json(&self, ord: usize) -> Value {
        let r = &self.row;
        serde_json::json!({
            "ord": ord,
            "id": r.id.try_as_ref(),
            "workspace_id": r.workspace_id.try_as_ref(),
            "idempotency_key": r.idempotency_key.try_as_ref(),
            "request_hash": r.request_hash.try_as_ref(),
            "event_type": r.event_type.try_as_ref(),
            "source": r.source.try_as_ref(),
            "event_time": r.event_time.try_as_ref(),
            "bot_id": r.bot_id.try_as_ref(),
            "conversation_id": r.conversation_id.try_as_ref(),
            "thread_id": r.thread_id.try_as_ref(),
            "actor_type": r.actor_type.try_as_ref(),
            "actor_id": r.actor_id.try_as_ref(),
            "actor_name": r.actor_name.try_as_ref(),
            "subject_type": r.subject_type.try_as_ref(),
            "subject_id": r.subject_id.try_as_ref(),
            "input_summary": r.input_summary.try_as_ref(),
            "envelope": r.envelope.try_as_ref(),
            "raw_ref": r.raw_ref.try_as_ref(),
            "status": r.status.try_as_ref(),
            "reason": r.reason.try_as_ref(),
            "run_id": r.run_id.try_as_ref(),
            "runner_id": r.runner_id.try_as_ref(),
            "claimed_by_run_id": r.claimed_by_run_id.try_as_ref(),
            "metadata": r.metadata.try_as_ref(),
            "created_at": r.created_at.try_as_ref(),
        })
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
}

/// The outcome of a request [`SqlStore::append_together`] did not answer (a bug).
fn missing_outcome() -> Result<Appended> {
    Err(StoreError::Corrupt("an append without an outcome".into()))
}

/// The SQL of [`SqlStore::append_postgres`]: the events and their outbox rows of a whole
/// batch as one data-modifying `WITH`. Its text is fixed (the rows are two `jsonb`
/// parameters), so Postgres plans it once per connection.
///
/// - `e` inserts the events; an idempotency conflict (with a stored event or an earlier row
///   of the batch) inserts nothing for that row.
/// - `messages` draws the outbox ids of the inserted events' messages in request order; it
///   is materialized once (it calls `nextval`), so `o` and the result see the same ids.
/// - The result is one row per inserted event and outbox message (an event without
///   messages once, with a null `outbox_ord`): only what the database made (the event's
///   `seq`, the outbox ids), since the rest of every row is the request's own and each
///   envelope read back would be parsed again from `jsonb`.
const APPEND_EVENTS_SQL: &str = r#"WITH input AS (
    SELECT * FROM jsonb_to_recordset($1::jsonb) AS x(
        ord int, id uuid, workspace_id text, idempotency_key text, request_hash text,
        event_type text, source text, event_time timestamptz, bot_id text,
        conversation_id text, thread_id text, actor_type text, actor_id text,
        actor_name text, subject_type text, subject_id text, input_summary text,
        envelope jsonb, raw_ref text, status text, reason text, run_id uuid, runner_id text,
        claimed_by_run_id uuid, metadata jsonb, created_at timestamptz)
),
e AS (
    INSERT INTO event_log (id, workspace_id, idempotency_key, request_hash, event_type,
        source, event_time, bot_id, conversation_id, thread_id, actor_type, actor_id,
        actor_name, subject_type, subject_id, input_summary, envelope, raw_ref, status,
        reason, run_id, runner_id, claimed_by_run_id, metadata, created_at, updated_at)
    SELECT id, workspace_id, idempotency_key, request_hash, event_type, source, event_time,
        bot_id, conversation_id, thread_id, actor_type, actor_id, actor_name, subject_type,
        subject_id, input_summary, envelope, raw_ref, status, reason, run_id, runner_id,
        claimed_by_run_id, metadata, created_at, created_at
    FROM input ORDER BY ord
    ON CONFLICT (workspace_id, idempotency_key) DO NOTHING
    RETURNING seq, id
),
messages AS (
    SELECT ordered.*, nextval(pg_get_serial_sequence('outbox', 'id')) AS outbox_id
    FROM (
        SELECT m.* FROM jsonb_to_recordset($2::jsonb) AS m(
            ord int, event_id uuid, exchange text, routing_key text, body text,
            headers jsonb, created_at timestamptz, available_at timestamptz,
            locked_until timestamptz)
        WHERE m.event_id IN (SELECT id FROM e)
        ORDER BY m.ord
    ) AS ordered
),
o AS (
    INSERT INTO outbox (id, exchange, routing_key, body, headers, created_at, available_at,
        locked_until, attempts)
    SELECT outbox_id, exchange, routing_key, decode(body, 'hex'), headers, created_at,
        available_at, locked_until, CASE WHEN locked_until IS NULL THEN 0 ELSE 1 END
    FROM messages
)
SELECT e.seq, e.id, messages.ord AS outbox_ord, messages.outbox_id
FROM e LEFT JOIN messages ON messages.event_id = e.id"#;

impl SqlStore {
    /// Writes `appends` in one commit: one statement on Postgres, one transaction on
    /// SQLite. `Err` when the shared write failed as a whole; otherwise one outcome per
    /// append, in order (a replay's conflict is that append's outcome).
    async fn append_together(
        &self,
        appends: &[(Append, Vec<NewOutboxMessage>)],
        until: Option<DateTime<Utc>>,
    ) -> Result<Vec<Result<Appended>>> {
        if appends.is_empty() {
            return Ok(Vec::new());
        }
        if self.backend() == DbBackend::Postgres {
            self.append_postgres(appends, until).await
        } else {
            self.append_in_transaction(appends, until).await
        }
    }

    /// [`Self::append_together`] on Postgres: [`APPEND_EVENTS_SQL`], then a read of the
    /// stored event for each request that hit an idempotency conflict.
    async fn append_postgres(
        &self,
        appends: &[(Append, Vec<NewOutboxMessage>)],
        until: Option<DateTime<Utc>>,
    ) -> Result<Vec<Result<Appended>>> {
        let mut events = Vec::with_capacity(appends.len());
        let mut messages = Vec::new();
        for (ord, (append, outbox)) in appends.iter().enumerate() {
            events.push(append.json(ord));
            for message in outbox {
                messages.push(serde_json::json!({
                    "ord": messages.len(),
                    "event_id": append.id,
                    "exchange": message.exchange,
                    "routing_key": message.routing_key,
                    "body": hex::encode(&message.body),
                    "headers": message.headers,
                    "created_at": append.now,
                    "available_at": message.available_at.map_or(append.now, super::micros),
                    "locked_until": leased_until(message, append.now, until),
                }));
            }
        }
        let statement = Statement::from_sql_and_values(
            DbBackend::Postgres,
            APPEND_EVENTS_SQL,
            [super::jsonb_rows(&events)?, super::jsonb_rows(&messages)?],
        );
        let rows = self
            .writer()
            .query_all_raw(statement)
            .await
            .map_err(|e| match appends {
                [(append, _)] => append.insert_error(e),
                _ => e.into(),
            })?;
        // The inserted events' `seq`, and the outbox ids by message position in the batch.
        let mut inserted: HashMap<uuid::Uuid, i64> = HashMap::new();
        let mut outbox_ids: HashMap<usize, i64> = HashMap::new();
        for row in &rows {
            if let Some(ord) = row.try_get::<Option<i32>>("", "outbox_ord")? {
                let position = usize::try_from(ord).unwrap_or_default();
                outbox_ids.insert(position, row.try_get::<i64>("", OUTBOX_ID)?);
            }
            inserted.insert(row.try_get("", "id")?, row.try_get("", "seq")?);
        }
        let mut outcomes = Vec::with_capacity(appends.len());
        let mut first_message = 0;
        for (append, outbox) in appends {
            let positions = first_message..first_message + outbox.len();
            first_message += outbox.len();
            let outcome = match inserted.remove(&append.id.into_uuid()) {
                Some(seq) => {
                    let ids = positions.map(|position| outbox_ids.get(&position).copied());
                    append.created(seq, append.leased(outbox, ids, until))
                }
                None => replayed(append.replay(self.writer()).await),
            };
            outcomes.push(outcome);
        }
        Ok(outcomes)
    }

    /// [`Self::append_together`] on SQLite: every append in the writer's shared
    /// transaction.
    async fn append_in_transaction(
        &self,
        appends: &[(Append, Vec<NewOutboxMessage>)],
        until: Option<DateTime<Utc>>,
    ) -> Result<Vec<Result<Appended>>> {
        super::tick::write_in_tick!(self, |txn| append_sqlite(txn, appends, until))
    }
}

/// [`SqlStore::append_together`]'s writes on SQLite, in `txn`.
async fn append_sqlite(
    txn: &DatabaseTransaction,
    appends: &[(Append, Vec<NewOutboxMessage>)],
    until: Option<DateTime<Utc>>,
) -> Result<Vec<Result<Appended>>> {
    // Every event in one multi-row insert, and every outbox row in another that writes
    // only the rows of the events just written: both sent in one hand-over ([`Script`];
    // each SQLite statement is a hand-over to the connection's thread and back). A taken
    // event id fails it for all (the caller then appends one by one); a taken
    // idempotency key only skips its row, whose request then reads the stored event.
    let mut script = Script::new(txn);
    let mut events = event_log::Entity::insert_many(appends.iter().map(|(a, _)| a.row.clone()))
        .on_conflict(Append::on_idempotency_conflict())
        .into_query();
    // Only what the database makes is read back (the events' `seq`, the outbox ids): the
    // rest of every row is the append's own, and sqlx hands each returned row over as
    // its own message, the envelope parsed again from its stored JSON.
    script.push_query(
        events.returning(
            sea_orm::sea_query::Query::returning()
                .columns([event_log::Column::Seq, event_log::Column::Id]),
        ),
    );
    let messages: Vec<(EventId, outbox::ActiveModel)> = appends
        .iter()
        .flat_map(|(append, outbox)| {
            outbox_models(outbox.clone(), append.now, until)
                .into_iter()
                .map(|row| (append.id, row))
        })
        .collect();
    for chunk in messages.chunks(OUTBOX_INSERT_CHUNK) {
        script.push_statement(sqlite_outbox_insert(chunk)?);
    }
    let rows = script
        .query_all(txn)
        .await
        .map_err(|e| match (appends, e) {
            ([(append, _)], StoreError::Database(e)) => append.insert_error(e),
            (_, e) => e,
        })?;
    // The events' rows come first, then the outbox ids (the only rows with an
    // `outbox_id`); SQLite numbers a statement's rows in order, so sorted the outbox ids
    // are the messages' in request order.
    let mut inserted: HashMap<uuid::Uuid, i64> = HashMap::new();
    let mut outbox_ids = Vec::new();
    for row in &rows {
        if let Ok(id) = row.try_get::<i64>("", OUTBOX_ID) {
            outbox_ids.push(id);
        } else {
            inserted.insert(row.try_get("", "id")?, row.try_get("", "seq")?);
        }
    }
    outbox_ids.sort_unstable();
    let mut outbox_ids = outbox_ids.into_iter();
    let mut outcomes = Vec::with_capacity(appends.len());
    for (append, outbox) in appends {
        let outcome = match inserted.remove(&append.id.into_uuid()) {
            Some(seq) => append.created(
                seq,
                append.leased(outbox, outbox_ids.by_ref().map(Some), until),
            ),
            None => replayed(append.replay(txn).await),
        };
        outcomes.push(outcome);
    }
    Ok(outcomes)
}

/// The outcome of a request whose event was already stored.
fn replayed(stored: Result<event_log::Model>) -> Result<Appended> {
    Ok(Appended {
        record: event_record(stored?)?,
        created: false,
        leased: Vec::new(),
    })
}

/// The row an outbox message was written as, leased until `locked_until`.
fn leased_row(
    message: &NewOutboxMessage,
    id: i64,
    now: DateTime<Utc>,
    locked_until: DateTime<Utc>,
) -> OutboxMessage {
    OutboxMessage {
        id,
        exchange: message.exchange.clone(),
        routing_key: message.routing_key.clone(),
        body: message.body.clone(),
        headers: message.headers.clone(),
        created_at: now,
        available_at: message.available_at.map_or(now, super::micros),
        locked_until: Some(locked_until),
        attempts: 1,
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
            insert_outbox(txn, outbox, append.now, None).await?;
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
            let appended = self
                .append_postgres(&[(append, outbox)], None)
                .await?
                .pop()
                .unwrap_or_else(missing_outcome)?;
            return Ok((appended.record, appended.created));
        }
        let txn = self.write_txn().await?;
        let (model, created) = append_in(&txn, event, outbox).await?;
        txn.commit().await?;
        Ok((event_record(model)?, created))
    }

    async fn append_batch(
        &self,
        batch: Vec<AppendRequest>,
        lease: Option<Duration>,
    ) -> Vec<Result<Appended>> {
        let until = match lease.map(|lease| lease_end(now(), lease)).transpose() {
            Ok(until) => until,
            Err(_) => {
                return batch.iter().map(|_| Err(lease_too_long())).collect();
            }
        };
        let shared = Shared::validate("an append", batch, |request| {
            Append::new(request.event, &request.outbox).map(|append| (append, request.outbox))
        });
        let written = shared
            .write(|appends| self.append_together(appends, until))
            .await;
        shared.answer(written)
    }

    async fn get_many(&self, ids: &[EventId]) -> Result<Vec<Option<EventRecord>>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let rows = event_log::Entity::find()
            .filter(event_log::Column::Id.is_in(ids.iter().map(|id| id.into_uuid())))
            .all(&self.db)
            .await?;
        let mut found = std::collections::HashMap::with_capacity(rows.len());
        for row in rows {
            let record = event_record(row)?;
            found.insert(record.id, record);
        }
        Ok(ids.iter().map(|id| found.get(id).cloned()).collect())
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

/// [`EventLog::update_status`] of one of several events updated in the caller's SQLite
/// transaction `txn`: an update that merges in place joins `script` (one `UPDATE` each,
/// `RETURNING` the event's id, all sent in one hand-over by the caller, who checks that each
/// returned its row); the others are written now (read-modify-write). Returns whether the
/// update joined the script.
pub(super) async fn script_status_update<C: ConnectionTrait>(
    txn: &C,
    script: &mut Script,
    id: EventId,
    mut update: EventStatusUpdate,
) -> Result<bool> {
    let merge = take_merge(&mut update)?;
    let backend = txn.get_database_backend();
    if merges_in_place(backend, merge.as_ref()) {
        let mut statement = status_update(backend, id, update, merge).into_query();
        script.push_query(statement.returning_col(event_log::Column::Id));
        Ok(true)
    } else {
        merge_status_in(txn, id, update, merge).await?;
        Ok(false)
    }
}

/// The update of the event of a run being started on SQLite, as a statement of the start's
/// script: it changes the event only when the run's row `run` exists (the script's insert
/// wrote it: an event that has a run already keeps its own), and returns the event's id.
/// `None` when the update cannot merge in place, which only a read-modify-write can do.
pub(super) fn sqlite_start_update(
    id: EventId,
    mut update: EventStatusUpdate,
    run: uuid::Uuid,
) -> Result<Option<sea_orm::sea_query::UpdateStatement>> {
    let merge = take_merge(&mut update)?;
    if !merges_in_place(DbBackend::Sqlite, merge.as_ref()) {
        return Ok(None);
    }
    let run_written = sea_orm::sea_query::Query::select()
        .expr(Expr::val(1))
        .from(super::entity::run::Entity)
        .and_where(super::entity::run::Column::Id.eq(run))
        .to_owned();
    let mut statement = status_update(DbBackend::Sqlite, id, update, merge)
        .filter(Expr::exists(run_written))
        .into_query();
    statement.returning_col(event_log::Column::Id);
    Ok(Some(statement))
}

/// The update of an event as the `event_*` and `metadata_*` fields of a row of a statement
/// that updates events from `jsonb` (the run starts'): what [`status_update`] sets, the
/// metadata merge split into the keys removed (merged as `null`) and the object written over
/// the rest; `null` where nothing changes.
pub(super) fn postgres_status_json(mut update: EventStatusUpdate) -> Result<Value> {
    let (removed, set) = split_merge(take_merge(&mut update)?.unwrap_or_default());
    Ok(serde_json::json!({
        "event_status": update.status.as_str(),
        "event_reason": update.reason,
        "event_run_id": update.run_id.map(RunId::into_uuid),
        "event_claimed_by_run_id": update.claimed_by_run_id.map(RunId::into_uuid),
        "metadata_removed": (!removed.is_empty()).then_some(removed),
        "metadata_set": (!set.is_empty()).then_some(set),
    }))
}

/// A metadata merge split into the keys it removes (merged as `null`) and the object it
/// writes over the rest.
fn split_merge(
    merge: serde_json::Map<String, Value>,
) -> (Vec<String>, serde_json::Map<String, Value>) {
    let (removed, set): (Vec<_>, Vec<_>) = merge.into_iter().partition(|(_, v)| v.is_null());
    (
        removed.into_iter().map(|(k, _)| k).collect(),
        set.into_iter().collect(),
    )
}

/// `metadata` merged with `merge` on Postgres: `coalesce(metadata, '{}')`, minus the keys
/// merged as `null`, `||` the others (top-level keys, right wins), `NULL` when empty (the
/// stored form of `{}`).
fn postgres_metadata_merge(
    merge: serde_json::Map<String, Value>,
) -> sea_orm::sea_query::SimpleExpr {
    let (removed, set) = split_merge(merge);
    let mut sql = String::from(r#"coalesce("metadata", '{}'::jsonb)"#);
    let mut values: Vec<sea_orm::Value> = Vec::new();
    // sea-query's Postgres placeholders are `$n`, numbered within this expression.
    for key in removed {
        values.push(key.into());
        sql = format!("({sql} - (${})::text)", values.len());
    }
    if !set.is_empty() {
        sql = format!("({sql} || (${})::jsonb)", values.len() + 1);
        values.push(Value::Object(set).to_string().into());
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
    let (removed, set) = split_merge(merge);
    if !removed.is_empty() {
        sql = format!("json_remove({sql}{})", ", ?".repeat(removed.len()));
        values.extend(
            removed
                .iter()
                .filter_map(|k| sqlite_path_label(k))
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
        let rows = insert_outbox(self.writer(), messages, now(), None).await?;
        Ok(rows.into_iter().map(|m| m.id).collect())
    }

    async fn claim(&self, limit: u64, lease: Duration) -> Result<Vec<OutboxMessage>> {
        let limit = limit.clamp(1, MAX_OUTBOX_CLAIM);
        let now = now();
        let until = lease_end(now, lease)?;
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
