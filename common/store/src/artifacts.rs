//! Artifacts: files produced by runners or attached to events, with verified content.

use std::str::FromStr;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::{RunId, WorkspaceId};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, StoreError};

/// Bytes an artifact read returns when the caller gives no limit.
pub const DEFAULT_ARTIFACT_READ_BYTES: u64 = 1024 * 1024;
/// Largest artifact read.
pub const MAX_ARTIFACT_READ_BYTES: u64 = 10 * 1024 * 1024;

/// Who may see an artifact besides the run that created it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ArtifactScope {
    /// Any run of the workspace.
    Workspace,
    /// Runs of the same conversation (and bot, workspace, thread).
    Conversation,
    /// Only the creating run.
    Run,
    /// Runs of the same runner.
    Runner,
}

impl ArtifactScope {
    /// The stored / wire form.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Workspace => "workspace",
            Self::Conversation => "conversation",
            Self::Run => "run",
            Self::Runner => "runner",
        }
    }
}

impl FromStr for ArtifactScope {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "workspace" => Self::Workspace,
            "conversation" => Self::Conversation,
            "run" => Self::Run,
            "runner" => Self::Runner,
            other => {
                return Err(StoreError::invalid(format!(
                    "unknown artifact scope: {other}"
                )));
            }
        })
    }
}

/// Where an artifact's content lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArtifactContent {
    /// Bytes stored by the host (verified against the declared sha256/size).
    Inline(Vec<u8>),
    /// Only a URL is known; reads return it as `file_key`.
    Url(String),
    /// A platform file id; reads return it as `file_key`.
    PlatformRef(String),
    /// No content at all, only metadata.
    MetadataOnly,
}

impl ArtifactContent {
    pub(crate) fn storage(&self) -> (&'static str, Option<String>) {
        match self {
            Self::Inline(_) => (STORAGE_INLINE, None),
            Self::Url(url) => ("url", Some(url.clone())),
            Self::PlatformRef(id) => ("platform_ref", Some(id.clone())),
            Self::MetadataOnly => ("metadata_only", None),
        }
    }
}

pub(crate) const STORAGE_INLINE: &str = "inline";

/// An artifact to register.
#[derive(Debug, Clone, PartialEq)]
pub struct NewArtifact {
    /// Artifact id; `None` → a fresh UUID. A taken id is `conflict`.
    pub id: Option<String>,
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// e.g. `file`, `image`, `document` (≤ 50 chars).
    pub artifact_type: String,
    /// MIME type.
    pub mime_type: Option<String>,
    /// File name.
    pub name: Option<String>,
    /// `runner`, `platform`, `api`, … (≤ 50 chars).
    pub source: String,
    /// Visibility.
    pub scope: ArtifactScope,
    /// Conversation.
    pub conversation_id: Option<String>,
    /// Thread.
    pub thread_id: Option<String>,
    /// Bot.
    pub bot_id: Option<String>,
    /// Creating run.
    pub run_id: Option<RunId>,
    /// Creating runner.
    pub runner_id: Option<String>,
    /// Metadata object.
    pub metadata: Value,
    /// After this instant the artifact is treated as missing.
    pub expires_at: Option<DateTime<Utc>>,
    /// The content.
    pub content: ArtifactContent,
    /// Declared lower-case hex SHA-256; verified for inline content, computed when absent.
    pub declared_sha256: Option<String>,
    /// Declared size in bytes; verified for inline content, computed when absent.
    pub declared_size: Option<i64>,
}

impl NewArtifact {
    /// An inline artifact with only the required fields.
    #[must_use]
    pub fn inline(
        workspace_id: WorkspaceId,
        artifact_type: impl Into<String>,
        source: impl Into<String>,
        scope: ArtifactScope,
        bytes: Vec<u8>,
    ) -> Self {
        Self {
            id: None,
            workspace_id,
            artifact_type: artifact_type.into(),
            mime_type: None,
            name: None,
            source: source.into(),
            scope,
            conversation_id: None,
            thread_id: None,
            bot_id: None,
            run_id: None,
            runner_id: None,
            metadata: Value::Object(serde_json::Map::new()),
            expires_at: None,
            content: ArtifactContent::Inline(bytes),
            declared_sha256: None,
            declared_size: None,
        }
    }
}

/// A registered artifact's metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArtifactRecord {
    /// Id.
    pub id: String,
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Type.
    pub artifact_type: String,
    /// MIME type.
    pub mime_type: Option<String>,
    /// Name.
    pub name: Option<String>,
    /// Size in bytes (exact for inline content).
    pub size_bytes: Option<i64>,
    /// Lower-case hex SHA-256 (verified for inline content).
    pub sha256: Option<String>,
    /// Source.
    pub source: String,
    /// Visibility.
    pub scope: ArtifactScope,
    /// `inline`, `url`, `platform_ref` or `metadata_only`.
    pub storage_type: String,
    /// URL / platform ref for external content.
    pub storage_key: Option<String>,
    /// Conversation.
    pub conversation_id: Option<String>,
    /// Thread.
    pub thread_id: Option<String>,
    /// Bot.
    pub bot_id: Option<String>,
    /// Creating run.
    pub run_id: Option<RunId>,
    /// Creating runner.
    pub runner_id: Option<String>,
    /// Metadata object (`{}` when none).
    pub metadata: Value,
    /// Expiry.
    pub expires_at: Option<DateTime<Utc>>,
    /// Registration time.
    pub created_at: DateTime<Utc>,
}

/// The result of a ranged read.
#[derive(Debug, Clone, PartialEq)]
pub struct ArtifactRead {
    /// The artifact's metadata.
    pub artifact: ArtifactRecord,
    /// The offset read from.
    pub offset: u64,
    /// The bytes at `[offset, offset + len)`; `None` for external content.
    pub content: Option<Vec<u8>>,
    /// URL / platform ref of external content.
    pub file_key: Option<String>,
    /// Whether bytes remain after this range.
    pub has_more: bool,
}

/// Artifact metadata and content.
///
/// # Contract
///
/// - **Verified content.** For inline content `put` computes the SHA-256 and size of the
///   bytes; a declared sha256 or size that differs is `invalid_argument` and nothing is
///   stored. Metadata and bytes are written in one transaction.
/// - **Expiry.** An artifact whose `expires_at ≤ now` is treated as missing by every read
///   (`not_found`), even before `delete_expired` removed it.
/// - **Ranged reads.** `read(id, offset, limit)` returns bytes `[offset, offset + limit)`
///   (limit default 1 MiB, capped at 10 MiB; `offset < 0` and `limit ≤ 0` are
///   `invalid_argument`); an offset at or past the end returns no bytes. `has_more` tells
///   whether bytes remain after the range.
#[async_trait]
pub trait ArtifactStore: Send + Sync + 'static {
    /// Registers an artifact (see the contract). Inline content over the configured cap is
    /// `payload_too_large`.
    async fn put(&self, artifact: NewArtifact) -> Result<ArtifactRecord>;

    /// Metadata of a live artifact; `not_found` if missing or expired.
    async fn metadata(&self, id: &str) -> Result<ArtifactRecord>;

    /// A range of a live artifact's content; `not_found` if missing or expired.
    async fn read(&self, id: &str, offset: i64, limit: Option<i64>) -> Result<ArtifactRead>;

    /// Deletes up to `batch` artifacts (and their bytes) with `expires_at ≤ now`. Returns
    /// how many.
    async fn delete_expired(&self, now: DateTime<Utc>, batch: u64) -> Result<u64>;
}
