//! Process-wide shutdown: one root [`CancellationToken`], one [`TaskTracker`], named tasks.
//!
//! `main` creates one [`Shutdown`] and hands clones to every role's `run(cfg, deps, shutdown)`.
//! The sequence is:
//!
//! ```text
//!  ctrl-c / SIGTERM ─┐
//!  shutdown.trigger()┴─▶ root token cancelled ──▶ every loop's `select! { biased; _ = cancelled() … }`
//!                                 │                   stops taking new work
//!                                 ▼
//!                       spawn() refuses (ShutdownError)
//!                                 ▼
//!        drain(deadline): wait for tracked tasks ── all done ──▶ DrainReport { forced: [] }
//!                                 │ deadline passed
//!                                 ▼
//!                log + abort each task still running ──▶ DrainReport { forced: [names] }
//! ```
//!
//! Per-run cancellation uses [`Shutdown::child_token`]: cancelling a run does not touch the
//! root, while a process shutdown reaches every run.
//!
//! Aborting a task drops its future at its next `.await`; code that must not be cut short
//! (an ack, a lease release) should watch the token and finish cooperatively before the
//! deadline. The deadline is the safety net, not the plan.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::{AbortHandle, JoinHandle};
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use tokio_util::task::TaskTracker;

use crate::error::ShutdownError;

/// How long [`Shutdown::drain`] waits for aborted tasks to unwind after the deadline. Aborts
/// take effect at the task's next poll, so this only matters for a task stuck in blocking code.
const ABORT_SETTLE: Duration = Duration::from_secs(1);

/// Root cancellation token + task tracker + the names of running tasks. Cheap to clone; all
/// clones share the same state.
#[derive(Clone, Default)]
pub struct Shutdown {
    token: CancellationToken,
    tracker: TaskTracker,
    tasks: Arc<TaskRegistry>,
}

/// The root token, for the shared loops that stop on a token ([`crate::bus::consumer`]).
impl AsRef<CancellationToken> for Shutdown {
    fn as_ref(&self) -> &CancellationToken {
        &self.token
    }
}

impl std::fmt::Debug for Shutdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shutdown")
            .field("shutting_down", &self.is_shutting_down())
            .field("tasks", &self.tracker.len())
            .finish()
    }
}

/// Names and abort handles of tasks that are still running. A task removes its own entry when
/// its future completes or is dropped (see [`Registration`]).
#[derive(Default)]
struct TaskRegistry {
    next_id: AtomicU64,
    running: Mutex<HashMap<u64, (String, AbortHandle)>>,
}

impl TaskRegistry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (String, AbortHandle)>> {
        // A panic while holding this lock cannot leave the map inconsistent (single inserts
        // and removes), so a poisoned lock is still usable.
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Removes a task's registry entry when the task's future is dropped, whether it completed,
/// panicked or was aborted.
struct Registration {
    id: u64,
    registry: Arc<TaskRegistry>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.id);
    }
}

/// What [`Shutdown::drain`] had to do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Names of the tasks still running at the deadline, which were aborted (sorted).
    pub forced: Vec<String>,
}

impl DrainReport {
    /// `true` when every task finished on its own before the deadline.
    pub fn is_clean(&self) -> bool {
        self.forced.is_empty()
    }
}

impl Shutdown {
    /// A fresh handle: nothing cancelled, no tasks.
    pub fn new() -> Self {
        Self::default()
    }

    /// Begins shutdown: cancels the root token (and therefore every child token). Idempotent.
    pub fn trigger(&self) {
        if !self.token.is_cancelled() {
            tracing::info!("shutdown requested");
        }
        self.token.cancel();
    }

    /// `true` once shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Completes when shutdown begins. Put it first in a `biased` `select!`.
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.token.cancelled()
    }

    /// Runs `tick` every `period` (the first at once) until shutdown begins, for the
    /// periodic scans of a role (reaper, scheduler). A tick that overruns delays the next
    /// one instead of letting missed ticks fire back to back; a tick in progress when
    /// shutdown begins finishes first.
    pub async fn every<F, Fut>(&self, period: std::time::Duration, mut tick: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = self.cancelled() => return,
                _ = ticks.tick() => tick().await,
            }
        }
    }

    /// A clone of the root token (for APIs that take a token, e.g. axum's
    /// `with_graceful_shutdown(token.cancelled_owned())`).
    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    /// A token cancelled with the root, that can also be cancelled on its own (one per run).
    pub fn child_token(&self) -> CancellationToken {
        self.token.child_token()
    }

    /// A handle sharing this one's task tracker and task names, with its own token: a child
    /// of this one's. Cancelling `child.token()` stops only the loops handed `child` (e.g. one
    /// shard a service hands over to another process), without logging a shutdown; triggering
    /// this handle still reaches them. Tasks spawned through the child are tracked (and
    /// drained) like any other.
    pub fn child(&self) -> Shutdown {
        Shutdown {
            token: self.token.child_token(),
            tracker: self.tracker.clone(),
            tasks: Arc::clone(&self.tasks),
        }
    }

    /// Spawns a named, tracked task. Refused with [`ShutdownError`] once shutdown has begun, so
    /// no new work starts during the drain.
    ///
    /// Must be called from within a tokio runtime.
    pub fn spawn<F>(
        &self,
        name: impl Into<String>,
        future: F,
    ) -> Result<JoinHandle<F::Output>, ShutdownError>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let name = name.into();
        if self.token.is_cancelled() || self.tracker.is_closed() {
            return Err(ShutdownError { task: name });
        }
        let id = self.tasks.next_id.fetch_add(1, Ordering::Relaxed);
        let registration = Registration {
            id,
            registry: Arc::clone(&self.tasks),
        };
        // Holding the lock across the spawn makes the insert happen before the task can remove
        // its entry, even if it completes immediately on another worker thread.
        let mut running = self.tasks.lock();
        let handle = self.tracker.spawn(async move {
            let _registration = registration;
            future.await
        });
        running.insert(id, (name, handle.abort_handle()));
        Ok(handle)
    }

    /// Names of the tracked tasks that are still running (sorted; for diagnostics and tests).
    pub fn running_tasks(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .tasks
            .lock()
            .values()
            .map(|(name, _)| name.clone())
            .collect();
        names.sort();
        names
    }

    /// Starts a task that triggers shutdown on ctrl-c or (on Unix) SIGTERM, and ends when
    /// shutdown begins for any reason. The handlers are installed before this returns, so a
    /// signal sent afterwards is never missed.
    pub fn listen_for_signals(&self) -> Result<JoinHandle<()>, ShutdownError> {
        #[cfg(unix)]
        let mut sigterm = match tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::terminate(),
        ) {
            Ok(s) => Some(s),
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM; only ctrl-c stops the process");
                None
            }
        };
        let this = self.clone();
        self.spawn("signal-listener", async move {
            #[cfg(unix)]
            let terminate = async {
                match sigterm.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            };
            #[cfg(not(unix))]
            let terminate = std::future::pending::<()>();
            tokio::pin!(terminate);

            tokio::select! {
                biased;
                _ = this.cancelled() => return,
                result = tokio::signal::ctrl_c() => {
                    if let Err(error) = result {
                        tracing::error!(%error, "cannot listen for ctrl-c");
                        // Without ctrl-c handling, fall back to waiting for SIGTERM only.
                        tokio::select! {
                            _ = this.cancelled() => return,
                            _ = &mut terminate => tracing::info!(signal = "SIGTERM", "signal received"),
                        }
                    } else {
                        tracing::info!(signal = "SIGINT", "signal received");
                    }
                }
                _ = &mut terminate => tracing::info!(signal = "SIGTERM", "signal received"),
            }
            this.trigger();
        })
    }

    /// Begins shutdown (if not already begun), then waits up to `deadline` for every tracked
    /// task to finish. Tasks still running at the deadline are logged by name and aborted.
    pub async fn drain(&self, deadline: Duration) -> DrainReport {
        self.trigger();
        self.tracker.close();
        if tokio::time::timeout(deadline, self.tracker.wait())
            .await
            .is_ok()
        {
            tracing::info!("all tasks finished");
            return DrainReport::default();
        }
        let mut forced: Vec<(String, AbortHandle)> = self.tasks.lock().values().cloned().collect();
        forced.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, handle) in &forced {
            tracing::warn!(task = %name, deadline = ?deadline, "task still running at shutdown deadline; aborting");
            handle.abort();
        }
        if tokio::time::timeout(ABORT_SETTLE, self.tracker.wait())
            .await
            .is_err()
        {
            tracing::error!(
                tasks = ?self.running_tasks(),
                "tasks did not stop after abort (blocking code?)"
            );
        }
        DrainReport {
            forced: forced.into_iter().map(|(name, _)| name).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::{Instant, sleep};

    #[tokio::test(start_paused = true)]
    async fn spawn_after_shutdown_is_refused() {
        let shutdown = Shutdown::new();
        let ok = shutdown.spawn("before", async { 1 }).unwrap();
        assert_eq!(ok.await.unwrap(), 1);
        shutdown.trigger();
        let err = shutdown.spawn("late", async {}).unwrap_err();
        assert_eq!(err.task, "late");
    }

    #[tokio::test(start_paused = true)]
    async fn child_cancels_alone_but_follows_the_root() {
        let root = Shutdown::new();
        let a = root.child();
        let b = root.child();
        let task = a
            .spawn("child-task", {
                let a = a.clone();
                async move { a.cancelled().await }
            })
            .unwrap();
        assert_eq!(root.running_tasks(), vec!["child-task".to_owned()]);
        a.token().cancel();
        task.await.unwrap();
        assert!(a.is_shutting_down());
        assert!(!root.is_shutting_down() && !b.is_shutting_down());
        assert!(a.spawn("late", async {}).is_err());
        root.trigger();
        assert!(b.is_shutting_down());
    }

    #[tokio::test(start_paused = true)]
    async fn spawn_after_drain_is_refused() {
        let shutdown = Shutdown::new();
        assert!(shutdown.drain(Duration::from_secs(1)).await.is_clean());
        assert!(shutdown.spawn("late", async {}).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn drain_waits_for_cooperative_tasks() {
        let shutdown = Shutdown::new();
        let s = shutdown.clone();
        let handle = shutdown
            .spawn("consumer", async move {
                s.cancelled().await;
                // Finishing in-flight work takes a while, but less than the deadline.
                sleep(Duration::from_secs(3)).await;
                "acked"
            })
            .unwrap();
        let start = Instant::now();
        let report = shutdown.drain(Duration::from_secs(10)).await;
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        assert_eq!(handle.await.unwrap(), "acked");
        assert!(shutdown.running_tasks().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn drain_aborts_tasks_past_the_deadline_and_names_them() {
        let shutdown = Shutdown::new();
        let stuck = shutdown
            .spawn("stuck-run", async {
                sleep(Duration::from_secs(3600)).await;
            })
            .unwrap();
        let s = shutdown.clone();
        shutdown
            .spawn("polite", async move { s.cancelled().await })
            .unwrap();
        assert_eq!(shutdown.running_tasks(), ["polite", "stuck-run"]);

        let start = Instant::now();
        let report = shutdown.drain(Duration::from_secs(5)).await;
        assert_eq!(report.forced, ["stuck-run"]);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        assert!(stuck.await.unwrap_err().is_cancelled());
        assert!(shutdown.running_tasks().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn finished_tasks_leave_the_registry() {
        let shutdown = Shutdown::new();
        let h = shutdown
            .spawn("short", sleep(Duration::from_millis(10)))
            .unwrap();
        assert_eq!(shutdown.running_tasks(), ["short"]);
        h.await.unwrap();
        assert!(shutdown.running_tasks().is_empty());

        // A panicking task also leaves it.
        let h = shutdown.spawn("panics", async { panic!("boom") }).unwrap();
        assert!(h.await.unwrap_err().is_panic());
        assert!(shutdown.running_tasks().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn child_tokens_follow_the_root_but_not_the_other_way() {
        let shutdown = Shutdown::new();
        let run_a = shutdown.child_token();
        let run_b = shutdown.child_token();
        run_a.cancel();
        assert!(!shutdown.is_shutting_down());
        assert!(!run_b.is_cancelled());
        shutdown.trigger();
        assert!(run_b.is_cancelled());
        assert!(shutdown.token().is_cancelled());
    }

    #[cfg(unix)]
    #[tokio::test]
    async fn sigterm_triggers_shutdown() {
        let shutdown = Shutdown::new();
        let listener = shutdown.listen_for_signals().unwrap();
        let status = std::process::Command::new("kill")
            .args(["-TERM", &std::process::id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        tokio::time::timeout(Duration::from_secs(10), shutdown.cancelled())
            .await
            .expect("SIGTERM should cancel the root token");
        listener.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn signal_listener_ends_when_shutdown_is_triggered_otherwise() {
        let shutdown = Shutdown::new();
        let listener = shutdown.listen_for_signals().unwrap();
        let report = shutdown.drain(Duration::from_secs(1)).await;
        assert!(report.is_clean(), "{report:?}");
        listener.await.unwrap();
    }
}
