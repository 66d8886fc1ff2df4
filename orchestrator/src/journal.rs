//! What persisting a run's items means, as pure functions (host-behaviour §14): transcript
//! rows, state writes, artifacts and run outcomes built from results. The result sink and
//! the event consumer call these and write what they return.
//!
//! # Idempotency by construction
//!
//! Everything these functions produce has a deterministic identity, so writing it twice is
//! detected by the store (`conflict`) instead of duplicating it:
//!
//! | item | id |
//! | --- | --- |
//! | user transcript of an event | `<event_id>:user` |
//! | assistant transcript of a run | `<run_id>:assistant` (one per run, the first complete message wins) |
//! | artifact without a declared id | `<run_id>:<sequence>` |
//! | `artifact.created` event-log row | idempotency key `artifact.created:<run_id>:<sequence>` |
//!
//! # Redaction
//!
//! Persisted copies of inputs never keep inline payloads: an image block's `base64` (and a
//! `data:` URL) and an attachment's `content_base64` become `null` with
//! `content_redacted: true` (host-behaviour §14). The runner still received them in its
//! context. The redaction functions live in `sb_store::redact` (re-exported here), shared
//! with the event-log audit rows.

use sb_protocol::content::{ArtifactRef, Message};
use sb_protocol::host::{AgentEventEnvelope, AuthorizationSnapshot, event_types};
use sb_protocol::ids::{EventId, RunId, WorkspaceId};
use sb_protocol::result::{
    AgentRunResult, ArtifactCreated, Classified, ResultLimits, ResultPayload, ResultType,
    StateUpdated, classify,
};
use sb_store::{
    ArtifactContent, ArtifactScope, NewArtifact, NewEvent, NewTranscriptItem, RunOutcome,
    RunStatus, StateWrite,
};
use serde_json::{Value, json};

pub use sb_store::redact::{sanitize_attachments, sanitize_contents};

use crate::state_keys::{
    StateKeyParts, StateValidationError, check_state_key, check_state_value, scope_key,
};

/// Source of runner-produced artifacts and event rows.
pub const SOURCE_RUNNER: &str = "runner";

/// The facts about a run the sink needs, read once from the ledger (the frozen snapshot,
/// which only state updates need, is read apart: `ResultSink::authorization`).
#[derive(Debug, Clone, PartialEq)]
pub struct RunInfo {
    /// Run.
    pub run_id: RunId,
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Triggering event.
    pub event_id: EventId,
    /// Runner id text.
    pub runner_id: String,
    /// Conversation.
    pub conversation_id: Option<String>,
    /// Thread.
    pub thread_id: Option<String>,
    /// Bot.
    pub bot_id: Option<String>,
}

/// Transcript id of an event's user message.
#[must_use]
pub fn user_transcript_id(event_id: &EventId) -> String {
    format!("{event_id}:user")
}

/// Transcript id of a run's assistant message.
#[must_use]
pub fn assistant_transcript_id(run_id: &RunId) -> String {
    format!("{run_id}:assistant")
}

/// Id of an artifact created by result `sequence` of a run: the declared id, else
/// `<run_id>:<sequence>`.
#[must_use]
pub fn artifact_id(run_id: &RunId, sequence: u64, declared: Option<&str>) -> String {
    match declared.filter(|id| !id.is_empty()) {
        Some(id) => id.to_owned(),
        None => format!("{run_id}:{sequence}"),
    }
}

/// The user transcript row of an event: only `message.received` events with a
/// conversation have one (host-behaviour §14 `write_user_transcript`).
#[must_use]
pub fn user_transcript(event: &AgentEventEnvelope) -> Option<NewTranscriptItem> {
    if event.event_type != event_types::MESSAGE_RECEIVED {
        return None;
    }
    let conversation_id = event.conversation_id.clone()?;
    let contents =
        sanitize_contents(serde_json::to_value(&event.input.contents).unwrap_or(Value::Null));
    let attachments = if event.input.attachments.is_empty() {
        None
    } else {
        Some(sanitize_attachments(
            serde_json::to_value(&event.input.attachments).unwrap_or(Value::Null),
        ))
    };
    Some(NewTranscriptItem {
        id: Some(user_transcript_id(&event.event_id)),
        workspace_id: event.workspace_id.clone(),
        conversation_id,
        thread_id: event.thread_id.clone(),
        bot_id: event.bot_id.clone(),
        event_id: event.event_id.to_string(),
        run_id: None,
        runner_id: None,
        role: "user".to_owned(),
        item_type: "message".to_owned(),
        content: event.input.text.clone(),
        content_json: Some(json!({"role": "user", "content": contents})),
        artifact_refs: attachments,
        metadata: json!({
            "actor_type": event.actor.as_ref().map(|a| a.actor_type.clone()),
            "actor_id": event.actor.as_ref().and_then(|a| a.actor_id.clone()),
        }),
    })
}

/// The text of a complete message: a string content as is, text blocks joined with spaces
/// (the seed host's rule).
#[must_use]
pub fn message_text(message: &Message) -> String {
    message
        .content
        .as_ref()
        .map(|c| c.text_joined(" "))
        .unwrap_or_default()
}

/// The assistant transcript row of a run, from its complete message (or, for a runner that
/// only streamed, from the assembled deltas: pass `Message::assistant(text)`).
/// `artifact_refs` are the run's artifacts created before the message; the message's own
/// refs are appended when their ids are new. `None` without a conversation.
#[must_use]
pub fn assistant_transcript(
    run: &RunInfo,
    message: &Message,
    artifact_refs: Vec<Value>,
) -> Option<NewTranscriptItem> {
    let conversation_id = run.conversation_id.clone()?;
    let mut refs = artifact_refs;
    for r in &message.artifact_refs {
        if !refs
            .iter()
            .any(|x| x.get("artifact_id").and_then(Value::as_str) == Some(r.artifact_id.as_str()))
        {
            refs.push(serde_json::to_value(r).unwrap_or(Value::Null));
        }
    }
    let mut content_json = serde_json::to_value(message).unwrap_or(Value::Null);
    if let Some(obj) = content_json.as_object_mut() {
        if let Some(content) = obj.remove("content") {
            obj.insert("content".into(), sanitize_contents(content));
        }
        if let Some(refs) = obj.remove("artifact_refs") {
            obj.insert("artifact_refs".into(), sanitize_attachments(refs));
        }
    }
    Some(NewTranscriptItem {
        id: Some(assistant_transcript_id(&run.run_id)),
        workspace_id: run.workspace_id.clone(),
        conversation_id,
        thread_id: run.thread_id.clone(),
        bot_id: run.bot_id.clone(),
        event_id: run.event_id.to_string(),
        run_id: Some(run.run_id),
        runner_id: Some(run.runner_id.clone()),
        role: "assistant".to_owned(),
        item_type: "message".to_owned(),
        content: Some(message_text(message)),
        content_json: Some(content_json),
        artifact_refs: if refs.is_empty() {
            None
        } else {
            Some(sanitize_attachments(Value::Array(refs)))
        },
        metadata: json!({"run_id": run.run_id.to_string(), "runner_id": run.runner_id}),
    })
}

/// What a stored result item means for the run's persistence.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Nothing besides the ledger row and the delivery (deltas, telemetry, actions,
    /// dropped items).
    None,
    /// A complete message: write the assistant transcript (once per run).
    AssistantMessage(Message),
    /// Apply a state update.
    State(StateUpdated),
    /// Register an artifact.
    Artifact(ArtifactCreated),
}

/// How a classified result affects the run: side effects plus, for a terminal item, the
/// run's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemPlan {
    /// The side effect.
    pub effect: Effect,
    /// The run's final status, for `run.completed` / `run.failed`.
    pub outcome: Option<RunOutcome>,
}

/// Classifies a stored result and says what to apply. A terminal item whose payload does
/// not validate still ends the run (as `failed`, code `runner.protocol_error`): the worker
/// guarantees exactly one terminal item, and a run must not stay active because of it.
#[must_use]
pub fn plan_item(result: &AgentRunResult) -> ItemPlan {
    if !may_have_effects(result.known_type()) {
        // Valid or not, such an item has no side effect and ends nothing: the streamed
        // deltas, most of a run's items, are not classified again here.
        return ItemPlan {
            effect: Effect::None,
            outcome: None,
        };
    }
    let classified = classify(&stored_json(result), &ResultLimits::default());
    let typed = match classified {
        Classified::Valid(typed) => typed,
        Classified::Telemetry(_) => {
            return ItemPlan {
                effect: Effect::None,
                outcome: None,
            };
        }
        Classified::Dropped { reason } | Classified::ProtocolError { reason } => {
            let outcome = result.known_type().filter(|t| t.is_terminal()).map(|_| {
                RunOutcome::with_error(
                    RunStatus::Failed,
                    sb_protocol::error::run_failure::RUNNER_PROTOCOL_ERROR,
                    format!("invalid terminal result: {reason}"),
                )
            });
            return ItemPlan {
                effect: Effect::None,
                outcome,
            };
        }
    };
    let usage = typed.usage.clone().map(Value::Object);
    match typed.payload {
        ResultPayload::MessageCompleted(p) => ItemPlan {
            effect: Effect::AssistantMessage(p.message),
            outcome: None,
        },
        ResultPayload::StateUpdated(p) => ItemPlan {
            effect: Effect::State(p),
            outcome: None,
        },
        ResultPayload::ArtifactCreated(p) => ItemPlan {
            effect: Effect::Artifact(p),
            outcome: None,
        },
        ResultPayload::RunCompleted(p) => ItemPlan {
            effect: p.message.map_or(Effect::None, Effect::AssistantMessage),
            outcome: Some(RunOutcome {
                usage,
                ..RunOutcome::completed()
            }),
        },
        ResultPayload::RunFailed(p) => {
            use sb_protocol::error::run_failure;
            let status = match p.code.as_str() {
                run_failure::CANCELLED => RunStatus::Cancelled,
                run_failure::TIMEOUT => RunStatus::Timeout,
                run_failure::INTERRUPTED => RunStatus::Interrupted,
                _ => RunStatus::Failed,
            };
            let mut outcome = RunOutcome::with_error(status, p.code, p.error);
            outcome.usage = usage;
            ItemPlan {
                effect: Effect::None,
                outcome: Some(outcome),
            }
        }
        ResultPayload::MessageDelta(_) | ResultPayload::ActionRequested(_) => ItemPlan {
            effect: Effect::None,
            outcome: None,
        },
    }
}

/// The JSON a result item is stored as in the ledger (`run_events.data`), as a value: what
/// it is classified from, and compared with to recognize a stored item.
#[must_use]
pub fn stored_json(result: &AgentRunResult) -> Value {
    serde_json::to_value(result).unwrap_or(Value::Null)
}

/// Whether an item of this type (`None`: unknown) can have a side effect or end its run;
/// every other item's plan is [`Effect::None`] without an outcome, whether it validates or
/// not (a dropped or invalid item of these types has none either).
fn may_have_effects(result_type: Option<ResultType>) -> bool {
    matches!(
        result_type,
        Some(
            ResultType::MessageCompleted
                | ResultType::StateUpdated
                | ResultType::ArtifactCreated
                | ResultType::RunCompleted
                | ResultType::RunFailed
        )
    )
}

/// The state write for a `state.updated` item, checked against the run's frozen policy
/// (host-behaviour §10 `apply_update_from_event`, in its order): state enabled, scope
/// enabled, key rules (alias applied), identity for the scope, value size.
pub fn plan_state_write(
    snapshot: &AuthorizationSnapshot,
    update: &StateUpdated,
    max_value_bytes: usize,
) -> Result<StateWrite, StateValidationError> {
    if !snapshot.state_policy.enable_state {
        return Err(StateValidationError::Disabled);
    }
    if !snapshot.state_policy.allows(update.scope) {
        return Err(StateValidationError::ScopeNotEnabled(update.scope));
    }
    let key = check_state_key(&update.key)?;
    let scope_key = scope_key(update.scope, &StateKeyParts::from_snapshot(snapshot))
        .ok_or(StateValidationError::MissingIdentity(update.scope))?;
    check_state_value(&update.value, max_value_bytes)?;
    Ok(StateWrite {
        scope_key,
        scope: update.scope.as_str().to_owned(),
        key,
        value: update.value.clone(),
        if_revision: None,
    })
}

/// Why an `artifact.created` item is not stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArtifactError {
    /// `content_base64` is not strict base64.
    #[error("artifact.created invalid base64 content: {0}")]
    InvalidBase64(String),
    /// The decoded content is over the inline cap.
    #[error("artifact.created content size {size} bytes exceeds limit {limit} bytes")]
    TooLarge {
        /// Decoded size.
        size: usize,
        /// The cap.
        limit: usize,
    },
    /// The declared sha256 is not 64 hex characters.
    #[error("artifact.created sha256 must be 64 hex characters")]
    BadSha256,
}

/// The artifact to register for an `artifact.created` item (host-behaviour §14, plus the
/// checks the seed skipped): strict base64, decoded size ≤ `max_inline_bytes`; the declared
/// sha256 / size are verified by the store against the bytes. Visible to the conversation
/// when the run has one, else only to the run.
pub fn plan_artifact(
    run: &RunInfo,
    sequence: u64,
    created: &ArtifactCreated,
    max_inline_bytes: usize,
) -> Result<NewArtifact, ArtifactError> {
    let content = match created.decode_content() {
        Ok(Some(bytes)) => {
            if bytes.len() > max_inline_bytes {
                return Err(ArtifactError::TooLarge {
                    size: bytes.len(),
                    limit: max_inline_bytes,
                });
            }
            ArtifactContent::Inline(bytes)
        }
        Ok(None) => ArtifactContent::MetadataOnly,
        Err(e) => return Err(ArtifactError::InvalidBase64(e.to_string())),
    };
    let declared_sha256 = match &created.sha256 {
        Some(s) if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) => {
            Some(s.to_ascii_lowercase())
        }
        Some(_) => return Err(ArtifactError::BadSha256),
        None => None,
    };
    Ok(NewArtifact {
        id: Some(artifact_id(
            &run.run_id,
            sequence,
            created.artifact_id.as_deref(),
        )),
        workspace_id: run.workspace_id.clone(),
        artifact_type: created.artifact_type.clone(),
        mime_type: created.mime_type.clone(),
        name: created.name.clone(),
        source: SOURCE_RUNNER.to_owned(),
        scope: if run.conversation_id.is_some() {
            ArtifactScope::Conversation
        } else {
            ArtifactScope::Run
        },
        conversation_id: run.conversation_id.clone(),
        thread_id: run.thread_id.clone(),
        bot_id: run.bot_id.clone(),
        run_id: Some(run.run_id),
        runner_id: Some(run.runner_id.clone()),
        metadata: created
            .metadata
            .clone()
            .map_or_else(|| json!({}), Value::Object),
        expires_at: None,
        content,
        declared_sha256,
        declared_size: created.size_bytes.and_then(|s| i64::try_from(s).ok()),
    })
}

/// The event-log row recording an artifact a runner created (host-behaviour §14). It is an
/// audit record of the run, never routed: its status is `dispatched` with the run id, and
/// its idempotency key makes a replayed item append it once.
#[must_use]
pub fn artifact_event(run: &RunInfo, sequence: u64, artifact: &NewArtifact) -> NewEvent {
    let mut event = NewEvent::new(run.workspace_id.clone(), "artifact.created", SOURCE_RUNNER);
    event.idempotency_key = Some(format!("artifact.created:{}:{sequence}", run.run_id));
    event.bot_id = run.bot_id.clone();
    event.conversation_id = run.conversation_id.clone();
    event.thread_id = run.thread_id.clone();
    event.input_summary = Some(format!("Artifact created: {}", artifact.artifact_type));
    event.envelope = Some(json!({
        "artifact_id": artifact.id,
        "artifact_type": artifact.artifact_type,
        "mime_type": artifact.mime_type,
        "name": artifact.name,
        "size_bytes": artifact.declared_size,
    }));
    event.status = sb_store::EventStatus::Dispatched;
    event.run_id = Some(run.run_id);
    event.runner_id = Some(run.runner_id.clone());
    event
}

/// The ref of an artifact, as merged into the assistant transcript.
#[must_use]
pub fn artifact_ref(run_id: &RunId, sequence: u64, created: &ArtifactCreated) -> Value {
    let mut r = ArtifactRef::new(
        artifact_id(run_id, sequence, created.artifact_id.as_deref()),
        created.artifact_type.clone(),
    );
    r.mime_type.clone_from(&created.mime_type);
    r.name.clone_from(&created.name);
    serde_json::to_value(r).unwrap_or(Value::Null)
}

/// What one sink applied of a run, so its terminal item and its assistant message need not
/// read the run's items back from the ledger: whether a complete assistant message was
/// applied and, while the applied items are exactly `1, 2, …` in order (the sink saw the
/// run from its start, none was handled by another consumer), the artifact references of
/// the ones applied so far.
#[derive(Debug, Clone, Default)]
pub struct AppliedItems {
    order: Order,
    /// `(sequence, ref)` of the applied `artifact.created` items, ascending (kept while the
    /// order is contiguous).
    artifacts: Vec<(u64, Value)>,
    /// Whether a complete assistant message was applied.
    messaged: bool,
}

/// Whether the applied items are the run's items from its first, without a gap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Order {
    /// Nothing applied yet.
    #[default]
    Fresh,
    /// Items `1..next` were applied, in order.
    Contiguous { next: u64 },
    /// The record began after the run's first item, or skipped one: read the ledger.
    Broken,
}

impl AppliedItems {
    /// Records the application of item `sequence` of `run_id` with plan `effect`. A
    /// redelivered item (below the next expected sequence) changes nothing.
    pub fn note(&mut self, run_id: &RunId, sequence: u64, effect: &Effect) {
        if matches!(effect, Effect::AssistantMessage(_)) {
            self.messaged = true;
        }
        let expected = match self.order {
            Order::Fresh => 1,
            Order::Contiguous { next } => next,
            Order::Broken => return,
        };
        if sequence < expected {
            return;
        }
        if sequence > expected {
            self.order = Order::Broken;
            self.artifacts = Vec::new();
            return;
        }
        self.order = Order::Contiguous { next: expected + 1 };
        if let Effect::Artifact(created) = effect {
            self.artifacts
                .push((sequence, artifact_ref(run_id, sequence, created)));
        }
    }

    /// The artifact references of the items before `sequence`, as
    /// [`artifact_refs_before`] would read them from the ledger, when every item before it
    /// was applied through this record; `None` when the ledger must be read.
    #[must_use]
    pub fn artifact_refs_before(&self, sequence: u64) -> Option<Vec<Value>> {
        let Order::Contiguous { next } = self.order else {
            return None;
        };
        (next >= sequence).then(|| {
            self.artifacts
                .iter()
                .filter(|(seq, _)| *seq < sequence)
                .map(|(_, r)| r.clone())
                .collect()
        })
    }

    /// Whether a complete assistant message was applied.
    #[must_use]
    pub fn messaged(&self) -> bool {
        self.messaged
    }
}

/// A run's items as stored in the ledger: `(sequence, result)`, ascending.
pub type StoredItems = [(u64, AgentRunResult)];

/// The refs of the artifacts created by items before `before_sequence`.
#[must_use]
pub fn artifact_refs_before(
    run_id: &RunId,
    items: &StoredItems,
    before_sequence: u64,
) -> Vec<Value> {
    items
        .iter()
        .filter(|(seq, _)| *seq < before_sequence)
        .filter_map(|(seq, r)| match plan_item(r).effect {
            Effect::Artifact(created) => Some(artifact_ref(run_id, *seq, &created)),
            _ => None,
        })
        .collect()
}

/// Whether any stored item is a complete message (then the assistant transcript was, or
/// will be, written from it).
#[must_use]
pub fn has_complete_message(items: &StoredItems) -> bool {
    items
        .iter()
        .any(|(_, r)| matches!(plan_item(r).effect, Effect::AssistantMessage(_)))
}

/// The text streamed by a run's `message.delta` items, in sequence order; `None` when
/// nothing was streamed.
#[must_use]
pub fn assembled_deltas(items: &StoredItems) -> Option<String> {
    let mut text = String::new();
    let mut any = false;
    for (_, r) in items {
        if r.known_type() != Some(ResultType::MessageDelta) {
            continue;
        }
        if let Classified::Valid(typed) = classify(
            &serde_json::to_value(r).unwrap_or(Value::Null),
            &ResultLimits::default(),
        ) {
            if let ResultPayload::MessageDelta(d) = typed.payload {
                any = true;
                text.push_str(&d.chunk.text());
            }
        }
    }
    (any && !text.is_empty()).then_some(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sb_protocol::content::{ContentElement, MessageContent};
    use sb_protocol::context::{ActorContext, AgentInput, DeliveryContext, StateScope};
    use sb_protocol::context::{AgentResources, ContextAPICapabilities};
    use sb_protocol::host::{ActorRef, RunBudgets, StatePolicy};
    use serde_json::Map;

    fn run(conversation: Option<&str>) -> RunInfo {
        RunInfo {
            run_id: RunId::new(),
            workspace_id: WorkspaceId::default_workspace(),
            event_id: EventId::new(),
            runner_id: "plugin:acme/echo/default".into(),
            conversation_id: conversation.map(Into::into),
            thread_id: None,
            bot_id: Some("bot".into()),
        }
    }

    fn snapshot(policy: StatePolicy, actor: Option<&str>) -> AuthorizationSnapshot {
        AuthorizationSnapshot {
            run_id: RunId::new(),
            plugin_id: "acme/echo".into(),
            runner_id: "plugin:acme/echo/default".parse().unwrap(),
            binding_id: "agent_x_plugin:acme/echo/default".into(),
            workspace_id: WorkspaceId::default_workspace(),
            bot_id: None,
            conversation_id: Some("c1".into()),
            thread_id: None,
            actor: actor.map(|a| ActorRef {
                actor_type: "user".into(),
                actor_id: Some(a.into()),
            }),
            subject: None,
            resources: AgentResources::default(),
            available_apis: ContextAPICapabilities {
                state: true,
                ..Default::default()
            },
            state_policy: policy,
            budgets: RunBudgets::default(),
            deadline_at: None,
            host_api_token_sha256: None,
        }
    }

    fn result(v: Value) -> AgentRunResult {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn user_transcript_redacts_and_requires_a_message_with_conversation() {
        let mut e = AgentEventEnvelope {
            event_id: EventId::new(),
            workspace_id: WorkspaceId::default_workspace(),
            event_type: "message.received".into(),
            event_time: None,
            source: "api".into(),
            source_event_type: None,
            bot_id: None,
            conversation_id: Some("c1".into()),
            thread_id: Some("t".into()),
            actor: Some(ActorContext {
                actor_type: "user".into(),
                actor_id: Some("u".into()),
                actor_name: None,
                metadata: Map::new(),
            }),
            subject: None,
            input: AgentInput {
                text: Some("look".into()),
                contents: vec![
                    ContentElement::text("look"),
                    serde_json::from_value(
                        json!({"type": "image", "base64": "AAAA", "mime_type": "image/png"}),
                    )
                    .unwrap(),
                ],
                attachments: vec![{
                    let mut r = ArtifactRef::new("a1", "file");
                    r.content_base64 = Some("QUJD".into());
                    r
                }],
            },
            delivery: DeliveryContext::new("api"),
            raw_ref: None,
            data: Map::new(),
            metadata: Map::new(),
        };
        let t = user_transcript(&e).unwrap();
        assert_eq!(
            t.id.as_deref(),
            Some(format!("{}:user", e.event_id).as_str())
        );
        assert_eq!(t.role, "user");
        assert_eq!(t.content.as_deref(), Some("look"));
        assert!(t.run_id.is_none() && t.runner_id.is_none());
        assert_eq!(t.thread_id.as_deref(), Some("t"));
        let cj = t.content_json.unwrap();
        assert_eq!(cj["content"][1]["base64"], Value::Null);
        assert_eq!(cj["content"][1]["content_redacted"], true);
        assert_eq!(cj["content"][0]["text"], "look");
        let refs = t.artifact_refs.unwrap();
        assert_eq!(refs[0]["content_base64"], Value::Null);
        assert_eq!(refs[0]["content_redacted"], true);
        assert_eq!(t.metadata["actor_id"], "u");
        assert!(!serde_json::to_string(&cj).unwrap().contains("AAAA"));

        e.conversation_id = None;
        assert!(user_transcript(&e).is_none());
        e.conversation_id = Some("c1".into());
        e.event_type = "group.member_joined".into();
        assert!(user_transcript(&e).is_none());
    }

    #[test]
    fn assistant_transcript_merges_refs() {
        let r = run(Some("c1"));
        let mut m = Message::assistant(MessageContent::Parts(vec![
            ContentElement::text("hello"),
            ContentElement::text("world"),
        ]));
        m.artifact_refs = vec![
            ArtifactRef::new("a1", "file"),
            ArtifactRef::new("a2", "image"),
        ];
        let pending = vec![json!({"artifact_id": "a1", "artifact_type": "file", "name": "first"})];
        let t = assistant_transcript(&r, &m, pending).unwrap();
        assert_eq!(t.id, Some(format!("{}:assistant", r.run_id)));
        assert_eq!(t.content.as_deref(), Some("hello world"));
        assert_eq!(t.run_id, Some(r.run_id));
        assert_eq!(t.event_id, r.event_id.to_string());
        let refs = t.artifact_refs.unwrap();
        assert_eq!(refs.as_array().unwrap().len(), 2);
        assert_eq!(refs[0]["name"], "first", "pending refs come first and win");
        assert_eq!(refs[1]["artifact_id"], "a2");
        assert_eq!(t.metadata["runner_id"], "plugin:acme/echo/default");
        assert!(assistant_transcript(&run(None), &m, vec![]).is_none());
    }

    #[test]
    fn item_plans_and_outcomes() {
        let p = plan_item(&result(
            json!({"type": "message.delta", "data": {"chunk": {"content": "x"}}}),
        ));
        assert_eq!(
            p,
            ItemPlan {
                effect: Effect::None,
                outcome: None
            }
        );
        let p = plan_item(&result(
            json!({"type": "message.completed", "data": {"message": {"role": "assistant", "content": "hi"}}}),
        ));
        assert!(matches!(p.effect, Effect::AssistantMessage(ref m) if m.text() == "hi"));
        let p = plan_item(&result(
            json!({"type": "run.completed", "data": {"finish_reason": "stop"}, "usage": {"tokens": 3}}),
        ));
        assert_eq!(p.effect, Effect::None);
        let o = p.outcome.unwrap();
        assert_eq!(o.status, RunStatus::Completed);
        assert_eq!(o.usage, Some(json!({"tokens": 3})));
        let p = plan_item(&result(
            json!({"type": "run.completed", "data": {"message": {"role": "assistant", "content": "bye"}}}),
        ));
        assert!(matches!(p.effect, Effect::AssistantMessage(_)));
        for (code, status) in [
            ("cancelled", RunStatus::Cancelled),
            ("timeout", RunStatus::Timeout),
            ("interrupted", RunStatus::Interrupted),
            ("runner.crashed", RunStatus::Failed),
            ("my.code", RunStatus::Failed),
        ] {
            let p = plan_item(&result(
                json!({"type": "run.failed", "data": {"code": code, "error": "boom"}}),
            ));
            let o = p.outcome.unwrap();
            assert_eq!(o.status, status, "{code}");
            assert_eq!(o.error_code.as_deref(), Some(code));
            assert_eq!(o.error_message.as_deref(), Some("boom"));
        }
        // an invalid terminal still ends the run
        let p = plan_item(&result(json!({"type": "run.failed", "data": {"oops": 1}})));
        let o = p.outcome.unwrap();
        assert_eq!(o.status, RunStatus::Failed);
        assert_eq!(o.error_code.as_deref(), Some("runner.protocol_error"));
        // telemetry and unknown types do nothing
        assert_eq!(
            plan_item(&result(
                json!({"type": "tool.call.started", "data": {"junk": true}})
            ))
            .effect,
            Effect::None
        );
        assert_eq!(
            plan_item(&result(json!({"type": "future.thing", "data": {}}))).outcome,
            None
        );
        let p = plan_item(&result(
            json!({"type": "state.updated", "data": {"scope": "runner", "key": "k", "value": 1}}),
        ));
        assert!(matches!(p.effect, Effect::State(_)));
    }

    #[test]
    fn state_write_checks_in_order() {
        let upd = |scope: StateScope, key: &str, value: Value| StateUpdated {
            scope,
            key: key.into(),
            value,
        };
        let policy = StatePolicy::default(); // conversation + actor
        let s = snapshot(policy.clone(), Some("u1"));
        let w = plan_state_write(
            &s,
            &upd(StateScope::Conversation, "conversation_id", json!("x")),
            262_144,
        )
        .unwrap();
        assert_eq!(w.key, "external.conversation_id");
        assert!(w.scope_key.starts_with("conversation:v2:"));
        assert_eq!(w.scope, "conversation");
        assert_eq!(w.if_revision, None);
        assert_eq!(
            plan_state_write(&s, &upd(StateScope::Runner, "k", json!(1)), 100),
            Err(StateValidationError::ScopeNotEnabled(StateScope::Runner))
        );
        let off = snapshot(
            StatePolicy {
                enable_state: false,
                ..policy.clone()
            },
            Some("u1"),
        );
        assert_eq!(
            plan_state_write(&off, &upd(StateScope::Conversation, "k", json!(1)), 100),
            Err(StateValidationError::Disabled)
        );
        assert_eq!(
            plan_state_write(&s, &upd(StateScope::Actor, "", json!(1)), 100),
            Err(StateValidationError::EmptyKey)
        );
        let anon = snapshot(policy, None);
        assert_eq!(
            plan_state_write(&anon, &upd(StateScope::Actor, "k", json!(1)), 100),
            Err(StateValidationError::MissingIdentity(StateScope::Actor))
        );
        assert!(matches!(
            plan_state_write(
                &s,
                &upd(StateScope::Actor, "k", json!("x".repeat(200))),
                100
            ),
            Err(StateValidationError::ValueTooLarge { .. })
        ));
        // the key isolates bindings: same update under another binding → another scope key
        let mut other = s.clone();
        other.binding_id = "agent_y_plugin:acme/echo/default".into();
        let a = plan_state_write(&s, &upd(StateScope::Actor, "k", json!(1)), 100).unwrap();
        let b = plan_state_write(&other, &upd(StateScope::Actor, "k", json!(1)), 100).unwrap();
        assert_ne!(a.scope_key, b.scope_key);
    }

    #[test]
    fn artifact_checks() {
        let r = run(Some("c1"));
        let created = |v: Value| -> ArtifactCreated { serde_json::from_value(v).unwrap() };
        let a = plan_artifact(
            &r,
            3,
            &created(
                json!({"artifact_type": "file", "content_base64": "aGVsbG8=", "name": "h.txt"}),
            ),
            1024,
        )
        .unwrap();
        assert_eq!(a.id, Some(format!("{}:3", r.run_id)));
        assert_eq!(a.content, ArtifactContent::Inline(b"hello".to_vec()));
        assert_eq!(a.scope, ArtifactScope::Conversation);
        assert_eq!(a.source, "runner");
        assert_eq!(a.run_id, Some(r.run_id));
        let a = plan_artifact(
            &run(None),
            1,
            &created(json!({"artifact_type": "file", "artifact_id": "mine"})),
            1024,
        )
        .unwrap();
        assert_eq!(a.id.as_deref(), Some("mine"));
        assert_eq!(a.content, ArtifactContent::MetadataOnly);
        assert_eq!(a.scope, ArtifactScope::Run);
        assert!(matches!(
            plan_artifact(
                &r,
                1,
                &created(json!({"artifact_type": "file", "content_base64": "aGVsbG8"})),
                1024
            ),
            Err(ArtifactError::InvalidBase64(_))
        ));
        assert_eq!(
            plan_artifact(
                &r,
                1,
                &created(json!({"artifact_type": "file", "content_base64": "aGVsbG8="})),
                4
            ),
            Err(ArtifactError::TooLarge { size: 5, limit: 4 })
        );
        assert_eq!(
            plan_artifact(
                &r,
                1,
                &created(json!({"artifact_type": "file", "sha256": "xyz"})),
                4
            ),
            Err(ArtifactError::BadSha256)
        );
        let sha = "2CF24DBA5FB0A30E26E83B2AC5B9E29E1B161E5C1FA7425E73043362938B9824";
        let a = plan_artifact(
            &r,
            1,
            &created(json!({"artifact_type": "file", "sha256": sha, "size_bytes": 5})),
            4,
        )
        .unwrap();
        assert_eq!(
            a.declared_sha256.as_deref(),
            Some(sha.to_ascii_lowercase().as_str())
        );
        assert_eq!(a.declared_size, Some(5));
        let ev = artifact_event(&r, 3, &a);
        assert_eq!(ev.event_type, "artifact.created");
        assert_eq!(
            ev.idempotency_key,
            Some(format!("artifact.created:{}:3", r.run_id))
        );
        assert!(sb_store::events::is_valid_idempotency_key(
            ev.idempotency_key.as_deref().unwrap()
        ));
    }

    #[test]
    fn stored_item_scans() {
        let run_id = RunId::new();
        let items: Vec<(u64, AgentRunResult)> = vec![
            (
                1,
                result(json!({"type": "message.delta", "data": {"chunk": {"content": "hel"}}})),
            ),
            (
                2,
                result(
                    json!({"type": "artifact.created", "data": {"artifact_type": "image", "name": "p.png"}}),
                ),
            ),
            (
                3,
                result(json!({"type": "message.delta", "data": {"chunk": {"content": "lo"}}})),
            ),
            (4, result(json!({"type": "run.completed", "data": {}}))),
        ];
        assert_eq!(assembled_deltas(&items).as_deref(), Some("hello"));
        assert!(!has_complete_message(&items));
        let refs = artifact_refs_before(&run_id, &items, 4);
        assert_eq!(refs.len(), 1);
        assert_eq!(refs[0]["artifact_id"], format!("{run_id}:2"));
        assert_eq!(refs[0]["name"], "p.png");
        assert!(artifact_refs_before(&run_id, &items, 2).is_empty());
        let with_message = [(
            1,
            result(
                json!({"type": "message.completed", "data": {"message": {"role": "assistant", "content": "x"}}}),
            ),
        )];
        assert!(has_complete_message(&with_message));
        assert_eq!(assembled_deltas(&with_message), None);
    }

    #[test]
    fn applied_items_know_the_artifact_refs_only_from_an_unbroken_start() {
        let r = run(Some("c1"));
        let created: ArtifactCreated =
            serde_json::from_value(json!({"artifact_type": "file", "name": "a.txt"})).unwrap();
        let art = Effect::Artifact(created.clone());
        let mut applied = AppliedItems::default();
        applied.note(&r.run_id, 1, &Effect::None);
        applied.note(&r.run_id, 2, &art);
        applied.note(&r.run_id, 2, &art); // a redelivery changes nothing
        applied.note(&r.run_id, 3, &Effect::None);
        assert_eq!(applied.artifact_refs_before(2), Some(vec![]));
        assert_eq!(
            applied.artifact_refs_before(4),
            Some(vec![artifact_ref(&r.run_id, 2, &created)])
        );
        // Item 4 was not applied here: the ledger must say what it was.
        assert_eq!(applied.artifact_refs_before(5), None);
        // A gap breaks the record for good.
        applied.note(&r.run_id, 5, &Effect::None);
        applied.note(&r.run_id, 6, &Effect::None);
        assert_eq!(applied.artifact_refs_before(4), None);

        // A record that begins after the run's first item knows nothing.
        let mut late = AppliedItems::default();
        late.note(&r.run_id, 2, &Effect::None);
        assert_eq!(late.artifact_refs_before(2), None);
        assert!(!late.messaged());
        late.note(
            &r.run_id,
            3,
            &Effect::AssistantMessage(Message::assistant("hi")),
        );
        assert!(late.messaged());
    }
}
