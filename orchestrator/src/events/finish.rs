//! The ends of an event that starts no run: unrouted, parked (`enqueue`), rejected
//! (`reject`), and leaving the conversation's parked queue.

use chrono::Utc;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::ids::RunId;
use sb_store::{EventRecord, EventStatus, EventStatusUpdate, RunStatus};
use serde_json::{Value, json};

use super::{EventRouter, RouteOutcome};
use crate::concurrency::{self, ConversationKey};
use crate::error::Result;
use crate::plan::UnroutedReason;

impl EventRouter {
    /// A formerly parked event that ends up not starting a run (unrouted, claimed, rejected,
    /// handled before) leaves the conversation's queue, and the next one gets its turn.
    pub(super) async fn leave_queue(&self, record: &EventRecord) -> Result<()> {
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

    /// `enqueue`: records why the event waits, adds it to the conversation's queue, then
    /// wakes the queue in case the conversation became free meanwhile.
    pub(super) async fn park(
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

    /// `reject`: the event is refused because the conversation is busy.
    pub(super) async fn reject(&self, record: &EventRecord, active: &[RunId]) -> Result<()> {
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

    pub(super) async fn unrouted(
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
}
