//! Agents (SPEC §5), registered runners, and tenancy (workspaces and API keys).

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::{AgentId, WorkspaceId};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::Result;

/// An agent to create. JSON policies are stored as given; the shapes belong to
/// `sb_protocol` and the gateway validates them.
#[derive(Debug, Clone, PartialEq)]
pub struct NewAgent {
    /// Id; `None` → a fresh UUID v7.
    pub id: Option<AgentId>,
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Unique within the workspace.
    pub name: String,
    /// Free text.
    pub description: Option<String>,
    /// Runner id.
    pub runner_id: String,
    /// Runner configuration.
    pub runner_config: Value,
    /// Event types the agent handles (JSON array).
    pub event_types: Value,
    /// Scope object: `bot_id`, `channel`, `conversation_id`, `actor_id` (all optional).
    pub scope: Value,
    /// Field predicates on the event.
    pub filters: Value,
    /// Resource policy.
    pub resource_policy: Value,
    /// State policy.
    pub state_policy: Value,
    /// Delivery policy (concurrency, …).
    pub delivery_policy: Value,
    /// Per-run budget overrides: an object holding only the budgets the agent sets (the
    /// others keep the host defaults); `{}` = none. `null` is stored as `{}`.
    pub budgets: Value,
    /// Whether the resolver considers it.
    pub enabled: bool,
}

/// A stored agent.
///
/// `bot_id`, `channel`, `conversation_id` and `actor_id` are copies of the string members of
/// `scope`, re-derived by the store on every write (so they cannot disagree with `scope`);
/// they exist so resolvers can prefilter candidates in SQL.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentRow {
    /// Id.
    pub id: AgentId,
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Name.
    pub name: String,
    /// Description.
    pub description: Option<String>,
    /// Runner id.
    pub runner_id: String,
    /// Runner configuration.
    pub runner_config: Value,
    /// Event types.
    pub event_types: Value,
    /// Scope object.
    pub scope: Value,
    /// `scope.bot_id`.
    pub bot_id: Option<String>,
    /// `scope.channel`.
    pub channel: Option<String>,
    /// `scope.conversation_id`.
    pub conversation_id: Option<String>,
    /// `scope.actor_id`.
    pub actor_id: Option<String>,
    /// Filters.
    pub filters: Value,
    /// Resource policy.
    pub resource_policy: Value,
    /// State policy.
    pub state_policy: Value,
    /// Delivery policy.
    pub delivery_policy: Value,
    /// Per-run budget overrides (`{}` = none).
    pub budgets: Value,
    /// Enabled.
    pub enabled: bool,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Last update.
    pub updated_at: DateTime<Utc>,
}

/// Agent configuration.
///
/// # Contract
///
/// - Names are unique per workspace: creating or renaming onto a taken name is `conflict`.
/// - Every read and write is scoped by workspace: an agent of another workspace is
///   reported as missing.
/// - `update` replaces every mutable field with the row's values and bumps `updated_at`
///   (`id`, `workspace_id` and `created_at` are not changed).
#[async_trait]
pub trait AgentStore: Send + Sync + 'static {
    /// Creates an agent.
    async fn create(&self, agent: NewAgent) -> Result<AgentRow>;

    /// The agent, if it exists in this workspace.
    async fn get(&self, workspace_id: &WorkspaceId, id: AgentId) -> Result<Option<AgentRow>>;

    /// Every agent of the workspace, by name.
    async fn list(&self, workspace_id: &WorkspaceId) -> Result<Vec<AgentRow>>;

    /// Enabled agents of the workspace, by name (the binding resolver's candidates).
    async fn list_enabled(&self, workspace_id: &WorkspaceId) -> Result<Vec<AgentRow>>;

    /// Replaces an agent's fields; `not_found` if it does not exist in its workspace.
    async fn update(&self, agent: AgentRow) -> Result<AgentRow>;

    /// Deletes an agent; `true` if it existed.
    async fn delete(&self, workspace_id: &WorkspaceId, id: AgentId) -> Result<bool>;
}

/// A runner registered by a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunnerRow {
    /// `plugin:<author>/<plugin>/<runner>`.
    pub id: String,
    /// `<author>/<plugin>`.
    pub plugin_id: String,
    /// Worker pool hosting it.
    pub pool: String,
    /// Version.
    pub version: String,
    /// The full descriptor (manifest projection).
    pub descriptor: Value,
    /// Last time a worker announced it.
    pub seen_at: DateTime<Utc>,
}

/// Runner descriptors announced by workers.
///
/// # Contract
/// `upsert` inserts or replaces the row with the same id (the last announcement wins).
#[async_trait]
pub trait RunnerRegistry: Send + Sync + 'static {
    /// Inserts or replaces a runner.
    async fn upsert(&self, runner: RunnerRow) -> Result<()>;

    /// The runner, if registered.
    async fn get(&self, id: &str) -> Result<Option<RunnerRow>>;

    /// Every runner, by id.
    async fn list(&self) -> Result<Vec<RunnerRow>>;
}

/// A freshly created API key. `plaintext` is shown once and never stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewApiKey {
    /// Key id (for listing and revoking).
    pub id: uuid::Uuid,
    /// The secret: `sb_` + 43 URL-safe base64 characters (32 random bytes).
    pub plaintext: String,
    /// The first characters, stored to tell keys apart.
    pub prefix: String,
}

/// A stored API key (without its secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiKeyRecord {
    /// Key id.
    pub id: uuid::Uuid,
    /// Workspace it authenticates for.
    pub workspace_id: WorkspaceId,
    /// Label.
    pub name: Option<String>,
    /// First characters of the key.
    pub prefix: String,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Revocation time.
    pub revoked_at: Option<DateTime<Utc>>,
}

/// Workspaces and API keys.
///
/// # Contract
///
/// - Only the SHA-256 of a key is stored; `create_api_key` is the only place the plaintext
///   exists.
/// - `authenticate` accepts exactly the plaintext of a key that has not been revoked.
#[async_trait]
pub trait Tenancy: Send + Sync + 'static {
    /// Creates the workspace if it does not exist. Idempotent.
    async fn ensure_workspace(&self, id: &WorkspaceId) -> Result<()>;

    /// Creates a key for the workspace (creating the workspace if needed).
    async fn create_api_key(
        &self,
        workspace_id: &WorkspaceId,
        name: Option<&str>,
    ) -> Result<NewApiKey>;

    /// The workspace the key belongs to, if the key is valid and not revoked.
    async fn authenticate(&self, plaintext: &str) -> Result<Option<WorkspaceId>>;

    /// Revokes a key; `true` if this call revoked it.
    async fn revoke(&self, key_id: uuid::Uuid) -> Result<bool>;

    /// The workspace's keys (revoked ones included), oldest first.
    async fn list_api_keys(&self, workspace_id: &WorkspaceId) -> Result<Vec<ApiKeyRecord>>;
}
