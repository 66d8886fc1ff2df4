//! Agents (SPEC §5), registered runners, and tenancy (workspaces and API keys).

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::{AgentId, WorkspaceId};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::Result;

/// How an agent is reached (issue 14 item 6).
///
/// - `scope` (the default): a candidate of scope resolution (SPEC §5): the most specific
///   matching agent handles an event that names no agent; two at the same level conflict.
/// - `direct`: reached only when a request names it (`agent_id` on `POST /v1/events`, or the
///   turns of a session created for it). Scope resolution never picks it and the conflict
///   rule ignores it, so any number of direct agents sit beside one scope-routed agent.
///
/// An event that names an agent goes to that agent whatever its routing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum AgentRouting {
    /// Chosen by scope resolution (and reachable directly as well).
    #[default]
    Scope,
    /// Reachable only directly.
    Direct,
}

impl AgentRouting {
    /// The stored / wire form: `scope` or `direct`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Scope => "scope",
            Self::Direct => "direct",
        }
    }
}

impl std::str::FromStr for AgentRouting {
    type Err = crate::error::StoreError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "scope" => Ok(Self::Scope),
            "direct" => Ok(Self::Direct),
            other => Err(crate::error::StoreError::Corrupt(format!(
                "unknown agent routing: {other}"
            ))),
        }
    }
}

impl std::fmt::Display for AgentRouting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

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
    /// How it is reached: by scope resolution (default) or only directly.
    pub routing: AgentRouting,
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
    /// How it is reached.
    #[serde(default)]
    pub routing: AgentRouting,
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

/// What an API key may do (SPEC §14). The gateway decides which routes need which role;
/// the store only keeps the role with the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ApiKeyRole {
    /// What an application needs: send events, read runs, turns, sessions, conversations and
    /// their streams, cancel runs, list agents.
    Client,
    /// Everything a client may do, plus the workspace's configuration: agents, the resource
    /// registry (models, tools, knowledge bases), schedules and keys.
    Admin,
}

impl ApiKeyRole {
    /// Every role.
    pub const ALL: [ApiKeyRole; 2] = [Self::Client, Self::Admin];

    /// The stored and wire text: `client` or `admin`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Admin => "admin",
        }
    }

    /// Whether a key of this role may do what `required` allows (`admin` includes `client`).
    #[must_use]
    pub const fn allows(self, required: ApiKeyRole) -> bool {
        matches!(
            (self, required),
            (Self::Admin, _) | (Self::Client, Self::Client)
        )
    }
}

impl std::fmt::Display for ApiKeyRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The text was not one of the [`ApiKeyRole`] names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown api key role `{0}` (expected `admin` or `client`)")]
pub struct UnknownApiKeyRole(pub String);

impl std::str::FromStr for ApiKeyRole {
    type Err = UnknownApiKeyRole;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownApiKeyRole(s.to_owned()))
    }
}

/// A freshly created API key. `plaintext` is shown once and never stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewApiKey {
    /// The secret: `sb_` + 43 URL-safe base64 characters (32 random bytes).
    pub plaintext: String,
    /// What was stored (id, role, the prefix that tells keys apart; no secret).
    pub record: ApiKeyRecord,
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
    /// What the key may do.
    pub role: ApiKeyRole,
    /// First characters of the key.
    pub prefix: String,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Revocation time.
    pub revoked_at: Option<DateTime<Utc>>,
}

/// What [`Tenancy::authenticate`] knows about a valid key: enough to scope and authorize a
/// request, and to cache (it holds no secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthenticatedKey {
    /// The key's id (rate and stream limits are counted per key).
    pub key_id: uuid::Uuid,
    /// The workspace the key belongs to.
    pub workspace_id: WorkspaceId,
    /// What the key may do.
    pub role: ApiKeyRole,
}

/// Workspaces and API keys.
///
/// # Contract
///
/// - Only the SHA-256 of a key is stored; `create_api_key` is the only place the plaintext
///   exists.
/// - `authenticate` accepts exactly the plaintext of a key that has not been revoked, and
///   answers the key's id, workspace and role. Once `revoke` returned, `authenticate` of
///   that key returns `None` from every connection to the database (a cache in front of it,
///   like the gateway's, is responsible for its own invalidation).
/// - Keys are addressed within a workspace: `get_api_key` and `revoke` of a key that belongs
///   to another workspace behave as for a key that does not exist.
/// - A key's role never changes; a different role is a new key.
#[async_trait]
pub trait Tenancy: Send + Sync + 'static {
    /// Creates the workspace if it does not exist. Idempotent.
    async fn ensure_workspace(&self, id: &WorkspaceId) -> Result<()>;

    /// Creates a key with `role` for the workspace (creating the workspace if needed).
    async fn create_api_key(
        &self,
        workspace_id: &WorkspaceId,
        name: Option<&str>,
        role: ApiKeyRole,
    ) -> Result<NewApiKey>;

    /// The key's id, workspace and role, if the key is valid and not revoked.
    async fn authenticate(&self, plaintext: &str) -> Result<Option<AuthenticatedKey>>;

    /// The workspace's key `key_id` (revoked or not); `None` if the workspace has no such key.
    async fn get_api_key(
        &self,
        workspace_id: &WorkspaceId,
        key_id: uuid::Uuid,
    ) -> Result<Option<ApiKeyRecord>>;

    /// Revokes the workspace's key `key_id`; `true` if this call revoked it (`false`: already
    /// revoked, or no such key in the workspace).
    async fn revoke(&self, workspace_id: &WorkspaceId, key_id: uuid::Uuid) -> Result<bool>;

    /// The workspace's keys (revoked ones included), oldest first.
    async fn list_api_keys(&self, workspace_id: &WorkspaceId) -> Result<Vec<ApiKeyRecord>>;
}
