//! The Host API gate: the checks every runner call passes before any action code runs
//! (SPEC §8 validation steps 1–3), in front of an inner [`Dispatcher`] that serves the action.
//!
//! ```text
//!  runner ──api{id, run_id, action}──▶ runner host ──(run_id is an active run of this process?)──▶ ApiGate::call
//!                                        (answers not_found itself otherwise)                           │
//!   0. run is a current run of the caller's connection ── no ──▶ not_found (same answer as 1)
//!   1. session exists in the session store ───────── no ──▶ not_found "run session <id> not found or expired"
//!   2. caller plugin identity = session's plugin_id ── no ──▶ unauthorized
//!   2b. session's workspace = the connection's ──────── no ──▶ unauthorized
//!   3. session deadline not passed ─────────────────── no ──▶ deadline_exceeded
//!   4+. Dispatcher::dispatch(call with the frozen snapshot) (grants, scope, arguments, budgets, the action)
//! ```
//!
//! Steps 0 and 2b repeat what the runner host already guarantees — a call is dispatched
//! only for a run of the calling process, and a shared process only ever hosts runs of its
//! one workspace (SPEC §14) — so that a bug there cannot let one process act as a run of
//! another tenant. Step 0 answers exactly like a missing session, so a process learns
//! nothing about runs that are not its own. Callers without a connection (the gateway's
//! remote Host API) skip both: their identity *is* the session's.
//!
//! The gateway serves the same gate to runners outside a worker (`POST /v1/host/{action}`,
//! `sb_gateway::routes::host`): there the caller identity is the session's own, established
//! by the run's token (whose digest the session holds) instead of by a process connection.
//!
//! The order matters and is the seed host's: a run that ended (its session removed
//! atomically by the worker, SPEC §4.4) answers `not_found` even to its own process, and a
//! process can never learn anything about another plugin's run beyond "unauthorized". The
//! caller identity comes from the runner host (the process connection), never from the
//! message. Authorization is always checked against the snapshot frozen in the session, never
//! re-derived from current configuration (SPEC §6).
//!
//! Every call is counted in `sb_proxy_calls_total{action, result}` (result = `ok` or the error
//! code) and timed in `sb_proxy_call_duration_seconds{action}`; action names outside the
//! protocol's closed set are counted as `unknown` so a runner cannot blow up label
//! cardinality.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use sb_common::session::SessionStore;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::action::Action;
use sb_protocol::error::{AgentApiError, ErrorCode};
use sb_protocol::host::AuthorizationSnapshot;
use sb_protocol::ids::RunId;
use serde_json::Value;

use crate::api::{ApiStream, CallerIdentity, HostApi};
pub use crate::api::{Dispatcher, GatedCall};
use crate::basic::BasicHostApi;

/// Current time as epoch seconds (the unit of `deadline_at`).
pub type Clock = Arc<dyn Fn() -> f64 + Send + Sync>;

/// The system clock in epoch seconds.
#[must_use]
pub fn system_clock() -> Clock {
    Arc::new(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    })
}

/// The [`HostApi`] the worker injects into its runner hosts: the gate, then `inner`.
pub struct ApiGate<D = BasicHostApi> {
    sessions: Arc<dyn SessionStore>,
    inner: D,
    clock: Clock,
    metrics: &'static Metrics,
}

impl<D> std::fmt::Debug for ApiGate<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiGate").finish_non_exhaustive()
    }
}

impl<D: Dispatcher> ApiGate<D> {
    /// A gate reading sessions from `sessions`, with the system clock.
    pub fn new(sessions: Arc<dyn SessionStore>, inner: D) -> Self {
        Self {
            sessions,
            inner,
            clock: system_clock(),
            metrics: Metrics::global(),
        }
    }

    /// Replaces the clock (tests).
    #[must_use]
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Steps 0–3 (see the module docs). Returns the frozen snapshot of the run.
    async fn check(
        &self,
        caller: &CallerIdentity,
        run_id: RunId,
    ) -> Result<AuthorizationSnapshot, AgentApiError> {
        if let Some(connection) = &caller.connection {
            if !connection.hosts(run_id) {
                tracing::warn!(%run_id, runner_id = %caller.runner_id, "host api call for a run that its connection does not host");
                return Err(session_not_found(run_id));
            }
        }
        let session = match self.sessions.get_session(&run_id).await {
            Ok(Some(session)) => session,
            Ok(None) => return Err(session_not_found(run_id)),
            Err(error) => {
                tracing::warn!(%run_id, %error, "session store unreachable for a host api call");
                return Err(AgentApiError::new(
                    ErrorCode::Unavailable,
                    "run session store is unavailable",
                ));
            }
        };
        let snapshot = decode_snapshot(session).map_err(|reason| {
            tracing::error!(%run_id, %reason, "run session does not hold an authorization snapshot");
            AgentApiError::new(ErrorCode::Internal, "internal host error")
        })?;
        if snapshot.run_id != run_id {
            tracing::error!(%run_id, stored = %snapshot.run_id, "run session belongs to another run");
            return Err(AgentApiError::new(
                ErrorCode::Internal,
                "internal host error",
            ));
        }
        // A session without an identity authorizes nobody (host-behaviour §22.1 check 2),
        // not even a caller whose identity would compare equal to the empty one.
        if snapshot.plugin_id.trim().is_empty() {
            tracing::error!(%run_id, "run session has no plugin identity");
            return Err(AgentApiError::new(
                ErrorCode::Unauthorized,
                format!("run session {run_id} has no plugin identity"),
            ));
        }
        if snapshot.plugin_id != caller.plugin_id {
            return Err(AgentApiError::new(
                ErrorCode::Unauthorized,
                format!(
                    "plugin {} is not authorized for run {run_id}",
                    caller.plugin_id
                ),
            ));
        }
        if let Some(connection) = &caller.connection {
            if snapshot.workspace_id != *connection.workspace_id() {
                tracing::error!(%run_id, run_workspace = %snapshot.workspace_id, process_workspace = %connection.workspace_id(), "host api call for a run of another workspace than its process");
                return Err(AgentApiError::new(
                    ErrorCode::Unauthorized,
                    format!("run {run_id} does not belong to the workspace of this runner process"),
                ));
            }
        }
        if snapshot.is_expired((self.clock)()) {
            return Err(AgentApiError::new(
                ErrorCode::DeadlineExceeded,
                format!("run {run_id} deadline exceeded"),
            ));
        }
        Ok(snapshot)
    }
}

/// The `not_found` answer for a run without a session (the seed host's message).
#[must_use]
pub fn session_not_found(run_id: RunId) -> AgentApiError {
    AgentApiError::new(
        ErrorCode::NotFound,
        format!("run session {run_id} not found or expired"),
    )
}

/// Reads the authorization snapshot out of a stored run session. The session value *is* the
/// snapshot's JSON (`sb_protocol::host::AuthorizationSnapshot`, as its docs say), written by
/// the orchestrator before it publishes the job.
pub fn decode_snapshot(session: Value) -> Result<AuthorizationSnapshot, String> {
    serde_json::from_value(session).map_err(|e| e.to_string())
}

/// The metric label for an action: its name if it is one of the protocol's, else `unknown`.
fn action_label(action: &str) -> &str {
    if Action::parse(action).is_some() {
        action
    } else {
        "unknown"
    }
}

#[async_trait]
impl<D: Dispatcher> HostApi for ApiGate<D> {
    async fn call(
        &self,
        caller: &CallerIdentity,
        run_id: RunId,
        action: &str,
        params: Value,
        stream: &ApiStream,
    ) -> Result<Value, AgentApiError> {
        let started = Instant::now();
        let outcome = match self.check(caller, run_id).await {
            Ok(snapshot) => {
                let call = GatedCall {
                    caller,
                    run_id,
                    action,
                    snapshot: &snapshot,
                };
                self.inner.dispatch(call, params, stream).await
            }
            Err(error) => Err(error),
        };
        let label = action_label(action);
        let result = match &outcome {
            Ok(_) => "ok",
            Err(e) => e.error_code().map_or("runtime_error", ErrorCode::as_str),
        };
        self.metrics.inc(
            names::PROXY_CALLS_TOTAL,
            &[("action", label), ("result", result)],
        );
        self.metrics.observe(
            names::PROXY_CALL_DURATION_SECONDS,
            &[("action", label)],
            started.elapsed().as_secs_f64(),
        );
        if let Err(e) = &outcome {
            tracing::debug!(%run_id, action = label, code = %e.code, message = %e.message, "host api call refused");
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn action_labels_are_bounded() {
        assert_eq!(action_label("get_host_version"), "get_host_version");
        assert_eq!(action_label("drop_tables; --"), "unknown");
        // both spellings of the storage actions are labelled by name
        for name in [
            "storage_get",
            "storage_set",
            "storage_delete",
            "storage_keys",
            "get_binary_storage",
            "set_binary_storage",
            "delete_binary_storage",
            "get_binary_storage_keys",
        ] {
            assert_eq!(action_label(name), name);
        }
    }

    #[test]
    fn snapshot_decodes_from_the_session_value() {
        let run_id = RunId::new();
        let snap = json!({
            "run_id": run_id, "plugin_id": "acme/echo", "runner_id": "plugin:acme/echo/default",
            "binding_id": "b", "workspace_id": "default", "resources": {},
            "available_apis": {}, "state_policy": {}, "budgets": {}
        });
        assert_eq!(decode_snapshot(snap).unwrap().plugin_id, "acme/echo");
        assert!(decode_snapshot(json!({"plugin_id": 3})).is_err());
    }
}
