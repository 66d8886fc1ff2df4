//! [`RunLedger`] on SQL.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::{AgentId, EventId, RunId, WorkspaceId};
use sb_protocol::result::{AgentRunResult, ResultType};
use sea_orm::sea_query::{CaseStatement, Expr, OnConflict};
use sea_orm::{
    ActiveValue::Set, ColumnTrait, Condition, ConnectionTrait, DatabaseTransaction, DbBackend,
    EntityTrait, FromQueryResult, QueryFilter, QueryOrder, QuerySelect, QueryTrait as _, Statement,
};
use serde_json::Value;
use uuid::Uuid;

use super::entity::{run, run_event, transcript};
use super::script::Script;
use super::shared::Shared;
use super::{
    ID_LEN, SqlStore, UniqueRow, check_len, check_len_opt, check_required, now, workspace,
};
use crate::error::{Result, StoreError, is_foreign_key_violation, is_unique_violation};
use crate::page::{
    CursorKind, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT, Page, clamp_limit, decode_time_id,
    encode_time_id,
};
use crate::runs::{
    CancelOutcome, Finalized, ItemJson, MAX_RUN_EVENTS_BATCH, NewRun, NewRunEvent, RunEventRecord,
    RunFilter, RunLedger, RunOutcome, RunRecord, RunStart, RunStatus, StartReads, StartedRun,
};
use crate::transcript::Direction;

/// Rows per multi-row insert (5 parameters each: far below every backend's limit).
const INSERT_CHUNK: usize = 500;

fn run_record(m: run::Model) -> Result<RunRecord> {
    Ok(RunRecord {
        id: RunId::from_uuid(m.id),
        workspace_id: workspace(m.workspace_id)?,
        event_id: EventId::from_uuid(m.event_id),
        agent_id: m.agent_id.map(AgentId::from_uuid),
        runner_id: m.runner_id,
        pool: m.pool,
        conversation_id: m.conversation_id,
        thread_id: m.thread_id,
        bot_id: m.bot_id,
        status: m
            .status
            .parse()
            .map_err(|e: StoreError| StoreError::Corrupt(e.to_string()))?,
        error_code: m.error_code,
        error_message: m.error_message,
        attempt: m.attempt,
        worker_id: m.worker_id,
        created_at: m.created_at,
        started_at: m.started_at,
        ended_at: m.ended_at,
        deadline_at: m.deadline_at,
        cancel_requested_at: m.cancel_requested_at,
        cancel_reason: m.cancel_reason,
        last_sequence: m.last_sequence,
        usage: m.usage,
        events_expired_at: m.events_expired_at,
    })
}

fn run_event_record(m: run_event::Model) -> RunEventRecord {
    RunEventRecord {
        run_id: RunId::from_uuid(m.run_id),
        sequence: m.sequence,
        result_type: m.result_type,
        data: m.data,
        created_at: m.created_at,
    }
}

fn records(rows: Vec<run::Model>) -> Result<Vec<RunRecord>> {
    rows.into_iter().map(run_record).collect()
}

/// The cursor of a run's position in `(created_at, id)` order.
fn run_cursor(run: &RunRecord) -> String {
    encode_time_id(CursorKind::Run, run.created_at, run.id.into_uuid())
}

/// The runs strictly past the position of a [`run_cursor`] in a read ordered by
/// `(created_at, id)`: after it reading forward (oldest first), before it reading backward.
fn past_cursor(cursor: &str, direction: Direction) -> Result<Condition> {
    let (at, id) = decode_time_id(CursorKind::Run, cursor)?;
    let (created, tie) = match direction {
        Direction::Forward => (run::Column::CreatedAt.gt(at), run::Column::Id.gt(id)),
        Direction::Backward => (run::Column::CreatedAt.lt(at), run::Column::Id.lt(id)),
    };
    Ok(Condition::any()
        .add(created)
        .add(Condition::all().add(run::Column::CreatedAt.eq(at)).add(tie)))
}

fn active() -> Vec<&'static str> {
    RunStatus::ACTIVE.iter().map(|s| s.as_str()).collect()
}

/// The runs that have not ended: a query for active runs starts here so that both backends
/// answer it from the entries of `ix_runs_ended` without an end (`status` is not indexed, so
/// that a claim is a heap-only update: migration `m20250601_000017`). Every active run is
/// among them: `ended_at` is set exactly when a run ends.
fn unended() -> sea_orm::Select<run::Entity> {
    run::Entity::find().filter(run::Column::EndedAt.is_null())
}

fn validate_run_event(event: &NewRunEvent) -> Result<()> {
    if event.sequence < 1 {
        return Err(StoreError::invalid("sequence must be >= 1"));
    }
    if let Some(outcome) = &event.ends_run {
        check_outcome(outcome)?;
    }
    check_required("result_type", &event.result_type, 100)
}

/// What a new item writes besides its row ([`NewRunEvent::ends_run`],
/// [`NewRunEvent::transcript`]), added to `script` (SQLite), which the caller runs inside the
/// insert's transaction: a transcript row that does not validate fails the call before the
/// commit, so nothing is written (on Postgres it fails while the statement is built,
/// [`transcript_json`]).
fn item_writes(
    script: &mut Script,
    run_id: Uuid,
    ends_run: Option<RunOutcome>,
    transcript: Option<crate::NewTranscriptItem>,
) -> Result<()> {
    if let Some(outcome) = ends_run {
        script.push(&end_run_update(run_id, outcome));
    }
    if let Some(item) = transcript {
        let (_, row) = super::transcript::transcript_row(item)?;
        // Deterministic ids: a row whose id exists was written by an earlier attempt.
        script.push(
            &transcript::Entity::insert(row).on_conflict(OnConflict::new().do_nothing().to_owned()),
        );
    }
    Ok(())
}

fn run_event_model(event: NewRunEvent, now: DateTime<Utc>) -> run_event::ActiveModel {
    run_event::ActiveModel {
        run_id: Set(event.run_id.into_uuid()),
        sequence: Set(event.sequence),
        result_type: Set(event.result_type),
        data: Set(event.data.to_value()),
        created_at: Set(now),
    }
}

/// A result item already stored under its `(run_id, sequence)`, or a second terminal item of
/// its run (the partial unique index of migration `m20250601_000016`), is skipped: both are
/// "not new" to the caller. No conflict target, so either unique index counts.
fn on_conflict_skip() -> OnConflict {
    OnConflict::new().do_nothing().to_owned()
}

/// The result types of terminal items (the partial unique index covers exactly these).
fn terminal_types() -> [&'static str; 2] {
    [
        ResultType::RunCompleted.as_str(),
        ResultType::RunFailed.as_str(),
    ]
}

/// `result_type IN ('run.completed', 'run.failed')` with the types written out, not bound.
///
/// Why literal: a planner can use a partial index only where the query's condition implies
/// the index's own, and a bound parameter implies nothing (SQLite plans a statement once, for
/// any value; Postgres' generic plans likewise). With the list bound, "the run's terminal
/// item" is found by walking every stored item of the run in the primary key, and a check per
/// inserted item makes a streaming run's ledger writes quadratic in its length.
static TERMINAL_TYPE_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let [completed, failed] = terminal_types();
    format!(r#""result_type" IN ('{completed}', '{failed}')"#)
});

/// [`TERMINAL_TYPE_SQL`] as a sea-query condition.
fn is_terminal_type() -> sea_orm::sea_query::SimpleExpr {
    Expr::cust(TERMINAL_TYPE_SQL.as_str())
}

/// The sequence of the run's terminal item, if its ledger holds one.
async fn terminal_sequence<C: ConnectionTrait>(db: &C, run_id: Uuid) -> Result<Option<u64>> {
    let row = run_event::Entity::find()
        .filter(run_event::Column::RunId.eq(run_id))
        .filter(is_terminal_type())
        .one(db)
        .await?;
    Ok(row.map(|m| u64::try_from(m.sequence).unwrap_or_default()))
}

/// Removes from `events` every item whose run already holds a terminal item at a lower
/// sequence: nothing follows a run's end in its ledger. It happens when the host ended the run
/// (the reaper's `interrupted`, a recovery) while its worker was still streaming — a worker
/// stopped past its lease and resumed, a partition — and the worker's late items arrive. One
/// indexed lookup for all runs of the batch (the partial unique index of terminal items).
async fn drop_after_terminal<C: ConnectionTrait>(
    db: &C,
    events: Vec<NewRunEvent>,
) -> Result<Vec<NewRunEvent>> {
    let runs: HashSet<Uuid> = events.iter().map(|e| e.run_id.into_uuid()).collect();
    let ends: HashMap<Uuid, u64> = run_event::Entity::find()
        .select_only()
        .column(run_event::Column::RunId)
        .column(run_event::Column::Sequence)
        .filter(run_event::Column::RunId.is_in(runs))
        .filter(is_terminal_type())
        .into_tuple::<(Uuid, i64)>()
        .all(db)
        .await?
        .into_iter()
        .map(|(run_id, sequence)| (run_id, u64::try_from(sequence).unwrap_or_default()))
        .collect();
    if ends.is_empty() {
        return Ok(events);
    }
    Ok(events
        .into_iter()
        .filter(|e| match ends.get(&e.run_id.into_uuid()) {
            Some(end) => u64::try_from(e.sequence).unwrap_or_default() <= *end,
            None => true,
        })
        .collect())
}

/// The insert of [`RunLedger::insert_events`] on SQLite for up to [`INSERT_CHUNK`] items, in
/// one statement: an item past its run's stored terminal item is left out (what
/// [`drop_after_terminal`] decides, read by the statement itself instead of a select before
/// it), an item whose `(run_id, sequence)` or terminal slot is taken is skipped
/// ([`on_conflict_skip`]). Returns the `run_id` and `sequence` of each row written: the keys
/// only, since the whole rows would come back with every item's `data`, parsed into JSON
/// again for nothing (a fifth of a streaming run's sink time).
///
/// Each item's `data` is bound as the JSON text it is stored as ([`ItemJson`], serialized once
/// by the row's maker): bound as a JSON value, sea-orm copies every item's tree (map by map)
/// to bind it and sqlx then serializes the copy, for the same text in the column.
fn sqlite_insert_events_statement(events: &[NewRunEvent], now: DateTime<Utc>) -> Statement {
    const HEAD: &str = r#"INSERT INTO "run_events" ("run_id", "sequence", "result_type", "data", "created_at")
SELECT v.column1, v.column2, v.column3, v.column4, v.column5 FROM (VALUES "#;
    // Sized once (a row's placeholders are 17 bytes).
    let mut sql =
        String::with_capacity(HEAD.len() + events.len() * 17 + SQLITE_INSERT_EVENTS_TAIL.len());
    sql.push_str(HEAD);
    let mut values: Vec<sea_orm::Value> = Vec::with_capacity(events.len() * 5);
    for (i, event) in events.iter().enumerate() {
        sql.push_str(if i == 0 {
            "(?, ?, ?, ?, ?)"
        } else {
            ", (?, ?, ?, ?, ?)"
        });
        values.extend([
            event.run_id.into_uuid().into(),
            event.sequence.into(),
            event.result_type.clone().into(),
            // The item's JSON text, bound as it is stored.
            event.data.as_str().to_owned().into(),
            now.into(),
        ]);
    }
    sql.push_str(&SQLITE_INSERT_EVENTS_TAIL);
    Statement::from_sql_and_values(DbBackend::Sqlite, sql, values)
}

/// The end of [`sqlite_insert_events_statement`]. Each item's check for a stored terminal item
/// of its run is one probe of the partial unique index of terminal items, named so that the
/// plan cannot change under it (`INDEXED BY` makes a missing index an error, not a scan): the
/// primary key also matches `run_id`, and SQLite, without statistics, picked it — a walk over
/// every earlier item of the run, for each item (300 runs of 202 items inserted 20 at a time:
/// 0.77 s of CPU against 0.25 s through the partial index). The `WHERE` also settles SQLite's
/// parse of `INSERT … SELECT … ON CONFLICT`.
static SQLITE_INSERT_EVENTS_TAIL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        r#") AS v
WHERE NOT EXISTS (SELECT 1 FROM "run_events" t INDEXED BY "{TERMINAL_INDEX}"
    WHERE t."run_id" = v.column1 AND t.{terminal} AND t."sequence" < v.column2)
ON CONFLICT DO NOTHING
RETURNING "run_id", "sequence""#,
        terminal = TERMINAL_TYPE_SQL.as_str(),
    )
});

/// The partial unique index of terminal items (migration `m20250601_000016`).
const TERMINAL_INDEX: &str = "ux_run_events_one_terminal";

/// The status update of `finish_run` / `finalize_run` (filtered to active runs by the caller).
fn finish_update(outcome: RunOutcome) -> sea_orm::UpdateMany<run::Entity> {
    let mut update = run::Entity::update_many()
        .col_expr(run::Column::Status, Expr::value(outcome.status.as_str()))
        .col_expr(run::Column::ErrorCode, Expr::value(outcome.error_code))
        .col_expr(
            run::Column::ErrorMessage,
            Expr::value(outcome.error_message),
        )
        .col_expr(run::Column::EndedAt, Expr::value(now()));
    if let Some(usage) = outcome.usage {
        update = update.col_expr(run::Column::Usage, Expr::value(usage));
    }
    update
}

/// The row of a new `queued` run (validated); the id is the caller's or a fresh UUID v7.
fn new_run_row(new: NewRun) -> Result<run::ActiveModel> {
    check_required("runner_id", &new.runner_id, ID_LEN)?;
    check_required("pool", &new.pool, ID_LEN)?;
    check_len_opt("conversation_id", new.conversation_id.as_deref(), ID_LEN)?;
    check_len_opt("thread_id", new.thread_id.as_deref(), ID_LEN)?;
    check_len_opt("bot_id", new.bot_id.as_deref(), ID_LEN)?;
    if new.attempt < 1 {
        return Err(StoreError::invalid("attempt must be >= 1"));
    }
    let row = run::ActiveModel {
        id: Set(new.id.unwrap_or_default().into_uuid()),
        workspace_id: Set(new.workspace_id.as_str().to_owned()),
        event_id: Set(new.event_id.into_uuid()),
        agent_id: Set(new.agent_id.map(AgentId::into_uuid)),
        runner_id: Set(new.runner_id),
        pool: Set(new.pool),
        conversation_id: Set(new.conversation_id),
        thread_id: Set(new.thread_id),
        bot_id: Set(new.bot_id),
        status: Set(RunStatus::Queued.as_str().to_owned()),
        error_code: Set(None),
        error_message: Set(None),
        attempt: Set(new.attempt),
        worker_id: Set(None),
        created_at: Set(now()),
        started_at: Set(None),
        ended_at: Set(None),
        deadline_at: Set(new.deadline_at.map(super::micros)),
        cancel_requested_at: Set(None),
        cancel_reason: Set(None),
        last_sequence: Set(0),
        usage: Set(None),
        events_expired_at: Set(None),
    };
    Ok(row)
}

/// The insert of a new run, skipped when its event already has one.
fn run_insert(row: run::ActiveModel) -> sea_orm::Insert<run::ActiveModel> {
    run::Entity::insert(row).on_conflict(one_run_per_event())
}

/// An event has one run: a second insert for it does nothing.
fn one_run_per_event() -> OnConflict {
    OnConflict::column(run::Column::EventId)
        .do_nothing()
        .to_owned()
}

/// A run start validated and turned into rows ([`RunLedger::start_run`]).
#[derive(Clone)]
struct Start {
    id: RunId,
    event_id: EventId,
    run: run::ActiveModel,
    transcript: Option<transcript::ActiveModel>,
    event: crate::EventStatusUpdate,
    reads: StartReads,
    /// The run's workspace and conversation: where [`StartReads::latest_cursor`] reads.
    conversation: Option<(WorkspaceId, String)>,
}

impl Start {
    fn new(start: RunStart) -> Result<Self> {
        let RunStart {
            run,
            user_transcript,
            event,
            reads,
        } = start;
        let Some(id) = run.id else {
            return Err(StoreError::invalid(
                "a run is started with the id its job names",
            ));
        };
        let event_id = run.event_id;
        super::state::check_scope_keys(&reads.state_scopes)?;
        let conversation = run
            .conversation_id
            .clone()
            .filter(|_| reads.latest_cursor)
            .map(|c| (run.workspace_id.clone(), c));
        let run = new_run_row(run)?;
        let transcript = user_transcript
            .map(super::transcript::transcript_row)
            .transpose()?
            .map(|(_, row)| row);
        Ok(Self {
            id,
            event_id,
            run,
            transcript,
            event,
            reads,
            conversation,
        })
    }
}

/// What a start's reads found: the conversation's transcript cursor and the asked scopes'
/// values ([`StartedRun::latest_cursor`], [`StartedRun::state`]).
type StartReadsFound = (Option<String>, BTreeMap<String, BTreeMap<String, Value>>);

/// The per-start reads of [`sqlite_reads`] in one text whatever the batch holds (the starts
/// are one JSON parameter read with `json_each`), so the readers prepare it once per
/// connection and keep it in their statement caches; a presence and a cursor select per
/// start, joined into a text of their own for every batch, were parsed and planned again
/// every time. One row per start, numbered by its place in the array (`start`): whether its
/// event exists (ids are stored as blobs: `unhex` of the UUID text without its dashes), and
/// the conversation's highest transcript `seq` for a start that reads a cursor (`max` over
/// `ix_transcript_conversation_seq`; `NULL` for one that does not, or for a conversation
/// without rows).
const SQLITE_START_READS_SQL: &str = r#"SELECT s.key AS "start",
    EXISTS (SELECT 1 FROM "event_log" WHERE "id" = unhex(s.value->>'event_id', '-')) AS "present",
    iif(s.value->>'conversation_id' IS NULL, NULL,
        (SELECT max("seq") FROM "transcript" WHERE "workspace_id" = s.value->>'workspace_id'
            AND "conversation_id" = s.value->>'conversation_id')) AS "seq"
FROM json_each(?) AS s"#;

/// A start as [`SQLITE_START_READS_SQL`] reads it.
#[derive(serde::Serialize)]
struct StartReadRow<'a> {
    event_id: Uuid,
    workspace_id: Option<&'a str>,
    conversation_id: Option<&'a str>,
}

/// What every start's reads find on SQLite, on `db` (the readers), in start order, in one
/// hand-over ([`Script`]): whether each start's event exists and the transcript cursor of
/// each start that reads one ([`SQLITE_START_READS_SQL`]), then one select of the rows of
/// every scope any start asks for.
async fn sqlite_reads<C: ConnectionTrait>(
    db: &C,
    starts: &[Start],
) -> Result<Vec<(bool, StartReadsFound)>> {
    let rows: Vec<StartReadRow<'_>> = starts
        .iter()
        .map(|start| StartReadRow {
            event_id: start.event_id.into_uuid(),
            workspace_id: start.conversation.as_ref().map(|(w, _)| w.as_str()),
            conversation_id: start.conversation.as_ref().map(|(_, c)| c.as_str()),
        })
        .collect();
    let mut script = Script::new(db);
    script.push_statement(Statement::from_sql_and_values(
        DbBackend::Sqlite,
        SQLITE_START_READS_SQL,
        [super::jsonb_rows(&rows)?],
    ));
    let scopes: BTreeSet<&String> = starts
        .iter()
        .flat_map(|start| &start.reads.state_scopes)
        .collect();
    if !scopes.is_empty() {
        script.push(&super::state::scope_rows_select(
            scopes.iter().map(|scope_key| (*scope_key).clone()),
        ));
    }
    let rows = script.query_all(db).await?;
    if rows.len() < starts.len() {
        return Err(StoreError::Corrupt(
            "the presence and transcript cursor reads returned too few rows".into(),
        ));
    }
    let (start_rows, state_rows) = rows.split_at(starts.len());
    let mut read: Vec<(bool, Option<i64>)> = vec![(false, None); starts.len()];
    for row in start_rows {
        let place = usize::try_from(row.try_get::<i64>("", "start")?)
            .ok()
            .filter(|place| *place < starts.len())
            .ok_or_else(|| StoreError::Corrupt("a start read names no start".into()))?;
        read[place] = (
            row.try_get::<bool>("", "present")?,
            row.try_get::<Option<i64>>("", "seq")?,
        );
    }
    let mut values: HashMap<String, BTreeMap<String, Value>> = HashMap::new();
    for row in state_rows {
        values
            .entry(row.try_get("", "scope_key")?)
            .or_default()
            .insert(row.try_get("", "key")?, row.try_get("", "value")?);
    }
    let mut found = Vec::with_capacity(starts.len());
    for (start, (present, seq)) in starts.iter().zip(read) {
        let cursor = seq.map(super::transcript::transcript_cursor);
        let state = start
            .reads
            .state_scopes
            .iter()
            .map(|scope_key| {
                let scope = values.get(scope_key).cloned().unwrap_or_default();
                (scope_key.clone(), scope)
            })
            .collect();
        found.push((present, (cursor, state)));
    }
    Ok(found)
}

/// The SQL of [`start_runs_statement`]: one text whatever the batch holds (the starts are one
/// `jsonb` parameter, `$1`; `$2` is the time written), so Postgres plans it once per
/// connection instead of once per batch size. A chain of per-start `WITH` parts (the text
/// before) cost more to plan than to run: 2.5 ms to plan a batch of four.
///
/// It reads the ledger by key only, whatever the planner's statistics say and however small
/// the ledger was when the connection planned it: the starts are read with
/// [`BATCH_ROWS`](super::BATCH_ROWS) (which the planner counts as one row, so a probe by key
/// is the cheaper plan of every join), `started` checks each start's event with a `LATERAL`
/// subquery under a `LIMIT` (not flattened into a join), and the state rows are read for each
/// scope the same way (only for a start that reads scopes: most read none).
pub(crate) static START_RUNS_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        r#"WITH input AS (
    SELECT x.* FROM {BATCH_ROWS}($1::jsonb) AS r CROSS JOIN LATERAL jsonb_to_record(r) AS x(
        id uuid, workspace_id text, event_id uuid, agent_id uuid, runner_id text, pool text,
        conversation_id text, thread_id text, bot_id text, attempt bigint,
        deadline_at timestamptz, event_status text, event_reason text, event_run_id uuid,
        event_claimed_by_run_id uuid, metadata_removed text[], metadata_set jsonb,
        transcript jsonb, read_cursor boolean, state_scopes text[])
),
started AS (
    INSERT INTO runs (id, workspace_id, event_id, agent_id, runner_id, pool, conversation_id,
        thread_id, bot_id, status, attempt, created_at, deadline_at, last_sequence)
    SELECT i.id, i.workspace_id, i.event_id, i.agent_id, i.runner_id, i.pool,
        i.conversation_id, i.thread_id, i.bot_id, '{queued}', i.attempt, $2, i.deadline_at, 0
    FROM input i
    CROSS JOIN LATERAL (SELECT 1 FROM event_log e WHERE e.id = i.event_id LIMIT 1) AS found
    ON CONFLICT (event_id) DO NOTHING
    RETURNING *
),
transcribed AS (
    {INSERT_TRANSCRIPT}
    FROM input i
    JOIN started s ON s.id = i.id
    CROSS JOIN LATERAL jsonb_to_record(i.transcript) AS {TRANSCRIPT_RECORD}
    WHERE i.transcript IS NOT NULL
    ON CONFLICT DO NOTHING
),
dispatched AS (
    UPDATE event_log e SET
        status = i.event_status,
        updated_at = $2,
        reason = coalesce(i.event_reason, e.reason),
        run_id = coalesce(i.event_run_id, e.run_id),
        claimed_by_run_id = coalesce(i.event_claimed_by_run_id, e.claimed_by_run_id),
        metadata = CASE WHEN i.metadata_removed IS NULL AND i.metadata_set IS NULL
            THEN e.metadata
            ELSE nullif((coalesce(e.metadata, '{{}}'::jsonb)
                - coalesce(i.metadata_removed, '{{}}'::text[]))
                || coalesce(i.metadata_set, '{{}}'::jsonb), '{{}}'::jsonb) END
    FROM input i
    JOIN started s ON s.id = i.id
    WHERE e.id = i.event_id
)
SELECT s.*,
    CASE WHEN i.read_cursor THEN (SELECT t.seq FROM transcript t
        WHERE t.workspace_id = s.workspace_id AND t.conversation_id = s.conversation_id
        ORDER BY t.seq DESC LIMIT 1) END AS latest_seq,
    CASE WHEN cardinality(i.state_scopes) > 0 THEN (
        SELECT jsonb_agg(jsonb_build_array(a.scope_key, a.key, a.value))
        FROM {BATCH_ROWS}(to_jsonb(i.state_scopes)) AS k(scope_key)
        JOIN agent_state a ON a.scope_key = k.scope_key #>> '{{}}') END AS state_rows
FROM started s
JOIN input i ON i.id = s.id"#,
        queued = RunStatus::Queued.as_str(),
        BATCH_ROWS = super::BATCH_ROWS,
    )
});

/// The head of an insert of the transcript rows `t` ([`TRANSCRIPT_RECORD`]) written at `$2`,
/// for the statements that write transcript rows with others.
const INSERT_TRANSCRIPT: &str = "INSERT INTO transcript (id, workspace_id, conversation_id,
        thread_id, bot_id, event_id, run_id, runner_id, role, item_type, content, content_json,
        artifact_refs, metadata, created_at)
    SELECT t.id, t.workspace_id, t.conversation_id, t.thread_id, t.bot_id, t.event_id,
        t.run_id, t.runner_id, t.role, t.item_type, t.content, t.content_json,
        t.artifact_refs, t.metadata, $2";

/// The record type of a transcript row in `jsonb` ([`transcript_json`]), for
/// `jsonb_to_record(…) AS <this>` in the statements that write transcript rows with others.
const TRANSCRIPT_RECORD: &str = "t(
        id text, workspace_id text, conversation_id text, thread_id text, bot_id text,
        event_id text, run_id uuid, runner_id text, role text, item_type text, content text,
        content_json jsonb, artifact_refs jsonb, metadata jsonb)";

/// [`RunLedger::start_runs`] on Postgres as one data-modifying `WITH` ([`START_RUNS_SQL`]),
/// so starting runs costs one round trip and one commit however many there are: the run
/// inserts `started` (only where the event exists; skipped when the event has a run already),
/// then, only for the runs inserted, the user transcript rows `transcribed` (skipped when the
/// id exists) and the events' routing updates `dispatched` (as
/// [`EventLog::update_status`](crate::EventLog::update_status), metadata merged in place). It
/// returns the inserted run rows, each with its [reads](RunStart::reads): `latest_seq` and
/// `state_rows` (`[scope_key, key, value]` triples). Every part of a `WITH` sees the tables
/// as they were before the statement, so the cursor is the one before the start's user row.
/// A start without a row wrote nothing.
fn start_runs_statement(starts: &[Start]) -> Result<Statement> {
    let rows = starts.iter().map(start_json).collect::<Result<Vec<_>>>()?;
    if rows.is_empty() {
        return Err(StoreError::invalid("no run to start"));
    }
    Ok(Statement::from_sql_and_values(
        DbBackend::Postgres,
        START_RUNS_SQL.as_str(),
        [super::jsonb_rows(&rows)?, now().into()],
    ))
}

/// A row of [`START_RUNS_SQL`]'s answer: the run and what its reads found.
fn postgres_started(row: &sea_orm::QueryResult) -> Result<StartedRun> {
    let run = run_record(run::Model::from_query_result(row, "")?)?;
    let latest_cursor = row
        .try_get::<Option<i64>>("", "latest_seq")?
        .map(super::transcript::transcript_cursor);
    let mut state: BTreeMap<String, BTreeMap<String, Value>> = BTreeMap::new();
    if let Some(Value::Array(rows)) = row.try_get::<Option<Value>>("", "state_rows")? {
        for triple in rows {
            let Ok([Value::String(scope_key), Value::String(key), value]) =
                <[Value; 3]>::try_from(match triple {
                    Value::Array(parts) => parts,
                    _ => Vec::new(),
                })
            else {
                return Err(StoreError::Corrupt(
                    "a state row read with a run start".into(),
                ));
            };
            state.entry(scope_key).or_default().insert(key, value);
        }
    }
    Ok(StartedRun {
        run,
        latest_cursor,
        state,
    })
}

/// One start as a row of [`START_RUNS_SQL`]'s input: the run's values (validated by
/// [`new_run_row`]), the event's status update and the user transcript row.
fn start_json(start: &Start) -> Result<serde_json::Value> {
    let run = &start.run;
    let event = super::events::postgres_status_json(start.event.clone())?;
    let transcript = start.transcript.clone().map(transcript_model_json);
    let mut row = serde_json::json!({
        "id": run.id.try_as_ref(),
        "workspace_id": run.workspace_id.try_as_ref(),
        "event_id": run.event_id.try_as_ref(),
        "agent_id": run.agent_id.try_as_ref(),
        "runner_id": run.runner_id.try_as_ref(),
        "pool": run.pool.try_as_ref(),
        "conversation_id": run.conversation_id.try_as_ref(),
        "thread_id": run.thread_id.try_as_ref(),
        "bot_id": run.bot_id.try_as_ref(),
        "attempt": run.attempt.try_as_ref(),
        "deadline_at": run.deadline_at.try_as_ref(),
        "transcript": transcript,
        "read_cursor": start.conversation.is_some(),
        "state_scopes": start.reads.state_scopes,
    });
    if let (Some(row), serde_json::Value::Object(event)) = (row.as_object_mut(), event) {
        row.extend(event);
    }
    Ok(row)
}

/// Ends the run if it is still active; `true` if it was.
async fn end_run<C: ConnectionTrait>(db: &C, id: Uuid, outcome: RunOutcome) -> Result<bool> {
    let res = end_run_update(id, outcome).exec(db).await?;
    Ok(res.rows_affected == 1)
}

/// The update that ends run `id` with `outcome` unless it has ended already.
fn end_run_update(id: Uuid, outcome: RunOutcome) -> sea_orm::UpdateMany<run::Entity> {
    finish_update(outcome)
        .filter(run::Column::Id.eq(id))
        .filter(run::Column::Status.is_in(active()))
}

fn check_outcome(outcome: &RunOutcome) -> Result<()> {
    if !outcome.status.is_terminal() {
        return Err(StoreError::invalid(format!(
            "{} is not a terminal run status",
            outcome.status
        )));
    }
    check_len_opt("error_code", outcome.error_code.as_deref(), 64)
}

fn run_missing(err: sea_orm::DbErr, what: &str) -> StoreError {
    if is_foreign_key_violation(&err) {
        StoreError::not_found(what)
    } else {
        err.into()
    }
}

/// Raises `runs.last_sequence` to `sequence` (never lowers it).
async fn bump_last_sequence<C: ConnectionTrait>(db: &C, run_id: Uuid, sequence: i64) -> Result<()> {
    bump_last_sequences(db, &HashMap::from([(run_id, sequence)])).await
}

/// Raises each run's `runs.last_sequence` to its sequence in `maxima` (never lowers one), in
/// one statement for the whole map: `SET last_sequence = CASE id WHEN … THEN … END`.
async fn bump_last_sequences<C: ConnectionTrait>(
    db: &C,
    maxima: &HashMap<Uuid, i64>,
) -> Result<()> {
    if let Some(update) = last_sequences_update(maxima) {
        update.exec(db).await?;
    }
    Ok(())
}

/// The statement of [`bump_last_sequences`] (`None` for an empty map).
fn last_sequences_update(maxima: &HashMap<Uuid, i64>) -> Option<sea_orm::UpdateMany<run::Entity>> {
    if maxima.is_empty() {
        return None;
    }
    let mut case = CaseStatement::new();
    for (run_id, sequence) in maxima {
        case = case.case(run::Column::Id.eq(*run_id), Expr::value(*sequence));
    }
    let target = Expr::Case(Box::new(case));
    Some(
        run::Entity::update_many()
            .col_expr(run::Column::LastSequence, target.clone())
            .filter(run::Column::Id.is_in(maxima.keys().copied()))
            .filter(sea_orm::sea_query::ExprTrait::lt(
                Expr::col(run::Column::LastSequence),
                target,
            )),
    )
}

/// A start's event does not exist.
fn event_not_found(id: EventId) -> StoreError {
    StoreError::not_found(format!("event {id}"))
}

/// The error of a start batch whose insert failed: a taken run id is a conflict (the caller
/// then starts one by one, and the start whose id it is fails alone).
fn run_id_taken(starts: &[Start], e: sea_orm::DbErr) -> StoreError {
    if is_unique_violation(&e) {
        StoreError::Conflict(match starts {
            [start] => format!("run {} already exists for another event", start.id),
            _ => "a run id already exists for another event".into(),
        })
    } else {
        e.into()
    }
}

impl SqlStore {
    /// Starts `starts` in one commit (see [`RunLedger::start_runs`]); an error fails them
    /// all and writes nothing.
    async fn start_together(&self, starts: &[Start]) -> Result<Vec<Result<Option<StartedRun>>>> {
        let taken = |e| run_id_taken(starts, e);
        if starts.is_empty() {
            return Ok(Vec::new());
        }
        if self.backend() == DbBackend::Postgres {
            let rows = self
                .writer()
                .query_all_raw(start_runs_statement(starts)?)
                .await
                .map_err(taken)?;
            let mut started = HashMap::with_capacity(rows.len());
            for row in rows {
                let started_run = postgres_started(&row)?;
                started.insert(started_run.run.id, started_run);
            }
            let mut outcomes = Vec::with_capacity(starts.len());
            for start in starts {
                outcomes.push(match started.remove(&start.id) {
                    Some(mut started_run) => {
                        // A scope without values has no row to name it.
                        for scope_key in &start.reads.state_scopes {
                            started_run.state.entry(scope_key.clone()).or_default();
                        }
                        Ok(Some(started_run))
                    }
                    // Nothing written: the event has a run already, or there is no such event.
                    None => match crate::EventLog::routing(self, start.event_id).await? {
                        Some(_) => Ok(None),
                        None => Err(event_not_found(start.event_id)),
                    },
                });
            }
            return Ok(outcomes);
        }
        // The reads first, on the readers: the one writer is what every write of the host
        // waits for, so it holds nothing but the writes (WAL: the readers see the last
        // commit, which is what the start's own statements would have seen).
        let reads = sqlite_reads(&self.db, starts).await?;
        // Only the starts of events that exist are written: one of a missing event writes
        // nothing and fails alone, as on Postgres.
        let writing: Vec<&Start> = starts
            .iter()
            .zip(&reads)
            .filter_map(|(start, (present, _))| present.then_some(start))
            .collect();
        let mut updates = Vec::with_capacity(writing.len());
        for start in &writing {
            match super::events::sqlite_start_update(
                start.event_id,
                start.event.clone(),
                start.id.into_uuid(),
            )? {
                Some(update) => updates.push(update),
                None => {
                    let reads = reads.into_iter().map(|(_, found)| found).collect();
                    return self.start_in_steps(starts, reads).await;
                }
            }
        }
        let mut inserted = if writing.is_empty() {
            HashMap::new()
        } else {
            self.write_starts(&writing, &updates)
                .await
                .map_err(|e| match e {
                    StoreError::Database(e) => taken(e),
                    e => e,
                })?
        };
        let mut outcomes = Vec::with_capacity(starts.len());
        for (start, (present, (latest_cursor, state))) in starts.iter().zip(reads) {
            outcomes.push(match inserted.remove(&start.id.into_uuid()) {
                Some(model) => Ok(Some(StartedRun {
                    run: run_record(model)?,
                    latest_cursor,
                    state,
                })),
                // The event exists (and still did when the batch committed: see
                // `write_starts`), so its run was skipped for the one it has already.
                None if present => Ok(None),
                None => Err(event_not_found(start.event_id)),
            });
        }
        Ok(outcomes)
    }

    /// The write of [`Self::start_together`]'s SQLite batch `writing` (starts of events
    /// that existed at the reads), with their event `updates`, in the writer's shared
    /// transaction; returns the runs written.
    async fn write_starts(
        &self,
        writing: &[&Start],
        updates: &[sea_orm::sea_query::UpdateStatement],
    ) -> Result<HashMap<uuid::Uuid, run::Model>> {
        super::tick::write_in_tick!(self, |txn| write_starts_in(txn, writing, updates))
    }

    /// [`Self::start_together`] on SQLite for a batch with an event update that cannot
    /// merge in place: the runs' insert first, then the updates (the others read-modify-
    /// write) and user rows of the runs it wrote, then the commit.
    async fn start_in_steps(
        &self,
        starts: &[Start],
        reads: Vec<StartReadsFound>,
    ) -> Result<Vec<Result<Option<StartedRun>>>> {
        let taken = |e| run_id_taken(starts, e);
        let txn = self.write_txn().await?;
        // Every run in one multi-row insert (each SQLite statement is a hand-over to the
        // connection's thread and back): an event that has a run already skips its row; a
        // taken run id fails the statement for all (the caller then starts one by one).
        let mut inserted: HashMap<uuid::Uuid, run::Model> =
            run::Entity::insert_many(starts.iter().map(|start| start.run.clone()))
                .on_conflict(one_run_per_event())
                .exec_with_returning(&txn)
                .await
                .map_err(taken)?
                .into_iter()
                .map(|model| (model.id, model))
                .collect();
        let mut outcomes = Vec::with_capacity(starts.len());
        let mut user_rows = Vec::new();
        // The started runs' event updates and user rows, sent together.
        let mut event_updates = Script::new(&txn);
        let mut updated_events = Vec::new();
        for (start, (latest_cursor, state)) in starts.iter().zip(reads) {
            let Some(model) = inserted.remove(&start.id.into_uuid()) else {
                outcomes.push(Ok(None));
                continue;
            };
            user_rows.extend(start.transcript.clone());
            let event = start.event.clone();
            if super::events::script_status_update(&txn, &mut event_updates, start.event_id, event)
                .await?
            {
                updated_events.push(start.event_id);
            }
            outcomes.push(Ok(Some(StartedRun {
                run: run_record(model)?,
                latest_cursor,
                state,
            })));
        }
        // The started runs' user rows in one insert, in start order (a row whose id exists is
        // skipped), sent with the event updates.
        if !user_rows.is_empty() {
            event_updates.push(
                &transcript::Entity::insert_many(user_rows)
                    .on_conflict(OnConflict::new().do_nothing().to_owned()),
            );
        }
        // An update that returned no row names no event: `not_found`, and dropping `txn`
        // rolls the runs back (alone, the start then fails with its own event's id).
        if event_updates.query_all(&txn).await?.len() != updated_events.len() {
            return Err(StoreError::not_found(match updated_events.as_slice() {
                [id] => format!("event {id}"),
                _ => "an event of the run starts".into(),
            }));
        }
        txn.commit().await?;
        Ok(outcomes)
    }
}

/// [`SqlStore::write_starts`]'s writes, in `txn`.
async fn write_starts_in(
    txn: &DatabaseTransaction,
    writing: &[&Start],
    updates: &[sea_orm::sea_query::UpdateStatement],
) -> Result<HashMap<uuid::Uuid, run::Model>> {
    // Every statement of the start in one hand-over (each SQLite statement is a
    // hand-over to the connection's thread and back): the runs in one
    // multi-row insert (an event that has a run already skips its row; a taken run id
    // fails the script for all, and the caller then starts one by one), each event's
    // update made only if its run was written, and the user rows (their ids are the
    // events': a row written with its event's first run is skipped).
    let mut script = Script::new(txn);
    let mut runs = run::Entity::insert_many(writing.iter().map(|start| start.run.clone()))
        .on_conflict(one_run_per_event())
        .into_query();
    script.push_query(runs.returning_all());
    for update in updates {
        script.push_query(update);
    }
    let user_rows: Vec<_> = writing
        .iter()
        .filter_map(|s| s.transcript.clone())
        .collect();
    if !user_rows.is_empty() {
        script.push(
            &transcript::Entity::insert_many(user_rows)
                .on_conflict(OnConflict::new().do_nothing().to_owned()),
        );
    }
    let rows = script.query_all(txn).await?;
    // The runs' rows (the only ones with an `event_id`), then the updated events' ids.
    let mut inserted = HashMap::new();
    let mut updated: HashSet<uuid::Uuid> = HashSet::new();
    for row in &rows {
        if row.try_get::<uuid::Uuid>("", "event_id").is_ok() {
            let model = run::Model::from_query_result(row, "")?;
            inserted.insert(model.id, model);
        } else {
            updated.insert(row.try_get("", "id")?);
        }
    }
    // A run written whose event was not updated: the event was deleted (retention)
    // since the reads. An error rolls the batch back (alone, that start then
    // fails with its own event's id).
    if inserted.len() != updated.len() {
        return Err(StoreError::not_found("an event of the run starts"));
    }
    Ok(inserted)
}

#[async_trait]
impl RunLedger for SqlStore {
    async fn create_run(&self, new: NewRun) -> Result<(RunRecord, bool)> {
        let (id, event_id) = (new.id.unwrap_or_default(), new.event_id);
        let row = new_run_row(NewRun {
            id: Some(id),
            ..new
        })?;
        let inserted = run_insert(row)
            .exec_with_returning_many(self.writer())
            .await
            .map_err(|e| {
                if is_unique_violation(&e) {
                    StoreError::Conflict(format!("run {id} already exists for another event"))
                } else {
                    e.into()
                }
            })?;
        if let Some(model) = inserted.into_iter().next() {
            return Ok((run_record(model)?, true));
        }
        let existing = run::Entity::find()
            .filter(run::Column::EventId.eq(event_id.into_uuid()))
            .all(&self.db)
            .await?
            .unique_row()
            .ok_or_else(|| StoreError::Corrupt("event conflict without a stored run".into()))?;
        Ok((run_record(existing)?, false))
    }

    async fn start_run(&self, start: RunStart) -> Result<Option<StartedRun>> {
        let start = Start::new(start)?;
        self.start_together(std::slice::from_ref(&start))
            .await?
            .pop()
            .unwrap_or_else(|| Err(StoreError::Corrupt("a run start went unanswered".into())))
    }

    async fn start_runs(&self, starts: Vec<RunStart>) -> Vec<Result<Option<StartedRun>>> {
        let shared = Shared::validate("a run start", starts, Start::new);
        let started = shared.write(|starts| self.start_together(starts)).await;
        shared.answer(started)
    }

    async fn get_run(&self, id: RunId) -> Result<Option<RunRecord>> {
        run::Entity::find_by_id(id.into_uuid())
            .all(&self.db)
            .await?
            .unique_row()
            .map(run_record)
            .transpose()
    }

    async fn list_runs(
        &self,
        filter: RunFilter,
        cursor: Option<String>,
        limit: Option<i64>,
    ) -> Result<Page<RunRecord>> {
        let limit = clamp_limit(limit, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT);
        let mut select =
            run::Entity::find().filter(run::Column::WorkspaceId.eq(filter.workspace_id.as_str()));
        if let Some(conversation) = filter.conversation_id {
            select = select.filter(run::Column::ConversationId.eq(conversation));
        }
        if !filter.statuses.is_empty() {
            select = select
                .filter(run::Column::Status.is_in(filter.statuses.iter().map(|s| s.as_str())));
        }
        if let Some(agent) = filter.agent_id {
            select = select.filter(run::Column::AgentId.eq(agent.into_uuid()));
        }
        if let Some(runner) = filter.runner_id {
            select = select.filter(run::Column::RunnerId.eq(runner));
        }
        if let Some(cursor) = cursor {
            select = select.filter(past_cursor(&cursor, Direction::Backward)?);
        }
        let rows = select
            .order_by_desc(run::Column::CreatedAt)
            .order_by_desc(run::Column::Id)
            .limit(limit + 1)
            .all(&self.db)
            .await?;
        Ok(Page::from_overfetch(records(rows)?, limit, run_cursor))
    }

    async fn runs_with_status(
        &self,
        status: RunStatus,
        cursor: Option<String>,
        limit: Option<i64>,
    ) -> Result<Page<RunRecord>> {
        let limit = clamp_limit(limit, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT);
        let select = if status.is_terminal() {
            run::Entity::find()
        } else {
            unended()
        };
        let mut select = select.filter(run::Column::Status.eq(status.as_str()));
        if let Some(cursor) = cursor {
            select = select.filter(past_cursor(&cursor, Direction::Forward)?);
        }
        let rows = select
            .order_by_asc(run::Column::CreatedAt)
            .order_by_asc(run::Column::Id)
            .limit(limit + 1)
            .all(&self.db)
            .await?;
        Ok(Page::from_overfetch(records(rows)?, limit, run_cursor))
    }

    async fn claim_run(&self, id: RunId, worker_id: &str) -> Result<bool> {
        Ok(self.claim_runs(&[id], worker_id).await?.contains(&id))
    }

    async fn claim_runs(&self, ids: &[RunId], worker_id: &str) -> Result<HashSet<RunId>> {
        check_required("worker_id", worker_id, ID_LEN)?;
        if ids.is_empty() {
            return Ok(HashSet::new());
        }
        // Only the ids come back: the claimer needs to know which runs it won, not their rows.
        let mut claim = run::Entity::update_many()
            .col_expr(
                run::Column::Status,
                Expr::value(RunStatus::Running.as_str()),
            )
            .col_expr(run::Column::WorkerId, Expr::value(worker_id))
            .col_expr(run::Column::StartedAt, Expr::value(now()))
            .filter(run::Column::Id.is_in(ids.iter().map(|id| id.into_uuid())))
            .filter(run::Column::Status.eq(RunStatus::Queued.as_str()))
            .into_query();
        claim.returning_col(run::Column::Id);
        let rows = self.writer().query_all(&claim).await?;
        rows.iter()
            .map(|row| Ok(RunId::from_uuid(row.try_get::<Uuid>("", "id")?)))
            .collect()
    }

    async fn finish_run(&self, id: RunId, outcome: RunOutcome) -> Result<bool> {
        check_outcome(&outcome)?;
        end_run(self.writer(), id.into_uuid(), outcome).await
    }

    async fn finalize_run(
        &self,
        id: RunId,
        outcome: RunOutcome,
        terminal: AgentRunResult,
    ) -> Result<Finalized> {
        check_outcome(&outcome)?;
        let target = outcome.status;
        if !terminal.is_terminal() {
            return Err(StoreError::invalid(format!(
                "{} is not a terminal result item",
                terminal.result_type
            )));
        }
        let uuid = id.into_uuid();
        // Rows are written in the order `insert_events` writes them (the item, then the run
        // row), so a concurrent sink batch of the same run waits on us or we on it, never
        // both. Dropping the transaction without commit rolls it back.
        let txn = self.write_txn().await?;
        let run = run::Entity::find_by_id(uuid)
            .one(&txn)
            .await?
            .ok_or_else(|| StoreError::not_found(format!("run {id}")))?;
        let status: RunStatus = run.status.parse()?;
        if status.is_terminal() {
            return Ok(Finalized::AlreadyEnded(status));
        }
        if let Some(sequence) = terminal_sequence(&txn, uuid).await? {
            return Ok(Finalized::TerminalStored { sequence });
        }
        let mut sequence = run.last_sequence.max(0) + 1;
        let created_at = now();
        loop {
            let item = terminal
                .clone()
                .with_run_id(id)
                .with_sequence(u64::try_from(sequence).unwrap_or_default());
            let row = NewRunEvent {
                run_id: id,
                sequence,
                result_type: item.result_type.clone(),
                data: ItemJson::of(&item),
                // The run is ended below, with the status of the caller's outcome.
                ends_run: None,
                transcript: None,
            };
            let inserted = run_event::Entity::insert(run_event_model(row, created_at))
                .on_conflict(on_conflict_skip())
                .exec_without_returning(&txn)
                .await?;
            if inserted == 1 {
                break;
            }
            // Taken meanwhile: by the run's own terminal item, or by an item still in flight
            // when the run was read (then the next sequence is tried).
            if let Some(existing) = terminal_sequence(&txn, uuid).await? {
                return Ok(Finalized::TerminalStored { sequence: existing });
            }
            sequence += 1;
        }
        bump_last_sequence(&txn, uuid, sequence).await?;
        let res = finish_update(outcome)
            .filter(run::Column::Id.eq(uuid))
            .filter(run::Column::Status.is_in(active()))
            .exec(&txn)
            .await?;
        if res.rows_affected != 1 {
            // Ended meanwhile without an item of ours (e.g. an unrouted queued run).
            drop(txn);
            let status = self.get_run(id).await?.map_or(target, |r| r.status);
            return Ok(Finalized::AlreadyEnded(status));
        }
        txn.commit().await?;
        Ok(Finalized::Ended {
            sequence: u64::try_from(sequence).unwrap_or_default(),
        })
    }

    async fn request_cancel(&self, id: RunId, reason: Option<String>) -> Result<CancelOutcome> {
        let res = run::Entity::update_many()
            .col_expr(run::Column::CancelRequestedAt, Expr::value(now()))
            .col_expr(run::Column::CancelReason, Expr::value(reason))
            .filter(run::Column::Id.eq(id.into_uuid()))
            .filter(run::Column::Status.is_in(active()))
            .filter(run::Column::CancelRequestedAt.is_null())
            .exec(self.writer())
            .await?;
        if res.rows_affected == 1 {
            return Ok(CancelOutcome::Requested);
        }
        let current = self
            .get_run(id)
            .await?
            .ok_or_else(|| StoreError::not_found(format!("run {id}")))?;
        Ok(if current.status.is_terminal() {
            CancelOutcome::AlreadyFinished(current.status)
        } else {
            CancelOutcome::AlreadyRequested
        })
    }

    async fn insert_event(&self, event: NewRunEvent) -> Result<bool> {
        validate_run_event(&event)?;
        let (run_id, sequence) = (event.run_id, event.sequence);
        let txn = self.write_txn().await?;
        // The run must exist (Postgres has no foreign key on the items any more, see
        // migration `m20250601_000019`; on SQLite the key would refuse the insert).
        if run::Entity::find_by_id(run_id.into_uuid())
            .select_only()
            .column(run::Column::Id)
            .into_tuple::<Uuid>()
            .one(&txn)
            .await?
            .is_none()
        {
            return Err(StoreError::not_found(format!("run {run_id}")));
        }
        let Some(event) = drop_after_terminal(&txn, vec![event]).await?.pop() else {
            txn.commit().await?;
            return Ok(false);
        };
        let (ends_run, transcript) = (event.ends_run.clone(), event.transcript.clone());
        let inserted = run_event::Entity::insert(run_event_model(event, now()))
            .on_conflict(on_conflict_skip())
            .exec_without_returning(&txn)
            .await
            .map_err(|e| run_missing(e, &format!("run {run_id}")))?;
        if inserted == 1 {
            let mut writes = Script::new(&txn);
            let bump = HashMap::from([(run_id.into_uuid(), sequence)]);
            if let Some(update) = last_sequences_update(&bump) {
                writes.push(&update);
            }
            item_writes(&mut writes, run_id.into_uuid(), ends_run, transcript)?;
            writes.execute(&txn).await?;
        }
        txn.commit().await?;
        Ok(inserted == 1)
    }

    async fn insert_events(&self, events: Vec<NewRunEvent>) -> Result<Vec<bool>> {
        for event in &events {
            validate_run_event(event)?;
        }
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<(Uuid, i64)> = events
            .iter()
            .map(|e| (e.run_id.into_uuid(), e.sequence))
            .collect();
        let now = now();
        let mut new_keys = if self.backend() == DbBackend::Postgres {
            self.insert_events_postgres(events, now).await?
        } else {
            self.insert_events_in_transaction(events, now).await?
        };
        // A key inserted by this call is new for its first occurrence in the input only.
        Ok(keys.into_iter().map(|key| new_keys.remove(&key)).collect())
    }

    async fn events_after(
        &self,
        run_id: RunId,
        after_sequence: i64,
        limit: u64,
    ) -> Result<Vec<RunEventRecord>> {
        let rows = run_event::Entity::find()
            .filter(run_event::Column::RunId.eq(run_id.into_uuid()))
            .filter(run_event::Column::Sequence.gt(after_sequence))
            .order_by_asc(run_event::Column::Sequence)
            .limit(limit.clamp(1, MAX_RUN_EVENTS_BATCH))
            .all(&self.db)
            .await?;
        Ok(rows.into_iter().map(run_event_record).collect())
    }

    async fn runs_past_deadline(&self, now: DateTime<Utc>, limit: u64) -> Result<Vec<RunRecord>> {
        let rows = unended()
            .filter(run::Column::Status.is_in(active()))
            .filter(run::Column::DeadlineAt.is_not_null())
            .filter(run::Column::DeadlineAt.lt(now))
            .order_by_asc(run::Column::DeadlineAt)
            .limit(limit.clamp(1, MAX_RUN_EVENTS_BATCH))
            .all(&self.db)
            .await?;
        records(rows)
    }

    async fn runs_without_deadline_created_before(
        &self,
        created_before: DateTime<Utc>,
        limit: u64,
    ) -> Result<Vec<RunRecord>> {
        let rows = unended()
            .filter(run::Column::Status.is_in(active()))
            .filter(run::Column::DeadlineAt.is_null())
            .filter(run::Column::CreatedAt.lt(created_before))
            .order_by_asc(run::Column::CreatedAt)
            .limit(limit.clamp(1, MAX_RUN_EVENTS_BATCH))
            .all(&self.db)
            .await?;
        records(rows)
    }

    async fn active_runs_for_conversation(
        &self,
        workspace_id: &WorkspaceId,
        conversation_id: &str,
    ) -> Result<Vec<RunRecord>> {
        check_len("conversation_id", conversation_id, ID_LEN)?;
        let rows = run::Entity::find()
            .filter(run::Column::WorkspaceId.eq(workspace_id.as_str()))
            .filter(run::Column::ConversationId.eq(conversation_id))
            .filter(run::Column::Status.is_in(active()))
            .order_by_asc(run::Column::CreatedAt)
            .order_by_asc(run::Column::Id)
            .all(&self.db)
            .await?;
        records(rows)
    }

    async fn expire_events(&self, ended_before: DateTime<Utc>, batch: u64) -> Result<u64> {
        let txn = self.write_txn().await?;
        let ids: Vec<Uuid> = run::Entity::find()
            .select_only()
            .column(run::Column::Id)
            .filter(run::Column::EndedAt.lt(ended_before))
            .filter(run::Column::EventsExpiredAt.is_null())
            .order_by_asc(run::Column::EndedAt)
            .limit(batch.clamp(1, super::IN_CHUNK as u64))
            .into_tuple()
            .all(&txn)
            .await?;
        if ids.is_empty() {
            return Ok(0);
        }
        run_event::Entity::delete_many()
            .filter(run_event::Column::RunId.is_in(ids.iter().copied()))
            .exec(&txn)
            .await?;
        run::Entity::update_many()
            .col_expr(run::Column::EventsExpiredAt, Expr::value(now()))
            .filter(run::Column::Id.is_in(ids.iter().copied()))
            .exec(&txn)
            .await?;
        txn.commit().await?;
        Ok(ids.len() as u64)
    }
}

impl SqlStore {
    /// [`RunLedger::insert_events`] on Postgres: the terminal check, the insert and the
    /// `last_sequence` raise of a chunk are **one statement** ([`insert_events_statement`]),
    /// so a sink batch costs one round trip and one commit instead of five round trips
    /// (`BEGIN`, read, insert, update, `COMMIT`). A batch of more than one chunk runs its
    /// statements in one transaction, as on SQLite.
    async fn insert_events_postgres(
        &self,
        events: Vec<NewRunEvent>,
        now: DateTime<Utc>,
    ) -> Result<HashSet<(Uuid, i64)>> {
        let mut new_keys: HashSet<(Uuid, i64)> = HashSet::new();
        if events.len() <= INSERT_CHUNK {
            new_keys.extend(insert_chunk_postgres(self.writer(), &events, now).await?);
        } else {
            let txn = self.write_txn().await?;
            for chunk in events.chunks(INSERT_CHUNK) {
                new_keys.extend(insert_chunk_postgres(&txn, chunk, now).await?);
            }
            txn.commit().await?;
        }
        Ok(new_keys)
    }

    /// [`RunLedger::insert_events`] on SQLite, in the writer's shared transaction: the
    /// terminal check, the multi-row inserts and the `last_sequence` raise; returns the
    /// inserted keys.
    async fn insert_events_in_transaction(
        &self,
        mut events: Vec<NewRunEvent>,
        now: DateTime<Utc>,
    ) -> Result<HashSet<(Uuid, i64)>> {
        // Taken out of the rows (the insert needs neither) and kept by key: each attempt of the
        // write (again after a rollback of its tick) reads its own copies from here. Of a key
        // given twice, the last occurrence's writes are kept.
        let mut writes: HashMap<(Uuid, i64), SqliteItemWrites> = HashMap::new();
        for e in events
            .iter_mut()
            .filter(|e| e.ends_run.is_some() || e.transcript.is_some())
        {
            let key = (e.run_id.into_uuid(), e.sequence);
            let taken = (e.ends_run.take(), e.transcript.take());
            writes.insert(key, taken);
        }
        super::tick::write_in_tick!(self, |txn| insert_events_sqlite(txn, &events, &writes, now))
    }
}

/// What a new item writes beyond its row: the run's end, a transcript row.
type SqliteItemWrites = (Option<RunOutcome>, Option<crate::NewTranscriptItem>);

/// [`SqlStore::insert_events_in_transaction`]'s writes in `txn`: the rows of `events` and
/// what the new ones write beyond them (`writes`, by key).
async fn insert_events_sqlite(
    txn: &DatabaseTransaction,
    events: &[NewRunEvent],
    writes: &HashMap<(Uuid, i64), SqliteItemWrites>,
    now: DateTime<Utc>,
) -> Result<HashSet<(Uuid, i64)>> {
    let mut new_keys: HashSet<(Uuid, i64)> = HashSet::new();
    for chunk in events.chunks(INSERT_CHUNK) {
        let rows = txn
            .query_all_raw(sqlite_insert_events_statement(chunk, now))
            .await
            .map_err(|e| run_missing(e, "run of a result item"))?;
        for row in rows {
            new_keys.insert((row.try_get("", "run_id")?, row.try_get("", "sequence")?));
        }
    }
    // What the new items write beyond their rows, in key order (transcript rows are
    // numbered as they are inserted), as one statement text.
    let mut keys: Vec<&(Uuid, i64)> = new_keys.iter().collect();
    keys.sort_unstable();
    let mut runs: Vec<SqliteRunWrite> = Vec::new();
    let mut transcripts = Vec::new();
    for &&(run_id, sequence) in &keys {
        match runs.last_mut() {
            // Keys are sorted: a run's later item raises its sequence.
            Some(last) if last.run_id == run_id => last.sequence = sequence,
            _ => runs.push(SqliteRunWrite::new(run_id, sequence)),
        }
        if let Some((ends_run, transcript)) = writes.get(&(run_id, sequence)) {
            if let (Some(outcome), Some(run)) = (ends_run, runs.last_mut()) {
                run.ends(outcome.clone());
            }
            if let Some(item) = transcript {
                transcripts.push(transcript_json(item.clone())?);
            }
        }
    }
    txn.execute_raw(sqlite_item_writes_statement(&runs, &transcripts, now)?)
        .await?;
    Ok(new_keys)
}

/// A run's part of [`sqlite_item_writes_statement`]: its highest new item's sequence and,
/// when one of its new items ends it, the outcome.
#[derive(serde::Serialize)]
struct SqliteRunWrite {
    run_id: Uuid,
    sequence: i64,
    status: Option<&'static str>,
    error_code: Option<String>,
    error_message: Option<String>,
    usage: Option<Value>,
}

impl SqliteRunWrite {
    fn new(run_id: Uuid, sequence: i64) -> Self {
        Self {
            run_id,
            sequence,
            status: None,
            error_code: None,
            error_message: None,
            usage: None,
        }
    }

    fn ends(&mut self, outcome: RunOutcome) {
        self.status = Some(outcome.status.as_str());
        self.error_code = outcome.error_code;
        self.error_message = outcome.error_message;
        self.usage = outcome.usage;
    }
}

/// The SQL of [`sqlite_item_writes_statement`]: one text whatever the batch holds, so the
/// writer's connection parses and plans it once and keeps it in its statement cache. A
/// statement per run and per transcript row, joined into a text of its own for every batch,
/// was parsed and planned again every time: two of the four statements SQLite prepared per
/// run at 64 in flight.
///
/// The parameters, in order: the time ended runs are stamped with, the runs
/// ([`SqliteRunWrite`] objects; one per run, as `UPDATE … FROM` applies one source row per
/// target row), the time transcript rows are written at, the transcript rows
/// ([`transcript_json`] objects). Ids are stored as blobs: `unhex` of the UUID text without
/// its dashes. Nullable JSON columns take `->` (the value's JSON text) only when the value is
/// not null, so an absent value is SQL `NULL`, as on Postgres.
static SQLITE_ITEM_WRITES_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let active = active()
        .iter()
        .map(|s| format!("'{s}'"))
        .collect::<Vec<_>>()
        .join(", ");
    let ends = format!(r#"u.value->>'status' IS NOT NULL AND "runs"."status" IN ({active})"#);
    let json_or_null =
        |key: &str| format!("iif(t.value->>'{key}' IS NULL, NULL, t.value->'{key}')");
    format!(
        r#"UPDATE "runs" SET
    "last_sequence" = max("runs"."last_sequence", u.value->>'sequence'),
    "status" = iif({ends}, u.value->>'status', "runs"."status"),
    "error_code" = iif({ends}, u.value->>'error_code', "runs"."error_code"),
    "error_message" = iif({ends}, u.value->>'error_message', "runs"."error_message"),
    "ended_at" = iif({ends}, ?, "runs"."ended_at"),
    "usage" = iif({ends} AND u.value->>'usage' IS NOT NULL, u.value->'usage', "runs"."usage")
FROM json_each(?) AS u
WHERE "runs"."id" = unhex(u.value->>'run_id', '-')
    AND ("runs"."last_sequence" < u.value->>'sequence' OR ({ends}));
INSERT INTO "transcript" ("id", "workspace_id", "conversation_id", "thread_id", "bot_id",
    "event_id", "run_id", "runner_id", "role", "item_type", "content", "content_json",
    "artifact_refs", "metadata", "created_at")
SELECT t.value->>'id', t.value->>'workspace_id', t.value->>'conversation_id',
    t.value->>'thread_id', t.value->>'bot_id', t.value->>'event_id',
    unhex(t.value->>'run_id', '-'), t.value->>'runner_id', t.value->>'role',
    t.value->>'item_type', t.value->>'content', {content_json}, {artifact_refs}, {metadata}, ?
FROM json_each(?) AS t
WHERE true
ORDER BY t.key
ON CONFLICT DO NOTHING"#,
        content_json = json_or_null("content_json"),
        artifact_refs = json_or_null("artifact_refs"),
        metadata = json_or_null("metadata"),
    )
});

/// What new result items write beyond their rows on SQLite, in one statement text
/// ([`SQLITE_ITEM_WRITES_SQL`]): each run's `last_sequence` raised to its highest new item
/// (never lowered), the runs whose new items end them ended as `finish_run` does (only while
/// active; `usage` kept when the outcome has none), and the new items' transcript rows
/// written in order (a row whose id exists is skipped: an earlier attempt wrote it). What
/// the Postgres statement ([`insert_events_statement`]) does after its insert.
fn sqlite_item_writes_statement(
    runs: &[SqliteRunWrite],
    transcripts: &[Value],
    now: DateTime<Utc>,
) -> Result<Statement> {
    Ok(Statement::from_sql_and_values(
        DbBackend::Sqlite,
        SQLITE_ITEM_WRITES_SQL.as_str(),
        [
            now.into(),
            super::jsonb_rows(runs)?,
            now.into(),
            super::jsonb_rows(transcripts)?,
        ],
    ))
}

/// Runs [`insert_events_statement`] for `events`; returns the keys it inserted.
async fn insert_chunk_postgres<C: ConnectionTrait>(
    db: &C,
    events: &[NewRunEvent],
    now: DateTime<Utc>,
) -> Result<Vec<(Uuid, i64)>> {
    let rows = db
        .query_all_raw(insert_events_statement(events, now)?)
        .await
        .map_err(|e| run_missing(e, "run of a result item"))?;
    let mut inserted = Vec::with_capacity(rows.len());
    for row in &rows {
        let run_id = row.try_get::<Uuid>("", "run_id")?;
        // A missing run comes back without a sequence, and then nothing was written.
        match row.try_get::<Option<i64>>("", "sequence")? {
            Some(sequence) => inserted.push((run_id, sequence)),
            None => {
                return Err(StoreError::not_found(format!(
                    "run {run_id} of a result item"
                )));
            }
        }
    }
    Ok(inserted)
}

/// The SQL of [`insert_events_statement`]: one text whatever the batch holds (the rows are
/// one `jsonb` parameter), so Postgres plans it once per connection instead of once per
/// batch size.
pub(crate) static INSERT_EVENTS_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let terminal = TERMINAL_TYPE_SQL.as_str();
    let active = active()
        .iter()
        .map(|s| format!("'{s}'"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        r#"WITH input AS (
    SELECT * FROM jsonb_to_recordset($1::jsonb) AS x(
        run_id uuid, sequence bigint, result_type text, data jsonb,
        status text, error_code text, error_message text, usage jsonb, transcript jsonb)
),
missing AS (
    SELECT i.run_id FROM (SELECT DISTINCT run_id FROM input) i
    LEFT JOIN LATERAL (SELECT r.id FROM runs r WHERE r.id = i.run_id LIMIT 1) r ON true
    WHERE r.id IS NULL
),
ends AS (
    SELECT i.run_id, e.sequence FROM (SELECT DISTINCT run_id FROM input) i
    CROSS JOIN LATERAL (
        SELECT sequence FROM run_events
        WHERE run_id = i.run_id AND {terminal} LIMIT 1
    ) e
),
ins AS (
    INSERT INTO run_events (run_id, sequence, result_type, data, created_at)
    SELECT i.run_id, i.sequence, i.result_type, i.data, $2 FROM input i
    WHERE NOT EXISTS (SELECT 1 FROM missing)
        AND NOT EXISTS (SELECT 1 FROM ends e WHERE e.run_id = i.run_id AND i.sequence > e.sequence)
    ON CONFLICT DO NOTHING
    RETURNING run_id, sequence
),
top AS (
    SELECT ins.run_id, max(ins.sequence) AS sequence,
        (array_agg(i.status) FILTER (WHERE i.status IS NOT NULL))[1] AS status,
        (array_agg(i.error_code) FILTER (WHERE i.status IS NOT NULL))[1] AS error_code,
        (array_agg(i.error_message) FILTER (WHERE i.status IS NOT NULL))[1] AS error_message,
        (array_agg(i.usage) FILTER (WHERE i.status IS NOT NULL))[1] AS usage
    FROM ins JOIN input i ON i.run_id = ins.run_id AND i.sequence = ins.sequence
    GROUP BY ins.run_id
),
upd AS (
    UPDATE runs SET
        last_sequence = GREATEST(runs.last_sequence, top.sequence),
        status = CASE WHEN top.status IS NOT NULL AND runs.status IN ({active})
            THEN top.status ELSE runs.status END,
        error_code = CASE WHEN top.status IS NOT NULL AND runs.status IN ({active})
            THEN top.error_code ELSE runs.error_code END,
        error_message = CASE WHEN top.status IS NOT NULL AND runs.status IN ({active})
            THEN top.error_message ELSE runs.error_message END,
        ended_at = CASE WHEN top.status IS NOT NULL AND runs.status IN ({active})
            THEN $2 ELSE runs.ended_at END,
        usage = CASE WHEN top.usage IS NOT NULL AND runs.status IN ({active})
            THEN top.usage ELSE runs.usage END
    FROM top
    WHERE runs.id = top.run_id
        AND (runs.last_sequence < top.sequence
            OR (top.status IS NOT NULL AND runs.status IN ({active})))
),
transcribed AS (
    {INSERT_TRANSCRIPT}
    FROM input i
    JOIN ins ON ins.run_id = i.run_id AND ins.sequence = i.sequence
    CROSS JOIN LATERAL jsonb_to_record(i.transcript) AS {TRANSCRIPT_RECORD}
    WHERE i.transcript IS NOT NULL
    ON CONFLICT DO NOTHING
)
SELECT run_id, sequence FROM ins
UNION ALL SELECT run_id, NULL FROM missing"#
    )
});

/// One Postgres statement that does what the SQLite path does in a transaction: refuse the
/// whole batch when a run of its items does not exist (`missing`: nothing is written, and the
/// runs come back with a null `sequence`; on SQLite the foreign key fails the transaction,
/// on Postgres the statement checks each run once instead, see migration
/// `m20250601_000019`), drop the items that follow a terminal item already in their run's
/// ledger ([`drop_after_terminal`]), insert the rest skipping the ones already stored and a
/// second terminal item ([`on_conflict_skip`]), raise each run's `last_sequence` to its
/// highest new item ([`bump_last_sequences`]), end the runs whose new items say so
/// ([`NewRunEvent::ends_run`], as `finish_run`), write the transcript rows of the new items
/// that carry one ([`NewRunEvent::transcript`]), and return the inserted keys. A statement is
/// atomic on its own, and its data-modifying parts see the same snapshot, as the
/// transaction's statements did at `READ COMMITTED`; a run row is updated once (Postgres
/// applies only one update per row and statement), by `upd`.
///
/// `missing` and `ends` read each run of the batch by key, as a `LATERAL` subquery with a
/// `LIMIT` (which the planner does not flatten): as joins, the planner turns to reading the
/// whole `runs` table or every terminal item once the ledger holds a few thousand runs, and
/// the statement's cost would grow with the ledger instead of with the batch.
fn insert_events_statement(events: &[NewRunEvent], now: DateTime<Utc>) -> Result<Statement> {
    let rows = events
        .iter()
        .map(|event| {
            let outcome = event.ends_run.as_ref();
            Ok(EventRow {
                run_id: event.run_id.into_uuid(),
                sequence: event.sequence,
                result_type: &event.result_type,
                data: &event.data,
                status: outcome.map(|o| o.status.as_str()),
                error_code: outcome.and_then(|o| o.error_code.as_deref()),
                error_message: outcome.and_then(|o| o.error_message.as_deref()),
                usage: outcome.and_then(|o| o.usage.as_ref()),
                transcript: event.transcript.clone().map(transcript_json).transpose()?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Statement::from_sql_and_values(
        DbBackend::Postgres,
        INSERT_EVENTS_SQL.as_str(),
        [super::jsonb_rows(&rows)?, now.into()],
    ))
}

/// A row of [`INSERT_EVENTS_SQL`]'s input, borrowing the item (its data is serialized once,
/// straight into the parameter).
#[derive(serde::Serialize)]
struct EventRow<'a> {
    run_id: Uuid,
    sequence: i64,
    result_type: &'a str,
    data: &'a ItemJson,
    status: Option<&'a str>,
    error_code: Option<&'a str>,
    error_message: Option<&'a str>,
    usage: Option<&'a Value>,
    transcript: Option<Value>,
}

/// A transcript row as the `transcript` object of an [`insert_events_statement`] row: the
/// values [`Transcript::append`](crate::Transcript::append) would write (validated, content
/// cut, empty metadata stored as `NULL`).
fn transcript_json(item: crate::NewTranscriptItem) -> Result<serde_json::Value> {
    let (_, row) = super::transcript::transcript_row(item)?;
    Ok(transcript_model_json(row))
}

/// A validated transcript row as a [`TRANSCRIPT_RECORD`] object (`created_at` is the
/// statement's).
fn transcript_model_json(row: transcript::ActiveModel) -> serde_json::Value {
    serde_json::json!({
        "id": row.id.try_as_ref(),
        "workspace_id": row.workspace_id.try_as_ref(),
        "conversation_id": row.conversation_id.try_as_ref(),
        "thread_id": row.thread_id.try_as_ref(),
        "bot_id": row.bot_id.try_as_ref(),
        "event_id": row.event_id.try_as_ref(),
        "run_id": row.run_id.try_as_ref(),
        "runner_id": row.runner_id.try_as_ref(),
        "role": row.role.try_as_ref(),
        "item_type": row.item_type.try_as_ref(),
        "content": row.content.try_as_ref(),
        "content_json": row.content_json.try_as_ref(),
        "artifact_refs": row.artifact_refs.try_as_ref(),
        "metadata": row.metadata.try_as_ref(),
    })
}
