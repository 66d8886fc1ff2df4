//! Steps 0–2 of routing an event: the route lock, loading the event, resolving its binding
//! and runner (see the [module docs](super) for the whole pipeline).

use sb_common::session::ROUTING_EPOCH_KEY;
use sb_protocol::host::AgentEventEnvelope;
use sb_protocol::messages::EventMessage;
use sb_rules::bindings;
use sb_store::{EventRecord, EventStatus, EventTarget, RunStatus, TurnTag};

use super::{EventRouter, RouteOutcome};
use crate::error::{OrchestratorError, Result};
use crate::plan::{self, Plan, RunnerLookup};

impl EventRouter {
    /// Routes the event a message points to (see the module docs for the steps).
    ///
    /// Fails with [`OrchestratorError::RouteInProgress`] (transient: requeue) while another
    /// consumer routes the same event.
    pub async fn route(&self, message: &EventMessage) -> Result<RouteOutcome> {
        let lock = format!("route:{}", message.event_id);
        let holder = uuid::Uuid::new_v4().to_string();
        let sessions = &self.deps.sessions;
        let ttl = self.options.route_lock_ttl;
        // The routing epoch is read with the lock, before the lookups, so a change committed
        // meanwhile is seen next time.
        let (locked, epoch) = if self.cache.is_enabled() {
            sessions
                .acquire_lease_and_get(&lock, &holder, ttl, ROUTING_EPOCH_KEY)
                .await?
        } else {
            (sessions.acquire_lease(&lock, &holder, ttl).await?, None)
        };
        if !locked {
            return Err(OrchestratorError::RouteInProgress(message.event_id));
        }
        let outcome = self.route_locked(message, epoch.as_deref()).await;
        if let Err(error) = sessions.release_lease(&lock, &holder).await {
            tracing::warn!(%error, "could not release the route lock; it expires with its ttl");
        }
        outcome
    }

    /// Steps 1–2 under the route lock; `epoch` is the routing epoch read with the lock.
    async fn route_locked(
        &self,
        message: &EventMessage,
        epoch: Option<&[u8]>,
    ) -> Result<RouteOutcome> {
        let stores = &self.deps.stores;
        let record = self
            .reads
            .event(message.event_id)
            .await?
            .filter(|r| r.workspace_id == message.workspace_id)
            .ok_or(OrchestratorError::EventNotFound(message.event_id))?;

        match record.status {
            EventStatus::Unrouted | EventStatus::Rejected | EventStatus::Claimed => {
                self.leave_queue(&record).await?;
                return Ok(RouteOutcome::AlreadyHandled);
            }
            EventStatus::Received | EventStatus::Scheduled | EventStatus::Dispatched => {}
        }
        if let Some(run_id) = record.run_id {
            if let Some(run) = stores.runs.get_run(run_id).await? {
                if run.status != RunStatus::Queued {
                    // The job was published and claimed (or the run ended): nothing to redo.
                    self.leave_queue(&record).await?;
                    return Ok(RouteOutcome::AlreadyHandled);
                }
            }
        }

        let envelope = decode_envelope(&record)?;
        let candidates = self.candidates(&envelope.workspace_id, epoch).await?;
        // A turn's event goes to its session's agent, an addressed event to the agent it
        // names, whatever the scopes say.
        let target = TurnTag::from_metadata(&envelope.metadata)
            .map(|tag| tag.agent_id)
            .or_else(|| EventTarget::from_metadata(&envelope.metadata).map(|t| t.agent_id));
        let resolution = bindings::resolve_event(&envelope, &candidates, target.as_ref());
        let lookup = match &resolution {
            bindings::Resolution::Matched(binding) => {
                Some(self.lookup_runner(binding, epoch).await?)
            }
            _ => None,
        };
        let plan = plan::plan(resolution, |_| lookup.unwrap_or(RunnerLookup::Missing));

        match plan {
            Plan::Unrouted { reason, metadata } => {
                self.unrouted(&record, reason, metadata).await?;
                self.leave_queue(&record).await?;
                Ok(RouteOutcome::Unrouted(reason))
            }
            Plan::Dispatch(dispatch) => self.decide(&record, &envelope, &dispatch).await,
        }
    }
}

fn decode_envelope(record: &EventRecord) -> Result<AgentEventEnvelope> {
    let bad = |reason: String| OrchestratorError::BadEnvelope {
        event_id: record.id,
        reason,
    };
    let value = record
        .envelope
        .clone()
        .ok_or_else(|| bad("the event has no envelope".into()))?;
    let envelope: AgentEventEnvelope =
        serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
    if envelope.event_id != record.id || envelope.workspace_id != record.workspace_id {
        return Err(bad("the envelope's ids differ from the event row".into()));
    }
    Ok(envelope)
}
