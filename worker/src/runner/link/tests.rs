use serde_json::json;

use super::*;
use crate::runner::testing::context;

fn shared() -> RunnerLink {
    RunnerLink::new(ExecutionMode::Shared, ResultLimits::default())
}

fn start(s: &mut RunnerLink) -> RunId {
    let id = RunId::new();
    let fx = s
        .start_run(id, "plugin:a/b/c", Box::new(context(id, "hi")))
        .unwrap();
    assert!(
        matches!(&fx[..], [Effect::Write(HostToRunner::Run { run_id, runner, .. })] if *run_id == id && runner == "plugin:a/b/c")
    );
    id
}

fn result(id: RunId, value: serde_json::Value) -> Input {
    Input::Frame(RunnerToHost::Result {
        run_id: id.to_string(),
        result: value,
    })
}

fn delta(id: RunId, text: &str) -> Input {
    result(
        id,
        json!({"type": "message.delta", "data": {"chunk": {"role": "assistant", "content": text}}}),
    )
}

fn done(id: RunId) -> Input {
    Input::Frame(RunnerToHost::Done {
        run_id: id.to_string(),
    })
}

/// The delivered items of `fx` as (run, sequence, type, failure code).
fn delivered(fx: &[Effect]) -> Vec<(RunId, u64, String, Option<String>)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Deliver { run_id, item } => Some((
                *run_id,
                item.sequence,
                item.result.result_type.clone(),
                item.failure_code().map(str::to_owned),
            )),
            _ => None,
        })
        .collect()
}

fn ended(fx: &[Effect]) -> Vec<RunId> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::RunEnded { run_id } => Some(*run_id),
            _ => None,
        })
        .collect()
}

#[test]
fn results_are_sequenced_and_the_terminal_ends_the_run() {
    let mut s = shared();
    let id = start(&mut s);
    assert_eq!(s.phase(), Phase::Running);
    let fx = s.on(delta(id, "a"));
    assert_eq!(delivered(&fx), vec![(id, 1, "message.delta".into(), None)]);
    let fx = s.on(result(
        id,
        json!({"type": "run.completed", "data": {"finish_reason": "stop"}}),
    ));
    assert_eq!(delivered(&fx), vec![(id, 2, "run.completed".into(), None)]);
    assert_eq!(ended(&fx), vec![id]);
    assert!(!s.is_active(&id));
    // Late completion isolation: nothing for a finished run.
    assert!(s.on(delta(id, "late")).is_empty());
    assert!(s.on(done(id)).is_empty());
}

#[test]
fn done_without_output_is_empty_output_and_with_output_completes() {
    let mut s = shared();
    let (a, b) = (start(&mut s), start(&mut s));
    let fx = s.on(done(a));
    assert_eq!(
        delivered(&fx),
        vec![(
            a,
            1,
            "run.failed".into(),
            Some("runner.empty_output".into())
        )]
    );
    s.on(delta(b, "x"));
    let fx = s.on(done(b));
    assert_eq!(delivered(&fx), vec![(b, 2, "run.completed".into(), None)]);
    assert_eq!(s.active_runs(), 0);
}

#[test]
fn api_calls_are_dispatched_only_for_active_runs_of_this_link() {
    let mut s = shared();
    let id = start(&mut s);
    let fx = s.on(Input::Frame(RunnerToHost::Api {
        id: "7".into(),
        run_id: id.to_string(),
        action: "get_host_version".into(),
        params: json!({}),
    }));
    assert_eq!(
        fx,
        vec![Effect::Dispatch {
            call_id: "7".into(),
            run_id: id,
            action: "get_host_version".into(),
            params: json!({})
        }]
    );

    let stranger = RunId::new();
    for run in [stranger.to_string(), "not-a-uuid".to_owned()] {
        let fx = s.on(Input::Frame(RunnerToHost::Api {
            id: "8".into(),
            run_id: run,
            action: "x".into(),
            params: json!(null),
        }));
        let [Effect::Write(HostToRunner::ApiResult(answer))] = &fx[..] else {
            panic!("{fx:?}")
        };
        assert!(!answer.ok);
        assert_eq!(answer.error.as_ref().unwrap().code, "not_found");
    }
    // After the run ended its id is rejected too.
    s.on(result(id, json!({"type": "run.failed", "data": {"code": "runner.error", "error": "x", "retryable": false}})));
    let fx = s.on(Input::Frame(RunnerToHost::Api {
        id: "9".into(),
        run_id: id.to_string(),
        action: "x".into(),
        params: json!(null),
    }));
    assert!(matches!(&fx[..], [Effect::Write(HostToRunner::ApiResult(a))] if !a.ok));
}

fn refused(id: Option<ApiCallId>, run_id: Option<String>, problem: &str) -> Input {
    Input::RefusedCall(RefusedCall {
        id,
        run_id,
        problem: problem.into(),
    })
}

fn only_answer(fx: &[Effect]) -> &ApiResult {
    match fx {
        [Effect::Write(HostToRunner::ApiResult(answer))] => answer,
        other => panic!("{other:?}"),
    }
}

#[test]
fn refused_calls_are_answered_with_their_code_and_the_run_goes_on() {
    let mut s = shared();
    let id = start(&mut s);
    // No run id: invalid_argument, echoing the integer id.
    let fx = s.on(refused(
        Some(5u64.into()),
        None,
        "api call has no string `run_id`",
    ));
    let answer = only_answer(&fx);
    assert_eq!(answer.id, Some(ApiCallId::from(5u64)));
    let error = answer.error.as_ref().unwrap();
    assert_eq!(error.code, "invalid_argument");
    assert_eq!(error.message, "api call has no string `run_id`");
    // An active run, a missing action: invalid_argument.
    let fx = s.on(refused(
        Some("a".into()),
        Some(id.to_string()),
        "api call has no string `action`",
    ));
    assert_eq!(
        only_answer(&fx).error.as_ref().unwrap().code,
        "invalid_argument"
    );
    // A run that is not active here: not_found first, whatever else is wrong.
    let fx = s.on(refused(
        Some("b".into()),
        Some(RunId::new().to_string()),
        "api call has no string `action`",
    ));
    assert_eq!(only_answer(&fx).error.as_ref().unwrap().code, "not_found");
    // No usable id: answered with id null.
    let fx = s.on(refused(None, Some(id.to_string()), "api call has no `id`"));
    let answer = only_answer(&fx);
    assert_eq!(answer.id, None);
    assert_eq!(answer.error.as_ref().unwrap().code, "invalid_argument");
    // None of it touched the run, and refused calls are usable lines: a bad line after
    // them is the first of a streak, forgiven for the process.
    assert!(s.is_active(&id));
    let fx = s.on(Input::BadFrame {
        run_id: None,
        detail: "x".into(),
    });
    assert!(!fx.contains(&Effect::Kill), "{fx:?}");
}

#[test]
fn integer_call_ids_are_dispatched_as_written() {
    let mut s = shared();
    let id = start(&mut s);
    let fx = s.on(Input::Frame(RunnerToHost::Api {
        id: 12u64.into(),
        run_id: id.to_string(),
        action: "ping".into(),
        params: json!({}),
    }));
    assert_eq!(
        fx,
        vec![Effect::Dispatch {
            call_id: 12u64.into(),
            run_id: id,
            action: "ping".into(),
            params: json!({})
        }]
    );
}

#[test]
fn cancel_asks_the_runner_then_ends_as_cancelled() {
    let mut s = shared();
    let id = start(&mut s);
    let fx = s.on(Input::Cancel {
        run_id: id,
        reason: "user".into(),
    });
    assert_eq!(
        fx,
        vec![
            Effect::Write(HostToRunner::Cancel {
                run_id: id,
                reason: "user".into()
            }),
            Effect::StartCancelGrace { run_id: id },
        ]
    );
    // A second cancel does nothing more.
    assert!(
        s.on(Input::Cancel {
            run_id: id,
            reason: "again".into()
        })
        .is_empty()
    );
    // Results during the grace period are still delivered.
    assert_eq!(delivered(&s.on(delta(id, "x"))).len(), 1);
    // The runner ends the stream without a terminal: cancelled, not "stop".
    let fx = s.on(done(id));
    assert_eq!(
        delivered(&fx),
        vec![(id, 2, "run.failed".into(), Some("cancelled".into()))]
    );
    // The grace timer firing later is harmless.
    assert!(s.on(Input::CancelGraceElapsed { run_id: id }).is_empty());
}

#[test]
fn cancel_grace_elapsing_ends_the_run_and_kills_a_per_run_process() {
    for mode in [ExecutionMode::Shared, ExecutionMode::PerRun] {
        let mut s = RunnerLink::new(mode, ResultLimits::default());
        let id = start(&mut s);
        s.on(Input::Cancel {
            run_id: id,
            reason: "user".into(),
        });
        let fx = s.on(Input::CancelGraceElapsed { run_id: id });
        assert_eq!(
            delivered(&fx),
            vec![(id, 1, "run.failed".into(), Some("cancelled".into()))]
        );
        assert_eq!(
            fx.contains(&Effect::Kill),
            mode == ExecutionMode::PerRun,
            "{mode:?}"
        );
    }
}

#[test]
fn the_runners_own_terminal_wins_over_a_pending_cancel() {
    let mut s = shared();
    let id = start(&mut s);
    s.on(Input::Cancel {
        run_id: id,
        reason: "user".into(),
    });
    let fx = s.on(result(id, json!({"type": "run.failed", "data": {"code": "cancelled", "error": "ok, stopping", "retryable": false}})));
    assert_eq!(
        delivered(&fx),
        vec![(id, 1, "run.failed".into(), Some("cancelled".into()))]
    );
    assert_eq!(ended(&fx), vec![id]);
}

#[test]
fn a_passed_deadline_cancels_and_fails_with_timeout() {
    let mut s = shared();
    let id = start(&mut s);
    s.on(delta(id, "x"));
    let fx = s.on(Input::DeadlinePassed { run_id: id });
    assert_eq!(
        fx[0],
        Effect::Write(HostToRunner::Cancel {
            run_id: id,
            reason: "deadline exceeded".into()
        })
    );
    assert_eq!(
        delivered(&fx),
        vec![(id, 2, "run.failed".into(), Some("timeout".into()))]
    );
    assert_eq!(ended(&fx), vec![id]);
    assert!(!fx.contains(&Effect::Kill));
}

#[test]
fn a_bad_line_fails_the_run_it_names_or_the_only_run() {
    let mut s = shared();
    let (a, b) = (start(&mut s), start(&mut s));
    let fx = s.on(Input::BadFrame {
        run_id: Some(a.to_string()),
        detail: "invalid result".into(),
    });
    assert_eq!(
        delivered(&fx),
        vec![(
            a,
            1,
            "run.failed".into(),
            Some("runner.protocol_error".into())
        )]
    );
    // The stream resynchronised: a good line resets the streak.
    s.on(delta(b, "ok"));
    // Garbage naming no run, with exactly one run in flight: that run is blamed.
    let fx = s.on(Input::BadFrame {
        run_id: None,
        detail: "not json".into(),
    });
    assert_eq!(
        delivered(&fx),
        vec![(
            b,
            2,
            "run.failed".into(),
            Some("runner.protocol_error".into())
        )]
    );
    assert!(!fx.contains(&Effect::Kill));
}

#[test]
fn unattributable_garbage_is_forgiven_once_then_the_process_is_killed() {
    let mut s = shared();
    let (a, b) = (start(&mut s), start(&mut s));
    let fx = s.on(Input::BadFrame {
        run_id: None,
        detail: "not json".into(),
    });
    assert!(fx.is_empty(), "two runs in flight, nobody to blame: {fx:?}");
    let fx = s.on(Input::BadFrame {
        run_id: None,
        detail: "still not json".into(),
    });
    let mut failed: Vec<RunId> = delivered(&fx)
        .into_iter()
        .map(|d| {
            assert_eq!(d.3.as_deref(), Some("runner.protocol_error"));
            d.0
        })
        .collect();
    failed.sort();
    let mut both = vec![a, b];
    both.sort();
    assert_eq!(failed, both);
    assert!(fx.contains(&Effect::Kill));
    assert!(!s.accepts_runs());
}

#[test]
fn exit_fails_in_flight_runs_as_crashed() {
    let mut s = shared();
    let (a, b) = (start(&mut s), start(&mut s));
    s.on(Input::Cancel {
        run_id: b,
        reason: "user".into(),
    });
    let fx = s.on(Input::Exited {
        clean: true,
        detail: "exit status 0".into(),
    });
    let mut got = delivered(&fx);
    got.sort_by_key(|d| d.0 == b);
    assert_eq!(
        got,
        vec![
            (a, 1, "run.failed".into(), Some("runner.crashed".into())),
            (b, 1, "run.failed".into(), Some("cancelled".into())),
        ]
    );
    // A clean exit is not called a crash.
    assert_eq!(
        failure_message(&fx, a),
        "runner process exited while runs were active (exit status 0)"
    );
    assert_eq!(s.phase(), Phase::Exited);
    assert!(!s.accepts_runs());

    let mut s = shared();
    let c = start(&mut s);
    let fx = s.on(Input::Exited {
        clean: false,
        detail: "exit status 1".into(),
    });
    assert_eq!(
        failure_message(&fx, c),
        "runner process crashed: exit status 1"
    );
}

fn failure_message(fx: &[Effect], run: RunId) -> String {
    fx.iter()
        .find_map(|e| match e {
            Effect::Deliver { run_id, item } if *run_id == run => {
                item.result.data["error"].as_str().map(str::to_owned)
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no failure for {run}: {fx:?}"))
}

#[test]
fn a_per_run_process_exiting_cleanly_ends_its_run_like_done() {
    let mut s = RunnerLink::new(ExecutionMode::PerRun, ResultLimits::default());
    let id = start(&mut s);
    assert_eq!(
        s.start_run(RunId::new(), "r", Box::new(context(id, ""))),
        Err(StartRefused::PerRunUsed)
    );
    s.on(delta(id, "x"));
    let fx = s.on(Input::Exited {
        clean: true,
        detail: "exit status 0".into(),
    });
    assert_eq!(delivered(&fx), vec![(id, 2, "run.completed".into(), None)]);

    let mut s = RunnerLink::new(ExecutionMode::PerRun, ResultLimits::default());
    let id = start(&mut s);
    let fx = s.on(Input::Exited {
        clean: false,
        detail: "exit status 1".into(),
    });
    assert_eq!(
        delivered(&fx),
        vec![(id, 1, "run.failed".into(), Some("runner.crashed".into()))]
    );
}

#[test]
fn a_per_run_process_is_shut_down_after_its_run() {
    let mut s = RunnerLink::new(ExecutionMode::PerRun, ResultLimits::default());
    let id = start(&mut s);
    s.on(delta(id, "x"));
    let fx = s.on(done(id));
    assert_eq!(
        &fx[fx.len() - 2..],
        &[Effect::Write(HostToRunner::Shutdown {}), Effect::CloseInput]
    );
    assert_eq!(s.phase(), Phase::Draining);
}

#[test]
fn drain_waits_for_in_flight_runs() {
    let mut s = shared();
    assert_eq!(
        s.on(Input::Drain),
        vec![Effect::Write(HostToRunner::Shutdown {}), Effect::CloseInput]
    );

    let mut s = shared();
    let id = start(&mut s);
    assert!(s.on(Input::Drain).is_empty());
    assert_eq!(
        s.start_run(RunId::new(), "r", Box::new(context(id, ""))),
        Err(StartRefused::NotAccepting)
    );
    // In-flight runs keep working while draining.
    assert_eq!(delivered(&s.on(delta(id, "x"))).len(), 1);
    let fx = s.on(done(id));
    assert_eq!(
        &fx[fx.len() - 2..],
        &[Effect::Write(HostToRunner::Shutdown {}), Effect::CloseInput]
    );
    // Drain is idempotent: no second shutdown.
    assert!(s.on(Input::Drain).is_empty());
}

#[test]
fn abort_interrupts_every_run_and_kills() {
    let mut s = shared();
    let (a, b) = (start(&mut s), start(&mut s));
    let fx = s.on(Input::Abort {
        detail: "worker shutting down".into(),
    });
    let codes: Vec<Option<String>> = delivered(&fx).into_iter().map(|d| d.3).collect();
    assert_eq!(codes, vec![Some("interrupted".into()); 2]);
    let mut ended = ended(&fx);
    ended.sort();
    let mut both = vec![a, b];
    both.sort();
    assert_eq!(ended, both);
    assert!(fx.contains(&Effect::Kill));
}

#[test]
fn duplicate_run_ids_are_refused() {
    let mut s = shared();
    let id = start(&mut s);
    assert_eq!(
        s.start_run(id, "r", Box::new(context(id, ""))),
        Err(StartRefused::Duplicate)
    );
}
