//! Property tests of the sequencer (`sb_worker::sequencer`, issue 15 item 3): whatever the
//! runners send (duplicates and gaps in their own numbering, invalid and unknown items,
//! protocol errors, several terminals, late items, NUL characters) and however the results
//! of concurrent runs interleave, every run's delivered stream is `1, 2, 3, …` with no gap
//! and no duplicate, ends with exactly one terminal item and nothing after it, respects
//! `items_max`, and is the same as if the run had been alone.

use std::num::NonZeroU64;

use proptest::prelude::*;
use sb_protocol::ids::RunId;
use sb_protocol::result::ResultLimits;
use sb_worker::sequencer::{Admission, EndCause, RunItem, RunSequencer};
use serde_json::{Value, json};

/// One raw result a runner may send, with an optional runner `sequence`.
fn raw_result() -> impl Strategy<Value = Value> {
    let body = prop_oneof![
        4 => "[a-z\u{0} ]{0,6}".prop_map(|t| json!({"type": "message.delta", "data": {"chunk": {"role": "assistant", "content": t}}})),
        1 => "[a-z]{0,6}".prop_map(|t| json!({"type": "message.completed", "data": {"message": {"role": "assistant", "content": t}}})),
        1 => Just(json!({"type": "tool.call.started", "data": {"junk": [1, 2]}})),
        1 => Just(json!({"type": "run.completed", "data": {}})),
        1 => Just(json!({"type": "run.failed", "data": {"code": "runner.error", "error": "x"}})),
        1 => Just(json!({"type": "telepathy.sent", "data": {}})),
        1 => Just(json!({"type": "message.delta", "data": {}})),
        1 => Just(json!({"data": {}})),
        1 => Just(json!({"type": "state.updated", "data": {"key": "", "value": 1}})),
    ];
    (body, proptest::option::of(0u64..8)).prop_map(|(mut body, sequence)| {
        if let Some(sequence) = sequence {
            body["sequence"] = json!(sequence);
        }
        body
    })
}

/// Ends a stream may have.
fn end_cause() -> impl Strategy<Value = EndCause> {
    prop_oneof![
        Just(EndCause::Done),
        Just(EndCause::TimedOut),
        Just(EndCause::Crashed {
            detail: "signal 9".into()
        }),
        Just(EndCause::Interrupted {
            detail: "shutdown".into()
        }),
    ]
}

/// Feeds one run's results, then its end; returns every item delivered, in order.
fn run_alone(
    run_id: RunId,
    items_max: NonZeroU64,
    results: &[Value],
    end: EndCause,
) -> Vec<RunItem> {
    let mut sequencer = sequencer(run_id, items_max);
    let mut out = Vec::new();
    for raw in results {
        if let Some(item) = delivered(sequencer.admit(raw)) {
            out.push(item);
        }
    }
    out.extend(sequencer.end(end));
    out
}

fn sequencer(run_id: RunId, items_max: NonZeroU64) -> RunSequencer {
    RunSequencer::new(run_id, ResultLimits::default())
        .with_items_max(items_max)
        .with_clock(|| 7)
}

fn delivered(admission: Admission) -> Option<RunItem> {
    match admission {
        Admission::Deliver(item) | Admission::Fail(item) => Some(item),
        Admission::Skip(_) => None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_run_is_dense_ordered_and_ends_once_whatever_the_interleaving(
        scripts in prop::collection::vec(
            (prop::collection::vec(raw_result(), 0..24), end_cause()),
            1..5,
        ),
        schedule in prop::collection::vec(any::<prop::sample::Index>(), 0..120),
        items_max in 1u64..30,
    ) {
        let items_max = NonZeroU64::new(items_max).unwrap();
        let runs: Vec<RunId> = scripts.iter().map(|_| RunId::new()).collect();
        let mut sequencers: Vec<RunSequencer> =
            runs.iter().map(|&run| sequencer(run, items_max)).collect();
        let mut next = vec![0usize; scripts.len()];
        let mut out: Vec<Vec<RunItem>> = vec![Vec::new(); scripts.len()];
        let mut admit = |run: usize, next: &mut Vec<usize>| {
            let raw = &scripts[run].0[next[run]];
            next[run] += 1;
            if let Some(item) = delivered(sequencers[run].admit(raw)) {
                out[run].push(item);
            }
        };
        // The interleaving: each step picks a run that still has results; then the rest.
        for pick in &schedule {
            let open: Vec<usize> = (0..scripts.len()).filter(|&r| next[r] < scripts[r].0.len()).collect();
            if open.is_empty() {
                break;
            }
            admit(open[pick.index(open.len())], &mut next);
        }
        for run in 0..scripts.len() {
            while next[run] < scripts[run].0.len() {
                admit(run, &mut next);
            }
        }
        for (run, sequencer) in sequencers.iter_mut().enumerate() {
            out[run].extend(sequencer.end(scripts[run].1.clone()));
        }

        for (run, items) in out.iter().enumerate() {
            let sequences: Vec<u64> = items.iter().map(|i| i.sequence).collect();
            prop_assert_eq!(&sequences, &(1..=items.len() as u64).collect::<Vec<_>>(), "dense and ordered");
            prop_assert!(items.len() as u64 <= items_max.get(), "{} items over {}", items.len(), items_max);
            let terminals: Vec<usize> = (0..items.len()).filter(|&i| items[i].is_terminal()).collect();
            prop_assert_eq!(terminals, vec![items.len() - 1], "exactly one terminal, last");
            for item in items {
                prop_assert_eq!(&item.result.run_id, &runs[run].to_string());
                prop_assert_eq!(item.result.sequence, Some(item.sequence));
                prop_assert!(!serde_json::to_string(&item.result).unwrap().contains("\\u0000"), "NUL replaced");
            }
            // The same as if the run had been alone.
            let alone = run_alone(runs[run], items_max, &scripts[run].0, scripts[run].1.clone());
            prop_assert_eq!(items, &alone);
        }
    }

    #[test]
    fn a_runner_sequence_is_delivered_at_most_once(
        results in prop::collection::vec(raw_result(), 0..40),
    ) {
        let mut sequencer = sequencer(RunId::new(), NonZeroU64::new(1_000).unwrap());
        let mut seen = std::collections::HashSet::new();
        for raw in &results {
            if let Admission::Deliver(_) = sequencer.admit(raw) {
                if let Some(runner_sequence) = raw.get("sequence").and_then(Value::as_u64) {
                    prop_assert!(seen.insert(runner_sequence), "runner sequence {} twice", runner_sequence);
                }
            }
        }
    }
}
