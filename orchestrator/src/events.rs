//! The event consumer: one loop per events shard turning `switchboard.event/1` pointers into
//! runs (SPEC §2 step 2).
//!
//! For one event, in this order (every step is idempotent, so a redelivered event redoes
//! them without effect beyond the first time):
//!
//! 1. load the event from the event log (the message is only a pointer); an event already
//!    `unrouted`/`rejected`/`claimed`, or whose run has left `queued`, is done;
//! 2. resolve one binding among the workspace's enabled agents ([`crate::bindings`]) and
//!    look its runner up in the registry; no match / a tie / no runner → the event becomes
//!    `unrouted` with reason `binding.not_found` / `binding.ambiguous` / `runner.not_found`
//!    and no run is created;
//! 3. effective access ([`crate::access`]) from the manifest, the policy, the config and the
//!    resource catalog;
//! 4. the transcript's latest cursor (before this event's own row);
//! 5. the run row (`queued`, unique on the event: a redelivery gets the existing run back,
//!    with its id and its deadline, which are never recomputed);
//! 6. the state snapshot, the context, the frozen snapshot and the job ([`crate::plan`]);
//! 7. the user transcript row (deterministic id: written once);
//! 8. the session (TTL = deadline + grace) in the session store;
//! 9. the event → `dispatched` with the run id, and the frozen snapshot under
//!    `metadata.authorization` (the result sink reads it after the session has ended);
//! 10. the job to `switchboard.runs.<pool>`, awaited until the broker confirms;
//! 11. the event delivery is acked.
//!
//! If the job publish fails, the delivery is requeued (transient) and the next attempt
//! republishes the job of the same, still `queued`, run. A job published twice for one run
//! is harmless: only one worker can claim a run (`queued → running`).

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::Utc;
use sb_common::bus::{ConsumeOptions, Delivery, PublishOptions};
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Registry, names};
use sb_protocol::context::StateScope;
use sb_protocol::host::{AgentBinding, AgentEventEnvelope, AgentRunnerDescriptor};
use sb_protocol::ids::RunId;
use sb_protocol::messages::{self, EventMessage};
use sb_store::{EventRecord, EventStatus, EventStatusUpdate, NewRun, RunStatus, StoreError};
use serde_json::{Map, Value, json};
use tracing::Instrument;

use crate::access;
use crate::bindings::{self, AgentCandidate};
use crate::context;
use crate::error::{OrchestratorError, Result};
use crate::journal;
use crate::plan::{self, Dispatch, Plan, PrepareInputs, RunnerLookup, UnroutedReason};
use crate::service::{OrchestratorDeps, OrchestratorOptions, pause, settle};
use crate::state_keys::{StateKeyParts, scope_key};

/// What routing one event did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteOutcome {
    /// A run exists for the event and its job was published (`created` = by this call).
    Dispatched {
        /// The run.
        run_id: RunId,
        /// Whether this call created the run.
        created: bool,
    },
    /// The event starts no run.
    Unrouted(UnroutedReason),
    /// The event had already been handled (terminal routing status, or its run has started).
    AlreadyHandled,
}

/// Routes events; shared by the shard loops.
#[derive(Debug)]
pub struct EventRouter {
    deps: OrchestratorDeps,
    options: Arc<OrchestratorOptions>,
}

impl EventRouter {
    /// A router over `deps`.
    #[must_use]
    pub fn new(deps: OrchestratorDeps, options: Arc<OrchestratorOptions>) -> Self {
        Self { deps, options }
    }

    /// Routes the event a message points to (see the module docs for the steps).
    pub async fn route(&self, message: &EventMessage) -> Result<RouteOutcome> {
        let stores = &self.deps.stores;
        let record = stores
            .events
            .get(message.event_id)
            .await?
            .filter(|r| r.workspace_id == message.workspace_id)
            .ok_or(OrchestratorError::EventNotFound(message.event_id))?;

        match record.status {
            EventStatus::Unrouted | EventStatus::Rejected | EventStatus::Claimed => {
                return Ok(RouteOutcome::AlreadyHandled);
            }
            EventStatus::Received | EventStatus::Scheduled | EventStatus::Dispatched => {}
        }
        if let Some(run_id) = record.run_id {
            if let Some(run) = stores.runs.get_run(run_id).await? {
                if run.status != RunStatus::Queued {
                    // The job was published and claimed (or the run ended): nothing to redo.
                    return Ok(RouteOutcome::AlreadyHandled);
                }
            }
        }

        let envelope = decode_envelope(&record)?;
        let rows = stores.agents.list_enabled(&envelope.workspace_id).await?;
        let candidates: Vec<AgentCandidate> = rows
            .iter()
            .filter_map(|row| match AgentCandidate::from_row(row) {
                Ok(c) => Some(c),
                Err(error) => {
                    tracing::warn!(%error, "agent skipped by the resolver");
                    None
                }
            })
            .collect();
        let resolution = bindings::resolve(&envelope, &candidates);
        let lookup = match &resolution {
            bindings::Resolution::Matched(binding) => Some(self.lookup_runner(binding).await?),
            _ => None,
        };
        let plan = plan::plan(resolution, |_| lookup.unwrap_or(RunnerLookup::Missing));

        match plan {
            Plan::Unrouted { reason, metadata } => {
                self.unrouted(&record, reason, metadata).await?;
                Ok(RouteOutcome::Unrouted(reason))
            }
            Plan::Dispatch(dispatch) => self.dispatch(&record, &envelope, &dispatch).await,
        }
    }

    async fn lookup_runner(&self, binding: &AgentBinding) -> Result<RunnerLookup> {
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

    async fn unrouted(
        &self,
        record: &EventRecord,
        reason: UnroutedReason,
        metadata: Value,
    ) -> Result<()> {
        // A queued run left from an earlier attempt whose binding no longer resolves must not
        // stay queued forever.
        if let Some(run_id) = record.run_id {
            let outcome = sb_store::RunOutcome::with_error(
                RunStatus::Failed,
                reason.as_str(),
                "the event no longer resolves to the run's binding",
            );
            self.deps.stores.runs.finish_run(run_id, outcome).await?;
        }
        self.deps
            .stores
            .events
            .update_status(
                record.id,
                EventStatusUpdate {
                    status: EventStatus::Unrouted,
                    reason: Some(reason.as_str().to_owned()),
                    run_id: None,
                    claimed_by_run_id: None,
                    metadata_merge: Some(metadata),
                },
            )
            .await?;
        tracing::info!(event_id = %record.id, reason = reason.as_str(), "event unrouted");
        Registry::global().inc(names::EVENTS_ROUTED_TOTAL, &[("outcome", "unrouted")]);
        Ok(())
    }

    async fn dispatch(
        &self,
        record: &EventRecord,
        envelope: &AgentEventEnvelope,
        dispatch: &Dispatch,
    ) -> Result<RouteOutcome> {
        let stores = &self.deps.stores;
        let options = &self.options;
        let binding = &dispatch.binding;
        let workspace = &envelope.workspace_id;
        let conversation = envelope
            .conversation_id
            .as_deref()
            .filter(|c| !c.is_empty());

        // Effective access: only what exists is granted.
        let request = access::requested(&dispatch.descriptor, binding);
        let catalog = if request.is_empty() {
            access::Catalog::default()
        } else {
            self.deps.catalog.lookup(workspace, &request).await?
        };
        let access = access::effective_access(
            &dispatch.descriptor,
            binding,
            conversation.is_some(),
            &catalog,
        );

        // Read before this event's own user row is written.
        let latest_cursor = match conversation {
            Some(c) => stores.transcript.latest_cursor(workspace, c).await?,
            None => None,
        };

        let now = Utc::now();
        let now_secs = plan::utc_to_epoch(now);
        let timeout = context::run_timeout(&binding.runner_config, options.default_run_timeout);
        let deadline = context::deadline_at(now_secs, timeout);
        let (run, created) = stores
            .runs
            .create_run(NewRun {
                id: Some(RunId::new()),
                workspace_id: workspace.clone(),
                event_id: record.id,
                agent_id: binding.agent_id,
                runner_id: binding.runner_id.to_string(),
                pool: dispatch.pool.clone(),
                conversation_id: envelope.conversation_id.clone(),
                thread_id: envelope.thread_id.clone(),
                bot_id: envelope.bot_id.clone(),
                deadline_at: deadline.and_then(plan::epoch_to_utc),
                attempt: 1,
            })
            .await?;
        if !created && run.status != RunStatus::Queued {
            return Ok(RouteOutcome::AlreadyHandled);
        }
        let span = tracing::info_span!("dispatch", run_id = %run.id, event_id = %record.id);
        async {
            // The deadline is fixed by the first attempt.
            let deadline = run.deadline_at.map(plan::utc_to_epoch);

            let state = self.state_snapshot(envelope, binding).await?;
            let prepared = plan::prepare(
                envelope,
                dispatch,
                PrepareInputs {
                    run_id: run.id,
                    now_epoch_secs: now_secs,
                    deadline_at: deadline,
                    access,
                    latest_cursor,
                    state,
                    host_version: options.host_version.clone(),
                    session_grace: options.session_grace,
                    no_deadline_session_ttl: options.no_deadline_session_ttl,
                },
            );

            if let Some(item) = journal::user_transcript(envelope) {
                match stores.transcript.append(item).await {
                    Ok(_) | Err(StoreError::Conflict(_)) => {}
                    Err(e) => return Err(e.into()),
                }
            }

            let snapshot_json = serde_json::to_value(&prepared.snapshot).unwrap_or(Value::Null);
            self.deps.sessions.put_session(&run.id, &snapshot_json, prepared.session_ttl).await?;

            stores
                .events
                .update_status(
                    record.id,
                    EventStatusUpdate {
                        status: EventStatus::Dispatched,
                        reason: None,
                        run_id: Some(run.id),
                        claimed_by_run_id: None,
                        metadata_merge: Some(json!({
                            "authorization": snapshot_json,
                            "routing": {"binding_id": binding.binding_id, "runner_id": binding.runner_id.to_string(), "pool": dispatch.pool},
                        })),
                    },
                )
                .await?;

            let topology = &self.deps.topology;
            self.deps
                .bus
                .publish(
                    &topology.runs_exchange(),
                    &sb_common::bus::topology::runs_routing_key(&dispatch.pool),
                    messages::encode(&prepared.job).into(),
                    PublishOptions::default(),
                )
                .await?;
            Registry::global().inc(names::BUS_PUBLISHED_TOTAL, &[("exchange", "runs")]);
            Registry::global().inc(names::EVENTS_ROUTED_TOTAL, &[("outcome", "dispatched")]);
            tracing::debug!(created, pool = %dispatch.pool, "run dispatched");
            Ok(RouteOutcome::Dispatched { run_id: run.id, created })
        }
        .instrument(span)
        .await
    }

    /// The state snapshot: every enabled scope that has a key for this event and binding.
    async fn state_snapshot(
        &self,
        envelope: &AgentEventEnvelope,
        binding: &AgentBinding,
    ) -> Result<sb_protocol::context::AgentRunState> {
        let policy = &binding.state_policy;
        let mut loaded: BTreeMap<StateScope, Map<String, Value>> = BTreeMap::new();
        if policy.is_enabled() {
            let parts = StateKeyParts::from_event(envelope, binding);
            for scope in StateScope::ALL {
                if !policy.allows(scope) {
                    continue;
                }
                if let Some(key) = scope_key(scope, &parts) {
                    let values = self.deps.stores.state.snapshot(&key).await?;
                    loaded.insert(scope, values.into_iter().collect());
                }
            }
        }
        Ok(context::state_snapshot(
            policy,
            envelope.conversation_id.as_deref(),
            |scope| loaded.remove(&scope),
        ))
    }

    async fn handle(&self, delivery: &Delivery) -> Result<RouteOutcome> {
        let message: EventMessage = messages::decode(&delivery.body)?;
        let span = tracing::info_span!("route", event_id = %message.event_id);
        self.route(&message).instrument(span).await
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

/// Consumes events shard `shard` until shutdown: one event at a time, so the events of one
/// conversation are routed in order.
pub async fn run_shard(router: Arc<EventRouter>, shard: u32, shutdown: Shutdown) {
    let queue = router.deps.topology.events_queue(shard);
    let options = Arc::clone(&router.options);
    'subscribe: loop {
        let subscribe = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            s = router.deps.bus.subscribe(&queue, ConsumeOptions::prefetch(options.prefetch)) => s,
        };
        let mut subscription = match subscribe {
            Ok(s) => s,
            Err(error) => {
                tracing::warn!(%error, queue = %queue.name, "cannot subscribe; retrying");
                if !pause(options.retry_backoff_max, &shutdown).await {
                    return;
                }
                continue 'subscribe;
            }
        };
        loop {
            let delivery = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                d = subscription.next() => d,
            };
            match delivery {
                Ok(delivery) => {
                    let outcome = router.handle(&delivery).await.map(|_| ());
                    settle(delivery, &outcome, &queue.name, &options, &shutdown).await;
                }
                Err(error) => {
                    tracing::warn!(%error, queue = %queue.name, "subscription ended; resubscribing");
                    if !pause(options.retry_backoff, &shutdown).await {
                        return;
                    }
                    continue 'subscribe;
                }
            }
        }
    }
}
