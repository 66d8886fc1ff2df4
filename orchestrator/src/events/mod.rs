//! The event consumer: one loop per events shard turning `switchboard.event/1` pointers into
//! runs, steering claims, parked or rejected events (SPEC §2 step 2, §7).
//!
//! For one event, in this order (every step is idempotent, so a redelivered event redoes
//! them without effect beyond the first time):
//!
//! 0. take the event's route lock (a session-store lease `route:<event_id>`): a copy of the
//!    event that another orchestrator is routing right now is requeued, so one event is never
//!    both claimed and dispatched, claimed twice, or parked behind its own run;
//! 1. load the event from the event log (the message is only a pointer); an event already
//!    `unrouted`/`rejected`/`claimed`, or whose run has left `queued`, is done;
//! 2. resolve one binding among the workspace's enabled agents ([`crate::bindings`]) and
//!    look its runner up in the registry; no match / a tie / no runner → the event becomes
//!    `unrouted` with reason `binding.not_found` / `binding.ambiguous` / `runner.not_found`
//!    and no run is created. An event that names its agent (a turn of the turn API,
//!    `metadata.turn`, see [`sb_store::TurnTag`]: its session's agent; or `agent_id` on
//!    ingest, `metadata.target`, see [`sb_store::EventTarget`]) goes to that agent whatever
//!    the scopes say ([`sb_rules::bindings::resolve_target`]), or is unrouted with
//!    `binding.target_unavailable` when the agent can no longer take it;
//! 3. for an event of a conversation without a run yet: the conversation's active runs
//!    ([`crate::conversations`]); a `message.received` that an active run can absorb
//!    ([`crate::steering::target`]) is pushed to that run's steering list and becomes
//!    `claimed` (a full list or a vanished run falls through); otherwise the agent's
//!    concurrency policy ([`crate::concurrency::decide`]) starts it, parks it (`enqueue`),
//!    cancels the active runs first (`interrupt`) or rejects it (`reject`);
//! 4. effective access ([`crate::access`]) from the manifest, the policy, the config and the
//!    resource catalog;
//! 5. the transcript's latest cursor (before this event's own row);
//! 6. the run row (`queued`, unique on the event: a redelivery gets the existing run back,
//!    with its id and its deadline, which are never recomputed); a turn's run takes the
//!    turn id chosen at receipt, and a turn is never absorbed as steering input in step 3;
//! 7. the state snapshot, the context, the frozen snapshot and the job ([`crate::plan`]),
//!    with a freshly minted remote Host API token (`ctx.runtime.metadata.host_api`; the
//!    snapshot keeps its SHA-256 only);
//! 8. the user transcript row (deterministic id: written once);
//! 9. the session (TTL = deadline + grace) in the session store, then the run in the
//!    conversation's active index (and, for a formerly parked event, out of the queue);
//! 10. the event → `dispatched` with the run id, and the frozen snapshot under
//!     `metadata.authorization` (the result sink reads it after the session has ended;
//!     without the digest of the run's remote Host API token, which only the session keeps);
//! 11. the job to `switchboard.runs.<pool>`, awaited until the broker confirms;
//! 12. the event delivery is acked.
//!
//! If the job publish fails, the delivery is requeued (transient) and the next attempt
//! republishes the job of the same, still `queued`, run (the policy is not asked again: it
//! already said "start"). A job published twice for one run is harmless: only one worker can
//! claim a run (`queued → running`).
//!
//! # Steering claims and redelivery
//! The claim pushes first and records second, so a crash in between can at worst push the
//! item again on redelivery (at-least-once: items carry their `event.event_id` for runners
//! that deduplicate); a `steer-claim:<event_id>` marker written right after the push
//! narrows that window to the two session-store calls.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sb_common::bus::topology::control_routing_key;
use sb_common::bus::{ConsumeOptions, Delivery, PublishOptions};
use sb_common::session::{PushOutcome, cancel_flag_key, routing_epoch};
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::context::StateScope;
use sb_protocol::host::{
    AgentBinding, AgentEventEnvelope, AgentRunnerDescriptor, ConcurrencyPolicy,
};
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::messages::{self, ControlMessage, EventMessage};
use sb_rules::bindings::{self, AgentCandidate};
use sb_store::{
    CancelOutcome, EventRecord, EventStatus, EventStatusUpdate, EventTarget, NewRun, RunStatus,
    StoreError, TurnTag,
};
use serde_json::{Map, Value, json};
use tracing::Instrument;

use crate::access;
use crate::concurrency::{self, Action, ConversationKey};
use crate::context;
use crate::conversations::Conversations;
use crate::deps::{OrchestratorDeps, OrchestratorOptions};
use crate::error::{OrchestratorError, Result};
use crate::journal;
use crate::plan::{self, Dispatch, Plan, PrepareInputs, RunnerLookup, UnroutedReason};
use crate::route_cache::RouteCache;
use crate::settle::{pause, settle};
use crate::state_keys::{StateKeyParts, scope_key};
use crate::steering::{self, ActiveRun};

/// How long a cancel flag set by `interrupt` outlives the cancelled run's deadline (or lives,
/// for a run without one): long enough for any worker to pick the job up and see it (the
/// gateway's cancel uses the same slack).
const CANCEL_FLAG_SLACK: Duration = Duration::from_secs(3600);
/// Life of the `steer-claim:<event_id>` marker: only redeliveries shortly after a crash
/// read it.
const STEER_CLAIM_MARKER_TTL: Duration = Duration::from_secs(3600);

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
    /// An active run absorbed the message as steering input (event `claimed`).
    Claimed {
        /// The absorbing run.
        run_id: RunId,
    },
    /// `enqueue`: the event waits (status `received`) until the conversation is free.
    Parked {
        /// The active runs it waits for (empty when it waits behind parked events only).
        behind: Vec<RunId>,
    },
    /// `reject`: the conversation was busy (event `rejected`).
    Rejected {
        /// The active runs.
        active: Vec<RunId>,
    },
    /// The event had already been handled (terminal routing status, or its run has started).
    AlreadyHandled,
}

/// Routes events; shared by the shard loops.
#[derive(Debug)]
pub struct EventRouter {
    deps: OrchestratorDeps,
    options: Arc<OrchestratorOptions>,
    conversations: Conversations,
    /// The workspace's agents and the runners' descriptors, as last read.
    cache: RouteCache,
}

/// How a run is started for an event of a conversation.
#[derive(Debug, Default)]
struct StartContext {
    /// The conversation (its active index gets the run).
    key: Option<ConversationKey>,
    /// The event's parked-queue member, removed once the run is in the active index.
    parked_member: Option<String>,
    /// Merged into the event's metadata as `concurrency`.
    concurrency: Option<Value>,
}

impl EventRouter {
    /// A router over `deps`.
    #[must_use]
    pub fn new(deps: OrchestratorDeps, options: Arc<OrchestratorOptions>) -> Self {
        let conversations = deps.conversations(&options);
        let cache = RouteCache::new(options.route_cache_max_age);
        Self {
            deps,
            options,
            conversations,
            cache,
        }
    }

    /// Routes the event a message points to (see the module docs for the steps).
    ///
    /// Fails with [`OrchestratorError::RouteInProgress`] (transient: requeue) while another
    /// consumer routes the same event.
    pub async fn route(&self, message: &EventMessage) -> Result<RouteOutcome> {
        let lock = format!("route:{}", message.event_id);
        let holder = uuid::Uuid::new_v4().to_string();
        let sessions = &self.deps.sessions;
        if !sessions
            .acquire_lease(&lock, &holder, self.options.route_lock_ttl)
            .await?
        {
            return Err(OrchestratorError::RouteInProgress(message.event_id));
        }
        let outcome = self.route_locked(message).await;
        if let Err(error) = sessions.release_lease(&lock, &holder).await {
            tracing::warn!(%error, "could not release the route lock; it expires with its ttl");
        }
        outcome
    }

    async fn route_locked(&self, message: &EventMessage) -> Result<RouteOutcome> {
        let stores = &self.deps.stores;
        let record = stores
            .events
            .get(message.event_id)
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
        // Read before the lookups, so a change committed meanwhile is seen next time.
        let epoch = if self.cache.is_enabled() {
            routing_epoch(self.deps.sessions.as_ref()).await?
        } else {
            None
        };
        let candidates = self
            .candidates(&envelope.workspace_id, epoch.as_deref())
            .await?;
        // A turn's event goes to its session's agent, an addressed event to the agent it
        // names, whatever the scopes say.
        let target = TurnTag::from_metadata(&envelope.metadata)
            .map(|tag| tag.agent_id)
            .or_else(|| EventTarget::from_metadata(&envelope.metadata).map(|t| t.agent_id));
        let resolution = bindings::resolve_event(&envelope, &candidates, target.as_ref());
        let lookup = match &resolution {
            bindings::Resolution::Matched(binding) => {
                Some(self.lookup_runner(binding, epoch.as_deref()).await?)
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

    /// A formerly parked event that ends up not starting a run (unrouted, claimed, rejected,
    /// handled before) leaves the conversation's queue, and the next one gets its turn.
    async fn leave_queue(&self, record: &EventRecord) -> Result<()> {
        let Some(member) = concurrency::recorded_member(&record.metadata) else {
            return Ok(());
        };
        let Some(key) =
            ConversationKey::new(&record.workspace_id, record.conversation_id.as_deref())
        else {
            return Ok(());
        };
        if self.conversations.unpark(&key, &member).await? {
            self.conversations.kick(&key).await?;
        }
        Ok(())
    }

    /// Steps 3 (steering claim, concurrency policy) and the start of the run.
    async fn decide(
        &self,
        record: &EventRecord,
        envelope: &AgentEventEnvelope,
        dispatch: &Dispatch,
    ) -> Result<RouteOutcome> {
        let Some(key) =
            ConversationKey::new(&envelope.workspace_id, envelope.conversation_id.as_deref())
        else {
            return self
                .dispatch(record, envelope, dispatch, StartContext::default())
                .await;
        };
        let own_member = concurrency::recorded_member(&record.metadata);
        if record.run_id.is_some() {
            // An earlier attempt decided to start and created the run: finish starting it.
            let start = StartContext {
                key: Some(key),
                parked_member: own_member,
                concurrency: None,
            };
            return self.dispatch(record, envelope, dispatch, start).await;
        }

        // A turn is a run of its own (its id is the run id): never absorbed as steering.
        let is_turn = TurnTag::from_metadata(&envelope.metadata).is_some();
        let policy = dispatch.binding.delivery_policy.concurrency;
        let may_steer = !is_turn && dispatch.descriptor.supports_steering();
        let active = if concurrency::needs_active_runs(policy, may_steer) {
            self.conversations.active(&key, None).await?
        } else {
            Vec::new()
        };
        let steering_target = if is_turn {
            None
        } else {
            steering::target(
                envelope,
                &dispatch.binding.runner_id,
                dispatch.descriptor.supports_steering(),
                &active,
            )
        };
        if let Some(target) = steering_target {
            if let Some(run_id) = self.claim(record, envelope, &key, target).await? {
                self.leave_queue(record).await?;
                return Ok(RouteOutcome::Claimed { run_id });
            }
        }

        let parked = if policy == ConcurrencyPolicy::Enqueue {
            self.conversations.parked(&key).await?
        } else {
            Vec::new()
        };
        let ahead = concurrency::parked_ahead(&parked, own_member.as_deref());
        let active_ids: Vec<RunId> = active.iter().map(|r| r.run_id).collect();
        match concurrency::decide(policy, &active_ids, ahead) {
            Action::Start => {
                let concurrency = own_member.as_ref().map(|_| {
                    let mut c = record
                        .metadata
                        .get("concurrency")
                        .cloned()
                        .unwrap_or_else(|| json!({}));
                    c["status"] = json!(concurrency::STATUS_STARTED);
                    c
                });
                let start = StartContext {
                    key: Some(key),
                    parked_member: own_member,
                    concurrency,
                };
                self.dispatch(record, envelope, dispatch, start).await
            }
            Action::Park { behind } => self.park(record, &key, own_member, behind).await,
            Action::Interrupt { cancel } => {
                self.interrupt(record, &active, &cancel).await?;
                let start = StartContext {
                    key: Some(key),
                    parked_member: own_member,
                    concurrency: Some(json!({
                        "policy": "interrupt",
                        "interrupted_run_ids": cancel.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    })),
                };
                self.dispatch(record, envelope, dispatch, start).await
            }
            Action::Reject { active } => {
                self.reject(record, &active).await?;
                self.leave_queue(record).await?;
                Ok(RouteOutcome::Rejected { active })
            }
        }
    }

    /// Pushes the message to `target`'s steering list and records the claim. `None` when the
    /// list is full or the run is gone (the event then follows the concurrency policy).
    async fn claim(
        &self,
        record: &EventRecord,
        envelope: &AgentEventEnvelope,
        key: &ConversationKey,
        target: &ActiveRun,
    ) -> Result<Option<RunId>> {
        let sessions = &self.deps.sessions;
        let marker = format!("steer-claim:{}", record.id);
        let runner_id = target
            .snapshot
            .as_ref()
            .map_or_else(String::new, |s| s.runner_id.to_string());
        // An earlier attempt that pushed and then failed to record left this marker.
        let earlier: Option<(RunId, i64)> = sessions
            .get(&marker)
            .await?
            .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
            .and_then(|v| {
                let run = v.get("run_id")?.as_str()?.parse().ok()?;
                Some((run, v.get("claimed_at")?.as_i64()?))
            });
        let (run_id, claimed_at) = match earlier {
            Some(claim) => claim,
            None => {
                let claimed_at = Utc::now().timestamp();
                let Some(snapshot) = &target.snapshot else {
                    return Ok(None);
                };
                let item = steering::item(envelope, target.run_id, &snapshot.runner_id, claimed_at);
                let item = serde_json::to_value(&item).unwrap_or(Value::Null);
                match sessions
                    .steering_push(&target.run_id, &item, self.options.steering_queue_cap)
                    .await?
                {
                    PushOutcome::Accepted => {}
                    PushOutcome::Full => {
                        tracing::info!(run_id = %target.run_id, "steering list full; the message is dispatched normally");
                        return Ok(None);
                    }
                    PushOutcome::NoSession => {
                        self.conversations.remove_run(key, target.run_id).await?;
                        return Ok(None);
                    }
                }
                let value = json!({"run_id": target.run_id.to_string(), "claimed_at": claimed_at});
                if let Err(error) = sessions
                    .set_ex(
                        &marker,
                        value.to_string().as_bytes(),
                        STEER_CLAIM_MARKER_TTL,
                    )
                    .await
                {
                    tracing::warn!(%error, "could not write the steering claim marker");
                }
                (target.run_id, claimed_at)
            }
        };

        let stores = &self.deps.stores;
        if let Some(item) = journal::user_transcript(envelope) {
            match stores.transcript.append(item).await {
                Ok(_) | Err(StoreError::Conflict(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        stores
            .events
            .update_status(
                record.id,
                EventStatusUpdate {
                    status: EventStatus::Claimed,
                    reason: None,
                    run_id: None,
                    claimed_by_run_id: Some(run_id),
                    metadata_merge: Some(json!({
                        "steering": steering::claim_metadata(run_id, &runner_id, claimed_at),
                    })),
                },
            )
            .await?;
        if let Err(error) = sessions.del(&marker).await {
            tracing::debug!(%error, "could not remove the steering claim marker");
        }
        tracing::info!(event_id = %record.id, run_id = %run_id, "message claimed as steering input");
        Metrics::global().inc(names::EVENTS_ROUTED_TOTAL, &[("outcome", "claimed")]);
        Ok(Some(run_id))
    }

    /// `enqueue`: records why the event waits, adds it to the conversation's queue, then
    /// wakes the queue in case the conversation became free meanwhile.
    async fn park(
        &self,
        record: &EventRecord,
        key: &ConversationKey,
        own_member: Option<String>,
        behind: Vec<RunId>,
    ) -> Result<RouteOutcome> {
        let member = own_member.unwrap_or_else(|| {
            concurrency::parked_member(Utc::now().timestamp_micros(), record.id)
        });
        // The metadata first: every member's event says it is parked (`leave_queue` relies
        // on it), and a redelivery reuses the same member (its place in the queue).
        self.deps
            .stores
            .events
            .update_status(
                record.id,
                EventStatusUpdate {
                    status: EventStatus::Received,
                    reason: None,
                    run_id: None,
                    claimed_by_run_id: None,
                    metadata_merge: Some(json!({
                        "concurrency": {
                            "policy": "enqueue",
                            "status": concurrency::STATUS_QUEUED,
                            "queued_behind": behind.iter().map(ToString::to_string).collect::<Vec<_>>(),
                            "ticket": member,
                        }
                    })),
                },
            )
            .await?;
        self.conversations.park(key, &member).await?;
        self.conversations.kick(key).await?;
        tracing::info!(event_id = %record.id, behind = behind.len(), "event parked until the conversation is free");
        Metrics::global().inc(names::EVENTS_ROUTED_TOTAL, &[("outcome", "parked")]);
        Ok(RouteOutcome::Parked { behind })
    }

    /// `interrupt`: records the cancel intent, sets each run's cancel flag, then publishes
    /// its cancel message (the order the worker relies on).
    async fn interrupt(
        &self,
        record: &EventRecord,
        active: &[ActiveRun],
        cancel: &[RunId],
    ) -> Result<()> {
        let reason = concurrency::interrupt_reason(&record.id);
        for &run_id in cancel {
            match self
                .deps
                .stores
                .runs
                .request_cancel(run_id, Some(reason.clone()))
                .await
            {
                Ok(CancelOutcome::AlreadyFinished(_)) | Err(StoreError::NotFound(_)) => continue,
                Ok(CancelOutcome::Requested | CancelOutcome::AlreadyRequested) => {}
                Err(e) => return Err(e.into()),
            }
            let deadline = active
                .iter()
                .find(|r| r.run_id == run_id)
                .and_then(|r| r.snapshot.as_ref()?.deadline_at);
            let remaining = deadline
                .map(|d| d - plan::utc_to_epoch(Utc::now()))
                .and_then(|secs| Duration::try_from_secs_f64(secs.max(0.0)).ok())
                .unwrap_or_default();
            self.deps
                .sessions
                .set_ex(
                    &cancel_flag_key(&run_id),
                    reason.as_bytes(),
                    remaining + CANCEL_FLAG_SLACK,
                )
                .await?;
            let message = ControlMessage::Cancel {
                run_id,
                reason: reason.clone(),
            };
            self.deps
                .bus
                .publish(
                    &self.deps.topology.control_exchange(),
                    &control_routing_key(&run_id),
                    messages::encode(&message).into(),
                    // Nobody may hold the run yet (queued): the flag covers that case.
                    PublishOptions::best_effort(),
                )
                .await?;
            tracing::info!(event_id = %record.id, run_id = %run_id, "active run interrupted");
        }
        Ok(())
    }

    /// `reject`: the event is refused because the conversation is busy.
    async fn reject(&self, record: &EventRecord, active: &[RunId]) -> Result<()> {
        self.deps
            .stores
            .events
            .update_status(
                record.id,
                EventStatusUpdate {
                    status: EventStatus::Rejected,
                    reason: Some(concurrency::REJECT_REASON.to_owned()),
                    run_id: None,
                    claimed_by_run_id: None,
                    metadata_merge: Some(json!({
                        "concurrency": {
                            "policy": "reject",
                            "active_run_ids": active.iter().map(ToString::to_string).collect::<Vec<_>>(),
                        }
                    })),
                },
            )
            .await?;
        tracing::info!(event_id = %record.id, "event rejected: the conversation has an active run");
        Metrics::global().inc(names::EVENTS_ROUTED_TOTAL, &[("outcome", "rejected")]);
        Ok(())
    }

    /// The workspace's enabled agents as resolver candidates (an agent whose row does not
    /// parse is skipped, with a warning), from the cache when it holds them under `epoch`.
    async fn candidates(
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
    async fn lookup_runner(
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

    async fn unrouted(
        &self,
        record: &EventRecord,
        reason: UnroutedReason,
        metadata: Value,
    ) -> Result<()> {
        // A queued run left from an earlier attempt whose binding no longer resolves must not
        // stay queued forever.
        // Ended with a terminal item, like every run (a stream reader that sees the status
        // finds the item: issue 15 finding 4).
        if let Some(run_id) = record.run_id {
            const MESSAGE: &str = "the event no longer resolves to the run's binding";
            let outcome =
                sb_store::RunOutcome::with_error(RunStatus::Failed, reason.as_str(), MESSAGE);
            let item =
                sb_protocol::result::AgentRunResult::run_failed(reason.as_str(), MESSAGE, false);
            self.deps
                .stores
                .runs
                .finalize_run(run_id, outcome, item)
                .await?;
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
        Metrics::global().inc(names::EVENTS_ROUTED_TOTAL, &[("outcome", "unrouted")]);
        Ok(())
    }

    async fn dispatch(
        &self,
        record: &EventRecord,
        envelope: &AgentEventEnvelope,
        dispatch: &Dispatch,
        start: StartContext,
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
            access::ExistingResources::default()
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
                // A turn's run takes the turn id chosen at receipt (the turn API answers
                // with it before the event is routed).
                id: Some(
                    TurnTag::from_metadata(&envelope.metadata)
                        .map_or_else(RunId::new, |tag| tag.turn_id),
                ),
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
            self.leave_queue(record).await?;
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
                    default_budgets: options.default_budgets,
                    session_grace: options.session_grace,
                    no_deadline_session_ttl: options.no_deadline_session_ttl,
                    host_api_token: Some(mint_host_api_token()),
                    accepted_at_ms: Some(record.created_at.timestamp_millis()),
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
            // Visible to steering and concurrency only once its session exists; leaves the
            // queue only once it is visible (so the queue's next event cannot start early).
            if let Some(key) = &start.key {
                self.conversations.add_run(key, run.id, prepared.session_ttl).await?;
                if let Some(member) = &start.parked_member {
                    self.conversations.unpark(key, member).await?;
                }
            }

            // The event keeps the frozen authorization for operators, without the token's
            // digest: the credential check belongs to the session alone.
            let mut authorization = snapshot_json;
            if let Some(fields) = authorization.as_object_mut() {
                fields.remove("host_api_token_sha256");
            }
            let mut metadata = json!({
                "authorization": authorization,
                "routing": {"binding_id": binding.binding_id, "runner_id": binding.runner_id.to_string(), "pool": dispatch.pool},
            });
            if let Some(concurrency) = &start.concurrency {
                metadata["concurrency"] = concurrency.clone();
            }

            stores
                .events
                .update_status(
                    record.id,
                    EventStatusUpdate {
                        status: EventStatus::Dispatched,
                        reason: None,
                        run_id: Some(run.id),
                        claimed_by_run_id: None,
                        metadata_merge: Some(metadata),
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
            Metrics::global().inc(names::BUS_PUBLISHED_TOTAL, &[("exchange", "runs")]);
            Metrics::global().inc(names::EVENTS_ROUTED_TOTAL, &[("outcome", "dispatched")]);
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
            let scopes: Vec<(StateScope, String)> = StateScope::ALL
                .into_iter()
                .filter(|scope| policy.allows(*scope))
                .filter_map(|scope| scope_key(scope, &parts).map(|key| (scope, key)))
                .collect();
            // Every enabled scope in one read.
            let keys: Vec<String> = scopes.iter().map(|(_, key)| key.clone()).collect();
            let values = self.deps.stores.state.snapshots(&keys).await?;
            for (scope, key) in scopes {
                let scope_values = values.get(&key).cloned().unwrap_or_default();
                loaded.insert(scope, scope_values.into_iter().collect());
            }
        }
        Ok(context::state_snapshot(
            policy,
            envelope.conversation_id.as_deref(),
            |scope| loaded.remove(&scope),
        ))
    }

    /// Routes a consumed event message. While another consumer holds the event's route lock,
    /// waits here (polling, up to `route_lock_ttl`) instead of requeueing at once: every
    /// requeue counts against the queue's delivery limit, and the lock of a consumer that
    /// died mid-route outlives a few quick retries — the event would be dead-lettered, never
    /// routed (found by the chaos suite's `kill_orchestrator`).
    ///
    /// For the same reason it waits in place, with the retry backoff and until shutdown,
    /// while the ledger or the session store is unreachable
    /// ([`OrchestratorError::is_backend_outage`]): a database restart outlasts the quick
    /// retries of the delivery limit.
    async fn handle(&self, delivery: &Delivery, shutdown: &Shutdown) -> Result<RouteOutcome> {
        let message: EventMessage = messages::decode(&delivery.body)?;
        let span = tracing::info_span!("route", event_id = %message.event_id);
        let give_up = tokio::time::Instant::now() + self.options.route_lock_ttl;
        let mut outages = 0u32;
        loop {
            match self.route(&message).instrument(span.clone()).await {
                Err(OrchestratorError::RouteInProgress(_))
                    if tokio::time::Instant::now() < give_up =>
                {
                    tokio::time::sleep(ROUTE_LOCK_POLL).await;
                }
                Err(error) if error.is_backend_outage() && !shutdown.is_shutting_down() => {
                    tracing::warn!(%error, event_id = %message.event_id, attempt = outages, "backend unreachable; retrying the event in place");
                    if !pause(self.options.retry_delay(outages), shutdown).await {
                        return Err(error);
                    }
                    outages = outages.saturating_add(1);
                }
                outcome => return outcome,
            }
        }
    }
}

/// How often a consumer waiting for another's route lock tries again (see `handle`).
const ROUTE_LOCK_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// A fresh remote Host API token: 32 random bytes (256 bits), base64url without padding.
///
/// Minted per dispatch attempt. A redelivered event whose run is still `queued` gets a new
/// token and the session is rewritten with its digest; a job published by the earlier
/// attempt, if a worker claims it, carries the earlier token, which the gateway then refuses
/// (`unauthorized`). Only the remote Host API is affected (runner processes of the worker
/// use the stdio wire), and only after an orchestrator lost an ack between publishing a job
/// and acknowledging its event.
fn mint_host_api_token() -> String {
    use base64::Engine as _;
    use rand::RngCore as _;
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
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
                if !pause(options.retry.max, &shutdown).await {
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
                    let outcome = router.handle(&delivery, &shutdown).await.map(|_| ());
                    settle(delivery, &outcome, &queue.name, &options, &shutdown).await;
                }
                Err(error) => {
                    tracing::warn!(%error, queue = %queue.name, "subscription ended; resubscribing");
                    if !pause(options.retry.initial, &shutdown).await {
                        return;
                    }
                    continue 'subscribe;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_api_tokens_are_256_random_bits_in_base64url() {
        let a = mint_host_api_token();
        let b = mint_host_api_token();
        assert_eq!(a.len(), 43, "32 bytes, unpadded");
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        );
        assert_ne!(a, b);
    }
}
