//! What firing a due schedule is (SPEC §1, §9): the fire time claimed, the next one, the
//! event copied from the schedule's template and its announcement on the bus.
//!
//! Pure, so the orchestrator's scheduler, which commits a firing with
//! [`ScheduleStore::fire`](sb_store::ScheduleStore::fire), and the gateway's tests, which
//! check that a schedule created through the API fires like an ingested event, apply the
//! same rule.

use chrono::{DateTime, Utc};
use sb_common::bus::topology::Topology;
use sb_protocol::ids::EventId;
use sb_store::{
    NewOutboxMessage, ScheduleFiring, ScheduleRecord, ScheduleSpec, ScheduledEvent, StoreError,
};

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
    // Announced like every ingested event (the gateway's `POST /v1/events` and turns).
    let announcement = topology.event_announcement(
        &envelope.workspace_id,
        envelope.event_id,
        envelope.conversation_id.as_deref(),
    );
    let announcement = NewOutboxMessage::new(
        announcement.exchange,
        announcement.routing_key,
        announcement.body,
    );
    Ok(ScheduleFiring {
        schedule_id: schedule.id,
        fire_at,
        next_fire_at: spec.next_fire(fire_at, now),
        event,
        outbox: vec![announcement],
    })
}

#[cfg(test)]
mod tests {
    use chrono::TimeDelta;
    use sb_common::bus::topology::TopologyOptions;
    use sb_protocol::host::AgentEventEnvelope;
    use sb_protocol::ids::WorkspaceId;
    use sb_protocol::messages::EventMessage;
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
