//! Spawning and killing runner processes (SPEC §4.2, §11).
//!
//! Every runner process:
//! - starts with a **cleared environment** plus only the variables its manifest allowlists
//!   (`execution.env`), so host secrets (database URLs, model API keys) never leak into plugin
//!   code;
//! - runs in **its own process group** (`process_group(0)`), so a runner that forks helpers can be
//!   stopped as a whole: [`RunnerProcess::terminate`] sends `SIGTERM` to the group, waits a grace
//!   period, then sends `SIGKILL` to the group;
//! - is killed if its handle is dropped (`kill_on_drop` plus a group `SIGKILL` in `Drop`), so no
//!   code path — a panic, an aborted task — can leak a process;
//! - is confined ([`super::sandbox`]): an unprivileged user when the worker runs as root,
//!   `no_new_privs`, resource limits, and a private `TMPDIR` removed with the process;
//! - has its stderr read line by line into `tracing` (target `sb_worker::runner::stderr`),
//!   redacted ([`super::redact`]) and capped ([`StderrLimiter`]), never buffered without bound.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use sb_common::config::SandboxConfig;
use tempfile::TempDir;
use tokio::io::BufReader;
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::task::JoinHandle;

use super::codec::{LineReader, RawLine};
use super::error::RunnerError;
use super::redact::redact;
use super::sandbox::{Confinement, RunnerUser};

/// What to start. Built from a manifest's `execution` table by the plugin loader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSpec {
    /// Absolute path of the executable (already resolved, see `plugins::resolve_command`).
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Names of environment variables passed through from the worker; everything else is
    /// cleared, and `TMPDIR` is always the process's private directory.
    pub env_allow: Vec<String>,
    /// Working directory (the plugin directory), if any.
    pub cwd: Option<PathBuf>,
    /// Label for logs (the runner id).
    pub label: String,
}

/// Limits for captured stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StderrOptions {
    /// Longer lines are cut (the rest of the line is discarded, not buffered).
    pub max_line_bytes: usize,
    /// At most this many bytes are logged per [`StderrOptions::window`]; lines beyond are
    /// counted and reported as one summary line when the window rolls over. Keeps a runner that
    /// spams stderr from flooding the worker's logs.
    pub bytes_per_window: usize,
    pub window: Duration,
}

impl Default for StderrOptions {
    fn default() -> Self {
        Self {
            // A stack trace line or a JSON blob is rarely longer; longer means a dump.
            max_line_bytes: 8 * 1024,
            // 256 KiB per 10 s is far above normal diagnostic output.
            bytes_per_window: 256 * 1024,
            window: Duration::from_secs(10),
        }
    }
}

/// A running runner process. Take its stdio with [`RunnerProcess::take_stdio`].
#[derive(Debug)]
pub struct RunnerProcess {
    child: Child,
    pid: u32,
    label: String,
    stdin: Option<ChildStdin>,
    stdout: Option<ChildStdout>,
    stderr_task: Option<JoinHandle<()>>,
    /// Set once the child was reaped; after that the group is only signalled for stragglers.
    exit: Option<ExitStatus>,
    /// Who the process runs as.
    user: RunnerUser,
    /// The private `TMPDIR`, removed when this handle is dropped (after the group is killed).
    temp_dir: Option<TempDir>,
}

impl RunnerProcess {
    /// Spawns the process, confined by `sandbox` (refused with [`RunnerError::Sandbox`] if
    /// it cannot be). `lookup_env` supplies the values of allowlisted variables (normally
    /// `std::env::var_os`; a map in tests).
    pub fn spawn(
        spec: &ProcessSpec,
        stderr: StderrOptions,
        sandbox: &SandboxConfig,
        lookup_env: &dyn Fn(&str) -> Option<OsString>,
    ) -> Result<Self, RunnerError> {
        let confinement = Confinement::prepare(sandbox)?;
        let user = confinement.user();
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        for name in &spec.env_allow {
            if let Some(value) = lookup_env(name) {
                cmd.env(name, value);
            }
        }
        if let Some(dir) = &spec.cwd {
            cmd.current_dir(dir);
        }
        confinement.apply(&mut cmd);
        let mut child = cmd.spawn().map_err(|source| RunnerError::Spawn {
            program: spec.program.display().to_string(),
            source: explain_spawn_error(source, user),
        })?;
        let pid = child.id().ok_or_else(|| RunnerError::Spawn {
            program: spec.program.display().to_string(),
            source: std::io::Error::other("process exited before its pid was read"),
        })?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let stderr_task = child.stderr.take().map(|err| {
            let label = spec.label.clone();
            tokio::spawn(capture_stderr(err, label, pid, stderr))
        });
        tracing::debug!(runner_id = %spec.label, pid, program = %spec.program.display(), uid = user.uid.as_raw(), tmpdir = %confinement.temp_dir().display(), "runner process spawned");
        Ok(Self {
            child,
            pid,
            label: spec.label.clone(),
            stdin,
            stdout,
            stderr_task,
            exit: None,
            user,
            temp_dir: Some(confinement.into_temp_dir()),
        })
    }

    /// The OS process id (also the process group id).
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Who the process runs as.
    #[must_use]
    pub fn user(&self) -> RunnerUser {
        self.user
    }

    /// The process's private temporary directory (its `TMPDIR`); gone once the handle is
    /// dropped.
    #[must_use]
    pub fn temp_dir(&self) -> Option<&std::path::Path> {
        self.temp_dir.as_ref().map(TempDir::path)
    }

    /// Takes the stdin/stdout pipes (once).
    pub fn take_stdio(&mut self) -> Option<(ChildStdin, ChildStdout)> {
        Some((self.stdin.take()?, self.stdout.take()?))
    }

    /// Waits for the process to exit. Cancel safe.
    pub async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        if let Some(status) = self.exit {
            return Ok(status);
        }
        let status = self.child.wait().await?;
        self.exit = Some(status);
        Ok(status)
    }

    /// Non-blocking exit check.
    pub fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait()?;
        }
        Ok(self.exit)
    }

    /// Sends `signal` to the whole process group. A group that no longer exists is not an
    /// error.
    pub fn signal_group(&self, signal: Signal) {
        let Ok(raw) = i32::try_from(self.pid) else {
            return;
        };
        match killpg(Pid::from_raw(raw), signal) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
            Err(e) => {
                tracing::warn!(runner_id = %self.label, pid = self.pid, %signal, error = %e, "signalling runner process group failed")
            }
        }
    }

    /// Stops the process: group `SIGTERM`, up to `grace` for it to exit, then group `SIGKILL`.
    /// Returns the exit status (or the error of waiting for it).
    pub async fn terminate(&mut self, grace: Duration) -> std::io::Result<ExitStatus> {
        if let Some(status) = self.try_wait()? {
            // The leader is gone; helpers it left in the group are killed outright.
            self.signal_group(Signal::SIGKILL);
            return Ok(status);
        }
        self.signal_group(Signal::SIGTERM);
        let status = match tokio::time::timeout(grace, self.wait()).await {
            Ok(status) => status?,
            Err(_) => {
                tracing::warn!(runner_id = %self.label, pid = self.pid, grace_ms = grace.as_millis() as u64, "runner ignored SIGTERM, killing its process group");
                self.signal_group(Signal::SIGKILL);
                self.wait().await?
            }
        };
        self.signal_group(Signal::SIGKILL);
        Ok(status)
    }

    /// Waits until the stderr reader has drained the pipe (all output logged). Used after exit
    /// so a crash's last words reach the log before the crash is reported.
    pub async fn drain_stderr(&mut self, within: Duration) {
        if let Some(task) = self.stderr_task.take() {
            let _ = tokio::time::timeout(within, task).await;
        }
    }
}

impl Drop for RunnerProcess {
    fn drop(&mut self) {
        // kill_on_drop only kills the leader; take the whole group down as well. While the
        // leader is unreaped its pid cannot be reused, so this cannot hit a stranger.
        if self.exit.is_none() {
            self.signal_group(Signal::SIGKILL);
        }
        if let Some(task) = self.stderr_task.take() {
            task.abort();
        }
        // The group is dead (or dying): its scratch files go with it.
        if let Some(dir) = self.temp_dir.take() {
            let path = dir.path().to_path_buf();
            if let Err(error) = dir.close() {
                tracing::warn!(runner_id = %self.label, pid = self.pid, path = %path.display(), %error, "runner temporary directory could not be removed");
            }
        }
    }
}

/// A permission error when the runner runs as another user is almost always a program or
/// plugin directory that user cannot reach: say so.
fn explain_spawn_error(error: std::io::Error, user: RunnerUser) -> std::io::Error {
    if user.switch && error.kind() == std::io::ErrorKind::PermissionDenied {
        return std::io::Error::new(
            error.kind(),
            format!(
                "{error} (runners run as uid {} gid {} (worker.sandbox.user): the program and the \
                 plugin directory, with every directory above them, must be readable and \
                 executable by that user)",
                user.uid, user.gid
            ),
        );
    }
    error
}

/// Reads stderr lines into the log until the pipe closes.
async fn capture_stderr(
    stderr: tokio::process::ChildStderr,
    label: String,
    pid: u32,
    config: StderrOptions,
) {
    let mut lines = LineReader::new(BufReader::new(stderr), config.max_line_bytes);
    let mut limiter = StderrLimiter::new(config.bytes_per_window, config.window);
    loop {
        let (bytes, cut) = match lines.next_line().await {
            Ok(Some(RawLine::Line(bytes))) => (bytes, false),
            Ok(Some(RawLine::TooLong { prefix })) => (prefix, true),
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(runner_id = %label, pid, error = %e, "reading runner stderr failed");
                break;
            }
        };
        match limiter.admit(bytes.len(), Instant::now()) {
            Admit::Log { dropped_before } => {
                if dropped_before > 0 {
                    tracing::warn!(target: "sb_worker::runner::stderr", runner_id = %label, pid, dropped_lines = dropped_before, "runner stderr rate limit dropped lines");
                }
                let text = String::from_utf8_lossy(&bytes);
                let text = redact(text.trim_end_matches('\r'));
                let suffix = if cut { " …[truncated]" } else { "" };
                tracing::info!(target: "sb_worker::runner::stderr", runner_id = %label, pid, "{text}{suffix}");
            }
            Admit::Drop => {}
        }
    }
    if limiter.dropped > 0 {
        tracing::warn!(target: "sb_worker::runner::stderr", runner_id = %label, pid, dropped_lines = limiter.dropped, "runner stderr rate limit dropped lines");
    }
}

/// Fixed-window byte budget for stderr logging (pure; time is passed in).
#[derive(Debug, Clone)]
pub struct StderrLimiter {
    budget: usize,
    window: Duration,
    window_start: Option<Instant>,
    used: usize,
    /// Lines dropped since the last reported summary.
    dropped: u64,
}

/// Decision of [`StderrLimiter::admit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Log the line; first report `dropped_before` lines that were dropped since the last log.
    Log {
        dropped_before: u64,
    },
    Drop,
}

impl StderrLimiter {
    #[must_use]
    pub fn new(budget: usize, window: Duration) -> Self {
        Self {
            budget,
            window,
            window_start: None,
            used: 0,
            dropped: 0,
        }
    }

    pub fn admit(&mut self, len: usize, now: Instant) -> Admit {
        let start = *self.window_start.get_or_insert(now);
        if now.duration_since(start) >= self.window {
            self.window_start = Some(now);
            self.used = 0;
        }
        if self.used + len > self.budget && self.used > 0 {
            self.dropped += 1;
            return Admit::Drop;
        }
        self.used += len;
        Admit::Log {
            dropped_before: std::mem::take(&mut self.dropped),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

    /// Spawns with the default sandbox (as root: as `nobody`).
    fn spawn(
        spec: &ProcessSpec,
        stderr: StderrOptions,
        lookup: &dyn Fn(&str) -> Option<OsString>,
    ) -> Result<RunnerProcess, RunnerError> {
        RunnerProcess::spawn(spec, stderr, &SandboxConfig::default(), lookup)
    }

    fn sh(script: &str) -> ProcessSpec {
        ProcessSpec {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            env_allow: vec!["KEEP_ME".into(), "PATH".into()],
            cwd: None,
            label: "test".into(),
        }
    }

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), OsString::from(v)))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[tokio::test]
    async fn environment_is_cleared_except_the_allowlist() {
        let lookup = env(&[
            ("KEEP_ME", "yes"),
            ("SECRET", "no"),
            ("PATH", "/usr/bin:/bin"),
            ("TMPDIR", "/tmp/shared-with-everyone"),
        ]);
        let mut spec = sh("env; echo END");
        // A manifest may allowlist TMPDIR: the private directory still wins.
        spec.env_allow.push("TMPDIR".into());
        let mut p = spawn(&spec, StderrOptions::default(), &lookup).unwrap();
        let tmpdir = format!("TMPDIR={}", p.temp_dir().unwrap().display());
        let (_stdin, stdout) = p.take_stdio().unwrap();
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let mut seen = Vec::new();
        while let Some(line) = lines.next_line().await.unwrap() {
            seen.push(line);
        }
        assert!(seen.contains(&"KEEP_ME=yes".to_owned()), "{seen:?}");
        assert!(!seen.iter().any(|l| l.starts_with("SECRET=")), "{seen:?}");
        assert!(!seen.iter().any(|l| l.starts_with("HOME=")), "{seen:?}");
        assert!(seen.contains(&tmpdir), "{seen:?}");
        assert!(p.wait().await.unwrap().success());
    }

    #[tokio::test]
    async fn runs_in_its_own_process_group() {
        let lookup = env(&[]);
        let mut p = spawn(
            &sh("ps -o pgid= -p $$ || cat /proc/$$/stat"),
            StderrOptions::default(),
            &lookup,
        )
        .unwrap();
        let (_stdin, stdout) = p.take_stdio().unwrap();
        let mut out = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut tokio::io::BufReader::new(stdout), &mut out)
            .await
            .unwrap();
        p.wait().await.unwrap();
        // Either `ps` printed the pgid, or /proc/<pid>/stat has it as the 5th field.
        let pgid: u32 = if let Ok(n) = out.trim().parse() {
            n
        } else {
            out.rsplit(')')
                .next()
                .unwrap()
                .split_whitespace()
                .nth(2)
                .unwrap()
                .parse()
                .unwrap()
        };
        assert_eq!(pgid, p.pid());
    }

    #[tokio::test]
    async fn terminate_kills_the_whole_group_even_when_sigterm_is_ignored() {
        let lookup = env(&[]);
        // The leader ignores TERM and starts a grandchild that also ignores it.
        let script = "trap '' TERM; (trap '' TERM; sleep 30) & echo $!; while :; do sleep 1; done";
        let mut p = spawn(&sh(script), StderrOptions::default(), &lookup).unwrap();
        let (stdin, stdout) = p.take_stdio().unwrap();
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let grandchild: i32 = lines
            .next_line()
            .await
            .unwrap()
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let started = Instant::now();
        let status = p.terminate(Duration::from_millis(300)).await.unwrap();
        assert!(!status.success());
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(stdin);
        // The grandchild is gone too (give the kernel a moment to deliver).
        let mut alive = true;
        for _ in 0..50 {
            if nix::sys::signal::kill(Pid::from_raw(grandchild), None).is_err() {
                alive = false;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // A killed but not yet reaped zombie still answers kill(0); check its state instead.
        if alive {
            let stat =
                std::fs::read_to_string(format!("/proc/{grandchild}/stat")).unwrap_or_default();
            alive = !stat.is_empty() && !stat.contains(") Z ");
        }
        assert!(!alive, "grandchild {grandchild} survived");
    }

    #[tokio::test]
    async fn a_cooperative_process_exits_on_sigterm_within_grace() {
        let lookup = env(&[]);
        let mut p = spawn(&sh("exec sleep 30"), StderrOptions::default(), &lookup).unwrap();
        let started = Instant::now();
        let status = p.terminate(Duration::from_secs(10)).await.unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc_sigterm()));
    }

    fn libc_sigterm() -> i32 {
        Signal::SIGTERM as i32
    }

    #[tokio::test]
    async fn dropping_the_handle_kills_the_process() {
        let lookup = env(&[]);
        let p = spawn(&sh("exec sleep 30"), StderrOptions::default(), &lookup).unwrap();
        let pid = p.pid() as i32;
        drop(p);
        let mut gone = false;
        for _ in 0..100 {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            if stat.is_empty() || stat.contains(") Z ") {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(gone, "process {pid} survived its handle");
    }

    #[tokio::test]
    async fn spawn_failure_names_the_program() {
        let lookup = env(&[]);
        let spec = ProcessSpec {
            program: "/nonexistent/runner".into(),
            ..sh("")
        };
        let err = spawn(&spec, StderrOptions::default(), &lookup).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/runner"), "{err}");
    }

    #[tokio::test]
    async fn stdin_close_ends_a_reading_process() {
        let lookup = env(&[]);
        let mut p = spawn(
            &sh("cat >/dev/null; exit 3"),
            StderrOptions::default(),
            &lookup,
        )
        .unwrap();
        let (mut stdin, _stdout) = p.take_stdio().unwrap();
        stdin.write_all(b"x\n").await.unwrap();
        drop(stdin);
        assert_eq!(p.wait().await.unwrap().code(), Some(3));
    }

    #[tokio::test]
    async fn stderr_is_drained_so_a_chatty_process_never_blocks() {
        // Megabytes to stderr: far more than a pipe buffer. Without a reader draining it the
        // process would block forever on a full pipe.
        let lookup = env(&[]);
        // One endless-looking 4 MiB line, then 200 000 short lines.
        let script = "head -c 4194304 /dev/zero | tr '\\0' 'e' >&2; yes eeeeeeeeee | head -n 200000 >&2; exit 7";
        let config = StderrOptions {
            bytes_per_window: 4096,
            ..StderrOptions::default()
        };
        let mut p = spawn(&sh(script), config, &lookup).unwrap();
        let status = tokio::time::timeout(Duration::from_secs(30), p.wait())
            .await
            .expect("process blocked on stderr");
        assert_eq!(status.unwrap().code(), Some(7));
    }

    #[test]
    fn limiter_drops_over_budget_and_reports_on_the_next_window() {
        let t0 = Instant::now();
        let mut l = StderrLimiter::new(10, Duration::from_secs(1));
        assert_eq!(l.admit(6, t0), Admit::Log { dropped_before: 0 });
        assert_eq!(l.admit(4, t0), Admit::Log { dropped_before: 0 });
        assert_eq!(l.admit(1, t0), Admit::Drop);
        assert_eq!(l.admit(1, t0), Admit::Drop);
        assert_eq!(
            l.admit(3, t0 + Duration::from_secs(1)),
            Admit::Log { dropped_before: 2 }
        );
        // A single line larger than the whole budget still gets through in an empty window.
        let mut l = StderrLimiter::new(10, Duration::from_secs(1));
        assert_eq!(l.admit(100, t0), Admit::Log { dropped_before: 0 });
    }
}
