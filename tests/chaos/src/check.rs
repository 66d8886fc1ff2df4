//! The verdict on one scenario, computed from what was observed through the API only: a
//! pure function of the observations, so every rule is tested on its own without a cluster.
//!
//! The guarantees (SPEC §2, §11) and how each is counted:
//!
//! | counter | an event / run counts when |
//! | --- | --- |
//! | `lost` | the event was accepted (`202`) but never got a run |
//! | `duplicated` | its conversation (unique per event) has more than one run |
//! | `stuck` | its run is not terminal when the scenario's settle time is over |
//! | `terminal_items` | its run's items hold no or several terminal items, or one that is not last |
//! | `gaps` | its run's item sequences are not exactly `1..=n` |
//! | `second_executions` | its run's deltas (the test runner numbers them `0 `, `1 `, …) do not count up from `0` once: a second execution starts again at `0` |
//! | `follower_gaps` | its stream follower, across all its reconnections, did not see exactly the sequences `1..=n` of the ledger in order, ending with the terminal item |
//! | `not_completed` | its run ended other than `completed` (only a failure where the scenario cannot interrupt runs: `must_complete`) |

use std::collections::BTreeMap;

use sb_protocol::result::AgentRunResult;
use serde::Serialize;
use serde_json::Value;

/// What a stream follower saw, over all its connections.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FollowerOutcome {
    /// Sequences of the result frames, in the order received.
    pub sequences: Vec<u64>,
    /// Whether the last frame received was terminal.
    pub ended_terminal: bool,
    /// Connections opened after the first one.
    pub reconnects: u32,
    /// `event: error` frames received (each followed by a reconnection), with their data.
    pub error_frames: Vec<String>,
    /// Why the follower gave up, if it did.
    pub gave_up: Option<String>,
}

/// One run as read back after the scenario.
#[derive(Debug, Clone, Default)]
pub struct RunObservation {
    /// `status` of `GET /v1/runs/{id}`.
    pub status: String,
    /// Every stored item, in sequence order.
    pub items: Vec<AgentRunResult>,
}

/// One accepted event as read back after the scenario.
#[derive(Debug, Clone, Default)]
pub struct EventObservation {
    /// The runs of its conversation.
    pub runs: Vec<RunObservation>,
    /// Its follower's outcome (`None`: not followed, e.g. a probe).
    pub follower: Option<FollowerOutcome>,
    /// Whether its run's deltas are the test runner's numbered ones (the second-execution
    /// check applies).
    pub numbered_deltas: bool,
}

/// The counters of one scenario (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    /// Events accepted with `202`.
    pub accepted: usize,
    /// Runs found for them.
    pub runs: usize,
    /// Accepted events without a run.
    pub lost: usize,
    /// Runs beyond the first of an event.
    pub duplicated: usize,
    /// Runs not terminal at the end.
    pub stuck: usize,
    /// Runs without exactly one terminal item, the last.
    pub terminal_items: usize,
    /// Runs with a sequence gap (or a repeated sequence).
    pub gaps: usize,
    /// Runs executed more than once.
    pub second_executions: usize,
    /// Followers that did not see a dense stream to the end.
    pub follower_gaps: usize,
    /// Follower reconnections, in total.
    pub reconnects: u32,
    /// `event: error` frames followers got, in total (each a false "no longer stored" or
    /// "not found" while the run was alive).
    pub stream_errors: usize,
    /// Runs by final status.
    pub statuses: BTreeMap<String, usize>,
    /// The first few runs that broke a guarantee, described (run id, status, item types).
    pub examples: Vec<String>,
}

/// Most [`Tally::examples`] kept.
const EXAMPLES: usize = 8;

impl Tally {
    /// Runs that ended other than `completed`.
    #[must_use]
    pub fn not_completed(&self) -> usize {
        self.statuses
            .iter()
            .filter(|(status, _)| status.as_str() != "completed")
            .map(|(_, n)| n)
            .sum()
    }

    /// The counters that must be zero after any fault, by name, when they are not.
    #[must_use]
    pub fn violations(&self, must_complete: bool) -> Vec<String> {
        let mut out = Vec::new();
        for (name, value) in [
            ("lost", self.lost),
            ("duplicated", self.duplicated),
            ("stuck", self.stuck),
            ("terminal_items", self.terminal_items),
            ("gaps", self.gaps),
            ("second_executions", self.second_executions),
            ("follower_gaps", self.follower_gaps),
        ] {
            if value > 0 {
                out.push(format!("{name}={value}"));
            }
        }
        if must_complete && self.not_completed() > 0 {
            out.push(format!("not_completed={:?}", self.statuses));
        }
        out
    }
}

/// Whether a run status is final.
#[must_use]
pub fn is_terminal_status(status: &str) -> bool {
    !matches!(status, "queued" | "running" | "")
}

/// Counts `observations` (see the module docs).
#[must_use]
pub fn judge(observations: &[EventObservation]) -> Tally {
    let mut tally = Tally {
        accepted: observations.len(),
        ..Tally::default()
    };
    for event in observations {
        tally.runs += event.runs.len();
        if event.runs.is_empty() {
            tally.lost += 1;
        }
        tally.duplicated += event.runs.len().saturating_sub(1);
        for run in &event.runs {
            *tally.statuses.entry(run.status.clone()).or_default() += 1;
            let mut broken = Vec::new();
            if !is_terminal_status(&run.status) {
                tally.stuck += 1;
                broken.push("stuck");
            }
            if !one_terminal_item_last(&run.items) {
                tally.terminal_items += 1;
                broken.push("terminal items");
            }
            if !dense(&run.items) {
                tally.gaps += 1;
                broken.push("gap");
            }
            if event.numbered_deltas && !executed_once(&run.items) {
                tally.second_executions += 1;
                broken.push("second execution");
            }
            if !broken.is_empty() && tally.examples.len() < EXAMPLES {
                tally.examples.push(format!(
                    "{}: run {} {}: {}",
                    broken.join(", "),
                    run.items.first().map_or("?", |i| i.run_id.as_str()),
                    run.status,
                    describe(&run.items)
                ));
            }
        }
        if let Some(follower) = &event.follower {
            tally.reconnects += follower.reconnects;
            tally.stream_errors += follower.error_frames.len();
            let ledger = event.runs.first().map_or(0, |run| run.items.len() as u64);
            if !follower_saw_everything(follower, ledger) {
                tally.follower_gaps += 1;
                if tally.examples.len() < EXAMPLES {
                    let seen = follower.sequences.len();
                    let missing: Vec<u64> = (1..=ledger)
                        .filter(|s| !follower.sequences.contains(s))
                        .take(10)
                        .collect();
                    tally.examples.push(format!(
                        "follower of run {}: {seen} frames of {ledger} (missing {missing:?}, \
                         last {:?}), terminal {}, {} reconnects, errors {:?}, gave up {:?}",
                        event
                            .runs
                            .first()
                            .and_then(|r| r.items.first())
                            .map_or("?", |i| i.run_id.as_str()),
                        follower.sequences.last(),
                        follower.ended_terminal,
                        follower.reconnects,
                        follower.error_frames,
                        follower.gave_up
                    ));
                }
            }
        }
    }
    tally
}

/// Item types in order, runs of deltas collapsed (`message.delta ×120`), with the code of
/// a failure.
fn describe(items: &[AgentRunResult]) -> String {
    let mut parts: Vec<(String, usize)> = Vec::new();
    for item in items {
        let mut name = item.result_type.clone();
        if let Some(code) = item.data.get("code").and_then(Value::as_str) {
            name = format!("{name}({code})");
        }
        if item.result_type == "message.delta" {
            let text = delta_text(item);
            if text.trim() == "0" {
                name = "message.delta(0)".to_owned();
            }
        }
        match parts.last_mut() {
            Some((last, n))
                if *last == name
                    || (name == "message.delta" && last.starts_with("message.delta")) =>
            {
                *n += 1
            }
            _ => parts.push((name, 1)),
        }
    }
    parts
        .iter()
        .map(|(name, n)| {
            if *n > 1 {
                format!("{name} ×{n}")
            } else {
                name.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Exactly one terminal item, and it is the last.
fn one_terminal_item_last(items: &[AgentRunResult]) -> bool {
    let terminal = items.iter().filter(|i| i.is_terminal()).count();
    terminal == 1 && items.last().is_some_and(AgentRunResult::is_terminal)
}

/// Sequences `1..=n` in order.
fn dense(items: &[AgentRunResult]) -> bool {
    items
        .iter()
        .enumerate()
        .all(|(i, item)| item.sequence == Some(i as u64 + 1))
}

/// The test runner's deltas (`0 `, `1 `, …) only count up: a second execution starts again
/// from `0`. (A number skipped is not a second execution; a gap in the sequences is counted
/// by [`dense`], and items after the terminal one by [`one_terminal_item_last`].)
fn executed_once(items: &[AgentRunResult]) -> bool {
    let numbers: Vec<Option<u64>> = items
        .iter()
        .filter(|i| i.result_type == "message.delta")
        .map(|i| delta_text(i).trim().parse().ok())
        .collect();
    numbers.iter().all(Option::is_some) && numbers.windows(2).all(|pair| pair[0] < pair[1])
}

/// The text of a `message.delta` item (string content, or its text parts).
#[must_use]
pub fn delta_text(item: &AgentRunResult) -> String {
    match &item.data.get("chunk").and_then(|c| c.get("content")) {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
        _ => String::new(),
    }
}

/// The follower saw `1..=ledger` in order, once each, and ended on the terminal item.
fn follower_saw_everything(follower: &FollowerOutcome, ledger: u64) -> bool {
    follower.gave_up.is_none()
        && follower.ended_terminal
        && follower.sequences.len() as u64 == ledger
        && follower
            .sequences
            .iter()
            .enumerate()
            .all(|(i, s)| *s == i as u64 + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn item(sequence: u64, result_type: &str, data: Value) -> AgentRunResult {
        let mut item: AgentRunResult = serde_json::from_value(json!({
            "run_id": "r", "type": result_type, "data": data,
        }))
        .unwrap();
        item.sequence = Some(sequence);
        item
    }

    fn delta(sequence: u64, n: u64) -> AgentRunResult {
        item(
            sequence,
            "message.delta",
            json!({"chunk": {"role": "assistant", "content": format!("{n} ")}}),
        )
    }

    fn completed_run(deltas: u64) -> RunObservation {
        let mut items: Vec<_> = (0..deltas).map(|n| delta(n + 1, n)).collect();
        items.push(item(deltas + 1, "run.completed", json!({})));
        RunObservation {
            status: "completed".into(),
            items,
        }
    }

    fn follower(n: u64) -> FollowerOutcome {
        FollowerOutcome {
            sequences: (1..=n).collect(),
            ended_terminal: true,
            ..FollowerOutcome::default()
        }
    }

    fn event(runs: Vec<RunObservation>, follower: Option<FollowerOutcome>) -> EventObservation {
        EventObservation {
            runs,
            follower,
            numbered_deltas: true,
        }
    }

    #[test]
    fn a_clean_scenario_has_only_zeros() {
        let tally = judge(&[event(vec![completed_run(3)], Some(follower(4)))]);
        assert_eq!(tally.accepted, 1);
        assert_eq!(tally.runs, 1);
        assert!(tally.violations(true).is_empty(), "{tally:?}");
    }

    #[test]
    fn lost_duplicated_and_stuck_runs_are_counted() {
        let mut running = completed_run(2);
        running.status = "running".into();
        running.items.pop();
        let tally = judge(&[
            event(Vec::new(), None),
            event(vec![completed_run(1), completed_run(1)], None),
            event(vec![running], None),
        ]);
        assert_eq!((tally.lost, tally.duplicated, tally.stuck), (1, 1, 1));
        assert_eq!(tally.terminal_items, 1, "the running one has none");
        assert_eq!(tally.runs, 3);
    }

    #[test]
    fn two_terminal_items_and_gaps_are_counted() {
        let mut twice = completed_run(1);
        twice
            .items
            .push(item(3, "run.failed", json!({"code": "interrupted"})));
        let mut gap = completed_run(3);
        gap.items.remove(1);
        let tally = judge(&[event(vec![twice], None), event(vec![gap], None)]);
        assert_eq!(tally.terminal_items, 1);
        assert_eq!(tally.gaps, 1);
    }

    #[test]
    fn a_restarted_count_is_a_second_execution() {
        let mut run = completed_run(2);
        run.items.insert(2, delta(3, 0));
        for (i, item) in run.items.iter_mut().enumerate() {
            item.sequence = Some(i as u64 + 1);
        }
        let tally = judge(&[event(vec![run.clone()], None)]);
        assert_eq!(tally.second_executions, 1);
        assert_eq!(tally.gaps, 0);
        let unnumbered = EventObservation {
            numbered_deltas: false,
            ..event(vec![run], None)
        };
        assert_eq!(judge(&[unnumbered]).second_executions, 0);
    }

    #[test]
    fn items_after_the_terminal_one_are_not_a_second_execution() {
        // A stale worker resumed after the reaper ended its run: the number the terminal
        // item's sequence took is skipped, the rest follows the terminal item.
        let items = vec![
            delta(1, 0),
            item(2, "run.failed", json!({"code": "interrupted"})),
            delta(3, 2),
            item(4, "message.completed", json!({})),
        ];
        let run = RunObservation {
            status: "interrupted".into(),
            items,
        };
        let tally = judge(&[event(vec![run], None)]);
        assert_eq!((tally.second_executions, tally.terminal_items), (0, 1));
        assert!(
            tally.examples[0].contains("run.failed(interrupted)"),
            "{tally:?}"
        );
    }

    #[test]
    fn followers_must_see_the_whole_ledger_once_in_order() {
        let run = || vec![completed_run(3)];
        let mut short = follower(3);
        short.ended_terminal = false;
        let mut repeated = follower(4);
        repeated.sequences.insert(2, 2);
        let mut gave_up = follower(4);
        gave_up.gave_up = Some("deadline".into());
        let mut resumed = follower(4);
        resumed.reconnects = 2;
        resumed.error_frames.push("{}".into());
        let tally = judge(&[
            event(run(), Some(short)),
            event(run(), Some(repeated)),
            event(run(), Some(gave_up)),
            event(run(), Some(resumed)),
        ]);
        assert_eq!(tally.follower_gaps, 3);
        assert_eq!((tally.reconnects, tally.stream_errors), (2, 1));
    }

    #[test]
    fn interrupted_runs_violate_only_where_runs_must_complete() {
        let mut run = completed_run(1);
        run.status = "interrupted".into();
        run.items[1] = item(2, "run.failed", json!({"code": "interrupted"}));
        let tally = judge(&[event(vec![run], None)]);
        assert!(tally.violations(false).is_empty());
        assert_eq!(tally.violations(true).len(), 1);
        assert_eq!(tally.not_completed(), 1);
    }
}
