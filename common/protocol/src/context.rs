//! `AgentRunContext`, the one authoritative context a runner receives (PROTOCOL_V1 §5), and
//! `AgentResources` (§6).
//!
//! Protocol v1 is event-first: `event` is required and there is no inline history (no
//! `messages`/`bootstrap` field). Runners assemble their own working context and pull more
//! through the Host API, as `context.available_apis` allows.
//!
//! These types accept unknown fields (a runner built against this crate keeps working when
//! a newer host adds one); the closed sets the protocol defines (`trigger.source`,
//! `inline_policy.mode`, operation names) are enums and reject unknown values.
//! Optional fields are written as explicit `null`, as the Python host does.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::content::{ArtifactRef, ContentElement};
use crate::ids::RunId;
use crate::manifest::{FileOp, KnowledgeBaseOp, ModelOp, StorageOp, ToolOp};

/// Everything a runner gets for one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentRunContext {
    /// The run; key of every Host API call.
    pub run_id: RunId,
    /// What started the run.
    pub trigger: AgentTrigger,
    /// The event being handled (required: Protocol v1 is event-first).
    pub event: AgentEventContext,
    /// Conversation scope, when the event has one.
    #[serde(default)]
    pub conversation: Option<ConversationContext>,
    /// Who caused the event.
    #[serde(default)]
    pub actor: Option<ActorContext>,
    /// What the event is about.
    #[serde(default)]
    pub subject: Option<SubjectContext>,
    /// The event's main input (not history).
    pub input: AgentInput,
    /// Where and how the reply is delivered.
    pub delivery: DeliveryContext,
    /// The frozen authorization of this run, as resource lists.
    pub resources: AgentResources,
    /// What the host inlined and which context APIs are available.
    pub context: ContextAccess,
    /// Host-owned state snapshot.
    #[serde(default)]
    pub state: AgentRunState,
    /// Version, trace id, deadline.
    pub runtime: AgentRuntimeContext,
    /// The Agent's runner config (not plugin-instance state).
    #[serde(default)]
    pub config: Map<String, Value>,
    /// Entry-adapter metadata; runners should not depend on it long term.
    #[serde(default)]
    pub adapter: Option<AdapterContext>,
    /// Free-form metadata.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

/// Where a trigger came from (closed set, PROTOCOL_V1 §5.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TriggerSource {
    /// An IM platform.
    Platform,
    /// The web console.
    Webui,
    /// The HTTP API.
    Api,
    /// A schedule.
    Scheduler,
    /// The host itself.
    System,
    /// An entry adapter inside the host.
    HostAdapter,
}

/// What started the run. `type` equals `event.event_type` or is coarser.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentTrigger {
    /// E.g. `message.received`.
    #[serde(rename = "type")]
    pub trigger_type: String,
    /// Closed set of sources.
    pub source: TriggerSource,
    /// Epoch seconds.
    #[serde(default)]
    pub timestamp: Option<i64>,
}

/// A reference to a stored raw event payload, so large platform payloads never travel in
/// `event.data`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RawEventRef {
    /// How to resolve `ref_id`, e.g. `artifact` (an artifact id) or `event_log`.
    pub ref_type: String,
    /// The id within that store.
    pub ref_id: String,
    /// MIME type of the payload.
    #[serde(default)]
    pub mime_type: Option<String>,
    /// Size of the payload in bytes.
    #[serde(default)]
    pub size_bytes: Option<u64>,
    /// Free-form metadata.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

/// The event as the runner sees it (PROTOCOL_V1 §5.4).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentEventContext {
    /// Host event id.
    pub event_id: String,
    /// Stable protocol name, e.g. `message.received`.
    pub event_type: String,
    /// Epoch seconds.
    #[serde(default)]
    pub event_time: Option<i64>,
    /// Event source (`platform`, `webui`, `api`, …).
    pub source: String,
    /// The platform's own event name.
    #[serde(default)]
    pub source_event_type: Option<String>,
    /// Raw payload reference.
    #[serde(default)]
    pub raw_ref: Option<RawEventRef>,
    /// Small structured payload (strings ≤ 512 bytes; larger goes to artifacts).
    #[serde(default)]
    pub data: Map<String, Value>,
}

/// Conversation scope (PROTOCOL_V1 §5.5, with `sender_id`/`session_id` from the seed host).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConversationContext {
    /// Conversation id.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Thread within the conversation.
    #[serde(default)]
    pub thread_id: Option<String>,
    /// Legacy launcher type (`person`/`group`).
    #[serde(default)]
    pub launcher_type: Option<String>,
    /// Legacy launcher id.
    #[serde(default)]
    pub launcher_id: Option<String>,
    /// The actor id of the sender.
    #[serde(default)]
    pub sender_id: Option<String>,
    /// Bot handling the event.
    #[serde(default)]
    pub bot_id: Option<String>,
    /// Workspace.
    #[serde(default)]
    pub workspace_id: Option<String>,
    /// Legacy session id.
    #[serde(default)]
    pub session_id: Option<String>,
}

/// Who caused the event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ActorContext {
    /// E.g. `user`, `system`.
    pub actor_type: String,
    /// Actor id.
    #[serde(default)]
    pub actor_id: Option<String>,
    /// Display name.
    #[serde(default)]
    pub actor_name: Option<String>,
    /// Free-form metadata.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

/// What the event is about.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SubjectContext {
    /// E.g. `message`, `group`, `schedule`.
    pub subject_type: String,
    /// Subject id.
    #[serde(default)]
    pub subject_id: Option<String>,
    /// Small structured data.
    #[serde(default)]
    pub data: Map<String, Value>,
}

/// The event's main input (PROTOCOL_V1 §5.6).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AgentInput {
    /// Plain text of the input.
    #[serde(default)]
    pub text: Option<String>,
    /// Typed content blocks.
    #[serde(default)]
    pub contents: Vec<ContentElement>,
    /// Attached artifacts.
    #[serde(default)]
    pub attachments: Vec<ArtifactRef>,
}

/// Delivery capabilities of the surface the reply goes to (PROTOCOL_V1 §5.7).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeliveryContext {
    /// E.g. `api`, `webui`, `telegram`.
    pub surface: String,
    /// Surface-specific reply address.
    #[serde(default)]
    pub reply_target: Option<Map<String, Value>>,
    /// `message.delta` is delivered progressively.
    #[serde(default)]
    pub supports_streaming: bool,
    /// Sent messages can be edited.
    #[serde(default)]
    pub supports_edit: bool,
    /// Reactions are supported.
    #[serde(default)]
    pub supports_reaction: bool,
    /// Longest message the surface accepts.
    #[serde(default)]
    pub max_message_size: Option<u64>,
    /// Other surface features.
    #[serde(default)]
    pub platform_capabilities: Map<String, Value>,
}

impl DeliveryContext {
    /// A surface with no special capabilities.
    pub fn new(surface: impl Into<String>) -> Self {
        Self {
            surface: surface.into(),
            reply_target: None,
            supports_streaming: false,
            supports_edit: false,
            supports_reaction: false,
            max_message_size: None,
            platform_capabilities: Map::new(),
        }
    }
}

/// What the host inlined and where to get more (PROTOCOL_V1 §5.8). Cursors are opaque.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContextAccess {
    /// Conversation id.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Thread id.
    #[serde(default)]
    pub thread_id: Option<String>,
    /// Latest transcript cursor of the conversation (opaque).
    #[serde(default)]
    pub latest_cursor: Option<String>,
    /// Event sequence number of this event, if known.
    #[serde(default)]
    pub event_seq: Option<i64>,
    /// Transcript sequence number at run start, if known.
    #[serde(default)]
    pub transcript_seq: Option<i64>,
    /// Whether history exists before this event.
    #[serde(default)]
    pub has_history_before: bool,
    /// What was inlined.
    pub inline_policy: InlineContextPolicy,
    /// Which context APIs the run may call.
    pub available_apis: ContextAPICapabilities,
}

/// How much context the host inlined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InlineMode {
    /// Nothing.
    None,
    /// Only the current event (what this host does).
    CurrentEvent,
    /// A recent tail of history.
    RecentTail,
    /// A summary plus a tail.
    SummaryTail,
}

/// The inline policy (PROTOCOL_V1 §5.8).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InlineContextPolicy {
    /// Mode.
    pub mode: InlineMode,
    /// Number of history items delivered inline.
    #[serde(default)]
    pub delivered_count: u64,
    /// Number of items the source had, if known.
    #[serde(default)]
    pub source_total_count: Option<u64>,
    /// Whether the inline messages are complete.
    #[serde(default)]
    pub messages_complete: bool,
    /// Why this mode.
    #[serde(default)]
    pub reason: Option<String>,
}

impl InlineContextPolicy {
    /// The policy this host always uses: the current event only, no history.
    #[must_use]
    pub fn current_event() -> Self {
        Self {
            mode: InlineMode::CurrentEvent,
            delivered_count: 0,
            source_total_count: None,
            messages_complete: false,
            reason: Some("current_event_only".to_owned()),
        }
    }
}

/// Which context APIs the run may call (frozen at run start; the Host API checks the same
/// flags).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default)]
pub struct ContextAPICapabilities {
    /// `history_page`.
    pub history_page: bool,
    /// `history_search`.
    pub history_search: bool,
    /// `event_get`.
    pub event_get: bool,
    /// `event_page`.
    pub event_page: bool,
    /// `artifact_metadata`.
    pub artifact_metadata: bool,
    /// `artifact_read` / `artifact_read_range`.
    pub artifact_read: bool,
    /// `state_get/set/delete/list`.
    pub state: bool,
    /// Plugin/workspace storage.
    pub storage: bool,
    /// `steering_pull`.
    pub steering_pull: bool,
    /// `get_prompt`.
    pub prompt_get: bool,
}

/// Host and run runtime information (PROTOCOL_V1 §5.9).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentRuntimeContext {
    /// Host version. The field name is kept from PROTOCOL_V1 for wire compatibility.
    #[serde(default)]
    pub langbot_version: Option<String>,
    /// Trace id (equal to the run id).
    pub trace_id: String,
    /// Absolute deadline, epoch seconds; `None` means no deadline.
    #[serde(default)]
    pub deadline_at: Option<f64>,
    /// E.g. `bot_id`, `workspace_id`, `streaming_supported`, `model_context_window_tokens`.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

/// A host-owned state scope (PROTOCOL_V1 §5.10, §7.2 `state.updated.scope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum StateScope {
    /// Per conversation (and thread).
    Conversation,
    /// Per actor.
    Actor,
    /// Per subject.
    Subject,
    /// Per runner and binding.
    Runner,
}

impl StateScope {
    /// Every scope.
    pub const ALL: [StateScope; 4] = [Self::Conversation, Self::Actor, Self::Subject, Self::Runner];

    /// The wire text.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Conversation => "conversation",
            Self::Actor => "actor",
            Self::Subject => "subject",
            Self::Runner => "runner",
        }
    }
}

impl std::fmt::Display for StateScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for StateScope {
    type Err = crate::manifest::UnknownOperation;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|x| x.as_str() == s)
            .ok_or_else(|| crate::manifest::UnknownOperation {
                kind: "StateScope",
                value: s.to_owned(),
            })
    }
}

/// Host-owned state snapshot, per scope (PROTOCOL_V1 §5.10).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AgentRunState {
    /// Conversation scope.
    pub conversation: Map<String, Value>,
    /// Actor scope.
    pub actor: Map<String, Value>,
    /// Subject scope.
    pub subject: Map<String, Value>,
    /// Runner scope.
    pub runner: Map<String, Value>,
}

impl AgentRunState {
    /// The snapshot of one scope.
    #[must_use]
    pub fn scope(&self, scope: StateScope) -> &Map<String, Value> {
        match scope {
            StateScope::Conversation => &self.conversation,
            StateScope::Actor => &self.actor,
            StateScope::Subject => &self.subject,
            StateScope::Runner => &self.runner,
        }
    }
}

/// Entry-adapter metadata (`extra.params` and the like). JSON-safe, one-off, non-core.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AdapterContext {
    /// One-off adapter data.
    #[serde(default)]
    pub extra: Map<String, Value>,
}

/// A model the run may use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelResource {
    /// Model id (opaque to the runner).
    pub model_id: String,
    /// `llm` or `rerank`.
    #[serde(default)]
    pub model_type: Option<String>,
    /// Provider name.
    #[serde(default)]
    pub provider: Option<String>,
    /// Granted operations.
    #[serde(default)]
    pub operations: Vec<ModelOp>,
}

/// A tool the run may use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolResource {
    /// Tool name.
    pub tool_name: String,
    /// Tool kind (`http`, `mcp`, …).
    #[serde(default)]
    pub tool_type: Option<String>,
    /// Description.
    #[serde(default)]
    pub description: Option<String>,
    /// Granted operations.
    #[serde(default)]
    pub operations: Vec<ToolOp>,
}

/// A knowledge base the run may use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KnowledgeBaseResource {
    /// KB id.
    pub kb_id: String,
    /// Name.
    #[serde(default)]
    pub kb_name: Option<String>,
    /// Kind.
    #[serde(default)]
    pub kb_type: Option<String>,
    /// Granted operations.
    #[serde(default)]
    pub operations: Vec<KnowledgeBaseOp>,
}

/// A skill visible to the run (facts only; the host never injects them into prompts).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkillResource {
    /// Skill name.
    pub skill_name: String,
    /// Display name.
    #[serde(default)]
    pub display_name: Option<String>,
    /// Description.
    #[serde(default)]
    pub description: Option<String>,
}

/// A file the run may use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileResource {
    /// File id / key.
    pub file_id: String,
    /// Name.
    #[serde(default)]
    pub file_name: Option<String>,
    /// MIME type.
    #[serde(default)]
    pub mime_type: Option<String>,
    /// Where the grant came from (`config`, `knowledge`).
    #[serde(default)]
    pub source: Option<String>,
    /// Granted operations.
    #[serde(default)]
    pub operations: Vec<FileOp>,
}

/// Storage grants.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default)]
pub struct StorageResource {
    /// Plugin-private storage.
    pub plugin_storage: bool,
    /// Workspace-shared storage.
    pub workspace_storage: bool,
}

impl StorageResource {
    /// Whether the given storage area is granted.
    #[must_use]
    pub fn allows(&self, area: StorageOp) -> bool {
        match area {
            StorageOp::Plugin => self.plugin_storage,
            StorageOp::Workspace => self.workspace_storage,
        }
    }
}

/// The run's authorized resources (PROTOCOL_V1 §6). History, event and artifact access is
/// governed by `context.available_apis`, not listed here.
///
/// The `allows_*` helpers answer the Host API's question "may this run do `op` on `id`":
/// the id must be listed, and the operation must be in its `operations`. An empty
/// `operations` list grants nothing (the host always writes explicit lists).
///
/// ```
/// use sb_protocol::context::{AgentResources, ToolResource};
/// use sb_protocol::manifest::ToolOp;
/// let mut r = AgentResources::default();
/// r.tools.push(ToolResource { tool_name: "search".into(), tool_type: None,
///                             description: None, operations: vec![ToolOp::Detail] });
/// assert!(r.allows_tool("search", ToolOp::Detail));
/// assert!(!r.allows_tool("search", ToolOp::Call));
/// assert!(!r.allows_tool("delete_all", ToolOp::Detail));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AgentResources {
    /// Models.
    pub models: Vec<ModelResource>,
    /// Tools.
    pub tools: Vec<ToolResource>,
    /// Knowledge bases.
    pub knowledge_bases: Vec<KnowledgeBaseResource>,
    /// Skills.
    pub skills: Vec<SkillResource>,
    /// Files.
    pub files: Vec<FileResource>,
    /// Storage grants.
    pub storage: StorageResource,
    /// Reserved; always empty today.
    pub platform_capabilities: Map<String, Value>,
}

impl AgentResources {
    /// The model entry for `model_id`.
    #[must_use]
    pub fn model(&self, model_id: &str) -> Option<&ModelResource> {
        self.models.iter().find(|m| m.model_id == model_id)
    }

    /// The tool entry for `tool_name`.
    #[must_use]
    pub fn tool(&self, tool_name: &str) -> Option<&ToolResource> {
        self.tools.iter().find(|t| t.tool_name == tool_name)
    }

    /// The knowledge base entry for `kb_id`.
    #[must_use]
    pub fn knowledge_base(&self, kb_id: &str) -> Option<&KnowledgeBaseResource> {
        self.knowledge_bases.iter().find(|k| k.kb_id == kb_id)
    }

    /// The file entry for `file_id`.
    #[must_use]
    pub fn file(&self, file_id: &str) -> Option<&FileResource> {
        self.files.iter().find(|f| f.file_id == file_id)
    }

    /// Whether `op` on model `model_id` is granted.
    #[must_use]
    pub fn allows_model(&self, model_id: &str, op: ModelOp) -> bool {
        self.model(model_id)
            .is_some_and(|m| m.operations.contains(&op))
    }

    /// Whether `op` on tool `tool_name` is granted.
    #[must_use]
    pub fn allows_tool(&self, tool_name: &str, op: ToolOp) -> bool {
        self.tool(tool_name)
            .is_some_and(|t| t.operations.contains(&op))
    }

    /// Whether `op` on knowledge base `kb_id` is granted.
    #[must_use]
    pub fn allows_knowledge_base(&self, kb_id: &str, op: KnowledgeBaseOp) -> bool {
        self.knowledge_base(kb_id)
            .is_some_and(|k| k.operations.contains(&op))
    }

    /// Whether `op` on file `file_id` is granted.
    #[must_use]
    pub fn allows_file(&self, file_id: &str, op: FileOp) -> bool {
        self.file(file_id)
            .is_some_and(|f| f.operations.contains(&op))
    }

    /// Whether skill `skill_name` is visible (its only operation is `activate`).
    #[must_use]
    pub fn allows_skill(&self, skill_name: &str) -> bool {
        self.skills.iter().any(|s| s.skill_name == skill_name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn trigger_source_is_closed() {
        let t: AgentTrigger =
            serde_json::from_value(json!({"type": "message.received", "source": "host_adapter"}))
                .unwrap();
        assert_eq!(t.source, TriggerSource::HostAdapter);
        assert!(
            serde_json::from_value::<AgentTrigger>(json!({"type": "x", "source": "email"}))
                .is_err()
        );
    }

    #[test]
    fn inline_mode_is_closed() {
        assert!(
            serde_json::from_value::<InlineContextPolicy>(json!({"mode": "full_history"})).is_err()
        );
        let p: InlineContextPolicy = serde_json::from_value(json!({"mode": "none"})).unwrap();
        assert_eq!(p.delivered_count, 0);
    }

    #[test]
    fn resource_operations_are_closed_and_checked() {
        assert!(
            serde_json::from_value::<ModelResource>(
                json!({"model_id": "m", "operations": ["train"]})
            )
            .is_err()
        );
        let r: AgentResources = serde_json::from_value(json!({
            "models": [{"model_id": "m1", "operations": ["invoke"]}, {"model_id": "m2"}],
            "knowledge_bases": [{"kb_id": "k", "operations": ["retrieve"]}],
            "files": [{"file_id": "f", "operations": ["config"]}],
            "skills": [{"skill_name": "s"}],
            "storage": {"plugin_storage": true}
        }))
        .unwrap();
        assert!(r.allows_model("m1", ModelOp::Invoke));
        assert!(!r.allows_model("m1", ModelOp::Stream));
        assert!(
            !r.allows_model("m2", ModelOp::Invoke),
            "empty operations grant nothing"
        );
        assert!(r.allows_knowledge_base("k", KnowledgeBaseOp::Retrieve));
        assert!(!r.allows_knowledge_base("k", KnowledgeBaseOp::List));
        assert!(r.allows_file("f", FileOp::Config));
        assert!(r.allows_skill("s") && !r.allows_skill("t"));
        assert!(r.storage.allows(StorageOp::Plugin) && !r.storage.allows(StorageOp::Workspace));
    }
}
