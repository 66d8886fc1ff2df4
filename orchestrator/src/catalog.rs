//! The boundary to the workspace's resources (models, tools, knowledge bases, skills): the
//! "∩ resources that exist" part of effective access (SPEC §6).
//!
//! [`crate::access::requested`] says which ids a binding could grant; a
//! [`ResourceCatalog`] answers which of them exist, as an [`access::Catalog`]; the pure
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
    ) -> Result<access::Catalog, CatalogError>;
}

/// A fixed catalog, the same for every workspace: what embedded mode configures statically,
/// and what tests use. `Catalog::default()` is a host with no models, tools, knowledge bases
/// or skills, where effective access still grants history, events, artifacts, state and
/// storage as the manifest and policy allow.
#[async_trait]
impl ResourceCatalog for access::Catalog {
    async fn lookup(
        &self,
        _workspace: &WorkspaceId,
        request: &ResourceRequest,
    ) -> Result<access::Catalog, CatalogError> {
        Ok(access::Catalog {
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
