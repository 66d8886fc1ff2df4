//! SPEC §14 "Runner ↔ host", tested as the attacks it closes, with real processes: a runner
//! reading the worker's `/proc/<pid>/environ`, running as root, escaping its limits, sharing
//! a temporary directory, or calling the Host API as another workspace's run.
//!
//! The tests adapt to the user they run as: as root (CI, containers) the runners must run as
//! `nobody`; as any other user they run as that user, and only non-dumpability protects the
//! worker. [`the_worker_environment_is_unreadable_to_a_same_user_runner`] covers the second
//! case even under root, by re-running this test binary as an unprivileged "worker".
//!
//! The worker-level test needs the runner binaries: `cargo build -p sb-runner-echo -p
//! sb-tests --bins`.

mod support;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use nix::unistd::{User, geteuid};
use sb_common::config::SandboxConfig;
use sb_protocol::error::{ErrorCode, HasErrorCode};
use sb_protocol::ids::WorkspaceId;
use sb_worker::runner::process::{ProcessSpec, RunnerProcess, StderrOptions};
use sb_worker::runner::{RunnerError, SandboxError, make_undumpable};
use serde_json::Value;
use tokio::io::AsyncReadExt as _;

use support::{Harness, SCRIPTED};

/// A secret-looking variable the "worker" holds, as it holds `SWITCHBOARD__*` URLs.
const SECRET_VAR: &str = "SWITCHBOARD__SESSIONS__URL";
const SECRET_VALUE: &str = "redis://:sb-test-secret-7f3a@127.0.0.1:6379/0";
/// Set in the environment of the re-executed "worker" test binary: `dumpable` or
/// `undumpable`.
const CHILD_MODE: &str = "SB_SANDBOX_TEST_WORKER";

fn sh(script: &str) -> ProcessSpec {
    ProcessSpec {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        env_allow: vec!["PATH".into()],
        cwd: None,
        label: "sandbox-test".into(),
    }
}

fn path_only(name: &str) -> Option<OsString> {
    (name == "PATH").then(|| OsString::from("/usr/local/bin:/usr/bin:/bin"))
}

/// Runs `script` as a runner process and returns its stdout (and the process, exited).
async fn run_script(script: &str, sandbox: &SandboxConfig) -> (String, RunnerProcess) {
    let mut process =
        RunnerProcess::spawn(&sh(script), StderrOptions::default(), sandbox, &path_only)
            .expect("runner starts");
    let (stdin, mut stdout) = process.take_stdio().unwrap();
    drop(stdin);
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(20), stdout.read_to_string(&mut out))
        .await
        .expect("runner finishes")
        .unwrap();
    let status = process.wait().await.unwrap();
    assert!(status.success(), "runner failed ({status}): {out}");
    (out, process)
}

/// The value of `key=` on a line of `out`.
fn field<'a>(out: &'a str, key: &str) -> &'a str {
    let prefix = format!("{key}=");
    out.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {key}= in {out}"))
}

/// The uid the runners of a default sandbox must run as: `nobody` under a root worker,
/// the worker's own uid otherwise.
fn expected_runner_uid() -> u32 {
    if geteuid().is_root() {
        User::from_name("nobody")
            .unwrap()
            .expect("a `nobody` user")
            .uid
            .as_raw()
    } else {
        geteuid().as_raw()
    }
}

/// What a runner learns by reading the worker's `/proc` files: `environ=denied` or the
/// secret it found, and `maps=denied|readable`.
fn snoop_script(worker_pid: u32) -> String {
    format!(
        "if env_text=$(tr '\\0' '\\n' < /proc/{worker_pid}/environ 2>/dev/null); then \
             echo \"environ=$(printf '%s\\n' \"$env_text\" | grep -c {SECRET_VAR}) $(printf '%s\\n' \"$env_text\" | grep {SECRET_VAR})\"; \
         else echo environ=denied; fi; \
         if head -c 1 /proc/{worker_pid}/maps >/dev/null 2>&1; then echo maps=readable; else echo maps=denied; fi"
    )
}

/// Not a test of its own: the "worker" of
/// [`the_worker_environment_is_unreadable_to_a_same_user_runner`], re-executed as an
/// unprivileged user. It starts a runner (as itself: it cannot switch users) that reads the
/// worker's `/proc/<pid>/environ` and `maps`, and prints what the runner saw.
#[tokio::test]
#[ignore = "run by the_worker_environment_is_unreadable_to_a_same_user_runner"]
async fn worker_child() {
    let Ok(mode) = std::env::var(CHILD_MODE) else {
        return;
    };
    assert!(!geteuid().is_root(), "the child worker must not be root");
    if mode == "undumpable" {
        make_undumpable().unwrap();
    }
    let (out, process) =
        run_script(&snoop_script(std::process::id()), &SandboxConfig::default()).await;
    assert_eq!(
        process.user().uid,
        geteuid(),
        "a worker that is not root runs runners as itself"
    );
    println!("RUNNER-SAW {}", out.trim().replace('\n', " | "));
}

/// Re-executes this test binary's [`worker_child`] with `mode`, holding the secret, as
/// `nobody` when the tests run as root. Returns what its runner saw.
async fn child_worker(mode: &str) -> String {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = tokio::process::Command::new(exe);
    cmd.args(["worker_child", "--exact", "--ignored", "--nocapture"])
        .env(CHILD_MODE, mode)
        .env(SECRET_VAR, SECRET_VALUE)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    if geteuid().is_root() {
        let nobody = User::from_name("nobody").unwrap().expect("a `nobody` user");
        cmd.uid(nobody.uid.as_raw()).gid(nobody.gid.as_raw());
        // Its private TMPDIR must be creatable by nobody.
        cmd.env("TMPDIR", std::env::temp_dir());
    }
    let output = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("child worker finishes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "child worker failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("RUNNER-SAW "))
        .unwrap_or_else(|| panic!("no report from the child worker: {stdout}"))
        .to_owned()
}

#[tokio::test]
async fn the_worker_environment_is_unreadable_to_a_same_user_runner() {
    // The attack, without the defence: a same-user runner reads the worker's secrets.
    let saw = child_worker("dumpable").await;
    assert!(
        saw.contains(SECRET_VALUE) && saw.contains("maps=readable"),
        "the control case must show the attack works: {saw}"
    );
    // With the defence, the same runner gets nothing.
    let saw = child_worker("undumpable").await;
    assert!(saw.contains("environ=denied"), "{saw}");
    assert!(saw.contains("maps=denied"), "{saw}");
    assert!(!saw.contains("sb-test-secret"), "{saw}");
}

#[tokio::test]
async fn a_runner_cannot_read_the_environment_of_the_worker_in_this_process() {
    // What `Worker::spawn_with` does first. As root this test also shows the user switch:
    // `nobody` cannot read root's `/proc` files whatever the dumpable flag.
    make_undumpable().unwrap();
    assert!(!nix::sys::prctl::get_dumpable().unwrap());
    let (out, _process) =
        run_script(&snoop_script(std::process::id()), &SandboxConfig::default()).await;
    assert!(out.contains("environ=denied"), "{out}");
    assert!(out.contains("maps=denied"), "{out}");
}

#[tokio::test]
async fn runners_are_unprivileged_with_no_new_privs_limits_and_a_private_tmpdir() {
    let sandbox = SandboxConfig {
        cpu_time: Some(Duration::from_secs(3600)),
        memory_bytes: Some(2 * 1024 * 1024 * 1024),
        open_files: std::num::NonZeroU32::new(256).unwrap(),
        processes: std::num::NonZeroU32::new(128).unwrap(),
        ..SandboxConfig::default()
    };
    let script = r#"
        echo "uid=$(id -u)"
        echo "gid=$(id -g)"
        echo "groups=$(id -G)"
        echo "nnp=$(awk '/^NoNewPrivs:/ {print $2}' /proc/self/status)"
        awk '/^Max cpu time/ {print "cpu=" $4 " " $5} /^Max address space/ {print "as=" $4 " " $5}
             /^Max open files/ {print "nofile=" $4 " " $5} /^Max processes/ {print "nproc=" $3 " " $4}' /proc/self/limits
        echo "tmpdir=$TMPDIR"
        echo "tmpstat=$(stat -c '%a %u' "$TMPDIR")"
        touch "$TMPDIR/scratch" && echo "scratch=ok"
    "#;
    let (out, process) = run_script(script, &sandbox).await;
    let uid: u32 = field(&out, "uid").parse().unwrap();
    assert_eq!(uid, expected_runner_uid(), "{out}");
    if geteuid().is_root() {
        assert_ne!(uid, 0, "a root worker never runs runners as root: {out}");
        assert!(
            !field(&out, "groups").split(' ').any(|g| g == "0"),
            "no supplementary root group: {out}"
        );
    }
    assert_eq!(field(&out, "nnp"), "1", "{out}");
    assert_eq!(field(&out, "cpu"), "3600 3600", "{out}");
    assert_eq!(field(&out, "as"), "2147483648 2147483648", "{out}");
    assert_eq!(field(&out, "nofile"), "256 256", "{out}");
    assert_eq!(field(&out, "nproc"), "128 128", "{out}");

    let tmpdir = PathBuf::from(field(&out, "tmpdir"));
    assert_eq!(Some(tmpdir.as_path()), process.temp_dir());
    assert_eq!(field(&out, "tmpstat"), format!("700 {uid}"), "{out}");
    assert_eq!(field(&out, "scratch"), "ok");
    assert!(tmpdir.join("scratch").exists());
    drop(process);
    assert!(!tmpdir.exists(), "the private TMPDIR outlived its process");
}

#[tokio::test]
async fn each_runner_process_gets_its_own_tmpdir() {
    let sandbox = SandboxConfig::default();
    let (a, pa) = run_script("echo \"tmpdir=$TMPDIR\"", &sandbox).await;
    let (b, pb) = run_script("echo \"tmpdir=$TMPDIR\"", &sandbox).await;
    assert_ne!(field(&a, "tmpdir"), field(&b, "tmpdir"));
    drop((pa, pb));
}

#[tokio::test]
async fn the_tmpdir_lives_under_the_configured_root() {
    let root = support::plugins_dir();
    let sandbox = SandboxConfig {
        temp_root: Some(root.path().to_path_buf()),
        ..SandboxConfig::default()
    };
    let (out, process) = run_script("echo \"tmpdir=$TMPDIR\"", &sandbox).await;
    let tmpdir = PathBuf::from(field(&out, "tmpdir"));
    assert_eq!(tmpdir.parent(), Some(root.path()));
    drop(process);
    assert!(!tmpdir.exists());

    let missing = SandboxConfig {
        temp_root: Some(root.path().join("missing")),
        ..SandboxConfig::default()
    };
    let e = RunnerProcess::spawn(&sh("true"), StderrOptions::default(), &missing, &path_only)
        .unwrap_err();
    assert!(
        matches!(e, RunnerError::Sandbox(SandboxError::TempDir { .. })),
        "{e}"
    );
    assert!(e.to_string().contains("missing"), "{e}");
}

#[tokio::test]
async fn starting_a_runner_as_root_is_refused_without_allow_root() {
    let as_user = |user: &str, allow_root: bool| SandboxConfig {
        user: Some(user.to_owned()),
        allow_root,
        ..SandboxConfig::default()
    };
    if !geteuid().is_root() {
        // A worker that is not root cannot switch: the runner is the worker's user, never root.
        let (out, _p) = run_script("echo \"uid=$(id -u)\"", &as_user("root", false)).await;
        assert_eq!(field(&out, "uid"), geteuid().as_raw().to_string());
        return;
    }
    for user in ["root", "sb-no-such-user"] {
        let e = RunnerProcess::spawn(
            &sh("echo started"),
            StderrOptions::default(),
            &as_user(user, false),
            &path_only,
        )
        .unwrap_err();
        assert!(
            matches!(e, RunnerError::Sandbox(SandboxError::RootRefused { .. })),
            "{user}: {e}"
        );
        let message = e.to_string();
        assert!(
            message.contains("refusing to start a runner as root")
                && message.contains(user)
                && message.contains("worker.sandbox.allow_root"),
            "{message}"
        );
        // Not retryable: the run fails for good instead of looping through workers.
        assert_eq!(e.code(), ErrorCode::Internal);
        assert!(!e.code().is_retryable());
    }
    // The operator may allow it explicitly.
    let (out, _p) = run_script("echo \"uid=$(id -u)\"", &as_user("root", true)).await;
    assert_eq!(field(&out, "uid"), "0");
}

/// Runs the scripted runner's `pid` script in `workspace`; returns the pid it reported.
async fn pid_of_a_run_in(h: &mut Harness, workspace: &WorkspaceId) -> String {
    let job = h.prepare_run_in(workspace, SCRIPTED, "pid", None).await;
    h.publish_job(&job).await;
    let results = h.results_until_terminal().await;
    results
        .iter()
        .find(|m| {
            m.result.run_id == job.run_id.to_string() && m.result.result_type == "message.completed"
        })
        .map(|m| {
            m.result.data["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .expect("a pid report")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_keeps_each_workspace_on_its_own_shared_process() {
    let mut h = Harness::start(|_, _| {}).await;
    assert!(
        !nix::sys::prctl::get_dumpable().unwrap(),
        "the worker made itself non-dumpable at start"
    );
    let (alpha, beta) = (
        WorkspaceId::new("alpha").unwrap(),
        WorkspaceId::new("beta").unwrap(),
    );
    // Beta's run waits for a cancel; alpha's run tries to act as it.
    let victim = h.prepare_run_in(&beta, SCRIPTED, "cancellable", None).await;
    h.publish_job(&victim).await;
    let worker = h.worker();
    h.eventually("beta's run to start", || {
        worker.active_runs().contains(&victim.run_id)
    })
    .await;
    let attacker = h
        .prepare_run_in(
            &alpha,
            SCRIPTED,
            &format!("api_foreign {} state_get", victim.run_id),
            None,
        )
        .await;
    h.publish_job(&attacker).await;
    let results = h.results_until_terminal().await;
    let report = results
        .iter()
        .find(|m| m.result.result_type == "message.completed")
        .expect("the attacker reported its answer");
    assert_eq!(report.result.run_id, attacker.run_id.to_string());
    let answer: Value =
        serde_json::from_str(report.result.data["message"]["content"].as_str().unwrap()).unwrap();
    assert_eq!(answer["ok"], false, "{answer}");
    assert_eq!(answer["error"]["code"], "not_found", "{answer}");

    // The runs were on different processes.
    assert_ne!(
        pid_of_a_run_in(&mut h, &alpha).await,
        pid_of_a_run_in(&mut h, &beta).await,
        "alpha and beta runs share no process"
    );

    h.publish_cancel(victim.run_id, "done").await;
    let ended = h.results_until_terminal().await;
    assert_eq!(
        ended.last().unwrap().result.run_id,
        victim.run_id.to_string()
    );
    h.stop().await;
}

#[tokio::test]
async fn a_program_the_runner_user_cannot_reach_is_explained() {
    if !geteuid().is_root() {
        // Only a root worker switches users; its own files are always reachable.
        return;
    }
    use std::os::unix::fs::PermissionsExt as _;
    // A plugin directory of mode 0700 owned by root: `nobody` cannot enter it.
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let program = dir.path().join("runner.sh");
    std::fs::write(&program, "#!/bin/sh\necho hi\n").unwrap();
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
    let spec = ProcessSpec {
        program,
        args: Vec::new(),
        env_allow: Vec::new(),
        cwd: Some(dir.path().to_path_buf()),
        label: "unreachable".into(),
    };
    let e = RunnerProcess::spawn(
        &spec,
        StderrOptions::default(),
        &SandboxConfig::default(),
        &path_only,
    )
    .unwrap_err();
    assert!(matches!(e, RunnerError::Spawn { .. }), "{e}");
    let message = e.to_string();
    assert!(
        message.contains("worker.sandbox.user") && message.contains("readable and executable"),
        "{message}"
    );
}
