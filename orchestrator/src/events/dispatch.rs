//! Steps 4–9 of routing an event: the run's access, row, session, snapshot and job.

use std::collections::BTreeMap;

use chrono::Utc;
use sb_common::bus::PublishOptions;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::context::{AgentRunState, StateScope};
use sb_protocol::host::{AgentBinding, AgentEventEnvelope, AuthorizationSnapshot};
use sb_protocol::ids::RunId;
use sb_protocol::messages;
use sb_store::{
    EventRecord, EventStatus, EventStatusUpdate, NewRun, RunStart, RunStatus, StartReads,
    StoreError, TurnTag,
};
use serde_json::{Map, Value, json};
use tracing::Instrument;

use super::{EventRouter, RouteOutcome, StartContext};
use crate::access;
use crate::context;
use crate::error::Result;
use crate::journal;
use crate::plan::{self, Dispatch, PrepareInputs};
use crate::state_keys::{StateKeyParts, scope_key};

impl EventRouter {
    pub(super) async fn dispatch(
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

        // The state scopes the run's snapshot holds (step 6), read with the transcript's
        // cursor by the run's start (step 7).
        let scopes = state_scopes(envelope, binding);
        let reads = StartReads {
            latest_cursor: conversation.is_some(),
            state_scopes: scopes.iter().map(|(_, key)| key.clone()).collect(),
        };

        let now = Utc::now();
        let now_secs = plan::utc_to_epoch(now);
        let timeout = context::run_timeout(&binding.runner_config, options.default_run_timeout);
        let new_run = NewRun {
            // A turn's run takes the turn id chosen at receipt (the turn API answers with it
            // before the event is routed).
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
            deadline_at: context::deadline_at(now_secs, timeout).and_then(plan::epoch_to_utc),
            attempt: 1,
        };
        // The run's deadline is fixed by its first attempt (a redelivery reads it back); the
        // cursor and the state are filled in once read.
        let inputs = |run_id: RunId, deadline_at: Option<chrono::DateTime<Utc>>| PrepareInputs {
            run_id,
            now_epoch_secs: now_secs,
            deadline_at: deadline_at.map(plan::utc_to_epoch),
            access: access.clone(),
            latest_cursor: None,
            state: AgentRunState::default(),
            host_version: options.host_version.clone(),
            default_budgets: options.default_budgets,
            session_grace: options.session_grace,
            no_deadline_session_ttl: options.no_deadline_session_ttl,
            host_api_token: Some(mint_host_api_token()),
            accepted_at_ms: Some(record.created_at.timestamp_millis()),
        };
        let user_row = journal::user_transcript(envelope);

        // A fresh event (the usual case): the run, the user transcript row and the event's
        // dispatch in one commit, which reads the run's cursor and state as well. `None`
        // when the event has a run already (an earlier attempt created it): that one is
        // started the long way below.
        let started = match record.run_id {
            Some(_) => None,
            None => {
                let run_id = new_run.id.unwrap_or_default();
                let mut inputs = inputs(run_id, new_run.deadline_at);
                let frozen = Frozen::new(plan::authorization(envelope, dispatch, &inputs));
                let start_run = RunStart {
                    run: new_run.clone(),
                    user_transcript: user_row.clone(),
                    event: dispatched(run_id, &frozen.json, binding, dispatch, &start),
                    reads,
                };
                self.starts.submit(start_run).await??.map(|started| {
                    inputs.latest_cursor = started.latest_cursor;
                    inputs.state = run_state(envelope, binding, &scopes, started.state);
                    let prepared = plan::prepare(envelope, dispatch, inputs, frozen.snapshot);
                    (started.run, prepared, frozen.json)
                })
            }
        };
        let in_one_commit = started.is_some();
        let (run, prepared, snapshot_json, created) = match started {
            Some((run, prepared, json)) => (run, prepared, json, true),
            None => {
                let (run, created) = stores.runs.create_run(new_run).await?;
                if !created && run.status != RunStatus::Queued {
                    self.leave_queue(record).await?;
                    return Ok(RouteOutcome::AlreadyHandled);
                }
                // Read before the user row is written (when this attempt writes it).
                let cursor = async {
                    match conversation {
                        Some(c) => stores.transcript.latest_cursor(workspace, c).await,
                        None => Ok(None),
                    }
                };
                let keys: Vec<String> = scopes.iter().map(|(_, key)| key.clone()).collect();
                let (latest_cursor, values) =
                    tokio::try_join!(cursor, stores.state.snapshots(&keys))?;
                let mut inputs = inputs(run.id, run.deadline_at);
                inputs.latest_cursor = latest_cursor;
                inputs.state = run_state(envelope, binding, &scopes, values);
                let frozen = Frozen::new(plan::authorization(envelope, dispatch, &inputs));
                let prepared = plan::prepare(envelope, dispatch, inputs, frozen.snapshot);
                if let Some(item) = user_row {
                    match stores.transcript.append(item).await {
                        Ok(_) | Err(StoreError::Conflict(_)) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                (run, prepared, frozen.json, created)
            }
        };
        let span = tracing::info_span!("dispatch", run_id = %run.id, event_id = %record.id);
        async {
            // Visible to steering and concurrency only once its session exists (one step of
            // the session store writes both); leaves the queue only once it is visible (so
            // the queue's next event cannot start early).
            match &start.key {
                Some(key) => {
                    self.conversations
                        .put_session_and_add_run(key, run.id, &snapshot_json, prepared.session_ttl)
                        .await?;
                    if let Some(member) = &start.parked_member {
                        self.conversations.unpark(key, member).await?;
                    }
                }
                None => {
                    self.deps
                        .sessions
                        .put_session(&run.id, &snapshot_json, prepared.session_ttl)
                        .await?;
                }
            }
            if !in_one_commit {
                stores
                    .events
                    .update_status(
                        record.id,
                        dispatched(run.id, &snapshot_json, binding, dispatch, &start),
                    )
                    .await?;
            }

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
            tracing::debug!(created, in_one_commit, pool = %dispatch.pool, "run dispatched");
            Ok(RouteOutcome::Dispatched {
                run_id: run.id,
                created,
            })
        }
        .instrument(span)
        .await
    }
}

/// The state scopes of the run's snapshot, with their keys: every scope the binding's policy
/// enables that has a key for this event.
fn state_scopes(
    envelope: &AgentEventEnvelope,
    binding: &AgentBinding,
) -> Vec<(StateScope, String)> {
    let policy = &binding.state_policy;
    if !policy.is_enabled() {
        return Vec::new();
    }
    let parts = StateKeyParts::from_event(envelope, binding);
    StateScope::ALL
        .into_iter()
        .filter(|scope| policy.allows(*scope))
        .filter_map(|scope| scope_key(scope, &parts).map(|key| (scope, key)))
        .collect()
}

/// The run's state snapshot from the values read for its `scopes` (by scope key).
fn run_state(
    envelope: &AgentEventEnvelope,
    binding: &AgentBinding,
    scopes: &[(StateScope, String)],
    mut values: BTreeMap<String, BTreeMap<String, Value>>,
) -> AgentRunState {
    let mut loaded: BTreeMap<StateScope, Map<String, Value>> = scopes
        .iter()
        .map(|(scope, key)| {
            let scope_values = values.remove(key).unwrap_or_default();
            (*scope, scope_values.into_iter().collect())
        })
        .collect();
    context::state_snapshot(
        &binding.state_policy,
        envelope.conversation_id.as_deref(),
        |scope| loaded.remove(&scope),
    )
}

/// A run's frozen authorization and its JSON, serialized once: the session's value, and
/// (without the token's digest) the event's.
struct Frozen {
    snapshot: AuthorizationSnapshot,
    json: Value,
}

impl Frozen {
    fn new(snapshot: AuthorizationSnapshot) -> Self {
        let json = serde_json::to_value(&snapshot).unwrap_or(Value::Null);
        Self { snapshot, json }
    }
}

/// The event's routing update once its run is dispatched: `dispatched` with the run, and the
/// frozen authorization (its [`Frozen::json`]) for operators, without the token's digest (the
/// credential check belongs to the session alone; the result sink reads the rest after the
/// session ended).
fn dispatched(
    run_id: RunId,
    authorization: &Value,
    binding: &AgentBinding,
    dispatch: &Dispatch,
    start: &StartContext,
) -> EventStatusUpdate {
    let mut authorization = authorization.clone();
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
    EventStatusUpdate {
        status: EventStatus::Dispatched,
        reason: None,
        run_id: Some(run_id),
        claimed_by_run_id: None,
        metadata_merge: Some(metadata),
    }
}

/// A fresh remote Host API token: 32 random bytes (256 bits), base64url without padding.
///
/// Minted per dispatch attempt. A redelivered event whose run is still `queued` gets a new
/// token and the session is rewritten with its digest; a job published by the earlier
/// attempt, if a worker claims it, carries the earlier token, which the gateway then refuses
/// (`unauthorized`). Only the remote Host API is affected (runner processes of the worker
/// use the stdio wire), and only after an orchestrator lost an ack between publishing a job
/// and acknowledging its event's message (which may hold an outbox round's batch: every
/// routed event of it whose run is still queued is then routed again).
fn mint_host_api_token() -> String {
    use base64::Engine as _;
    use rand::RngCore as _;
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
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
