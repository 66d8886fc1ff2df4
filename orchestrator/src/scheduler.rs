//! The scheduler: turns due schedules into host events (SPEC §1, §9).
//!
//! Every `scheduler_interval` it reads the due schedules and fires each one: the firing is
//! planned by the pure [`plan_firing`] of `sb_rules` (fire time, next fire time, the event
//! copied from the schedule's template, its bus announcement) and committed by
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

use chrono::Utc;
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::ids::EventId;
use sb_rules::schedules::plan_firing;

use crate::deps::{OrchestratorDeps, OrchestratorOptions};
use crate::error::Result;

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
                Metrics::global().inc(names::EVENTS_INGESTED_TOTAL, &[("outcome", "scheduled")]);
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
