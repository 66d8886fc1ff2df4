//! Event-log audit rows of steering input, built in one place (host-behaviour §11, §14,
//! §26.10). Pure functions returning [`NewEvent`]s; the caller appends them.
//!
//! Two roles write these rows — the worker when a run pulls an item (`steering.injected`)
//! or ends without pulling it (`steering.dropped`), the orchestrator's reaper when it ends
//! an overdue run (`steering.dropped`) — so the shape lives here, next to the store they are
//! written to, rather than in either role.
//!
//! # Item
//!
//! `item` is the steering item as JSON, as the session store holds it
//! (`sb_protocol::proxy::SteeringItem`: `claimed_run_id`, `runner_id`, `claimed_at`,
//! `event`, `conversation`, `actor`, `subject`, `input`, `metadata`). The builders read it
//! leniently: an item that does not decode still gives a row, with what could be read.
//!
//! # Idempotency
//!
//! Each row carries the idempotency key `<event type>:<run_id>:<source event id>`, so a
//! retried audit (a redelivered job, a second reaper, a replayed pull) appends once.
//!
//! # Audit keys
//!
//! The seed host wrote `original_event_id` in `steering.dropped` rows and `source_event_id`
//! in `steering.injected` rows (host-behaviour §26.10). Switchboard uses `source_event_id`
//! in both, as the seed documentation says.

use chrono::{DateTime, TimeZone, Utc};
use sb_protocol::host::AuthorizationSnapshot;
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::proxy::SteeringItem;
use serde_json::{Value, json};

use crate::events::{EventStatus, NewEvent, is_valid_idempotency_key};
use crate::redact::{sanitize_attachments, sanitize_contents};

/// Tracing target of audit log lines (every role's, so one filter shows them all).
pub const LOG_TARGET: &str = "audit";
/// Event type of the row of a pulled steering item.
pub const STEERING_INJECTED: &str = "steering.injected";
/// Event type of the row of a steering item its run never pulled.
pub const STEERING_DROPPED: &str = "steering.dropped";
/// Source of `steering.injected` rows (the seed's: the runner asked for the item).
pub const SOURCE_AGENT_RUNNER: &str = "agent_runner";
/// Source of `steering.dropped` rows (the host dropped the item).
pub const SOURCE_HOST: &str = "host";
/// Reason of the `steering.dropped` rows written when a run ends with unpulled items.
pub const DROPPED_RUN_ENDED: &str = "run_ended";
/// Summary of a dropped item without text (seed wording).
pub const DROPPED_SUMMARY: &str = "Unconsumed steering input dropped";
/// Longest summary a dropped row keeps of the item's text, in characters
/// (host-behaviour §14).
const MAX_SUMMARY_CHARS: usize = 1000;

fn cut(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(max - 3).collect();
    out.push_str("...");
    out
}

fn epoch_secs(secs: i64) -> Option<DateTime<Utc>> {
    Utc.timestamp_opt(secs, 0).single()
}

fn source_event_id(item: &Value) -> Option<String> {
    item.pointer("/event/event_id")
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// `<event type>:<run_id>:<source event id>`, if that is a valid idempotency key.
fn audit_key(event_type: &str, run_id: RunId, source_event_id: Option<&str>) -> Option<String> {
    source_event_id
        .map(|source| format!("{event_type}:{run_id}:{source}"))
        .filter(|key| is_valid_idempotency_key(key))
}

/// The `steering.injected` row of an item `run_id` pulled (host-behaviour §11, §22.2).
/// `snapshot` is the run's frozen authorization: it gives the workspace and runner, and the
/// scope fields the item lacks. `pull_mode` is the normalized mode (`all` / `one`).
///
/// Without a usable source event id the row has no idempotency key (it is still written).
/// The row is an audit record, never routed: its status is `dispatched` with the run id.
#[must_use]
pub fn steering_injected(
    item: &Value,
    run_id: RunId,
    snapshot: &AuthorizationSnapshot,
    pull_mode: &str,
) -> NewEvent {
    let text = |pointer: &str| {
        item.pointer(pointer)
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    let source_event_id = source_event_id(item);
    let mut event = NewEvent::new(
        snapshot.workspace_id.clone(),
        STEERING_INJECTED,
        SOURCE_AGENT_RUNNER,
    );
    event.idempotency_key = audit_key(STEERING_INJECTED, run_id, source_event_id.as_deref());
    event.bot_id = text("/conversation/bot_id").or_else(|| snapshot.bot_id.clone());
    event.conversation_id =
        text("/conversation/conversation_id").or_else(|| snapshot.conversation_id.clone());
    event.thread_id = text("/conversation/thread_id").or_else(|| snapshot.thread_id.clone());
    event.actor_type = text("/actor/actor_type");
    event.actor_id = text("/actor/actor_id");
    event.actor_name = text("/actor/actor_name");
    event.subject_type = text("/subject/subject_type");
    event.subject_id = text("/subject/subject_id");
    event.input_summary = Some(format!(
        "steering injected from {}",
        source_event_id.as_deref().unwrap_or("unknown event")
    ));
    event.status = EventStatus::Dispatched;
    event.run_id = Some(run_id);
    event.runner_id = Some(snapshot.runner_id.to_string());
    event.metadata = json!({
        "steering": {
            "status": "injected",
            "source_event_id": source_event_id,
            "claimed_by_run_id": item.get("claimed_run_id").cloned().unwrap_or(Value::Null),
            "claimed_runner_id": item.get("runner_id").cloned().unwrap_or(Value::Null),
            "claimed_at": item.get("claimed_at").cloned().unwrap_or(Value::Null),
            "pull_mode": pull_mode,
        }
    });
    event
}

/// The `steering.dropped` row of an item a run never pulled (host-behaviour §14
/// `write_steering_dropped_audits`). `run_id` / `runner_id` / `workspace` describe the run
/// that claimed it (`runner_id` is used when the item lacks one); `reason` is e.g.
/// [`DROPPED_RUN_ENDED`].
///
/// Without a usable source event id the key is `steering.dropped:<run_id>:<fresh uuid>` (no
/// replay protection, but no bad key either). The stored input is redacted
/// ([`crate::redact`]); the summary is the item's text cut to 1000 characters, or
/// [`DROPPED_SUMMARY`]. The row is an audit record, never routed: its status is
/// `dispatched` with the run id.
#[must_use]
pub fn steering_dropped(
    item: &Value,
    run_id: RunId,
    runner_id: &str,
    workspace: &WorkspaceId,
    reason: &str,
) -> NewEvent {
    let typed: Option<SteeringItem> = serde_json::from_value(item.clone()).ok();
    let source_event_id = source_event_id(item);
    let claimed_runner_id = item
        .get("runner_id")
        .and_then(Value::as_str)
        .unwrap_or(runner_id)
        .to_owned();
    let claimed_at = item.get("claimed_at").and_then(Value::as_i64);

    let mut event = NewEvent::new(workspace.clone(), STEERING_DROPPED, SOURCE_HOST);
    let key = audit_key(STEERING_DROPPED, run_id, source_event_id.as_deref())
        .unwrap_or_else(|| format!("{STEERING_DROPPED}:{run_id}:{}", uuid::Uuid::new_v4()));
    event.idempotency_key = Some(key);
    event.status = EventStatus::Dispatched;
    event.run_id = Some(run_id);
    event.runner_id = Some(claimed_runner_id.clone());
    let text = typed
        .as_ref()
        .and_then(|t| t.input.text.as_deref())
        .filter(|t| !t.is_empty());
    event.input_summary =
        Some(text.map_or_else(|| DROPPED_SUMMARY.to_owned(), |t| cut(t, MAX_SUMMARY_CHARS)));
    if let Some(typed) = &typed {
        event.bot_id = typed.conversation.bot_id.clone();
        event.conversation_id = typed.conversation.conversation_id.clone();
        event.thread_id = typed.conversation.thread_id.clone();
        if let Some(actor) = &typed.actor {
            event.actor_type = Some(actor.actor_type.clone());
            event.actor_id = actor.actor_id.clone();
            event.actor_name = actor.actor_name.clone();
        }
        if let Some(subject) = &typed.subject {
            event.subject_type = Some(subject.subject_type.clone());
            event.subject_id = subject.subject_id.clone();
        }
        event.event_time = typed.event.event_time.and_then(epoch_secs);
        event.envelope = Some(json!({
            "input": {
                "text": typed.input.text,
                "contents": sanitize_contents(serde_json::to_value(&typed.input.contents).unwrap_or(Value::Null)),
                "attachments": sanitize_attachments(serde_json::to_value(&typed.input.attachments).unwrap_or(Value::Null)),
            }
        }));
    }
    event.metadata = json!({
        "steering": {
            "status": "dropped",
            "reason": reason,
            "source_event_id": source_event_id,
            "claimed_run_id": run_id.to_string(),
            "claimed_runner_id": claimed_runner_id,
            "claimed_at": claimed_at,
        }
    });
    event
}

#[cfg(test)]
mod tests {
    use super::*;

    const RUNNER: &str = "plugin:acme/agent/default";

    /// A steering item as the orchestrator pushes it (the `SteeringItem` wire shape).
    fn item(run_id: RunId, event_id: &str, text: &str, claimed_at: i64) -> Value {
        json!({
            "claimed_run_id": run_id.to_string(),
            "runner_id": RUNNER,
            "claimed_at": claimed_at,
            "event": {
                "event_id": event_id,
                "event_type": "message.received",
                "event_time": 1_700_000_000,
                "source": "api",
            },
            "conversation": {
                "conversation_id": "c1",
                "thread_id": null,
                "bot_id": "bot",
                "workspace_id": "default",
            },
            "actor": {"actor_type": "user", "actor_id": "u1", "actor_name": "Alice"},
            "subject": null,
            "input": {
                "text": text,
                "contents": [{"type": "image", "base64": "AAAA"}],
                "attachments": [],
            },
            "metadata": {},
        })
    }

    fn snapshot(run_id: RunId) -> AuthorizationSnapshot {
        serde_json::from_value(json!({
            "run_id": run_id,
            "plugin_id": "acme/agent",
            "runner_id": RUNNER,
            "binding_id": "b",
            "workspace_id": "w1",
            "bot_id": "snap-bot",
            "conversation_id": "snap-conv",
            "thread_id": "snap-thread",
            "resources": {},
            "available_apis": {"steering_pull": true},
            "state_policy": {},
            "budgets": {},
        }))
        .unwrap()
    }

    #[test]
    fn the_test_item_is_the_protocol_shape() {
        let run_id = RunId::new();
        let typed: SteeringItem =
            serde_json::from_value(item(run_id, "e1", "hi", 1)).expect("a SteeringItem");
        assert_eq!(typed.event.event_id, "e1");
    }

    #[test]
    fn dropped_rows() {
        let run_id = RunId::new();
        let v = item(run_id, "e-1", "and also this", 42);
        let ws = WorkspaceId::default_workspace();
        let row = steering_dropped(&v, run_id, "plugin:other/x/y", &ws, DROPPED_RUN_ENDED);
        assert_eq!(row.event_type, "steering.dropped");
        assert_eq!(row.source, "host");
        assert_eq!(row.workspace_id, ws);
        assert_eq!(row.status, EventStatus::Dispatched);
        assert_eq!(row.run_id, Some(run_id));
        assert_eq!(
            row.runner_id.as_deref(),
            Some(RUNNER),
            "the item's runner wins over the fallback"
        );
        assert_eq!(row.conversation_id.as_deref(), Some("c1"));
        assert_eq!(row.bot_id.as_deref(), Some("bot"));
        assert_eq!(row.actor_id.as_deref(), Some("u1"));
        assert_eq!(row.actor_name.as_deref(), Some("Alice"));
        assert_eq!(row.input_summary.as_deref(), Some("and also this"));
        assert_eq!(row.event_time.unwrap().timestamp(), 1_700_000_000);
        let key = row.idempotency_key.clone().unwrap();
        assert_eq!(key, format!("steering.dropped:{run_id}:e-1"));
        assert!(is_valid_idempotency_key(&key));
        // the same item gives the same key: a replayed audit appends once
        let again = steering_dropped(&v, run_id, RUNNER, &ws, DROPPED_RUN_ENDED);
        assert_eq!(again.idempotency_key, row.idempotency_key);
        let s = &row.metadata["steering"];
        assert_eq!(s["status"], "dropped");
        assert_eq!(s["reason"], "run_ended");
        assert_eq!(s["source_event_id"], "e-1");
        assert_eq!(s["claimed_run_id"], run_id.to_string());
        assert_eq!(s["claimed_runner_id"], RUNNER);
        assert_eq!(s["claimed_at"], 42);
        let input = &row.envelope.as_ref().unwrap()["input"];
        assert_eq!(input["text"], "and also this");
        assert_eq!(
            input["contents"][0]["base64"],
            Value::Null,
            "persisted copies are redacted"
        );
        assert_eq!(input["contents"][0]["content_redacted"], true);

        // an item without text or a readable shape still gives a row, with a valid key
        let row = steering_dropped(&json!({"junk": true}), run_id, RUNNER, &ws, "run_ended");
        assert_eq!(row.input_summary.as_deref(), Some(DROPPED_SUMMARY));
        assert_eq!(
            row.runner_id.as_deref(),
            Some(RUNNER),
            "the fallback runner"
        );
        assert_eq!(row.metadata["steering"]["source_event_id"], Value::Null);
        assert!(row.envelope.is_none());
        let key = row.idempotency_key.unwrap();
        assert!(is_valid_idempotency_key(&key));
        assert!(key.starts_with(&format!("steering.dropped:{run_id}:")));
        // an event id that cannot be part of a key gets a fresh one
        let row = steering_dropped(&item(run_id, "bad id/", "x", 1), run_id, RUNNER, &ws, "r");
        assert!(is_valid_idempotency_key(
            row.idempotency_key.as_deref().unwrap()
        ));
        // long text is cut
        let row = steering_dropped(
            &item(run_id, "e-2", &"x".repeat(1500), 1),
            run_id,
            RUNNER,
            &ws,
            "run_ended",
        );
        let summary = row.input_summary.unwrap();
        assert_eq!(summary.chars().count(), 1000);
        assert!(summary.ends_with("..."));
    }

    #[test]
    fn injected_rows() {
        let run_id = RunId::new();
        let snap = snapshot(run_id);
        let row = steering_injected(&item(run_id, "e-1", "more", 7), run_id, &snap, "one");
        assert_eq!(row.event_type, "steering.injected");
        assert_eq!(row.source, "agent_runner");
        assert_eq!(row.workspace_id.as_str(), "w1", "the run's workspace");
        assert_eq!(row.status, EventStatus::Dispatched);
        assert_eq!(row.run_id, Some(run_id));
        assert_eq!(row.runner_id.as_deref(), Some(RUNNER));
        assert_eq!(
            row.idempotency_key.as_deref(),
            Some(format!("steering.injected:{run_id}:e-1").as_str())
        );
        // the item's scope wins; the snapshot fills what the item lacks
        assert_eq!(row.conversation_id.as_deref(), Some("c1"));
        assert_eq!(row.bot_id.as_deref(), Some("bot"));
        assert_eq!(row.thread_id.as_deref(), Some("snap-thread"));
        assert_eq!(row.actor_type.as_deref(), Some("user"));
        assert_eq!(row.actor_id.as_deref(), Some("u1"));
        assert_eq!(
            row.input_summary.as_deref(),
            Some("steering injected from e-1")
        );
        assert!(row.envelope.is_none(), "the input is not copied");
        let s = &row.metadata["steering"];
        assert_eq!(s["status"], "injected");
        assert_eq!(s["source_event_id"], "e-1");
        assert_eq!(s["claimed_by_run_id"], run_id.to_string());
        assert_eq!(s["claimed_runner_id"], RUNNER);
        assert_eq!(s["claimed_at"], 7);
        assert_eq!(s["pull_mode"], "one");

        // an unreadable item: scope from the snapshot, no key, still a row
        let row = steering_injected(&json!({}), run_id, &snap, "all");
        assert_eq!(row.conversation_id.as_deref(), Some("snap-conv"));
        assert_eq!(row.bot_id.as_deref(), Some("snap-bot"));
        assert_eq!(row.idempotency_key, None);
        assert_eq!(
            row.input_summary.as_deref(),
            Some("steering injected from unknown event")
        );
        assert_eq!(row.metadata["steering"]["claimed_at"], Value::Null);
    }
}
