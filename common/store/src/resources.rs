//! The workspace resource registry behind the Host API (SPEC §8): models, tools and
//! knowledge bases with their documents and full-text indexed chunks.
//!
//! Secrets are never stored: a model names the *environment variable* that holds its API
//! key, a tool names the environment variables of its static headers; only the process
//! that calls the provider (a worker) reads the values.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::WorkspaceId;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::error::Result;

/// Largest document text accepted by [`ResourceRegistry::add_document`], in bytes.
pub const MAX_DOCUMENT_BYTES: usize = 1024 * 1024;
/// Target size of a chunk, in characters (see [`chunk_text`]).
pub const CHUNK_CHARS: usize = 1000;
/// Largest `top_k` of a knowledge search.
pub const MAX_KB_TOP_K: u64 = 50;
/// Most document ids a search filter may name.
pub const MAX_FILTER_DOCUMENTS: usize = 100;

/// Kind of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// Chat completions (`invoke`, `stream`).
    Llm,
    /// `/rerank`.
    Rerank,
}

impl ModelKind {
    /// Wire and column form.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Llm => "llm",
            Self::Rerank => "rerank",
        }
    }

    /// Parses the column form.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "llm" => Some(Self::Llm),
            "rerank" => Some(Self::Rerank),
            _ => None,
        }
    }
}

/// A model to register.
#[derive(Debug, Clone, PartialEq)]
pub struct NewModel {
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Unique name in the workspace.
    pub name: String,
    /// Kind.
    pub kind: ModelKind,
    /// OpenAI-compatible base URL (`…/v1`), `http` or `https`.
    pub base_url: String,
    /// The provider's model name.
    pub model_name: String,
    /// Name of the environment variable holding the API key (never the key).
    pub api_key_env: Option<String>,
    /// Context window in tokens.
    pub context_window: Option<i64>,
    /// Extra request body fields merged into every call (a JSON object).
    pub extra_args: Option<Value>,
}

/// A registered model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRecord {
    /// Id (UUID v7).
    pub model_id: Uuid,
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Name.
    pub name: String,
    /// Kind.
    pub kind: ModelKind,
    /// Base URL.
    pub base_url: String,
    /// Provider model name.
    pub model_name: String,
    /// API key environment variable name.
    pub api_key_env: Option<String>,
    /// Context window in tokens.
    pub context_window: Option<i64>,
    /// Extra request body fields (an object, `{}` when none).
    pub extra_args: Value,
    /// Whether the model may be granted.
    pub enabled: bool,
    /// Creation time.
    pub created_at: DateTime<Utc>,
}

/// A tool to register.
#[derive(Debug, Clone, PartialEq)]
pub struct NewTool {
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Unique name in the workspace (what policies and runners use).
    pub name: String,
    /// Kind; only `http` is executable today.
    pub kind: String,
    /// Description shown to models.
    pub description: String,
    /// JSON schema of the call parameters (an object).
    pub parameters: Value,
    /// Kind-specific settings (an object; for `http`: `url`, `timeout_ms`,
    /// `max_response_bytes`, `headers_env`).
    pub config: Value,
}

/// A registered tool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolRecord {
    /// Id.
    pub tool_id: Uuid,
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Name.
    pub name: String,
    /// Kind.
    pub kind: String,
    /// Description.
    pub description: String,
    /// JSON schema of the parameters.
    pub parameters: Value,
    /// Kind-specific settings.
    pub config: Value,
    /// Whether the tool may be granted.
    pub enabled: bool,
    /// Creation time.
    pub created_at: DateTime<Utc>,
}

/// A registered knowledge base.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KnowledgeBaseRecord {
    /// Id.
    pub kb_id: Uuid,
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Name.
    pub name: String,
    /// Description.
    pub description: Option<String>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
}

/// A document to add to a knowledge base.
#[derive(Debug, Clone, PartialEq)]
pub struct NewKbDocument {
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Knowledge base.
    pub kb_id: Uuid,
    /// Title (≤ 255 chars).
    pub title: String,
    /// The text, ≤ [`MAX_DOCUMENT_BYTES`].
    pub text: String,
    /// Artifact the text came from, if any.
    pub artifact_id: Option<String>,
    /// Metadata object.
    pub metadata: Value,
}

/// A stored document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KbDocumentRecord {
    /// Id.
    pub document_id: Uuid,
    /// Knowledge base.
    pub kb_id: Uuid,
    /// Title.
    pub title: String,
    /// Size of the text in bytes.
    pub size_bytes: i64,
    /// Hex sha256 of the text.
    pub sha256: String,
    /// Number of chunks indexed.
    pub chunks: u64,
    /// Artifact the text was read from, if any.
    pub artifact_id: Option<String>,
    /// Metadata object (`{}` when none).
    pub metadata: Value,
    /// Creation time.
    pub created_at: DateTime<Utc>,
}

/// The editable fields of a stored document (its text is not: delete the document and add
/// the new text, so chunks and hash always describe one text).
#[derive(Debug, Clone, PartialEq)]
pub struct DocumentEdit {
    /// Title (≤ 255 chars).
    pub title: String,
    /// Metadata object (`null` or `{}` for none).
    pub metadata: Value,
}

/// A full-text query of one knowledge base.
#[derive(Debug, Clone, PartialEq)]
pub struct KbSearch {
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Knowledge base.
    pub kb_id: Uuid,
    /// The user's question or keywords, as typed: plain words (see
    /// [`ResourceRegistry::search_kb`]); quotes and operators carry no meaning.
    pub query: String,
    /// Number of results, clamped to [1, 50].
    pub top_k: u64,
    /// Only chunks of these documents (empty = all), at most [`MAX_FILTER_DOCUMENTS`].
    pub document_ids: Vec<Uuid>,
}

/// One search hit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KbHit {
    /// The chunk text.
    pub content: String,
    /// Relevance, higher is better; comparable only within one answer. The integer part is
    /// the number of the query's words the chunk contains (see
    /// [`ResourceRegistry::search_kb`]).
    pub score: f64,
    /// Document of the chunk.
    pub document_id: Uuid,
    /// Title of that document.
    pub title: String,
    /// Position of the chunk in its document.
    pub chunk_index: i64,
}

/// Splits `text` into chunks of at most `max_chars` characters for indexing.
///
/// Paragraphs (blank-line separated) are packed greedily; a paragraph longer than
/// `max_chars` is split at the last whitespace before the limit (or hard, for a run of
/// text without any). Chunks are trimmed; empty ones are dropped, so whitespace-only text
/// has no chunks. No text is lost other than the whitespace at the cut points.
#[must_use]
pub fn chunk_text(text: &str, max_chars: usize) -> Vec<String> {
    let max_chars = max_chars.max(1);
    let mut chunks = Vec::new();
    let mut current = String::new();
    let mut current_len = 0usize;
    let flush = |current: &mut String, current_len: &mut usize, chunks: &mut Vec<String>| {
        let t = current.trim();
        if !t.is_empty() {
            chunks.push(t.to_owned());
        }
        current.clear();
        *current_len = 0;
    };
    for para in text.split("\n\n") {
        let para = para.trim();
        if para.is_empty() {
            continue;
        }
        let plen = para.chars().count();
        if current_len > 0 && current_len + 2 + plen <= max_chars {
            current.push_str("\n\n");
            current.push_str(para);
            current_len += 2 + plen;
            continue;
        }
        flush(&mut current, &mut current_len, &mut chunks);
        if plen <= max_chars {
            current.push_str(para);
            current_len = plen;
            continue;
        }
        // A long paragraph: cut at whitespace.
        let chars: Vec<char> = para.chars().collect();
        let mut start = 0;
        while start < chars.len() {
            let end = (start + max_chars).min(chars.len());
            let cut = if end == chars.len() {
                end
            } else {
                (start + 1..end)
                    .rev()
                    .find(|&i| chars[i].is_whitespace())
                    .unwrap_or(end)
            };
            let piece: String = chars[start..cut].iter().collect();
            let piece = piece.trim();
            if !piece.is_empty() {
                chunks.push(piece.to_owned());
            }
            start = cut;
            while start < chars.len() && chars[start].is_whitespace() {
                start += 1;
            }
        }
    }
    flush(&mut current, &mut current_len, &mut chunks);
    chunks
}

/// Models, tools and knowledge bases of a workspace.
///
/// # Contract
/// - Names are unique per workspace and kind of resource: a duplicate is `conflict`, on
///   create and on update alike.
/// - Updates replace every editable field and keep the id and creation time; the checks of
///   create apply unchanged. An id missing from the workspace is `not_found`.
/// - Deletes answer whether the resource existed in the workspace. Deleting a knowledge base
///   deletes its documents and their chunks in one transaction; deleting a document deletes
///   its chunks with it, so no search ever returns a chunk of a deleted document. Whether an
///   agent still refers to the resource is the caller's rule (the gateway refuses), not the
///   store's.
/// - Reads are scoped by workspace: an id of another workspace is `not_found` (or absent
///   from a batch answer), never visible.
/// - Batch lookups (`*_by_ids`, `tools_by_names`) answer only the rows that exist, in no
///   particular order; malformed ids are simply absent.
/// - `add_document` stores the document and all its chunks in one transaction, so a
///   document is either fully searchable or absent. Empty text is `invalid_argument`, text
///   over [`MAX_DOCUMENT_BYTES`] is `payload_too_large`, an unknown knowledge base is
///   `not_found`.
/// - `search_kb` is full-text over chunk contents, matching the way users ask (the same
///   contract on Postgres and SQLite):
///   - the query is words, not syntax: split at every character that is not a letter or a
///     digit, case-insensitive, English stop words ignored; no text is a syntax error;
///   - words are **stemmed** on both sides (Postgres `english`, SQLite FTS5 `porter`):
///     `refund` matches "refunds", `deleting` matches "delete";
///   - a chunk matches if it contains **any** of the query's words;
///   - ranking: chunks containing more of the query's distinct words first, then by the
///     backend's relevance (BM25 on SQLite FTS5, `ts_rank_cd` on Postgres), then earlier
///     chunks first;
///   - [`KbHit::score`] is the number of matched words plus the relevance squashed into
///     `[0, 1)`, so scores fall in rank order (comparable within one answer only);
///   - a query with no searchable word answers no hits. An unknown knowledge base is
///     `not_found`.
///
///   The transcript's search keeps its own, stricter rules (whole words, all of them).
#[async_trait]
pub trait ResourceRegistry: Send + Sync + 'static {
    /// Registers a model.
    async fn create_model(&self, model: NewModel) -> Result<ModelRecord>;
    /// Replaces every registered field of model `model_id` of `model.workspace_id` (name,
    /// kind, URL, model name, key variable, context window, extra args) and enables it:
    /// `not_found` if it does not exist in that workspace, `conflict` if another model has
    /// the new name. The id and creation time stay.
    async fn update_model(&self, model_id: Uuid, model: NewModel) -> Result<ModelRecord>;
    /// Deletes model `model_id`; `true` if it existed in the workspace.
    async fn delete_model(&self, workspace_id: &WorkspaceId, model_id: Uuid) -> Result<bool>;
    /// One model.
    async fn get_model(&self, workspace_id: &WorkspaceId, model_id: Uuid) -> Result<ModelRecord>;
    /// All models of a workspace, by name.
    async fn list_models(&self, workspace_id: &WorkspaceId) -> Result<Vec<ModelRecord>>;
    /// The models among `ids` that exist.
    async fn models_by_ids(
        &self,
        workspace_id: &WorkspaceId,
        ids: &[Uuid],
    ) -> Result<Vec<ModelRecord>>;

    /// Registers a tool.
    async fn create_tool(&self, tool: NewTool) -> Result<ToolRecord>;
    /// Replaces every registered field of tool `tool_id` of `tool.workspace_id` (name, kind,
    /// description, parameters, config): `not_found`, `conflict` on a taken name.
    async fn update_tool(&self, tool_id: Uuid, tool: NewTool) -> Result<ToolRecord>;
    /// Deletes tool `tool_id`; `true` if it existed in the workspace.
    async fn delete_tool(&self, workspace_id: &WorkspaceId, tool_id: Uuid) -> Result<bool>;
    /// One tool by name.
    async fn get_tool(&self, workspace_id: &WorkspaceId, name: &str) -> Result<ToolRecord>;
    /// All tools of a workspace, by name.
    async fn list_tools(&self, workspace_id: &WorkspaceId) -> Result<Vec<ToolRecord>>;
    /// The tools among `names` that exist.
    async fn tools_by_names(
        &self,
        workspace_id: &WorkspaceId,
        names: &[String],
    ) -> Result<Vec<ToolRecord>>;

    /// Creates a knowledge base.
    async fn create_kb(
        &self,
        workspace_id: &WorkspaceId,
        name: &str,
        description: Option<String>,
    ) -> Result<KnowledgeBaseRecord>;
    /// Replaces the name and description of knowledge base `kb_id`: `not_found`,
    /// `conflict` on a taken name.
    async fn update_kb(
        &self,
        workspace_id: &WorkspaceId,
        kb_id: Uuid,
        name: &str,
        description: Option<String>,
    ) -> Result<KnowledgeBaseRecord>;
    /// Deletes knowledge base `kb_id` with its documents and chunks; `true` if it existed.
    async fn delete_kb(&self, workspace_id: &WorkspaceId, kb_id: Uuid) -> Result<bool>;
    /// One knowledge base.
    async fn get_kb(&self, workspace_id: &WorkspaceId, kb_id: Uuid) -> Result<KnowledgeBaseRecord>;
    /// All knowledge bases of a workspace, by name.
    async fn list_kbs(&self, workspace_id: &WorkspaceId) -> Result<Vec<KnowledgeBaseRecord>>;
    /// The knowledge bases among `ids` that exist.
    async fn kbs_by_ids(
        &self,
        workspace_id: &WorkspaceId,
        ids: &[Uuid],
    ) -> Result<Vec<KnowledgeBaseRecord>>;
    /// Adds a document: chunks ([`chunk_text`], [`CHUNK_CHARS`]) and indexes it.
    async fn add_document(&self, doc: NewKbDocument) -> Result<KbDocumentRecord>;
    /// The documents of knowledge base `kb_id`, oldest first (`not_found` for an unknown
    /// knowledge base).
    async fn list_documents(
        &self,
        workspace_id: &WorkspaceId,
        kb_id: Uuid,
    ) -> Result<Vec<KbDocumentRecord>>;
    /// Replaces the title and metadata of document `document_id` of `kb_id`: `not_found`
    /// when either is not in the workspace.
    async fn update_document(
        &self,
        workspace_id: &WorkspaceId,
        kb_id: Uuid,
        document_id: Uuid,
        edit: DocumentEdit,
    ) -> Result<KbDocumentRecord>;
    /// Deletes document `document_id` of `kb_id` with its chunks; `true` if it existed.
    async fn delete_document(
        &self,
        workspace_id: &WorkspaceId,
        kb_id: Uuid,
        document_id: Uuid,
    ) -> Result<bool>;
    /// Full-text search of one knowledge base.
    async fn search_kb(&self, search: KbSearch) -> Result<Vec<KbHit>>;
}

#[cfg(test)]
mod tests {
    use super::chunk_text;

    #[test]
    fn short_paragraphs_are_packed() {
        assert_eq!(chunk_text("a\n\nb\n\n\n\nc", 100), vec!["a\n\nb\n\nc"]);
        assert_eq!(chunk_text("aaaa\n\nbbbb", 6), vec!["aaaa", "bbbb"]);
        assert!(chunk_text("  \n\n \n", 10).is_empty());
    }

    #[test]
    fn long_paragraphs_cut_at_whitespace_without_losing_words() {
        let text = "alpha beta gamma delta epsilon";
        let chunks = chunk_text(text, 12);
        assert!(chunks.iter().all(|c| c.chars().count() <= 12), "{chunks:?}");
        assert_eq!(chunks.join(" "), text);
        let hard = chunk_text("abcdefghij", 4);
        assert_eq!(hard, vec!["abcd", "efgh", "ij"]);
    }
}
