//! The run lease a worker holds while it executes a run: its key, and the heartbeat that
//! renews it — and re-establishes it, with the run's session, when a session store that
//! restarted empty lost both while the run is still ours ([`decide_lost_lease`]).

use std::sync::Arc;
use std::time::Duration;

use sb_common::session::{SessionError, SessionStore, run_lease_key};
use sb_protocol::ids::RunId;
use sb_store::RunLedger;
use serde_json::Value;
use tokio::sync::watch;

use super::decisions::{LostLease, decide_lost_lease};

/// The session-store key of a run's worker lease ([`run_lease_key`]: the reaper reads it
/// too).
#[must_use]
pub fn lease_key(run_id: &RunId) -> String {
    run_lease_key(run_id)
}

/// The run a [`heartbeat`] keeps.
pub(super) struct HeartbeatRun {
    pub(super) run_id: RunId,
    /// This worker's id.
    pub(super) holder: String,
    /// The run's session as the job pipeline read it with the lease
    /// ([`SessionStore::begin_run`]).
    pub(super) session: Option<Value>,
    /// Lease TTL set by every renewal.
    pub(super) ttl: Duration,
    /// Time between renewals.
    pub(super) interval: Duration,
}

/// Renews the run lease every `interval`. A renewal that finds the lease missing while the
/// run is still ours ([`decide_lost_lease`]) re-establishes it, and the run's `session` with
/// it (as read with the lease, kept alive by later heartbeats): a session store that
/// restarted empty neither cancels a healthy run nor breaks its Host API calls. The session
/// has to be read before any loss, since a store that lost it cannot give it back. A lease
/// held by another holder, or a run that is no longer ours, cancels the run (a worker that
/// lost its lease must stop acting on the run).
pub(super) async fn heartbeat(
    sessions: Arc<dyn SessionStore>,
    ledger: Arc<dyn RunLedger>,
    run: HeartbeatRun,
    cancel: watch::Sender<Option<String>>,
) {
    let HeartbeatRun {
        run_id,
        holder,
        session,
        ttl,
        interval,
    } = run;
    let key = lease_key(&run_id);
    let mut restored = false;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match sessions.renew_lease(&key, &holder, ttl).await {
            Ok(()) => {
                if restored {
                    // A restored session lives as long as its holder keeps renewing.
                    if let Err(error) = sessions.touch_session(&run_id, ttl).await {
                        tracing::debug!(%error, "extending the restored run session failed");
                    }
                }
            }
            Err(SessionError::LeaseLost { .. }) => {
                match reestablish(&*sessions, &*ledger, run_id, &holder, ttl).await {
                    Ok(true) => {
                        tracing::warn!(
                            "run lease was missing (session store emptied?); re-established"
                        );
                        restored |=
                            restore_session(&*sessions, run_id, session.as_ref(), ttl).await;
                    }
                    Ok(false) => {
                        tracing::warn!("run lease lost; cancelling the run");
                        cancel.send_if_modified(|current| {
                            if current.is_none() {
                                *current = Some("worker lease lost".to_owned());
                                true
                            } else {
                                false
                            }
                        });
                        return;
                    }
                    Err(error) => {
                        tracing::warn!(%error, "checking a lost run lease failed; will retry");
                    }
                }
            }
            Err(error) => tracing::warn!(%error, "renewing the run lease failed; will retry"),
        }
    }
}

/// Takes the run lease again after a renewal found it lost, if [`decide_lost_lease`] says
/// the run is still ours. `Ok(true)` once the lease is ours again.
async fn reestablish(
    sessions: &dyn SessionStore,
    ledger: &dyn RunLedger,
    run_id: RunId,
    holder: &str,
    ttl: Duration,
) -> Result<bool, String> {
    let key = lease_key(&run_id);
    let current = sessions
        .lease_holder(&key)
        .await
        .map_err(|e| e.to_string())?;
    let run = ledger.get_run(run_id).await.map_err(|e| e.to_string())?;
    let facts = run.as_ref().map(|r| (r.status, r.worker_id.as_deref()));
    match decide_lost_lease(current.as_deref(), facts, holder) {
        LostLease::Lost => Ok(false),
        // Atomic: fails if another holder took it in between.
        LostLease::Reestablish => sessions
            .acquire_lease(&key, holder, ttl)
            .await
            .map_err(|e| e.to_string()),
    }
}

/// Puts the run's session back if the store lost it. `true` if it was put back.
async fn restore_session(
    sessions: &dyn SessionStore,
    run_id: RunId,
    session: Option<&Value>,
    ttl: Duration,
) -> bool {
    let Some(session) = session else {
        return false;
    };
    match sessions.get_session(&run_id).await {
        Ok(Some(_)) => false,
        Ok(None) => match sessions.put_session(&run_id, session, ttl).await {
            Ok(()) => {
                tracing::warn!("run session was missing; restored");
                true
            }
            Err(error) => {
                tracing::warn!(%error, "restoring the run session failed");
                false
            }
        },
        Err(error) => {
            tracing::warn!(%error, "reading the run session failed");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        let run = RunId::new();
        assert_eq!(lease_key(&run), run.to_string());
    }
}
