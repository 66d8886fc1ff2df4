//! Per-run budgets (SPEC §8) and `call_tool` idempotency, both kept in the session store so
//! every worker (and the gateway's remote Host API) shares them.
//!
//! **Budgets.** Model calls and tool calls are counters charged with the session store's
//! `counter_try_add` *before* the provider is called, model output characters *after* each
//! answer (or each streamed chunk). A charge that would pass the limit is refused with
//! `budget_exceeded` and marks the counter exhausted, so the budget stays exhausted for the
//! rest of the run even for a smaller later charge. Nothing is cut to fit: an answer over a
//! budget is refused, never truncated. A tool result over `max_tool_result_chars` is refused
//! the same way (that budget is per result).
//!
//! **Idempotency.** `call_tool` with a `call_id` claims `tool_call:<run>:<call_id>` with
//! `set_nx_ex`, holding the hash of the normalized parameters and the claim time. The winner
//! executes and overwrites the key with the outcome. Everyone else:
//! - different parameters → `conflict`;
//! - an outcome is stored → it is replayed (result or error);
//! - still running → waits (polling) for the outcome until the tool's timeout plus a grace
//!   period from the claim time; past that, the executor is presumed dead and the answer is
//!   `tool_outcome_unknown` — the tool is never executed a second time.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sb_common::session::{SessionError, SessionStore};
use sb_common::telemetry::{Metrics, names};
use sb_protocol::error::{AgentApiError, ErrorCode};
use sb_protocol::host::AuthorizationSnapshot;
use sb_protocol::ids::RunId;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// What a budget counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Budget {
    /// Model invocations (invoke, stream, rerank).
    ModelCalls,
    /// Tool executions.
    ToolCalls,
    /// Characters of model output over the run.
    ModelOutputChars,
}

impl Budget {
    fn name(self) -> &'static str {
        match self {
            Self::ModelCalls => "model_calls",
            Self::ToolCalls => "tool_calls",
            Self::ModelOutputChars => "model_output_chars",
        }
    }

    fn limit(self, snap: &AuthorizationSnapshot) -> i64 {
        let b = &snap.budgets;
        let v = match self {
            Self::ModelCalls => u64::from(b.max_model_calls),
            Self::ToolCalls => u64::from(b.max_tool_calls),
            Self::ModelOutputChars => b.max_model_output_chars,
        };
        i64::try_from(v).unwrap_or(i64::MAX)
    }
}

/// Keys outlive the run by an hour (a run's keys are useless after it, and the session
/// store forgets them on its own).
pub(crate) fn run_ttl(snap: &AuthorizationSnapshot) -> Duration {
    let now = now_secs_f64();
    let left = snap
        .deadline_at
        .map_or(24.0 * 3600.0, |d| (d - now).max(0.0));
    Duration::from_secs_f64(left) + Duration::from_secs(3600)
}

/// Time left until the run's deadline, if it has one.
pub(crate) fn until_deadline(snap: &AuthorizationSnapshot) -> Option<Duration> {
    snap.deadline_at
        .map(|d| Duration::from_secs_f64((d - now_secs_f64()).max(0.0)))
}

fn now_secs_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn session_failed(error: &SessionError) -> AgentApiError {
    tracing::warn!(%error, "session store failed during a host api call");
    AgentApiError::from_error(error)
}

/// Charges `by` units of `budget` to the run.
pub(crate) async fn charge(
    sessions: &dyn SessionStore,
    snap: &AuthorizationSnapshot,
    budget: Budget,
    by: u64,
) -> Result<(), AgentApiError> {
    let limit = budget.limit(snap);
    let key = format!("budget:{}:{}", snap.run_id, budget.name());
    let by = i64::try_from(by).unwrap_or(i64::MAX);
    match sessions
        .counter_try_add(&key, by, limit, Some(run_ttl(snap)))
        .await
    {
        Ok(_) => Ok(()),
        Err(SessionError::Exhausted { .. }) => Err(exceeded(budget.name(), limit)),
        Err(e) => Err(session_failed(&e)),
    }
}

/// Fails with `budget_exceeded` when `budget` has nothing left for the run: it is exhausted
/// (an earlier charge was refused) or its limit is zero.
///
/// For a budget charged *after* the work (model output), this is checked before the
/// provider is called, so a run whose output budget is gone does not pay for answers it
/// will be refused, nor spend model calls on them.
pub(crate) async fn ensure_left(
    sessions: &dyn SessionStore,
    snap: &AuthorizationSnapshot,
    budget: Budget,
) -> Result<(), AgentApiError> {
    if budget.limit(snap) == 0 {
        return Err(exceeded(budget.name(), 0));
    }
    // Adding nothing succeeds unless the counter is marked exhausted.
    charge(sessions, snap, budget, 0).await
}

/// The `budget_exceeded` error of `budget` with its limit (every refusal is counted in
/// `sb_budget_refusals_total{budget}`).
pub(crate) fn exceeded(budget: &'static str, limit: i64) -> AgentApiError {
    Metrics::global().inc(names::BUDGET_REFUSALS_TOTAL, &[("budget", budget)]);
    AgentApiError::new(
        ErrorCode::BudgetExceeded,
        format!("run budget {budget} exhausted (limit {limit})"),
    )
    .with_detail("budget", budget)
    .with_detail("limit", limit)
}

/// `value` with every object's keys sorted, as compact JSON: equal for parameters that
/// differ only in key order.
pub(crate) fn normalized(value: &Value) -> String {
    // serde_json's map keeps insertion order with `preserve_order`; sorting here keeps
    // the hash stable either way.
    let mut out = String::new();
    write_sorted(value, &mut out);
    out
}

fn write_sorted(v: &Value, out: &mut String) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_sorted(&m[k], out);
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_sorted(x, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

fn params_hash(tool: &str, params: &Value) -> String {
    let mut h = Sha256::new();
    h.update(tool.as_bytes());
    h.update([0]);
    h.update(normalized(params).as_bytes());
    hex::encode(h.finalize())
}

/// The stored record of an idempotent tool call.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CallRecord {
    hash: String,
    claimed_at_ms: u64,
    #[serde(default)]
    outcome: Option<Outcome>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Outcome {
    Ok(Value),
    Err(AgentApiError),
}

/// What to do with an idempotent call.
pub(crate) enum Claim {
    /// This caller executes; report the outcome with [`IdempotentCall::finish`].
    Execute(IdempotentCall),
    /// The call already has an outcome (or it is unknowable): answer this.
    Answer(Result<Value, AgentApiError>),
}

/// A claimed idempotent call.
pub(crate) struct IdempotentCall {
    key: String,
    record: CallRecord,
    ttl: Duration,
}

impl IdempotentCall {
    /// Stores the outcome for replays.
    pub(crate) async fn finish(
        mut self,
        sessions: &dyn SessionStore,
        outcome: &Result<Value, AgentApiError>,
    ) {
        self.record.outcome = Some(match outcome {
            Ok(v) => Outcome::Ok(v.clone()),
            Err(e) => Outcome::Err(e.clone()),
        });
        let bytes = serde_json::to_vec(&self.record).unwrap_or_default();
        if let Err(error) = sessions.set_ex(&self.key, &bytes, self.ttl).await {
            // Later calls with this call_id will answer tool_outcome_unknown.
            tracing::warn!(%error, key = %self.key, "could not record a tool call outcome");
        }
    }

    /// Gives the claim up when the tool was not executed at all (e.g. the budget refused
    /// it), so the same call_id can be tried again.
    pub(crate) async fn release(self, sessions: &dyn SessionStore) {
        if let Err(error) = sessions.del(&self.key).await {
            tracing::warn!(%error, key = %self.key, "could not release a tool call claim");
        }
    }
}

fn unknown(call_id: &str) -> AgentApiError {
    AgentApiError::new(
        ErrorCode::ToolOutcomeUnknown,
        format!("the outcome of tool call {call_id} was lost; it is not executed again"),
    )
    .with_detail("call_id", call_id)
}

/// Claims `call_id` for `params`, or answers from an earlier call with the same id.
/// `max_running` is how long an executor may take (the tool timeout plus grace).
pub(crate) async fn claim(
    sessions: &dyn SessionStore,
    run_id: RunId,
    ttl: Duration,
    tool: &str,
    call_id: &str,
    params: &Value,
    max_running: Duration,
) -> Result<Claim, AgentApiError> {
    let key = format!("tool_call:{run_id}:{call_id}");
    let record = CallRecord {
        hash: params_hash(tool, params),
        claimed_at_ms: now_ms(),
        outcome: None,
    };
    let bytes = serde_json::to_vec(&record).unwrap_or_default();
    if sessions
        .set_nx_ex(&key, &bytes, ttl)
        .await
        .map_err(|e| session_failed(&e))?
    {
        return Ok(Claim::Execute(IdempotentCall { key, record, ttl }));
    }
    let max_ms = u64::try_from(max_running.as_millis()).unwrap_or(u64::MAX);
    loop {
        let stored = sessions.get(&key).await.map_err(|e| session_failed(&e))?;
        let Some(stored) = stored else {
            // Released (never executed) or expired: claim it again.
            if sessions
                .set_nx_ex(&key, &bytes, ttl)
                .await
                .map_err(|e| session_failed(&e))?
            {
                return Ok(Claim::Execute(IdempotentCall { key, record, ttl }));
            }
            continue;
        };
        let Ok(existing) = serde_json::from_slice::<CallRecord>(&stored) else {
            return Ok(Claim::Answer(Err(unknown(call_id))));
        };
        if existing.hash != record.hash {
            return Ok(Claim::Answer(Err(AgentApiError::new(
                ErrorCode::Conflict,
                format!("tool call {call_id} was already made with different parameters"),
            )
            .with_detail("call_id", call_id))));
        }
        match existing.outcome {
            Some(Outcome::Ok(v)) => return Ok(Claim::Answer(Ok(v))),
            Some(Outcome::Err(e)) => return Ok(Claim::Answer(Err(e))),
            None if now_ms().saturating_sub(existing.claimed_at_ms) > max_ms => {
                return Ok(Claim::Answer(Err(unknown(call_id))));
            }
            None => tokio::time::sleep(Duration::from_millis(25)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn normalization_ignores_key_order_only() {
        let a = json!({"b": 1, "a": {"y": [1, {"q": 1, "p": 2}], "x": null}});
        let b = json!({"a": {"x": null, "y": [1, {"p": 2, "q": 1}]}, "b": 1});
        assert_eq!(normalized(&a), normalized(&b));
        assert_ne!(normalized(&a), normalized(&json!({"b": 2})));
        assert_ne!(params_hash("t", &a), params_hash("u", &a));
    }
}
