//! What the resource routes share: URL and secret checks, the referrer check, PATCH merging.

use sb_protocol::error::ErrorCode;
use sb_store::StoreError;
use serde_json::{Map, Value};

use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use sb_store::agents::AgentRow;

/// Refuses a URL the deployment's egress policy refuses, naming the field.
pub(super) fn check_egress(state: &AppState, field: &'static str, url: &str) -> ApiResult<()> {
    state
        .options()
        .providers
        .egress
        .check_url(field, url)
        .map(drop)
        .map_err(|e| ApiError::invalid(e.to_string()))
}

/// Refuses a secret reference the deployment does not make available, naming the field.
pub(super) fn check_secret(state: &AppState, field: &str, name: &str) -> ApiResult<()> {
    state
        .options()
        .providers
        .secrets
        .check(name)
        .map_err(|e| ApiError::invalid(format!("{field}: {e}")))
}

/// What an agent refers to, for the referrer check of deletes and tool renames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reference<'a> {
    /// A model, by id.
    Model(&'a str),
    /// A tool, by name.
    Tool(&'a str),
    /// A knowledge base, by id.
    KnowledgeBase(&'a str),
}

/// `true` when `value` holds the string `needle` anywhere (object values, array items).
fn mentions(value: &Value, needle: &str) -> bool {
    match value {
        Value::String(s) => s == needle,
        Value::Array(items) => items.iter().any(|v| mentions(v, needle)),
        Value::Object(map) => map.values().any(|v| mentions(v, needle)),
        _ => false,
    }
}

/// The names of the `agents` that refer to `reference` (pure; see the module docs): a tool
/// through `resource_policy.allowed_tool_names`; a model or knowledge base through its id
/// anywhere in `resource_policy` or `runner_config` (ids are UUIDs, so a match is a
/// reference, never a coincidence).
#[must_use]
pub fn referrers(agents: &[AgentRow], reference: Reference<'_>) -> Vec<String> {
    agents
        .iter()
        .filter(|agent| match reference {
            Reference::Tool(name) => agent
                .resource_policy
                .get("allowed_tool_names")
                .is_some_and(|names| mentions(names, name)),
            Reference::Model(id) | Reference::KnowledgeBase(id) => {
                mentions(&agent.resource_policy, id) || mentions(&agent.runner_config, id)
            }
        })
        .map(|agent| agent.name.clone())
        .collect()
}

/// Refuses with `409 conflict` when an agent of the caller's workspace refers to
/// `reference`; `doing` says what was refused ("delete model m1").
pub(super) async fn refuse_if_referenced(
    state: &AppState,
    caller: &Caller,
    reference: Reference<'_>,
    doing: &str,
) -> ApiResult<()> {
    let agents = state.stores().agents.list(&caller.workspace_id).await?;
    let names = referrers(&agents, reference);
    if names.is_empty() {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorCode::Conflict,
        format!(
            "cannot {doing}: agent(s) {} refer to it; change or delete them first",
            names.join(", ")
        ),
    ))
}

/// The current fields of a registration as a create body (an object), with `patch` on
/// top: top-level keys replace, so `null` clears an optional field.
pub(super) fn merged<T: serde::de::DeserializeOwned>(
    current: Value,
    patch: Map<String, Value>,
) -> ApiResult<T> {
    let mut body = match current {
        Value::Object(map) => map,
        _ => return Err(ApiError::internal("registration is not an object")),
    };
    body.extend(patch);
    from_body(&Value::Object(body))
}

/// Reads a merged body exactly as the create route reads its request body (same
/// extractor, so the same refusal texts naming the field).
pub(crate) fn from_body<T: serde::de::DeserializeOwned>(body: &Value) -> ApiResult<T> {
    let bytes = serde_json::to_vec(body).map_err(ApiError::internal)?;
    axum::Json::<T>::from_bytes(&bytes)
        .map(|axum::Json(value)| value)
        .map_err(ApiError::from)
}

/// A missing resource of `what` with path id `id`: the store's `not_found` worded for the
/// API.
pub(super) fn missing(what: &str, id: &str) -> impl FnOnce(StoreError) -> ApiError {
    let message = format!("{what} {id} not found");
    move |e| match e {
        StoreError::NotFound(_) => ApiError::not_found(message),
        e => e.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sb_protocol::ids::WorkspaceId;
    use serde_json::json;

    fn agent(name: &str, policy: Value, runner_config: Value) -> AgentRow {
        AgentRow {
            id: sb_protocol::ids::AgentId::new(),
            workspace_id: WorkspaceId::default_workspace(),
            name: name.into(),
            description: None,
            runner_id: "plugin:x/y".into(),
            runner_config,
            event_types: json!([]),
            scope: json!({}),
            bot_id: None,
            channel: None,
            conversation_id: None,
            actor_id: None,
            filters: json!([]),
            resource_policy: policy,
            state_policy: json!({}),
            delivery_policy: json!({}),
            budgets: json!({}),
            enabled: true,
            routing: Default::default(),
            created_at: chrono::Utc::now(),
            updated_at: chrono::Utc::now(),
        }
    }

    #[test]
    fn referrers_find_grants_and_runner_config_ids() {
        let model = "0190c3a0-0000-7000-8000-000000000001";
        let kb = "0190c3a0-0000-7000-8000-000000000002";
        let agents = [
            agent(
                "granted",
                json!({"allowed_model_uuids": [model]}),
                json!({}),
            ),
            agent("primary", json!({}), json!({"model": {"primary": model}})),
            agent(
                "tools",
                json!({"allowed_tool_names": ["weather"], "allowed_kb_uuids": [kb]}),
                json!({"prompt": "weather"}),
            ),
        ];
        assert_eq!(
            referrers(&agents, Reference::Model(model)),
            ["granted", "primary"]
        );
        assert_eq!(referrers(&agents, Reference::KnowledgeBase(kb)), ["tools"]);
        assert_eq!(referrers(&agents, Reference::Tool("weather")), ["tools"]);
        // A tool is referred to by its grant only, not by a word in a prompt.
        let prompt_only = [agent("p", json!({}), json!({"prompt": "weather"}))];
        assert!(referrers(&prompt_only, Reference::Tool("weather")).is_empty());
        assert!(referrers(&agents, Reference::Tool("calendar")).is_empty());
    }
}
