//! `steering_pull`: follow-up events claimed by the run (SPEC §7, host-behaviour §11, §22.2).
//!
//! Items come off the head of the run's steering list in the session store (FIFO, atomic:
//! never returned twice). `mode` is `all` (default: up to `limit`, at most 100) or `one`
//! (also `one-at-a-time` / `one_at_a_time`, the seed's spellings; exactly one item whatever
//! the limit). Each pulled item is audited as a `steering.injected` event-log row (built by
//! `sb_store::audit::steering_injected`); an audit failure is logged and does not fail the
//! pull — the items are already off the list, and losing them would be worse than a missing
//! audit row.

use sb_common::session::PullMode;
use sb_protocol::error::AgentApiError;
use sb_store::audit::{STEERING_INJECTED, steering_injected};
use serde_json::{Value, json};

use super::params::page_limit;
use super::{AUDIT_TARGET, ActionDispatcher, Cx, api_not_granted, invalid};

fn pull_mode(mode: Option<&str>) -> Result<(PullMode, &'static str), AgentApiError> {
    match mode.map(str::to_ascii_lowercase).as_deref() {
        None | Some("all") => Ok((PullMode::All, "all")),
        Some("one" | "one-at-a-time" | "one_at_a_time") => Ok((PullMode::One, "one")),
        Some(other) => Err(invalid(format!("mode must be all or one, not {other}"))),
    }
}

impl ActionDispatcher {
    pub(super) async fn steering_pull(&self, cx: &Cx<'_, '_>) -> Result<Value, AgentApiError> {
        let snap = cx.call.snapshot;
        let p = cx.p;
        // 4
        if !snap.available_apis.steering_pull {
            return Err(api_not_granted("steering pull"));
        }
        // 6
        let (mode, mode_name) = pull_mode(p.opt_str("mode")?)?;
        let max = self.limits.steering_pull_max;
        let limit = page_limit(p, "limit", max, max)?;
        // 7
        self.admit(cx).await?;

        let count = usize::try_from(limit).unwrap_or(1);
        let items = self
            .sessions
            .steering_pull(&cx.call.run_id, count, mode)
            .await
            .map_err(|error| {
                tracing::warn!(%error, "steering pull failed");
                AgentApiError::from_error(&error)
            })?;
        for item in &items {
            let event_id = item
                .pointer("/event/event_id")
                .and_then(Value::as_str)
                .unwrap_or("");
            tracing::info!(
                target: AUDIT_TARGET, audit = STEERING_INJECTED, run_id = %cx.call.run_id, event_id,
                pull_mode = mode_name, "steering item pulled by the run"
            );
            if let Err(error) = self
                .stores
                .events
                .append(
                    steering_injected(item, cx.call.run_id, snap, mode_name),
                    Vec::new(),
                )
                .await
            {
                tracing::warn!(%error, event_id, "writing the steering.injected audit row failed");
            }
        }
        Ok(json!({ "items": items }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes() {
        assert_eq!(pull_mode(None).unwrap().0, PullMode::All);
        assert_eq!(pull_mode(Some("ALL")).unwrap().0, PullMode::All);
        for one in ["one", "one-at-a-time", "one_at_a_time", "One"] {
            assert_eq!(pull_mode(Some(one)).unwrap(), (PullMode::One, "one"));
        }
        assert_eq!(
            pull_mode(Some("some")).unwrap_err().code,
            "invalid_argument"
        );
    }
}
