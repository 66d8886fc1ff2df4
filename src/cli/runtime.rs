//! The Tokio runtime every command runs on, chosen before anything else starts.
//!
//! `TOKIO_WORKER_THREADS` is Tokio's own variable for how many threads run tasks; unset, a
//! multi-thread runtime starts one per core. Set to `1` (what `scripts/cluster` gives each
//! role, as a container given one CPU would get), the process runs on Tokio's current-thread
//! scheduler instead of a multi-thread one with a single worker: the same one thread runs
//! every task, without the work-stealing scheduler's bookkeeping (its injection queue, its
//! searching and parking protocol, the idle thread that blocks in `block_on`). On the 2-core
//! benchmark machine that cut the cluster's machine CPU per run by ≈ 14 %
//! (`docs/PERFORMANCE.md`, session 52). Anything else (unset, `2`, …) is left to Tokio's
//! multi-thread runtime, which reads the variable itself and refuses a value that is not a
//! positive number.
//!
//! Nothing in the roles needs more than one scheduler thread to make progress: no task
//! blocks its thread (`block_in_place` is not used; blocking work goes to the blocking pool,
//! which both schedulers have), so the one thread only has to be free of long computations,
//! as the single worker already had to be.

use tokio::runtime::{Builder, Runtime};

/// Tokio's variable for the number of task threads.
pub const WORKER_THREADS_ENV: &str = "TOKIO_WORKER_THREADS";

/// Which scheduler a process runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheduler {
    /// One thread runs every task (`TOKIO_WORKER_THREADS=1`).
    CurrentThread,
    /// Tokio's work-stealing scheduler, with as many workers as it decides.
    MultiThread,
}

/// The scheduler for a `TOKIO_WORKER_THREADS` value (`None`: unset). Only an exact `1`
/// chooses the current-thread scheduler; every other value is the multi-thread runtime's
/// to read, so a bad value keeps Tokio's own error.
#[must_use]
pub fn scheduler_for(worker_threads: Option<&str>) -> Scheduler {
    match worker_threads.map(str::parse::<usize>) {
        Some(Ok(1)) => Scheduler::CurrentThread,
        _ => Scheduler::MultiThread,
    }
}

/// Builds the runtime `TOKIO_WORKER_THREADS` asks for ([`scheduler_for`]), with I/O and
/// timers enabled.
///
/// # Errors
/// When the runtime cannot be built (the operating system refuses a thread or the I/O
/// driver).
pub fn build() -> std::io::Result<Runtime> {
    build_for(std::env::var(WORKER_THREADS_ENV).ok().as_deref())
}

/// [`build`] for a given `TOKIO_WORKER_THREADS` value (`None`: unset).
fn build_for(worker_threads: Option<&str>) -> std::io::Result<Runtime> {
    let mut builder = match scheduler_for(worker_threads) {
        Scheduler::CurrentThread => Builder::new_current_thread(),
        Scheduler::MultiThread => Builder::new_multi_thread(),
    };
    builder.enable_all().build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_one_thread_runs_on_the_current_thread_scheduler() {
        assert_eq!(scheduler_for(Some("1")), Scheduler::CurrentThread);
        for other in [
            None,
            Some("2"),
            Some("8"),
            Some(""),
            Some(" 1"),
            Some("one"),
        ] {
            assert_eq!(scheduler_for(other), Scheduler::MultiThread, "{other:?}");
        }
    }

    #[test]
    fn one_thread_builds_a_current_thread_runtime_that_runs_spawned_and_blocking_work() {
        let runtime = build_for(Some("1")).unwrap();
        assert_eq!(
            runtime.handle().runtime_flavor(),
            tokio::runtime::RuntimeFlavor::CurrentThread
        );
        let answer = runtime.block_on(async {
            let spawned = tokio::spawn(async { 20 });
            let blocking = tokio::task::spawn_blocking(|| 22);
            spawned.await.unwrap() + blocking.await.unwrap()
        });
        assert_eq!(answer, 42);
    }
}
