//! Fixtures for unit tests.

use sb_protocol::context::AgentRunContext;
use sb_protocol::ids::RunId;
use serde_json::json;

/// A minimal valid context for `run_id` with input `text`.
pub(crate) fn context(run_id: RunId, text: &str) -> AgentRunContext {
    serde_json::from_value(json!({
        "run_id": run_id,
        "trigger": {"type": "message.received", "source": "api"},
        "event": {"event_id": "e1", "event_type": "message.received", "source": "api"},
        "input": {"text": text},
        "delivery": {"surface": "api"},
        "resources": {},
        "context": {"inline_policy": {"mode": "current_event"}, "available_apis": {}},
        "runtime": {"trace_id": run_id.to_string()},
    }))
    .expect("fixture context is valid")
}
