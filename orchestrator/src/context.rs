//! The `AgentRunContext` builder (PROTOCOL_V1 §5, host-behaviour §9). Pure: every input
//! (run id, clock, transcript cursor, state snapshot, effective access) is an argument.
//!
//! The host never inlines history: `input` is the current event only, and
//! `context.inline_policy` says so (`current_event`). Runners pull more through the Host API
//! as `context.available_apis` allows. `context.latest_cursor` is the conversation's latest
//! transcript cursor *before* this event's own user transcript row, so a runner paging
//! backwards from it sees strictly earlier history.
//!
//! `runtime.metadata.host_api` (`{url, token}`) tells a runner that runs outside a worker
//! where the remote Host API is (`POST <gateway>{url}/{action}`) and the run's bearer token;
//! see [`sb_protocol::host::host_api_token`].

use std::time::Duration;

use sb_protocol::context::{
    AdapterContext, AgentRunContext, AgentRunState, AgentRuntimeContext, AgentTrigger,
    ContextAccess, ConversationContext, InlineContextPolicy, StateScope, TriggerSource,
};
use sb_protocol::host::{AgentBinding, AgentEventEnvelope, StatePolicy, host_api_token};
use sb_protocol::ids::RunId;
use serde_json::{Map, Value, json};

use crate::access::EffectiveAccess;
use crate::state_keys::EXTERNAL_CONVERSATION_ID;

/// The runner-config key whose value (seconds) sets the run deadline.
pub const TIMEOUT_KEY: &str = "timeout";

/// The run's timeout from `runner_config.timeout` (host-behaviour §1):
/// - key absent → `default`;
/// - a positive number → that many seconds;
/// - `null`, zero, negative, or not a number → **no deadline** (`None`), as in the seed.
#[must_use]
pub fn run_timeout(runner_config: &Map<String, Value>, default: Duration) -> Option<Duration> {
    match runner_config.get(TIMEOUT_KEY) {
        None => Some(default),
        Some(Value::Number(n)) => n
            .as_f64()
            .filter(|s| s.is_finite() && *s > 0.0)
            .and_then(|s| Duration::try_from_secs_f64(s).ok()),
        Some(_) => None,
    }
}

/// `deadline_at` in epoch seconds: `now + timeout`, or `None` without a timeout.
#[must_use]
pub fn deadline_at(now_epoch_secs: f64, timeout: Option<Duration>) -> Option<f64> {
    timeout.map(|t| now_epoch_secs + t.as_secs_f64())
}

/// `trigger.source` from the event's free-form `source`; a source outside the protocol's
/// closed set was normalized by an entry adapter inside the host (`host_adapter`).
#[must_use]
pub fn trigger_source(source: &str) -> TriggerSource {
    serde_json::from_value(Value::String(source.to_owned())).unwrap_or(TriggerSource::HostAdapter)
}

/// The state snapshot (`ctx.state`): for each scope the policy enables, the rows loaded for
/// it (`rows` returns them; scopes without a key were never looked up). With the
/// conversation scope enabled and a conversation id, `external.conversation_id` is filled in
/// when missing (host-behaviour §10). State disabled → all scopes empty.
#[must_use]
pub fn state_snapshot(
    policy: &StatePolicy,
    conversation_id: Option<&str>,
    mut rows: impl FnMut(StateScope) -> Option<Map<String, Value>>,
) -> AgentRunState {
    let mut state = AgentRunState::default();
    if !policy.is_enabled() {
        return state;
    }
    for scope in StateScope::ALL {
        if !policy.allows(scope) {
            continue;
        }
        let loaded = rows(scope).unwrap_or_default();
        match scope {
            StateScope::Conversation => state.conversation = loaded,
            StateScope::Actor => state.actor = loaded,
            StateScope::Subject => state.subject = loaded,
            StateScope::Runner => state.runner = loaded,
        }
    }
    if policy.allows(StateScope::Conversation) {
        if let Some(conversation) = conversation_id.filter(|c| !c.is_empty()) {
            state
                .conversation
                .entry(EXTERNAL_CONVERSATION_ID)
                .or_insert_with(|| Value::String(conversation.to_owned()));
        }
    }
    state
}

/// Everything [`build`] needs besides the event and binding.
#[derive(Debug, Clone)]
pub struct ContextInputs {
    /// The new run's id (also `runtime.trace_id`).
    pub run_id: RunId,
    /// Now, epoch seconds.
    pub now_epoch_secs: f64,
    /// `deadline_at` (see [`run_timeout`] and [`deadline_at`]).
    pub deadline_at: Option<f64>,
    /// The conversation's latest transcript cursor before this event, if any.
    pub latest_cursor: Option<String>,
    /// Effective access of the run.
    pub access: EffectiveAccess,
    /// State snapshot.
    pub state: AgentRunState,
    /// Host version (`runtime.langbot_version`).
    pub host_version: String,
    /// The run's remote Host API token (`runtime.metadata.host_api.token`), if the run has
    /// one.
    pub host_api_token: Option<String>,
}

/// Builds the context a runner receives for `event` handled by `binding`.
#[must_use]
pub fn build(
    event: &AgentEventEnvelope,
    binding: &AgentBinding,
    inputs: ContextInputs,
) -> AgentRunContext {
    let ContextInputs {
        run_id,
        now_epoch_secs,
        deadline_at,
        latest_cursor,
        access,
        state,
        host_version,
        host_api_token,
    } = inputs;

    let conversation = event
        .conversation_id
        .as_ref()
        .map(|conversation_id| ConversationContext {
            conversation_id: Some(conversation_id.clone()),
            thread_id: event.thread_id.clone(),
            launcher_type: None,
            launcher_id: None,
            sender_id: event.actor.as_ref().and_then(|a| a.actor_id.clone()),
            bot_id: event.bot_id.clone(),
            workspace_id: Some(event.workspace_id.to_string()),
            session_id: None,
        });

    let latest_cursor = latest_cursor.filter(|c| !c.is_empty());
    let context = ContextAccess {
        conversation_id: event.conversation_id.clone(),
        thread_id: event.thread_id.clone(),
        transcript_seq: latest_cursor.as_deref().and_then(|c| c.parse::<i64>().ok()),
        has_history_before: latest_cursor.is_some(),
        latest_cursor,
        event_seq: None,
        inline_policy: InlineContextPolicy::current_event(),
        available_apis: access.available_apis,
    };

    let mut runtime_metadata = Map::new();
    runtime_metadata.insert(
        "bot_id".into(),
        event.bot_id.clone().map_or(Value::Null, Value::String),
    );
    runtime_metadata.insert(
        "workspace_id".into(),
        Value::String(event.workspace_id.to_string()),
    );
    runtime_metadata.insert(
        "streaming_supported".into(),
        Value::Bool(event.delivery.supports_streaming),
    );
    runtime_metadata.insert(
        "model_context_window_tokens".into(),
        access
            .model_context_window_tokens
            .map_or(Value::Null, Value::from),
    );
    if let Some(token) = host_api_token {
        runtime_metadata.insert(
            host_api_token::METADATA_KEY.into(),
            json!({ "url": host_api_token::PATH, "token": token }),
        );
    }

    let now_secs = now_epoch_secs.floor() as i64;
    AgentRunContext {
        run_id,
        trigger: AgentTrigger {
            trigger_type: event.event_type.clone(),
            source: trigger_source(&event.source),
            timestamp: Some(event.event_time.unwrap_or(now_secs)),
        },
        event: event.event_context(),
        conversation,
        actor: event.actor.clone(),
        subject: event.subject.clone(),
        input: event.input.clone(),
        delivery: event.delivery.clone(),
        resources: access.resources,
        context,
        state,
        runtime: AgentRuntimeContext {
            langbot_version: Some(host_version),
            trace_id: run_id.to_string(),
            deadline_at,
            metadata: runtime_metadata,
        },
        config: binding.runner_config.clone(),
        adapter: Some(AdapterContext::default()),
        metadata: Map::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::tests::{binding, descriptor};
    use crate::access::{ExistingResources, effective_access};
    use sb_protocol::context::{
        ActorContext, AgentInput, DeliveryContext, InlineMode, SubjectContext,
    };
    use sb_protocol::ids::{EventId, WorkspaceId};
    use serde_json::json;

    fn event(conversation: Option<&str>) -> AgentEventEnvelope {
        AgentEventEnvelope {
            event_id: EventId::new(),
            workspace_id: WorkspaceId::default_workspace(),
            event_type: "message.received".into(),
            event_time: None,
            source: "api".into(),
            source_event_type: Some("chat.message".into()),
            bot_id: Some("bot1".into()),
            conversation_id: conversation.map(Into::into),
            thread_id: Some("t1".into()),
            actor: Some(ActorContext {
                actor_type: "user".into(),
                actor_id: Some("alice".into()),
                actor_name: Some("Alice".into()),
                metadata: Map::new(),
            }),
            subject: Some(SubjectContext {
                subject_type: "message".into(),
                subject_id: Some("m1".into()),
                data: json!({"k": "v"}).as_object().cloned().unwrap(),
            }),
            input: AgentInput {
                text: Some("hi".into()),
                ..Default::default()
            },
            delivery: DeliveryContext {
                supports_streaming: true,
                ..DeliveryContext::new("webui")
            },
            raw_ref: None,
            data: json!({"x": 1}).as_object().cloned().unwrap(),
            metadata: json!({"idempotency_key": "secret-ish"})
                .as_object()
                .cloned()
                .unwrap(),
        }
    }

    #[test]
    fn timeout_rules() {
        let d = Duration::from_secs(300);
        let cfg = |v: Value| v.as_object().cloned().unwrap();
        assert_eq!(run_timeout(&Map::new(), d), Some(d));
        assert_eq!(
            run_timeout(&cfg(json!({"timeout": 30})), d),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            run_timeout(&cfg(json!({"timeout": 1.5})), d),
            Some(Duration::from_millis(1500))
        );
        for none in [
            json!(null),
            json!(0),
            json!(-5),
            json!("30"),
            json!(true),
            json!([30]),
        ] {
            assert_eq!(
                run_timeout(&cfg(json!({ "timeout": none.clone() })), d),
                None,
                "{none}"
            );
        }
        assert_eq!(
            deadline_at(1000.0, Some(Duration::from_secs(300))),
            Some(1300.0)
        );
        assert_eq!(deadline_at(1000.0, None), None);
    }

    #[test]
    fn trigger_sources() {
        assert_eq!(trigger_source("platform"), TriggerSource::Platform);
        assert_eq!(trigger_source("scheduler"), TriggerSource::Scheduler);
        assert_eq!(trigger_source("telegram"), TriggerSource::HostAdapter);
    }

    #[test]
    fn snapshot_respects_policy_and_seeds_conversation_id() {
        let policy = StatePolicy::default(); // conversation + actor
        let mut asked = Vec::new();
        let state = state_snapshot(&policy, Some("c1"), |scope| {
            asked.push(scope);
            Some(json!({"k": scope.as_str()}).as_object().cloned().unwrap())
        });
        assert_eq!(asked, [StateScope::Conversation, StateScope::Actor]);
        assert_eq!(state.conversation["k"], "conversation");
        assert_eq!(state.conversation[EXTERNAL_CONVERSATION_ID], "c1");
        assert_eq!(state.actor["k"], "actor");
        assert!(state.subject.is_empty() && state.runner.is_empty());

        // an existing value is kept
        let state = state_snapshot(&policy, Some("c1"), |_| {
            Some(
                json!({EXTERNAL_CONVERSATION_ID: "ext"})
                    .as_object()
                    .cloned()
                    .unwrap(),
            )
        });
        assert_eq!(state.conversation[EXTERNAL_CONVERSATION_ID], "ext");

        let off = StatePolicy {
            enable_state: false,
            ..StatePolicy::default()
        };
        assert_eq!(
            state_snapshot(&off, Some("c1"), |_| panic!("not loaded")),
            AgentRunState::default()
        );
        let runner_only = StatePolicy {
            enable_state: true,
            state_scopes: vec![StateScope::Runner],
        };
        let s = state_snapshot(&runner_only, Some("c1"), |_| None);
        assert!(
            s.conversation.is_empty(),
            "conversation scope not enabled: nothing seeded"
        );
    }

    #[test]
    fn context_fields() {
        let d = descriptor(
            json!({"history": ["page"], "events": ["get", "page"]}),
            json!({"steering": true}),
            json!([]),
        );
        let b = binding(json!({"timeout": 60, "prompt": "be nice"}), json!({}));
        let e = event(Some("c1"));
        let access = effective_access(&d, &b, true, &ExistingResources::default());
        let run_id = RunId::new();
        let ctx = build(
            &e,
            &b,
            ContextInputs {
                run_id,
                now_epoch_secs: 1_700_000_000.7,
                deadline_at: Some(1_700_000_060.7),
                latest_cursor: Some("42".into()),
                access: access.clone(),
                state: AgentRunState::default(),
                host_version: "0.1.0".into(),
                host_api_token: Some("tok-1".into()),
            },
        );
        assert_eq!(ctx.run_id, run_id);
        assert_eq!(
            ctx.runtime.metadata["host_api"],
            json!({"url": "/v1/host", "token": "tok-1"})
        );
        assert_eq!(ctx.runtime.trace_id, run_id.to_string());
        assert_eq!(ctx.runtime.deadline_at, Some(1_700_000_060.7));
        assert_eq!(ctx.runtime.langbot_version.as_deref(), Some("0.1.0"));
        assert_eq!(ctx.runtime.metadata["streaming_supported"], true);
        assert_eq!(ctx.runtime.metadata["bot_id"], "bot1");
        assert_eq!(ctx.runtime.metadata["workspace_id"], "default");
        assert_eq!(
            ctx.runtime.metadata["model_context_window_tokens"],
            Value::Null
        );
        assert_eq!(ctx.trigger.trigger_type, "message.received");
        assert_eq!(ctx.trigger.source, TriggerSource::Api);
        assert_eq!(
            ctx.trigger.timestamp,
            Some(1_700_000_000),
            "event_time absent: now"
        );
        assert_eq!(ctx.event.event_id, e.event_id.to_string());
        assert_eq!(ctx.event.source_event_type.as_deref(), Some("chat.message"));
        assert_eq!(ctx.event.data["x"], 1);
        let conv = ctx.conversation.as_ref().unwrap();
        assert_eq!(conv.conversation_id.as_deref(), Some("c1"));
        assert_eq!(conv.thread_id.as_deref(), Some("t1"));
        assert_eq!(conv.sender_id.as_deref(), Some("alice"));
        assert_eq!(conv.workspace_id.as_deref(), Some("default"));
        assert!(conv.session_id.is_none() && conv.launcher_type.is_none());
        assert_eq!(ctx.subject.as_ref().unwrap().data["k"], "v");
        assert_eq!(ctx.input.text.as_deref(), Some("hi"));
        assert_eq!(ctx.context.latest_cursor.as_deref(), Some("42"));
        assert_eq!(ctx.context.transcript_seq, Some(42));
        assert!(ctx.context.has_history_before);
        assert_eq!(ctx.context.event_seq, None);
        assert_eq!(ctx.context.inline_policy.mode, InlineMode::CurrentEvent);
        assert_eq!(
            ctx.context.inline_policy.reason.as_deref(),
            Some("current_event_only")
        );
        assert_eq!(ctx.context.available_apis, access.available_apis);
        assert!(
            ctx.context.available_apis.steering_pull && ctx.context.available_apis.history_page
        );
        assert_eq!(ctx.config["prompt"], "be nice");
        assert_eq!(ctx.adapter, Some(AdapterContext::default()));
        assert!(ctx.metadata.is_empty());

        // no inline history and no host metadata leak in the wire form
        let json = serde_json::to_value(&ctx).unwrap();
        for forbidden in ["messages", "bootstrap", "history"] {
            assert!(json.get(forbidden).is_none(), "{forbidden}");
        }
        assert!(!json.to_string().contains("secret-ish"));
        let back: AgentRunContext = serde_json::from_value(json).unwrap();
        assert_eq!(back, ctx);
    }

    #[test]
    fn context_without_conversation_or_cursor() {
        let d = descriptor(
            json!({"history": ["page"]}),
            json!({"steering": true}),
            json!([]),
        );
        let b = binding(json!({}), json!({}));
        let mut e = event(None);
        e.event_time = Some(123);
        let access = effective_access(&d, &b, false, &ExistingResources::default());
        let ctx = build(
            &e,
            &b,
            ContextInputs {
                run_id: RunId::new(),
                now_epoch_secs: 1000.0,
                deadline_at: None,
                latest_cursor: Some(String::new()),
                access,
                state: AgentRunState::default(),
                host_version: "0.1.0".into(),
                host_api_token: None,
            },
        );
        assert!(ctx.conversation.is_none());
        assert!(!ctx.runtime.metadata.contains_key("host_api"));
        assert_eq!(ctx.trigger.timestamp, Some(123));
        assert_eq!(ctx.context.latest_cursor, None);
        assert!(!ctx.context.has_history_before);
        assert_eq!(ctx.context.transcript_seq, None);
        assert!(
            !ctx.context.available_apis.history_page && !ctx.context.available_apis.steering_pull
        );
        assert_eq!(ctx.runtime.deadline_at, None);
    }
}
