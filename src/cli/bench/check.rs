//! One run's stream checks and outcome (pure): [`RunCheck`] reads the results as they
//! arrive and decides [`RunOutcome`] — completed with its latencies, failed by code, or lost.

use std::time::Duration;

use sb_protocol::result::AgentRunResult;
use serde_json::Value;

use crate::client::{FollowError, delta_text, message_text};

/// How one run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunOutcome {
    /// `run.completed` with an intact stream.
    Completed {
        /// Post → first delivered result.
        first: Duration,
        /// Post → terminal result.
        terminal: Duration,
    },
    /// Ended with a failure code.
    Failed {
        /// See the module docs.
        code: String,
    },
    /// No terminal result: `timeout` or `connection`.
    Lost {
        /// Why.
        reason: &'static str,
    },
}

impl RunOutcome {
    /// The outcome of a follow that ended with `error`.
    #[must_use]
    pub fn from_error(error: &FollowError) -> Self {
        match error {
            FollowError::TimedOut => Self::Lost { reason: "timeout" },
            FollowError::Lost { .. } => Self::Lost {
                reason: "connection",
            },
            other => Self::Failed { code: other.code() },
        }
    }
}

/// Per-run stream checks: feed every yielded result to [`on_result`](Self::on_result); the
/// terminal one returns the outcome.
#[derive(Debug, Default)]
pub struct RunCheck {
    /// Results received (the stream's items).
    pub items: u64,
    first: Option<Duration>,
    last_sequence: u64,
    gap: bool,
    streamed: String,
    mismatch: bool,
}

impl RunCheck {
    /// Records `result`, received `elapsed` after the post; `Some` once it is terminal.
    pub fn on_result(&mut self, result: &AgentRunResult, elapsed: Duration) -> Option<RunOutcome> {
        self.items += 1;
        self.first.get_or_insert(elapsed);
        if let Some(sequence) = result.sequence {
            if sequence != self.last_sequence + 1 {
                self.gap = true;
            }
            self.last_sequence = sequence;
        }
        match result.result_type.as_str() {
            "message.delta" => self
                .streamed
                .push_str(&delta_text(result).unwrap_or_default()),
            "message.completed" => self.check_message(result),
            "run.completed" => {
                self.check_message(result);
                let code = if self.gap {
                    "client.sequence_gap"
                } else if self.mismatch {
                    "client.reply_mismatch"
                } else {
                    return Some(RunOutcome::Completed {
                        first: self.first.unwrap_or(elapsed),
                        terminal: elapsed,
                    });
                };
                return Some(RunOutcome::Failed { code: code.into() });
            }
            "run.failed" => {
                let code = result
                    .data
                    .get("code")
                    .and_then(Value::as_str)
                    .filter(|c| !c.is_empty())
                    .unwrap_or("run.failed");
                return Some(RunOutcome::Failed { code: code.into() });
            }
            _ => {}
        }
        None
    }

    /// A completed message must equal what was streamed of it (if anything was).
    fn check_message(&mut self, result: &AgentRunResult) {
        if let Some(text) = message_text(result) {
            if !self.streamed.is_empty() && self.streamed != text {
                self.mismatch = true;
            }
            self.streamed.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn result(t: &str, sequence: u64, data: Value) -> AgentRunResult {
        serde_json::from_value(json!({"type": t, "data": data, "sequence": sequence})).unwrap()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn feed(items: &[AgentRunResult]) -> Option<RunOutcome> {
        let mut check = RunCheck::default();
        items
            .iter()
            .enumerate()
            .find_map(|(i, r)| check.on_result(r, ms(10 * (i as u64 + 1))))
    }

    fn delta(seq: u64, s: &str) -> AgentRunResult {
        result(
            "message.delta",
            seq,
            json!({"chunk": {"role": "assistant", "content": s}}),
        )
    }

    fn completed(seq: u64, s: &str) -> AgentRunResult {
        result(
            "message.completed",
            seq,
            json!({"message": {"role": "assistant", "content": s}}),
        )
    }

    fn done(seq: u64) -> AgentRunResult {
        result("run.completed", seq, json!({"finish_reason": "stop"}))
    }

    #[test]
    fn a_clean_run_completes_with_its_latencies() {
        let outcome = feed(&[delta(1, "a "), delta(2, "b"), completed(3, "a b"), done(4)]);
        assert_eq!(
            outcome,
            Some(RunOutcome::Completed {
                first: ms(10),
                terminal: ms(40)
            })
        );
        assert_eq!(
            feed(&[done(1)]),
            Some(RunOutcome::Completed {
                first: ms(10),
                terminal: ms(10)
            })
        );
        assert_eq!(feed(&[delta(1, "a")]), None, "no terminal yet");
    }

    #[test]
    fn gaps_and_mismatches_fail_the_run() {
        let failed = |code: &str| Some(RunOutcome::Failed { code: code.into() });
        assert_eq!(
            feed(&[delta(1, "a "), completed(3, "a b"), done(4)]),
            failed("client.sequence_gap")
        );
        assert_eq!(
            feed(&[delta(1, "a "), delta(2, "c"), completed(3, "a b"), done(4)]),
            failed("client.reply_mismatch")
        );
        assert_eq!(
            feed(&[
                delta(1, "x"),
                result(
                    "run.failed",
                    2,
                    json!({"code": "runner.crashed", "error": "e", "retryable": false})
                )
            ]),
            failed("runner.crashed")
        );
        assert_eq!(
            feed(&[result("run.failed", 1, json!({}))]),
            failed("run.failed")
        );
    }

    #[test]
    fn follow_errors_map_to_failed_or_lost() {
        assert_eq!(
            RunOutcome::from_error(&FollowError::TimedOut),
            RunOutcome::Lost { reason: "timeout" }
        );
        assert_eq!(
            RunOutcome::from_error(&FollowError::Lost {
                attempts: 3,
                last_error: "refused".into()
            }),
            RunOutcome::Lost {
                reason: "connection"
            }
        );
        let unrouted = FollowError::NotRun {
            event_id: "e".into(),
            status: "unrouted".into(),
            reason: None,
            run_id: None,
        };
        assert_eq!(
            RunOutcome::from_error(&unrouted),
            RunOutcome::Failed {
                code: "event.unrouted".into()
            }
        );
    }
}
