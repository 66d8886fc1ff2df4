//! Binding resolution: which single Agent handles an event (SPEC §5, host-behaviour §6).
//!
//! [`resolve`] is pure: it sees the event and the workspace's agents, nothing else.
//!
//! An agent is a *candidate* when, in this order:
//! 1. it belongs to the event's workspace and is `enabled`;
//! 2. its `event_types` list the event's type;
//! 3. every field set in its [`AgentScope`] equals the event's (`bot_id`, `channel` = the
//!    event's delivery surface, `conversation_id`, `actor_id`);
//! 4. every one of its [`EventFilter`]s holds on the event.
//!
//! Only agents routed by scope ([`AgentRouting::Scope`], the default) are candidates: a
//! `direct` agent is reached only when the event names it.
//!
//! Among candidates the most specific scope wins (conversation > actor > channel > bot >
//! workspace, [`ScopeSpecificity`]). Two or more candidates at the winning level are
//! **ambiguous**: the event is unrouted, never fanned out (PROTOCOL_V1 §13) and never
//! decided by an arbitrary order. No candidate at all is **not found**.
//!
//! # Explicit targets
//!
//! An event that names its agent (`agent_id` on `POST /v1/events`, or a turn of a session,
//! whose agent is fixed at creation) skips scope resolution ([`resolve_target`]): the named
//! agent handles it whatever the scopes, the filters and its routing say, so a second
//! agent in scope can never win or make the event ambiguous. It must still be of the
//! event's workspace, enabled and subscribed to the event type; otherwise the event is
//! unrouted as **target unavailable** (the gateway checked all this at ingest; this covers
//! an agent disabled or deleted since).
//!
//! # Conflicts
//!
//! [`conflicts`] is the resolver's ambiguity rule seen from the API: two agents conflict
//! when some event could find both as its most specific candidates. Direct agents are never
//! candidates, so they conflict with nothing: any number of them coexist beside one
//! workspace-wide agent.
//!
//! # Filters
//!
//! A filter is `{"field": "<dotted path>", "op": "<op>", "value": <json>}` evaluated on the
//! event envelope's JSON (e.g. `event_type`, `source`, `bot_id`, `actor.actor_type`,
//! `delivery.surface`, `input.text`, `data.<key>`). Ops:
//!
//! | op | holds when |
//! | --- | --- |
//! | `eq` (default) / `ne` | the field equals / does not equal `value` (a missing field is `null`) |
//! | `in` / `not_in` | the field is / is not one of the `value` array |
//! | `exists` | the field is present and not `null` (`value: false` inverts) |
//! | `prefix` | the field is a string starting with the `value` string |
//! | `contains` | the field is a string containing the `value` string, or an array containing `value` |
//!
//! Filters live on the stored agent (`agents.filters`); [`AgentCandidate::from_row`] decodes
//! a row into the protocol's [`AgentConfig`] plus its filters. An agent whose filters do not
//! parse never matches (fail closed) and the reason is logged.

use sb_protocol::host::{
    AgentBinding, AgentConfig, AgentEventEnvelope, AgentScope, BudgetOverrides, DeliveryPolicy,
    ResourcePolicy, ScopeSpecificity, StatePolicy,
};
use sb_protocol::ids::AgentId;
use sb_store::{AgentRouting, AgentRow};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The outcome of binding resolution.
#[derive(Debug, Clone, PartialEq)]
pub enum Resolution {
    /// Exactly one agent wins.
    Matched(Box<AgentBinding>),
    /// No agent handles the event.
    NotFound,
    /// Several agents tie at the most specific level; their binding ids, sorted.
    Ambiguous(Vec<String>),
    /// The event names an agent that cannot handle it (another workspace, disabled,
    /// deleted, or not subscribed to the event type).
    TargetUnavailable(AgentId),
}

/// One predicate on the event (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventFilter {
    /// Dotted path into the event envelope's JSON.
    pub field: String,
    /// Comparison.
    #[serde(default)]
    pub op: FilterOp,
    /// Operand.
    #[serde(default)]
    pub value: Value,
}

/// Filter comparisons.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FilterOp {
    /// Equal.
    #[default]
    Eq,
    /// Not equal.
    Ne,
    /// One of an array.
    In,
    /// None of an array.
    NotIn,
    /// Present and not null.
    Exists,
    /// String prefix.
    Prefix,
    /// Substring, or array element.
    Contains,
}

/// Why a filter is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    /// `metadata.filters` is not a list of filter objects.
    #[error("invalid filters: {0}")]
    Parse(String),
    /// The field path is empty or has an empty segment.
    #[error("filter field {0:?} is not a dotted path")]
    Field(String),
    /// The operand does not fit the op.
    #[error("filter on {field:?}: op {op:?} needs {expected}")]
    Operand {
        /// Field path.
        field: String,
        /// The op.
        op: FilterOp,
        /// What the value must be.
        expected: &'static str,
    },
}

impl EventFilter {
    /// Checks the shape: a non-empty dotted path and an operand that fits the op.
    pub fn validate(&self) -> Result<(), FilterError> {
        if self.field.is_empty() || self.field.split('.').any(str::is_empty) {
            return Err(FilterError::Field(self.field.clone()));
        }
        let expected = match self.op {
            FilterOp::In | FilterOp::NotIn if !self.value.is_array() => "an array",
            FilterOp::Prefix if !self.value.is_string() => "a string",
            FilterOp::Exists if !(self.value.is_null() || self.value.is_boolean()) => {
                "a boolean or nothing"
            }
            _ => return Ok(()),
        };
        Err(FilterError::Operand {
            field: self.field.clone(),
            op: self.op,
            expected,
        })
    }

    /// Whether the filter holds on `event` (the envelope as JSON).
    #[must_use]
    pub fn matches(&self, event: &Value) -> bool {
        let field = self.field.split('.').try_fold(event, |v, seg| v.get(seg));
        let field_or_null = field.unwrap_or(&Value::Null);
        match self.op {
            FilterOp::Eq => *field_or_null == self.value,
            FilterOp::Ne => *field_or_null != self.value,
            FilterOp::In => self
                .value
                .as_array()
                .is_some_and(|values| values.contains(field_or_null)),
            FilterOp::NotIn => self
                .value
                .as_array()
                .is_some_and(|values| !values.contains(field_or_null)),
            FilterOp::Exists => {
                let present = !field_or_null.is_null();
                present == self.value.as_bool().unwrap_or(true)
            }
            FilterOp::Prefix => match (field_or_null.as_str(), self.value.as_str()) {
                (Some(s), Some(p)) => s.starts_with(p),
                _ => false,
            },
            FilterOp::Contains => match field_or_null {
                Value::String(s) => self.value.as_str().is_some_and(|needle| s.contains(needle)),
                Value::Array(items) => items.contains(&self.value),
                _ => false,
            },
        }
    }
}

/// An agent as the resolver sees it: the protocol's [`AgentConfig`] and its filters (or why
/// they are unusable).
#[derive(Debug, Clone, PartialEq)]
pub struct AgentCandidate {
    /// The agent.
    pub config: AgentConfig,
    /// Its filters; an error makes the agent never match.
    pub filters: Result<Vec<EventFilter>, FilterError>,
    /// How it is reached: a `direct` agent is never a scope candidate.
    pub routing: AgentRouting,
}

/// Why a stored agent row cannot be used at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("agent {agent_id} is invalid: {reason}")]
pub struct AgentRowError {
    /// The agent.
    pub agent_id: String,
    /// What does not decode.
    pub reason: String,
}

fn json_or_default<T: serde::de::DeserializeOwned + Default>(
    v: &Value,
    field: &str,
) -> Result<T, String> {
    if v.is_null() {
        return Ok(T::default());
    }
    serde_json::from_value(v.clone()).map_err(|e| format!("{field}: {e}"))
}

impl AgentCandidate {
    /// A scope-routed agent from its configuration and filters.
    #[must_use]
    pub fn new(config: AgentConfig, filters: Vec<EventFilter>) -> Self {
        let filters = filters
            .iter()
            .try_for_each(EventFilter::validate)
            .map(|()| filters);
        Self {
            config,
            filters,
            routing: AgentRouting::Scope,
        }
    }

    /// The same agent, reached as `routing` says.
    #[must_use]
    pub fn with_routing(mut self, routing: AgentRouting) -> Self {
        self.routing = routing;
        self
    }

    /// Decodes a stored agent. Filters that do not decode are kept as an error (the agent
    /// then never matches); anything else that does not decode rejects the row.
    pub fn from_row(row: &AgentRow) -> Result<Self, AgentRowError> {
        let err = |reason: String| AgentRowError {
            agent_id: row.id.to_string(),
            reason,
        };
        let runner_id = row
            .runner_id
            .parse()
            .map_err(|e| err(format!("runner_id: {e}")))?;
        let runner_config = match &row.runner_config {
            Value::Null => serde_json::Map::new(),
            Value::Object(m) => m.clone(),
            _ => return Err(err("runner_config: expected an object".into())),
        };
        let event_types: Vec<String> = if row.event_types.is_null() {
            vec![sb_protocol::host::event_types::MESSAGE_RECEIVED.to_owned()]
        } else {
            serde_json::from_value(row.event_types.clone())
                .map_err(|e| err(format!("event_types: {e}")))?
        };
        let config = AgentConfig {
            agent_id: Some(row.id),
            workspace_id: row.workspace_id.clone(),
            runner_id,
            runner_config,
            scope: json_or_default::<AgentScope>(&row.scope, "scope").map_err(err)?,
            resource_policy: json_or_default::<ResourcePolicy>(
                &row.resource_policy,
                "resource_policy",
            )
            .map_err(err)?,
            state_policy: json_or_default::<StatePolicy>(&row.state_policy, "state_policy")
                .map_err(err)?,
            delivery_policy: json_or_default::<DeliveryPolicy>(
                &row.delivery_policy,
                "delivery_policy",
            )
            .map_err(err)?,
            // The row holds only the overrides; a budget it leaves out keeps the default.
            budgets: json_or_default::<BudgetOverrides>(&row.budgets, "budgets").map_err(err)?,
            event_types,
            enabled: row.enabled,
            metadata: serde_json::Map::new(),
        };
        let filters = json_or_default::<Vec<EventFilter>>(&row.filters, "filters")
            .map_err(FilterError::Parse)
            .and_then(|f| f.iter().try_for_each(EventFilter::validate).map(|()| f));
        Ok(Self {
            config,
            filters,
            routing: row.routing,
        })
    }
}

/// Whether every set field of `scope` equals the event's.
#[must_use]
pub fn scope_matches(scope: &AgentScope, event: &AgentEventEnvelope) -> bool {
    fn eq(want: Option<&String>, have: Option<&str>) -> bool {
        want.is_none_or(|w| have == Some(w.as_str()))
    }
    eq(scope.bot_id.as_ref(), event.bot_id.as_deref())
        && eq(
            scope.channel.as_ref(),
            Some(event.delivery.surface.as_str()),
        )
        && eq(
            scope.conversation_id.as_ref(),
            event.conversation_id.as_deref(),
        )
        && eq(
            scope.actor_id.as_ref(),
            event.actor.as_ref().and_then(|a| a.actor_id.as_deref()),
        )
}

/// Why one agent is not a candidate (for debug logs and tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// Reachable only directly.
    Direct,
    /// Other workspace.
    Workspace,
    /// Disabled.
    Disabled,
    /// Event type not handled.
    EventType,
    /// Scope does not match.
    Scope,
    /// A filter does not hold.
    Filter,
    /// The filters are malformed.
    BadFilters(FilterError),
}

/// Whether `agent` is a candidate for `event` (whose JSON is `event_json`), or why not.
pub fn candidate(
    candidate: &AgentCandidate,
    event: &AgentEventEnvelope,
    event_json: &Value,
) -> Result<(), Rejection> {
    let agent = &candidate.config;
    if candidate.routing == AgentRouting::Direct {
        return Err(Rejection::Direct);
    }
    if agent.workspace_id != event.workspace_id {
        return Err(Rejection::Workspace);
    }
    if !agent.enabled {
        return Err(Rejection::Disabled);
    }
    if !agent.event_types.contains(&event.event_type) {
        return Err(Rejection::EventType);
    }
    if !scope_matches(&agent.scope, event) {
        return Err(Rejection::Scope);
    }
    let filters = candidate
        .filters
        .as_ref()
        .map_err(|e| Rejection::BadFilters(e.clone()))?;
    if !filters.iter().all(|f| f.matches(event_json)) {
        return Err(Rejection::Filter);
    }
    Ok(())
}

/// Picks the one agent that handles `event` (see the module docs for the rules).
#[must_use]
pub fn resolve(event: &AgentEventEnvelope, agents: &[AgentCandidate]) -> Resolution {
    let event_json = serde_json::to_value(event).unwrap_or(Value::Null);
    let mut best: Option<ScopeSpecificity> = None;
    let mut winners: Vec<&AgentConfig> = Vec::new();
    for entry in agents {
        let agent = &entry.config;
        match candidate(entry, event, &event_json) {
            Ok(()) => {}
            Err(Rejection::BadFilters(error)) => {
                tracing::warn!(
                    agent_id = ?agent.agent_id,
                    %error,
                    "agent has malformed filters and never matches"
                );
                continue;
            }
            Err(_) => continue,
        }
        let level = agent.scope.specificity();
        match best {
            Some(b) if level < b => {}
            Some(b) if level == b => winners.push(agent),
            _ => {
                best = Some(level);
                winners.clear();
                winners.push(agent);
            }
        }
    }
    match winners.as_slice() {
        [] => Resolution::NotFound,
        [one] => Resolution::Matched(Box::new(AgentBinding::from_config(one))),
        many => {
            let mut ids: Vec<String> = many
                .iter()
                .map(|a| AgentBinding::binding_id_for(a.agent_id.as_ref(), &a.runner_id))
                .collect();
            ids.sort();
            Resolution::Ambiguous(ids)
        }
    }
}

/// Picks the agent the event names (`agent_id`), ignoring scopes, filters and routing (see
/// "Explicit targets" in the module docs): the agent must be of the event's workspace,
/// enabled and subscribed to its event type, else the event's target is unavailable.
#[must_use]
pub fn resolve_target(
    event: &AgentEventEnvelope,
    agents: &[AgentCandidate],
    agent_id: &AgentId,
) -> Resolution {
    agents
        .iter()
        .map(|entry| &entry.config)
        .find(|agent| {
            agent.agent_id.as_ref() == Some(agent_id)
                && agent.workspace_id == event.workspace_id
                && agent.enabled
                && agent.event_types.contains(&event.event_type)
        })
        .map_or(Resolution::TargetUnavailable(*agent_id), |agent| {
            Resolution::Matched(Box::new(AgentBinding::from_config(agent)))
        })
}

/// Resolves `event`: to the agent it names when `target` is set ([`resolve_target`]),
/// else by scope ([`resolve`]).
#[must_use]
pub fn resolve_event(
    event: &AgentEventEnvelope,
    agents: &[AgentCandidate],
    target: Option<&AgentId>,
) -> Resolution {
    match target {
        Some(agent_id) => resolve_target(event, agents, agent_id),
        None => resolve(event, agents),
    }
}

/// Whether two agents could both be the most specific match for some event, which makes
/// that event ambiguous. The API uses this to refuse creating such an agent (409). A
/// `direct` agent is never a scope candidate, so it conflicts with nothing.
///
/// Conservative about filters: two agents that differ only in filters still conflict,
/// because whether two predicates can hold together is not decided here.
#[must_use]
pub fn conflicts(a: &AgentCandidate, b: &AgentCandidate) -> bool {
    a.routing == AgentRouting::Scope
        && b.routing == AgentRouting::Scope
        && scopes_conflict(&a.config, &b.config)
}

/// [`conflicts`] between two scope-routed agents.
fn scopes_conflict(a: &AgentConfig, b: &AgentConfig) -> bool {
    a.workspace_id == b.workspace_id
        && a.enabled
        && b.enabled
        && a.event_types.iter().any(|t| b.event_types.contains(t))
        && a.scope.specificity() == b.scope.specificity()
        && field_overlap(a.scope.bot_id.as_ref(), b.scope.bot_id.as_ref())
        && field_overlap(a.scope.channel.as_ref(), b.scope.channel.as_ref())
        && field_overlap(a.scope.actor_id.as_ref(), b.scope.actor_id.as_ref())
        && field_overlap(
            a.scope.conversation_id.as_ref(),
            b.scope.conversation_id.as_ref(),
        )
}

/// Two scope fields can both match one event: either is unset, or they are equal.
fn field_overlap(x: Option<&String>, y: Option<&String>) -> bool {
    match (x, y) {
        (Some(x), Some(y)) => x == y,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sb_protocol::context::{ActorContext, AgentInput, DeliveryContext};
    use sb_protocol::ids::{AgentId, EventId, WorkspaceId};
    use serde_json::json;

    fn event() -> AgentEventEnvelope {
        AgentEventEnvelope {
            event_id: EventId::new(),
            workspace_id: WorkspaceId::default_workspace(),
            event_type: "message.received".into(),
            event_time: Some(1_700_000_000),
            source: "api".into(),
            source_event_type: None,
            bot_id: Some("bot1".into()),
            conversation_id: Some("conv1".into()),
            thread_id: None,
            actor: Some(ActorContext {
                actor_type: "user".into(),
                actor_id: Some("alice".into()),
                actor_name: None,
                metadata: Default::default(),
            }),
            subject: None,
            input: AgentInput {
                text: Some("hello there".into()),
                ..Default::default()
            },
            delivery: DeliveryContext::new("telegram"),
            raw_ref: None,
            data: json!({"chat_type": "group", "tags": ["vip", "beta"]})
                .as_object()
                .cloned()
                .unwrap(),
            metadata: Default::default(),
        }
    }

    fn agent(scope: AgentScope) -> AgentCandidate {
        AgentCandidate::new(config(scope), Vec::new())
    }

    fn config(scope: AgentScope) -> AgentConfig {
        AgentConfig {
            agent_id: Some(AgentId::new()),
            workspace_id: WorkspaceId::default_workspace(),
            runner_id: "plugin:acme/echo/default".parse().unwrap(),
            runner_config: Default::default(),
            scope,
            resource_policy: Default::default(),
            state_policy: Default::default(),
            delivery_policy: Default::default(),
            budgets: Default::default(),
            event_types: vec!["message.received".into()],
            enabled: true,
            metadata: Default::default(),
        }
    }

    fn scope(
        bot: Option<&str>,
        channel: Option<&str>,
        actor: Option<&str>,
        conv: Option<&str>,
    ) -> AgentScope {
        AgentScope {
            bot_id: bot.map(Into::into),
            channel: channel.map(Into::into),
            conversation_id: conv.map(Into::into),
            actor_id: actor.map(Into::into),
        }
    }

    fn matched_id(r: &Resolution) -> Option<AgentId> {
        match r {
            Resolution::Matched(b) => b.agent_id,
            _ => None,
        }
    }

    #[test]
    fn a_named_agent_wins_over_scopes_but_must_be_enabled_and_subscribed() {
        // Two workspace-wide agents (ambiguous by scope) and one scoped elsewhere.
        let a = agent(AgentScope::default());
        let b = agent(AgentScope::default());
        let elsewhere = agent(scope(None, None, None, Some("other-conv")));
        let agents = [a.clone(), b, elsewhere.clone()];
        assert!(matches!(
            resolve(&event(), &agents),
            Resolution::Ambiguous(_)
        ));
        let pinned = |id: &AgentCandidate, agents: &[AgentCandidate]| {
            matched_id(&resolve_target(
                &event(),
                agents,
                id.config.agent_id.as_ref().unwrap(),
            ))
        };
        assert_eq!(pinned(&a, &agents), a.config.agent_id);
        assert_eq!(pinned(&elsewhere, &agents), elsewhere.config.agent_id);

        let mut disabled = a.clone();
        disabled.config.enabled = false;
        assert_eq!(pinned(&a, std::slice::from_ref(&disabled)), None);
        let mut unsubscribed = a.clone();
        unsubscribed.config.event_types = vec!["message.recalled".into()];
        assert_eq!(pinned(&a, std::slice::from_ref(&unsubscribed)), None);
        let mut foreign = a.clone();
        foreign.config.workspace_id = WorkspaceId::new("other").unwrap();
        assert_eq!(pinned(&a, std::slice::from_ref(&foreign)), None);
        assert_eq!(pinned(&a, &[]), None);
    }

    #[test]
    fn single_workspace_agent_matches_and_projects_a_binding() {
        let a = agent(AgentScope::default());
        let r = resolve(&event(), std::slice::from_ref(&a));
        let Resolution::Matched(b) = r else {
            panic!("{r:?}")
        };
        assert_eq!(b.agent_id, a.config.agent_id);
        assert_eq!(
            b.binding_id,
            format!(
                "agent_{}_plugin:acme/echo/default",
                a.config.agent_id.unwrap()
            )
        );
    }

    #[test]
    fn nothing_matches_gives_not_found() {
        assert_eq!(resolve(&event(), &[]), Resolution::NotFound);
        let mut disabled = agent(AgentScope::default());
        disabled.config.enabled = false;
        let mut other_type = agent(AgentScope::default());
        other_type.config.event_types = vec!["group.member_joined".into()];
        let mut other_ws = agent(AgentScope::default());
        other_ws.config.workspace_id = WorkspaceId::new("other").unwrap();
        let other_bot = agent(scope(Some("bot2"), None, None, None));
        let other_conv = agent(scope(None, None, None, Some("conv2")));
        let other_channel = agent(scope(None, Some("slack"), None, None));
        let other_actor = agent(scope(None, None, Some("bob"), None));
        let agents = [
            disabled,
            other_type,
            other_ws,
            other_bot,
            other_conv,
            other_channel,
            other_actor,
        ];
        assert_eq!(resolve(&event(), &agents), Resolution::NotFound);
        let e = event();
        let j = serde_json::to_value(&e).unwrap();
        let reasons: Vec<_> = agents
            .iter()
            .map(|a| candidate(a, &e, &j).unwrap_err())
            .collect();
        assert_eq!(
            reasons,
            [
                Rejection::Disabled,
                Rejection::EventType,
                Rejection::Workspace,
                Rejection::Scope,
                Rejection::Scope,
                Rejection::Scope,
                Rejection::Scope
            ]
        );
    }

    #[test]
    fn most_specific_scope_wins() {
        let ws = agent(AgentScope::default());
        let bot = agent(scope(Some("bot1"), None, None, None));
        let channel = agent(scope(Some("bot1"), Some("telegram"), None, None));
        let actor = agent(scope(None, None, Some("alice"), None));
        let conv = agent(scope(None, None, None, Some("conv1")));
        let all = [
            ws.clone(),
            bot.clone(),
            channel.clone(),
            actor.clone(),
            conv.clone(),
        ];
        // remove the most specific one at a time: the next level wins
        for (i, expected) in [&conv, &actor, &channel, &bot, &ws].into_iter().enumerate() {
            let pool = &all[..all.len() - i];
            assert_eq!(
                matched_id(&resolve(&event(), pool)),
                expected.config.agent_id,
                "level {i}"
            );
        }
        // order of the input does not matter
        let mut reversed = all.to_vec();
        reversed.reverse();
        assert_eq!(
            matched_id(&resolve(&event(), &reversed)),
            conv.config.agent_id
        );
    }

    #[test]
    fn tie_at_the_winning_level_is_ambiguous() {
        let a = agent(scope(Some("bot1"), None, None, None));
        let b = agent(scope(Some("bot1"), None, None, None));
        let ws = agent(AgentScope::default());
        let r = resolve(&event(), &[a.clone(), ws.clone(), b.clone()]);
        let Resolution::Ambiguous(ids) = r else {
            panic!("{r:?}")
        };
        let mut expected = vec![
            AgentBinding::from_config(&a.config).binding_id,
            AgentBinding::from_config(&b.config).binding_id,
        ];
        expected.sort();
        assert_eq!(ids, expected);
        // a tie below a unique more specific match is not ambiguous
        let conv = agent(scope(None, None, None, Some("conv1")));
        assert_eq!(
            matched_id(&resolve(&event(), &[a, b, conv.clone(), ws])),
            conv.config.agent_id
        );
    }

    #[test]
    fn filters_narrow_candidates() {
        let filter = |v: Value| -> Vec<EventFilter> { serde_json::from_value(v).unwrap() };
        let group_only = AgentCandidate::new(
            config(AgentScope::default()),
            filter(json!([{"field": "data.chat_type", "op": "eq", "value": "group"}])),
        );
        let private_only = AgentCandidate::new(
            config(AgentScope::default()),
            filter(json!([{"field": "data.chat_type", "value": "private"}])),
        );
        assert_eq!(
            matched_id(&resolve(&event(), &[group_only.clone(), private_only])),
            group_only.config.agent_id
        );
        // a malformed filter never matches
        let broken = AgentCandidate::new(
            config(AgentScope::default()),
            filter(json!([{"field": "x", "op": "in", "value": "nope"}])),
        );
        assert!(broken.filters.is_err());
        assert_eq!(resolve(&event(), &[broken]), Resolution::NotFound);
    }

    #[test]
    fn candidates_from_rows() {
        let now = chrono::Utc::now();
        let row = AgentRow {
            id: AgentId::new(),
            workspace_id: WorkspaceId::default_workspace(),
            name: "a".into(),
            description: None,
            runner_id: "plugin:acme/echo/default".into(),
            runner_config: json!({"timeout": 5}),
            event_types: json!(["message.received", "message.recalled"]),
            scope: json!({"bot_id": "bot1"}),
            bot_id: Some("bot1".into()),
            channel: None,
            conversation_id: None,
            actor_id: None,
            filters: json!([{"field": "source", "value": "api"}]),
            resource_policy: json!({"allowed_tool_names": ["t"]}),
            state_policy: Value::Null,
            delivery_policy: json!({}),
            budgets: json!({"max_tool_calls": 1, "max_model_output_chars": 0}),
            enabled: true,
            routing: sb_store::AgentRouting::Scope,
            created_at: now,
            updated_at: now,
        };
        let c = AgentCandidate::from_row(&row).unwrap();
        assert_eq!(c.config.agent_id, Some(row.id));
        // Overrides replace their budget; the others keep the defaults.
        assert_eq!(
            c.config.budgets,
            BudgetOverrides {
                max_tool_calls: Some(1),
                max_model_output_chars: Some(0),
                ..BudgetOverrides::default()
            }
        );
        assert_eq!(
            AgentBinding::from_config(&c.config).budgets,
            c.config.budgets
        );
        for none in [json!({}), Value::Null] {
            let c = AgentCandidate::from_row(&AgentRow {
                budgets: none,
                ..row.clone()
            })
            .unwrap();
            assert_eq!(c.config.budgets, BudgetOverrides::default());
        }
        assert_eq!(c.config.scope.bot_id.as_deref(), Some("bot1"));
        assert_eq!(c.config.runner_config["timeout"], 5);
        assert_eq!(c.config.event_types.len(), 2);
        assert_eq!(c.config.state_policy, StatePolicy::default());
        assert_eq!(
            c.config.resource_policy.allowed_tool_names,
            Some(vec!["t".to_owned()])
        );
        assert_eq!(c.filters.as_ref().unwrap().len(), 1);
        assert_eq!(
            matched_id(&resolve(&event(), std::slice::from_ref(&c))),
            Some(row.id)
        );

        let bad_filters = AgentRow {
            filters: json!({"not": "a list"}),
            ..row.clone()
        };
        let c = AgentCandidate::from_row(&bad_filters).unwrap();
        assert!(matches!(c.filters, Err(FilterError::Parse(_))));
        assert_eq!(resolve(&event(), &[c]), Resolution::NotFound);

        let bad_runner = AgentRow {
            runner_id: "builtin:x".into(),
            ..row.clone()
        };
        assert!(AgentCandidate::from_row(&bad_runner).is_err());
        let bad_policy = AgentRow {
            state_policy: json!({"state_scopes": ["galaxy"]}),
            ..row.clone()
        };
        let e = AgentCandidate::from_row(&bad_policy).unwrap_err();
        assert!(e.reason.starts_with("state_policy"), "{e}");
        // An unreadable override rejects the row rather than running on the defaults.
        let bad_budgets = AgentRow {
            budgets: json!({"max_tool_calls": -1}),
            ..row
        };
        let e = AgentCandidate::from_row(&bad_budgets).unwrap_err();
        assert!(e.reason.starts_with("budgets"), "{e}");
    }

    #[test]
    fn filter_ops() {
        let j = serde_json::to_value(event()).unwrap();
        let f = |field: &str, op: FilterOp, value: Value| EventFilter {
            field: field.into(),
            op,
            value,
        };
        let holds = [
            f("event_type", FilterOp::Eq, json!("message.received")),
            f("source", FilterOp::Ne, json!("platform")),
            f("actor.actor_type", FilterOp::In, json!(["user", "admin"])),
            f("bot_id", FilterOp::NotIn, json!(["bot9"])),
            f("conversation_id", FilterOp::Exists, Value::Null),
            f("thread_id", FilterOp::Exists, json!(false)),
            f("data.missing", FilterOp::Eq, Value::Null),
            f("input.text", FilterOp::Prefix, json!("hello")),
            f("input.text", FilterOp::Contains, json!("o th")),
            f("data.tags", FilterOp::Contains, json!("vip")),
            f("delivery.surface", FilterOp::Eq, json!("telegram")),
        ];
        for filter in &holds {
            assert!(filter.validate().is_ok(), "{filter:?}");
            assert!(filter.matches(&j), "{filter:?}");
        }
        let fails = [
            f("event_type", FilterOp::Eq, json!("message.recalled")),
            f("actor.actor_type", FilterOp::In, json!(["admin"])),
            f("thread_id", FilterOp::Exists, Value::Null),
            f("input.text", FilterOp::Prefix, json!("bye")),
            f("data.tags", FilterOp::Contains, json!("alpha")),
            f("data.chat_type.deeper", FilterOp::Exists, json!(true)),
            f("bot_id", FilterOp::Contains, json!(1)),
        ];
        for filter in &fails {
            assert!(!filter.matches(&j), "{filter:?}");
        }
        assert!(f("", FilterOp::Eq, json!(1)).validate().is_err());
        assert!(f("a..b", FilterOp::Eq, json!(1)).validate().is_err());
        assert!(f("a", FilterOp::Prefix, json!(1)).validate().is_err());
        assert!(f("a", FilterOp::Exists, json!("yes")).validate().is_err());
        assert!(
            serde_json::from_value::<EventFilter>(json!({"field": "a", "op": "regex"})).is_err()
        );
        assert!(serde_json::from_value::<EventFilter>(json!({"field": "a", "extra": 1})).is_err());
    }

    #[test]
    fn conflict_detection() {
        let bot1 = agent(scope(Some("bot1"), None, None, None));
        let bot1b = agent(scope(Some("bot1"), None, None, None));
        let bot2 = agent(scope(Some("bot2"), None, None, None));
        let ws = agent(AgentScope::default());
        assert!(conflicts(&bot1, &bot1b));
        assert!(
            !conflicts(&bot1, &bot2),
            "different bots never match one event"
        );
        assert!(
            !conflicts(&bot1, &ws),
            "different levels are ordered, not ambiguous"
        );
        let mut other_type = bot1b.clone();
        other_type.config.event_types = vec!["message.recalled".into()];
        assert!(!conflicts(&bot1, &other_type));
        let conv_a = agent(scope(Some("bot1"), None, None, Some("c")));
        let conv_b = agent(scope(None, None, None, Some("c")));
        assert!(
            conflicts(&conv_a, &conv_b),
            "both can match an event of bot1 in c"
        );
        let conv_c = agent(scope(None, None, None, Some("d")));
        assert!(!conflicts(&conv_a, &conv_c));
    }

    #[test]
    fn direct_agents_conflict_with_nothing_and_are_never_scope_candidates() {
        let ws = agent(AgentScope::default());
        let direct = |a: AgentCandidate| a.with_routing(AgentRouting::Direct);
        let d1 = direct(agent(AgentScope::default()));
        let d2 = direct(agent(AgentScope::default()));
        let ws2 = agent(AgentScope::default());
        // Two workspace-wide scope agents tie; a direct one beside either does not.
        assert!(conflicts(&ws, &ws2));
        assert!(!conflicts(&ws, &d1));
        assert!(!conflicts(&d1, &ws));
        assert!(!conflicts(&d1, &d2), "any number of direct agents coexist");

        // Scope resolution ignores direct agents: the scope agent wins alone, and with only
        // direct agents nothing matches.
        let all = [d1.clone(), ws.clone(), d2.clone()];
        assert_eq!(matched_id(&resolve(&event(), &all)), ws.config.agent_id);
        assert_eq!(
            resolve(&event(), &[d1.clone(), d2.clone()]),
            Resolution::NotFound
        );
        let e = event();
        let j = serde_json::to_value(&e).unwrap();
        assert_eq!(candidate(&d1, &e, &j), Err(Rejection::Direct));

        // Named explicitly, a direct agent handles the event; so does the scope agent.
        let d1_id = d1.config.agent_id.unwrap();
        assert_eq!(
            matched_id(&resolve_event(&event(), &all, Some(&d1_id))),
            Some(d1_id)
        );
        assert_eq!(
            matched_id(&resolve_event(&event(), &all, ws.config.agent_id.as_ref())),
            ws.config.agent_id
        );
        assert_eq!(
            matched_id(&resolve_event(&event(), &all, None)),
            ws.config.agent_id
        );
        // A target that is not there is unavailable, not "not found" by scope.
        let ghost = AgentId::new();
        assert_eq!(
            resolve_event(&event(), &all, Some(&ghost)),
            Resolution::TargetUnavailable(ghost)
        );
    }
}
