//! [`Stores`]: every store trait as an `Arc<dyn Trait>`, for application state.

use std::sync::Arc;

use async_trait::async_trait;

use crate::error::Result;
use crate::{
    AgentStore, ArtifactStore, BlobStorage, EventLog, Outbox, ResourceRegistry, RunLedger,
    RunnerRegistry, ScheduleStore, SqlStore, StateStore, Tenancy, Transcript, TurnStore,
};

/// Liveness of the database behind the stores (readiness probes).
#[async_trait]
pub trait Health: Send + Sync + 'static {
    /// Succeeds when the database answers a trivial query.
    async fn ping(&self) -> Result<()>;
}

#[async_trait]
impl Health for SqlStore {
    async fn ping(&self) -> Result<()> {
        SqlStore::ping(self).await
    }
}

/// The store handles a role needs, as trait objects so each can be replaced (axum's
/// `Arc<dyn Repo>` pattern). Cloning is cheap.
#[derive(Clone)]
pub struct Stores {
    /// Host events.
    pub events: Arc<dyn EventLog>,
    /// Transactional outbox.
    pub outbox: Arc<dyn Outbox>,
    /// Runs and result items.
    pub runs: Arc<dyn RunLedger>,
    /// Conversation transcript.
    pub transcript: Arc<dyn Transcript>,
    /// Artifacts.
    pub artifacts: Arc<dyn ArtifactStore>,
    /// Agent state.
    pub state: Arc<dyn StateStore>,
    /// Plugin / workspace storage.
    pub storage: Arc<dyn BlobStorage>,
    /// Agents.
    pub agents: Arc<dyn AgentStore>,
    /// Registered runners.
    pub runners: Arc<dyn RunnerRegistry>,
    /// Workspaces and API keys.
    pub tenancy: Arc<dyn Tenancy>,
    /// Models, tools and knowledge bases.
    pub resources: Arc<dyn ResourceRegistry>,
    /// Schedules (interval / cron / one-shot triggers).
    pub schedules: Arc<dyn ScheduleStore>,
    /// Turn API sessions and turn identities.
    pub turns: Arc<dyn TurnStore>,
    /// Database liveness.
    pub health: Arc<dyn Health>,
}

impl Stores {
    /// Every trait backed by the same [`SqlStore`] (one shared pool).
    #[must_use]
    pub fn from_sql(store: SqlStore) -> Self {
        let store = Arc::new(store);
        Self {
            events: store.clone(),
            outbox: store.clone(),
            runs: store.clone(),
            transcript: store.clone(),
            artifacts: store.clone(),
            state: store.clone(),
            storage: store.clone(),
            agents: store.clone(),
            runners: store.clone(),
            tenancy: store.clone(),
            resources: store.clone(),
            schedules: store.clone(),
            turns: store.clone(),
            health: store,
        }
    }
}

impl std::fmt::Debug for Stores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stores").finish_non_exhaustive()
    }
}
