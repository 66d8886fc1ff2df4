//! The worker's pure decisions: how an error settles a delivery, what a lost claim or a lost
//! lease means, why a claimed run ends before it starts, and how a run's items become result
//! messages. No I/O: the job pipeline (`job`) and the lease heartbeat (`lease`) gather the
//! facts and apply the outcome, and the rules are unit-tested here without services.
//!
//! # Why a redelivered job looks at the hand-off mark
//! A finished run's terminal status is written by the result sink, which may lag behind the
//! worker. So `running` + free lease alone does not prove a crash: the run may have ended
//! cleanly a moment ago. The worker marks the run handed off
//! ([`run_handed_off_key`](sb_common::session::run_handed_off_key)) once its terminal item is
//! handed on and before it releases the lease, so "no mark" is what distinguishes a crash
//! (finalize `interrupted`) from a clean end (drop the duplicate). The session is no witness:
//! it ends before the terminal item is handed on (a run whose end can be seen answers no
//! Host API call), so a worker lost in that moment leaves a run without session or mark.

use sb_common::bus::Settlement;
use sb_protocol::error::{ErrorCode, run_failure};
use sb_protocol::manifest::RunnerId;
use sb_protocol::messages::{ResultBatch, ResultMessage, RunJob, encode};
use sb_protocol::result::{AgentRunResult, ResultType};
use sb_store::RunStatus;

use crate::sequencer::RunItem;

/// Largest body of one `switchboard.results/1` message: a batch above it is split (a single
/// item is bounded by `worker.max_result_bytes` on its own). Far below the broker's message
/// size limit, and small enough that one batch never holds a shard's consumer for long.
pub(super) const BATCH_BYTES_MAX: usize = 1024 * 1024;

/// How a bus settlement follows from an error code: its disposition (the one mapping,
/// [`ErrorCode::disposition`]) as a settlement.
#[must_use]
pub fn settlement_for(code: ErrorCode) -> Settlement {
    code.disposition().into()
}

/// What to do with a job whose claim was lost while this worker holds the run's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimLost {
    /// Nothing to do: acknowledge and drop the job (the reason is logged).
    Drop(&'static str),
    /// The run started on a worker that is gone: finalize it `interrupted`.
    Interrupt,
    /// The ledger is in a state that should not last (e.g. still `queued`): try again later.
    Retry,
}

/// Decides a lost claim from the run's ledger status and whether the run is marked handed
/// off (see the module docs for why the mark is the crash witness).
#[must_use]
pub fn decide_claim_lost(status: Option<RunStatus>, handed_off: bool) -> ClaimLost {
    match status {
        None => ClaimLost::Drop("the run does not exist"),
        Some(s) if s.is_terminal() => ClaimLost::Drop("the run already ended"),
        Some(RunStatus::Running) if handed_off => ClaimLost::Drop(
            "the run ended elsewhere: its terminal item is handed on and the sink applies it",
        ),
        Some(RunStatus::Running) => ClaimLost::Interrupt,
        Some(_) => ClaimLost::Retry,
    }
}

/// Why a claimed run ends before it reaches a runner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PreStart {
    /// Cancel was requested before the start.
    Cancelled(String),
    /// The deadline passed while the job waited.
    DeadlinePassed,
    /// This worker does not host the runner.
    RunnerMissing,
}

impl PreStart {
    /// The terminal `run.failed` for this reason.
    #[must_use]
    pub fn result(&self, runner_id: &RunnerId, pool: &str) -> AgentRunResult {
        match self {
            Self::Cancelled(reason) => AgentRunResult::run_failed(
                run_failure::CANCELLED,
                if reason.is_empty() {
                    "cancelled before the run started".to_owned()
                } else {
                    reason.clone()
                },
                false,
            ),
            Self::DeadlinePassed => AgentRunResult::run_failed(
                run_failure::TIMEOUT,
                "the run deadline passed before the run started",
                run_failure::default_retryable(run_failure::TIMEOUT),
            ),
            Self::RunnerMissing => AgentRunResult::run_failed(
                run_failure::RUNNER_ERROR,
                format!("runner {runner_id} is not available in worker pool {pool}"),
                false,
            ),
        }
    }
}

/// Checks made after the claim, in order: cancel first (the user's intent wins), then the
/// deadline, then whether the runner is hosted here.
#[must_use]
pub fn decide_pre_start(
    cancel_reason: Option<String>,
    deadline_at_ms: Option<i64>,
    now_ms: i64,
    runner_hosted: bool,
) -> Option<PreStart> {
    if let Some(reason) = cancel_reason {
        return Some(PreStart::Cancelled(reason));
    }
    if deadline_at_ms.is_some_and(|d| now_ms >= d) {
        return Some(PreStart::DeadlinePassed);
    }
    if !runner_hosted {
        return Some(PreStart::RunnerMissing);
    }
    None
}

/// The result messages of `items` (consecutive items of `job`'s run, ascending), each with
/// the run's facts from its job, so whoever stores them need not read the run row.
pub(super) fn result_messages(
    job: &RunJob,
    conversation: Option<String>,
    items: Vec<RunItem>,
) -> Vec<ResultMessage> {
    items
        .into_iter()
        .map(|item| {
            ResultMessage::new(
                job.run_id,
                job.workspace_id.clone(),
                conversation.clone(),
                item.sequence,
                item.result,
            )
            .with_run(job.run.clone())
        })
        .collect()
}

/// The bodies that carry `messages` (consecutive items of one run, ascending) to the result
/// sink by the results queue: one `switchboard.result/1` for a single item, else
/// `switchboard.results/1` batches, halved until each is at most [`BATCH_BYTES_MAX`] (or holds
/// one item). Order is kept.
pub(super) fn result_bodies(messages: &[ResultMessage]) -> Vec<Vec<u8>> {
    fn encode_items(messages: &[ResultMessage], out: &mut Vec<Vec<u8>>) {
        let [first, ..] = messages else {
            return;
        };
        if messages.len() == 1 {
            out.push(encode(first));
            return;
        }
        let batch = ResultBatch::new(
            first.run_id,
            first.workspace_id.clone(),
            first.conversation_id.clone(),
            messages.iter().map(|m| (m.sequence, m.result.clone())),
        )
        .with_run(first.run.clone());
        let body = encode(&batch);
        if body.len() <= BATCH_BYTES_MAX {
            out.push(body);
        } else {
            let (head, tail) = messages.split_at(messages.len() / 2);
            encode_items(head, out);
            encode_items(tail, out);
        }
    }
    let mut out = Vec::new();
    encode_items(messages, &mut out);
    out
}

/// The `status` label of a terminal item: `completed`, `cancelled` or `failed`.
pub(super) fn terminal_status(result: &AgentRunResult) -> &'static str {
    match result.known_type() {
        Some(ResultType::RunCompleted) => "completed",
        _ if result.data.get("code").and_then(|c| c.as_str()) == Some(run_failure::CANCELLED) => {
            "cancelled"
        }
        _ => "failed",
    }
}

/// The cancel reason a run's cancel flag carries (its value; empty: a generic one).
pub(super) fn cancel_reason(flag: &[u8]) -> String {
    let reason = String::from_utf8_lossy(flag).trim().to_owned();
    if reason.is_empty() {
        "cancelled before the run started".to_owned()
    } else {
        reason
    }
}

/// What a worker does when renewing its run lease failed with `LeaseLost`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostLease {
    /// The lease is missing but the run is still ours (the session store came back empty):
    /// take it again, and put the run's session back.
    Reestablish,
    /// Another holder has it, or the run is no longer ours: stop acting on the run.
    Lost,
}

/// Decides a failed renewal from the lease's current holder and the run's ledger row
/// (`status`, `worker_id`). A lease taken by another holder is lost whatever the ledger
/// says; a missing one is ours again only while the ledger says we are running the run.
#[must_use]
pub fn decide_lost_lease(
    current_holder: Option<&str>,
    run: Option<(RunStatus, Option<&str>)>,
    me: &str,
) -> LostLease {
    match current_holder {
        Some(holder) if holder != me => LostLease::Lost,
        Some(_) => LostLease::Reestablish,
        None => match run {
            Some((RunStatus::Running, Some(worker))) if worker == me => LostLease::Reestablish,
            _ => LostLease::Lost,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_lost_decisions() {
        use ClaimLost::*;
        assert!(matches!(decide_claim_lost(None, false), Drop(_)));
        for terminal in [
            RunStatus::Completed,
            RunStatus::Failed,
            RunStatus::Cancelled,
            RunStatus::Timeout,
            RunStatus::Interrupted,
        ] {
            assert!(
                matches!(decide_claim_lost(Some(terminal), false), Drop(_)),
                "{terminal}"
            );
        }
        assert_eq!(
            decide_claim_lost(Some(RunStatus::Running), false),
            Interrupt
        );
        assert!(matches!(
            decide_claim_lost(Some(RunStatus::Running), true),
            Drop(_)
        ));
        assert_eq!(decide_claim_lost(Some(RunStatus::Queued), false), Retry);
    }

    #[test]
    fn pre_start_order() {
        let now = 1_000;
        assert_eq!(decide_pre_start(None, None, now, true), None);
        assert_eq!(decide_pre_start(None, Some(now + 1), now, true), None);
        assert_eq!(
            decide_pre_start(None, Some(now), now, true),
            Some(PreStart::DeadlinePassed)
        );
        assert_eq!(
            decide_pre_start(None, None, now, false),
            Some(PreStart::RunnerMissing)
        );
        assert_eq!(
            decide_pre_start(Some("user".into()), Some(0), now, false),
            Some(PreStart::Cancelled("user".into()))
        );
        let runner: RunnerId = "plugin:a/b/c".parse().unwrap();
        let failed = PreStart::DeadlinePassed.result(&runner, "default");
        assert_eq!(failed.data["code"], "timeout");
        assert_eq!(failed.data["retryable"], true);
        let failed = PreStart::Cancelled(String::new()).result(&runner, "default");
        assert_eq!(failed.data["code"], "cancelled");
        assert_eq!(failed.data["retryable"], false);
    }

    #[test]
    fn cancel_flag_reasons() {
        assert_eq!(cancel_reason(b" user asked \n"), "user asked");
        assert_eq!(cancel_reason(b""), "cancelled before the run started");
    }

    #[test]
    fn settlements_follow_the_disposition_mapping() {
        assert_eq!(
            settlement_for(ErrorCode::InvalidArgument),
            Settlement::Nack { requeue: false }
        );
        assert_eq!(
            settlement_for(ErrorCode::Unavailable),
            Settlement::Nack { requeue: true }
        );
        assert_eq!(settlement_for(ErrorCode::NotFound), Settlement::Ack);
    }

    #[test]
    fn a_missing_lease_is_reestablished_only_while_the_run_is_ours() {
        let running = |w: &'static str| Some((RunStatus::Running, Some(w)));
        // The store came back empty: the ledger says we run it.
        assert_eq!(
            decide_lost_lease(None, running("me"), "me"),
            LostLease::Reestablish
        );
        // Another holder took it: lost, whatever the ledger says.
        assert_eq!(
            decide_lost_lease(Some("other"), running("me"), "me"),
            LostLease::Lost
        );
        assert_eq!(
            decide_lost_lease(Some("me"), running("me"), "me"),
            LostLease::Reestablish
        );
        // Missing, and the run is no longer ours (finalized by the reaper, claimed elsewhere).
        assert_eq!(
            decide_lost_lease(None, Some((RunStatus::Interrupted, Some("me"))), "me"),
            LostLease::Lost
        );
        assert_eq!(
            decide_lost_lease(None, running("other"), "me"),
            LostLease::Lost
        );
        assert_eq!(decide_lost_lease(None, None, "me"), LostLease::Lost);
    }
}
