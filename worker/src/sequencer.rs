//! Per-run result sequencing and validation (SPEC §4.3, §4.4): the pure core between a
//! runner's raw output and the ordered stream the worker publishes.
//!
//! A [`RunSequencer`] sees every raw result of one run, in arrival order, and decides:
//!
//! ```text
//!  raw result ──▶ after terminal? ──yes──▶ Skip(Late)                 (late completion isolation)
//!                     │ no
//!                     ▼
//!              envelope run_id ≠ run? ──yes──▶ Fail(runner.protocol_error)
//!                     │ no
//!                     ▼
//!              runner `sequence` seen? ──yes──▶ Skip(Duplicate)        (gaps/out-of-order: warn)
//!                     │ no
//!                     ▼
//!              classify (sb_protocol::result::classify)
//!                Valid / Telemetry ──▶ non-terminal and n+1 = items_max? ──yes──▶ Fail(runner.too_many_items)
//!                     │                     │ no
//!                     │                     ▼
//!                     └──────────────▶ Deliver(item with transport sequence n+1)
//!                Dropped           ──▶ Skip(Invalid)                  (unknown type, bad strict payload)
//!                ProtocolError     ──▶ Fail(runner.protocol_error)     (missing type, oversize, …)
//! ```
//!
//! Transport sequences are assigned here and only here: 1, 2, 3, … with no gaps, over the
//! items actually delivered (skipped results do not consume a number). Items the host makes
//! without a runner's result — a run refused before it starts, a runner that could not be
//! started ([`RunSequencer::end_with`]), a runner host that lost the run
//! ([`RunSequencer::continuing`]) — are numbered here too. The runner's own
//! `sequence` is only used to drop duplicates; it is replaced in the delivered envelope.
//!
//! Exactly one terminal item is produced per run: the runner's own `run.completed` /
//! `run.failed`, or one synthesized by [`RunSequencer::admit`] (protocol errors, too many
//! items) or
//! [`RunSequencer::end`]
//! (`runner.empty_output` for a run that ends with no message and no terminal, SPEC's "no
//! silent success"; `run.completed {finish_reason: "stop"}` for one that produced messages).
//! After the terminal item everything is skipped.
//!
//! A run delivers at most `items_max` items ([`RunSequencer::with_items_max`],
//! `limits.run_items_max`), its terminal item included: once `items_max - 1` items were
//! delivered, a terminal item from the runner is still accepted, while any other item ends the
//! run with a synthesized `run.failed {code: "runner.too_many_items"}` in its place (the last
//! number), so the stream stays dense and bounded.
//!
//! Every delivered item has its NUL characters (U+0000) replaced with U+FFFD
//! ([`sb_protocol::result::replace_nul`]): PostgreSQL cannot store them, and an item the
//! ledger refuses would be a hole in the dense sequence.

use std::collections::BTreeSet;
use std::num::NonZeroU64;
use std::time::{SystemTime, UNIX_EPOCH};

use sb_protocol::error::run_failure;
use sb_protocol::ids::RunId;
use sb_protocol::result::{
    AgentRunResult, Classified, ResultLimits, ResultType, classify, replace_nul,
};
use serde_json::Value;

/// Default of [`RunSequencer::with_items_max`] (and of `limits.run_items_max`): a long
/// streamed answer is a few thousand deltas, so 10 000 leaves room for the longest legitimate
/// run while a runaway runner cannot fill the ledger with one run.
pub const DEFAULT_RUN_ITEMS_MAX: NonZeroU64 = NonZeroU64::new(10_000).unwrap();

/// One delivered result with its transport sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct RunItem {
    /// Transport sequence (1, 2, 3, … per run). Also written into `result.sequence`.
    pub sequence: u64,
    /// The envelope, with `run_id` and `sequence` set by the host.
    pub result: AgentRunResult,
}

impl RunItem {
    /// Whether this item ends the run.
    #[must_use]
    pub fn is_terminal(&self) -> bool {
        self.result.is_terminal()
    }

    /// For a terminal `run.failed`: its `code`.
    #[must_use]
    pub fn failure_code(&self) -> Option<&str> {
        if self.result.known_type() == Some(ResultType::RunFailed) {
            self.result.data.get("code").and_then(Value::as_str)
        } else {
            None
        }
    }
}

/// What [`RunSequencer::admit`] decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// Deliver this item (it may be the terminal one).
    Deliver(RunItem),
    /// Do not deliver; log `reason` and go on.
    Skip(SkipReason),
    /// The runner broke the protocol (`runner.protocol_error`) or produced more items than the
    /// run may have (`runner.too_many_items`): deliver this synthesized terminal `run.failed`;
    /// the run is over.
    Fail(RunItem),
}

/// Why a result was not delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SkipReason {
    /// The run already has its terminal item.
    Late,
    /// A runner `sequence` that was already delivered.
    Duplicate { sequence: u64 },
    /// Dropped by classification (unknown type, invalid strict payload).
    Invalid { reason: String },
}

/// How a run's stream ended without (necessarily) a terminal result from the runner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndCause {
    /// The runner sent `done` (or a `per_run` process exited cleanly).
    Done,
    /// The host cancelled the run and the grace period passed.
    Cancelled { reason: String },
    /// The run's deadline passed.
    TimedOut,
    /// The process died with the run in flight.
    Crashed { detail: String },
    /// A `shared` process exited cleanly (status 0) with the run in flight: no crash, but the
    /// run was left unfinished, so it fails like a crash (`runner.crashed`) with a message
    /// that says what happened.
    ExitedMidRun { detail: String },
    /// The process broke the wire protocol in a way attributable to this run.
    ProtocolError { detail: String },
    /// The worker stopped hosting the run (forced shutdown).
    Interrupted { detail: String },
}

/// Runner-side sequence bookkeeping: which runner sequences were seen, compactly (a dense
/// prefix plus a sparse set above it), so a run with a million results keeps O(1) state when
/// the runner numbers densely.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeenSequences {
    /// Every sequence in `1..=dense_upto` has been seen.
    dense_upto: u64,
    /// Seen sequences above `dense_upto + 1`.
    sparse: BTreeSet<u64>,
    /// The largest sequence seen.
    max_seen: u64,
}

/// What a runner sequence means relative to what was seen before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// The next expected one (or the first).
    InOrder,
    /// Larger than expected: `expected..sequence` are missing (so far).
    Gap { expected: u64 },
    /// Smaller than the largest seen but new (a late arrival; delivered, logged).
    OutOfOrder { max_seen: u64 },
    /// Already seen: drop.
    Duplicate,
}

impl SeenSequences {
    /// Records `sequence` and says how it relates to the previous ones. Sequence 0 (invalid per
    /// protocol, which starts at 1) is treated like any other number.
    pub fn record(&mut self, sequence: u64) -> SeqCheck {
        if sequence <= self.dense_upto && sequence != 0 || self.sparse.contains(&sequence) {
            return SeqCheck::Duplicate;
        }
        let check = if sequence == self.max_seen + 1 {
            SeqCheck::InOrder
        } else if sequence > self.max_seen {
            SeqCheck::Gap {
                expected: self.max_seen + 1,
            }
        } else {
            SeqCheck::OutOfOrder {
                max_seen: self.max_seen,
            }
        };
        if sequence == 0 {
            // Outside the protocol's numbering; remember it in the sparse set only.
            self.sparse.insert(0);
            return check;
        }
        self.max_seen = self.max_seen.max(sequence);
        if sequence == self.dense_upto + 1 {
            self.dense_upto = sequence;
            while self.sparse.remove(&(self.dense_upto + 1)) {
                self.dense_upto += 1;
            }
        } else {
            self.sparse.insert(sequence);
        }
        check
    }
}

/// The per-run state machine over results. Pure: no I/O, no clock except for filling a
/// missing `timestamp` (see [`RunSequencer::with_clock`]).
#[derive(Debug, Clone)]
pub struct RunSequencer {
    run_id: RunId,
    run_id_text: String,
    limits: ResultLimits,
    /// Most items delivered for the run, its terminal item included.
    items_max: NonZeroU64,
    /// The transport sequence of the next delivered item.
    next_sequence: u64,
    seen: SeenSequences,
    /// Whether any `message.*` item was delivered (no-silent-success rule).
    saw_message: bool,
    /// Set once the terminal item was produced.
    finished: bool,
    clock: fn() -> i64,
}

fn epoch_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

impl RunSequencer {
    #[must_use]
    pub fn new(run_id: RunId, limits: ResultLimits) -> Self {
        Self {
            run_id,
            run_id_text: run_id.to_string(),
            limits,
            items_max: DEFAULT_RUN_ITEMS_MAX,
            next_sequence: 1,
            seen: SeenSequences::default(),
            saw_message: false,
            finished: false,
            clock: epoch_now,
        }
    }

    /// Sets the most items the run may deliver, its terminal item included
    /// (default [`DEFAULT_RUN_ITEMS_MAX`]).
    #[must_use]
    pub fn with_items_max(mut self, items_max: NonZeroU64) -> Self {
        self.items_max = items_max;
        self
    }

    /// Replaces the clock used for missing timestamps (tests).
    #[must_use]
    pub fn with_clock(mut self, clock: fn() -> i64) -> Self {
        self.clock = clock;
        self
    }

    /// A sequencer for a stream whose first `delivered` items were numbered by another
    /// sequencer now out of reach (a runner host's actor that went away mid-run): the next
    /// item it makes is number `delivered + 1`. Only for ending the run ([`Self::end_with`],
    /// [`Self::end`]); it has not seen the runner's own sequences.
    #[must_use]
    pub fn continuing(run_id: RunId, delivered: u64) -> Self {
        Self {
            next_sequence: delivered + 1,
            ..Self::new(run_id, ResultLimits::default())
        }
    }

    #[must_use]
    pub fn run_id(&self) -> RunId {
        self.run_id
    }

    /// Whether the terminal item was produced.
    #[must_use]
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Number of items delivered so far.
    #[must_use]
    pub fn delivered(&self) -> u64 {
        self.next_sequence - 1
    }

    /// Decides what to do with one raw result of this run.
    pub fn admit(&mut self, raw: &Value) -> Admission {
        if self.finished {
            return Admission::Skip(SkipReason::Late);
        }
        let foreign_run = raw
            .get("run_id")
            .and_then(Value::as_str)
            .filter(|inner| !inner.is_empty() && *inner != self.run_id_text);
        if let Some(inner) = foreign_run {
            return Admission::Fail(self.terminal_failure(
                run_failure::RUNNER_PROTOCOL_ERROR,
                format!(
                    "result names run `{inner}` on the stream of run {}",
                    self.run_id_text
                ),
            ));
        }
        if let Some(seq) = raw.get("sequence").and_then(Value::as_u64) {
            match self.seen.record(seq) {
                SeqCheck::Duplicate => {
                    return Admission::Skip(SkipReason::Duplicate { sequence: seq });
                }
                SeqCheck::Gap { expected } => tracing::warn!(
                    run_id = %self.run_id, expected, got = seq,
                    "runner sequence gap"
                ),
                SeqCheck::OutOfOrder { max_seen } => tracing::warn!(
                    run_id = %self.run_id, max_seen, got = seq,
                    "runner sequence out of order"
                ),
                SeqCheck::InOrder => {}
            }
        }
        let result = match classify(raw, &self.limits) {
            Classified::Valid(typed) => typed.to_result(),
            Classified::Telemetry(telemetry) => telemetry.to_result(),
            Classified::Dropped { reason } => {
                return Admission::Skip(SkipReason::Invalid { reason });
            }
            Classified::ProtocolError { reason } => {
                return Admission::Fail(
                    self.terminal_failure(run_failure::RUNNER_PROTOCOL_ERROR, reason),
                );
            }
        };
        // The last number is reserved for a terminal item: the runner's own, or this one.
        if !result.is_terminal() && self.delivered() + 1 >= self.items_max.get() {
            return Admission::Fail(self.terminal_failure(
                run_failure::RUNNER_TOO_MANY_ITEMS,
                format!(
                    "run produced more than {} result items (limits.run_items_max)",
                    self.items_max.get() - 1
                ),
            ));
        }
        Admission::Deliver(self.deliver(result))
    }

    /// Ends the run because of `cause`, unless it already ended. Returns the synthesized
    /// terminal item, or `None` if the runner's own terminal item was already delivered.
    pub fn end(&mut self, cause: EndCause) -> Option<RunItem> {
        if self.finished {
            return None;
        }
        let item = match cause {
            EndCause::Done if self.saw_message => self.deliver(AgentRunResult::run_completed()),
            EndCause::Done => self.terminal_failure(
                run_failure::RUNNER_EMPTY_OUTPUT,
                "runner ended the run without any message or terminal result".to_owned(),
            ),
            EndCause::Cancelled { reason } => {
                self.terminal_failure(run_failure::CANCELLED, format!("run cancelled: {reason}"))
            }
            EndCause::TimedOut => {
                self.terminal_failure(run_failure::TIMEOUT, "run deadline exceeded".to_owned())
            }
            EndCause::Crashed { detail } => self.terminal_failure(
                run_failure::RUNNER_CRASHED,
                format!("runner process crashed: {detail}"),
            ),
            EndCause::ExitedMidRun { detail } => self.terminal_failure(
                run_failure::RUNNER_CRASHED,
                format!("runner process exited while runs were active ({detail})"),
            ),
            EndCause::ProtocolError { detail } => {
                self.terminal_failure(run_failure::RUNNER_PROTOCOL_ERROR, detail)
            }
            EndCause::Interrupted { detail } => self.terminal_failure(
                run_failure::INTERRUPTED,
                format!("run interrupted: {detail}"),
            ),
        };
        Some(item)
    }

    /// Ends the run with a terminal item the host made (a run refused before its runner
    /// starts, a runner that could not be started, a host that lost the run), numbered like
    /// every other item. Returns `None` if the run already ended. A non-terminal `result` is
    /// a caller bug: it is delivered but does not end the run.
    pub fn end_with(&mut self, result: AgentRunResult) -> Option<RunItem> {
        debug_assert!(result.is_terminal(), "end_with takes a terminal item");
        if self.finished {
            return None;
        }
        Some(self.deliver(result))
    }

    fn terminal_failure(&mut self, code: &str, error: String) -> RunItem {
        let retryable = run_failure::default_retryable(code);
        self.deliver(AgentRunResult::run_failed(code, error, retryable))
    }

    fn deliver(&mut self, mut result: AgentRunResult) -> RunItem {
        let replaced = replace_nul(&mut result);
        if replaced > 0 {
            tracing::debug!(run_id = %self.run_id, replaced, "NUL characters in a result replaced with U+FFFD");
        }
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        result.run_id.clone_from(&self.run_id_text);
        result.sequence = Some(sequence);
        if result.timestamp.is_none() {
            result.timestamp = Some((self.clock)());
        }
        match result.known_type() {
            Some(t) if t.is_message() => self.saw_message = true,
            Some(t) if t.is_terminal() => self.finished = true,
            _ => {}
        }
        RunItem { sequence, result }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn seq() -> RunSequencer {
        RunSequencer::new(RunId::new(), ResultLimits::default()).with_clock(|| 42)
    }

    fn delta(text: &str, sequence: Option<u64>) -> Value {
        let mut v = json!({"type": "message.delta", "data": {"chunk": {"role": "assistant", "content": text}}});
        if let Some(s) = sequence {
            v["sequence"] = json!(s);
        }
        v
    }

    fn delivered(a: Admission) -> RunItem {
        match a {
            Admission::Deliver(item) => item,
            other => panic!("expected delivery, got {other:?}"),
        }
    }

    #[test]
    fn seen_sequences_classify_and_stay_compact() {
        let mut s = SeenSequences::default();
        assert_eq!(s.record(1), SeqCheck::InOrder);
        assert_eq!(s.record(2), SeqCheck::InOrder);
        assert_eq!(s.record(2), SeqCheck::Duplicate);
        assert_eq!(s.record(5), SeqCheck::Gap { expected: 3 });
        assert_eq!(s.record(3), SeqCheck::OutOfOrder { max_seen: 5 });
        assert_eq!(s.record(5), SeqCheck::Duplicate);
        assert_eq!(s.record(4), SeqCheck::OutOfOrder { max_seen: 5 });
        assert_eq!(s.record(6), SeqCheck::InOrder);
        assert!(
            s.sparse.is_empty(),
            "dense prefix absorbed the sparse set: {s:?}"
        );
        assert_eq!(s.dense_upto, 6);
        for n in 7..10_000 {
            s.record(n);
        }
        assert!(s.sparse.is_empty());
    }

    #[test]
    fn transport_sequences_are_dense_and_replace_the_runners() {
        let mut s = seq();
        let a = delivered(s.admit(&delta("a", Some(10))));
        let b = delivered(s.admit(&delta("b", None)));
        let c = delivered(s.admit(&delta("c", Some(12))));
        assert_eq!((a.sequence, b.sequence, c.sequence), (1, 2, 3));
        assert_eq!(c.result.sequence, Some(3));
        assert_eq!(c.result.run_id, s.run_id().to_string());
        assert_eq!(c.result.timestamp, Some(42));
    }

    #[test]
    fn duplicates_are_dropped_without_consuming_a_sequence() {
        let mut s = seq();
        delivered(s.admit(&delta("a", Some(1))));
        assert_eq!(
            s.admit(&delta("a", Some(1))),
            Admission::Skip(SkipReason::Duplicate { sequence: 1 })
        );
        let b = delivered(s.admit(&delta("b", Some(2))));
        assert_eq!(b.sequence, 2);
    }

    #[test]
    fn unknown_and_invalid_results_are_skipped_missing_type_fails() {
        let mut s = seq();
        assert!(matches!(
            s.admit(&json!({"type": "telepathy", "data": {}})),
            Admission::Skip(SkipReason::Invalid { .. })
        ));
        assert!(matches!(
            s.admit(
                &json!({"type": "message.delta", "data": {"chunk": {"content": "x", "extra": 1}}})
            ),
            Admission::Skip(SkipReason::Invalid { .. })
        ));
        assert_eq!(s.delivered(), 0);
        let Admission::Fail(item) = s.admit(&json!({"data": {}})) else {
            panic!()
        };
        assert_eq!(item.sequence, 1);
        assert_eq!(item.failure_code(), Some("runner.protocol_error"));
        assert!(item.is_terminal());
        assert!(s.is_finished());
        assert_eq!(
            s.admit(&delta("late", None)),
            Admission::Skip(SkipReason::Late)
        );
        assert_eq!(s.end(EndCause::Done), None);
    }

    #[test]
    fn telemetry_is_delivered_and_does_not_count_as_a_message() {
        let mut s = seq();
        let t = delivered(s.admit(&json!({"type": "tool.call.started", "data": "junk"})));
        assert_eq!(t.result.result_type, "tool.call.started");
        let end = s.end(EndCause::Done).unwrap();
        assert_eq!(end.failure_code(), Some("runner.empty_output"));
        assert_eq!(end.sequence, 2);
    }

    #[test]
    fn done_after_messages_completes_with_stop() {
        let mut s = seq();
        delivered(s.admit(&json!({"type": "message.completed", "data": {"message": {"role": "assistant", "content": "hi"}}})));
        let end = s.end(EndCause::Done).unwrap();
        assert_eq!(end.result.result_type, "run.completed");
        assert_eq!(end.result.data["finish_reason"], "stop");
        assert_eq!(end.sequence, 2);
        assert!(s.is_finished());
    }

    #[test]
    fn the_runners_terminal_wins_and_later_results_are_late() {
        let mut s = seq();
        let t = delivered(s.admit(&json!({"type": "run.failed", "data": {"code": "runner.error", "error": "x", "retryable": false}})));
        assert!(t.is_terminal());
        assert_eq!(
            s.admit(&delta("after", None)),
            Admission::Skip(SkipReason::Late)
        );
        assert_eq!(
            s.end(EndCause::Crashed {
                detail: "exit 1".into()
            }),
            None
        );
    }

    #[test]
    fn end_causes_map_to_codes() {
        for (cause, code, retryable) in [
            (
                EndCause::Cancelled {
                    reason: "user".into(),
                },
                "cancelled",
                false,
            ),
            (EndCause::TimedOut, "timeout", true),
            (
                EndCause::Crashed {
                    detail: "signal 9".into(),
                },
                "runner.crashed",
                false,
            ),
            (
                EndCause::ExitedMidRun {
                    detail: "exit status 0".into(),
                },
                "runner.crashed",
                false,
            ),
            (
                EndCause::ProtocolError {
                    detail: "bad".into(),
                },
                "runner.protocol_error",
                false,
            ),
            (
                EndCause::Interrupted {
                    detail: "shutdown".into(),
                },
                "interrupted",
                true,
            ),
        ] {
            let mut s = seq();
            delivered(s.admit(&delta("x", None)));
            let end = s.end(cause).unwrap();
            assert_eq!(end.failure_code(), Some(code));
            assert_eq!(end.result.data["retryable"], json!(retryable));
            assert_eq!(end.sequence, 2);
        }
    }

    #[test]
    fn a_foreign_run_id_in_the_envelope_is_a_protocol_error() {
        let mut s = seq();
        let mut raw = delta("x", None);
        raw["run_id"] = json!(RunId::new().to_string());
        assert!(matches!(s.admit(&raw), Admission::Fail(_)));
        // The run's own id (or none) is fine.
        let mut s = seq();
        let mut raw = delta("x", None);
        raw["run_id"] = json!(s.run_id().to_string());
        delivered(s.admit(&raw));
    }

    #[test]
    fn nul_characters_are_replaced_and_keep_their_sequence() {
        let mut s = seq();
        let first = delivered(s.admit(&delta("a\0b", None)));
        assert_eq!(first.sequence, 1);
        assert_eq!(
            first.result.data["chunk"]["content"], "a\u{FFFD}b",
            "{:?}",
            first.result
        );
        let raw = json!({"type": "message.completed", "data": {
            "message": {"role": "assistant", "content": "x\0"}}});
        let second = delivered(s.admit(&raw));
        assert_eq!(second.sequence, 2, "no sequence is lost");
        let text = serde_json::to_string(&second.result).unwrap();
        assert!(!text.contains("\\u0000"), "{text}");
        assert!(text.contains("x\u{FFFD}"), "{text}");
    }

    fn limited(items_max: u64) -> RunSequencer {
        seq().with_items_max(NonZeroU64::new(items_max).unwrap())
    }

    fn completed() -> Value {
        json!({"type": "run.completed", "data": {"finish_reason": "stop"}})
    }

    #[test]
    fn exactly_at_the_item_limit_the_run_completes() {
        // 3 items allowed: two deltas and the runner's terminal fill the run exactly.
        let mut s = limited(3);
        delivered(s.admit(&delta("a", None)));
        delivered(s.admit(&delta("b", None)));
        let end = delivered(s.admit(&completed()));
        assert_eq!(end.sequence, 3);
        assert_eq!(end.result.result_type, "run.completed");
        assert!(s.is_finished());
        // `done` (or a synthesized end) at the limit fits too.
        let mut s = limited(3);
        delivered(s.admit(&delta("a", None)));
        delivered(s.admit(&delta("b", None)));
        let end = s.end(EndCause::Done).unwrap();
        assert_eq!(
            (end.sequence, end.result.result_type.as_str()),
            (3, "run.completed")
        );
    }

    #[test]
    fn one_item_over_the_limit_fails_the_run_once() {
        let mut s = limited(3);
        delivered(s.admit(&delta("a", Some(1))));
        delivered(s.admit(&delta("b", Some(2))));
        let Admission::Fail(item) = s.admit(&delta("c", Some(3))) else {
            panic!("the third non-terminal item must end the run")
        };
        assert_eq!(
            item.sequence, 3,
            "no gap: the failure takes the next number"
        );
        assert_eq!(item.failure_code(), Some("runner.too_many_items"));
        assert_eq!(item.result.data["retryable"], json!(false));
        assert!(
            item.result.data["error"]
                .as_str()
                .unwrap()
                .contains("run_items_max")
        );
        assert!(s.is_finished());
        assert_eq!(s.delivered(), 3);
        for late in [delta("d", Some(4)), completed()] {
            assert_eq!(s.admit(&late), Admission::Skip(SkipReason::Late));
        }
        assert_eq!(s.end(EndCause::Done), None);
        // Skipped results do not count: duplicates and invalid ones below the limit.
        let mut s = limited(2);
        delivered(s.admit(&delta("a", Some(1))));
        assert_eq!(
            s.admit(&delta("a", Some(1))),
            Admission::Skip(SkipReason::Duplicate { sequence: 1 })
        );
        assert!(matches!(
            s.admit(&json!({"type": "telepathy", "data": {}})),
            Admission::Skip(SkipReason::Invalid { .. })
        ));
        assert!(matches!(s.admit(&delta("b", Some(2))), Admission::Fail(_)));
    }

    #[test]
    fn the_runners_terminal_at_the_limit_is_accepted() {
        let mut s = limited(2);
        delivered(s.admit(&delta("a", None)));
        let failed = json!({"type": "run.failed", "data": {"code": "runner.error", "error": "x", "retryable": false}});
        let end = delivered(s.admit(&failed));
        assert_eq!(end.sequence, 2);
        assert_eq!(end.failure_code(), Some("runner.error"));
        // A limit of 1 leaves room for the terminal item only.
        let mut s = limited(1);
        let Admission::Fail(item) = s.admit(&delta("a", None)) else {
            panic!()
        };
        assert_eq!(
            (item.sequence, item.failure_code()),
            (1, Some("runner.too_many_items"))
        );
        let mut s = limited(1);
        assert_eq!(delivered(s.admit(&completed())).sequence, 1);
    }

    #[test]
    fn oversize_results_follow_classify() {
        let mut s = seq();
        // A 2 MiB delta is truncated by classify and delivered.
        let big = "x".repeat(2 * 1024 * 1024);
        let item = delivered(s.admit(&delta(&big, None)));
        let content = item.result.data["chunk"]["content"].as_str().unwrap();
        assert!(content.len() < 20_000 && content.ends_with("...[truncated]"));
        // A 2 MiB state value cannot be truncated: protocol error.
        let raw = json!({"type": "state.updated", "data": {"scope": "conversation", "key": "k", "value": big}});
        let Admission::Fail(item) = s.admit(&raw) else {
            panic!()
        };
        assert_eq!(item.failure_code(), Some("runner.protocol_error"));
    }

    #[test]
    fn host_made_terminal_items_are_numbered_here() {
        // A run refused before its runner starts: its only item is number 1, stamped.
        let failed = || AgentRunResult::run_failed("runner.error", "could not start", true);
        let item = seq().end_with(failed()).unwrap();
        assert_eq!((item.sequence, item.result.sequence), (1, Some(1)));
        assert_eq!(item.failure_code(), Some("runner.error"));
        assert!(item.result.timestamp.is_some() && item.is_terminal());
        // After a terminal item nothing more is made.
        let mut s = seq();
        assert!(s.end_with(failed()).is_some());
        assert_eq!(s.end_with(failed()), None);
        assert_eq!(s.end(EndCause::TimedOut), None);
        // A stream whose first items were numbered elsewhere continues after them.
        let run_id = RunId::new();
        let item = RunSequencer::continuing(run_id, 7)
            .end_with(failed())
            .unwrap();
        assert_eq!(item.sequence, 8);
        assert_eq!(item.result.run_id, run_id.to_string());
        let item = RunSequencer::continuing(run_id, 0)
            .end(EndCause::Crashed {
                detail: "gone".into(),
            })
            .unwrap();
        assert_eq!(
            (item.sequence, item.failure_code()),
            (1, Some("runner.crashed"))
        );
    }
}
