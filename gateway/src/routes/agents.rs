//! `GET /v1/agents`, `POST /v1/agents`, `GET /v1/agents/{id}`, `PATCH /v1/agents/{id}`,
//! `DELETE /v1/agents/{id}`.
//!
//! Creating an agent validates every policy against its `sb-protocol` type (unknown fields
//! refused), the filters against the resolver's filter language, the budget overrides
//! against [`BudgetOverrides`], and then two things that need the database:
//! - the runner must be registered by some worker (`422` otherwise: the request is
//!   well-formed but names something that does not exist);
//! - an enabled agent must not tie with an existing enabled agent: same specificity,
//!   overlapping scope and a shared event type would make events ambiguous, which the
//!   resolver refuses to decide (SPEC §5), so it is refused here with `409 conflict`. The
//!   rule is the resolver's own [`sb_rules::bindings::conflicts`].
//!
//! # Routing
//!
//! `routing` is `scope` (the default: scope resolution may pick the agent) or `direct`: the
//! agent is reached only when a request names it (`agent_id` on `POST /v1/events`, or a
//! session created for it). A direct agent is never a scope candidate, so it conflicts with
//! no agent: any number of them sit beside one workspace-wide agent.
//!
//! # Budgets
//!
//! `budgets` holds per-run budget overrides (SPEC §8): any of `max_model_calls`,
//! `max_tool_calls`, `max_tool_result_chars`, `max_model_output_chars`, as non-negative
//! integers; a budget left out keeps the host default (16, 32, 100 000, 100 000) and `{}`
//! (the default) overrides nothing. Only the overrides are stored and returned, so an agent
//! follows the defaults for what it does not set. `0` is accepted on purpose: it turns the
//! budgeted capability off for the agent (every call is `budget_exceeded`) while leaving
//! its grants untouched. The run's frozen authorization snapshot carries the resulting
//! budgets; workers enforce them.

use std::str::FromStr;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use sb_protocol::error::ErrorCode;
use sb_protocol::host::{
    AgentConfig, AgentScope, BudgetOverrides, DeliveryPolicy, ResourcePolicy, StatePolicy,
    event_types,
};
use sb_protocol::ids::AgentId;
use sb_protocol::manifest::RunnerId;
use sb_rules::bindings::{AgentCandidate, EventFilter, conflicts};
use sb_store::agents::{AgentRouting, AgentRow, NewAgent};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::{ListPage, PageQuery, epoch, page_by_key, parse_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::normalize::MAX_TYPE_LEN;
use crate::state::AppState;

/// Longest agent name.
const MAX_NAME_LEN: usize = 100;
/// Longest description.
const MAX_DESCRIPTION_LEN: usize = 2000;

fn default_event_types() -> Vec<String> {
    vec![event_types::MESSAGE_RECEIVED.to_owned()]
}

fn yes() -> bool {
    true
}

/// Body of `POST /v1/agents`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateAgent {
    /// Unique within the workspace.
    pub name: String,
    /// Free text.
    #[serde(default)]
    pub description: Option<String>,
    /// `plugin:<author>/<plugin>/<runner>`; must be registered.
    pub runner_id: String,
    /// Runner configuration (`ctx.config`).
    #[serde(default)]
    pub runner_config: Map<String, Value>,
    /// Handled event types (default `["message.received"]`).
    #[serde(default = "default_event_types")]
    pub event_types: Vec<String>,
    /// Where it applies.
    #[serde(default)]
    pub scope: AgentScope,
    /// Predicates on the event (see the resolver docs).
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    pub filters: Vec<EventFilter>,
    /// Resource grants.
    #[serde(default)]
    pub resource_policy: ResourcePolicy,
    /// State access.
    #[serde(default)]
    pub state_policy: StatePolicy,
    /// Delivery and concurrency.
    #[serde(default)]
    pub delivery_policy: DeliveryPolicy,
    /// Per-run budget overrides (see the module docs); checked against [`BudgetOverrides`]
    /// and stored as given, so unset budgets keep following the deployment's defaults
    /// (`limits.budgets`).
    #[serde(default)]
    pub budgets: Map<String, Value>,
    /// Whether the resolver considers it (default `true`).
    #[serde(default = "yes")]
    pub enabled: bool,
    /// `scope` (default: scope resolution may pick it) or `direct` (reached only when a
    /// request names it).
    #[serde(default)]
    pub routing: AgentRouting,
}

/// An agent as the API shows it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct AgentView {
    /// Id.
    pub agent_id: AgentId,
    /// Name.
    pub name: String,
    /// Description.
    pub description: Option<String>,
    /// Runner.
    pub runner_id: String,
    /// Runner configuration.
    pub runner_config: Value,
    /// Event types.
    pub event_types: Value,
    /// Scope.
    pub scope: Value,
    /// Filters.
    pub filters: Value,
    /// Resource policy.
    pub resource_policy: Value,
    /// State policy.
    pub state_policy: Value,
    /// Delivery policy.
    pub delivery_policy: Value,
    /// Budget overrides (`{}` = the defaults).
    pub budgets: Value,
    /// Enabled.
    pub enabled: bool,
    /// `scope` or `direct`.
    pub routing: AgentRouting,
    /// Epoch seconds.
    pub created_at: i64,
    /// Epoch seconds.
    pub updated_at: i64,
}

impl From<AgentRow> for AgentView {
    fn from(r: AgentRow) -> Self {
        Self {
            agent_id: r.id,
            name: r.name,
            description: r.description,
            runner_id: r.runner_id,
            runner_config: r.runner_config,
            event_types: r.event_types,
            scope: r.scope,
            filters: r.filters,
            resource_policy: r.resource_policy,
            state_policy: r.state_policy,
            delivery_policy: r.delivery_policy,
            budgets: r.budgets,
            enabled: r.enabled,
            routing: r.routing,
            created_at: epoch(r.created_at),
            updated_at: epoch(r.updated_at),
        }
    }
}

/// `GET /v1/agents`: every agent of the workspace, by name.
#[utoipa::path(
    get,
    path = "/v1/agents",
    tag = "agents",
    params(PageQuery),
    responses(
        (status = 200, description = "The workspace's agents, by name", body = ListPage<AgentView>),
    )
)]
pub async fn list_agents(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ApiResult<ApiJson<ListPage<AgentView>>> {
    let rows = state.stores().agents.list(&caller.workspace_id).await?;
    let items: Vec<AgentView> = rows.into_iter().map(AgentView::from).collect();
    Ok(ApiJson(page_by_key(
        items,
        |a| (a.name.clone(), a.agent_id),
        q.cursor.as_deref(),
        state.page_limit(q.limit),
    )?))
}

/// `GET /v1/agents/{id}`.
#[utoipa::path(
    get,
    path = "/v1/agents/{id}",
    tag = "agents",
    params(("id" = String, Path, description = "Agent id")),
    responses(
        (status = 200, description = "The agent", body = AgentView),
        (status = 404, description = "no such agent in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn get_agent(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<ApiJson<AgentView>> {
    let agent_id: AgentId = parse_id("agent", &id)?;
    match state
        .stores()
        .agents
        .get(&caller.workspace_id, agent_id)
        .await?
    {
        Some(row) => Ok(ApiJson(row.into())),
        None => Err(ApiError::not_found(format!("agent {id} not found"))),
    }
}

/// `DELETE /v1/agents/{id}`: `204`, or `404` if there is no such agent.
#[utoipa::path(
    delete,
    path = "/v1/agents/{id}",
    tag = "agents",
    params(("id" = String, Path, description = "Agent id")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "no such agent in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn delete_agent(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    let agent_id: AgentId = parse_id("agent", &id)?;
    if state
        .stores()
        .agents
        .delete(&caller.workspace_id, agent_id)
        .await?
    {
        announce_routing_change(&state).await;
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("agent {id} not found")))
    }
}

/// `POST /v1/agents`: `201` with the agent.
#[utoipa::path(
    post,
    path = "/v1/agents",
    tag = "agents",
    request_body = CreateAgent,
    responses(
        (status = 201, description = "The new agent", body = AgentView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 422, description = "`invalid_argument`: well-formed, but names something that cannot be used", body = crate::error::ErrorBody<'static>),
        (status = 409, description = "`conflict`: its scope is ambiguous with another agent's", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn create_agent(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CreateAgent>,
) -> ApiResult<impl IntoResponse> {
    let checked = check(&state, &caller, &body, None).await?;
    let new = NewAgent {
        id: None,
        workspace_id: caller.workspace_id,
        name: body.name,
        description: body.description,
        runner_id: checked.runner_id,
        runner_config: Value::Object(body.runner_config),
        event_types: json!(body.event_types),
        scope: checked.scope,
        filters: checked.filters,
        resource_policy: checked.resource_policy,
        state_policy: checked.state_policy,
        delivery_policy: checked.delivery_policy,
        budgets: Value::Object(body.budgets),
        enabled: body.enabled,
        routing: body.routing,
    };
    let row = state.stores().agents.create(new).await?;
    tracing::info!(agent_id = %row.id, runner_id = %row.runner_id, "agent created");
    announce_routing_change(&state).await;
    Ok((StatusCode::CREATED, ApiJson(AgentView::from(row))))
}

/// `PATCH /v1/agents/{id}`: the body holds the fields to change (same names and rules as
/// `POST`); the merged agent is validated again as a whole, conflict check included (against
/// the other agents).
#[utoipa::path(
    patch,
    path = "/v1/agents/{id}",
    tag = "agents",
    params(("id" = String, Path, description = "Agent id")),
    request_body(content = Object, description = "Fields of `CreateAgent` to change"),
    responses(
        (status = 200, description = "The changed agent", body = AgentView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 404, description = "no such agent in the caller's workspace", body = crate::error::ErrorBody<'static>),
        (status = 422, description = "`invalid_argument`: well-formed, but names something that cannot be used", body = crate::error::ErrorBody<'static>),
        (status = 409, description = "`conflict`: the change makes its scope ambiguous", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn update_agent(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiJson(patch): ApiJson<Map<String, Value>>,
) -> ApiResult<ApiJson<AgentView>> {
    let agent_id: AgentId = parse_id("agent", &id)?;
    let Some(row) = state
        .stores()
        .agents
        .get(&caller.workspace_id, agent_id)
        .await?
    else {
        return Err(ApiError::not_found(format!("agent {id} not found")));
    };
    // Current fields as a create body, then the patch on top (top-level keys replace).
    let mut merged =
        match serde_json::to_value(AgentView::from(row.clone())).map_err(ApiError::internal)? {
            Value::Object(map) => map,
            _ => return Err(ApiError::internal("agent view is not an object")),
        };
    for key in ["agent_id", "created_at", "updated_at"] {
        merged.remove(key);
    }
    for (key, value) in patch {
        if matches!(key.as_str(), "agent_id" | "created_at" | "updated_at") {
            return Err(ApiError::invalid(format!(
                "invalid `{key}`: it cannot be changed"
            )));
        }
        merged.insert(key, value);
    }
    let body: CreateAgent = serde_json::from_value(Value::Object(merged))
        .map_err(|e| ApiError::invalid(format!("invalid request body: {e}")))?;
    let checked = check(&state, &caller, &body, Some(agent_id)).await?;
    let updated = AgentRow {
        name: body.name,
        description: body.description,
        runner_id: checked.runner_id,
        runner_config: Value::Object(body.runner_config),
        event_types: json!(body.event_types),
        scope: checked.scope,
        filters: checked.filters,
        resource_policy: checked.resource_policy,
        state_policy: checked.state_policy,
        delivery_policy: checked.delivery_policy,
        budgets: Value::Object(body.budgets),
        enabled: body.enabled,
        routing: body.routing,
        ..row
    };
    let row = state.stores().agents.update(updated).await?;
    tracing::info!(agent_id = %row.id, "agent updated");
    announce_routing_change(&state).await;
    Ok(ApiJson(row.into()))
}

/// Tells every orchestrator's routing cache that agents changed (after the commit). The
/// change is committed whatever happens here: if the session store cannot take the new epoch,
/// the caches see it within their `route_cache_max_age`, and the request still succeeds.
async fn announce_routing_change(state: &AppState) {
    if let Err(error) = sb_common::session::announce_routing_change(state.sessions().as_ref()).await
    {
        tracing::warn!(%error, "could not announce the agent change to the routing caches; they pick it up within orchestrator.route_cache_max_age");
    }
}

/// The stored forms of a checked agent body.
struct Checked {
    runner_id: String,
    scope: Value,
    filters: Value,
    resource_policy: Value,
    state_policy: Value,
    delivery_policy: Value,
}

/// Validates a create (or merged update) body: shapes, the runner's registration, and the
/// conflict rule against every other enabled agent of the workspace (`except` = the agent
/// being updated).
async fn check(
    state: &AppState,
    caller: &Caller,
    body: &CreateAgent,
    except: Option<AgentId>,
) -> ApiResult<Checked> {
    let (runner_id, budgets) = validate(body)?;
    if state
        .stores()
        .runners
        .get(&runner_id.to_string())
        .await?
        .is_none()
    {
        return Err(ApiError::unprocessable(format!(
            "runner {runner_id} is not registered by any worker (see GET /v1/runners)"
        )));
    }
    let config = AgentConfig {
        agent_id: except,
        workspace_id: caller.workspace_id.clone(),
        runner_id: runner_id.clone(),
        runner_config: body.runner_config.clone(),
        scope: body.scope.clone(),
        resource_policy: body.resource_policy.clone(),
        state_policy: body.state_policy.clone(),
        delivery_policy: body.delivery_policy.clone(),
        budgets,
        event_types: body.event_types.clone(),
        enabled: body.enabled,
        metadata: Map::new(),
    };
    let config = AgentCandidate::new(config, body.filters.clone()).with_routing(body.routing);
    if config.config.enabled && config.routing == AgentRouting::Scope {
        for row in state
            .stores()
            .agents
            .list_enabled(&caller.workspace_id)
            .await?
        {
            if Some(row.id) == except {
                continue;
            }
            // Read the row exactly as the resolver does. A row it cannot read, or whose
            // filters are malformed, never matches, so it cannot tie either.
            let Ok(existing) = AgentCandidate::from_row(&row) else {
                continue;
            };
            if existing.filters.is_err() {
                continue;
            }
            if conflicts(&config, &existing) {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!(
                        "agent {:?} ({}) already handles an overlapping event type at the same scope \
                         specificity ({:?}); events would be ambiguous: narrow the scope, disable one, or \
                         create this one with `\"routing\": \"direct\"` (reached only by `agent_id` or a session)",
                        row.name,
                        row.id,
                        config.config.scope.specificity()
                    ),
                ));
            }
        }
    }
    Ok(Checked {
        runner_id: runner_id.to_string(),
        scope: to_json(&body.scope)?,
        filters: to_json(&body.filters)?,
        resource_policy: to_json(&body.resource_policy)?,
        state_policy: to_json(&body.state_policy)?,
        delivery_policy: to_json(&body.delivery_policy)?,
    })
}

fn to_json<T: Serialize>(value: &T) -> ApiResult<Value> {
    serde_json::to_value(value).map_err(ApiError::internal)
}

/// Checks what can be checked without the database; returns the parsed runner id and the
/// budgets the overrides give.
fn validate(body: &CreateAgent) -> ApiResult<(RunnerId, BudgetOverrides)> {
    check_text("name", &body.name, MAX_NAME_LEN)?;
    if let Some(d) = &body.description {
        if d.chars().count() > MAX_DESCRIPTION_LEN {
            return Err(ApiError::invalid(format!(
                "invalid `description`: must be at most {MAX_DESCRIPTION_LEN} characters"
            )));
        }
    }
    let runner_id = RunnerId::from_str(&body.runner_id).map_err(|e| {
        ApiError::invalid(format!(
            "invalid `runner_id`: {e} (expected plugin:<author>/<plugin>/<runner>)"
        ))
    })?;
    if body.event_types.is_empty() {
        return Err(ApiError::invalid(
            "invalid `event_types`: at least one event type is required",
        ));
    }
    for t in &body.event_types {
        let ok = !t.is_empty()
            && t.len() <= MAX_TYPE_LEN
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-'));
        if !ok {
            return Err(ApiError::invalid(format!(
                "invalid `event_types`: {t:?} must be 1-{MAX_TYPE_LEN} characters of [A-Za-z0-9_.:-]"
            )));
        }
    }
    let scope = &body.scope;
    for (field, value) in [
        ("scope.bot_id", &scope.bot_id),
        ("scope.channel", &scope.channel),
        ("scope.conversation_id", &scope.conversation_id),
        ("scope.actor_id", &scope.actor_id),
    ] {
        if let Some(v) = value {
            check_text(field, v, 255)?;
        }
    }
    for (i, filter) in body.filters.iter().enumerate() {
        filter
            .validate()
            .map_err(|e| ApiError::invalid(format!("invalid `filters[{i}]`: {e}")))?;
    }
    let budgets = budgets(&body.budgets)?;
    Ok((runner_id, budgets))
}

/// The budgets that `overrides` give: unknown names, negative or fractional numbers, values
/// out of range are refused; a partial object is the normal case, and `null` leaves a
/// budget to the default.
fn budgets(overrides: &Map<String, Value>) -> ApiResult<BudgetOverrides> {
    serde_json::from_value(Value::Object(overrides.clone())).map_err(|e| {
        ApiError::invalid(format!(
            "invalid `budgets`: {e} (expected non-negative integers for any of \
             max_model_calls, max_tool_calls, max_tool_result_chars, max_model_output_chars)"
        ))
    })
}

fn check_text(field: &str, value: &str, max: usize) -> ApiResult<()> {
    if value.trim().is_empty() {
        return Err(ApiError::invalid(format!(
            "invalid `{field}`: must not be empty"
        )));
    }
    if value.chars().count() > max || value.chars().any(char::is_control) {
        return Err(ApiError::invalid(format!(
            "invalid `{field}`: must be at most {max} characters without control characters"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(extra: Value) -> CreateAgent {
        let mut v = json!({"name": "echo", "runner_id": "plugin:acme/echo/default"});
        for (k, val) in extra.as_object().unwrap() {
            v[k] = val.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn defaults_and_validation() {
        let b = body(json!({}));
        assert_eq!(b.event_types, vec!["message.received"]);
        assert!(b.enabled);
        assert!(validate(&b).is_ok());
        for (extra, needle) in [
            (json!({"name": " "}), "name"),
            (json!({"runner_id": "echo"}), "runner_id"),
            (json!({"event_types": []}), "event_types"),
            (json!({"event_types": ["bad type"]}), "event_types"),
            (json!({"scope": {"bot_id": ""}}), "scope.bot_id"),
            (
                json!({"filters": [{"field": "", "value": 1}]}),
                "filters[0]",
            ),
            (
                json!({"filters": [{"field": "a", "op": "in", "value": 1}]}),
                "filters[0]",
            ),
        ] {
            let err = validate(&body(extra.clone())).unwrap_err();
            assert_eq!(err.code(), ErrorCode::InvalidArgument);
            assert!(err.message().contains(needle), "{extra}: {}", err.message());
        }
    }

    #[test]
    fn budgets_are_partial_overrides() {
        let (_, b) = validate(&body(json!({}))).unwrap();
        assert_eq!(b, BudgetOverrides::default());
        // `null` leaves a budget to the deployment's default, like leaving it out.
        let (_, b) = validate(&body(json!({"budgets": {"max_model_calls": null}}))).unwrap();
        assert_eq!(b, BudgetOverrides::default());
        let (_, b) = validate(&body(json!({"budgets": {"max_tool_calls": 0}}))).unwrap();
        assert_eq!(
            b,
            BudgetOverrides {
                max_tool_calls: Some(0),
                ..BudgetOverrides::default()
            }
        );
        for bad in [
            json!({"max_tool_callz": 1}),
            json!({"max_tool_calls": -1}),
            json!({"max_tool_calls": 1.5}),
            json!({"max_tool_calls": "1"}),
            json!({"max_model_calls": 4_294_967_296_u64}),
        ] {
            let err = validate(&body(json!({ "budgets": bad.clone() }))).unwrap_err();
            assert_eq!(err.code(), ErrorCode::InvalidArgument, "{bad}");
            assert!(
                err.message().contains("`budgets`"),
                "{bad}: {}",
                err.message()
            );
        }
    }

    #[test]
    fn policies_refuse_unknown_fields() {
        let v = json!({"name": "x", "runner_id": "plugin:a/b/c", "scope": {"botid": "b"}});
        assert!(serde_json::from_value::<CreateAgent>(v).is_err());
        let v = json!({"name": "x", "runner_id": "plugin:a/b/c", "colour": "red"});
        assert!(serde_json::from_value::<CreateAgent>(v).is_err());
    }
}
