//! `[worker]` and `[worker.sandbox]`: pools and slots, runner discovery, leases, the runner
//! pipe's caps, shutdown timings, and how runner processes are confined.

use std::num::{NonZeroU32, NonZeroUsize};
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::problems::Problems;
use super::values::{KIB, MIB, nz32, nzu};

/// The worker.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// Stable identity of this worker in leases and logs. Unset: a random id is generated at
    /// start (see [`WorkerConfig::id_or_generate`]).
    pub id: Option<String>,
    /// Pools this worker consumes jobs from (`switchboard.runs.<pool>`); a runner's manifest
    /// names its pool. Comma-separated in the environment.
    #[serde(deserialize_with = "crate::env_list::deserialize")]
    pub pools: Vec<String>,
    /// Runs executed concurrently by this worker (also its job prefetch).
    pub slots: NonZeroU32,
    /// Directories scanned for runner plugins (each subdirectory with a `manifest.toml`,
    /// `.yaml` or `.json`). Comma-separated in the environment.
    #[serde(deserialize_with = "crate::env_list::deserialize")]
    pub runners_dirs: Vec<PathBuf>,
    /// How often a running job's lease is renewed. Must be shorter than `lease_ttl`.
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// How long a lease lives without renewal; after that the run counts as orphaned and is
    /// finalized `interrupted`.
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// Longest line a runner may write on stdout, in bytes; a longer line is a protocol error.
    pub max_line_bytes: NonZeroUsize,
    /// Largest single result (`AgentRunResult` JSON) in bytes; must be below `max_line_bytes`.
    pub max_result_bytes: NonZeroUsize,
    /// Longest runner stderr line copied into the logs, in bytes; the rest of the line is cut.
    pub stderr_cap_bytes: NonZeroUsize,
    /// Time a runner gets after a `cancel` before its process group is killed.
    #[serde(with = "humantime_serde")]
    pub cancel_grace: Duration,
    /// On shutdown, time in-flight runs get to finish before they are cancelled and their jobs
    /// handed back to the queue.
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Duration,
    /// Longest a run's result item waits for the items after it before they are published
    /// together as one `switchboard.results/1` message (a terminal item, or 256 items, flush
    /// at once). Each message is a confirmed quorum-queue write and a sink transaction, so a
    /// short run that fits in one costs about half; the price is at most this much latency on
    /// an item that is not followed at once. `0s`: publish whatever is ready, never wait.
    #[serde(with = "humantime_serde")]
    pub result_linger: Duration,
    /// How runner processes are confined (SPEC §14).
    pub sandbox: SandboxConfig,
}

/// How a worker confines its runner processes (SPEC §14, `SECURITY.md`). Whatever is set
/// here, the worker makes itself non-dumpable at start, so no runner can read its memory or
/// `/proc/<worker>/environ`, and every runner gets a cleared environment, its own process
/// group, `no_new_privs`, the resource limits below and a private temporary directory.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxConfig {
    /// User the runners run as when the worker can switch users (it runs as root). Unset:
    /// `nobody`. A worker that cannot switch runs them as its own user.
    pub user: Option<String>,
    /// Allow runners to run as root (`user = "root"`, or a root worker that cannot find the
    /// user). Off: such a start is refused.
    pub allow_root: bool,
    /// CPU time one runner process may use (`RLIMIT_CPU`), e.g. `1h`; a shared process
    /// that reaches it is restarted like any crashed one. Unset: no limit.
    #[serde(with = "humantime_serde")]
    pub cpu_time: Option<Duration>,
    /// Address space of one runner process in bytes (`RLIMIT_AS`). Unset: no limit.
    pub memory_bytes: Option<u64>,
    /// Open files of one runner process (`RLIMIT_NOFILE`).
    pub open_files: NonZeroU32,
    /// Processes and threads of the runner user (`RLIMIT_NPROC`).
    pub processes: NonZeroU32,
    /// Directory under which each runner process gets its private temporary directory
    /// (`TMPDIR`), removed when the process exits. Unset: the system's.
    pub temp_root: Option<PathBuf>,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            user: None,
            allow_root: false,
            cpu_time: None,
            // 8 GiB of address space: far above an agent loop's needs, yet a runaway
            // allocation fails in the runner instead of pushing the worker's host into swap.
            memory_bytes: Some(8 * 1024 * 1024 * 1024),
            // Enough for an HTTP client pool and a few files; a descriptor leak fails fast.
            open_files: nz32(1024),
            // Threads count: a tokio or Python runner uses tens; 512 stops a fork bomb.
            processes: nz32(512),
            temp_root: None,
        }
    }
}

impl WorkerConfig {
    /// The configured id, or a fresh `worker-<uuid>` (call once at start and keep the result).
    pub fn id_or_generate(&self) -> String {
        self.id
            .clone()
            .unwrap_or_else(|| format!("worker-{}", uuid::Uuid::new_v4().simple()))
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            id: None,
            pools: vec!["default".to_owned()],
            // Runner processes are mostly waiting on models and tools; 16 concurrent runs keep
            // a small host busy without oversubscribing it with per-run processes.
            slots: nz32(16),
            // The official runners shipped in the repository / image.
            runners_dirs: vec![PathBuf::from("runners")],
            // SPEC §11: heartbeat every 3 s, lease 10 s, so two heartbeats may be lost before a
            // healthy worker loses its run.
            heartbeat_interval: Duration::from_secs(3),
            lease_ttl: Duration::from_secs(10),
            // SPEC §4.2: 4 MiB per line leaves room for a 1 MiB result plus escaping.
            max_line_bytes: nzu(4 * MIB),
            // SPEC §13 / seed `MAX_RESULT_SIZE_BYTES`.
            max_result_bytes: nzu(MIB),
            // Enough for a stack trace line; stops a runner from flooding the logs.
            stderr_cap_bytes: nzu(8 * KIB),
            // Cooperative cancel is a message round trip; 5 s is generous for a runner to stop.
            cancel_grace: Duration::from_secs(5),
            // Below the usual 30 s container stop timeout, so leases are released and jobs
            // requeued before the process is killed.
            drain_timeout: Duration::from_secs(20),
            // A couple of milliseconds: a runner's burst of items (a short reply, a tool
            // call and its result) leaves as one message; a model's deltas, which come tens
            // of milliseconds apart, are not held back noticeably.
            result_linger: Duration::from_millis(2),
            sandbox: SandboxConfig::default(),
        }
    }
}

impl WorkerConfig {
    /// Adds a problem for every rule of this section that the values break.
    pub(super) fn validate(&self, p: &mut Problems) {
        let w = self;
        if let Some(id) = &w.id {
            p.name("worker.id", id, &['.', ':']);
        }
        if w.pools.is_empty() {
            p.push("worker.pools", "expected at least one pool");
        }
        for pool in &w.pools {
            // A pool is a routing key and part of a queue name: no dots, no wildcards.
            p.name("worker.pools", pool, &[]);
        }
        if w.runners_dirs.is_empty() {
            p.push("worker.runners_dirs", "expected at least one directory");
        }
        p.positive("worker.heartbeat_interval", w.heartbeat_interval);
        p.positive("worker.lease_ttl", w.lease_ttl);
        if w.heartbeat_interval >= w.lease_ttl {
            p.push(
                "worker.heartbeat_interval",
                format!(
                    "expected less than worker.lease_ttl ({}), got {}",
                    humantime_serde::re::humantime::format_duration(w.lease_ttl),
                    humantime_serde::re::humantime::format_duration(w.heartbeat_interval)
                ),
            );
        }
        if w.max_result_bytes >= w.max_line_bytes {
            p.push(
                "worker.max_result_bytes",
                format!(
                    "expected less than worker.max_line_bytes ({}), got {}",
                    w.max_line_bytes, w.max_result_bytes
                ),
            );
        }
        p.positive("worker.cancel_grace", w.cancel_grace);
        p.positive("worker.drain_timeout", w.drain_timeout);
        if w.result_linger > Duration::from_secs(1) {
            p.push(
                "worker.result_linger",
                "expected at most 1s (it delays live items)",
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::values::MIB;

    #[test]
    fn rejects_worker_id_with_spaces() {
        assert_rejected("worker.id", "my worker");
    }

    #[test]
    fn rejects_empty_pools() {
        assert_rejected("worker.pools", OverrideValue::List(vec![]));
    }

    #[test]
    fn rejects_pool_with_dot() {
        assert_rejected("worker.pools", "gpu.large");
    }

    #[test]
    fn rejects_zero_slots() {
        assert_load_error("worker.slots", "0");
    }

    #[test]
    fn rejects_empty_runners_dirs() {
        assert_rejected("worker.runners_dirs", "");
    }

    #[test]
    fn rejects_heartbeat_not_below_lease_ttl() {
        let err = loader()
            .set("worker.heartbeat_interval", "10s")
            .set("worker.lease_ttl", "10s")
            .load()
            .unwrap_err();
        assert_eq!(err.problems()[0].key, "worker.heartbeat_interval");
    }

    #[test]
    fn rejects_zero_heartbeat() {
        assert_rejected("worker.heartbeat_interval", "0s");
    }

    #[test]
    fn rejects_a_result_linger_above_a_second() {
        assert_rejected("worker.result_linger", "2s");
    }

    #[test]
    fn rejects_zero_lease_ttl() {
        assert_rejected("worker.lease_ttl", "0s");
    }

    #[test]
    fn rejects_result_cap_not_below_line_cap() {
        assert_rejected("worker.max_result_bytes", (4 * MIB).to_string());
    }

    #[test]
    fn rejects_zero_max_line_bytes() {
        assert_load_error("worker.max_line_bytes", "0");
    }

    #[test]
    fn rejects_zero_cancel_grace() {
        assert_rejected("worker.cancel_grace", "0s");
    }

    #[test]
    fn rejects_zero_drain_timeout() {
        assert_rejected("worker.drain_timeout", "0s");
    }

    #[test]
    fn rejects_negative_number() {
        assert_load_error("worker.stderr_cap_bytes", "-1");
    }
}
