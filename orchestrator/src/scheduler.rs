//! The scheduler: turns due schedules into host events (SPEC §1, §9).
//!
//! Every `scheduler_interval` it reads the due schedules and fires each one: the firing is
//! planned by the pure [`plan_firing`] (fire time, next fire time, the event copied from
//! the schedule's template, its bus announcement) and committed by
//! [`ScheduleStore::fire`](sb_store::ScheduleStore::fire), which advances the schedule with
//! a compare-and-set and appends the event with its outbox row in one transaction. The
//! fired event then enters the pipeline exactly like an ingested one: the outbox relay
//! publishes it to `switchboard.events` (at its next poll, `gateway.outbox_poll_interval`:
//! the relay runs in the gateway, which the scheduler cannot wake) and the event consumer
//! routes it.
//!
//! Every orchestrator runs a scheduler; they need no coordination. Each may read the same
//! due schedule, and the compare-and-set lets exactly one of them fire each fire time (the
//! others get `None` and move on). A scheduler that dies mid-firing leaves nothing behind
//! (the transaction rolls back), so the schedule is still due at the next scan.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use sb_common::bus::topology::Topology;
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Registry, names};
use sb_protocol::host::AgentEventEnvelope;
use sb_protocol::ids::EventId;
use sb_protocol::messages::{EventMessage, encode};
use sb_store::{
    NewOutboxMessage, ScheduleFiring, ScheduleRecord, ScheduleSpec, ScheduledEvent, StoreError,
};

use crate::error::Result;
use crate::service::{OrchestratorDeps, OrchestratorOptions};

/// The outbox row announcing an event on `switchboard.events`, sharded by conversation:
/// what ingest enqueues with every accepted event (the gateway's `POST /v1/events` and the
/// scheduler share it).
#[must_use]
pub fn event_announcement(topology: &Topology, envelope: &AgentEventEnvelope) -> NewOutboxMessage {
    let message = EventMessage::new(envelope.workspace_id.clone(), envelope.event_id);
    let routing_key = topology.events_routing_key(
        envelope.workspace_id.as_str(),
        envelope.conversation_id.as_deref(),
    );
    NewOutboxMessage::new(topology.events_exchange(), routing_key, encode(&message))
}

/// The firing of a due `schedule` at `now` as event `event_id`: the fire time claimed is
/// the schedule's `next_fire_at`, the next one follows it strictly after `now` (a schedule
/// that missed periods fires once, see [`ScheduleSpec::next_fire`]), and the event is the
/// schedule's template with its own id, time and idempotency key.
///
/// `invalid_argument` / `corrupt` when the stored spec or template no longer reads (the
/// gateway validated both): such a schedule is skipped and reported, never fired half.
pub fn plan_firing(
    schedule: &ScheduleRecord,
    now: DateTime<Utc>,
    event_id: EventId,
    topology: &Topology,
) -> Result<ScheduleFiring, StoreError> {
    let fire_at = schedule
        .next_fire_at
        .ok_or_else(|| StoreError::Corrupt(format!("schedule {} is not due", schedule.id)))?;
    let spec = ScheduleSpec::parse(schedule.kind, &schedule.spec)?;
    let template: ScheduledEvent = serde_json::from_value(schedule.event.clone())
        .map_err(|e| StoreError::Corrupt(format!("schedule {} event: {e}", schedule.id)))?;
    let (event, envelope) = template.fire(schedule.id, fire_at, event_id, now)?;
    Ok(ScheduleFiring {
        schedule_id: schedule.id,
        fire_at,
        next_fire_at: spec.next_fire(fire_at, now),
        event,
        outbox: vec![event_announcement(topology, &envelope)],
    })
}

/// Fires due schedules.
#[derive(Debug)]
pub struct Scheduler {
    deps: OrchestratorDeps,
    options: Arc<OrchestratorOptions>,
}

impl Scheduler {
    /// A scheduler over `deps`.
    #[must_use]
    pub fn new(deps: OrchestratorDeps, options: Arc<OrchestratorOptions>) -> Self {
        Self { deps, options }
    }

    /// One scan: fires up to `scheduler_batch` schedules due at now. Returns the events
    /// this call ingested (a schedule another scheduler fired first is not among them).
    pub async fn fire_due(&self) -> Result<Vec<EventId>> {
        let now = Utc::now();
        let due = self
            .deps
            .stores
            .schedules
            .due(now, self.options.scheduler_batch)
            .await?;
        let mut fired = Vec::new();
        for schedule in due {
            let firing = match plan_firing(&schedule, now, EventId::new(), &self.deps.topology) {
                Ok(firing) => firing,
                Err(error) => {
                    tracing::warn!(schedule_id = %schedule.id, %error, "schedule cannot fire; skipped");
                    continue;
                }
            };
            let fire_at = firing.fire_at;
            let Some((event, created)) = self.deps.stores.schedules.fire(firing).await? else {
                continue; // another scheduler fired it, or it was deleted meanwhile
            };
            if created {
                Registry::global().inc(names::EVENTS_INGESTED_TOTAL, &[("outcome", "scheduled")]);
            }
            tracing::debug!(
                schedule_id = %schedule.id,
                event_id = %event.id,
                %fire_at,
                "schedule fired"
            );
            fired.push(event.id);
        }
        Ok(fired)
    }

    /// Scans every `scheduler_interval` until shutdown.
    pub async fn run(self, shutdown: Shutdown) {
        shutdown
            .every(self.options.scheduler_interval, || async {
                if let Err(error) = self.fire_due().await {
                    tracing::warn!(%error, "scheduler scan failed; retrying at the next tick");
                }
            })
            .await;
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeDelta;
    use sb_common::bus::topology::TopologyOptions;
    use sb_protocol::ids::WorkspaceId;
    use sb_store::{EventStatus, ScheduleKind};
    use serde_json::json;
    use uuid::Uuid;

    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn envelope() -> AgentEventEnvelope {
        serde_json::from_value(json!({
            "event_id": EventId::new(),
            "workspace_id": "ws-1",
            "event_type": "message.received",
            "source": "scheduler",
            "conversation_id": "daily",
            "input": {"text": "good morning", "contents": [{"type": "text", "text": "good morning"}]},
            "delivery": {"surface": "api"},
            "metadata": {"origin": "test"}
        }))
        .unwrap()
    }

    fn schedule(kind: ScheduleKind, spec: &str, next: &str) -> ScheduleRecord {
        let template = ScheduledEvent {
            request: json!({"event_type": "message.received"}),
            envelope: envelope(),
            input_summary: "good morning".into(),
        };
        ScheduleRecord {
            id: Uuid::now_v7(),
            workspace_id: WorkspaceId::new("ws-1").unwrap(),
            name: None,
            kind,
            spec: spec.into(),
            event: serde_json::to_value(template).unwrap(),
            next_fire_at: Some(at(next)),
            last_fired_at: None,
            enabled: true,
            created_at: at("2026-01-01T00:00:00Z"),
            updated_at: at("2026-01-01T00:00:00Z"),
        }
    }

    fn topology() -> Topology {
        Topology::new(TopologyOptions::default()).unwrap()
    }

    #[test]
    fn a_firing_copies_the_template_with_its_own_identity() {
        let s = schedule(ScheduleKind::Interval, "15m", "2026-01-01T10:00:00Z");
        let now = at("2026-01-01T10:00:00.4Z");
        let event_id = EventId::new();
        let firing = plan_firing(&s, now, event_id, &topology()).unwrap();
        assert_eq!(firing.schedule_id, s.id);
        assert_eq!(firing.fire_at, at("2026-01-01T10:00:00Z"));
        assert_eq!(firing.next_fire_at, Some(at("2026-01-01T10:15:00Z")));
        let event = &firing.event;
        assert_eq!(event.id, Some(event_id));
        assert_eq!(event.status, EventStatus::Received);
        assert_eq!(event.event_type, "message.received");
        assert_eq!(event.conversation_id.as_deref(), Some("daily"));
        assert_eq!(event.input_summary.as_deref(), Some("good morning"));
        assert_eq!(
            event.idempotency_key.as_deref(),
            Some(sb_store::schedules::firing_key(s.id, firing.fire_at).as_str())
        );
        assert_eq!(event.event_time, Some(at("2026-01-01T10:00:00Z")));
        assert_eq!(event.metadata["origin"], "test");
        assert_eq!(event.metadata["schedule_id"], s.id.to_string());
        assert_eq!(
            event.metadata["scheduled_for"],
            "2026-01-01T10:00:00.000000Z"
        );
        let stored: AgentEventEnvelope =
            serde_json::from_value(event.envelope.clone().unwrap()).unwrap();
        assert_eq!(stored.event_id, event_id);

        let [announcement] = firing.outbox.as_slice() else {
            panic!("one announcement expected");
        };
        assert_eq!(announcement.exchange, topology().events_exchange());
        assert_eq!(
            announcement.routing_key,
            topology().events_routing_key("ws-1", Some("daily"))
        );
        let message: EventMessage = sb_protocol::messages::decode(&announcement.body).unwrap();
        assert_eq!(message.event_id, event_id);
    }

    #[test]
    fn a_late_firing_catches_up_once() {
        let s = schedule(ScheduleKind::Cron, "0 * * * *", "2026-01-01T10:00:00Z");
        let firing =
            plan_firing(&s, at("2026-01-01T15:20:00Z"), EventId::new(), &topology()).unwrap();
        assert_eq!(firing.fire_at, at("2026-01-01T10:00:00Z"));
        assert_eq!(firing.next_fire_at, Some(at("2026-01-01T16:00:00Z")));
    }

    #[test]
    fn a_one_shot_has_no_next_firing() {
        let s = schedule(
            ScheduleKind::Once,
            "2026-01-01T10:00:00Z",
            "2026-01-01T10:00:00Z",
        );
        let firing =
            plan_firing(&s, at("2026-01-01T10:00:01Z"), EventId::new(), &topology()).unwrap();
        assert_eq!(firing.next_fire_at, None);
        // Successive firings of an interval schedule differ in their keys.
        let s = schedule(ScheduleKind::Interval, "1s", "2026-01-01T10:00:00Z");
        let now = at("2026-01-01T10:00:00Z") + TimeDelta::milliseconds(100);
        let first = plan_firing(&s, now, EventId::new(), &topology()).unwrap();
        let mut later = s.clone();
        later.next_fire_at = first.next_fire_at;
        let second = plan_firing(
            &later,
            now + TimeDelta::seconds(1),
            EventId::new(),
            &topology(),
        )
        .unwrap();
        assert_ne!(first.event.idempotency_key, second.event.idempotency_key);
    }

    #[test]
    fn an_unreadable_template_is_refused_not_fired() {
        let mut s = schedule(ScheduleKind::Interval, "1m", "2026-01-01T10:00:00Z");
        s.event = json!({"request": {}});
        assert!(matches!(
            plan_firing(&s, at("2026-01-01T10:00:00Z"), EventId::new(), &topology()),
            Err(StoreError::Corrupt(_))
        ));
        let mut s = schedule(ScheduleKind::Interval, "1m", "2026-01-01T10:00:00Z");
        s.spec = "never".into();
        assert!(matches!(
            plan_firing(&s, at("2026-01-01T10:00:00Z"), EventId::new(), &topology()),
            Err(StoreError::InvalidArgument(_))
        ));
    }
}
