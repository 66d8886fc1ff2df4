//! The default agent and model of `switchboard dev`: one configuration step to a real model.
//!
//! `switchboard dev --model-url URL --model NAME [--model-key-env VAR]` (or `[dev]` in
//! `switchboard.toml`, see `sb_common::config::DevConfig`) registers that OpenAI-compatible
//! model in workspace `default` and makes the default agent the local-agent runner bound to
//! it; without a model the default agent is the echo runner. Each start converges the
//! workspace to what its configuration says, without duplicating anything:
//!
//! - **The model** is the one named [`DEFAULT_MODEL_NAME`]: created when missing, updated in
//!   place (same id, so agents that use it keep working) when the URL, model name, key
//!   variable or context window changed, kept otherwise. It is never deleted: dropping the
//!   flags only stops the default agent from using it.
//! - **The default agent** is the workspace's agent named [`DEFAULT_AGENT_NAME`] (or, in a
//!   data directory from before this step, the echo agent the bootstrap made then, named
//!   [`LEGACY_AGENT_NAME`]). It is created only in a workspace with no agent at all, and
//!   converged only while it is bound to one of the two bootstrap runners: an operator who
//!   rebound, renamed or deleted it keeps their choice. Converging to the local agent sets
//!   the model as `runner_config.model.primary` (keeping configured fallbacks and every
//!   other key) and adds it to `resource_policy.allowed_model_uuids` (keeping the rest of
//!   the policy, e.g. tools and knowledge bases granted since); converging back to echo
//!   clears the runner config.
//!
//! [`plan_agent`] and [`plan_model`] decide (pure, unit-tested); [`ensure`] reads and writes
//! the store.

use std::num::NonZeroU32;

use sb_common::config::{DevModel, SwitchboardConfig};
use sb_common::egress::EgressPolicy;
use sb_common::secrets::SecretPolicy;
use sb_protocol::host::event_types;
use sb_protocol::ids::{AgentId, WorkspaceId};
use sb_store::{AgentRow, ModelKind, ModelRecord, NewAgent, NewModel, StoreError, Stores};
use serde_json::{Map, Value, json};
use uuid::Uuid;

use crate::builtin::ECHO_RUNNER_ID;

/// Name of the agent the bootstrap manages.
pub const DEFAULT_AGENT_NAME: &str = "default";
/// Name the bootstrap's echo agent had before the default agent could be a local agent.
pub const LEGACY_AGENT_NAME: &str = "echo";
/// Name of the model the bootstrap registers.
pub const DEFAULT_MODEL_NAME: &str = "default";
/// Runner id of the official local agent.
pub const LOCAL_AGENT_RUNNER_ID: &str = sb_runner_local_agent::RUNNER_ID;

/// What the default agent should be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Desired<'a> {
    /// The echo runner (no model configured).
    Echo,
    /// The local agent on this model id.
    LocalAgent {
        /// The registered model.
        model_id: &'a str,
    },
}

impl Desired<'_> {
    /// The runner id.
    #[must_use]
    pub fn runner_id(&self) -> &'static str {
        match self {
            Self::Echo => ECHO_RUNNER_ID,
            Self::LocalAgent { .. } => LOCAL_AGENT_RUNNER_ID,
        }
    }

    fn description(&self) -> &'static str {
        match self {
            Self::Echo => "Echoes every message back, word by word (created by switchboard dev).",
            Self::LocalAgent { .. } => {
                "Answers with the model given to switchboard dev (--model-url, --model)."
            }
        }
    }
}

/// The runner config and resource policy of the default agent for `desired`, from the
/// agent's current ones (see the module docs for what is kept). Also what a cluster
/// operator (or test) sends to `POST /v1/agents` to make the same agent.
#[must_use]
pub fn agent_fields(
    desired: Desired<'_>,
    current_runner: Option<&str>,
    current_config: &Value,
    current_policy: &Value,
) -> (Value, Value) {
    let mut policy = current_policy.as_object().cloned().unwrap_or_default();
    let Desired::LocalAgent { model_id } = desired else {
        return (Value::Object(Map::new()), Value::Object(policy));
    };
    let mut config = if current_runner == Some(LOCAL_AGENT_RUNNER_ID) {
        current_config.as_object().cloned().unwrap_or_default()
    } else {
        Map::new()
    };
    let fallbacks = config
        .get("model")
        .and_then(|m| m.get("fallbacks"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|f| f.as_str() != Some(model_id))
        .collect::<Vec<_>>();
    config.insert(
        "model".into(),
        json!({"primary": model_id, "fallbacks": fallbacks}),
    );
    let mut allowed: Vec<Value> = policy
        .get("allowed_model_uuids")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if !allowed.iter().any(|m| m.as_str() == Some(model_id)) {
        allowed.insert(0, json!(model_id));
    }
    policy.insert("allowed_model_uuids".into(), Value::Array(allowed));
    (Value::Object(config), Value::Object(policy))
}

/// What to do with the workspace's agents.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentPlan {
    /// The workspace has no agent: create the default one.
    Create(NewAgent),
    /// The managed agent differs from what it should be: write this row.
    Update(AgentRow),
    /// The managed agent is already what it should be.
    Keep(AgentRow),
    /// There is no managed agent, or it is bound to a runner of the operator's choosing:
    /// leave the workspace alone.
    NotManaged(Option<AgentRow>),
}

/// The agent the bootstrap manages among `agents`, if any (see the module docs).
fn managed(agents: &[AgentRow]) -> Option<&AgentRow> {
    agents
        .iter()
        .find(|a| a.name == DEFAULT_AGENT_NAME)
        .or_else(|| {
            agents
                .iter()
                .find(|a| a.name == LEGACY_AGENT_NAME && a.runner_id == ECHO_RUNNER_ID)
        })
}

/// Decides what the bootstrap does to `agents` (the workspace's) for `desired`.
#[must_use]
pub fn plan_agent(workspace: &WorkspaceId, agents: &[AgentRow], desired: Desired<'_>) -> AgentPlan {
    let Some(current) = managed(agents) else {
        if !agents.is_empty() {
            return AgentPlan::NotManaged(None);
        }
        let (runner_config, resource_policy) =
            agent_fields(desired, None, &Value::Null, &Value::Null);
        let empty = || Value::Object(Map::new());
        return AgentPlan::Create(NewAgent {
            id: None,
            workspace_id: workspace.clone(),
            name: DEFAULT_AGENT_NAME.to_owned(),
            description: Some(desired.description().to_owned()),
            runner_id: desired.runner_id().to_owned(),
            runner_config,
            event_types: json!([event_types::MESSAGE_RECEIVED]),
            scope: empty(),
            filters: json!([]),
            resource_policy,
            state_policy: empty(),
            delivery_policy: empty(),
            budgets: empty(),
            enabled: true,
            routing: sb_store::AgentRouting::Scope,
        });
    };
    if ![ECHO_RUNNER_ID, LOCAL_AGENT_RUNNER_ID].contains(&current.runner_id.as_str()) {
        return AgentPlan::NotManaged(Some(current.clone()));
    }
    let (runner_config, resource_policy) = agent_fields(
        desired,
        Some(&current.runner_id),
        &current.runner_config,
        &current.resource_policy,
    );
    let mut next = current.clone();
    next.name = DEFAULT_AGENT_NAME.to_owned();
    if next.runner_id != desired.runner_id() {
        next.description = Some(desired.description().to_owned());
    }
    next.runner_id = desired.runner_id().to_owned();
    next.runner_config = runner_config;
    next.resource_policy = resource_policy;
    if &next == current {
        AgentPlan::Keep(next)
    } else {
        AgentPlan::Update(next)
    }
}

/// The registration of the dev model.
#[must_use]
pub fn new_model(workspace: &WorkspaceId, model: &DevModel) -> NewModel {
    NewModel {
        workspace_id: workspace.clone(),
        name: DEFAULT_MODEL_NAME.to_owned(),
        kind: ModelKind::Llm,
        base_url: model.base_url.trim_end_matches('/').to_owned(),
        model_name: model.model.clone(),
        api_key_env: model.api_key_env.clone(),
        context_window: model.context_window.map(|w| i64::from(NonZeroU32::get(w))),
        extra_args: None,
    }
}

/// What to do with the registry's model of that name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelPlan {
    /// Register it.
    Create,
    /// Replace the registration of this id.
    Update(Uuid),
    /// Already registered like that.
    Keep(Uuid),
}

/// Decides what the bootstrap does with `existing` (the model named
/// [`DEFAULT_MODEL_NAME`], if any) to register `wanted`. Extra args set through the API
/// since are kept (they are not the flags' business); everything the flags say is compared.
#[must_use]
pub fn plan_model(existing: Option<&ModelRecord>, wanted: &NewModel) -> ModelPlan {
    let Some(m) = existing else {
        return ModelPlan::Create;
    };
    let same = m.kind == wanted.kind
        && m.base_url == wanted.base_url
        && m.model_name == wanted.model_name
        && m.api_key_env == wanted.api_key_env
        && m.context_window == wanted.context_window
        && m.enabled;
    if same {
        ModelPlan::Keep(m.model_id)
    } else {
        ModelPlan::Update(m.model_id)
    }
}

/// How the managed agent changed at this start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Created now.
    Created,
    /// Rewritten now (runner, model or name).
    Updated,
    /// Already as configured.
    Unchanged,
    /// Not the bootstrap's to change (see [`AgentPlan::NotManaged`]).
    NotManaged,
}

/// The registered dev model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelReport {
    /// Registry id (the agent's `runner_config.model.primary`).
    pub model_id: Uuid,
    /// Name at the server.
    pub model: String,
    /// Base URL.
    pub base_url: String,
}

/// What [`ensure`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DefaultAgentReport {
    /// The managed agent (after this start), if there is one.
    pub agent_id: Option<AgentId>,
    /// Its runner.
    pub runner_id: Option<String>,
    /// What changed.
    pub change: Change,
    /// The dev model, when one is configured.
    pub model: Option<ModelReport>,
}

/// Why the bootstrap cannot register the dev model.
#[derive(Debug, thiserror::Error)]
pub enum DefaultAgentError {
    /// The configured model is refused by the deployment's own policies.
    #[error("{0}")]
    Refused(String),
    /// A store operation failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Registers the dev model (when `config.dev` names one) and converges the default agent of
/// workspace `default` (see the module docs).
///
/// # Errors
/// [`DefaultAgentError::Refused`] when the egress policy or `secrets.allow` refuses the
/// model (checked here as the gateway checks a registration, so `dev` fails at start rather
/// than at the first message), or a store error.
pub async fn ensure(
    stores: &Stores,
    config: &SwitchboardConfig,
) -> Result<DefaultAgentReport, DefaultAgentError> {
    let workspace = WorkspaceId::default_workspace();
    let model = match config.dev.default_model() {
        Some(model) => Some(register_model(stores, config, &workspace, &model).await?),
        None => None,
    };
    let model_id = model.as_ref().map(|m| m.model_id.to_string());
    let desired = match &model_id {
        Some(id) => Desired::LocalAgent { model_id: id },
        None => Desired::Echo,
    };
    if stores.runners.get(desired.runner_id()).await?.is_none() {
        tracing::warn!(
            runner_id = desired.runner_id(),
            "the default agent's runner is not registered by any worker; its runs fail until one hosts it"
        );
    }
    let agents = stores.agents.list(&workspace).await?;
    let (agent, change) = match plan_agent(&workspace, &agents, desired) {
        AgentPlan::Create(new) => match stores.agents.create(new).await {
            Ok(row) => {
                tracing::info!(agent_id = %row.id, runner_id = %row.runner_id, "default agent created");
                (Some(row), Change::Created)
            }
            // Another process created an agent with that name meanwhile: theirs stands.
            Err(StoreError::Conflict(_)) => (None, Change::NotManaged),
            Err(e) => return Err(e.into()),
        },
        AgentPlan::Update(row) => {
            let row = stores.agents.update(row).await?;
            tracing::info!(agent_id = %row.id, runner_id = %row.runner_id, "default agent updated");
            (Some(row), Change::Updated)
        }
        AgentPlan::Keep(row) => (Some(row), Change::Unchanged),
        AgentPlan::NotManaged(row) => {
            if model.is_some() {
                tracing::info!(
                    "the workspace's default agent was replaced or removed: the dev model is registered, \
                     bind an agent to it to use it"
                );
            }
            (row, Change::NotManaged)
        }
    };
    Ok(DefaultAgentReport {
        agent_id: agent.as_ref().map(|a| a.id),
        runner_id: agent.map(|a| a.runner_id),
        change,
        model,
    })
}

async fn register_model(
    stores: &Stores,
    config: &SwitchboardConfig,
    workspace: &WorkspaceId,
    model: &DevModel,
) -> Result<ModelReport, DefaultAgentError> {
    let wanted = new_model(workspace, model);
    EgressPolicy::from_config(&config.egress)
        .check_url("dev.model_url", &wanted.base_url)
        .map_err(|e| DefaultAgentError::Refused(format!("dev.model_url: {e}")))?;
    if let Some(name) = &wanted.api_key_env {
        SecretPolicy::from_config(&config.secrets)
            .check(name)
            .map_err(|e| DefaultAgentError::Refused(format!("dev.model_key_env: {e}")))?;
        if std::env::var_os(name).is_none() {
            tracing::warn!(
                variable = %name,
                "the dev model's key variable is not set; the model's calls fail until it is"
            );
        }
    }
    let existing = stores.resources.list_models(workspace).await?;
    let existing = existing.iter().find(|m| m.name == DEFAULT_MODEL_NAME);
    let mut wanted = wanted;
    if let Some(m) = existing {
        // Extra args given through the API are not the flags' business: kept.
        wanted.extra_args = Some(m.extra_args.clone());
    }
    let record = match plan_model(existing, &wanted) {
        ModelPlan::Create => {
            let record = stores.resources.create_model(wanted).await?;
            tracing::info!(model_id = %record.model_id, model = %record.model_name, "dev model registered");
            record
        }
        ModelPlan::Update(id) => {
            let record = stores.resources.update_model(id, wanted).await?;
            tracing::info!(model_id = %record.model_id, model = %record.model_name, "dev model updated");
            record
        }
        ModelPlan::Keep(id) => stores.resources.get_model(workspace, id).await?,
    };
    Ok(ModelReport {
        model_id: record.model_id,
        model: record.model_name,
        base_url: record.base_url,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;

    fn ws() -> WorkspaceId {
        WorkspaceId::default_workspace()
    }

    fn row(name: &str, runner: &str, config: Value, policy: Value) -> AgentRow {
        AgentRow {
            id: AgentId::new(),
            workspace_id: ws(),
            name: name.into(),
            description: None,
            runner_id: runner.into(),
            runner_config: config,
            event_types: json!(["message.received"]),
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
            routing: sb_store::AgentRouting::Scope,
            created_at: Utc::now(),
            updated_at: Utc::now(),
        }
    }

    const M: Desired<'static> = Desired::LocalAgent { model_id: "m1" };

    #[test]
    fn an_empty_workspace_gets_the_agent_it_is_configured_for() {
        let AgentPlan::Create(echo) = plan_agent(&ws(), &[], Desired::Echo) else {
            panic!()
        };
        assert_eq!(
            (echo.name.as_str(), echo.runner_id.as_str()),
            ("default", ECHO_RUNNER_ID)
        );
        assert_eq!(echo.runner_config, json!({}));
        let AgentPlan::Create(local) = plan_agent(&ws(), &[], M) else {
            panic!()
        };
        assert_eq!(local.runner_id, LOCAL_AGENT_RUNNER_ID);
        assert_eq!(
            local.runner_config,
            json!({"model": {"primary": "m1", "fallbacks": []}})
        );
        assert_eq!(
            local.resource_policy,
            json!({"allowed_model_uuids": ["m1"]})
        );
        assert_eq!(local.event_types, json!(["message.received"]));
        assert_eq!(local.scope, json!({}), "workspace-wide");
    }

    #[test]
    fn the_managed_agent_converges_and_keeps_what_the_operator_added() {
        // The echo agent of an older data directory becomes the local agent, renamed.
        let legacy = row(
            "echo",
            ECHO_RUNNER_ID,
            json!({}),
            json!({"allowed_tool_names": ["t"]}),
        );
        let AgentPlan::Update(next) = plan_agent(&ws(), std::slice::from_ref(&legacy), M) else {
            panic!()
        };
        assert_eq!((next.id, next.name.as_str()), (legacy.id, "default"));
        assert_eq!(next.runner_id, LOCAL_AGENT_RUNNER_ID);
        assert_eq!(
            next.resource_policy,
            json!({"allowed_tool_names": ["t"], "allowed_model_uuids": ["m1"]})
        );
        // Again: nothing to do.
        assert!(matches!(
            plan_agent(&ws(), std::slice::from_ref(&next), M),
            AgentPlan::Keep(_)
        ));

        // A new model: primary replaced, fallbacks and other keys kept, policy extended.
        let tuned = row(
            "default",
            LOCAL_AGENT_RUNNER_ID,
            json!({"model": {"primary": "m1", "fallbacks": ["f1", "m2"]}, "max_rounds": 3}),
            json!({"allowed_model_uuids": ["m1", "f1"], "allowed_kb_uuids": ["kb"]}),
        );
        let AgentPlan::Update(next) =
            plan_agent(&ws(), &[tuned], Desired::LocalAgent { model_id: "m2" })
        else {
            panic!()
        };
        assert_eq!(
            next.runner_config,
            json!({"model": {"primary": "m2", "fallbacks": ["f1"]}, "max_rounds": 3})
        );
        assert_eq!(
            next.resource_policy,
            json!({"allowed_model_uuids": ["m2", "m1", "f1"], "allowed_kb_uuids": ["kb"]})
        );

        // Without a model it is echo again.
        let AgentPlan::Update(echo) = plan_agent(&ws(), &[next], Desired::Echo) else {
            panic!()
        };
        assert_eq!(
            (echo.runner_id.as_str(), &echo.runner_config),
            (ECHO_RUNNER_ID, &json!({}))
        );
        assert!(matches!(
            plan_agent(&ws(), &[echo], Desired::Echo),
            AgentPlan::Keep(_)
        ));
    }

    #[test]
    fn an_operators_choice_is_left_alone() {
        let own = row("default", "plugin:me/mine/default", json!({}), json!({}));
        assert_eq!(
            plan_agent(&ws(), std::slice::from_ref(&own), M),
            AgentPlan::NotManaged(Some(own))
        );
        let other = row("support", ECHO_RUNNER_ID, json!({}), json!({}));
        assert_eq!(
            plan_agent(&ws(), std::slice::from_ref(&other), M),
            AgentPlan::NotManaged(None)
        );
        // A user's own agent named like the legacy one, on another runner, is not ours.
        let echo_named = row("echo", LOCAL_AGENT_RUNNER_ID, json!({}), json!({}));
        assert_eq!(
            plan_agent(&ws(), &[echo_named], M),
            AgentPlan::NotManaged(None)
        );
    }

    fn record(m: &NewModel) -> ModelRecord {
        ModelRecord {
            model_id: Uuid::now_v7(),
            workspace_id: m.workspace_id.clone(),
            name: m.name.clone(),
            kind: m.kind,
            base_url: m.base_url.clone(),
            model_name: m.model_name.clone(),
            api_key_env: m.api_key_env.clone(),
            context_window: m.context_window,
            extra_args: json!({"temperature": 0}),
            enabled: true,
            created_at: Utc::now(),
        }
    }

    #[test]
    fn the_model_is_registered_once_and_updated_in_place() {
        let dev = DevModel {
            base_url: "http://127.0.0.1:11434/v1/".into(),
            model: "llama3.2".into(),
            api_key_env: None,
            context_window: NonZeroU32::new(4096),
        };
        let wanted = new_model(&ws(), &dev);
        assert_eq!(wanted.base_url, "http://127.0.0.1:11434/v1");
        assert_eq!(
            (wanted.name.as_str(), wanted.context_window),
            ("default", Some(4096))
        );
        assert_eq!(plan_model(None, &wanted), ModelPlan::Create);
        let same = record(&wanted);
        assert_eq!(
            plan_model(Some(&same), &wanted),
            ModelPlan::Keep(same.model_id)
        );
        for change in [
            |m: &mut NewModel| m.model_name = "qwen2.5".into(),
            |m: &mut NewModel| m.base_url = "http://127.0.0.1:8000/v1".into(),
            |m: &mut NewModel| m.api_key_env = Some("OPENAI_API_KEY".into()),
            |m: &mut NewModel| m.context_window = None,
        ] {
            let mut other = wanted.clone();
            change(&mut other);
            assert_eq!(
                plan_model(Some(&same), &other),
                ModelPlan::Update(same.model_id)
            );
        }
        let mut disabled = same.clone();
        disabled.enabled = false;
        assert_eq!(
            plan_model(Some(&disabled), &wanted),
            ModelPlan::Update(same.model_id)
        );
    }
}
