//! The resolver's inputs: the workspace's enabled agents and the binding's runner, through
//! the route cache.

use std::sync::Arc;

use sb_protocol::host::{AgentBinding, AgentRunnerDescriptor};
use sb_protocol::ids::WorkspaceId;
use sb_rules::bindings::AgentCandidate;

use super::EventRouter;
use crate::error::Result;
use crate::plan::RunnerLookup;

impl EventRouter {
    /// The workspace's enabled agents as resolver candidates (an agent whose row does not
    /// parse is skipped, with a warning), from the cache when it holds them under `epoch`.
    pub(super) async fn candidates(
        &self,
        workspace: &WorkspaceId,
        epoch: Option<&[u8]>,
    ) -> Result<Arc<[AgentCandidate]>> {
        if let Some(cached) = self.cache.agents(workspace, epoch) {
            return Ok(cached);
        }
        let rows = self.deps.stores.agents.list_enabled(workspace).await?;
        let candidates: Arc<[AgentCandidate]> = rows
            .iter()
            .filter_map(|row| match AgentCandidate::from_row(row) {
                Ok(c) => Some(c),
                Err(error) => {
                    tracing::warn!(%error, "agent skipped by the resolver");
                    None
                }
            })
            .collect();
        self.cache
            .put_agents(workspace, epoch, Arc::clone(&candidates));
        Ok(candidates)
    }

    /// The registry's entry of the binding's runner, from the cache when it holds it under
    /// `epoch`.
    pub(super) async fn lookup_runner(
        &self,
        binding: &AgentBinding,
        epoch: Option<&[u8]>,
    ) -> Result<RunnerLookup> {
        let runner_id = binding.runner_id.to_string();
        if let Some(cached) = self.cache.runner(&runner_id, epoch) {
            return Ok(cached);
        }
        let lookup = self.read_runner(binding).await?;
        self.cache.put_runner(&runner_id, epoch, lookup.clone());
        Ok(lookup)
    }

    async fn read_runner(&self, binding: &AgentBinding) -> Result<RunnerLookup> {
        let Some(row) = self
            .deps
            .stores
            .runners
            .get(&binding.runner_id.to_string())
            .await?
        else {
            return Ok(RunnerLookup::Missing);
        };
        Ok(
            match serde_json::from_value::<AgentRunnerDescriptor>(row.descriptor) {
                Ok(descriptor) if descriptor.id == binding.runner_id => RunnerLookup::Found {
                    descriptor: Box::new(descriptor),
                    pool: row.pool,
                },
                Ok(descriptor) => {
                    RunnerLookup::Invalid(format!("descriptor id {} does not match", descriptor.id))
                }
                Err(e) => RunnerLookup::Invalid(format!("descriptor does not decode: {e}")),
            },
        )
    }
}
