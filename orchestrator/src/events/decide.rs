//! Step 3 of routing an event of a conversation: the steering claim, then the agent's
//! concurrency policy (start, park, interrupt or reject).

use std::time::Duration;

use chrono::Utc;
use sb_common::bus::PublishOptions;
use sb_common::bus::topology::control_routing_key;
use sb_common::session::{PushOutcome, cancel_flag_key};
use sb_common::telemetry::{Metrics, names};
use sb_protocol::host::{AgentEventEnvelope, ConcurrencyPolicy};
use sb_protocol::ids::RunId;
use sb_protocol::messages::{self, ControlMessage};
use sb_store::{CancelOutcome, EventRecord, EventStatus, EventStatusUpdate, StoreError, TurnTag};
use serde_json::{Value, json};

use super::{EventRouter, RouteOutcome, StartContext};
use crate::concurrency::{self, Action, ConversationKey};
use crate::error::Result;
use crate::journal;
use crate::plan::{self, Dispatch};
use crate::steering::{self, ActiveRun};

/// How long a cancel flag set by `interrupt` outlives the cancelled run's deadline (or lives,
/// for a run without one): long enough for any worker to pick the job up and see it (the
/// gateway's cancel uses the same slack).
const CANCEL_FLAG_SLACK: Duration = Duration::from_secs(3600);
/// Life of the `steer-claim:<event_id>` marker: only redeliveries shortly after a crash
/// read it.
const STEER_CLAIM_MARKER_TTL: Duration = Duration::from_secs(3600);

impl EventRouter {
    /// Steps 3 (steering claim, concurrency policy) and the start of the run.
    pub(super) async fn decide(
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
}
