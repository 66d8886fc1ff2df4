//! How a run ends when its runner did not end it, in one place for every role that ends
//! runs: the worker (a redelivered job whose worker is gone), the orchestrator's reaper
//! (deadline, deployment maximum, lost lease) and embedded recovery (a process that stopped
//! mid-run).
//!
//! [`Finalizer::finalize`] is the one way to do it:
//!
//! 1. the ledger stores the host-made terminal item at the run's first free sequence **and**
//!    the terminal status in one commit ([`RunLedger::finalize_run`]), so a stream reader
//!    never sees the status without the item; if the run's own terminal item is already
//!    stored (stored, not yet applied), that item ends the run instead, so a run has exactly
//!    one terminal item whatever races;
//! 2. the run's session is ended ([`Finalizer::end_session`]): Host API calls for the run are refused
//!    from then on, and the steering items it never pulled are audited as
//!    `steering.dropped`;
//! 3. the terminal item is handed over ([`HandOver`]): the orchestrator applies its side
//!    effects and publishes it for live delivery; the worker publishes it to the result sink,
//!    which does the same.
//!
//! The session ends before the hand-over because the ledger already says how the run ended:
//! nothing the session guards is worth keeping open while the side effects are applied.
//!
//! The roles differ only in how the session ends ([`SessionEnd`]: the worker holds the run's
//! lease and releases it with the session) and in the hand-over; everything else — the
//! order, the one-terminal-item rule, the audit, the run metric — is here.

use std::fmt::Display;
use std::time::Duration;

use async_trait::async_trait;
use sb_common::session::{EndedSession, SessionStore};
use sb_common::telemetry::{Metrics, names};
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::result::AgentRunResult;
use sb_store::{EventLog, Finalized, RunLedger, RunOutcome, StoreError, audit};
use serde_json::Value;

/// The run being ended: what its audit rows and log lines name.
#[derive(Clone, Copy)]
pub struct RunRef<'a> {
    /// The run.
    pub run_id: RunId,
    /// Its runner (named by the `steering.dropped` rows; written out only for them, so that
    /// ending a run without dropped steering costs no allocation).
    pub runner_id: &'a (dyn Display + Sync),
    /// Its workspace (the audit rows' workspace).
    pub workspace_id: &'a WorkspaceId,
}

/// How the run's session ends.
#[derive(Debug, Clone, Copy)]
pub enum SessionEnd<'a> {
    /// By the host, which holds no lease of the run (reaper, recovery):
    /// [`SessionStore::end_session`].
    Host,
    /// By the worker holding the run's lease: the session ends, the cancel flag goes, the run
    /// is marked handed off for `handed_off_ttl` and the lease is released, in one step
    /// ([`SessionStore::end_run`]).
    Holder {
        /// The lease holder (the worker's id).
        holder: &'a str,
        /// How long the hand-off mark lives (the reaper leaves a marked run to the sink).
        handed_off_ttl: Duration,
    },
}

/// Where the terminal item that ended the run came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Made by the host and stored by this finalize.
    HostMade,
    /// The run's own terminal item, already in the ledger but not yet applied.
    Stored,
}

impl Origin {
    /// The origin's name in log lines.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::HostMade => "host-made",
            Self::Stored => "stored",
        }
    }
}

/// Step 3 of [`Finalizer::finalize`]: what the caller does with the terminal item once it is stored
/// and the session has ended.
#[async_trait]
pub trait HandOver: Send + Sync {
    /// Why a hand-over failed.
    type Error: Send;

    /// Applies the side effects of `item` (stored at `sequence`, its envelope's `run_id` and
    /// `sequence` set) and publishes it for live delivery, or hands it to whoever does. Every
    /// side effect of a terminal item must be idempotent: a stored item is handed over again
    /// by whoever finalizes the run next.
    async fn hand_over(
        &self,
        sequence: u64,
        item: AgentRunResult,
        origin: Origin,
    ) -> Result<(), Self::Error>;
}

/// A run [`Finalizer::finalize`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ended {
    /// The sequence of the terminal item that ended it.
    pub sequence: u64,
    /// Whether that item was made by this finalize or was the run's own.
    pub origin: Origin,
    /// Whether the session store answered the session's end (with
    /// [`SessionEnd::Holder`], the lease is then no longer the holder's). When it did not,
    /// the session expires with its ttl.
    pub session_answered: bool,
}

/// Why [`Finalizer::finalize`] failed.
#[derive(Debug)]
pub enum FinalizeError<E> {
    /// The ledger could not store or read the terminal item; nothing was ended, try again.
    Ledger(StoreError),
    /// The run ended (ledger and session), but its terminal item was not handed over.
    HandOver {
        /// The run's end, as far as it got.
        ended: Ended,
        /// Why the hand-over failed.
        error: E,
    },
}

/// The stores a run's end writes to: the ledger (the terminal item and status), the session
/// store (the session, and a holder's lease) and the event log (the audit rows).
#[derive(Clone, Copy)]
pub struct Finalizer<'a> {
    /// The run ledger.
    pub ledger: &'a dyn RunLedger,
    /// The event log the `steering.dropped` rows go to.
    pub events: &'a dyn EventLog,
    /// The session store.
    pub sessions: &'a dyn SessionStore,
}

impl Finalizer<'_> {
    /// Finalizes `run` with the host-made terminal `item` and its ledger `outcome` (see the
    /// crate docs for the steps). Returns `None` when the run had already ended (someone else
    /// finalized it; nothing is done).
    ///
    /// # Errors
    /// [`FinalizeError::Ledger`] when the ledger fails (nothing changed that a retry would not
    /// redo), [`FinalizeError::HandOver`] when the item is stored and the session ended but the
    /// hand-over failed.
    pub async fn finalize<H: HandOver + ?Sized>(
        &self,
        run: RunRef<'_>,
        outcome: RunOutcome,
        item: AgentRunResult,
        session: SessionEnd<'_>,
        hand_over: &H,
    ) -> Result<Option<Ended>, FinalizeError<H::Error>> {
        let status = outcome.status;
        let finalized = self
            .ledger
            .finalize_run(run.run_id, outcome, item.clone())
            .await
            .map_err(FinalizeError::Ledger)?;
        let (sequence, item, origin) = match finalized {
            Finalized::AlreadyEnded(_) => return Ok(None),
            Finalized::TerminalStored { sequence } => {
                let stored = stored_item(self.ledger, run.run_id, sequence)
                    .await
                    .map_err(FinalizeError::Ledger)?;
                (sequence, stored, Origin::Stored)
            }
            Finalized::Ended { sequence } => {
                Metrics::global().inc(names::RUNS_TOTAL, &[("status", status.as_str())]);
                let item = item.with_run_id(run.run_id).with_sequence(sequence);
                (sequence, item, Origin::HostMade)
            }
        };
        let ended = Ended {
            sequence,
            origin,
            session_answered: self.end_session(run, session).await,
        };
        hand_over
            .hand_over(sequence, item, origin)
            .await
            .map_err(|error| FinalizeError::HandOver { ended, error })?;
        Ok(Some(ended))
    }

    /// Ends `run`'s session as `how` says and audits each steering item it never pulled as a
    /// `steering.dropped` event-log row (reason `run_ended`) and on the audit log
    /// ([`audit::LOG_TARGET`]).
    ///
    /// Returns whether the session store answered; when it did not, the session (and a holder's
    /// lease) expire with their ttl, and until then the runner host refuses calls for the ended
    /// run. The steering items are gone from the session store either way, so a failed audit
    /// append is logged rather than retried; a row's idempotency key makes a repeated audit
    /// append once.
    pub async fn end_session(&self, run: RunRef<'_>, how: SessionEnd<'_>) -> bool {
        let ended: Result<Option<EndedSession>, _> = match how {
            SessionEnd::Host => self.sessions.end_session(&run.run_id).await,
            SessionEnd::Holder {
                holder,
                handed_off_ttl,
            } => self
                .sessions
                .end_run(&run.run_id, holder, handed_off_ttl)
                .await
                .map(|end| end.ended),
        };
        match ended {
            Ok(Some(ended)) => {
                audit_dropped_steering(self.events, run, &ended.steering).await;
                true
            }
            Ok(None) => {
                tracing::debug!(run_id = %run.run_id, "run session was already gone");
                true
            }
            Err(error) => {
                tracing::warn!(run_id = %run.run_id, %error, "ending the run's session failed; it expires with its ttl");
                false
            }
        }
    }
}

/// The run's terminal item stored at `sequence`, with its envelope set.
async fn stored_item(
    ledger: &dyn RunLedger,
    run_id: RunId,
    sequence: u64,
) -> Result<AgentRunResult, StoreError> {
    let after = i64::try_from(sequence.saturating_sub(1)).unwrap_or(i64::MAX);
    let record = ledger
        .events_after(run_id, after, 1)
        .await?
        .into_iter()
        .find(|record| record.sequence == after + 1)
        .ok_or_else(|| {
            StoreError::Corrupt(format!(
                "run {run_id}: the terminal item at {sequence} is not in the ledger"
            ))
        })?;
    let item: AgentRunResult = serde_json::from_value(record.data).map_err(|error| {
        StoreError::Corrupt(format!(
            "run {run_id}: the stored terminal item at {sequence} does not parse: {error}"
        ))
    })?;
    Ok(item.with_run_id(run_id).with_sequence(sequence))
}

async fn audit_dropped_steering(events: &dyn EventLog, run: RunRef<'_>, items: &[Value]) {
    if items.is_empty() {
        return;
    }
    let runner_id = run.runner_id.to_string();
    for item in items {
        let event_id = item
            .pointer("/event/event_id")
            .and_then(Value::as_str)
            .unwrap_or("");
        tracing::info!(
            target: audit::LOG_TARGET,
            audit = audit::STEERING_DROPPED,
            run_id = %run.run_id,
            event_id,
            "steering item dropped: the run ended before pulling it"
        );
        let row = audit::steering_dropped(
            item,
            run.run_id,
            &runner_id,
            run.workspace_id,
            audit::DROPPED_RUN_ENDED,
        );
        if let Err(error) = events.append(row, Vec::new()).await {
            tracing::warn!(run_id = %run.run_id, %error, event_id, "writing the steering.dropped audit row failed");
        }
    }
}
