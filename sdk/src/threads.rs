//! The threads runs execute on: a thread per run in flight, kept for the next run when its
//! run ends instead of exiting.
//!
//! [`Runner::run`](crate::Runner::run) is blocking code, so every run in flight needs a
//! thread of its own. Starting one per run and letting it exit cost the echo runner about
//! two fifths of its CPU under load (the kernel's work to create, map, unmap and reap a
//! thread; `perf` of a cluster at 64 runs in flight). A thread whose run ended waits
//! [`IDLE_TIMEOUT`] for the next one and exits only if none came, so a steady load reuses the
//! same threads and an idle runner holds none.
//!
//! # Hand-over
//! `idle` counts the threads waiting for a job that no job is promised to yet. A submitter
//! either *reserves* one of them (decrements `idle`) and sends its job on the channel, or,
//! when none is free, starts a new thread with the job. A waiting thread that times out
//! leaves only by taking back an unreserved place (decrementing `idle` itself); when every
//! waiting place is reserved, a job is on its way and it keeps waiting. So there are always
//! at least as many waiting threads as jobs in the channel: no job waits for a thread that
//! has left.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a thread whose run ended waits for the next run before it exits.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Work for a run thread.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// The run threads of one runner process. Cheap to share (`Arc`).
pub(crate) struct RunThreads {
    jobs: Sender<Job>,
    shared: Arc<Shared>,
    idle_timeout: Duration,
}

struct Shared {
    /// Waiting threads no job is promised to.
    idle: AtomicUsize,
    /// Where waiting threads take their jobs (one waits on the channel, the others on the
    /// lock).
    queue: Mutex<Receiver<Job>>,
}

impl RunThreads {
    pub(crate) fn new() -> Self {
        Self::with_idle_timeout(IDLE_TIMEOUT)
    }

    pub(crate) fn with_idle_timeout(idle_timeout: Duration) -> Self {
        let (jobs, queue) = mpsc::channel();
        Self {
            jobs,
            shared: Arc::new(Shared {
                idle: AtomicUsize::new(0),
                queue: Mutex::new(queue),
            }),
            idle_timeout,
        }
    }

    /// Runs `job` on a waiting thread, or on a new one when none waits. `Err` only when a
    /// new thread was needed and the system refused it (the job is dropped unrun).
    pub(crate) fn execute(&self, job: Job) -> io::Result<()> {
        if self.reserve_idle() {
            // A waiting thread is promised this job and cannot leave before it takes it, so
            // the receiver is alive (it lives in `shared`, which this value holds too).
            self.jobs
                .send(job)
                .expect("the job queue lives as long as its sender");
            return Ok(());
        }
        let shared = Arc::clone(&self.shared);
        let idle_timeout = self.idle_timeout;
        std::thread::Builder::new()
            .name("sb-runner-run".into())
            .spawn(move || {
                job();
                wait_for_jobs(&shared, idle_timeout);
            })
            .map(drop)
    }

    /// Takes one waiting thread for a job, if any is free.
    fn reserve_idle(&self) -> bool {
        take_one(&self.shared.idle)
    }

    /// Threads waiting for a job that none is promised to (for tests).
    #[cfg(test)]
    pub(crate) fn idle(&self) -> usize {
        self.shared.idle.load(Ordering::SeqCst)
    }
}

/// Decrements `counter` if it is above zero; `true` if it did.
fn take_one(counter: &AtomicUsize) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

/// A thread's life after its first job: wait for the next, run it, until none comes for
/// `idle_timeout` and no job is promised to a waiting thread.
fn wait_for_jobs(shared: &Shared, idle_timeout: Duration) {
    loop {
        shared.idle.fetch_add(1, Ordering::SeqCst);
        let job = loop {
            let next = shared
                .queue
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .recv_timeout(idle_timeout);
            match next {
                Ok(job) => break job,
                // Leave only by taking back an unreserved place; if every place is
                // reserved, a job is on its way to one of the waiting threads.
                Err(RecvTimeoutError::Timeout) if take_one(&shared.idle) => return,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        };
        job();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Barrier;
    use std::time::Instant;

    use super::*;

    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn thread_id_job(threads: &RunThreads) -> std::thread::ThreadId {
        let (tx, rx) = mpsc::channel();
        threads
            .execute(Box::new(move || {
                tx.send(std::thread::current().id()).unwrap()
            }))
            .unwrap();
        rx.recv().unwrap()
    }

    #[test]
    fn a_thread_whose_run_ended_takes_the_next_run() {
        let threads = RunThreads::new();
        let first = thread_id_job(&threads);
        wait_until("the thread waits", || threads.idle() == 1);
        let second = thread_id_job(&threads);
        assert_eq!(first, second);
        assert_ne!(first, std::thread::current().id());
    }

    #[test]
    fn runs_in_flight_together_each_get_a_thread() {
        let threads = RunThreads::new();
        let all_in = Arc::new(Barrier::new(4));
        let (tx, rx) = mpsc::channel();
        for _ in 0..3 {
            let (all_in, tx) = (Arc::clone(&all_in), tx.clone());
            threads
                .execute(Box::new(move || {
                    // Blocks until all three run at once: one thread each.
                    all_in.wait();
                    tx.send(std::thread::current().id()).unwrap();
                }))
                .unwrap();
        }
        all_in.wait();
        let ids: std::collections::HashSet<_> = (0..3).map(|_| rx.recv().unwrap()).collect();
        assert_eq!(ids.len(), 3);
        wait_until("all three wait", || threads.idle() == 3);
    }

    #[test]
    fn an_idle_thread_leaves_after_the_timeout_and_a_new_run_starts_another() {
        let threads = RunThreads::with_idle_timeout(Duration::from_millis(20));
        let first = thread_id_job(&threads);
        wait_until("the thread waits", || threads.idle() == 1);
        wait_until("the thread leaves", || threads.idle() == 0);
        let second = thread_id_job(&threads);
        assert_ne!(first, second);
    }

    #[test]
    fn no_job_is_lost_while_threads_time_out() {
        // Timeouts as short as the gaps between jobs: threads leave and are reserved all
        // the time, and every job still runs.
        let threads = RunThreads::with_idle_timeout(Duration::from_micros(200));
        let (tx, rx) = mpsc::channel();
        for i in 0..2_000u32 {
            let tx = tx.clone();
            threads
                .execute(Box::new(move || tx.send(i).unwrap()))
                .unwrap();
            if i % 7 == 0 {
                std::thread::sleep(Duration::from_micros(150));
            }
        }
        let mut seen: Vec<u32> = (0..2_000)
            .map(|_| {
                rx.recv_timeout(Duration::from_secs(10))
                    .expect("a job was lost")
            })
            .collect();
        seen.sort_unstable();
        assert!(seen.iter().copied().eq(0..2_000));
    }
}
