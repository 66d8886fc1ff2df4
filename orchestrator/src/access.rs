//! Effective access of a run (SPEC §6, PROTOCOL_V1 §4.4, host-behaviour §8 and the
//! `available_apis` table of §9).
//!
//! ```text
//! effective access = manifest permissions ∩ binding resource policy
//!                    ∩ runner-config selections ∩ resources that exist in the workspace
//! ```
//!
//! Computed once per run by [`effective_access`], frozen into the authorization snapshot
//! and projected to the runner as `ctx.resources` and `ctx.context.available_apis`.
//!
//! The split keeps this module pure: [`requested`] lists the ids the binding could grant
//! (config selections + policy lists), the service looks those up in the workspace's
//! [`ExistingResources`] (only what exists comes back), and [`effective_access`] intersects.
//!
//! Rules per kind:
//! - **Models.** LLMs only if `models` grants `invoke` or `stream` (operations: the granted
//!   subset, in that order); rerank models only if `rerank` is granted (operations
//!   `[rerank]`). Order: models selected in the runner config (fallback-selector primary,
//!   then its fallbacks; llm-selectors; rerank-selectors), then the policy's
//!   `allowed_model_uuids` (LLM only). Sentinels, duplicates and models that do not exist
//!   (or are of the other kind) are skipped.
//! - **Tools.** Only if `tools` grants `detail` or `call`, the runner has
//!   `capabilities.tool_calling`, and the policy names tools; each must exist. The runner
//!   config can never grant tools.
//! - **Knowledge bases.** Only if `knowledge_bases` grants `list` or `retrieve` and the
//!   runner has `capabilities.knowledge_retrieval`: KB-selector values of the config (or
//!   the field default), then the policy's `allowed_kb_uuids`; each must exist.
//! - **Skills.** Only with `capabilities.skill_authoring`: every skill of the workspace when
//!   the policy says `None`, otherwise the intersection; sorted by name.
//! - **Files.** Only if `files` grants `config`: the values of `file` / `array[file]` config
//!   fields (`knowledge` grants nothing yet).
//! - **Storage.** `plugin` granted ∧ `allow_plugin_storage`; `workspace` granted ∧
//!   `allow_workspace_storage`.
//!
//! For models, tools and knowledge bases a policy list of `None` means "no *extra*
//! grants", never "everything". Capabilities only decide whether a kind is projected; they
//! are never grants on their own.
//!
//! One file on purpose: everything here is a single pure computation (no I/O, no service
//! state), the intersection above and the config readers that feed it; its ~490 production
//! lines are one rule set read together, and most of the file is its tests.

use std::collections::{BTreeMap, BTreeSet};

use sb_protocol::context::{
    AgentResources, ContextAPICapabilities, FileResource, KnowledgeBaseResource, ModelResource,
    SkillResource, StorageResource, ToolResource,
};
use sb_protocol::host::{AgentBinding, AgentRunnerDescriptor};
use sb_protocol::manifest::{
    ArtifactOp, DynamicFormItemSchema, EventOp, FileOp, HistoryOp, KnowledgeBaseOp, ModelOp,
    StorageOp, ToolOp,
};
use serde_json::{Map, Value};

/// Config values that mean "nothing selected".
pub const NONE_SENTINELS: [&str; 3] = ["", "__none__", "__none"];

/// LLM selector with fallbacks (`{primary, fallbacks}` or a plain id).
pub const FIELD_MODEL_FALLBACK_SELECTOR: &str = "model-fallback-selector";
/// LLM selector (a plain id).
pub const FIELD_LLM_MODEL_SELECTOR: &str = "llm-model-selector";
/// Rerank model selector (a plain id).
pub const FIELD_RERANK_MODEL_SELECTOR: &str = "rerank-model-selector";
/// Knowledge base selector (a list of ids).
pub const FIELD_KB_MULTI_SELECTOR: &str = "knowledge-base-multi-selector";
/// One file (`{file_key|file_id, file_name|name, mime_type|mimetype}`).
pub const FIELD_FILE: &str = "file";
/// A list of files.
pub const FIELD_FILE_ARRAY: &str = "array[file]";

/// The canonical DynamicForm field type (legacy aliases mapped).
#[must_use]
pub fn canonical_field_type(item_type: &str) -> &str {
    match item_type {
        "select-llm-model" => FIELD_LLM_MODEL_SELECTOR,
        "select-knowledge-bases" => FIELD_KB_MULTI_SELECTOR,
        other => other,
    }
}

fn is_sentinel(s: &str) -> bool {
    NONE_SENTINELS.contains(&s)
}

/// LLM or rerank: the registry's kind; `as_str` is the `model_type` runners see.
pub use sb_store::ModelKind;

/// A model that exists in the workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// Id.
    pub model_id: String,
    /// Kind.
    pub kind: ModelKind,
    /// Provider name.
    pub provider: Option<String>,
    /// Context window in tokens, if known.
    pub context_window: Option<u64>,
}

/// A tool that exists in the workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolInfo {
    /// Name.
    pub tool_name: String,
    /// Kind (`http`, `mcp`, …).
    pub tool_type: Option<String>,
    /// Description.
    pub description: Option<String>,
}

/// A knowledge base that exists in the workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnowledgeBaseInfo {
    /// Id.
    pub kb_id: String,
    /// Name.
    pub kb_name: Option<String>,
    /// Kind.
    pub kb_type: Option<String>,
}

/// The ids a binding could grant, before checking which exist.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResourceRequest {
    /// Models (config selections and policy list), with the kind each was asked as.
    pub models: Vec<(String, ModelKind)>,
    /// Tool names.
    pub tools: Vec<String>,
    /// Knowledge base ids.
    pub knowledge_bases: Vec<String>,
    /// Whether skills are projected at all.
    pub skills: bool,
}

impl ResourceRequest {
    /// Whether nothing needs looking up.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
            && self.tools.is_empty()
            && self.knowledge_bases.is_empty()
            && !self.skills
    }
}

/// What exists in the workspace, as far as a [`ResourceRequest`] asked. Ids missing here do
/// not exist (or are not visible) and are never granted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExistingResources {
    /// Models by id.
    pub models: BTreeMap<String, ModelInfo>,
    /// Tools by name.
    pub tools: BTreeMap<String, ToolInfo>,
    /// Knowledge bases by id.
    pub knowledge_bases: BTreeMap<String, KnowledgeBaseInfo>,
    /// Skills of the workspace; `None` when the workspace has no skill support.
    pub skills: Option<Vec<SkillResource>>,
}

/// The frozen access of one run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EffectiveAccess {
    /// `ctx.resources`.
    pub resources: AgentResources,
    /// `ctx.context.available_apis`.
    pub available_apis: ContextAPICapabilities,
    /// Context window of the first LLM granted (`runtime.metadata.model_context_window_tokens`).
    pub model_context_window_tokens: Option<u64>,
}

/// The config value of a schema field, if the config sets it.
fn config_value<'a>(
    item: &DynamicFormItemSchema,
    config: &'a Map<String, Value>,
) -> Option<&'a Value> {
    config.get(&item.name).filter(|v| !v.is_null())
}

/// Models the runner config selects (only fields present in the config), in schema order:
/// a fallback-selector's primary then its fallbacks, llm-selectors, rerank-selectors.
#[must_use]
pub fn config_model_refs(
    schema: &[DynamicFormItemSchema],
    config: &Map<String, Value>,
) -> Vec<(String, ModelKind)> {
    let mut refs = Vec::new();
    let mut push = |v: &Value, kind: ModelKind| {
        if let Some(s) = v.as_str().filter(|s| !is_sentinel(s)) {
            refs.push((s.to_owned(), kind));
        }
    };
    for item in schema {
        let Some(value) = config_value(item, config) else {
            continue;
        };
        match canonical_field_type(&item.item_type) {
            FIELD_MODEL_FALLBACK_SELECTOR => match value {
                Value::String(_) => push(value, ModelKind::Llm),
                Value::Object(obj) => {
                    if let Some(primary) = obj.get("primary") {
                        push(primary, ModelKind::Llm);
                    }
                    for fallback in obj
                        .get("fallbacks")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                    {
                        push(fallback, ModelKind::Llm);
                    }
                }
                _ => {}
            },
            FIELD_LLM_MODEL_SELECTOR => push(value, ModelKind::Llm),
            FIELD_RERANK_MODEL_SELECTOR => push(value, ModelKind::Rerank),
            _ => {}
        }
    }
    refs
}

/// Knowledge bases the runner config selects: every KB-selector's list (the configured
/// value, else the field default), sentinels removed, de-duplicated in order.
#[must_use]
pub fn config_kb_ids(schema: &[DynamicFormItemSchema], config: &Map<String, Value>) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    for item in schema {
        if canonical_field_type(&item.item_type) != FIELD_KB_MULTI_SELECTOR {
            continue;
        }
        let value = config_value(item, config).or(item.default.as_ref());
        for id in value
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            if !is_sentinel(id) && !ids.iter().any(|x| x == id) {
                ids.push(id.to_owned());
            }
        }
    }
    ids
}

/// Files the runner config references (`file` and `array[file]` fields), de-duplicated by
/// id (first wins). Each value is `{file_key | file_id, file_name | name, mime_type | mimetype}`.
#[must_use]
pub fn config_files(
    schema: &[DynamicFormItemSchema],
    config: &Map<String, Value>,
) -> Vec<FileResource> {
    fn str_of<'a>(obj: &'a Map<String, Value>, keys: &[&str]) -> Option<&'a str> {
        keys.iter()
            .find_map(|k| obj.get(*k).and_then(Value::as_str))
    }
    let mut files: Vec<FileResource> = Vec::new();
    for item in schema {
        let field_type = canonical_field_type(&item.item_type);
        if field_type != FIELD_FILE && field_type != FIELD_FILE_ARRAY {
            continue;
        }
        let Some(value) = config_value(item, config) else {
            continue;
        };
        let entries: Vec<&Value> = match value {
            Value::Array(items) => items.iter().collect(),
            other => vec![other],
        };
        for entry in entries {
            let Some(obj) = entry.as_object() else {
                continue;
            };
            let Some(id) = str_of(obj, &["file_key", "file_id"]).filter(|s| !is_sentinel(s)) else {
                continue;
            };
            if files.iter().any(|f| f.file_id == id) {
                continue;
            }
            files.push(FileResource {
                file_id: id.to_owned(),
                file_name: str_of(obj, &["file_name", "name"]).map(str::to_owned),
                mime_type: str_of(obj, &["mime_type", "mimetype"]).map(str::to_owned),
                source: Some("config".to_owned()),
                operations: vec![FileOp::Config],
            });
        }
    }
    files
}

fn llm_ops(descriptor: &AgentRunnerDescriptor) -> Vec<ModelOp> {
    [ModelOp::Invoke, ModelOp::Stream]
        .into_iter()
        .filter(|op| descriptor.permissions.has_model(*op))
        .collect()
}

fn tool_ops(descriptor: &AgentRunnerDescriptor) -> Vec<ToolOp> {
    [ToolOp::Detail, ToolOp::Call]
        .into_iter()
        .filter(|op| descriptor.permissions.has_tool(*op))
        .collect()
}

fn kb_ops(descriptor: &AgentRunnerDescriptor) -> Vec<KnowledgeBaseOp> {
    [KnowledgeBaseOp::List, KnowledgeBaseOp::Retrieve]
        .into_iter()
        .filter(|op| descriptor.permissions.has_knowledge_base(*op))
        .collect()
}

/// The ids worth looking up for this binding and runner: nothing the manifest or the
/// capabilities rule out is asked for.
#[must_use]
pub fn requested(descriptor: &AgentRunnerDescriptor, binding: &AgentBinding) -> ResourceRequest {
    let policy = &binding.resource_policy;
    let llm = !llm_ops(descriptor).is_empty();
    let rerank = descriptor.permissions.has_model(ModelOp::Rerank);

    let mut models: Vec<(String, ModelKind)> =
        config_model_refs(&descriptor.config_schema, &binding.runner_config)
            .into_iter()
            .filter(|(_, kind)| match kind {
                ModelKind::Llm => llm,
                ModelKind::Rerank => rerank,
            })
            .collect();
    if llm {
        for id in policy.allowed_model_uuids.iter().flatten() {
            if !is_sentinel(id) {
                models.push((id.clone(), ModelKind::Llm));
            }
        }
    }
    let mut seen = BTreeSet::new();
    models.retain(|(id, _)| seen.insert(id.clone()));

    let tools = if !tool_ops(descriptor).is_empty() && descriptor.capabilities.tool_calling {
        dedup(policy.allowed_tool_names.iter().flatten())
    } else {
        Vec::new()
    };

    let knowledge_bases =
        if !kb_ops(descriptor).is_empty() && descriptor.capabilities.knowledge_retrieval {
            let mut ids = config_kb_ids(&descriptor.config_schema, &binding.runner_config);
            ids.extend(policy.allowed_kb_uuids.iter().flatten().cloned());
            dedup(ids.iter())
        } else {
            Vec::new()
        };

    ResourceRequest {
        models,
        tools,
        knowledge_bases,
        skills: descriptor.capabilities.skill_authoring,
    }
}

fn dedup<'a>(ids: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for id in ids {
        if !is_sentinel(id) && !out.contains(id) {
            out.push(id.clone());
        }
    }
    out
}

/// The `available_apis` flags (host-behaviour §9). `prompt_get` is always false: this host
/// has no query-backed runs.
#[must_use]
pub fn available_apis(
    descriptor: &AgentRunnerDescriptor,
    binding: &AgentBinding,
    storage: StorageResource,
    has_conversation: bool,
) -> ContextAPICapabilities {
    let p = &descriptor.permissions;
    ContextAPICapabilities {
        history_page: p.has_history(HistoryOp::Page) && has_conversation,
        history_search: p.has_history(HistoryOp::Search) && has_conversation,
        event_get: p.has_event(EventOp::Get),
        event_page: p.has_event(EventOp::Page) && has_conversation,
        artifact_metadata: p.has_artifact(ArtifactOp::Metadata),
        artifact_read: p.has_artifact(ArtifactOp::Read),
        state: binding.state_policy.is_enabled(),
        storage: storage.plugin_storage || storage.workspace_storage,
        steering_pull: descriptor.capabilities.steering && has_conversation,
        prompt_get: false,
    }
}

/// Intersects manifest, policy, config and what exists (see the module docs).
/// `catalog` should answer [`requested`]`(descriptor, binding)`; anything it lacks is not
/// granted.
#[must_use]
pub fn effective_access(
    descriptor: &AgentRunnerDescriptor,
    binding: &AgentBinding,
    has_conversation: bool,
    catalog: &ExistingResources,
) -> EffectiveAccess {
    let request = requested(descriptor, binding);
    let policy = &binding.resource_policy;
    let mut resources = AgentResources::default();
    let mut model_context_window_tokens = None;
    let mut first_llm = true;

    let llm_operations = llm_ops(descriptor);
    for (id, kind) in &request.models {
        let Some(info) = catalog.models.get(id).filter(|m| m.kind == *kind) else {
            continue;
        };
        let operations = match kind {
            ModelKind::Llm => llm_operations.clone(),
            ModelKind::Rerank => vec![ModelOp::Rerank],
        };
        if *kind == ModelKind::Llm && first_llm {
            first_llm = false;
            model_context_window_tokens = info.context_window.filter(|w| *w > 0);
        }
        resources.models.push(ModelResource {
            model_id: info.model_id.clone(),
            model_type: Some(kind.as_str().to_owned()),
            provider: info.provider.clone(),
            operations,
        });
    }

    let tool_operations = tool_ops(descriptor);
    for name in &request.tools {
        if let Some(info) = catalog.tools.get(name) {
            resources.tools.push(ToolResource {
                tool_name: info.tool_name.clone(),
                tool_type: info.tool_type.clone(),
                description: info.description.clone(),
                operations: tool_operations.clone(),
            });
        }
    }

    let kb_operations = kb_ops(descriptor);
    for id in &request.knowledge_bases {
        if let Some(info) = catalog.knowledge_bases.get(id) {
            resources.knowledge_bases.push(KnowledgeBaseResource {
                kb_id: info.kb_id.clone(),
                kb_name: info.kb_name.clone(),
                kb_type: info.kb_type.clone(),
                operations: kb_operations.clone(),
            });
        }
    }

    if request.skills {
        if let Some(skills) = &catalog.skills {
            let mut visible: Vec<SkillResource> = skills
                .iter()
                .filter(|s| {
                    policy
                        .allowed_skill_names
                        .as_ref()
                        .is_none_or(|names| names.contains(&s.skill_name))
                })
                .cloned()
                .collect();
            visible.sort_by(|a, b| a.skill_name.cmp(&b.skill_name));
            visible.dedup_by(|a, b| a.skill_name == b.skill_name);
            resources.skills = visible;
        }
    }

    if descriptor.permissions.has_file(FileOp::Config) {
        resources.files = config_files(&descriptor.config_schema, &binding.runner_config);
    }

    resources.storage = StorageResource {
        plugin_storage: descriptor.permissions.has_storage(StorageOp::Plugin)
            && policy.allow_plugin_storage,
        workspace_storage: descriptor.permissions.has_storage(StorageOp::Workspace)
            && policy.allow_workspace_storage,
    };

    let available_apis = available_apis(descriptor, binding, resources.storage, has_conversation);
    EffectiveAccess {
        resources,
        available_apis,
        model_context_window_tokens,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use sb_protocol::host::{AgentConfig, ResourcePolicy, StatePolicy};
    use serde_json::json;

    pub(crate) fn descriptor(perms: Value, caps: Value, schema: Value) -> AgentRunnerDescriptor {
        serde_json::from_value(json!({
            "id": "plugin:acme/agent/default",
            "label": {"en_US": "Agent"},
            "plugin_author": "acme",
            "plugin_name": "agent",
            "runner_name": "default",
            "pool": "default",
            "permissions": perms,
            "capabilities": caps,
            "config_schema": schema,
        }))
        .unwrap()
    }

    pub(crate) fn binding(config: Value, policy: Value) -> AgentBinding {
        let cfg: AgentConfig = serde_json::from_value(json!({
            "workspace_id": "default",
            "runner_id": "plugin:acme/agent/default",
            "runner_config": config,
            "resource_policy": policy,
        }))
        .unwrap();
        AgentBinding::from_config(&cfg)
    }

    fn model(id: &str, kind: ModelKind, window: Option<u64>) -> (String, ModelInfo) {
        (
            id.to_owned(),
            ModelInfo {
                model_id: id.to_owned(),
                kind,
                provider: Some("openai".into()),
                context_window: window,
            },
        )
    }

    fn catalog() -> ExistingResources {
        ExistingResources {
            models: [
                model("m1", ModelKind::Llm, Some(8192)),
                model("m2", ModelKind::Llm, Some(4096)),
                model("m3", ModelKind::Llm, None),
                model("r1", ModelKind::Rerank, None),
            ]
            .into_iter()
            .collect(),
            tools: ["search", "fetch"]
                .into_iter()
                .map(|n| {
                    (
                        n.to_owned(),
                        ToolInfo {
                            tool_name: n.to_owned(),
                            tool_type: Some("http".into()),
                            description: Some(format!("{n} tool")),
                        },
                    )
                })
                .collect(),
            knowledge_bases: ["kb1", "kb2"]
                .into_iter()
                .map(|k| {
                    (
                        k.to_owned(),
                        KnowledgeBaseInfo {
                            kb_id: k.to_owned(),
                            kb_name: Some(k.to_uppercase()),
                            kb_type: None,
                        },
                    )
                })
                .collect(),
            skills: Some(vec![
                SkillResource {
                    skill_name: "zeta".into(),
                    display_name: None,
                    description: None,
                },
                SkillResource {
                    skill_name: "alpha".into(),
                    display_name: Some("Alpha".into()),
                    description: None,
                },
            ]),
        }
    }

    fn schema() -> Value {
        json!([
            {"name": "model", "type": "model-fallback-selector"},
            {"name": "helper", "type": "select-llm-model"},
            {"name": "reranker", "type": "rerank-model-selector"},
            {"name": "kbs", "type": "knowledge-base-multi-selector", "default": ["kb2"]},
            {"name": "doc", "type": "file"},
            {"name": "docs", "type": "array[file]"},
        ])
    }

    fn all_perms() -> Value {
        json!({
            "models": ["invoke", "stream", "rerank"], "tools": ["detail", "call"],
            "knowledge_bases": ["list", "retrieve"], "history": ["page", "search"],
            "events": ["get", "page"], "artifacts": ["metadata", "read"],
            "storage": ["plugin", "workspace"], "files": ["config", "knowledge"]
        })
    }

    fn all_caps() -> Value {
        json!({"tool_calling": true, "knowledge_retrieval": true, "skill_authoring": true, "steering": true})
    }

    #[test]
    fn models_from_config_then_policy_deduplicated_and_existing_only() {
        let d = descriptor(all_perms(), all_caps(), schema());
        let b = binding(
            json!({
                "model": {"primary": "m1", "fallbacks": ["m2", "__none__", "ghost"]},
                "helper": "m1",
                "reranker": "r1",
            }),
            json!({"allowed_model_uuids": ["m3", "m2", "r1"]}),
        );
        let access = effective_access(&d, &b, true, &catalog());
        let got: Vec<(&str, Option<&str>, &[ModelOp])> = access
            .resources
            .models
            .iter()
            .map(|m| {
                (
                    m.model_id.as_str(),
                    m.model_type.as_deref(),
                    m.operations.as_slice(),
                )
            })
            .collect();
        let llm: &[ModelOp] = &[ModelOp::Invoke, ModelOp::Stream];
        assert_eq!(
            got,
            [
                ("m1", Some("llm"), llm),
                ("m2", Some("llm"), llm),
                ("r1", Some("rerank"), &[ModelOp::Rerank][..]),
                ("m3", Some("llm"), llm),
            ],
            "a rerank model listed in the policy is not an llm grant"
        );
        assert_eq!(access.model_context_window_tokens, Some(8192));
    }

    #[test]
    fn manifest_narrows_models() {
        let b = binding(
            json!({"model": "m1", "reranker": "r1"}),
            json!({"allowed_model_uuids": ["m2"]}),
        );
        let invoke_only = descriptor(json!({"models": ["invoke"]}), json!({}), schema());
        let a = effective_access(&invoke_only, &b, true, &catalog());
        assert_eq!(a.resources.models.len(), 2);
        assert!(
            a.resources
                .models
                .iter()
                .all(|m| m.operations == [ModelOp::Invoke])
        );
        let rerank_only = descriptor(json!({"models": ["rerank"]}), json!({}), schema());
        let a = effective_access(&rerank_only, &b, true, &catalog());
        assert_eq!(a.resources.models.len(), 1);
        assert_eq!(a.resources.models[0].model_id, "r1");
        assert_eq!(a.model_context_window_tokens, None);
        let none = descriptor(json!({}), json!({}), schema());
        assert!(
            effective_access(&none, &b, true, &catalog())
                .resources
                .models
                .is_empty()
        );
    }

    #[test]
    fn none_policy_means_no_extra_grants() {
        let d = descriptor(all_perms(), all_caps(), schema());
        let b = binding(json!({}), json!({}));
        assert_eq!(b.resource_policy, ResourcePolicy::default());
        let a = effective_access(&d, &b, true, &catalog());
        assert!(
            a.resources.models.is_empty(),
            "no config models and no policy list"
        );
        assert!(
            a.resources.tools.is_empty(),
            "tools only come from the policy"
        );
        // the KB field default still selects kb2 (config selection, not a policy grant)
        assert_eq!(
            a.resources
                .knowledge_bases
                .iter()
                .map(|k| k.kb_id.as_str())
                .collect::<Vec<_>>(),
            ["kb2"]
        );
        // skills: None means every skill, sorted by name
        assert_eq!(
            a.resources
                .skills
                .iter()
                .map(|s| s.skill_name.as_str())
                .collect::<Vec<_>>(),
            ["alpha", "zeta"]
        );
    }

    #[test]
    fn tools_need_permission_capability_policy_and_existence() {
        let policy = json!({"allowed_tool_names": ["search", "ghost", "search"]});
        let d = descriptor(
            json!({"tools": ["call"]}),
            json!({"tool_calling": true}),
            json!([]),
        );
        let a = effective_access(&d, &binding(json!({}), policy.clone()), true, &catalog());
        assert_eq!(
            a.resources.tools,
            [ToolResource {
                tool_name: "search".into(),
                tool_type: Some("http".into()),
                description: Some("search tool".into()),
                operations: vec![ToolOp::Call],
            }]
        );
        let no_cap = descriptor(json!({"tools": ["call"]}), json!({}), json!([]));
        assert!(
            effective_access(
                &no_cap,
                &binding(json!({}), policy.clone()),
                true,
                &catalog()
            )
            .resources
            .tools
            .is_empty()
        );
        let no_perm = descriptor(json!({}), json!({"tool_calling": true}), json!([]));
        assert!(
            effective_access(&no_perm, &binding(json!({}), policy), true, &catalog())
                .resources
                .tools
                .is_empty()
        );
        let empty_policy = binding(json!({}), json!({"allowed_tool_names": []}));
        assert!(
            effective_access(&d, &empty_policy, true, &catalog())
                .resources
                .tools
                .is_empty()
        );
    }

    #[test]
    fn knowledge_bases_union_config_and_policy() {
        let d = descriptor(
            json!({"knowledge_bases": ["retrieve"]}),
            json!({"knowledge_retrieval": true}),
            schema(),
        );
        let b = binding(
            json!({"kbs": ["kb1", "__none"]}),
            json!({"allowed_kb_uuids": ["kb2", "kb1", "ghost"]}),
        );
        let a = effective_access(&d, &b, true, &catalog());
        let kbs: Vec<_> = a
            .resources
            .knowledge_bases
            .iter()
            .map(|k| (k.kb_id.as_str(), k.operations.clone()))
            .collect();
        assert_eq!(
            kbs,
            [
                ("kb1", vec![KnowledgeBaseOp::Retrieve]),
                ("kb2", vec![KnowledgeBaseOp::Retrieve])
            ]
        );
        let no_cap = descriptor(
            json!({"knowledge_bases": ["retrieve"]}),
            json!({}),
            schema(),
        );
        assert!(
            effective_access(&no_cap, &b, true, &catalog())
                .resources
                .knowledge_bases
                .is_empty()
        );
    }

    #[test]
    fn skills_files_and_storage() {
        let d = descriptor(all_perms(), all_caps(), schema());
        let b = binding(
            json!({
                "doc": {"file_key": "f1", "file_name": "a.pdf", "mimetype": "application/pdf"},
                "docs": [{"file_id": "f2", "name": "b.txt"}, {"file_id": "f1"}, {"file_id": ""}, "junk"],
            }),
            json!({"allowed_skill_names": ["zeta", "ghost"], "allow_workspace_storage": true}),
        );
        let a = effective_access(&d, &b, true, &catalog());
        assert_eq!(a.resources.skills.len(), 1);
        assert_eq!(a.resources.skills[0].skill_name, "zeta");
        let files: Vec<_> = a
            .resources
            .files
            .iter()
            .map(|f| {
                (
                    f.file_id.as_str(),
                    f.file_name.as_deref(),
                    f.mime_type.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            files,
            [
                ("f1", Some("a.pdf"), Some("application/pdf")),
                ("f2", Some("b.txt"), None)
            ]
        );
        assert!(
            a.resources
                .files
                .iter()
                .all(|f| f.operations == [FileOp::Config])
        );
        assert_eq!(
            a.resources.storage,
            StorageResource {
                plugin_storage: true,
                workspace_storage: true
            }
        );

        // knowledge-only file permission produces nothing; storage needs both sides
        let d2 = descriptor(
            json!({"files": ["knowledge"], "storage": ["workspace"]}),
            json!({}),
            schema(),
        );
        let b2 = binding(json!({"doc": {"file_key": "f1"}}), json!({}));
        let a2 = effective_access(&d2, &b2, true, &catalog());
        assert!(a2.resources.files.is_empty());
        assert_eq!(a2.resources.storage, StorageResource::default());
        assert!(!a2.available_apis.storage);
        // no skill capability: no skills even with skills in the workspace
        let d3 = descriptor(json!({}), json!({}), json!([]));
        assert!(
            effective_access(&d3, &b2, true, &catalog())
                .resources
                .skills
                .is_empty()
        );
    }

    #[test]
    fn available_apis_table() {
        let d = descriptor(all_perms(), all_caps(), json!([]));
        let b = binding(json!({}), json!({}));
        let with = effective_access(&d, &b, true, &ExistingResources::default()).available_apis;
        assert_eq!(
            with,
            ContextAPICapabilities {
                history_page: true,
                history_search: true,
                event_get: true,
                event_page: true,
                artifact_metadata: true,
                artifact_read: true,
                state: true,
                storage: true,
                steering_pull: true,
                prompt_get: false,
            }
        );
        // without a conversation: history, event_page and steering are off; event_get,
        // artifacts, state (runner scope) and storage stay
        let without = effective_access(&d, &b, false, &ExistingResources::default()).available_apis;
        assert!(!without.history_page && !without.history_search && !without.event_page);
        assert!(!without.steering_pull);
        assert!(without.event_get && without.artifact_metadata && without.artifact_read);
        assert!(without.state && without.storage);

        // manifest permissions turn APIs off
        let narrow = descriptor(
            json!({"history": ["page"], "events": ["page"], "artifacts": ["read"]}),
            json!({}),
            json!([]),
        );
        let n = effective_access(&narrow, &b, true, &ExistingResources::default()).available_apis;
        assert!(n.history_page && !n.history_search && n.event_page && !n.event_get);
        assert!(n.artifact_read && !n.artifact_metadata && !n.steering_pull);
        assert!(!n.storage, "no storage permission");

        // state needs enable_state and a non-empty scope list
        let mut off = b.clone();
        off.state_policy = StatePolicy {
            enable_state: false,
            ..StatePolicy::default()
        };
        assert!(
            !effective_access(&d, &off, true, &ExistingResources::default())
                .available_apis
                .state
        );
        let mut empty = b.clone();
        empty.state_policy = StatePolicy {
            enable_state: true,
            state_scopes: vec![],
        };
        assert!(
            !effective_access(&d, &empty, true, &ExistingResources::default())
                .available_apis
                .state
        );
    }

    #[test]
    fn request_skips_what_the_manifest_rules_out() {
        let d = descriptor(json!({"models": ["rerank"]}), json!({}), schema());
        let b = binding(
            json!({"model": "m1", "reranker": "r1", "kbs": ["kb1"]}),
            json!({"allowed_model_uuids": ["m2"], "allowed_tool_names": ["search"], "allowed_kb_uuids": ["kb2"]}),
        );
        let r = requested(&d, &b);
        assert_eq!(r.models, [("r1".to_owned(), ModelKind::Rerank)]);
        assert!(r.tools.is_empty() && r.knowledge_bases.is_empty() && !r.skills);
        assert!(!r.is_empty());
        let nothing = descriptor(json!({}), json!({}), json!([]));
        assert!(requested(&nothing, &b).is_empty());
    }
}
