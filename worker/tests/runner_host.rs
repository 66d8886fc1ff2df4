//! The runner host against real processes: the official echo runner and the misbehaving
//! `sb-test-runner` (tests/src/bin), loaded through their real manifests.
//!
//! The binaries must be built first (cargo builds a package's own binaries for its tests,
//! but not other packages'):
//!
//! ```text
//! cargo build -p sb-runner-echo -p sb-tests --bins && cargo nextest run -p sb-worker --test runner_host
//! ```

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use sb_host_api::api::{ApiStream, CallerIdentity, HostApi};
use sb_host_api::basic::BasicHostApi;
use sb_protocol::context::AgentRunContext;
use sb_protocol::error::AgentApiError;
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_worker::plugins::{CommandLookup, PluginRunner, load_plugin_dir};
use sb_worker::runner::{EnvLookup, RunHandle, RunRequest, RunnerHost, RunnerHostOptions};
use sb_worker::sequencer::RunItem;
use serde_json::{Value, json};

const BUILD_HINT: &str =
    "build the runner binaries first: cargo build -p sb-runner-echo -p sb-tests --bins";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn load(plugin: &str) -> PluginRunner {
    let dir = repo_root().join(plugin);
    let mut results = load_plugin_dir(&dir, &CommandLookup::from_env()).expect("manifest loads");
    assert_eq!(results.len(), 1, "one runner per test plugin");
    match results.remove(0) {
        Ok(runner) => runner,
        Err(e) => panic!("{e}\n{BUILD_HINT}"),
    }
}

fn default_ws() -> WorkspaceId {
    WorkspaceId::default_workspace()
}

fn config() -> RunnerHostOptions {
    RunnerHostOptions {
        cancel_grace: Duration::from_millis(300),
        kill_grace: Duration::from_millis(500),
        restart_backoff_initial: Duration::from_millis(50),
        restart_backoff_max: Duration::from_millis(400),
        ..RunnerHostOptions::default()
    }
}

fn env_lookup() -> EnvLookup {
    Arc::new(|name: &str| match name {
        "SB_TEST_VISIBLE" => Some("yes".into()),
        "SB_TEST_HIDDEN" => Some("no".into()),
        _ => None,
    })
}

fn host_for(plugin: &str, api: Arc<dyn HostApi>) -> RunnerHost {
    RunnerHost::with_env(load(plugin).runner_spec(), config(), api, env_lookup())
}

fn shared() -> RunnerHost {
    host_for("tests/runners/test-shared", Arc::new(BasicHostApi))
}

fn per_run() -> RunnerHost {
    host_for("tests/runners/test-per-run", Arc::new(BasicHostApi))
}

fn context(run_id: RunId, text: &str) -> AgentRunContext {
    serde_json::from_value(json!({
        "run_id": run_id,
        "trigger": {"type": "message.received", "source": "api"},
        "event": {"event_id": "e1", "event_type": "message.received", "source": "api"},
        "input": {"text": text},
        "delivery": {"surface": "api"},
        "resources": {},
        "context": {"inline_policy": {"mode": "current_event"}, "available_apis": {}},
        "runtime": {"trace_id": run_id.to_string()},
    }))
    .unwrap()
}

async fn start(host: &RunnerHost, text: &str) -> RunHandle {
    let run_id = RunId::new();
    host.start_run(RunRequest::new(context(run_id, text)))
        .await
        .expect("run starts")
}

/// All items of a run, asserting the stream contract: dense sequences from 1, exactly one
/// terminal item, last.
async fn collect(mut handle: RunHandle) -> Vec<RunItem> {
    let items = tokio::time::timeout(Duration::from_secs(20), async {
        let mut items = Vec::new();
        while let Some(item) = handle.next().await {
            items.push(item);
        }
        items
    })
    .await
    .expect("run finished in time");
    assert!(!items.is_empty());
    for (i, item) in items.iter().enumerate() {
        assert_eq!(item.sequence, i as u64 + 1, "dense sequences: {items:#?}");
        assert_eq!(item.result.sequence, Some(item.sequence));
        assert_eq!(item.result.run_id, handle.run_id().to_string());
        assert_eq!(
            item.is_terminal(),
            i + 1 == items.len(),
            "one terminal, last: {items:#?}"
        );
    }
    items
}

async fn run(host: &RunnerHost, text: &str) -> Vec<RunItem> {
    collect(start(host, text).await).await
}

fn types(items: &[RunItem]) -> Vec<&str> {
    items
        .iter()
        .map(|i| i.result.result_type.as_str())
        .collect()
}

fn texts(items: &[RunItem]) -> Vec<String> {
    items
        .iter()
        .filter_map(|i| {
            let data = &i.result.data;
            data.get("chunk")
                .or_else(|| data.get("message"))
                .map(|m| m["content"].as_str().unwrap_or("").to_owned())
        })
        .collect()
}

fn failure(items: &[RunItem]) -> Option<&str> {
    items.last().and_then(RunItem::failure_code)
}

fn reported(items: &[RunItem]) -> String {
    let completed = items
        .iter()
        .find(|i| i.result.result_type == "message.completed")
        .expect("a report");
    completed.result.data["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn process_gone(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.is_empty() || stat.contains(") Z ")
}

/// Whether `condition` holds within two seconds (checked every 20 ms).
async fn eventually(condition: impl Fn() -> bool) -> bool {
    for _ in 0..100 {
        if condition() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

async fn wait_gone(pid: u32) -> bool {
    eventually(|| process_gone(pid)).await
}

/// Whether the host stops listing `pid` within two seconds.
async fn forgotten(host: &RunnerHost, pid: u32) -> bool {
    eventually(|| !host.pids().contains(&pid)).await
}

#[tokio::test]
async fn echo_streams_words_in_order() {
    let host = host_for("runners/echo", Arc::new(BasicHostApi));
    let items = run(&host, "hello big  world").await;
    assert_eq!(
        types(&items),
        vec![
            "message.delta",
            "message.delta",
            "message.delta",
            "message.completed",
            "run.completed"
        ]
    );
    assert_eq!(
        texts(&items),
        vec!["hello ", "big ", "world", "hello big  world"]
    );
    assert_eq!(items[4].result.data["finish_reason"], "stop");
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn shared_mode_serves_fifty_concurrent_runs_on_one_process() {
    let host = host_for("runners/echo", Arc::new(BasicHostApi));
    // Warm up so the process exists before the burst.
    run(&host, "warm").await;
    let pid = host.shared_pid(&default_ws()).expect("shared process up");
    let words: Vec<String> = (0..30).map(|i| format!("w{i}")).collect();
    let text = words.join(" ");
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let handle = start(&host, &text).await;
        tasks.push(tokio::spawn(collect(handle)));
    }
    assert!(host.active_runs() <= 50);
    for task in tasks {
        let items = task.await.unwrap();
        assert_eq!(items.len(), 32);
        let mut expected: Vec<String> = words.iter().map(|w| format!("{w} ")).collect();
        expected.last_mut().unwrap().pop();
        expected.push(text.clone());
        assert_eq!(texts(&items), expected);
    }
    assert_eq!(
        host.shared_pid(&default_ws()),
        Some(pid),
        "all runs on the one process"
    );
    assert_eq!(host.active_runs(), 0);
    assert_eq!(host.available_slots(), 64);
    host.shutdown(Duration::from_secs(2)).await;
    assert!(wait_gone(pid).await);
}

#[tokio::test]
async fn shared_concurrency_is_capped_by_max_concurrency() {
    let mut spec = load("tests/runners/test-shared").runner_spec();
    spec.max_concurrency = std::num::NonZeroUsize::new(2).unwrap();
    let host = RunnerHost::with_env(spec, config(), Arc::new(BasicHostApi), env_lookup());
    let a = start(&host, "cancellable").await;
    let b = start(&host, "cancellable").await;
    assert_eq!(host.available_slots(), 0);
    // A third run waits for a slot.
    let third = tokio::time::timeout(Duration::from_millis(200), start(&host, "x")).await;
    assert!(third.is_err(), "third run must wait");
    a.cancel("free a slot");
    let items = collect(a).await;
    assert_eq!(failure(&items), Some("cancelled"));
    let c = tokio::time::timeout(Duration::from_secs(5), start(&host, "third"))
        .await
        .expect("slot freed");
    assert_eq!(types(&collect(c).await).last(), Some(&"run.completed"));
    b.cancel("done");
    collect(b).await;
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn per_run_mode_uses_one_process_per_run() {
    let host = per_run();
    let handles = vec![
        start(&host, "pid").await,
        start(&host, "pid").await,
        start(&host, "pid").await,
    ];
    let mut pids = HashSet::new();
    for handle in handles {
        let items = collect(handle).await;
        pids.insert(reported(&items).parse::<u32>().unwrap());
    }
    assert_eq!(pids.len(), 3, "{pids:?}");
    for pid in pids {
        assert!(wait_gone(pid).await, "per-run process {pid} retired");
    }
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn per_run_clean_exit_means_done() {
    let host = per_run();
    let items = run(&host, "exit0").await;
    assert_eq!(types(&items), vec!["message.delta", "run.completed"]);
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn a_crash_fails_in_flight_runs_and_the_process_restarts() {
    let host = shared();
    let bystander = start(&host, "cancellable").await;
    let pid_before = host.shared_pid(&default_ws()).unwrap();
    let items = run(&host, "crash").await;
    assert_eq!(types(&items), vec!["message.delta", "run.failed"]);
    assert_eq!(failure(&items), Some("runner.crashed"));
    // The other run on the same process crashed with it.
    let other = collect(bystander).await;
    assert_eq!(failure(&other), Some("runner.crashed"));
    // The next run gets a new process (after the backoff).
    let items = run(&host, "pid").await;
    let pid_after: u32 = reported(&items).parse().unwrap();
    assert_ne!(pid_after, pid_before);
    assert!(process_gone(pid_before));
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn garbage_fails_the_run_and_the_process_resynchronises() {
    let host = shared();
    run(&host, "warm").await;
    let pid = host.shared_pid(&default_ws()).unwrap();
    let items = run(&host, "garbage").await;
    assert_eq!(types(&items), vec!["message.delta", "run.failed"]);
    assert_eq!(failure(&items), Some("runner.protocol_error"));
    // Same process, still serving.
    let items = run(&host, "still fine").await;
    assert_eq!(types(&items).last(), Some(&"run.completed"));
    assert_eq!(host.shared_pid(&default_ws()), Some(pid));
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn garbage_that_cannot_resynchronise_restarts_the_process() {
    let host = shared();
    run(&host, "warm").await;
    let pid = host.shared_pid(&default_ws()).unwrap();
    let items = run(&host, "garbage2").await;
    assert_eq!(failure(&items), Some("runner.protocol_error"));
    assert!(wait_gone(pid).await, "the broken process was killed");
    let items = run(&host, "pid").await;
    assert_ne!(reported(&items).parse::<u32>().unwrap(), pid);
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn empty_output_is_not_a_silent_success() {
    let host = shared();
    let items = run(&host, "empty").await;
    assert_eq!(types(&items), vec!["run.failed"]);
    assert_eq!(failure(&items), Some("runner.empty_output"));
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn oversize_results_follow_the_caps() {
    let host = shared();
    // A 2 MiB delta is truncated, delivered, and the run goes on.
    let items = run(&host, "huge").await;
    assert_eq!(
        types(&items),
        vec!["message.delta", "message.completed", "run.completed"]
    );
    let content = items[0].result.data["chunk"]["content"].as_str().unwrap();
    assert!(content.ends_with("...[truncated]") && content.len() < 20_000);
    // A 2 MiB state value cannot be truncated: protocol error.
    let items = run(&host, "hugestate").await;
    assert_eq!(types(&items), vec!["run.failed"]);
    assert_eq!(failure(&items), Some("runner.protocol_error"));
    // A 5 MiB line is over the 4 MiB line cap: protocol error, and the stream resynchronises.
    let items = run(&host, "overlong").await;
    assert_eq!(failure(&items), Some("runner.protocol_error"));
    let items = run(&host, "after").await;
    assert_eq!(types(&items).last(), Some(&"run.completed"));
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn unknown_types_are_dropped_and_missing_types_fail() {
    let host = shared();
    let items = run(&host, "unknown a b").await;
    assert_eq!(
        types(&items),
        vec![
            "message.delta",
            "message.delta",
            "message.completed",
            "run.completed"
        ]
    );
    let items = run(&host, "notype").await;
    assert_eq!(types(&items), vec!["run.failed"]);
    assert_eq!(failure(&items), Some("runner.protocol_error"));
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn a_runner_failure_passes_through() {
    let host = shared();
    let items = run(&host, "fail").await;
    assert_eq!(types(&items), vec!["run.failed"]);
    assert_eq!(failure(&items), Some("runner.error"));
    assert_eq!(items[0].result.data["error"], "scripted failure");
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn a_stream_without_terminal_is_completed_with_stop() {
    let host = shared();
    let items = run(&host, "noterminal").await;
    assert_eq!(types(&items), vec!["message.completed", "run.completed"]);
    assert_eq!(items[1].result.data["finish_reason"], "stop");
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn results_after_the_terminal_are_dropped() {
    let host = shared();
    let items = run(&host, "late").await;
    assert_eq!(types(&items), vec!["message.completed", "run.completed"]);
    // The late lines did not disturb the process.
    let items = run(&host, "next").await;
    assert_eq!(types(&items).last(), Some(&"run.completed"));
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn duplicate_runner_sequences_are_dropped() {
    let host = shared();
    let items = run(&host, "dup").await;
    assert_eq!(texts(&items), vec!["a", "b", "c"]);
    assert_eq!(types(&items).last(), Some(&"run.completed"));
    assert_eq!(items.len(), 4);
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn cancel_is_cooperative_then_enforced() {
    let host = shared();
    // The runner honours the cancel and reports it itself.
    let handle = start(&host, "cancellable").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    host.cancel(handle.run_id(), "user asked");
    let items = collect(handle).await;
    assert_eq!(types(&items), vec!["message.delta", "run.failed"]);
    assert_eq!(items[1].result.data["error"], "cancelled as asked");
    // The runner ignores it: the host ends the run after the grace period.
    let handle = start(&host, "stall").await;
    let started = std::time::Instant::now();
    handle.cancel("user asked");
    let items = collect(handle).await;
    assert_eq!(failure(&items), Some("cancelled"));
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "waited for the grace period"
    );
    host.shutdown(Duration::from_millis(200)).await;
}

#[tokio::test]
async fn a_deadline_fails_the_run_with_timeout() {
    let host = shared();
    let run_id = RunId::new();
    let mut request = RunRequest::new(context(run_id, "stall"));
    request.deadline = Some(SystemTime::now() + Duration::from_millis(300));
    let started = std::time::Instant::now();
    let items = collect(host.start_run(request).await.unwrap()).await;
    assert_eq!(types(&items), vec!["run.failed"]);
    assert_eq!(failure(&items), Some("timeout"));
    assert!(started.elapsed() >= Duration::from_millis(250));
    assert_eq!(items[0].result.data["retryable"], true);
    host.shutdown(Duration::from_millis(200)).await;
}

#[tokio::test]
async fn a_per_run_cancel_kills_the_whole_process_group() {
    let host = per_run();
    let mut handle = start(&host, "grandchild").await;
    let first = tokio::time::timeout(Duration::from_secs(5), handle.next())
        .await
        .unwrap()
        .unwrap();
    let grandchild: u32 = first.result.data["chunk"]["content"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(!process_gone(grandchild));
    handle.cancel("stop");
    let rest = tokio::time::timeout(Duration::from_secs(10), async {
        let mut rest = Vec::new();
        while let Some(item) = handle.next().await {
            rest.push(item);
        }
        rest
    })
    .await
    .unwrap();
    assert_eq!(failure(&rest), Some("cancelled"));
    assert!(
        wait_gone(grandchild).await,
        "grandchild {grandchild} outlived its runner"
    );
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn api_calls_are_served_for_the_callers_own_runs_only() {
    let host = shared();
    let items = run(&host, "api").await;
    let answer: Value = serde_json::from_str(&reported(&items)).unwrap();
    assert_eq!(answer["ok"], true);
    assert_eq!(answer["data"]["version"], env!("CARGO_PKG_VERSION"));

    let items = run(&host, "api call_tool").await;
    let answer: Value = serde_json::from_str(&reported(&items)).unwrap();
    assert_eq!(answer["ok"], false);
    assert_eq!(answer["error"]["code"], "unauthorized");

    let items = run(&host, "api_foreign").await;
    let answer: Value = serde_json::from_str(&reported(&items)).unwrap();
    assert_eq!(answer["ok"], false);
    assert_eq!(answer["error"]["code"], "not_found");
    host.shutdown(Duration::from_secs(2)).await;
}

/// Records who called, answers with the caller's plugin id.
#[derive(Default)]
struct Recorder {
    calls: Mutex<Vec<(CallerIdentity, RunId, String)>>,
}

#[async_trait]
impl HostApi for Recorder {
    async fn call(
        &self,
        caller: &CallerIdentity,
        run_id: RunId,
        action: &str,
        _params: Value,
        stream: &ApiStream,
    ) -> Result<Value, AgentApiError> {
        self.calls
            .lock()
            .unwrap()
            .push((caller.clone(), run_id, action.to_owned()));
        stream.send(json!("chunk")).await;
        Ok(json!({"plugin": caller.plugin_id}))
    }
}

#[tokio::test]
async fn the_caller_identity_comes_from_the_connection() {
    let recorder = Arc::new(Recorder::default());
    let host = host_for("tests/runners/test-shared", recorder.clone());
    let handle = start(&host, "api anything").await;
    let run_id = handle.run_id();
    let items = collect(handle).await;
    let answer: Value = serde_json::from_str(&reported(&items)).unwrap();
    assert_eq!(answer["data"]["plugin"], "switchboard-tests/test-shared");
    let calls = recorder.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 1);
    assert_eq!(
        calls[0].0.runner_id.to_string(),
        "plugin:switchboard-tests/test-shared/default"
    );
    assert_eq!(calls[0].1, run_id);
    assert_eq!(calls[0].2, "anything");
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn the_environment_is_cleared_except_the_allowlist() {
    let host = shared();
    let items = run(&host, "env").await;
    let names = reported(&items);
    assert_eq!(
        names, "SB_TEST_VISIBLE,TMPDIR",
        "only the allowlisted variable, and the private temporary directory: {names}"
    );
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn dropping_a_handle_cancels_its_run() {
    let host = shared();
    let handle = start(&host, "cancellable").await;
    assert_eq!(host.active_runs(), 1);
    drop(handle);
    for _ in 0..100 {
        if host.active_runs() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(host.active_runs(), 0);
    assert_eq!(host.available_slots(), 64);
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn shutdown_drains_then_interrupts_and_leaves_no_process() {
    let host = shared();
    let finishing = start(&host, "slow 10").await;
    let stuck = start(&host, "stall").await;
    let pid = host.shared_pid(&default_ws()).unwrap();
    let (done, _) = tokio::join!(
        async {
            let finished = collect(finishing).await;
            let stuck = collect(stuck).await;
            (finished, stuck)
        },
        host.shutdown(Duration::from_millis(500)),
    );
    let (finished, stuck) = done;
    assert_eq!(types(&finished).last(), Some(&"run.completed"));
    assert_eq!(failure(&stuck), Some("interrupted"));
    assert!(wait_gone(pid).await);
    // No new runs after shutdown.
    let refused = host
        .start_run(RunRequest::new(context(RunId::new(), "x")))
        .await;
    assert!(refused.is_err());
}

#[tokio::test]
async fn the_sdk_talks_to_the_real_host() {
    let host = host_for("tests/runners/sdk-shared", Arc::new(BasicHostApi));
    let items = run(&host, "version").await;
    assert_eq!(reported(&items), env!("CARGO_PKG_VERSION"));
    let items = run(&host, "denied").await;
    assert_eq!(reported(&items), "unauthorized");
    let items = run(&host, "plain text").await;
    assert_eq!(
        types(&items),
        vec!["message.delta", "message.completed", "run.completed"]
    );
    let items = run(&host, "panic").await;
    assert_eq!(failure(&items), Some("runner.error"));
    let items = run(&host, "error").await;
    assert_eq!(failure(&items), Some("runner.custom"));
    // A cooperative cancel through the SDK: the runner returns, the SDK reports `cancelled`
    // well before the host's grace period would have.
    let handle = start(&host, "wait").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = std::time::Instant::now();
    handle.cancel("user asked");
    let items = collect(handle).await;
    assert_eq!(types(&items), vec!["message.delta", "run.failed"]);
    assert_eq!(failure(&items), Some("cancelled"));
    assert_eq!(items[1].result.data["error"], "user asked");
    assert!(
        started.elapsed() < Duration::from_millis(250),
        "the SDK answered the cancel itself"
    );
    // After a shutdown the SDK process exits by itself.
    let pid = host.shared_pid(&default_ws()).unwrap();
    host.shutdown(Duration::from_secs(2)).await;
    assert!(wait_gone(pid).await);
}

#[tokio::test]
async fn dropping_the_host_stops_its_processes() {
    let host = shared();
    run(&host, "warm").await;
    let pid = host.shared_pid(&default_ws()).unwrap();
    drop(host);
    assert!(
        wait_gone(pid).await,
        "an unowned runner process {pid} kept running"
    );
}

#[tokio::test]
async fn many_runs_over_time_keep_their_streams_separate() {
    // Interleaved, varied scripts on one process: every stream keeps its own contract.
    let host = shared();
    let scripts = [
        "slow 15",
        "dup",
        "unknown x y",
        "noterminal",
        "fail",
        "late",
        "empty",
        "hello there",
    ];
    let mut tasks = Vec::new();
    for round in 0..4 {
        for s in scripts {
            let handle = start(&host, s).await;
            tasks.push((round, s, tokio::spawn(collect(handle))));
        }
    }
    let mut by_script: HashMap<&str, Vec<Vec<String>>> = HashMap::new();
    for (_, s, task) in tasks {
        let items = task.await.unwrap();
        by_script
            .entry(s)
            .or_default()
            .push(types(&items).iter().map(|t| (*t).to_owned()).collect());
    }
    for (s, runs) in by_script {
        assert!(
            runs.windows(2).all(|w| w[0] == w[1]),
            "{s}: same script, same stream: {runs:?}"
        );
    }
    host.shutdown(Duration::from_secs(2)).await;
}

// ---------------------------------------------------------------------------------------------
// SPEC §14: a shared runner process is bound to one workspace.

fn ws(id: &str) -> WorkspaceId {
    WorkspaceId::new(id).unwrap()
}

async fn start_in(host: &RunnerHost, workspace: &WorkspaceId, text: &str) -> RunHandle {
    let run_id = RunId::new();
    host.start_run(RunRequest::new(context(run_id, text)).in_workspace(workspace.clone()))
        .await
        .expect("run starts")
}

async fn pid_in(host: &RunnerHost, workspace: &WorkspaceId) -> u32 {
    reported(&collect(start_in(host, workspace, "pid").await).await)
        .parse()
        .unwrap()
}

#[tokio::test]
async fn shared_processes_are_per_workspace() {
    let host = shared();
    let (alpha, beta) = (ws("alpha"), ws("beta"));
    let alpha_pid = pid_in(&host, &alpha).await;
    let beta_pid = pid_in(&host, &beta).await;
    assert_ne!(alpha_pid, beta_pid, "one process per workspace");
    assert_eq!(
        pid_in(&host, &alpha).await,
        alpha_pid,
        "reused within alpha"
    );
    assert_eq!(pid_in(&host, &beta).await, beta_pid, "reused within beta");
    assert_eq!(host.shared_pid(&alpha), Some(alpha_pid));
    assert_eq!(host.shared_pid(&beta), Some(beta_pid));
    assert_eq!(host.shared_pid(&default_ws()), None);
    host.shutdown(Duration::from_secs(2)).await;
    assert!(wait_gone(alpha_pid).await && wait_gone(beta_pid).await);
}

#[tokio::test]
async fn a_shared_process_cannot_call_as_a_run_of_another_workspace() {
    let recorder = Arc::new(Recorder::default());
    let host = host_for("tests/runners/test-shared", recorder.clone());
    let (alpha, beta) = (ws("alpha"), ws("beta"));
    // Beta's run is live (waiting for a cancel) while alpha's process learns its id.
    let victim = start_in(&host, &beta, "cancellable").await;
    let victim_id = victim.run_id();
    let attacker = start_in(&host, &alpha, &format!("api_foreign {victim_id} state_get")).await;
    let items = collect(attacker).await;
    let answer: Value = serde_json::from_str(&reported(&items)).unwrap();
    assert_eq!(answer["ok"], false, "{answer}");
    assert_eq!(answer["error"]["code"], "not_found", "{answer}");
    assert!(
        recorder.calls.lock().unwrap().is_empty(),
        "the call never reached the host api"
    );
    assert_ne!(host.shared_pid(&alpha), host.shared_pid(&beta));

    victim.cancel("done");
    assert_eq!(failure(&collect(victim).await), Some("cancelled"));
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn the_host_api_sees_the_workspace_and_runs_of_the_calling_process() {
    let recorder = Arc::new(Recorder::default());
    let host = host_for("tests/runners/test-shared", recorder.clone());
    let handle = start_in(&host, &ws("alpha"), "api anything").await;
    let run_id = handle.run_id();
    collect(handle).await;
    let calls = recorder.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 1);
    let connection = calls[0].0.connection.clone().expect("a process connection");
    assert_eq!(connection.workspace_id(), &ws("alpha"));
    assert!(
        !connection.hosts(run_id),
        "the run ended: no longer on the connection"
    );
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn an_idle_process_of_another_workspace_makes_room_at_the_cap() {
    let mut spec = load("tests/runners/test-shared").runner_spec();
    spec.max_concurrency = std::num::NonZeroUsize::new(2).unwrap();
    let host = RunnerHost::with_env(spec, config(), Arc::new(BasicHostApi), env_lookup());
    let first = pid_in(&host, &ws("one")).await;
    let second = pid_in(&host, &ws("two")).await;
    // A third workspace: the least recently used idle process (`one`) is drained.
    let third = pid_in(&host, &ws("three")).await;
    assert!(
        wait_gone(first).await,
        "the idle process of `one` was drained"
    );
    // The host forgets a process once its actor has reaped it, a moment after it exits.
    assert!(
        forgotten(&host, first).await,
        "the drained process leaves the host's pids: {:?}",
        host.pids()
    );
    assert_eq!(host.shared_pid(&ws("one")), None);
    assert_eq!(host.shared_pid(&ws("two")), Some(second));
    assert_eq!(host.shared_pid(&ws("three")), Some(third));
    assert!(host.pids().len() <= 2, "{:?}", host.pids());
    // `one` comes back on a fresh process.
    let again = pid_in(&host, &ws("one")).await;
    assert_ne!(again, first);
    host.shutdown(Duration::from_secs(2)).await;
}

// ---------------------------------------------------------------------------------------------
// A forgiving, exact wire: call ids, refused calls, one answer per call.
// ---------------------------------------------------------------------------------------------

/// `hold` answers after 300 ms (counting the holds that ran to the end); `jitter` yields a
/// few times before answering, so its answer races the end of its run; anything else is
/// [`BasicHostApi`].
#[derive(Default)]
struct Holder {
    holds_finished: std::sync::atomic::AtomicUsize,
    jitter: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl HostApi for Holder {
    async fn call(
        &self,
        caller: &CallerIdentity,
        run_id: RunId,
        action: &str,
        params: Value,
        stream: &ApiStream,
    ) -> Result<Value, AgentApiError> {
        use std::sync::atomic::Ordering;
        match action {
            "hold" => {
                tokio::time::sleep(Duration::from_millis(300)).await;
                self.holds_finished.fetch_add(1, Ordering::SeqCst);
                Ok(json!({"held": true}))
            }
            "jitter" => {
                for _ in 0..self.jitter.fetch_add(1, Ordering::Relaxed) % 7 {
                    tokio::task::yield_now().await;
                }
                Ok(json!({"jittered": true}))
            }
            _ => {
                BasicHostApi
                    .call(caller, run_id, action, params, stream)
                    .await
            }
        }
    }
}

/// The runner's `wire` report: the host answers the scripted runner received.
fn wire_answers(items: &[RunItem]) -> Vec<Value> {
    serde_json::from_str(&reported(items)).expect("a JSON array of answers")
}

fn api_line(id: Value, action: &str) -> Value {
    json!({"op": "api", "id": id, "run_id": "$RUN", "action": action, "params": {}})
}

#[tokio::test]
async fn call_ids_are_echoed_exactly_and_unacceptable_calls_are_answered() {
    let host = shared();
    let lines = json!([
        api_line(json!(7), "get_host_version"),
        api_line(json!("7"), "get_host_version"),
        api_line(json!(-1), "teleport"),
        {"op": "api", "id": "no-run", "action": "get_host_version", "params": {}},
        {"op": "api", "id": 8, "run_id": "$RUN", "params": {}},
        {"op": "api", "run_id": "$RUN", "action": "get_host_version"},
        {"op": "api", "id": 9, "run_id": RunId::new(), "action": "get_host_version"},
    ]);
    let items = run(&host, &format!("wire 7 {lines}")).await;
    // The run went on: the report and run.completed arrived, nothing failed it.
    assert_eq!(
        types(&items),
        vec!["message.completed", "run.completed"],
        "{items:#?}"
    );
    let answers = wire_answers(&items);
    assert_eq!(answers.len(), 7, "{answers:#?}");
    let by_id = |id: Value| -> &Value {
        answers
            .iter()
            .find(|a| a["id"] == id)
            .unwrap_or_else(|| panic!("no answer for {id}: {answers:#?}"))
    };
    // 7 and "7" are two calls, each answered with its own id, type kept.
    assert!(by_id(json!(7))["id"].is_u64());
    assert_eq!(by_id(json!(7))["ok"], true);
    assert!(by_id(json!("7"))["id"].is_string());
    assert_eq!(by_id(json!("7"))["ok"], true);
    assert_eq!(by_id(json!(-1))["error"]["code"], "not_found");
    assert_eq!(
        by_id(json!(-1))["error"]["message"],
        "unknown host api action `teleport`"
    );
    assert_eq!(by_id(json!("no-run"))["error"]["code"], "invalid_argument");
    assert_eq!(
        by_id(json!("no-run"))["error"]["message"],
        "api call has no string `run_id`"
    );
    assert_eq!(by_id(json!(8))["error"]["code"], "invalid_argument");
    assert_eq!(
        by_id(json!(8))["error"]["message"],
        "api call has no string `action`"
    );
    // Without an id the refusal is addressed to `null` (JSON-RPC's rule).
    assert_eq!(by_id(Value::Null)["error"]["code"], "invalid_argument");
    assert_eq!(by_id(json!(9))["error"]["code"], "not_found");
    // The process is the same and serves the next run normally.
    let pid = host.shared_pid(&default_ws()).unwrap();
    assert_eq!(
        types(&run(&host, "fine").await).last(),
        Some(&"run.completed")
    );
    assert_eq!(host.shared_pid(&default_ws()), Some(pid));
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn a_call_id_in_flight_cannot_be_reused_until_it_is_answered() {
    let holder = Arc::new(Holder::default());
    let host = host_for("tests/runners/test-shared", holder.clone());
    let lines = json!([
        api_line(json!(1), "hold"),
        api_line(json!(1), "get_host_version")
    ]);
    let items = run(&host, &format!("wire 2 {lines}")).await;
    let answers = wire_answers(&items);
    assert_eq!(answers.len(), 2, "{answers:#?}");
    // The second call is refused at once; the first is neither aborted nor disturbed.
    assert_eq!(answers[0]["id"], 1);
    assert_eq!(answers[0]["ok"], false);
    assert_eq!(answers[0]["error"]["code"], "conflict");
    assert_eq!(answers[0]["error"]["details"]["id"], 1);
    assert_eq!(answers[1]["id"], 1);
    assert_eq!(answers[1]["ok"], true, "{answers:#?}");
    assert_eq!(answers[1]["data"]["held"], true);
    assert_eq!(
        holder
            .holds_finished
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    // Once answered, the id is free again.
    let lines = json!([api_line(json!(1), "get_host_version")]);
    let answers = wire_answers(&run(&host, &format!("wire 1 {lines}")).await);
    assert_eq!(answers.len(), 1, "{answers:#?}");
    assert_eq!(answers[0]["ok"], true);
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn a_call_in_flight_when_its_run_ends_is_aborted_and_answered_once() {
    let holder = Arc::new(Holder::default());
    let host = host_for("tests/runners/test-shared", holder.clone());
    let completed = json!({"op": "result", "run_id": "$RUN",
        "result": {"type": "run.completed", "data": {"finish_reason": "stop"}}});
    let items = run(
        &host,
        &format!(
            "wire 0 {}",
            json!([api_line(json!("h"), "hold"), completed])
        ),
    )
    .await;
    assert_eq!(types(&items), vec!["run.completed"]);
    // Well past the hold: the aborted call never finished, and was answered exactly once.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let answers = wire_answers(&run(&host, "answers").await);
    assert_eq!(answers.len(), 1, "{answers:#?}");
    assert_eq!(answers[0]["id"], "h");
    assert_eq!(answers[0]["error"]["code"], "not_found");
    assert_eq!(
        holder
            .holds_finished
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    host.shutdown(Duration::from_secs(2)).await;
}

/// The end of a run races the answers of its calls: whichever comes first, each call gets
/// exactly one answer (the real one, or `not_found`), never both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_is_answered_exactly_once_when_its_run_ends_meanwhile() {
    let host = host_for("tests/runners/test-shared", Arc::new(Holder::default()));
    let completed = json!({"op": "result", "run_id": "$RUN",
        "result": {"type": "run.completed", "data": {"finish_reason": "stop"}}});
    let mut ids = Vec::new();
    let mut handles = Vec::new();
    for round in 0..40 {
        let mut lines: Vec<Value> = (0..5)
            .map(|k| api_line(json!(format!("$RUN-{k}")), "jitter"))
            .collect();
        lines.push(completed.clone());
        let handle = start(&host, &format!("wire 0 {}", Value::Array(lines))).await;
        ids.extend((0..5).map(|k| format!("{}-{k}", handle.run_id())));
        handles.push(tokio::spawn(collect(handle)));
        if round % 8 == 7 {
            for handle in handles.drain(..) {
                handle.await.unwrap();
            }
        }
    }
    for handle in handles {
        handle.await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let answers = wire_answers(&run(&host, "answers").await);
    let mut per_id: HashMap<String, usize> = HashMap::new();
    let (mut served, mut ended) = (0, 0);
    for answer in &answers {
        assert_eq!(answer["op"], "api_result", "{answer}");
        *per_id
            .entry(answer["id"].as_str().unwrap().to_owned())
            .or_default() += 1;
        if answer["ok"] == true {
            served += 1;
        } else {
            assert_eq!(answer["error"]["code"], "not_found", "{answer}");
            ended += 1;
        }
    }
    for id in &ids {
        assert_eq!(per_id.get(id), Some(&1), "answers of {id}: {answers:#?}");
    }
    assert_eq!(per_id.len(), ids.len());
    println!("{served} calls served, {ended} answered not_found by the end of their run");
    host.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn a_shared_process_exiting_cleanly_mid_run_is_not_called_a_crash() {
    let host = shared();
    let bystander = start(&host, "cancellable").await;
    let items = run(&host, "exit0").await;
    assert_eq!(types(&items), vec!["message.delta", "run.failed"]);
    assert_eq!(failure(&items), Some("runner.crashed"));
    assert_eq!(
        items[1].result.data["error"],
        "runner process exited while runs were active (exit status 0)"
    );
    let other = collect(bystander).await;
    assert_eq!(
        other.last().unwrap().result.data["error"],
        "runner process exited while runs were active (exit status 0)"
    );
    // A real crash keeps its name.
    let items = run(&host, "crash").await;
    assert_eq!(
        items.last().unwrap().result.data["error"],
        "runner process crashed: exit status 1"
    );
    host.shutdown(Duration::from_secs(2)).await;
}
