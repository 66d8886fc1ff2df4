//! [`Transcript`] on SQL, with backend-specific full-text search.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::{RunId, WorkspaceId};
use sea_orm::sea_query::{Alias, Expr, JoinType, Query};
use sea_orm::{
    ActiveValue::NotSet, ColumnTrait, ConnectionTrait, DbBackend, EntityTrait, Order, QueryFilter,
    QueryOrder, QuerySelect, QueryTrait, Select, Set,
};

use super::entity::transcript;
use super::fts::fts5_match_expression;
use super::{
    ID_LEN, SqlStore, UniqueRow, check_len, check_len_opt, check_required, metadata_in,
    metadata_out, now, workspace,
};
use crate::error::{Result, StoreError, is_unique_violation};
use crate::page::{
    CursorKind, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT, Page, ThreadFilter, clamp_limit, decode_seq,
    encode_seq,
};
use crate::transcript::{
    DEFAULT_SEARCH_TOP_K, Direction, MAX_SEARCH_TOP_K, MAX_TRANSCRIPT_CONTENT_CHARS,
    NewTranscriptItem, Transcript, TranscriptQuery, TranscriptRecord, TranscriptSearch,
};

fn record(m: transcript::Model) -> Result<TranscriptRecord> {
    Ok(TranscriptRecord {
        cursor: encode_seq(CursorKind::Transcript, m.seq),
        seq: m.seq,
        id: m.id,
        workspace_id: workspace(m.workspace_id)?,
        conversation_id: m.conversation_id,
        thread_id: m.thread_id,
        bot_id: m.bot_id,
        event_id: m.event_id,
        run_id: m.run_id.map(RunId::from_uuid),
        runner_id: m.runner_id,
        role: m.role,
        item_type: m.item_type,
        content: m.content,
        content_json: m.content_json,
        artifact_refs: m.artifact_refs,
        metadata: metadata_out(m.metadata),
        created_at: m.created_at,
    })
}

fn records(rows: Vec<transcript::Model>) -> Result<Vec<TranscriptRecord>> {
    rows.into_iter().map(record).collect()
}

/// The filters every transcript read shares: workspace, conversation, bot, thread.
fn scoped(
    workspace_id: &WorkspaceId,
    conversation_id: &str,
    bot_id: Option<String>,
    thread: ThreadFilter,
) -> Select<transcript::Entity> {
    let mut select = transcript::Entity::find()
        .filter(transcript::Column::WorkspaceId.eq(workspace_id.as_str()))
        .filter(transcript::Column::ConversationId.eq(conversation_id));
    if let Some(bot) = bot_id {
        select = select.filter(transcript::Column::BotId.eq(bot));
    }
    match thread {
        ThreadFilter::Any => select,
        ThreadFilter::Exactly(Some(thread)) => {
            select.filter(transcript::Column::ThreadId.eq(thread))
        }
        ThreadFilter::Exactly(None) => select.filter(transcript::Column::ThreadId.is_null()),
    }
}

/// The row of a new transcript item (validated) and its id (the caller's or a fresh UUID v7).
pub(super) fn transcript_row(item: NewTranscriptItem) -> Result<(String, transcript::ActiveModel)> {
    check_required("conversation_id", &item.conversation_id, ID_LEN)?;
    check_required("event_id", &item.event_id, ID_LEN)?;
    check_required("role", &item.role, 50)?;
    check_required("item_type", &item.item_type, 50)?;
    check_len_opt("thread_id", item.thread_id.as_deref(), ID_LEN)?;
    check_len_opt("bot_id", item.bot_id.as_deref(), ID_LEN)?;
    check_len_opt("runner_id", item.runner_id.as_deref(), ID_LEN)?;
    let id = match item.id {
        Some(id) => {
            check_required("id", &id, ID_LEN)?;
            id
        }
        None => uuid::Uuid::now_v7().to_string(),
    };
    let row = transcript::ActiveModel {
        seq: NotSet,
        id: Set(id.clone()),
        workspace_id: Set(item.workspace_id.as_str().to_owned()),
        conversation_id: Set(item.conversation_id),
        thread_id: Set(item.thread_id),
        bot_id: Set(item.bot_id),
        event_id: Set(item.event_id),
        run_id: Set(item.run_id.map(RunId::into_uuid)),
        runner_id: Set(item.runner_id),
        role: Set(item.role),
        item_type: Set(item.item_type),
        content: Set(item
            .content
            .map(|c| crate::events::truncate_chars(&c, MAX_TRANSCRIPT_CONTENT_CHARS))),
        content_json: Set(item.content_json),
        artifact_refs: Set(item.artifact_refs),
        metadata: Set(metadata_in("metadata", item.metadata)?),
        created_at: Set(now()),
    };
    Ok((id, row))
}

/// The latest transcript `seq` of a conversation on Postgres ([`Transcript::latest_cursor`]).
const LATEST_SEQ_SQL: &str = r#"SELECT "seq" FROM "transcript" WHERE "workspace_id" = $1 AND "conversation_id" = $2 ORDER BY "seq" DESC LIMIT 1"#;

/// The conversation's latest `seq` on SQLite, on `db` (a run start reads it in its own
/// batch statement, `SQLITE_START_READS_SQL` in the `runs` module, the same way).
///
/// `max` rather than `ORDER BY seq DESC LIMIT 1`: SQLite seeks the index for it, without the
/// bound `LIMIT` that makes it re-prepare the statement on every call (see the `sql` module
/// docs).
pub(super) async fn sqlite_latest_seq<C: ConnectionTrait>(
    db: &C,
    workspace_id: &WorkspaceId,
    conversation_id: &str,
) -> Result<Option<i64>> {
    Ok(sqlite_latest_seq_select(workspace_id, conversation_id)
        .into_tuple::<Option<i64>>()
        .all(db)
        .await?
        .unique_row()
        .flatten())
}

/// The select of [`sqlite_latest_seq`]: always one row, its `seq` null for a conversation
/// without rows (an aggregate without `GROUP BY`).
fn sqlite_latest_seq_select(
    workspace_id: &WorkspaceId,
    conversation_id: &str,
) -> sea_orm::Select<transcript::Entity> {
    transcript::Entity::find()
        .select_only()
        .column_as(transcript::Column::Seq.max(), "seq")
        .filter(transcript::Column::WorkspaceId.eq(workspace_id.as_str()))
        .filter(transcript::Column::ConversationId.eq(conversation_id))
}

/// The transcript cursor of a row's `seq`.
pub(super) fn transcript_cursor(seq: i64) -> String {
    encode_seq(CursorKind::Transcript, seq)
}

#[async_trait]
impl Transcript for SqlStore {
    async fn append(&self, item: NewTranscriptItem) -> Result<TranscriptRecord> {
        let (id, row) = transcript_row(item)?;
        let model = transcript::Entity::insert(row)
            .exec_with_returning(self.writer())
            .await
            .map_err(|e| {
                if is_unique_violation(&e) {
                    StoreError::Conflict(format!("transcript item {id} already exists"))
                } else {
                    e.into()
                }
            })?;
        record(model)
    }

    async fn page(&self, query: TranscriptQuery) -> Result<Page<TranscriptRecord>> {
        let limit = clamp_limit(query.limit, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT);
        let before = query
            .before_cursor
            .as_deref()
            .map(|c| decode_seq(CursorKind::Transcript, c))
            .transpose()?;
        let after = query
            .after_cursor
            .as_deref()
            .map(|c| decode_seq(CursorKind::Transcript, c))
            .transpose()?;
        let mut select = scoped(
            &query.workspace_id,
            &query.conversation_id,
            query.bot_id,
            query.thread,
        );
        if let Some(before) = before {
            select = select.filter(transcript::Column::Seq.lt(before));
        }
        if let Some(after) = after {
            select = select.filter(transcript::Column::Seq.gt(after));
        }
        select = match query.direction {
            Direction::Backward => select.order_by_desc(transcript::Column::Seq),
            Direction::Forward => select.order_by_asc(transcript::Column::Seq),
        };
        let rows = select.limit(limit + 1).all(&self.db).await?;
        Ok(Page::from_overfetch(records(rows)?, limit, |r| {
            r.cursor.clone()
        }))
    }

    async fn latest_cursor(
        &self,
        workspace_id: &WorkspaceId,
        conversation_id: &str,
    ) -> Result<Option<String>> {
        check_len("conversation_id", conversation_id, ID_LEN)?;
        let seq: Option<i64> = if self.backend() == DbBackend::Postgres {
            // `ORDER BY seq DESC LIMIT 1` with the limit in the text: one backward seek on
            // `(workspace_id, conversation_id, seq)`. Postgres plans `max(seq)` as an
            // aggregate over every row of the conversation whenever its statistics say the
            // conversation is small (a busy conversation between two analyzes: hundreds of
            // rows, and heap fetches for each).
            self.db
                .query_one_raw(sea_orm::Statement::from_sql_and_values(
                    DbBackend::Postgres,
                    LATEST_SEQ_SQL,
                    [workspace_id.as_str().into(), conversation_id.into()],
                ))
                .await?
                .map(|row| row.try_get::<i64>("", "seq"))
                .transpose()?
        } else {
            sqlite_latest_seq(&self.db, workspace_id, conversation_id).await?
        };
        Ok(seq.map(transcript_cursor))
    }

    async fn search(&self, search: TranscriptSearch) -> Result<Vec<TranscriptRecord>> {
        let top_k = clamp_limit(search.top_k, DEFAULT_SEARCH_TOP_K, MAX_SEARCH_TOP_K);
        // Postgres rejects NUL in text parameters; it is not searchable text anyway.
        let mut search = search;
        search.query = search.query.replace('\0', " ");
        if search.query.trim().is_empty() {
            return Ok(Vec::new());
        }
        let mut select = scoped(
            &search.workspace_id,
            &search.conversation_id,
            search.bot_id,
            search.thread,
        );
        if !search.roles.is_empty() {
            select = select.filter(transcript::Column::Role.is_in(search.roles));
        }
        if !search.item_types.is_empty() {
            select = select.filter(transcript::Column::ItemType.is_in(search.item_types));
        }
        let select = match self.backend() {
            DbBackend::Postgres => {
                // websearch_to_tsquery accepts any text; the query is a bound parameter.
                let q = search.query;
                select
                    .filter(Expr::cust_with_values(
                        r#""transcript"."content_tsv" @@ websearch_to_tsquery('simple', $1)"#,
                        [q.clone()],
                    ))
                    .order_by(
                        Expr::cust_with_values(
                            r#"ts_rank("transcript"."content_tsv", websearch_to_tsquery('simple', $1))"#,
                            [q],
                        ),
                        Order::Desc,
                    )
            }
            DbBackend::Sqlite => {
                let Some(expr) = fts5_match_expression(&search.query) else {
                    return Ok(Vec::new());
                };
                let mut select = select;
                QueryTrait::query(&mut select).join(
                    JoinType::InnerJoin,
                    Alias::new("transcript_fts"),
                    Expr::cust(r#""transcript_fts"."rowid" = "transcript"."seq""#),
                );
                select
                    .filter(Expr::cust_with_values(
                        r#""transcript_fts" MATCH ?"#,
                        [expr],
                    ))
                    // FTS5 `rank` is bm25: smaller is better.
                    .order_by(Expr::cust(r#""transcript_fts"."rank""#), Order::Asc)
            }
            other => {
                return Err(StoreError::invalid(format!(
                    "full-text search is not supported on {other:?}"
                )));
            }
        };
        let rows = select
            .order_by_desc(transcript::Column::Seq)
            .limit(top_k)
            .all(&self.db)
            .await?;
        records(rows)
    }

    async fn delete_older_than(&self, before: DateTime<Utc>, batch: u64) -> Result<u64> {
        let victims = Query::select()
            .column(transcript::Column::Seq)
            .from(transcript::Entity)
            .and_where(transcript::Column::CreatedAt.lt(before))
            .order_by(transcript::Column::Seq, Order::Asc)
            .limit(batch.max(1))
            .to_owned();
        let res = transcript::Entity::delete_many()
            .filter(transcript::Column::Seq.in_subquery(victims))
            .exec(self.writer())
            .await?;
        Ok(res.rows_affected)
    }
}
