//! Fixtures for tests of the Host API and of its transports (feature `test-util`): the run
//! sessions the gate reads, as the orchestrator writes them.
//!
//! The worker's and the gateway's tests store these snapshots as run sessions, so every
//! crate's tests build sessions one way and a change of the snapshot's shape is made once.

use std::time::{SystemTime, UNIX_EPOCH};

use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::manifest::RunnerId;
use serde_json::{Value, json};

/// The authorization snapshot stored as the session of a run of the default workspace:
/// `runner_id`'s plugin, conversation `conv-1`, nothing granted, `deadline_at` as given.
#[must_use]
pub fn snapshot(run_id: RunId, runner_id: &RunnerId, deadline_at: Option<f64>) -> Value {
    snapshot_in(
        &WorkspaceId::default_workspace(),
        run_id,
        runner_id,
        deadline_at,
    )
}

/// The authorization snapshot of a run of `workspace` (otherwise as [`snapshot`]).
#[must_use]
pub fn snapshot_in(
    workspace: &WorkspaceId,
    run_id: RunId,
    runner_id: &RunnerId,
    deadline_at: Option<f64>,
) -> Value {
    json!({
        "run_id": run_id,
        "plugin_id": runner_id.plugin_id(),
        "runner_id": runner_id.to_string(),
        "binding_id": format!("agent_default_{runner_id}"),
        "workspace_id": workspace.to_string(),
        "conversation_id": "conv-1",
        "resources": {},
        "available_apis": {},
        "state_policy": {},
        "budgets": {},
        "deadline_at": deadline_at,
    })
}

/// Now, in epoch seconds (the unit of `deadline_at`).
///
/// # Panics
///
/// When the system clock is before 1970.
#[must_use]
pub fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_secs_f64()
}
