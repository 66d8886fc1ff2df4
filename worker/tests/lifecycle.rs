//! Cancel, lease loss and drain, with the scripted test runner (`sb-test-runner`).

mod support;

use std::num::NonZeroU32;
use std::time::Duration;

use sb_common::session::SessionStore;
use sb_protocol::result::ResultType;
use sb_worker::service::lease_key;
use std::sync::Arc;

use sb_worker::outlet::{OutletError, ResultOutlet};
use support::{ECHO, Harness, SCRIPTED};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_message_reaches_the_runner_and_ends_the_run_cancelled() {
    let mut h = Harness::start(|_, _| {}).await;
    let job = h.prepare_run(SCRIPTED, "cancellable").await;
    h.publish_job(&job).await;
    let first = h.next_result().await;
    assert_eq!(first.sequence, 1);
    assert_eq!(first.result.data["chunk"]["content"], "waiting for cancel");
    h.publish_cancel(job.run_id, "user pressed stop").await;
    let rest = h.results_until_terminal().await;
    let terminal = rest.last().unwrap();
    assert_eq!(terminal.sequence, 2);
    assert_eq!(terminal.result.known_type(), Some(ResultType::RunFailed));
    assert_eq!(terminal.result.data["code"], "cancelled");
    // The runner's own answer (within the grace period), not the host's fallback.
    assert_eq!(terminal.result.data["error"], "cancelled as asked");
    h.jobs_settled().await;
    assert!(h.sessions.get_session(&job.run_id).await.unwrap().is_none());
    let report = h.stop().await;
    assert!(report.cancelled_runs.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_that_ignores_cancel_is_ended_cancelled_after_the_grace() {
    let mut h = Harness::start(|_, _| {}).await;
    let job = h.prepare_run(SCRIPTED, "stall").await;
    h.publish_job(&job).await;
    // Wait until the run is held (its cancel key bound), then cancel.
    let run_id = job.run_id;
    let sessions = h.sessions.clone();
    let deadline = tokio::time::Instant::now() + support::WAIT;
    while sessions
        .lease_holder(&lease_key(&run_id))
        .await
        .unwrap()
        .is_none()
    {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = tokio::time::Instant::now();
    h.publish_cancel(run_id, "stop it").await;
    let results = h.results_until_terminal().await;
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0].result.data["code"], "cancelled");
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "the runner had its grace period"
    );
    h.jobs_settled().await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_lease_cancels_the_run() {
    let mut h = Harness::start(|_, _| {}).await;
    let job = h.prepare_run(SCRIPTED, "cancellable").await;
    h.publish_job(&job).await;
    assert_eq!(h.next_result().await.sequence, 1);
    // Another holder takes the lease (as after an expiry): the next heartbeat notices.
    let key = lease_key(&job.run_id);
    let worker_id = h.worker().id().to_owned();
    assert!(h.sessions.release_lease(&key, &worker_id).await.unwrap());
    assert!(
        h.sessions
            .acquire_lease(&key, "thief", Duration::from_secs(60))
            .await
            .unwrap()
    );
    let results = h.results_until_terminal().await;
    assert_eq!(results.last().unwrap().result.data["code"], "cancelled");
    h.jobs_settled().await;
    // The lease belongs to the other holder: the worker did not release it.
    assert_eq!(
        h.sessions.lease_holder(&key).await.unwrap().as_deref(),
        Some("thief")
    );
    h.stop().await;
}

/// Issue 15 finding 3: the session store restarts empty (no persistence) while a run is
/// executing. Its worker re-establishes the lease and the run's session and the run completes
/// instead of being cancelled as "lease lost".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_store_that_comes_back_empty_neither_cancels_the_run_nor_loses_its_session() {
    let mut h = Harness::start(|_, _| {}).await;
    // 300 deltas 5 ms apart: about 1.5 s, many heartbeats (100 ms) and lease TTLs (500 ms).
    let job = h.prepare_run(SCRIPTED, "slow 300").await;
    let session = h.sessions.get_session(&job.run_id).await.unwrap().unwrap();
    h.publish_job(&job).await;
    assert_eq!(h.next_result().await.sequence, 1);
    let key = lease_key(&job.run_id);
    let worker_id = h.worker().id().to_owned();
    // The store loses every key of the run: its lease and its session.
    assert!(h.sessions.release_lease(&key, &worker_id).await.unwrap());
    assert!(h.sessions.end_session(&job.run_id).await.unwrap().is_some());
    let sessions = h.sessions.clone();
    let run_id = job.run_id;
    let mut restored = None;
    for _ in 0..50 {
        if let Some(value) = sessions.get_session(&run_id).await.unwrap() {
            restored = Some(value);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        restored,
        Some(session),
        "the worker put the run's session back"
    );
    assert_eq!(
        h.sessions.lease_holder(&key).await.unwrap().as_deref(),
        Some(worker_id.as_str()),
        "the worker took its lease again"
    );
    let results = h.results_until_terminal().await;
    let last = results.last().unwrap();
    assert_eq!(
        last.result.known_type(),
        Some(ResultType::RunCompleted),
        "{:?}",
        last.result
    );
    h.jobs_settled().await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_in_flight_runs_finish_within_the_drain_timeout() {
    let mut h = Harness::start(|_, _| {}).await;
    let job = h.prepare_run(SCRIPTED, "slow 40").await;
    h.publish_job(&job).await;
    assert_eq!(h.next_result().await.sequence, 1);
    h.shutdown.trigger();
    let results = h.results_until_terminal().await;
    assert_eq!(
        results.last().unwrap().result.known_type(),
        Some(ResultType::RunCompleted)
    );
    assert_eq!(results.last().unwrap().sequence, 42);
    let report = h.stop().await;
    assert!(
        report.cancelled_runs.is_empty() && report.forced_runs.is_empty(),
        "{report:?}"
    );
    assert_eq!(h.jobs_in_queue(), (0, 0), "the finished job was acked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cancels_runs_left_at_the_drain_deadline_and_requeues_unstarted_jobs() {
    let mut h = Harness::start(|_, config| {
        config.worker.slots = NonZeroU32::new(1).unwrap();
        config.worker.drain_timeout = Duration::from_millis(300);
    })
    .await;
    let stalled = h.prepare_run(SCRIPTED, "stall").await;
    h.publish_job(&stalled).await;
    let sessions = h.sessions.clone();
    let deadline = tokio::time::Instant::now() + support::WAIT;
    while sessions
        .lease_holder(&lease_key(&stalled.run_id))
        .await
        .unwrap()
        .is_none()
    {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // One slot: this job waits behind the stalled run and never starts.
    let waiting = h.prepare_run(ECHO, "never started").await;
    h.publish_job(&waiting).await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    let report = h.stop().await;
    assert_eq!(report.cancelled_runs, vec![stalled.run_id]);
    assert!(report.forced_runs.is_empty(), "{report:?}");
    let results = h.results_until_terminal().await;
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0].run_id, stalled.run_id);
    assert_eq!(results[0].result.data["code"], "cancelled");
    // The stalled job was settled; the one never started is back in the queue for another
    // worker, its run untouched.
    assert_eq!(h.jobs_in_queue(), (1, 0));
    assert_eq!(
        h.stores
            .runs
            .get_run(waiting.run_id)
            .await
            .unwrap()
            .unwrap()
            .status,
        sb_store::RunStatus::Queued
    );
    assert!(
        h.sessions
            .lease_holder(&lease_key(&stalled.run_id))
            .await
            .unwrap()
            .is_none(),
        "lease released"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_are_published_in_order_after_a_bus_outage() {
    let mut h = Harness::start(|_, _| {}).await;
    let job = h.prepare_run(SCRIPTED, "slow 60").await;
    h.publish_job(&job).await;
    assert_eq!(h.next_result().await.sequence, 1);
    h.flaky
        .fail_results
        .store(true, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(400)).await;
    h.flaky
        .fail_results
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let rest = h.results_until_terminal().await;
    let sequences: Vec<u64> = rest.iter().map(|m| m.sequence).collect();
    assert_eq!(
        sequences,
        (2..=62).collect::<Vec<u64>>(),
        "nothing lost, duplicated or reordered"
    );
    h.jobs_settled().await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_stuck_at_the_drain_deadline_is_forced_and_its_job_finalized_interrupted_elsewhere() {
    let mut h =
        Harness::start(|_, config| config.worker.drain_timeout = Duration::from_millis(300)).await;
    let job = h.prepare_run(SCRIPTED, "stall").await;
    let run_id = job.run_id;
    h.publish_job(&job).await;
    let sessions = h.sessions.clone();
    let deadline = tokio::time::Instant::now() + support::WAIT;
    while sessions
        .lease_holder(&lease_key(&run_id))
        .await
        .unwrap()
        .is_none()
    {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The broker is down: not even the cancelled terminal item can be published.
    h.flaky
        .fail_results
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let report = h.stop().await;
    assert_eq!(report.cancelled_runs, vec![run_id]);
    assert_eq!(report.forced_runs, vec![run_id]);
    assert_eq!(h.jobs_in_queue(), (1, 0), "the forced job was requeued");
    assert!(
        h.sessions
            .lease_holder(&lease_key(&run_id))
            .await
            .unwrap()
            .is_none(),
        "lease released"
    );

    // The broker is back; another worker gets the job and, the run having started, finalizes
    // it instead of running it again.
    h.flaky
        .fail_results
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let (other, other_shutdown) = h.another_worker().await;
    let results = h.results_until_terminal().await;
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0].result.data["code"], "interrupted");
    assert_eq!(
        h.stores.runs.get_run(run_id).await.unwrap().unwrap().status,
        sb_store::RunStatus::Interrupted
    );
    h.jobs_settled().await;
    other_shutdown.trigger();
    other.join().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_held_by_a_live_worker_is_dropped_after_one_lease_ttl() {
    let mut h = Harness::start(|_, _| {}).await;
    let job = h.prepare_run(ECHO, "someone else has it").await;
    let run_id = job.run_id;
    assert!(
        h.stores
            .runs
            .claim_run(run_id, "live-worker")
            .await
            .unwrap()
    );
    let key = lease_key(&run_id);
    assert!(
        h.sessions
            .acquire_lease(&key, "live-worker", Duration::from_millis(500))
            .await
            .unwrap()
    );
    let sessions = h.sessions.clone();
    let renew_key = key.clone();
    let renewer = tokio::spawn(async move {
        loop {
            sessions
                .renew_lease(&renew_key, "live-worker", Duration::from_millis(500))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let started = tokio::time::Instant::now();
    h.publish_job(&job).await;
    h.jobs_settled().await;
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "waited for the lease to lapse first"
    );
    assert!(
        h.no_result_within(Duration::from_millis(200))
            .await
            .is_none()
    );
    assert_eq!(
        h.sessions.lease_holder(&key).await.unwrap().as_deref(),
        Some("live-worker")
    );
    assert_eq!(
        h.stores.runs.get_run(run_id).await.unwrap().unwrap().status,
        sb_store::RunStatus::Running
    );
    renewer.abort();
    h.stop().await;
}

/// An outlet that records what it is handed, answering `Unavailable` to the first
/// `unavailable` hand-overs and refusing everything when `refuse` is set.
#[derive(Default)]
struct RecordingOutlet {
    handed: std::sync::Mutex<Vec<(Vec<u64>, bool)>>,
    unavailable: std::sync::atomic::AtomicUsize,
    refuse: bool,
}

impl RecordingOutlet {
    fn handed(&self) -> Vec<(Vec<u64>, bool)> {
        self.handed.lock().unwrap().clone()
    }
}

#[async_trait::async_trait]
impl ResultOutlet for RecordingOutlet {
    async fn hand_over(
        &self,
        messages: &[sb_protocol::messages::ResultMessage],
        retried: bool,
    ) -> Result<(), OutletError> {
        use std::sync::atomic::Ordering;
        self.handed
            .lock()
            .unwrap()
            .push((messages.iter().map(|m| m.sequence).collect(), retried));
        if self.refuse {
            return Err(OutletError::Refused("not mine (test)".into()));
        }
        let left = self.unavailable.load(Ordering::SeqCst);
        if left > 0 {
            self.unavailable.store(left - 1, Ordering::SeqCst);
            return Err(OutletError::Unavailable("ledger down (test)".into()));
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_an_outlet_hands_its_items_over_in_order_and_again_when_unavailable() {
    let mut h = Harness::start(|_, _| {}).await;
    h.stop().await;
    let outlet = Arc::new(RecordingOutlet {
        unavailable: 1.into(),
        ..RecordingOutlet::default()
    });
    let (worker, shutdown) = h.another_worker_with(Some(outlet.clone())).await;
    let job = h.prepare_run(ECHO, "hello there").await;
    h.publish_job(&job).await;
    // The job is settled only after its terminal item was handed over.
    h.jobs_settled().await;
    let handed = outlet.handed();
    // The first hand-over failed and was made again whole, marked retried.
    assert_eq!(handed[0].0, handed[1].0);
    assert!(!handed[0].1 && handed[1].1, "{handed:?}");
    let taken: Vec<u64> = handed[1..].iter().flat_map(|(s, _)| s.clone()).collect();
    assert_eq!(
        taken,
        (1..=taken.len() as u64).collect::<Vec<_>>(),
        "{handed:?}"
    );
    assert!(
        h.no_result_within(Duration::from_millis(200))
            .await
            .is_none(),
        "nothing was published to the results queue"
    );
    shutdown.trigger();
    worker.join().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_outlet_refuses_is_published_to_the_results_queue() {
    let mut h = Harness::start(|_, _| {}).await;
    h.stop().await;
    let outlet = Arc::new(RecordingOutlet {
        refuse: true,
        ..RecordingOutlet::default()
    });
    let (worker, shutdown) = h.another_worker_with(Some(outlet.clone())).await;
    let job = h.prepare_run(ECHO, "hello there").await;
    h.publish_job(&job).await;
    let results = h.results_until_terminal().await;
    let sequences: Vec<u64> = results.iter().map(|m| m.sequence).collect();
    assert_eq!(sequences, (1..=sequences.len() as u64).collect::<Vec<_>>());
    let handed: Vec<u64> = outlet.handed().into_iter().flat_map(|(s, _)| s).collect();
    assert_eq!(
        handed, sequences,
        "every item was offered to the outlet first"
    );
    h.jobs_settled().await;
    shutdown.trigger();
    worker.join().await;
}

/// What a hand-over saw of its run in the session store when it was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    terminal: bool,
    session: bool,
    lease: bool,
}

/// An outlet that takes everything and records, per hand-over, whether it held the run's
/// terminal item and whether the run's session and lease existed at that moment.
struct SessionProbe {
    sessions: Arc<sb_common::session::memory::MemorySessionStore>,
    seen: std::sync::Mutex<Vec<Seen>>,
}

#[async_trait::async_trait]
impl ResultOutlet for SessionProbe {
    async fn hand_over(
        &self,
        messages: &[sb_protocol::messages::ResultMessage],
        _retried: bool,
    ) -> Result<(), OutletError> {
        let run_id = messages[0].run_id;
        let seen = Seen {
            terminal: messages.iter().any(|m| m.result.is_terminal()),
            session: self.sessions.get_session(&run_id).await.unwrap().is_some(),
            lease: self
                .sessions
                .lease_holder(&lease_key(&run_id))
                .await
                .unwrap()
                .is_some(),
        };
        self.seen.lock().unwrap().push(seen);
        Ok(())
    }
}

/// A run's token must be refused once its end can be seen: the sink stores (and may deliver)
/// the terminal item before the worker hears back from the hand-over, so the session ends
/// before it, while the lease is kept until the item is handed on (a worker lost in between
/// leaves the run to the reaper once the lease lapses). Both ways a run ends here: a runner's
/// own terminal item, and one the host makes before the runner starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_session_ends_before_its_terminal_item_is_handed_on_and_the_lease_after() {
    let mut h = Harness::start(|_, _| {}).await;
    h.stop().await;
    let outlet = Arc::new(SessionProbe {
        sessions: h.sessions.clone(),
        seen: std::sync::Mutex::default(),
    });
    let (worker, shutdown) = h.another_worker_with(Some(outlet.clone())).await;

    let ran = h.prepare_run(ECHO, "hello there").await;
    h.publish_job(&ran).await;
    h.jobs_settled().await;
    let unstarted = h
        .prepare_run("plugin:tests/not-hosted-here/default", "hello")
        .await;
    h.publish_job(&unstarted).await;
    h.jobs_settled().await;

    let seen = outlet.seen.lock().unwrap().clone();
    let terminal: Vec<Seen> = seen.iter().copied().filter(|s| s.terminal).collect();
    assert_eq!(terminal.len(), 2, "{seen:?}");
    for s in &seen {
        assert!(
            s.lease,
            "the lease is held until the end is handed on: {seen:?}"
        );
        assert_eq!(s.session, !s.terminal, "{seen:?}");
    }
    for job in [&ran, &unstarted] {
        let key = lease_key(&job.run_id);
        assert_eq!(h.sessions.lease_holder(&key).await.unwrap(), None);
        assert!(h.sessions.get_session(&job.run_id).await.unwrap().is_none());
    }
    shutdown.trigger();
    worker.join().await;
}
