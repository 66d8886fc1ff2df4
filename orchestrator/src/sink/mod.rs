//! The result sink: one loop per results shard persisting `switchboard.result/1` items and
//! publishing them for live delivery (SPEC §2 step 4).
//!
//! Per batch (up to `sink_batch` deliveries that are ready at once, possibly of many runs):
//!
//! 1. decode; an undecodable body is dead-lettered;
//! 2. insert every item into the ledger in **one call**, idempotently on
//!    `(run_id, sequence)` (the first write wins);
//! 3. in queue order, for each item that is **new** — or that was redelivered, in case a
//!    crash fell between its insert and its side effects — apply its side effects
//!    ([`crate::journal`]): run status on a terminal item (`completed`, `failed(code)`,
//!    `cancelled`, `timeout`, `interrupted`; `running` is the worker's claim; the run also
//!    leaves its conversation's active index, which wakes the next parked event), the assistant
//!    transcript (from the first complete message, or assembled from the deltas at the
//!    terminal item when the runner only streamed), `state.updated` under the run's frozen
//!    policy, `artifact.created` with its checks. Every side effect has a deterministic
//!    identity or is a last-writer-wins write replayed in order, so applying it again is
//!    harmless;
//! 4. publish those items to `switchboard.deliveries` (after the ledger write, so a client
//!    that reads the ledger and then follows live items misses nothing), in queue order;
//!    the items applied so far are published before the side effects of a later item are
//!    written, so a delta is not held back by the transcript and status writes of the
//!    terminal item that arrived in the same batch;
//! 5. ack each delivery once its publish is confirmed.
//!
//! A plain duplicate (the same result published twice) is neither applied nor delivered
//! again, except a terminal item the ledger holds exactly as received: a worker that
//! finalizes a lost run stores its terminal item with the status itself
//! ([`RunLedger::finalize_run`](sb_store::RunLedger::finalize_run)) and then publishes it,
//! and its side effects and live delivery are due (all idempotent). A second terminal item of
//! a run is refused by the ledger and never applied. Host-made ends (reaper, recovery) go
//! through [`ResultSink::finalize`]. When an item fails transiently, it and every later item of the batch are requeued,
//! so a run's items are still applied in sequence order; when it failed because the ledger
//! or the session store is unreachable, they are retried in place instead, until the
//! backend is back (see [`ResultSink::process_batch`]), so an outage never spends their
//! delivery limit. A delivery the bus refuses for good
//! (a non-retryable [`BusError`](sb_common::bus::BusError), e.g. an invalid routing key) is
//! dropped and counted, not requeued: the items are in the ledger, and requeueing would stall
//! the shard and keep the run from finishing.
//!
//! Failures of a *result's own content* (a state update outside the policy, an oversized or
//! mismatching artifact) never fail the message: they are logged and the item is still
//! stored and delivered, as the seed host does (host-behaviour §10, §14).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use sb_common::bus::topology::deliveries_routing_key;
use sb_common::bus::{ConsumeOptions, Delivery, Outgoing, PublishOptions};
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::content::Message;
use sb_protocol::host::AuthorizationSnapshot;
use sb_protocol::ids::RunId;
use sb_protocol::messages::{self, DeliveryBatch, DeliveryMessage, ResultMessage};
use sb_protocol::result::{AgentRunResult, ArtifactCreated, StateUpdated};
use sb_store::{Finalized, NewRunEvent, RunOutcome, RunRecord, StoreError, audit};
use serde_json::Value;

use crate::concurrency::ConversationKey;
use crate::conversations::Conversations;
use crate::deps::{OrchestratorDeps, OrchestratorOptions};
use crate::error::{OrchestratorError, Result};
use crate::journal::{self, Effect, RunInfo};
use crate::lock;
use crate::settle::{pause, settle};

/// Runs whose facts are cached; the cache is cleared when it grows past this (a run's entry
/// is also dropped at its terminal item).
const RUN_CACHE_CAP: usize = 10_000;

/// Persists and delivers results; shared by the shard loops and the reaper.
#[derive(Debug)]
pub struct ResultSink {
    deps: OrchestratorDeps,
    options: Arc<OrchestratorOptions>,
    /// Immutable facts of active runs (from the ledger row), so a streaming run costs one
    /// ledger insert per batch instead of an extra read per item.
    runs: Mutex<HashMap<RunId, Arc<RunInfo>>>,
    /// Frozen authorizations of active runs that updated state (see `authorization`);
    /// bounded and dropped like `runs`.
    authorizations: Mutex<HashMap<RunId, Option<Arc<AuthorizationSnapshot>>>>,
    /// Active runs for which this sink applied a complete assistant message: their terminal
    /// item need not read the run's items back to find out (see `finish`). Bounded like
    /// `runs`; a run missing here is just read back.
    messaged: Mutex<HashSet<RunId>>,
    /// The conversations' active-run index and parked queues: a terminal item takes its run
    /// out of the index and wakes the next parked event.
    conversations: Conversations,
}

/// One result of a batch: a bus delivery holds one (`switchboard.result/1`) or several
/// (`switchboard.results/1`) of them.
struct Item {
    /// Index of its delivery in the batch's deliveries.
    delivery: usize,
    /// Whether the broker delivered that message before (a crash may have fallen between
    /// the item's insert and its side effects).
    redelivered: bool,
    message: ResultMessage,
}

impl ResultSink {
    /// A sink over `deps`.
    #[must_use]
    pub fn new(deps: OrchestratorDeps, options: Arc<OrchestratorOptions>) -> Self {
        let conversations = deps.conversations(&options);
        Self {
            deps,
            options,
            runs: Mutex::new(HashMap::new()),
            authorizations: Mutex::new(HashMap::new()),
            messaged: Mutex::new(HashSet::new()),
            conversations,
        }
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, HashMap<RunId, Arc<RunInfo>>> {
        lock(&self.runs)
    }

    /// The facts of a run, from its ledger row.
    async fn run_info(&self, run_id: RunId) -> Result<Arc<RunInfo>> {
        if let Some(info) = self.cache().get(&run_id) {
            return Ok(Arc::clone(info));
        }
        let run = self
            .deps
            .stores
            .runs
            .get_run(run_id)
            .await?
            .ok_or(OrchestratorError::RunNotFound(run_id))?;
        let info = Arc::new(run_info_from(&run));
        let mut cache = self.cache();
        if cache.len() >= RUN_CACHE_CAP {
            cache.clear();
        }
        cache.insert(run_id, Arc::clone(&info));
        Ok(info)
    }

    /// The run's frozen authorization, kept on its event: read at the run's first state
    /// update only (most runs update no state, and the event row, envelope and snapshot
    /// included, is the largest read of a run), then cached like the run's facts. `None`
    /// when the event holds none.
    async fn authorization(&self, info: &RunInfo) -> Result<Option<Arc<AuthorizationSnapshot>>> {
        if let Some(snapshot) = lock(&self.authorizations).get(&info.run_id) {
            return Ok(snapshot.clone());
        }
        let snapshot = match self.deps.stores.events.get(info.event_id).await? {
            Some(event) => event
                .metadata
                .get("authorization")
                .cloned()
                .and_then(|v| serde_json::from_value::<AuthorizationSnapshot>(v).ok())
                .map(Arc::new),
            None => None,
        };
        if snapshot.is_none() {
            tracing::warn!(run_id = %info.run_id, "no authorization snapshot for the run; state updates will be refused");
        }
        let mut cache = lock(&self.authorizations);
        if cache.len() >= RUN_CACHE_CAP {
            cache.clear();
        }
        cache.insert(info.run_id, snapshot.clone());
        Ok(snapshot)
    }

    /// The run's stored items, ascending (for transcript assembly).
    async fn stored_items(&self, run_id: RunId) -> Result<Vec<(u64, AgentRunResult)>> {
        let mut items = Vec::new();
        let mut after = 0i64;
        loop {
            let page = self
                .deps
                .stores
                .runs
                .events_after(run_id, after, sb_store::runs::MAX_RUN_EVENTS_BATCH)
                .await?;
            let full = page.len() as u64 >= sb_store::runs::MAX_RUN_EVENTS_BATCH;
            for record in page {
                after = record.sequence;
                if let Ok(result) = serde_json::from_value::<AgentRunResult>(record.data) {
                    items.push((u64::try_from(record.sequence).unwrap_or_default(), result));
                }
            }
            if !full {
                return Ok(items);
            }
        }
    }

    /// Applies the side effects of one stored item (see the module docs).
    async fn apply(&self, info: &RunInfo, message: &ResultMessage) -> Result<()> {
        let plan = journal::plan_item(&message.result);
        Metrics::global().inc(
            names::RUN_RESULTS_TOTAL,
            &[("type", result_type_label(&message.result))],
        );
        match &plan.effect {
            Effect::None => {}
            Effect::AssistantMessage(m) => {
                self.write_assistant(info, message.sequence, m).await?;
                let mut messaged = lock(&self.messaged);
                if messaged.len() >= RUN_CACHE_CAP {
                    messaged.clear();
                }
                messaged.insert(info.run_id);
            }
            Effect::State(update) => self.apply_state(info, update).await?,
            Effect::Artifact(created) => {
                self.store_artifact(info, message.sequence, created).await?
            }
        }
        if let Some(outcome) = plan.outcome {
            self.finish(info, outcome).await?;
        }
        Ok(())
    }

    async fn write_assistant(
        &self,
        info: &RunInfo,
        sequence: u64,
        message: &Message,
    ) -> Result<()> {
        if info.conversation_id.is_none() {
            return Ok(());
        }
        let items = self.stored_items(info.run_id).await?;
        let refs = journal::artifact_refs_before(&info.run_id, &items, sequence);
        if let Some(row) = journal::assistant_transcript(info, message, refs) {
            append_once(&self.deps, row).await?;
        }
        Ok(())
    }

    async fn apply_state(&self, info: &RunInfo, update: &StateUpdated) -> Result<()> {
        let Some(snapshot) = self.authorization(info).await? else {
            tracing::warn!(run_id = %info.run_id, key = %update.key, "state.updated ignored: no authorization snapshot");
            return Ok(());
        };
        let write = match journal::plan_state_write(
            &snapshot,
            update,
            self.options.max_state_value_bytes,
        ) {
            Ok(w) => w,
            Err(reason) => {
                tracing::warn!(run_id = %info.run_id, scope = %update.scope, key = %update.key, %reason, "state.updated rejected");
                return Ok(());
            }
        };
        match self.deps.stores.state.set(write).await {
            Ok(_) => Ok(()),
            Err(
                e @ (StoreError::PayloadTooLarge(_)
                | StoreError::InvalidArgument(_)
                | StoreError::Conflict(_)),
            ) => {
                tracing::warn!(run_id = %info.run_id, key = %update.key, reason = %e, "state.updated rejected by the store");
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn store_artifact(
        &self,
        info: &RunInfo,
        sequence: u64,
        created: &ArtifactCreated,
    ) -> Result<()> {
        let artifact = match journal::plan_artifact(
            info,
            sequence,
            created,
            self.options.max_inline_artifact_bytes,
        ) {
            Ok(a) => a,
            Err(reason) => {
                tracing::warn!(run_id = %info.run_id, sequence, %reason, "artifact.created rejected");
                return Ok(());
            }
        };
        let id = artifact.id.clone().unwrap_or_default();
        match self.deps.stores.artifacts.put(artifact.clone()).await {
            Ok(_) => {}
            Err(StoreError::Conflict(_)) => {
                // Stored by an earlier attempt of this item, or an id another run took.
                let ours = match self.deps.stores.artifacts.metadata(&id).await {
                    Ok(existing) => existing.run_id == Some(info.run_id),
                    Err(StoreError::NotFound(_)) => false,
                    Err(e) => return Err(e.into()),
                };
                if !ours {
                    tracing::warn!(run_id = %info.run_id, artifact_id = %id, "artifact.created rejected: the id is taken");
                    return Ok(());
                }
            }
            Err(e @ (StoreError::InvalidArgument(_) | StoreError::PayloadTooLarge(_))) => {
                tracing::warn!(run_id = %info.run_id, artifact_id = %id, reason = %e, "artifact.created rejected by the store");
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        }
        self.deps
            .stores
            .events
            .append(
                journal::artifact_event(info, sequence, &artifact),
                Vec::new(),
            )
            .await?;
        Ok(())
    }

    async fn finish(&self, info: &RunInfo, outcome: RunOutcome) -> Result<()> {
        let status = outcome.status;
        if self
            .deps
            .stores
            .runs
            .finish_run(info.run_id, outcome)
            .await?
        {
            Metrics::global().inc(names::RUNS_TOTAL, &[("status", status.as_str())]);
            tracing::info!(run_id = %info.run_id, status = status.as_str(), "run finished");
        }
        // A runner that only streamed leaves no complete message: the transcript gets the
        // assembled deltas instead (the seed host stored nothing, host-behaviour §26.13).
        let messaged = lock(&self.messaged).remove(&info.run_id);
        if info.conversation_id.is_some() && !messaged {
            let items = self.stored_items(info.run_id).await?;
            if !journal::has_complete_message(&items) {
                if let Some(text) = journal::assembled_deltas(&items) {
                    let refs = journal::artifact_refs_before(&info.run_id, &items, u64::MAX);
                    if let Some(row) =
                        journal::assistant_transcript(info, &Message::assistant(text), refs)
                    {
                        append_once(&self.deps, row).await?;
                    }
                }
            }
        }
        // The conversation is free of this run: the next parked event may start (`enqueue`).
        if let Some(key) = ConversationKey::new(&info.workspace_id, info.conversation_id.as_deref())
        {
            self.conversations.finish_run(&key, info.run_id).await?;
        }
        self.cache().remove(&info.run_id);
        lock(&self.authorizations).remove(&info.run_id);
        Ok(())
    }

    /// The live delivery of `messages`: consecutive persisted items of one run, as one
    /// `switchboard.deliveries/1` message (or a single `switchboard.delivery/1`).
    fn outgoing(&self, messages: &[&ResultMessage]) -> Outgoing {
        let first = messages[0];
        let body = if let [single] = messages {
            messages::encode(&DeliveryMessage::from((*single).clone()))
        } else {
            DeliveryBatch::of(messages).map_or_else(Vec::new, |b| messages::encode(&b))
        };
        Outgoing {
            exchange: self.deps.topology.deliveries_exchange(),
            routing_key: deliveries_routing_key(
                first.workspace_id.as_str(),
                first.conversation_id.as_deref(),
                &first.run_id,
            ),
            body: body.into(),
            // Nobody may be streaming this run: live delivery is best effort, the ledger is
            // the source of truth for every reader.
            options: PublishOptions::best_effort(),
        }
    }

    /// Persists, applies and delivers one batch of result deliveries, then settles them.
    ///
    /// While the ledger or the session store is unreachable, the deliveries that failed on
    /// it (and those deferred behind them) are retried **in place**, with the orchestrator's
    /// retry backoff, until they succeed or shutdown begins: requeueing them would spend the
    /// results queue's delivery limit in seconds and dead-letter a run's items during an
    /// outage longer than that, leaving the run without its terminal item. Holding them keeps
    /// the shard waiting, which is all it could do anyway (every later item needs the same
    /// backends), and keeps each run's items in order.
    pub(crate) async fn process_batch(
        &self,
        deliveries: Vec<Delivery>,
        queue: &str,
        shutdown: &Shutdown,
    ) {
        let mut pending = deliveries;
        let mut attempt = 0u32;
        loop {
            let waiting = self.process_once(pending, queue, shutdown).await;
            if waiting.is_empty() {
                return;
            }
            Metrics::global().add(
                names::BUS_CONSUMED_TOTAL,
                &[("queue", queue), ("disposition", "retry_in_place")],
                waiting.len() as u64,
            );
            tracing::warn!(
                queue,
                deliveries = waiting.len(),
                attempt,
                "ledger or session store unreachable; retrying the results in place"
            );
            if !pause(self.options.retry_delay(attempt), shutdown).await {
                // Shutting down: hand them back to the broker for another consumer.
                for delivery in waiting {
                    if let Err(error) = delivery.nack(true).await {
                        tracing::warn!(%error, queue, "could not requeue a delivery at shutdown");
                    }
                }
                return;
            }
            attempt = attempt.saturating_add(1);
            // Their items may have been stored by the failed attempt: apply them as
            // redelivered (side effects again, all idempotent).
            pending = waiting
                .into_iter()
                .map(|mut delivery| {
                    delivery.redelivered = true;
                    delivery
                })
                .collect();
        }
    }

    /// One attempt of [`Self::process_batch`]: settles every delivery except those that
    /// failed on an unreachable backend (and those deferred behind them), which it returns.
    async fn process_once(
        &self,
        deliveries: Vec<Delivery>,
        queue: &str,
        shutdown: &Shutdown,
    ) -> Vec<Delivery> {
        let options = &self.options;
        let mut kept: Vec<Delivery> = Vec::with_capacity(deliveries.len());
        let mut items: Vec<Item> = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            match messages::decode_results(&delivery.body) {
                Ok(decoded) => {
                    let index = kept.len();
                    let redelivered = delivery.redelivered;
                    kept.push(delivery);
                    items.extend(decoded.into_iter().map(|message| Item {
                        delivery: index,
                        redelivered,
                        message,
                    }));
                }
                Err(e) => settle(delivery, &Err(e.into()), queue, options, shutdown).await,
            }
        }
        if items.is_empty() {
            return Vec::new();
        }

        // 2. One ledger call for the whole batch.
        let rows: Vec<NewRunEvent> = items.iter().map(|i| ledger_row(&i.message)).collect();
        let inserted: Vec<Result<bool>> =
            match self.deps.stores.runs.insert_events(rows.clone()).await {
                Ok(flags) if flags.len() == rows.len() => flags.into_iter().map(Ok).collect(),
                Ok(_) | Err(_) => {
                    // Find out per item (one missing run must not fail the others).
                    let mut each = Vec::with_capacity(rows.len());
                    for row in rows {
                        each.push(
                            self.deps
                                .stores
                                .runs
                                .insert_event(row)
                                .await
                                .map_err(Into::into),
                        );
                    }
                    each
                }
            };

        // 3. Side effects, in queue order; stop at the first transient failure. Applied items
        // are delivered (4.) in queue order as well, and *before* the side effects of a later
        // item of the batch are written: a delta reaches its readers as soon as it is
        // persisted, not after the transcript and run-status writes of the terminal item that
        // arrived in the same batch.
        let mut outcomes: Vec<Result<bool>> = Vec::with_capacity(items.len());
        let mut unsent: Vec<usize> = Vec::new();
        let mut halted = false;
        for (index, (item, inserted)) in items.iter().zip(inserted).enumerate() {
            if halted {
                outcomes.push(Err(OrchestratorError::Deferred));
                continue;
            }
            // A terminal item that is not new is applied anyway when the ledger holds it as
            // is: its worker stored it itself (see `is_stored_as_is`).
            let inserted = match inserted {
                Ok(false) if !item.redelivered && item.message.result.is_terminal() => {
                    self.is_stored_as_is(&item.message).await
                }
                other => other,
            };
            let outcome = match inserted {
                Err(e) => Err(e),
                Ok(new) if !new && !item.redelivered => Ok(false),
                Ok(_) => {
                    if !unsent.is_empty()
                        && has_side_effect(&item.message)
                        && !self.deliver(&items, &mut unsent, &mut outcomes).await
                    {
                        halted = true;
                        outcomes.push(Err(OrchestratorError::Deferred));
                        continue;
                    }
                    match self.run_info(item.message.run_id).await {
                        Ok(info) => self.apply(&info, &item.message).await.map(|()| true),
                        Err(e) => Err(e),
                    }
                }
            };
            if let Err(e) = &outcome {
                use sb_protocol::error::{Disposition, HasErrorCode};
                halted = e.code().disposition() == Disposition::Retry;
            }
            if matches!(outcome, Ok(true)) {
                unsent.push(index);
            }
            outcomes.push(outcome);
        }

        // 4. The remaining deliveries, after the ledger write.
        self.deliver(&items, &mut unsent, &mut outcomes).await;

        // 5. Settle each delivery in order, by the outcomes of its items.
        let mut settled: Vec<Option<Result<()>>> = (0..kept.len()).map(|_| None).collect();
        for (item, outcome) in items.iter().zip(outcomes) {
            let slot = &mut settled[item.delivery];
            *slot = Some(match (slot.take(), outcome) {
                // The first failure of its items decides; a deferral only when nothing failed.
                (Some(Err(e)), _) if !matches!(e, OrchestratorError::Deferred) => Err(e),
                (_, Err(e)) => Err(e),
                (Some(Err(e)), Ok(_)) => Err(e),
                (_, Ok(_)) => Ok(()),
            });
        }
        // An unreachable ledger or session store: what failed on it waits in place.
        let outage = settled
            .iter()
            .any(|o| matches!(o, Some(Err(e)) if e.is_backend_outage()));
        let mut waiting = Vec::new();
        for (delivery, outcome) in kept.into_iter().zip(settled) {
            match outcome.unwrap_or(Ok(())) {
                Err(e)
                    if outage
                        && (e.is_backend_outage() || matches!(e, OrchestratorError::Deferred)) =>
                {
                    waiting.push(delivery);
                }
                Err(OrchestratorError::Deferred) => {
                    if let Err(error) = delivery.nack(true).await {
                        tracing::warn!(%error, queue, "could not requeue a deferred delivery");
                    }
                }
                other => settle(delivery, &other, queue, options, shutdown).await,
            }
        }
        waiting
    }

    /// Publishes the deliveries of the items at `unsent` (indices into `items`, ascending;
    /// emptied). If the bus fails, the first failed item and every later one of the batch
    /// (those of `outcomes` so far) are set to be requeued, keeping the run order, and
    /// `false` is returned.
    async fn deliver(
        &self,
        items: &[Item],
        unsent: &mut Vec<usize>,
        outcomes: &mut [Result<bool>],
    ) -> bool {
        if unsent.is_empty() {
            return true;
        }
        let indices = std::mem::take(unsent);
        // Consecutive items of one run travel as one message.
        let groups = group_by_run(&indices, |i| items[i].message.run_id);
        let batch = groups
            .iter()
            .map(|group| {
                let messages: Vec<&ResultMessage> =
                    group.iter().map(|&i| &items[i].message).collect();
                self.outgoing(&messages)
            })
            .collect();
        match self.deps.bus.publish_batch(batch).await {
            Ok(()) => {
                Metrics::global().add(
                    names::BUS_PUBLISHED_TOTAL,
                    &[("exchange", "deliveries")],
                    groups.len() as u64,
                );
                true
            }
            Err(error) => {
                use sb_protocol::error::{Disposition, HasErrorCode};
                // A message the broker can never take (an invalid routing key, a body over
                // its size limit) is dropped: live delivery is best effort and the items are
                // in the ledger, where every stream reads what it missed. Requeueing it would
                // stall the shard behind it for good and keep its run from ever finishing.
                let (permanent, transient): (Vec<_>, Vec<_>) = error
                    .failed
                    .iter()
                    .partition(|(_, e)| e.code().disposition() != Disposition::Retry);
                for (index, cause) in &permanent {
                    let run_id = items[groups[*index][0]].message.run_id;
                    Metrics::global().inc(
                        names::BUS_PUBLISH_REFUSED_TOTAL,
                        &[("exchange", "deliveries")],
                    );
                    tracing::warn!(%run_id, error = %cause, "live delivery refused by the bus; the items stay in the ledger");
                }
                if transient.is_empty() {
                    return true;
                }
                // Requeue from the first item of the first transiently failed message on,
                // keeping the run order.
                let first_failed = transient.first().map_or(0, |(i, _)| *i);
                let cut = groups[first_failed.min(groups.len() - 1)][0];
                tracing::warn!(%error, "publishing deliveries failed; requeueing");
                for (i, outcome) in outcomes.iter_mut().enumerate().skip(cut) {
                    if i == cut {
                        *outcome = Err(OrchestratorError::Bus(
                            sb_common::bus::BusError::Unavailable(format!(
                                "delivery publish failed: {error}"
                            )),
                        ));
                    } else if outcome.is_ok() {
                        *outcome = Err(OrchestratorError::Deferred);
                    }
                }
                false
            }
        }
    }

    /// Finishes `run` from a terminal item already in its ledger, if there is one: applies it
    /// again (every side effect is idempotent, see the module docs) and publishes it for live
    /// delivery. Returns its sequence, or `None` when the ledger holds no terminal item.
    ///
    /// The reaper calls this before making a terminal item of its own: an item is stored
    /// (step 2) before its side effects, so a run whose terminal item was stored but never
    /// applied (its delivery dead-lettered) still looks active, and a second, host-made
    /// terminal item would end it twice.
    pub async fn finish_from_ledger(&self, run: &RunRecord) -> Result<Option<u64>> {
        let Some((sequence, result)) = self
            .stored_items(run.id)
            .await?
            .into_iter()
            .find(|(_, result)| result.is_terminal())
        else {
            return Ok(None);
        };
        let info = self.run_info(run.id).await?;
        let message = ResultMessage::new(
            run.id,
            run.workspace_id.clone(),
            run.conversation_id.clone(),
            sequence,
            result,
        );
        self.apply(&info, &message).await?;
        if let Err(error) = self
            .deps
            .bus
            .publish_batch(vec![self.outgoing(&[&message])])
            .await
        {
            tracing::warn!(run_id = %run.id, %error, "live delivery of a stored terminal item failed");
        }
        Ok(Some(sequence))
    }

    /// Finalizes `run` with a host-made terminal item: the reaper's `timeout` (deadline,
    /// deployment maximum) or `interrupted` (lost lease), the embedded recovery's
    /// `interrupted`. The one way the orchestrator's side ends a run that its worker did not:
    ///
    /// 1. the ledger stores the item at the first free sequence **and** the terminal status
    ///    in one commit ([`RunLedger::finalize_run`](sb_store::RunLedger::finalize_run)), so
    ///    a stream reader never sees the status without the item; if the run's own terminal
    ///    item is already stored, that one ends the run instead ([`Self::finish_from_ledger`]),
    ///    so a run has exactly one terminal item whatever races;
    /// 2. the item's side effects are applied and it is published for live delivery;
    /// 3. the run's session is ended (Host API calls for it are refused) and the steering
    ///    items it never pulled are audited as `steering.dropped`.
    ///
    /// Returns the sequence of the terminal item that ended the run, or `None` when the run
    /// had already ended (someone else finalized it; nothing is done).
    pub async fn finalize(
        &self,
        run: &RunRecord,
        outcome: RunOutcome,
        result: AgentRunResult,
    ) -> Result<Option<u64>> {
        let status = outcome.status;
        let sequence = match self
            .deps
            .stores
            .runs
            .finalize_run(run.id, outcome, result.clone())
            .await?
        {
            Finalized::AlreadyEnded(_) => return Ok(None),
            Finalized::TerminalStored { .. } => self.finish_from_ledger(run).await?,
            Finalized::Ended { sequence } => {
                Metrics::global().inc(names::RUNS_TOTAL, &[("status", status.as_str())]);
                let info = self.run_info(run.id).await?;
                let message = ResultMessage::new(
                    run.id,
                    run.workspace_id.clone(),
                    run.conversation_id.clone(),
                    sequence,
                    result.with_run_id(run.id).with_sequence(sequence),
                );
                self.apply(&info, &message).await?;
                // Best effort, like every live delivery: the item is stored and applied, and
                // a stream that misses it reads it from the ledger.
                if let Err(error) = self
                    .deps
                    .bus
                    .publish_batch(vec![self.outgoing(&[&message])])
                    .await
                {
                    tracing::warn!(run_id = %run.id, %error, "live delivery of a host-made terminal item failed");
                }
                Some(sequence)
            }
        };
        self.end_session(run).await;
        Ok(sequence)
    }

    /// Ends `run`'s session and audits the steering items it never pulled.
    async fn end_session(&self, run: &RunRecord) {
        match self.deps.sessions.end_session(&run.id).await {
            Ok(Some(ended)) => {
                for item in &ended.steering {
                    let row = audit::steering_dropped(
                        item,
                        run.id,
                        &run.runner_id,
                        &run.workspace_id,
                        audit::DROPPED_RUN_ENDED,
                    );
                    if let Err(error) = self.deps.stores.events.append(row, Vec::new()).await {
                        tracing::warn!(run_id = %run.id, %error, "could not audit a dropped steering item");
                    }
                }
            }
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(run_id = %run.id, %error, "could not end the session of a finalized run; it expires with its ttl");
            }
        }
    }

    /// Whether `message` is exactly the item the ledger holds at its sequence: a terminal
    /// item a worker stored itself before publishing it (a lost run finalized `interrupted`,
    /// [`RunLedger::finalize_run`](sb_store::RunLedger::finalize_run)), whose side effects
    /// and live delivery are still due. A different item at that sequence (a second terminal
    /// item refused by the ledger) is not.
    async fn is_stored_as_is(&self, message: &ResultMessage) -> Result<bool> {
        let sequence = i64::try_from(message.sequence).unwrap_or(i64::MAX);
        let stored = self
            .deps
            .stores
            .runs
            .events_after(message.run_id, sequence - 1, 1)
            .await?;
        Ok(stored.first().is_some_and(|record| {
            record.sequence == sequence
                && serde_json::to_value(&message.result).is_ok_and(|v| v == record.data)
        }))
    }
}

/// `indices` (ascending) split into runs of consecutive entries with the same `run_of`.
fn group_by_run(indices: &[usize], run_of: impl Fn(usize) -> RunId) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for &i in indices {
        match groups.last_mut() {
            Some(group) if run_of(group[0]) == run_of(i) => group.push(i),
            _ => groups.push(vec![i]),
        }
    }
    groups
}

fn run_info_from(run: &RunRecord) -> RunInfo {
    RunInfo {
        run_id: run.id,
        workspace_id: run.workspace_id.clone(),
        event_id: run.event_id,
        runner_id: run.runner_id.clone(),
        conversation_id: run.conversation_id.clone(),
        thread_id: run.thread_id.clone(),
        bot_id: run.bot_id.clone(),
    }
}

/// Whether applying `message` writes anything besides its ledger row (transcript, state,
/// artifact, run status).
fn has_side_effect(message: &ResultMessage) -> bool {
    let plan = journal::plan_item(&message.result);
    !matches!(plan.effect, Effect::None) || plan.outcome.is_some()
}

fn ledger_row(message: &ResultMessage) -> NewRunEvent {
    NewRunEvent {
        run_id: message.run_id,
        sequence: i64::try_from(message.sequence).unwrap_or(i64::MAX),
        result_type: message.result.result_type.clone(),
        data: serde_json::to_value(&message.result).unwrap_or(Value::Null),
    }
}

/// A low-cardinality label for a result type (unknown types share one label).
fn result_type_label(result: &AgentRunResult) -> &'static str {
    result.known_type().map_or("unknown", |t| t.as_str())
}

async fn append_once(deps: &OrchestratorDeps, row: sb_store::NewTranscriptItem) -> Result<()> {
    match deps.stores.transcript.append(row).await {
        // Conflict: the row with this deterministic id already exists (written once).
        Ok(_) | Err(StoreError::Conflict(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Consumes results shard `shard` until shutdown, in batches of the deliveries that are
/// ready at once.
pub async fn run_shard(sink: Arc<ResultSink>, shard: u32, shutdown: Shutdown) {
    let queue = sink.deps.topology.results_queue(shard);
    let options = Arc::clone(&sink.options);
    let max_batch = options.sink_batch.max(1);
    'subscribe: loop {
        let subscribe = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            s = sink.deps.bus.subscribe(&queue, ConsumeOptions::prefetch(options.prefetch)) => s,
        };
        let mut subscription = match subscribe {
            Ok(s) => s,
            Err(error) => {
                tracing::warn!(%error, queue = %queue.name, "cannot subscribe; retrying");
                if !pause(options.retry.max, &shutdown).await {
                    return;
                }
                continue 'subscribe;
            }
        };
        loop {
            let first = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                d = subscription.next() => d,
            };
            let mut lost = false;
            let mut batch = match first {
                Ok(d) => vec![d],
                Err(error) => {
                    tracing::warn!(%error, queue = %queue.name, "subscription ended; resubscribing");
                    Vec::new()
                }
            };
            if batch.is_empty() {
                lost = true;
            }
            // Take whatever else is ready now, without waiting (`next` is cancel-safe).
            while !lost && batch.len() < max_batch {
                match subscription.next().now_or_never() {
                    Some(Ok(d)) => batch.push(d),
                    Some(Err(_)) => {
                        lost = true;
                    }
                    None => break,
                }
            }
            if !batch.is_empty() {
                sink.process_batch(batch, &queue.name, &shutdown).await;
            }
            if lost {
                if !pause(options.retry.initial, &shutdown).await {
                    return;
                }
                continue 'subscribe;
            }
        }
    }
}
