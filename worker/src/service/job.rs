//! The pipeline of one job: a delivery from a runs queue, taken from decode to settlement.
//! [`Core`] is the worker's shared state; each delivery runs [`Core::handle_job`] on its own
//! task (spawned by the jobs loop), which gathers the facts, asks the pure rules
//! (`decisions`) what they mean, and applies the answer.
//!
//! # One job
//!
//! ```text
//!  delivery ─decode─▶ RunJob ──(bad body: dead-letter via ErrorCode::disposition)
//!     │
//!     ▼ reserve run_id on this worker ── already active here ──────────────▶ ack (duplicate)
//!     ▼ begin_run: acquire lease:<run_id>, read the cancel flag and the session (one round trip)
//!     │   └─ held by a live worker (kept after waiting one lease TTL for it
//!     │      to lapse) ───────────────────────────────────────────────────▶ ack (duplicate)
//!     ▼ claim queued → running ── lost ─▶ decide_claim_lost(status, handed off?)
//!     │                                     ├─ terminal / no run / handed off ─▶ ack (drop)
//!     │                                     └─ running, not handed off ─▶ finalize `interrupted`
//!     │                                        (item + status in one ledger commit, then published)
//!     ▼ cancel flag set? deadline passed? runner missing? ─▶ terminal run.failed, seq 1
//!     ▼ start on the RunnerHost; heartbeat renews the lease (missing while the run is still
//!     │ ours ─▶ re-established with the run's session; held by another ─▶ cancel the run)
//!     ▼ hand every item (seq 1, 2, 3, …, exactly one terminal) on, ready items together: to
//!     │ the worker's result outlet (the result sink in this process, `outlet`) when it has
//!     │ one, else — or when the outlet refuses them — published to switchboard.results in
//!     │ one confirmed batch; failures retried in order
//!     ▼ terminal: the session ends first (Host API calls refused; steering.dropped audits),
//!     │ then the last items are handed on, then end_run: drop the cancel flag, mark the run
//!     │ handed off, release the lease (one round trip) ─▶ ack
//! ```
//!
//! # Why the lease comes before the claim
//! A run that is `running` in the ledger while nobody holds its lease was abandoned by a dead
//! worker. If the claim came first there would be a moment where our own fresh claim looks
//! exactly like that to a duplicate delivery, which would then finalize a live run as
//! `interrupted`. Taking the lease first closes the window: whoever holds the lease owns the
//! decision.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use sb_common::bus::consumer::{ConsumeLoop, settle};
use sb_common::bus::topology::Topology;
use sb_common::bus::{Bus, Delivery, Outgoing, QueueSpec, Settlement};
use sb_common::config::WorkerConfig;
use sb_common::retry::RetryPolicy;
use sb_common::session::{
    RUN_HANDED_OFF_TTL, RunBegin, SessionError, SessionStore, run_handed_off_key,
};
use sb_common::telemetry::{Metrics, names};
use sb_lifecycle::{FinalizeError, Finalizer, HandOver, Origin, RunRef, SessionEnd};
use sb_protocol::error::{ErrorCode, HasErrorCode, run_failure};
use sb_protocol::ids::RunId;
use sb_protocol::manifest::RunnerId;
use sb_protocol::messages::{ResultMessage, RunJob, decode};
use sb_protocol::result::{AgentRunResult, ResultLimits};
use sb_store::{EventLog, RunLedger, RunOutcome, RunStatus};
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument as _;

use super::claims::Claims;
use super::decisions::{
    ClaimLost, PreStart, cancel_reason, decide_claim_lost, decide_pre_start, result_bodies,
    result_messages, settlement_for, terminal_status,
};
use super::deps::WorkerDeps;
use super::lease::{HeartbeatRun, heartbeat, lease_key};
use crate::lock::lock;
use crate::outlet::{OutletError, ResultOutlet};
use crate::runner::{RunHandle, RunRequest, RunnerHost};
use crate::sequencer::{RunItem, RunSequencer};

/// Most result items taken from a run for one publish. A burst (a runner that streams a
/// whole reply at once) leaves in as few messages as this allows: each message is a
/// confirmed quorum-queue write, a sink transaction and a delivery, so 200 deltas cost one of
/// each instead of four (measured: cluster streamed items/s 19,966 → 21,566–22,646, broker
/// CPU per 200-item run 3.5 → 2.9 ms). Bodies stay under
/// [`BATCH_BYTES_MAX`](super::decisions::BATCH_BYTES_MAX) whatever the count.
const MAX_BATCH: usize = 256;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Cancel requests of the runs this worker holds: run id → latest reason (`None` = none yet).
type ActiveRuns = Arc<Mutex<HashMap<RunId, watch::Sender<Option<String>>>>>;

/// Shared state of one worker.
pub(super) struct Core {
    id: String,
    bus: Arc<dyn Bus>,
    sessions: Arc<dyn SessionStore>,
    ledger: Arc<dyn RunLedger>,
    /// The claims, in commits shared by the jobs received together.
    claims: Claims,
    /// Where the runs' items go when not by the results queue (see [`ResultOutlet`]).
    outlet: Option<Arc<dyn ResultOutlet>>,
    /// Audit rows (`steering.dropped`).
    events: Arc<dyn EventLog>,
    topology: Topology,
    pub(super) config: WorkerConfig,
    /// Delays between attempts while the bus (publishing results) or the ledger (claiming a
    /// run) fails: the configuration's `[retry]`.
    retry: RetryPolicy,
    pub(super) hosts: HashMap<RunnerId, RunnerHost>,
    active: ActiveRuns,
    /// The root shutdown token: stop taking work.
    pub(super) stop: CancellationToken,
    /// Cancelled at the very end of the drain: abandon whatever is still running.
    pub(super) force: CancellationToken,
    metrics: &'static Metrics,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// A run id reserved on this worker. Dropping it frees the reservation.
struct Reservation {
    run_id: RunId,
    /// When this worker took the job: the start of `sb_run_duration_seconds`.
    claimed_at: std::time::Instant,
    active: ActiveRuns,
    cancel_tx: watch::Sender<Option<String>>,
    cancel_rx: watch::Receiver<Option<String>>,
    /// Set once [`Core::end_run`] released the run lease with the session's end, so that
    /// `process` does not release it a second time (one round trip fewer per run).
    lease_released: bool,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        lock(&self.active).remove(&self.run_id);
        Metrics::global().gauge_add(names::RUNS_ACTIVE, &[], -1.0);
    }
}

/// Outcome of waiting for a run's lease.
enum LeaseWait {
    Acquired(Begun),
    HeldBy(String),
    Stopped,
    Failed(SessionError),
}

/// What the worker read with the run lease ([`SessionStore::begin_run`]).
struct Begun {
    /// The reason the run's cancel flag gave, if it was set.
    cancel_flag: Option<String>,
    /// The run's session as the orchestrator stored it: what the heartbeat puts back if the
    /// store loses it (see [`heartbeat`]). Read with the lease so that keeping it costs no
    /// round trip of its own; the job does not carry it (only its digest of the Host API
    /// token is in it, and the frozen grants must be exactly the orchestrator's).
    session: Option<Value>,
}

/// How streaming a run ended.
enum Streamed {
    /// The runner ended the run: these items, the last one terminal, are still to be handed
    /// on ([`Core::end_with`]); `first` when they include the run's first item.
    Ending { items: Vec<RunItem>, first: bool },
    /// The handle closed without a terminal item (it does not: it ends after one).
    Closed,
    /// The drain gave up on the run.
    Forced,
}

impl Core {
    /// The state of worker `id` over `deps`, hosting `hosts` and handing its runs' items to
    /// `outlet` (`None`: the results queue); `stop` is the root shutdown token.
    pub(super) fn new(
        id: String,
        deps: WorkerDeps,
        config: WorkerConfig,
        hosts: HashMap<RunnerId, RunnerHost>,
        outlet: Option<Arc<dyn ResultOutlet>>,
        stop: CancellationToken,
    ) -> Self {
        Self {
            outlet,
            claims: Claims::start(Arc::clone(&deps.stores.runs), id.clone()),
            id,
            retry: deps.config.retry.policy(),
            bus: deps.bus,
            sessions: deps.sessions,
            ledger: deps.stores.runs,
            events: deps.stores.events,
            topology: deps.topology,
            config,
            hosts,
            active: Arc::new(Mutex::new(HashMap::new())),
            stop,
            force: CancellationToken::new(),
            metrics: Metrics::global(),
        }
    }

    pub(super) fn active_ids(&self) -> Vec<RunId> {
        let mut ids: Vec<RunId> = lock(&self.active).keys().copied().collect();
        ids.sort_by_key(ToString::to_string);
        ids
    }

    fn reserve(&self, run_id: RunId) -> Option<Reservation> {
        let mut active = lock(&self.active);
        if active.contains_key(&run_id) {
            return None;
        }
        let (cancel_tx, cancel_rx) = watch::channel(None);
        active.insert(run_id, cancel_tx.clone());
        self.metrics.gauge_add(names::RUNS_ACTIVE, &[], 1.0);
        Some(Reservation {
            run_id,
            claimed_at: std::time::Instant::now(),
            active: self.active.clone(),
            cancel_tx,
            cancel_rx,
            lease_released: false,
        })
    }

    /// Records a cancel request for a held run (the first reason is kept). `false` if the run
    /// is not held here.
    pub(super) fn request_cancel(&self, run_id: RunId, reason: String) -> bool {
        match lock(&self.active).get(&run_id) {
            Some(tx) => {
                tx.send_if_modified(|current| {
                    if current.is_none() {
                        *current = Some(reason);
                        true
                    } else {
                        false
                    }
                });
                true
            }
            None => false,
        }
    }

    /// Handles one delivery from a runs queue, start to settlement.
    pub(super) async fn handle_job(
        self: Arc<Self>,
        queue: String,
        delivery: Delivery,
        _slot: OwnedSemaphorePermit,
    ) {
        let settlement = match decode::<RunJob>(&delivery.body) {
            Ok(job) if job.context.run_id != job.run_id => {
                tracing::warn!(run_id = %job.run_id, context_run_id = %job.context.run_id, "run job whose context names another run");
                settlement_for(ErrorCode::InvalidArgument)
            }
            Ok(job) => {
                let span =
                    tracing::info_span!("run", run_id = %job.run_id, runner_id = %job.runner_id);
                self.process(&job).instrument(span).await
            }
            Err(error) => {
                tracing::warn!(%error, routing_key = %delivery.routing_key, "undecodable run job");
                settlement_for(error.code())
            }
        };
        settle(delivery, settlement, &queue, &self.retry, &self.stop).await;
    }

    /// The shared consume loop ([`ConsumeLoop`]) over `queue` on this worker's bus, with the
    /// configured `[retry]` delays.
    pub(super) fn consume_loop<'a>(
        &'a self,
        queue: &'a QueueSpec,
        prefetch: u16,
        max_batch: usize,
    ) -> ConsumeLoop<'a> {
        ConsumeLoop {
            bus: self.bus.as_ref(),
            queue,
            prefetch,
            max_batch,
            retry: self.retry,
        }
    }

    /// The configured retry policy (`[retry]`): the consume loops' resubscribe and requeue
    /// delays.
    pub(super) fn retry(&self) -> RetryPolicy {
        self.retry
    }

    async fn process(&self, job: &RunJob) -> Settlement {
        let run_id = job.run_id;
        let Some(mut reservation) = self.reserve(run_id) else {
            tracing::info!("duplicate delivery of a run active on this worker; dropped");
            return Settlement::Ack;
        };
        let begun = match self.take_lease(run_id).await {
            LeaseWait::Acquired(begun) => begun,
            LeaseWait::HeldBy(holder) => {
                tracing::info!(%holder, "run is held by another live worker; duplicate job dropped");
                return Settlement::Ack;
            }
            LeaseWait::Stopped => return Settlement::Nack { requeue: true },
            LeaseWait::Failed(error) => {
                tracing::warn!(%error, "cannot take the run lease");
                return settlement_for(error.code());
            }
        };
        let settlement = self.with_lease(job, &mut reservation, begun).await;
        if !reservation.lease_released {
            match self
                .sessions
                .release_lease(&lease_key(&run_id), &self.id)
                .await
            {
                Ok(_) => {}
                // It expires on its own; a redelivery meanwhile waits for that.
                Err(error) => tracing::warn!(%error, "releasing the run lease failed"),
            }
        }
        settlement
    }

    /// Takes the run lease, reading the run's cancel flag and session with it
    /// ([`SessionStore::begin_run`], one round trip). The flag is read after the run was
    /// reserved here, so a cancel set later still reaches the run: its cancel message follows
    /// the flag and finds the reservation. If another holder has the lease, waits up to one
    /// lease TTL (plus a heartbeat) for it to lapse: a worker that crashed a moment ago still
    /// holds its lease when the broker redelivers its job, while a live holder keeps renewing
    /// it.
    async fn take_lease(&self, run_id: RunId) -> LeaseWait {
        let ttl = self.config.lease_ttl;
        let give_up = tokio::time::Instant::now() + ttl + self.config.heartbeat_interval;
        let mut logged = false;
        loop {
            let holder = match self.sessions.begin_run(&run_id, &self.id, ttl).await {
                Ok(RunBegin::Leased {
                    cancel_flag,
                    session,
                }) => {
                    return LeaseWait::Acquired(Begun {
                        cancel_flag: cancel_flag.as_deref().map(cancel_reason),
                        session,
                    });
                }
                Ok(RunBegin::HeldBy(holder)) => holder,
                Err(error) => return LeaseWait::Failed(error),
            };
            if tokio::time::Instant::now() >= give_up {
                return LeaseWait::HeldBy(holder);
            }
            if !logged {
                tracing::info!(%holder, "run lease is held by another worker; waiting to see whether it lapses");
                logged = true;
            }
            tokio::select! {
                biased;
                () = self.stop.cancelled() => return LeaseWait::Stopped,
                () = tokio::time::sleep(self.config.heartbeat_interval) => {}
            }
        }
    }

    async fn with_lease(
        &self,
        job: &RunJob,
        reservation: &mut Reservation,
        begun: Begun,
    ) -> Settlement {
        let run_id = job.run_id;
        // While the ledger is unreachable the claim is retried here, holding the job: a
        // requeue per failure would spend the runs queue's delivery limit within seconds and
        // dead-letter the job of a run that then stays `queued` (found by the chaos suite's
        // `restart_postgres`).
        let mut retry = self.retry.start();
        loop {
            let claimed = match self.claims.claim(run_id).await {
                Ok(claimed) => claimed,
                Err(closed) => return settlement_for(closed.code()),
            };
            match claimed {
                Ok(true) => break,
                Ok(false) => return self.on_claim_lost(job, reservation).await,
                Err(error) if error.is_transient() => {
                    let delay = retry.next_delay();
                    tracing::warn!(%error, retry_in_ms = delay.as_millis() as u64, "claiming the run failed; the ledger is unreachable, retrying");
                    tokio::select! {
                        biased;
                        () = self.stop.cancelled() => return settlement_for(error.code()),
                        () = tokio::time::sleep(delay) => {}
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "claiming the run failed");
                    return settlement_for(error.code());
                }
            }
        }
        tracing::debug!("run claimed");
        self.execute(job, reservation, begun).await
    }

    async fn on_claim_lost(&self, job: &RunJob, reservation: &mut Reservation) -> Settlement {
        let run_id = job.run_id;
        let record = match self.ledger.get_run(run_id).await {
            Ok(record) => record,
            Err(error) => {
                tracing::warn!(%error, "reading the run after a lost claim failed");
                return settlement_for(error.code());
            }
        };
        let status = record.as_ref().map(|r| r.status);
        let handed_off = if status == Some(RunStatus::Running) {
            match self.sessions.get(&run_handed_off_key(&run_id)).await {
                Ok(mark) => mark.is_some(),
                Err(error) => {
                    tracing::warn!(%error, "reading the run's hand-off mark failed");
                    return settlement_for(error.code());
                }
            }
        } else {
            false
        };
        match decide_claim_lost(status, handed_off) {
            ClaimLost::Drop(reason) => {
                tracing::info!(status = ?status, reason, "job for a run that cannot start here dropped");
                Settlement::Ack
            }
            ClaimLost::Retry => {
                tracing::warn!(status = ?status, "claim lost but the run is still queued; retrying later");
                Settlement::Nack { requeue: true }
            }
            ClaimLost::Interrupt => self.finalize_interrupted(job, reservation).await,
        }
    }

    /// A redelivered job of a run that started on a worker that is gone: never re-executed,
    /// it ends `interrupted` through the one finalize ([`Finalizer::finalize`]): the terminal
    /// item and the status in one ledger commit (a stream reader never sees the status
    /// without the item, and the item takes the first free sequence even if the lost
    /// worker's last results are still in flight), then the run's session and this worker's
    /// lease end (the ledger already says how the run ended, so the lease protects nothing
    /// any more), then the item is published to the result sink, which applies its side
    /// effects and delivers it (it finds it stored as is). A run whose own terminal item is
    /// already stored ends with that one, published again the same way.
    async fn finalize_interrupted(
        &self,
        job: &RunJob,
        reservation: &mut Reservation,
    ) -> Settlement {
        let message = "the worker executing the run was lost";
        let outcome =
            RunOutcome::with_error(RunStatus::Interrupted, run_failure::INTERRUPTED, message);
        let result = AgentRunResult::run_failed(
            run_failure::INTERRUPTED,
            message,
            run_failure::default_retryable(run_failure::INTERRUPTED),
        );
        let hand_over = PublishToSink { core: self, job };
        let ended = self
            .finalizer()
            .finalize(
                run_ref(job),
                outcome,
                result,
                self.session_end(),
                &hand_over,
            )
            .await;
        match ended {
            Ok(Some(ended)) => {
                reservation.lease_released = ended.session_answered;
                tracing::warn!(
                    sequence = ended.sequence,
                    origin = ended.origin.as_str(),
                    "run was interrupted by the loss of its worker; finalized"
                );
                Settlement::Ack
            }
            Ok(None) => {
                tracing::info!("run was finished concurrently; nothing to finalize");
                Settlement::Ack
            }
            Err(FinalizeError::Ledger(error)) => {
                tracing::warn!(%error, "finalizing the interrupted run failed");
                settlement_for(error.code())
            }
            Err(FinalizeError::HandOver { ended, .. }) => {
                reservation.lease_released = ended.session_answered;
                // Forced drain: the ledger already holds the terminal item, so the
                // redelivery finds it stored and publishes it again.
                Settlement::Nack { requeue: true }
            }
        }
    }

    /// The stores a run's end writes to ([`sb_lifecycle`]).
    fn finalizer(&self) -> Finalizer<'_> {
        Finalizer {
            ledger: self.ledger.as_ref(),
            events: self.events.as_ref(),
            sessions: self.sessions.as_ref(),
        }
    }

    /// How this worker ends the session of a run it holds: with its lease, marking the run
    /// handed off to the result sink.
    fn session_end(&self) -> SessionEnd<'_> {
        SessionEnd::Holder {
            holder: &self.id,
            handed_off_ttl: RUN_HANDED_OFF_TTL,
        }
    }

    /// The run is claimed: execute it and publish its results.
    async fn execute(
        &self,
        job: &RunJob,
        reservation: &mut Reservation,
        begun: Begun,
    ) -> Settlement {
        let run_id = job.run_id;
        let host = self.hosts.get(&job.runner_id);
        let requested = reservation.cancel_rx.borrow_and_update().clone();
        let cancel_reason = requested.or(begun.cancel_flag);
        let pre = decide_pre_start(cancel_reason, job.deadline_at_ms, now_ms(), host.is_some());
        let host = match (pre, host) {
            (None, Some(host)) => host,
            (pre, _) => {
                let pre = pre.unwrap_or(PreStart::RunnerMissing);
                tracing::info!(reason = ?pre, "run ends before it starts");
                let result = pre.result(&job.runner_id, &job.pool);
                return self.finish_unstarted(job, reservation, result).await;
            }
        };

        // The job's workspace is the orchestrator's (the one the session was authorized in);
        // it picks the shared process the run may go to.
        let mut request =
            RunRequest::new(job.context.clone()).in_workspace(job.workspace_id.clone());
        request.run_id = run_id;
        if let Some(ms) = job.deadline_at_ms {
            request.deadline =
                Some(UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
        }
        let mut handle = match host.start_run(request).await {
            Ok(handle) => handle,
            Err(error) => {
                tracing::error!(%error, "runner could not start the run");
                let result = AgentRunResult::run_failed(
                    run_failure::RUNNER_ERROR,
                    format!("the runner could not be started: {error}"),
                    error.code().is_retryable(),
                );
                return self.finish_unstarted(job, reservation, result).await;
            }
        };
        tracing::debug!("run started");
        let heartbeat = AbortOnDropHandle::new(tokio::spawn(
            heartbeat(
                self.sessions.clone(),
                self.ledger.clone(),
                HeartbeatRun {
                    run_id,
                    holder: self.id.clone(),
                    session: begun.session,
                    ttl: self.config.lease_ttl,
                    interval: self.config.heartbeat_interval,
                },
                reservation.cancel_tx.clone(),
            )
            .in_current_span(),
        ));
        let streamed = self.stream(job, &mut handle, reservation).await;
        // Stopped (not only told to stop) before the lease is released: a renewal racing the
        // release would find the lease missing and could take it back for an ended run.
        heartbeat.abort();
        let _ = heartbeat.await;
        match streamed {
            Streamed::Ending { items, first } => {
                let started = Started {
                    first,
                    claimed_at: reservation.claimed_at,
                };
                self.end_with(job, reservation, items, Some(started)).await
            }
            Streamed::Closed => {
                self.end_run(job, reservation).await;
                Settlement::Ack
            }
            Streamed::Forced => {
                tracing::warn!("run abandoned by the forced drain; its job is requeued");
                // Dropping the handle cancels the run in the runner host.
                drop(handle);
                Settlement::Nack { requeue: true }
            }
        }
    }

    /// Ends a run whose runner never started: publishes the host-made terminal `result` as its
    /// only item (numbered by [`RunSequencer`] like every item), then ends the run.
    async fn finish_unstarted(
        &self,
        job: &RunJob,
        reservation: &mut Reservation,
        result: AgentRunResult,
    ) -> Settlement {
        let items = RunSequencer::new(job.run_id, ResultLimits::default())
            .end_with(result)
            .into_iter()
            .collect();
        self.end_with(job, reservation, items, None).await
    }

    /// Ends a run with its last `items` (the last one terminal): closes the run's Host API
    /// first (its session ends and its unpulled steering is audited), then hands the items
    /// on, then ends the run's execution here ([`Self::end_run`]). The order is the
    /// guarantee that a run whose end can be seen (in the ledger, on a stream) no longer
    /// answers its token: the sink stores the terminal item, and may deliver it, before this
    /// worker hears back from its hand-over. The run is marked handed off only after the
    /// items are handed on, so a worker lost in between leaves a run without the mark: its
    /// redelivered job finalizes it `interrupted` ([`decide_claim_lost`]), as the reaper does
    /// once the lease lapses. `started` when a runner ran it: its first-result and duration
    /// metrics are observed once the items are handed on.
    async fn end_with(
        &self,
        job: &RunJob,
        reservation: &mut Reservation,
        items: Vec<RunItem>,
        started: Option<Started>,
    ) -> Settlement {
        let status = items
            .last()
            .filter(|item| item.is_terminal())
            .map(|item| terminal_status(&item.result));
        self.finalizer()
            .end_session(run_ref(job), SessionEnd::Host)
            .await;
        if !self.publish_items(job, items).await {
            tracing::warn!(
                "run abandoned by the forced drain before its end was handed on; its job is requeued"
            );
            return Settlement::Nack { requeue: true };
        }
        if let Some(started) = started {
            if started.first {
                self.observe_first_result(job);
            }
            if let Some(status) = status {
                self.metrics.observe(
                    names::RUN_DURATION_SECONDS,
                    &[("status", status)],
                    started.claimed_at.elapsed().as_secs_f64(),
                );
            }
        }
        self.end_run(job, reservation).await;
        Settlement::Ack
    }

    /// Observes the time from the event's acceptance to the run's first item handed on.
    fn observe_first_result(&self, job: &RunJob) {
        if let Some(accepted) = job.accepted_at_ms {
            let seconds = (now_ms() - accepted).max(0) as f64 / 1000.0;
            self.metrics
                .observe(names::RUN_FIRST_RESULT_SECONDS, &[], seconds);
        }
    }

    /// Forwards cancel requests to the run and publishes its items as they come.
    async fn stream(
        &self,
        job: &RunJob,
        handle: &mut RunHandle,
        reservation: &mut Reservation,
    ) -> Streamed {
        let mut cancel_open = true;
        let mut first_published = false;
        loop {
            tokio::select! {
                biased;
                () = self.force.cancelled() => return Streamed::Forced,
                changed = reservation.cancel_rx.changed(), if cancel_open => match changed {
                    Ok(()) => {
                        if let Some(reason) = reservation.cancel_rx.borrow_and_update().clone() {
                            tracing::info!(%reason, "cancelling the run");
                            handle.cancel(reason);
                        }
                    }
                    Err(_) => cancel_open = false,
                },
                item = handle.next() => {
                    let Some(first) = item else {
                        // The handle ends only after its terminal item, which returned below.
                        return Streamed::Closed;
                    };
                    let batch = self.gather(handle, first).await;
                    if batch.last().is_some_and(RunItem::is_terminal) {
                        return Streamed::Ending { items: batch, first: !first_published };
                    }
                    if !self.publish_items(job, batch).await {
                        return Streamed::Forced;
                    }
                    if !first_published {
                        first_published = true;
                        self.observe_first_result(job);
                    }
                }
            }
        }
    }

    /// The items to publish with `first`: what the run has ready, then whatever follows
    /// within `worker.result_linger` of `first`, up to a terminal item or [`MAX_BATCH`]
    /// items. The linger is short and bounded, so a cancel or a forced drain waits at most
    /// that long to be seen.
    async fn gather(&self, handle: &mut RunHandle, first: RunItem) -> Vec<RunItem> {
        let deadline = tokio::time::Instant::now() + self.config.result_linger;
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH && !batch.last().is_some_and(RunItem::is_terminal) {
            // `timeout_at` polls the item first, so what is ready is taken even once the
            // deadline has passed (or with a zero linger).
            match tokio::time::timeout_at(deadline, handle.next()).await {
                Ok(Some(item)) => batch.push(item),
                Ok(None) | Err(_) => break,
            }
        }
        batch
    }

    /// Hands `items` (consecutive items of `job`'s run, ascending) on: to the worker's
    /// [`ResultOutlet`] when it has one, retrying while it is unavailable; else, or when the
    /// outlet refuses them, to the results queue ([`Self::publish_messages`]). `false` only
    /// if the forced drain gave up while they could not be handed on.
    async fn publish_items(&self, job: &RunJob, items: Vec<RunItem>) -> bool {
        let conversation = job
            .context
            .conversation
            .as_ref()
            .and_then(|c| c.conversation_id.clone());
        let messages = result_messages(job, conversation, items);
        if let Some(outlet) = &self.outlet {
            let mut retry = self.retry.start();
            let mut retried = false;
            loop {
                match outlet.hand_over(&messages, retried).await {
                    Ok(()) => return true,
                    Err(OutletError::Refused(reason)) => {
                        tracing::warn!(%reason, "the result outlet refused the items; publishing them to the results queue");
                        break;
                    }
                    Err(OutletError::Unavailable(error)) => {
                        let delay = retry.next_delay();
                        tracing::warn!(%error, retry_in_ms = delay.as_millis() as u64, "handing run results over failed; retrying");
                        if !self.pause_to_retry("hand_over_failed", delay).await {
                            return false;
                        }
                        retried = true;
                    }
                }
            }
        }
        self.publish_messages(&messages).await
    }

    /// Publishes `messages` (consecutive items of one run, ascending) to the results queue, in
    /// order, as few messages as [`result_bodies`] makes of them (one `switchboard.results/1`
    /// batch per ≤ [`BATCH_BYTES_MAX`](super::decisions::BATCH_BYTES_MAX), or a single
    /// `switchboard.result/1`), with confirms, retrying from the first failed message (later
    /// ones that did land are published again; the result sink keeps the first copy of each
    /// `(run_id, sequence)`). `false` only if the forced drain gave up while the bus kept
    /// failing.
    async fn publish_messages(&self, messages: &[ResultMessage]) -> bool {
        let Some(first) = messages.first() else {
            return true;
        };
        let exchange = self.topology.results_exchange();
        let routing_key = self.topology.results_routing_key(&first.run_id);
        let mut pending: Vec<Outgoing> = result_bodies(messages)
            .into_iter()
            .map(|body| Outgoing::new(exchange.clone(), routing_key.clone(), body))
            .collect();
        let mut retry = self.retry.start();
        loop {
            let count = pending.len();
            let outcome = if count == 1 {
                let m = &pending[0];
                self.bus
                    .publish(&m.exchange, &m.routing_key, m.body.clone(), m.options)
                    .await
                    .map_err(|e| (0, e.to_string()))
            } else {
                self.bus
                    .publish_batch(pending.clone())
                    .await
                    .map_err(|e| (e.failed.first().map_or(0, |(i, _)| *i), e.to_string()))
            };
            match outcome {
                Ok(()) => {
                    self.metrics.add(
                        names::BUS_PUBLISHED_TOTAL,
                        &[("exchange", &exchange)],
                        count as u64,
                    );
                    return true;
                }
                Err((first_failed, error)) => {
                    self.metrics.add(
                        names::BUS_PUBLISHED_TOTAL,
                        &[("exchange", &exchange)],
                        first_failed as u64,
                    );
                    pending.drain(..first_failed.min(pending.len()));
                    let delay = retry.next_delay();
                    tracing::warn!(%error, remaining = pending.len(), retry_in_ms = delay.as_millis() as u64, "publishing run results failed; retrying");
                    if !self.pause_to_retry("publish_failed", delay).await {
                        return false;
                    }
                }
            }
        }
    }

    /// Counts a failed attempt to hand a run's items on (`error_type`) and waits `delay`
    /// before the next one; `false` when the forced drain came first (give up).
    async fn pause_to_retry(&self, error_type: &'static str, delay: Duration) -> bool {
        self.metrics.inc(
            names::ERRORS_TOTAL,
            &[("error_type", error_type), ("stage", "retried")],
        );
        tokio::select! {
            biased;
            () = self.force.cancelled() => false,
            () = tokio::time::sleep(delay) => true,
        }
    }

    /// Ends the run's execution here in one round trip ([`SessionStore::end_run`]), once its
    /// terminal item is handed on: the session ends if [`Self::end_with`] could not end it
    /// (then its unpulled steering is audited here), the cancel flag has done its job, the
    /// run is marked handed off (the reaper must not take a lagging result sink for a lost
    /// worker), and the lease is released.
    async fn end_run(&self, job: &RunJob, reservation: &mut Reservation) {
        if self
            .finalizer()
            .end_session(run_ref(job), self.session_end())
            .await
        {
            reservation.lease_released = true;
        }
        // Otherwise the session and flag expire on their own; until then late Host API calls
        // still pass the gate's session check but the runner host refuses calls for ended
        // runs. `process` still tries to release the lease.
    }
}

/// What [`Core::end_with`] observes of a run a runner executed.
struct Started {
    /// The items it ends with include the run's first.
    first: bool,
    /// When the run was claimed (its duration's start).
    claimed_at: std::time::Instant,
}

/// The run a job executes, as its end names it.
fn run_ref(job: &RunJob) -> RunRef<'_> {
    RunRef {
        run_id: job.run_id,
        runner_id: &job.runner_id,
        workspace_id: &job.workspace_id,
    }
}

/// The worker's hand-over of a finalized run's terminal item: publish it to the result sink
/// (which applies it and delivers it live), as every item of a run the worker executes.
struct PublishToSink<'a> {
    core: &'a Core,
    job: &'a RunJob,
}

/// The result sink could not be reached before the forced drain gave up.
struct Unpublished;

#[async_trait]
impl HandOver for PublishToSink<'_> {
    type Error = Unpublished;

    async fn hand_over(
        &self,
        sequence: u64,
        result: AgentRunResult,
        _origin: Origin,
    ) -> Result<(), Unpublished> {
        let item = RunItem { sequence, result };
        if self.core.publish_items(self.job, vec![item]).await {
            Ok(())
        } else {
            Err(Unpublished)
        }
    }
}
