//! The boundary to the workspace's resources (models, tools, knowledge bases, skills): the
//! "∩ resources that exist" part of effective access (SPEC §6).
//!
//! [`crate::access::requested`] says which ids a binding could grant; a
//! [`ResourceCatalog`] answers which of them exist, as an [`access::ExistingResources`]; the pure
//! [`crate::access::effective_access`] intersects.

use async_trait::async_trait;
use sb_protocol::error::{ErrorCode, HasErrorCode};
use sb_protocol::ids::WorkspaceId;

use crate::access::{self, ResourceRequest};

/// A resource lookup failed.
#[derive(Debug, thiserror::Error)]
#[error("resource catalog unavailable: {0}")]
pub struct CatalogError(pub String);

impl HasErrorCode for CatalogError {
    /// The catalog is a dependency: its failure is transient from the event's point of view.
    fn code(&self) -> ErrorCode {
        ErrorCode::Unavailable
    }
}

/// Looks up which requested resources exist in a workspace.
///
/// # Contract
/// - The answer only contains ids from `request` (extra entries are ignored by the access
///   computation anyway) whose resource exists and is visible in `workspace`.
/// - An id missing from the answer is treated as "does not exist" and is never granted;
///   a lookup that could not be completed must be an error, never a partial answer.
/// - `skills` is `Some` (possibly empty) only when `request.skills` is set and the
///   workspace has skill support.
#[async_trait]
pub trait ResourceCatalog: Send + Sync + 'static {
    /// The subset of `request` that exists in `workspace`.
    async fn lookup(
        &self,
        workspace: &WorkspaceId,
        request: &ResourceRequest,
    ) -> Result<access::ExistingResources, CatalogError>;
}

/// A fixed catalog, the same for every workspace: what embedded mode configures statically,
/// and what tests use. `ExistingResources::default()` is a host with no models, tools, knowledge bases
/// or skills, where effective access still grants history, events, artifacts, state and
/// storage as the manifest and policy allow.
#[async_trait]
impl ResourceCatalog for access::ExistingResources {
    async fn lookup(
        &self,
        _workspace: &WorkspaceId,
        request: &ResourceRequest,
    ) -> Result<access::ExistingResources, CatalogError> {
        Ok(access::ExistingResources {
            models: request
                .models
                .iter()
                .filter_map(|(id, _)| self.models.get(id).map(|m| (id.clone(), m.clone())))
                .collect(),
            tools: request
                .tools
                .iter()
                .filter_map(|name| self.tools.get(name).map(|t| (name.clone(), t.clone())))
                .collect(),
            knowledge_bases: request
                .knowledge_bases
                .iter()
                .filter_map(|id| {
                    self.knowledge_bases
                        .get(id)
                        .map(|k| (id.clone(), k.clone()))
                })
                .collect(),
            skills: if request.skills {
                self.skills.clone()
            } else {
                None
            },
        })
    }
}

/// The catalog of the workspace resource registry (`/v1/models`, `/v1/tools`,
/// `/v1/knowledge-bases`): what every role backed by the database uses.
///
/// Disabled models and tools do not exist for access purposes. A model id that is not a
/// UUID cannot name a registered model and is simply absent. Skills are not registered
/// anywhere yet, so `skills` is always `None` (no skill support).
#[derive(Clone)]
pub struct StoreCatalog {
    resources: std::sync::Arc<dyn sb_store::ResourceRegistry>,
}

impl StoreCatalog {
    /// A catalog over `resources`.
    #[must_use]
    pub fn new(resources: std::sync::Arc<dyn sb_store::ResourceRegistry>) -> Self {
        Self { resources }
    }
}

impl std::fmt::Debug for StoreCatalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreCatalog").finish_non_exhaustive()
    }
}

fn uuids<'a>(ids: impl Iterator<Item = &'a String>) -> Vec<uuid::Uuid> {
    let mut out: Vec<uuid::Uuid> = ids.filter_map(|id| id.parse().ok()).collect();
    out.sort_unstable();
    out.dedup();
    out
}

#[async_trait]
impl ResourceCatalog for StoreCatalog {
    async fn lookup(
        &self,
        workspace: &WorkspaceId,
        request: &ResourceRequest,
    ) -> Result<access::ExistingResources, CatalogError> {
        let failed = |e: sb_store::StoreError| CatalogError(e.to_string());
        let mut catalog = access::ExistingResources::default();
        let model_ids = uuids(request.models.iter().map(|(id, _)| id));
        if !model_ids.is_empty() {
            for m in self
                .resources
                .models_by_ids(workspace, &model_ids)
                .await
                .map_err(failed)?
                .into_iter()
                .filter(|m| m.enabled)
            {
                let id = m.model_id.to_string();
                catalog.models.insert(
                    id.clone(),
                    access::ModelInfo {
                        model_id: id,
                        kind: m.kind,
                        provider: Some("openai_compatible".to_owned()),
                        context_window: m.context_window.and_then(|w| u64::try_from(w).ok()),
                    },
                );
            }
        }
        if !request.tools.is_empty() {
            let mut names = request.tools.clone();
            names.sort_unstable();
            names.dedup();
            for t in self
                .resources
                .tools_by_names(workspace, &names)
                .await
                .map_err(failed)?
                .into_iter()
                .filter(|t| t.enabled)
            {
                catalog.tools.insert(
                    t.name.clone(),
                    access::ToolInfo {
                        tool_name: t.name,
                        tool_type: Some(t.kind),
                        description: Some(t.description),
                    },
                );
            }
        }
        let kb_ids = uuids(request.knowledge_bases.iter());
        if !kb_ids.is_empty() {
            for k in self
                .resources
                .kbs_by_ids(workspace, &kb_ids)
                .await
                .map_err(failed)?
            {
                let id = k.kb_id.to_string();
                catalog.knowledge_bases.insert(
                    id.clone(),
                    access::KnowledgeBaseInfo {
                        kb_id: id,
                        kb_name: Some(k.name),
                        kb_type: Some("full_text".to_owned()),
                    },
                );
            }
        }
        Ok(catalog)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use sb_store::{ModelKind, NewModel, NewTool, ResourceRegistry, SqlStore, SqlStoreOptions};
    use serde_json::json;

    use super::*;
    use crate::access::effective_access;
    use crate::access::tests::{binding, descriptor};

    async fn registry() -> Arc<dyn ResourceRegistry> {
        let store = SqlStore::connect(
            "sqlite::memory:",
            &SqlStoreOptions {
                migrate: true,
                ..SqlStoreOptions::default()
            },
        )
        .await
        .unwrap();
        Arc::new(store)
    }

    fn model(name: &str, kind: ModelKind, window: Option<i64>) -> NewModel {
        NewModel {
            workspace_id: WorkspaceId::default_workspace(),
            name: name.into(),
            kind,
            base_url: "http://127.0.0.1:9/v1".into(),
            model_name: name.into(),
            api_key_env: None,
            context_window: window,
            extra_args: None,
        }
    }

    /// Registered resources are granted per host-behaviour §8: models from the policy,
    /// tools only with `tool_calling` + permission, knowledge bases only with
    /// `knowledge_retrieval` + permission; unknown ids and other workspaces' ids never.
    #[tokio::test]
    async fn registered_resources_are_granted_by_policy_and_capability() {
        let r = registry().await;
        let ws = WorkspaceId::default_workspace();
        let llm = r
            .create_model(model("llm", ModelKind::Llm, Some(32000)))
            .await
            .unwrap();
        let rerank = r
            .create_model(model("rr", ModelKind::Rerank, None))
            .await
            .unwrap();
        r.create_tool(NewTool {
            workspace_id: ws.clone(),
            name: "weather".into(),
            kind: "http".into(),
            description: "weather".into(),
            parameters: json!({"type": "object"}),
            config: json!({"url": "http://127.0.0.1:9"}),
        })
        .await
        .unwrap();
        let kb = r.create_kb(&ws, "docs", None).await.unwrap();
        let other_ws = WorkspaceId::new("other").unwrap();
        let foreign = r.create_kb(&other_ws, "theirs", None).await.unwrap();
        let catalog = StoreCatalog::new(r);

        let policy = json!({
            "allowed_model_uuids": [llm.model_id.to_string(), "not-a-uuid", uuid::Uuid::now_v7().to_string()],
            "allowed_tool_names": ["weather", "ghost"],
            "allowed_kb_uuids": [kb.kb_id.to_string(), foreign.kb_id.to_string()],
        });
        let perms = json!({
            "models": ["invoke", "stream", "rerank"], "tools": ["detail", "call"],
            "knowledge_bases": ["list", "retrieve"]
        });
        let schema = json!([{"name": "reranker", "type": "rerank-model-selector"}]);
        let config = json!({"reranker": rerank.model_id.to_string()});
        let d = descriptor(
            perms.clone(),
            json!({"tool_calling": true, "knowledge_retrieval": true}),
            schema.clone(),
        );
        let b = binding(config.clone(), policy.clone());
        let request = crate::access::requested(&d, &b);
        let found = catalog.lookup(&ws, &request).await.unwrap();
        let access = effective_access(&d, &b, true, &found);
        let models: Vec<String> = access
            .resources
            .models
            .iter()
            .map(|m| m.model_id.clone())
            .collect();
        assert_eq!(models.len(), 2, "{models:?}");
        assert!(models.contains(&llm.model_id.to_string()));
        assert!(models.contains(&rerank.model_id.to_string()));
        assert_eq!(access.model_context_window_tokens, Some(32000));
        let tools: Vec<&str> = access
            .resources
            .tools
            .iter()
            .map(|t| t.tool_name.as_str())
            .collect();
        assert_eq!(tools, vec!["weather"]);
        let kbs: Vec<String> = access
            .resources
            .knowledge_bases
            .iter()
            .map(|k| k.kb_id.clone())
            .collect();
        assert_eq!(kbs, vec![kb.kb_id.to_string()]);

        // Without the capabilities, the same policy grants no tool and no knowledge base.
        let d = descriptor(
            perms,
            json!({"tool_calling": false, "knowledge_retrieval": false}),
            schema,
        );
        let request = crate::access::requested(&d, &b);
        let found = catalog.lookup(&ws, &request).await.unwrap();
        let access = effective_access(&d, &b, true, &found);
        assert!(access.resources.tools.is_empty());
        assert!(access.resources.knowledge_bases.is_empty());
        assert_eq!(access.resources.models.len(), 2);
    }
}
