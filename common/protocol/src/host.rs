//! Host-internal models: never sent to runners as such (host-behaviour §3, SPEC §5–§6).
//!
//! - [`AgentEventEnvelope`]: the normalized inbound event; the event log stores it.
//! - [`AgentConfig`] (a product-level Agent) and its run-time projection [`AgentBinding`],
//!   with the three policies and [`RunBudgets`].
//! - [`AgentRunnerDescriptor`]: a runner a worker pool can host.
//! - [`AuthorizationSnapshot`]: effective access frozen at run start; the session store keeps
//!   it as JSON and every Host API call is checked against it, never against current config.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use crate::context::StateScope;
use crate::context::{
    ActorContext, AgentEventContext, AgentInput, AgentResources, ContextAPICapabilities,
    DeliveryContext, RawEventRef, StorageResource, SubjectContext,
};
use crate::ids::{AgentId, EventId, RunId, WorkspaceId};
use crate::manifest::{
    AgentRunnerCapabilities, AgentRunnerManifest, AgentRunnerPermissions, DynamicFormItemSchema,
    FileOp, I18nObject, KnowledgeBaseOp, ModelOp, RunnerId, RunnerIdError, StorageOp, ToolOp,
};

/// Reserved stable event type names.
pub mod event_types {
    /// A message arrived.
    pub const MESSAGE_RECEIVED: &str = "message.received";
    /// A message was recalled (deleted by its sender).
    pub const MESSAGE_RECALLED: &str = "message.recalled";
    /// A member joined a group.
    pub const GROUP_MEMBER_JOINED: &str = "group.member_joined";
    /// A friend request arrived.
    pub const FRIEND_REQUEST_RECEIVED: &str = "friend.request_received";
    /// All reserved names.
    pub const RESERVED: [&str; 4] = [
        MESSAGE_RECEIVED,
        MESSAGE_RECALLED,
        GROUP_MEMBER_JOINED,
        FRIEND_REQUEST_RECEIVED,
    ];
}

/// The normalized inbound event (host-behaviour §3, plus the workspace it belongs to).
/// The gateway builds it, the event log stores it, and the orchestrator routes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentEventEnvelope {
    /// Host event id.
    pub event_id: EventId,
    /// Tenant.
    pub workspace_id: WorkspaceId,
    /// Stable type, e.g. `message.received`.
    pub event_type: String,
    /// Epoch seconds.
    #[serde(default)]
    pub event_time: Option<i64>,
    /// `platform`, `webui`, `api`, `scheduler`, `system`.
    pub source: String,
    /// The platform's own event name.
    #[serde(default)]
    pub source_event_type: Option<String>,
    /// Bot.
    #[serde(default)]
    pub bot_id: Option<String>,
    /// Conversation.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Thread.
    #[serde(default)]
    pub thread_id: Option<String>,
    /// Who caused the event.
    #[serde(default)]
    pub actor: Option<ActorContext>,
    /// What it is about.
    #[serde(default)]
    pub subject: Option<SubjectContext>,
    /// The input.
    pub input: AgentInput,
    /// Where replies go.
    pub delivery: DeliveryContext,
    /// Raw payload reference.
    #[serde(default)]
    pub raw_ref: Option<RawEventRef>,
    /// Small structured payload.
    #[serde(default)]
    pub data: Map<String, Value>,
    /// Host metadata (idempotency key, steering status, …); not shown to runners.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

impl AgentEventEnvelope {
    /// The runner-visible `ctx.event` projection.
    #[must_use]
    pub fn event_context(&self) -> AgentEventContext {
        AgentEventContext {
            event_id: self.event_id.to_string(),
            event_type: self.event_type.clone(),
            event_time: self.event_time,
            source: self.source.clone(),
            source_event_type: self.source_event_type.clone(),
            raw_ref: self.raw_ref.clone(),
            data: self.data.clone(),
        }
    }
}

/// Which host resources an Agent grants on top of (and intersected with) the runner's
/// manifest permissions.
///
/// For models, tools and knowledge bases, `None` means "no *extra* grants" — never
/// "everything". For skills, `None` means every visible skill.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default, deny_unknown_fields)]
pub struct ResourcePolicy {
    /// Extra model ids.
    pub allowed_model_uuids: Option<Vec<String>>,
    /// Tool names (the only source of tool grants).
    pub allowed_tool_names: Option<Vec<String>>,
    /// Extra knowledge base ids.
    pub allowed_kb_uuids: Option<Vec<String>>,
    /// Visible skills; `None` = all.
    pub allowed_skill_names: Option<Vec<String>>,
    /// Plugin-private storage may be used (if the manifest asks).
    pub allow_plugin_storage: bool,
    /// Workspace-shared storage may be used (if the manifest asks).
    pub allow_workspace_storage: bool,
}

impl Default for ResourcePolicy {
    fn default() -> Self {
        Self {
            allowed_model_uuids: None,
            allowed_tool_names: None,
            allowed_kb_uuids: None,
            allowed_skill_names: None,
            // Plugin-private storage is the plugin's own data: on by default.
            allow_plugin_storage: true,
            // Workspace storage is shared between plugins: opt-in.
            allow_workspace_storage: false,
        }
    }
}

fn default_state_scopes() -> Vec<StateScope> {
    vec![StateScope::Conversation, StateScope::Actor]
}

/// Host-owned state access of an Agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default, deny_unknown_fields)]
pub struct StatePolicy {
    /// State API and `state.updated` are allowed at all.
    pub enable_state: bool,
    /// Which scopes may be used.
    pub state_scopes: Vec<StateScope>,
}

impl Default for StatePolicy {
    fn default() -> Self {
        Self {
            enable_state: true,
            state_scopes: default_state_scopes(),
        }
    }
}

impl StatePolicy {
    /// Whether `scope` may be read and written.
    #[must_use]
    pub fn allows(&self, scope: StateScope) -> bool {
        self.enable_state && self.state_scopes.contains(&scope)
    }

    /// Whether any state access is possible (`available_apis.state`).
    #[must_use]
    pub fn is_enabled(&self) -> bool {
        self.enable_state && !self.state_scopes.is_empty()
    }
}

/// What happens when an event arrives for a conversation that already has an active run
/// that cannot absorb it as steering (SPEC §7).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ConcurrencyPolicy {
    /// Start another run alongside (seed behaviour).
    #[default]
    Parallel,
    /// Start after the active run ends.
    Enqueue,
    /// Cancel the active run, then start.
    Interrupt,
    /// Do not start; the event is `rejected`.
    Reject,
}

/// How replies are delivered for an Agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default, deny_unknown_fields)]
pub struct DeliveryPolicy {
    /// Deliver `message.delta` progressively where the surface supports it.
    pub enable_streaming: bool,
    /// Deliver replies at all.
    pub enable_reply: bool,
    /// Cap on one delivered message, if any.
    pub max_message_size: Option<u64>,
    /// Conversation concurrency.
    pub concurrency: ConcurrencyPolicy,
}

impl Default for DeliveryPolicy {
    fn default() -> Self {
        Self {
            enable_streaming: true,
            enable_reply: true,
            max_message_size: None,
            concurrency: ConcurrencyPolicy::Parallel,
        }
    }
}

/// Per-run budgets for Host API usage (SPEC §8). Once exhausted, a budget stays exhausted
/// for the run (`budget_exceeded`). Defaults follow the seed runtime's bounded limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunBudgets {
    /// Model invocations (invoke, stream, rerank) per run.
    pub max_model_calls: u32,
    /// Tool calls per run.
    pub max_tool_calls: u32,
    /// Characters of one tool result handed back to the runner.
    pub max_tool_result_chars: u64,
    /// Characters of model output over the whole run.
    pub max_model_output_chars: u64,
}

impl Default for RunBudgets {
    fn default() -> Self {
        Self {
            max_model_calls: 16,
            max_tool_calls: 32,
            max_tool_result_chars: 100_000,
            max_model_output_chars: 100_000,
        }
    }
}

/// An agent's own budgets (the `budgets` of `POST /v1/agents`): each budget it names
/// replaces the deployment's default (`limits.budgets`), the others keep it. Stored as
/// given, so a deployment that changes its defaults changes them for every agent that did
/// not choose its own. Zero is a legitimate value: it switches that capability off for the
/// agent (every call is `budget_exceeded`) without touching its grants.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BudgetOverrides {
    /// Replaces [`RunBudgets::max_model_calls`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_calls: Option<u32>,
    /// Replaces [`RunBudgets::max_tool_calls`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tool_calls: Option<u32>,
    /// Replaces [`RunBudgets::max_tool_result_chars`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tool_result_chars: Option<u64>,
    /// Replaces [`RunBudgets::max_model_output_chars`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_output_chars: Option<u64>,
}

impl BudgetOverrides {
    /// The budgets of a run: `defaults` with these overrides applied.
    ///
    /// ```
    /// use sb_protocol::host::{BudgetOverrides, RunBudgets};
    /// let mine = BudgetOverrides { max_tool_calls: Some(1), ..Default::default() };
    /// let run = mine.over(RunBudgets::default());
    /// assert_eq!((run.max_tool_calls, run.max_model_calls), (1, 16));
    /// ```
    #[must_use]
    pub fn over(self, defaults: RunBudgets) -> RunBudgets {
        RunBudgets {
            max_model_calls: self.max_model_calls.unwrap_or(defaults.max_model_calls),
            max_tool_calls: self.max_tool_calls.unwrap_or(defaults.max_tool_calls),
            max_tool_result_chars: self
                .max_tool_result_chars
                .unwrap_or(defaults.max_tool_result_chars),
            max_model_output_chars: self
                .max_model_output_chars
                .unwrap_or(defaults.max_model_output_chars),
        }
    }
}

/// How specific an [`AgentScope`] is; binding resolution picks the most specific match, and
/// two matches at the same level are ambiguous (SPEC §5). Ordered least to most specific.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScopeSpecificity {
    /// Whole workspace.
    Workspace,
    /// One bot.
    Bot,
    /// One channel (surface).
    Channel,
    /// One actor.
    Actor,
    /// One conversation.
    Conversation,
}

/// Where an Agent applies within its workspace. Every set field must match the event; an
/// empty scope applies to the whole workspace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default, deny_unknown_fields)]
pub struct AgentScope {
    /// Only events of this bot.
    pub bot_id: Option<String>,
    /// Only events from this channel (delivery surface / platform).
    pub channel: Option<String>,
    /// Only this conversation.
    pub conversation_id: Option<String>,
    /// Only this actor.
    pub actor_id: Option<String>,
}

impl AgentScope {
    /// The most specific field that is set.
    ///
    /// ```
    /// use sb_protocol::host::{AgentScope, ScopeSpecificity};
    /// let s = AgentScope { bot_id: Some("b".into()), actor_id: Some("u".into()), ..Default::default() };
    /// assert_eq!(s.specificity(), ScopeSpecificity::Actor);
    /// assert_eq!(AgentScope::default().specificity(), ScopeSpecificity::Workspace);
    /// ```
    #[must_use]
    pub fn specificity(&self) -> ScopeSpecificity {
        if self.conversation_id.is_some() {
            ScopeSpecificity::Conversation
        } else if self.actor_id.is_some() {
            ScopeSpecificity::Actor
        } else if self.channel.is_some() {
            ScopeSpecificity::Channel
        } else if self.bot_id.is_some() {
            ScopeSpecificity::Bot
        } else {
            ScopeSpecificity::Workspace
        }
    }
}

fn default_event_types() -> Vec<String> {
    vec![event_types::MESSAGE_RECEIVED.to_owned()]
}

fn yes() -> bool {
    true
}

/// A product-level Agent: which runner handles which events, with what config and grants.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentConfig {
    /// Agent id (`None` for an ad-hoc projection).
    #[serde(default)]
    pub agent_id: Option<AgentId>,
    /// Tenant.
    pub workspace_id: WorkspaceId,
    /// The runner.
    pub runner_id: RunnerId,
    /// The runner config (`ctx.config`); `timeout` (seconds) sets the run deadline.
    #[serde(default)]
    pub runner_config: Map<String, Value>,
    /// Where it applies.
    #[serde(default)]
    pub scope: AgentScope,
    /// Resource grants.
    #[serde(default)]
    pub resource_policy: ResourcePolicy,
    /// State access.
    #[serde(default)]
    pub state_policy: StatePolicy,
    /// Delivery and concurrency.
    #[serde(default)]
    pub delivery_policy: DeliveryPolicy,
    /// The agent's own per-run budgets, over the deployment's defaults.
    #[serde(default)]
    pub budgets: BudgetOverrides,
    /// Handled event types.
    #[serde(default = "default_event_types")]
    pub event_types: Vec<String>,
    /// Disabled agents never match.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Free-form metadata.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

/// The run-time projection of an Agent that the resolver selects for an event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentBinding {
    /// `agent_<agent_id or "default">_<runner_id>`; also the state binding identity.
    pub binding_id: String,
    /// The Agent.
    #[serde(default)]
    pub agent_id: Option<AgentId>,
    /// Tenant.
    pub workspace_id: WorkspaceId,
    /// Where it applies.
    #[serde(default)]
    pub scope: AgentScope,
    /// Handled event types.
    pub event_types: Vec<String>,
    /// The runner.
    pub runner_id: RunnerId,
    /// The runner config.
    #[serde(default)]
    pub runner_config: Map<String, Value>,
    /// Resource grants.
    #[serde(default)]
    pub resource_policy: ResourcePolicy,
    /// State access.
    #[serde(default)]
    pub state_policy: StatePolicy,
    /// Delivery and concurrency.
    #[serde(default)]
    pub delivery_policy: DeliveryPolicy,
    /// The agent's own per-run budgets, over the deployment's defaults.
    #[serde(default)]
    pub budgets: BudgetOverrides,
    /// Whether it can match.
    pub enabled: bool,
}

impl AgentBinding {
    /// The binding id for an agent and runner (host-behaviour §2).
    ///
    /// ```
    /// use sb_protocol::host::AgentBinding;
    /// let runner = "plugin:acme/echo/default".parse().unwrap();
    /// assert_eq!(AgentBinding::binding_id_for(None, &runner), "agent_default_plugin:acme/echo/default");
    /// ```
    #[must_use]
    pub fn binding_id_for(agent_id: Option<&AgentId>, runner_id: &RunnerId) -> String {
        match agent_id {
            Some(id) => format!("agent_{id}_{runner_id}"),
            None => format!("agent_default_{runner_id}"),
        }
    }

    /// Projects an Agent.
    #[must_use]
    pub fn from_config(config: &AgentConfig) -> Self {
        Self {
            binding_id: Self::binding_id_for(config.agent_id.as_ref(), &config.runner_id),
            agent_id: config.agent_id,
            workspace_id: config.workspace_id.clone(),
            scope: config.scope.clone(),
            event_types: config.event_types.clone(),
            runner_id: config.runner_id.clone(),
            runner_config: config.runner_config.clone(),
            resource_policy: config.resource_policy.clone(),
            state_policy: config.state_policy.clone(),
            delivery_policy: config.delivery_policy.clone(),
            budgets: config.budgets,
            enabled: config.enabled,
        }
    }

    /// Whether the binding is enabled and handles `event_type`.
    #[must_use]
    pub fn handles(&self, event_type: &str) -> bool {
        self.enabled && self.event_types.iter().any(|t| t == event_type)
    }
}

/// Where a runner comes from. Only plugins: built-in adapters must not bypass the plugin,
/// runtime and proxy permission chain (PROTOCOL_V1 §13).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunnerSource {
    /// A runner plugin.
    #[default]
    Plugin,
}

/// A runner that a worker pool can host, as registered in the `runners` table
/// (host-behaviour §3). How the worker executes it (command, mode, env) stays in the
/// worker's own manifest types; `raw_manifest` keeps what was loaded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentRunnerDescriptor {
    /// Runner id.
    pub id: RunnerId,
    /// Always `plugin`.
    #[serde(default)]
    pub source: RunnerSource,
    /// Display name.
    pub label: I18nObject,
    /// Display description.
    #[serde(default)]
    pub description: Option<I18nObject>,
    /// Plugin author.
    pub plugin_author: String,
    /// Plugin name.
    pub plugin_name: String,
    /// Runner name within the plugin.
    pub runner_name: String,
    /// Plugin version.
    #[serde(default)]
    pub plugin_version: Option<String>,
    /// Binding config form.
    #[serde(default)]
    pub config_schema: Vec<DynamicFormItemSchema>,
    /// Capabilities.
    #[serde(default)]
    pub capabilities: AgentRunnerCapabilities,
    /// Requested permissions.
    #[serde(default)]
    pub permissions: AgentRunnerPermissions,
    /// Worker pool that hosts it (routing key of `switchboard.runs.<pool>`).
    pub pool: String,
    /// The manifest as loaded.
    #[serde(default)]
    pub raw_manifest: Value,
    /// Other keys, kept as given.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl AgentRunnerDescriptor {
    /// Builds a descriptor from a validated manifest. Fails if the manifest id is not a
    /// valid runner id or does not match its name.
    pub fn from_manifest(
        manifest: &AgentRunnerManifest,
        plugin_version: Option<String>,
        pool: impl Into<String>,
        raw_manifest: Value,
    ) -> Result<Self, RunnerIdError> {
        let id = manifest.runner_id()?;
        Ok(Self {
            plugin_author: id.author().to_owned(),
            plugin_name: id.plugin().to_owned(),
            runner_name: id.runner().to_owned(),
            id,
            source: RunnerSource::Plugin,
            label: manifest.label.clone(),
            description: manifest.description.clone(),
            plugin_version,
            config_schema: manifest.config_schema.clone(),
            capabilities: manifest.capabilities,
            permissions: manifest.permissions.clone(),
            pool: pool.into(),
            raw_manifest,
            extra: Map::new(),
        })
    }

    /// The plugin identity `<author>/<plugin>`.
    #[must_use]
    pub fn plugin_id(&self) -> String {
        self.id.plugin_id()
    }

    /// `capabilities.streaming`.
    #[must_use]
    pub fn supports_streaming(&self) -> bool {
        self.capabilities.streaming
    }

    /// `capabilities.tool_calling`.
    #[must_use]
    pub fn supports_tool_calling(&self) -> bool {
        self.capabilities.tool_calling
    }

    /// `capabilities.knowledge_retrieval`.
    #[must_use]
    pub fn supports_knowledge_retrieval(&self) -> bool {
        self.capabilities.knowledge_retrieval
    }

    /// `capabilities.steering`.
    #[must_use]
    pub fn supports_steering(&self) -> bool {
        self.capabilities.steering
    }
}

/// `(type, id)` of an actor in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ActorRef {
    /// Actor type.
    pub actor_type: String,
    /// Actor id.
    #[serde(default)]
    pub actor_id: Option<String>,
}

/// `(type, id)` of a subject in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SubjectRef {
    /// Subject type.
    pub subject_type: String,
    /// Subject id.
    #[serde(default)]
    pub subject_id: Option<String>,
}

/// Effective access of one run, frozen at run start (SPEC §6). The session store keeps it as
/// JSON; `ctx.resources` and `ctx.context.available_apis` are projections of the same
/// snapshot, so what a runner is told and what the Host API enforces cannot diverge.
///
/// Storage grants are `resources.storage` (see [`storage`](Self::storage)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuthorizationSnapshot {
    /// The run.
    pub run_id: RunId,
    /// Plugin identity `<author>/<plugin>` that calls must come from.
    pub plugin_id: String,
    /// The runner.
    pub runner_id: RunnerId,
    /// The binding (state binding identity).
    pub binding_id: String,
    /// Tenant.
    pub workspace_id: WorkspaceId,
    /// Bot scope.
    #[serde(default)]
    pub bot_id: Option<String>,
    /// Conversation scope.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Thread scope.
    #[serde(default)]
    pub thread_id: Option<String>,
    /// Actor of the triggering event.
    #[serde(default)]
    pub actor: Option<ActorRef>,
    /// Subject of the triggering event.
    #[serde(default)]
    pub subject: Option<SubjectRef>,
    /// Granted resources.
    pub resources: AgentResources,
    /// Granted context APIs.
    pub available_apis: ContextAPICapabilities,
    /// State access.
    pub state_policy: StatePolicy,
    /// Budgets.
    pub budgets: RunBudgets,
    /// Absolute deadline, epoch seconds; `None` = no deadline.
    #[serde(default)]
    pub deadline_at: Option<f64>,
    /// SHA-256 (lower-case hex) of the run's remote Host API token, the bearer credential of
    /// `POST /v1/host/{action}` for runners outside a worker (see [`host_api_token`]). Only
    /// the digest is kept, so the session store never holds a usable credential; the token
    /// dies with the session. `None`: the run has no remote Host API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_api_token_sha256: Option<String>,
}

impl AuthorizationSnapshot {
    /// Storage grants.
    #[must_use]
    pub fn storage(&self) -> StorageResource {
        self.resources.storage
    }

    /// Whether storage `area` may be used.
    #[must_use]
    pub fn allows_storage(&self, area: StorageOp) -> bool {
        self.resources.storage.allows(area)
    }

    /// Whether `op` on model `id` is granted.
    #[must_use]
    pub fn allows_model(&self, id: &str, op: ModelOp) -> bool {
        self.resources.allows_model(id, op)
    }

    /// Whether `op` on tool `name` is granted.
    #[must_use]
    pub fn allows_tool(&self, name: &str, op: ToolOp) -> bool {
        self.resources.allows_tool(name, op)
    }

    /// Whether `op` on knowledge base `id` is granted.
    #[must_use]
    pub fn allows_knowledge_base(&self, id: &str, op: KnowledgeBaseOp) -> bool {
        self.resources.allows_knowledge_base(id, op)
    }

    /// Whether `op` on file `id` is granted.
    #[must_use]
    pub fn allows_file(&self, id: &str, op: FileOp) -> bool {
        self.resources.allows_file(id, op)
    }

    /// Whether state `scope` may be used: the state API is available and the policy
    /// enables that scope.
    #[must_use]
    pub fn allows_state(&self, scope: StateScope) -> bool {
        self.available_apis.state && self.state_policy.allows(scope)
    }

    /// Whether the deadline has passed at `now` (epoch seconds).
    #[must_use]
    pub fn is_expired(&self, now: f64) -> bool {
        self.deadline_at.is_some_and(|d| now >= d)
    }

    /// Whether `token` is this run's remote Host API token (constant time in the token's
    /// content). Always false for a run without one.
    #[must_use]
    pub fn accepts_host_api_token(&self, token: &str) -> bool {
        self.host_api_token_sha256
            .as_deref()
            .is_some_and(|digest| host_api_token::matches(digest, token))
    }
}

/// The per-run token of the remote Host API (SPEC §8: `POST /v1/host/{action}` "with the
/// run's token").
///
/// The orchestrator mints a random token per run, hands it to the runner in
/// `ctx.runtime.metadata.host_api = {"url": PATH, "token": <token>}` and freezes only its
/// [`digest`](host_api_token::digest) into the run's [`AuthorizationSnapshot`]. The gateway
/// compares the digest of a presented token with the frozen one; since the snapshot *is* the
/// run session, the token stops working the moment the session ends (terminal result,
/// cancel, deadline).
///
/// ```
/// use sb_protocol::host::host_api_token;
/// let digest = host_api_token::digest("tok");
/// assert_eq!(digest.len(), 64);
/// assert!(host_api_token::matches(&digest, "tok"));
/// assert!(!host_api_token::matches(&digest, "tok2"));
/// ```
pub mod host_api_token {
    use sha2::{Digest as _, Sha256};

    /// Key of the runner-visible entry in `ctx.runtime.metadata`.
    pub const METADATA_KEY: &str = "host_api";
    /// Path of the remote Host API on the gateway (`POST {PATH}/{action}`), relative to the
    /// gateway's base URL.
    pub const PATH: &str = "/v1/host";

    /// SHA-256 of the token, lower-case hex.
    #[must_use]
    pub fn digest(token: &str) -> String {
        hex::encode(Sha256::digest(token.as_bytes()))
    }

    /// Whether `token` hashes to `expected` (lower-case hex). The digests are compared
    /// without an early exit, so the time taken says nothing about how much matched.
    #[must_use]
    pub fn matches(expected: &str, token: &str) -> bool {
        let actual = digest(token);
        let (a, b) = (actual.as_bytes(), expected.as_bytes());
        if a.len() != b.len() {
            return false;
        }
        a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn policy_defaults() {
        let r: ResourcePolicy = serde_json::from_value(json!({})).unwrap();
        assert!(r.allow_plugin_storage && !r.allow_workspace_storage);
        assert!(r.allowed_tool_names.is_none());
        let s: StatePolicy = serde_json::from_value(json!({})).unwrap();
        assert_eq!(
            s.state_scopes,
            [StateScope::Conversation, StateScope::Actor]
        );
        assert!(s.allows(StateScope::Actor) && !s.allows(StateScope::Runner));
        let off = StatePolicy {
            enable_state: false,
            ..StatePolicy::default()
        };
        assert!(!off.allows(StateScope::Conversation) && !off.is_enabled());
        let d: DeliveryPolicy =
            serde_json::from_value(json!({"concurrency": "interrupt"})).unwrap();
        assert!(d.enable_streaming && d.enable_reply);
        assert_eq!(d.concurrency, ConcurrencyPolicy::Interrupt);
        assert!(serde_json::from_value::<DeliveryPolicy>(json!({"concurrency": "queue"})).is_err());
        assert!(
            serde_json::from_value::<StatePolicy>(json!({"state_scopes": ["global"]})).is_err()
        );
        assert!(
            serde_json::from_value::<ResourcePolicy>(json!({"allow_everything": true})).is_err()
        );
        let b: RunBudgets = serde_json::from_value(json!({"max_tool_calls": 5})).unwrap();
        assert_eq!((b.max_model_calls, b.max_tool_calls), (16, 5));
        assert_eq!(
            (b.max_tool_result_chars, b.max_model_output_chars),
            (100_000, 100_000)
        );
    }

    #[test]
    fn scope_specificity_order() {
        use ScopeSpecificity::*;
        assert!(Workspace < Bot && Bot < Channel && Channel < Actor && Actor < Conversation);
        let all = AgentScope {
            bot_id: Some("b".into()),
            channel: Some("c".into()),
            conversation_id: Some("x".into()),
            actor_id: Some("a".into()),
        };
        assert_eq!(all.specificity(), Conversation);
        let ch = AgentScope {
            bot_id: Some("b".into()),
            channel: Some("c".into()),
            ..Default::default()
        };
        assert_eq!(ch.specificity(), Channel);
        let bot = AgentScope {
            bot_id: Some("b".into()),
            ..Default::default()
        };
        assert_eq!(bot.specificity(), Bot);
    }

    #[test]
    fn binding_from_config() {
        let cfg: AgentConfig = serde_json::from_value(json!({
            "workspace_id": "default",
            "runner_id": "plugin:acme/echo/default"
        }))
        .unwrap();
        assert!(cfg.enabled);
        assert_eq!(cfg.event_types, ["message.received"]);
        let b = AgentBinding::from_config(&cfg);
        assert_eq!(b.binding_id, "agent_default_plugin:acme/echo/default");
        assert!(b.handles("message.received") && !b.handles("message.recalled"));

        let id = AgentId::new();
        let cfg = AgentConfig {
            agent_id: Some(id),
            enabled: false,
            ..cfg
        };
        let b = AgentBinding::from_config(&cfg);
        assert_eq!(b.binding_id, format!("agent_{id}_plugin:acme/echo/default"));
        assert!(!b.handles("message.received"));
        assert!(
            serde_json::from_value::<AgentConfig>(json!({
                "workspace_id": "default", "runner_id": "builtin:x/y/z"
            }))
            .is_err()
        );
    }

    #[test]
    fn descriptor_from_manifest_and_source_is_plugin_only() {
        let m: AgentRunnerManifest = serde_json::from_value(json!({
            "id": "plugin:acme/echo/default", "name": "default", "label": {"en_US": "Echo"},
            "capabilities": {"streaming": true, "steering": true}
        }))
        .unwrap();
        let d = AgentRunnerDescriptor::from_manifest(
            &m,
            Some("1.0.0".into()),
            "default",
            json!({"x": 1}),
        )
        .unwrap();
        assert_eq!(
            (
                d.plugin_author.as_str(),
                d.plugin_name.as_str(),
                d.runner_name.as_str()
            ),
            ("acme", "echo", "default")
        );
        assert!(d.supports_streaming() && d.supports_steering() && !d.supports_tool_calling());
        assert_eq!(d.plugin_id(), "acme/echo");
        let mut v = serde_json::to_value(&d).unwrap();
        assert_eq!(v["source"], "plugin");
        assert_eq!(
            serde_json::from_value::<AgentRunnerDescriptor>(v.clone()).unwrap(),
            d
        );
        v["source"] = json!("builtin");
        assert!(serde_json::from_value::<AgentRunnerDescriptor>(v).is_err());
    }

    #[test]
    fn host_api_tokens_match_their_digest_only() {
        let digest = host_api_token::digest("secret-token");
        // the SHA-256 test vector of "abc"
        assert_eq!(
            host_api_token::digest("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(host_api_token::matches(&digest, "secret-token"));
        assert!(!host_api_token::matches(&digest, "secret-tokeN"));
        assert!(!host_api_token::matches(&digest, ""));
        assert!(!host_api_token::matches(&digest[..63], "secret-token"));
        assert!(!host_api_token::matches("", ""));
        let snap: AuthorizationSnapshot = serde_json::from_value(json!({
            "run_id": RunId::new(), "plugin_id": "a/b", "runner_id": "plugin:a/b/c",
            "binding_id": "x", "workspace_id": "default", "resources": {},
            "available_apis": {}, "state_policy": {}, "budgets": {},
            "host_api_token_sha256": digest,
        }))
        .unwrap();
        assert!(snap.accepts_host_api_token("secret-token"));
        assert!(!snap.accepts_host_api_token("other"));
    }

    #[test]
    fn snapshot_checks() {
        let snap: AuthorizationSnapshot = serde_json::from_value(json!({
            "run_id": RunId::new(),
            "plugin_id": "acme/echo",
            "runner_id": "plugin:acme/echo/default",
            "binding_id": "agent_default_plugin:acme/echo/default",
            "workspace_id": "default",
            "resources": {
                "tools": [{"tool_name": "search", "operations": ["call"]}],
                "storage": {"plugin_storage": true, "workspace_storage": false}
            },
            "available_apis": {"state": true},
            "state_policy": {"enable_state": true, "state_scopes": ["conversation"]},
            "budgets": {},
            "deadline_at": 100.0
        }))
        .unwrap();
        assert!(snap.allows_tool("search", ToolOp::Call));
        assert!(!snap.allows_tool("search", ToolOp::Detail));
        assert!(!snap.allows_model("m", ModelOp::Invoke));
        assert!(!snap.allows_knowledge_base("k", KnowledgeBaseOp::Retrieve));
        assert!(!snap.allows_file("f", FileOp::Config));
        assert!(
            snap.allows_storage(StorageOp::Plugin) && !snap.allows_storage(StorageOp::Workspace)
        );
        assert!(snap.storage().plugin_storage);
        assert!(snap.allows_state(StateScope::Conversation));
        assert!(!snap.allows_state(StateScope::Actor));
        assert!(!snap.is_expired(99.9) && snap.is_expired(100.0));
        // no remote host api token: nothing is accepted, and the key is not written
        assert!(snap.host_api_token_sha256.is_none());
        assert!(!snap.accepts_host_api_token(""));
        assert!(
            !serde_json::to_value(&snap)
                .unwrap()
                .as_object()
                .unwrap()
                .contains_key("host_api_token_sha256")
        );
        let json = serde_json::to_string(&snap).unwrap();
        assert_eq!(
            serde_json::from_str::<AuthorizationSnapshot>(&json).unwrap(),
            snap
        );
    }
}
