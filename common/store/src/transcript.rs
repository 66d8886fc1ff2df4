//! The conversation transcript: the canonical history runners page and search.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::{RunId, WorkspaceId};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::Result;
use crate::page::{Page, ThreadFilter};

/// Longest stored `content`, in characters; longer text is cut to 3997 + `...` (the full
/// item stays in `content_json`).
pub const MAX_TRANSCRIPT_CONTENT_CHARS: usize = 4000;
/// Largest `top_k` of a search.
pub const MAX_SEARCH_TOP_K: u64 = 100;
/// `top_k` of a search when the caller gives none.
pub const DEFAULT_SEARCH_TOP_K: u64 = 10;

/// A transcript item to append.
#[derive(Debug, Clone, PartialEq)]
pub struct NewTranscriptItem {
    /// Item id; `None` → a fresh UUID.
    pub id: Option<String>,
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Conversation (required).
    pub conversation_id: String,
    /// Thread.
    pub thread_id: Option<String>,
    /// Bot.
    pub bot_id: Option<String>,
    /// Event the item came from (for user items, the event log id).
    pub event_id: String,
    /// Run that produced the item (not set on user items).
    pub run_id: Option<RunId>,
    /// Runner of that run.
    pub runner_id: Option<String>,
    /// `user`, `assistant`, `tool`, `system`, … (≤ 50 chars).
    pub role: String,
    /// `message` or a non-message item type (≤ 50 chars).
    pub item_type: String,
    /// Plain text; cut to [`MAX_TRANSCRIPT_CONTENT_CHARS`]. This is what search indexes.
    pub content: Option<String>,
    /// The whole structured item, never cut.
    pub content_json: Option<Value>,
    /// Artifact references (a JSON array).
    pub artifact_refs: Option<Value>,
    /// Metadata object.
    pub metadata: Value,
}

impl NewTranscriptItem {
    /// A `message` item with only the required fields.
    #[must_use]
    pub fn message(
        workspace_id: WorkspaceId,
        conversation_id: impl Into<String>,
        event_id: impl Into<String>,
        role: impl Into<String>,
        content: impl Into<String>,
    ) -> Self {
        Self {
            id: None,
            workspace_id,
            conversation_id: conversation_id.into(),
            thread_id: None,
            bot_id: None,
            event_id: event_id.into(),
            run_id: None,
            runner_id: None,
            role: role.into(),
            item_type: "message".to_owned(),
            content: Some(content.into()),
            content_json: None,
            artifact_refs: None,
            metadata: Value::Object(serde_json::Map::new()),
        }
    }
}

/// A stored transcript item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TranscriptRecord {
    /// Item id.
    pub id: String,
    /// Position: increasing in append order across all conversations, not dense.
    pub seq: i64,
    /// Opaque cursor of this item's position.
    pub cursor: String,
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Conversation.
    pub conversation_id: String,
    /// Thread.
    pub thread_id: Option<String>,
    /// Bot.
    pub bot_id: Option<String>,
    /// Source event.
    pub event_id: String,
    /// Producing run.
    pub run_id: Option<RunId>,
    /// Producing runner.
    pub runner_id: Option<String>,
    /// Role.
    pub role: String,
    /// Item type.
    pub item_type: String,
    /// Text (≤ 4000 chars).
    pub content: Option<String>,
    /// Full item.
    pub content_json: Option<Value>,
    /// Artifact references.
    pub artifact_refs: Option<Value>,
    /// Metadata object (`{}` when none).
    pub metadata: Value,
    /// Append time.
    pub created_at: DateTime<Utc>,
}

/// Reading direction of a history page.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Newest first, continuing towards older items.
    #[default]
    Backward,
    /// Oldest first, continuing towards newer items.
    Forward,
}

/// A paged read of one conversation's transcript.
#[derive(Debug, Clone, PartialEq)]
pub struct TranscriptQuery {
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Conversation.
    pub conversation_id: String,
    /// Thread filter.
    pub thread: ThreadFilter,
    /// Only this bot.
    pub bot_id: Option<String>,
    /// Only items strictly older than this cursor.
    pub before_cursor: Option<String>,
    /// Only items strictly newer than this cursor.
    pub after_cursor: Option<String>,
    /// Page size, clamped to [1, 100]; default 50.
    pub limit: Option<i64>,
    /// Order of the page.
    pub direction: Direction,
}

impl TranscriptQuery {
    /// The newest page of a conversation.
    #[must_use]
    pub fn new(workspace_id: WorkspaceId, conversation_id: impl Into<String>) -> Self {
        Self {
            workspace_id,
            conversation_id: conversation_id.into(),
            thread: ThreadFilter::Any,
            bot_id: None,
            before_cursor: None,
            after_cursor: None,
            limit: None,
            direction: Direction::Backward,
        }
    }
}

/// A full-text search in one conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct TranscriptSearch {
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Conversation.
    pub conversation_id: String,
    /// Thread filter.
    pub thread: ThreadFilter,
    /// Only this bot.
    pub bot_id: Option<String>,
    /// User text, web-search syntax: words (all must match), `"quoted phrases"`, `OR`,
    /// `-excluded`. Anything else is treated as plain words; no input is a syntax error.
    pub query: String,
    /// Only these roles (empty = all).
    pub roles: Vec<String>,
    /// Only these item types (empty = all).
    pub item_types: Vec<String>,
    /// Number of results, clamped to [1, 100]; default 10.
    pub top_k: Option<i64>,
}

impl TranscriptSearch {
    /// A search with default filters.
    #[must_use]
    pub fn new(
        workspace_id: WorkspaceId,
        conversation_id: impl Into<String>,
        query: impl Into<String>,
    ) -> Self {
        Self {
            workspace_id,
            conversation_id: conversation_id.into(),
            thread: ThreadFilter::Any,
            bot_id: None,
            query: query.into(),
            roles: Vec::new(),
            item_types: Vec::new(),
            top_k: None,
        }
    }
}

/// The conversation transcript.
///
/// # Contract
///
/// - **Positions.** The store assigns `seq` on append: strictly increasing in append order
///   across all conversations (not dense per conversation). Cursors are opaque tagged
///   positions; an event-log or state cursor is `invalid_argument` here.
/// - **Paging.**
///
///   ```text
///   seq:           3   7   8   12  15
///   backward, before=12      → [8, 7, 3]      (newest first)
///   forward,  after=7        → [8, 12, 15]    (oldest first)
///   backward, no cursor      → [15, 12, 8, …] (the newest page)
///   forward,  no cursor      → [3, 7, 8, …]   (from the start)
///   ```
///
///   Both cursors together bound the range from both sides.
/// - **Search** is full-text over `content` (Postgres `websearch_to_tsquery('simple')`,
///   SQLite FTS5): case-insensitive whole words, no stemming; best match first, newer first
///   among equals. User text never causes a syntax error.
#[async_trait]
pub trait Transcript: Send + Sync + 'static {
    /// Appends an item (content cut to 3997 + `...` over 4000 chars). A duplicate `id` is
    /// `conflict`.
    async fn append(&self, item: NewTranscriptItem) -> Result<TranscriptRecord>;

    /// One page of a conversation (see the contract for ordering).
    async fn page(&self, query: TranscriptQuery) -> Result<Page<TranscriptRecord>>;

    /// Cursor of the newest item of the conversation, if any.
    async fn latest_cursor(
        &self,
        workspace_id: &WorkspaceId,
        conversation_id: &str,
    ) -> Result<Option<String>>;

    /// Full-text search, best match first, at most `top_k` items.
    async fn search(&self, search: TranscriptSearch) -> Result<Vec<TranscriptRecord>>;

    /// Deletes up to `batch` items created before `before` (retention). Returns how many.
    async fn delete_older_than(&self, before: DateTime<Utc>, batch: u64) -> Result<u64>;
}
