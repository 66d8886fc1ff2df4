//! The per-shard consume loop: one event delivery at a time, routed and settled.

use std::sync::Arc;

use sb_common::bus::Delivery;
use sb_common::shutdown::Shutdown;
use sb_protocol::messages::{self, EventMessage};
use tracing::Instrument;

use super::{EventRouter, RouteOutcome};
use crate::error::{OrchestratorError, Result};
use crate::settle::{consume, pause, settle};

impl EventRouter {
    /// Routes a consumed event message. While another consumer holds the event's route lock,
    /// waits here (polling, up to `route_lock_ttl`) instead of requeueing at once: every
    /// requeue counts against the queue's delivery limit, and the lock of a consumer that
    /// died mid-route outlives a few quick retries — the event would be dead-lettered, never
    /// routed (found by the chaos suite's `kill_orchestrator`).
    ///
    /// For the same reason it waits in place, with the retry backoff and until shutdown,
    /// while the ledger or the session store is unreachable
    /// ([`OrchestratorError::is_backend_outage`]): a database restart outlasts the quick
    /// retries of the delivery limit.
    async fn handle(&self, delivery: &Delivery, shutdown: &Shutdown) -> Result<RouteOutcome> {
        let message: EventMessage = messages::decode(&delivery.body)?;
        let span = tracing::info_span!("route", event_id = %message.event_id);
        let give_up = tokio::time::Instant::now() + self.options.route_lock_ttl;
        let mut outages = 0u32;
        loop {
            match self.route(&message).instrument(span.clone()).await {
                Err(OrchestratorError::RouteInProgress(_))
                    if tokio::time::Instant::now() < give_up =>
                {
                    tokio::time::sleep(ROUTE_LOCK_POLL).await;
                }
                Err(error) if error.is_backend_outage() && !shutdown.is_shutting_down() => {
                    tracing::warn!(%error, event_id = %message.event_id, attempt = outages, "backend unreachable; retrying the event in place");
                    if !pause(self.options.retry_delay(outages), shutdown).await {
                        return Err(error);
                    }
                    outages = outages.saturating_add(1);
                }
                outcome => return outcome,
            }
        }
    }
}

/// How often a consumer waiting for another's route lock tries again (see `handle`).
const ROUTE_LOCK_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// Consumes events shard `shard` until shutdown: one event at a time, so the events of one
/// conversation are routed in order.
pub async fn run_shard(router: Arc<EventRouter>, shard: u32, shutdown: Shutdown) {
    let queue = router.deps.topology.events_queue(shard);
    let options = &router.options;
    consume(
        router.deps.bus.as_ref(),
        &queue,
        1,
        options,
        &shutdown,
        |batch| async {
            for delivery in batch {
                let outcome = router.handle(&delivery, &shutdown).await.map(|_| ());
                settle(delivery, &outcome, &queue.name, options, &shutdown).await;
            }
        },
    )
    .await;
}
