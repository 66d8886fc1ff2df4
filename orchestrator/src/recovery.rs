//! Crash recovery for a bus that does not outlive the process (embedded mode's in-process
//! bus): work the ledger knows about but whose messages were lost.
//!
//! A crash (or a drain cut short) can lose messages that were published but not consumed.
//! The ledger still knows about that work, so [`recover`] runs at start, before the
//! consumers do:
//! - events still `received` (published, never routed) are published again;
//! - runs still `queued` get their event published again: the event consumer reuses the
//!   run (one run per event) and publishes its job again;
//! - runs still `running` were being executed by the process that stopped, and no worker can
//!   hold them now: they end `interrupted` with a `run.failed {code: "interrupted"}` item
//!   (SPEC §10.2: an interrupted run is never replayed automatically).
//!
//! Every consumer is idempotent, so a message published twice (by the recovery and by the
//! outbox relay) has no further effect. With a durable broker (RabbitMQ) nothing is to be
//! recovered: the broker keeps unconsumed messages, and the outbox keeps unpublished ones.
//!
//! This is the orchestrator's own domain (the run ledger's statuses, the sink's terminal
//! items, the event announcement); embedded mode only decides when it runs.

use std::collections::HashSet;
use std::sync::Arc;

use sb_common::bus::{BusError, PublishOptions};
use sb_protocol::error::run_failure;
use sb_protocol::ids::{EventId, RunId};
use sb_protocol::result::AgentRunResult;
use sb_store::{EventRecord, EventStatus, RunOutcome, RunStatus, StoreError};

use crate::deps::{OrchestratorDeps, OrchestratorOptions};
use crate::error::OrchestratorError;
use crate::sink::ResultSink;

/// The message of the `run.failed` item of a run that recovery finds still `running`.
pub const INTERRUPTED_MESSAGE: &str =
    "the switchboard process stopped while the run was in progress";

/// How many runs or events the recovery reads per store query: a restart after a long
/// outage can find many, so they are read and handled a page at a time.
pub const RECOVERY_PAGE: i64 = 100;

/// What the recovery pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Events published again (never routed, or routed to a run that never started).
    pub republished: Vec<EventId>,
    /// Runs that were executing when the process stopped, now `interrupted`.
    pub interrupted: Vec<RunId>,
}

/// Why the recovery pass failed.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    /// Reading the ledger or the event log failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Publishing an event again failed.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// Finalizing a run as `interrupted` failed.
    #[error(transparent)]
    Orchestrator(#[from] OrchestratorError),
}

/// The recovery pass (see the module docs).
///
/// Everything it needs is read through the store traits, in pages across all workspaces
/// ([`RunLedger::runs_with_status`](sb_store::RunLedger::runs_with_status),
/// [`EventLog::with_status`](sb_store::EventLog::with_status)). It must run before the
/// orchestrator and the gateway start, so no statuses change under it except its own.
pub async fn recover(
    deps: &OrchestratorDeps,
    options: &Arc<OrchestratorOptions>,
) -> Result<RecoveryReport, RecoveryError> {
    let sink = ResultSink::new(deps.clone(), Arc::clone(options));
    let mut report = RecoveryReport::default();
    interrupt_running_runs(deps, &sink, &mut report).await?;
    republish_lost_events(deps, &mut report).await?;
    if !report.republished.is_empty() || !report.interrupted.is_empty() {
        tracing::info!(
            republished = report.republished.len(),
            interrupted = report.interrupted.len(),
            "recovered work left by the previous process"
        );
    }
    Ok(report)
}

/// Runs that were executing: no worker of this process holds them any more, so they end
/// `interrupted` (each finished as it is read; the store's cursor is a position, so
/// finishing them does not make the next page skip any).
async fn interrupt_running_runs(
    deps: &OrchestratorDeps,
    sink: &ResultSink,
    report: &mut RecoveryReport,
) -> Result<(), RecoveryError> {
    let mut cursor = None;
    loop {
        let page = deps
            .stores
            .runs
            .runs_with_status(RunStatus::Running, cursor, Some(RECOVERY_PAGE))
            .await?;
        for run in page.items {
            let outcome = RunOutcome::with_error(
                RunStatus::Interrupted,
                run_failure::INTERRUPTED,
                INTERRUPTED_MESSAGE,
            );
            let item = AgentRunResult::run_failed(
                run_failure::INTERRUPTED,
                INTERRUPTED_MESSAGE,
                run_failure::default_retryable(run_failure::INTERRUPTED),
            );
            // The item and the status in one commit; a run whose own terminal item was
            // stored ends with that one (exactly one terminal item).
            if sink.finalize(&run, outcome, item).await?.is_none() {
                continue;
            }
            tracing::warn!(run_id = %run.id, "run was in progress when the process stopped; finalized as interrupted");
            report.interrupted.push(run.id);
        }
        let Some(next) = page.next_cursor else {
            return Ok(());
        };
        cursor = Some(next);
    }
}

/// Events never routed, then events whose run never started (their job was lost: the
/// orchestrator reuses the run and publishes its job again). Each event is published once,
/// in that order.
async fn republish_lost_events(
    deps: &OrchestratorDeps,
    report: &mut RecoveryReport,
) -> Result<(), RecoveryError> {
    let mut cursor = None;
    loop {
        let page = deps
            .stores
            .events
            .with_status(EventStatus::Received, cursor, Some(RECOVERY_PAGE))
            .await?;
        for event in &page.items {
            republish(deps, event).await?;
            report.republished.push(event.id);
        }
        let Some(next) = page.next_cursor else {
            break;
        };
        cursor = Some(next);
    }

    // A run is created before its event is marked `dispatched`, so a queued run's event may
    // still be `received`, and published above already.
    let unrouted: HashSet<EventId> = report.republished.iter().copied().collect();
    let mut cursor = None;
    loop {
        let page = deps
            .stores
            .runs
            .runs_with_status(RunStatus::Queued, cursor, Some(RECOVERY_PAGE))
            .await?;
        for run in &page.items {
            if unrouted.contains(&run.event_id) {
                continue;
            }
            let Some(event) = deps.stores.events.get(run.event_id).await? else {
                continue;
            };
            republish(deps, &event).await?;
            report.republished.push(event.id);
        }
        let Some(next) = page.next_cursor else {
            return Ok(());
        };
        cursor = Some(next);
    }
}

/// Publishes the bus message of `event` again, as the gateway's outbox did the first time.
async fn republish(deps: &OrchestratorDeps, event: &EventRecord) -> Result<(), RecoveryError> {
    let announcement = deps.topology.event_announcement(
        &event.workspace_id,
        event.id,
        event.conversation_id.as_deref(),
    );
    deps.bus
        .publish(
            &announcement.exchange,
            &announcement.routing_key,
            announcement.body.into(),
            PublishOptions::default(),
        )
        .await?;
    Ok(())
}
