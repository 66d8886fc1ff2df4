//! Group commit by natural batching: concurrent callers submit requests, one task commits
//! whatever is pending as one batch and answers each caller with its part.
//!
//! ```text
//!  submit(a) ─┐                         ┌─▶ a's answer
//!  submit(b) ─┼─▶ queue ─▶ commit([a, b, c]) ─┼─▶ b's answer
//!  submit(c) ─┘   (one task)            └─▶ c's answer
//! ```
//!
//! The task never waits for more requests than are already queued: with one caller at a
//! time every batch holds one request and costs what a direct call costs; under load the
//! requests that arrive while a batch is committing form the next batch, so batches grow
//! with the load by themselves. One commit is in flight at a time, which is what makes the
//! batches form: the database does one transaction's work where it did one per request.
//!
//! [`SharedRead`] is the same idea for reads of a changing value: the callers waiting at once
//! share one read, never one that began before they arrived.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

use futures::FutureExt as _;
use tokio::sync::{mpsc, oneshot};

/// A request and the channel its answer goes back on.
type Job<Req, Resp> = (Req, oneshot::Sender<Resp>);

/// The request was not answered: its batch's commit panicked, or the committing task is gone
/// (the runtime is shutting down). It may or may not have been committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the group-commit task is gone")]
pub struct GroupCommitClosed;

impl sb_protocol::error::HasErrorCode for GroupCommitClosed {
    /// Retryable: a request made again is committed by a task that works (or, at shutdown,
    /// by the next process).
    fn code(&self) -> sb_protocol::error::ErrorCode {
        sb_protocol::error::ErrorCode::Unavailable
    }
}

/// The submitting side of a group-commit task. Cheap to clone; the task ends when the last
/// clone is dropped, after committing what is queued.
#[derive(Debug)]
pub struct GroupCommit<Req, Resp> {
    tx: mpsc::Sender<Job<Req, Resp>>,
}

impl<Req, Resp> Clone for GroupCommit<Req, Resp> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
        }
    }
}

impl<Req: Send + 'static, Resp: Send + 'static> GroupCommit<Req, Resp> {
    /// Spawns the committing task on the current Tokio runtime. `commit` receives up to
    /// `max_batch` requests (at least one) in submission order and must return one answer
    /// per request, in the same order; a request left without an answer gets
    /// [`GroupCommitClosed`].
    ///
    /// # Panics
    /// Outside a Tokio runtime.
    pub fn spawn<F, Fut>(max_batch: usize, mut commit: F) -> Self
    where
        F: FnMut(Vec<Req>) -> Fut + Send + 'static,
        Fut: Future<Output = Vec<Resp>> + Send + 'static,
    {
        let max_batch = max_batch.max(1);
        // Room for a few batches: a full queue makes submitters wait (backpressure) rather
        // than grow memory without bound.
        let (tx, mut rx) = mpsc::channel::<Job<Req, Resp>>(max_batch.saturating_mul(4));
        tokio::spawn(async move {
            let mut jobs = Vec::with_capacity(max_batch);
            while rx.recv_many(&mut jobs, max_batch).await > 0 {
                let (requests, waiters): (Vec<Req>, Vec<oneshot::Sender<Resp>>) =
                    jobs.drain(..).unzip();
                // A commit that panics (a bug) fails its own batch only: its callers get
                // `GroupCommitClosed`, and the next batch is committed as usual, instead of
                // every later request failing with the task gone.
                let answers = match AssertUnwindSafe(commit(requests)).catch_unwind().await {
                    Ok(answers) => answers,
                    Err(_) => {
                        tracing::error!(
                            requests = waiters.len(),
                            "a group commit panicked; its batch is failed"
                        );
                        continue;
                    }
                };
                for (waiter, answer) in waiters.into_iter().zip(answers) {
                    // A caller that gave up (its request was cancelled) is not waiting.
                    let _ = waiter.send(answer);
                }
            }
        });
        Self { tx }
    }

    /// Queues `request` for the next batch and waits for its answer. Dropping the future
    /// does not withdraw a queued request: it is committed all the same.
    pub async fn submit(&self, request: Req) -> Result<Resp, GroupCommitClosed> {
        let (answer, answered) = oneshot::channel();
        self.tx
            .send((request, answer))
            .await
            .map_err(|_| GroupCommitClosed)?;
        answered.await.map_err(|_| GroupCommitClosed)
    }
}

/// The read side of natural batching: one read of a value that changes (a revocation epoch,
/// say) shared by the callers waiting at once, under the rule that makes sharing safe —
/// **a caller is only given the result of a read that began after it arrived**. So a caller
/// that arrives after a change was made (and acknowledged) sees it, exactly as with a read
/// of its own, while under load the reads stay at about one per read's round trip instead of
/// one per caller.
///
/// ```text
///  a arrives ─ read 1 begins ──────────── read 1 ends ─▶ a
///  b, c arrive during read 1 ─ (wait) ─── read 2 begins ─── read 2 ends ─▶ b, c
/// ```
///
/// Reads run one at a time, in the calling tasks (no task of its own, nothing to spawn): a
/// caller either takes the last read's result, if it began after the caller arrived, or
/// makes the next read itself. A caller cancelled mid-read leaves no result; the next
/// waiter reads instead.
#[derive(Debug)]
pub struct SharedRead<T> {
    /// Numbers the callers in the order they arrived.
    arrivals: AtomicU64,
    /// Held while a read is out. The last read's result, with the number of callers that had
    /// arrived when it began (those may take it).
    last: tokio::sync::Mutex<Option<(u64, T)>>,
}

impl<T> Default for SharedRead<T> {
    fn default() -> Self {
        Self {
            arrivals: AtomicU64::new(0),
            last: tokio::sync::Mutex::new(None),
        }
    }
}

impl<T: Clone> SharedRead<T> {
    /// The value `read` returns, from a read that began after this call did: the last one
    /// if it qualifies, else a new one.
    pub async fn read<F: Future<Output = T>>(&self, read: impl FnOnce() -> F) -> T {
        let ticket = self.arrivals.fetch_add(1, AtomicOrdering::SeqCst);
        let mut last = self.last.lock().await;
        if let Some((arrived_before, value)) = &*last {
            if ticket < *arrived_before {
                return value.clone();
            }
        }
        // Every caller numbered below this had arrived before this read begins.
        let arrived_before = self.arrivals.load(AtomicOrdering::SeqCst);
        let value = read().await;
        *last = Some((arrived_before, value.clone()));
        value
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn one_caller_at_a_time_reads_every_time() {
        let shared = SharedRead::default();
        let reads = AtomicUsize::new(0);
        for i in 0..3 {
            let value = shared
                .read(|| async {
                    reads.fetch_add(1, Ordering::SeqCst);
                    i
                })
                .await;
            assert_eq!(value, i, "never a read older than the call");
        }
        assert_eq!(reads.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_arriving_during_a_read_share_the_next_and_never_an_older_one() {
        // The value is a version that a writer bumps; a read returns the version current when
        // it began, after a pause (a round trip).
        let version = Arc::new(AtomicU64::new(0));
        let reads = Arc::new(AtomicUsize::new(0));
        let shared = Arc::new(SharedRead::default());
        let call = |shared: Arc<SharedRead<u64>>| {
            let (version, reads) = (Arc::clone(&version), Arc::clone(&reads));
            async move {
                shared
                    .read(|| async move {
                        reads.fetch_add(1, Ordering::SeqCst);
                        let seen = version.load(AtomicOrdering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(30)).await;
                        seen
                    })
                    .await
            }
        };
        let first = tokio::spawn(call(Arc::clone(&shared)));
        tokio::time::sleep(Duration::from_millis(10)).await;
        // A change made while the first read is out: callers arriving now must see it.
        version.store(1, AtomicOrdering::SeqCst);
        let later: Vec<_> = (0..20)
            .map(|_| tokio::spawn(call(Arc::clone(&shared))))
            .collect();
        assert_eq!(first.await.unwrap(), 0);
        for caller in later {
            assert_eq!(
                caller.await.unwrap(),
                1,
                "a read that began before the caller"
            );
        }
        let reads = reads.load(Ordering::SeqCst);
        assert!((2..=3).contains(&reads), "21 callers took {reads} reads");
    }

    #[tokio::test]
    async fn a_caller_cancelled_mid_read_leaves_the_next_to_read() {
        let shared = SharedRead::default();
        let cancelled = tokio::time::timeout(
            Duration::from_millis(10),
            shared.read(std::future::pending::<u32>),
        )
        .await;
        assert!(cancelled.is_err());
        assert_eq!(shared.read(|| async { 7 }).await, 7);
    }

    #[tokio::test]
    async fn one_caller_gets_batches_of_one() {
        let batches = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = Arc::clone(&batches);
        let group = GroupCommit::spawn(8, move |requests: Vec<u32>| {
            seen.lock().unwrap().push(requests.len());
            async move { requests.into_iter().map(|r| r * 10).collect() }
        });
        for i in 0..3 {
            assert_eq!(group.submit(i).await, Ok(i * 10));
        }
        assert_eq!(*batches.lock().unwrap(), [1, 1, 1]);
    }

    #[tokio::test]
    async fn requests_queued_during_a_commit_share_the_next_one() {
        let commits = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&commits);
        let group = GroupCommit::spawn(100, move |requests: Vec<u32>| {
            counted.fetch_add(1, Ordering::SeqCst);
            async move {
                // A slow commit: everything submitted meanwhile waits for the next one.
                tokio::time::sleep(Duration::from_millis(50)).await;
                requests
            }
        });
        let calls: Vec<_> = (0..20)
            .map(|i| {
                let group = group.clone();
                tokio::spawn(async move { group.submit(i).await })
            })
            .collect();
        for (i, call) in calls.into_iter().enumerate() {
            assert_eq!(call.await.unwrap(), Ok(u32::try_from(i).unwrap()));
        }
        let commits = commits.load(Ordering::SeqCst);
        assert!(
            (1..=3).contains(&commits),
            "20 concurrent requests took {commits} commits"
        );
    }

    #[tokio::test]
    async fn batches_are_capped_and_answers_keep_their_order() {
        let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = Arc::clone(&sizes);
        let group = GroupCommit::spawn(4, move |requests: Vec<u32>| {
            seen.lock().unwrap().push(requests.len());
            async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                requests.into_iter().map(|r| r + 1).collect()
            }
        });
        let calls: Vec<_> = (0..10)
            .map(|i| {
                let group = group.clone();
                tokio::spawn(async move { group.submit(i).await })
            })
            .collect();
        for (i, call) in calls.into_iter().enumerate() {
            assert_eq!(call.await.unwrap(), Ok(u32::try_from(i).unwrap() + 1));
        }
        assert!(sizes.lock().unwrap().iter().all(|&n| (1..=4).contains(&n)));
    }

    #[tokio::test]
    async fn a_panicking_commit_fails_its_batch_only() {
        let group = GroupCommit::spawn(4, |requests: Vec<u32>| async move {
            assert!(requests != [13], "unlucky");
            requests
        });
        assert_eq!(group.submit(13).await, Err(GroupCommitClosed));
        assert_eq!(group.submit(14).await, Ok(14));
    }

    #[tokio::test]
    async fn a_missing_answer_is_an_error_not_a_hang() {
        let group = GroupCommit::spawn(4, |_: Vec<u32>| async { Vec::<u32>::new() });
        assert_eq!(group.submit(1).await, Err(GroupCommitClosed));
    }
}
