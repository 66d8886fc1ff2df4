//! The result sink: one loop per results shard persisting `switchboard.result/1` items and
//! publishing them for live delivery (SPEC §2 step 4).
//!
//! Per batch (up to `sink_batch` deliveries that are ready at once, possibly of many runs):
//!
//! 1. decode; an undecodable body is dead-lettered;
//! 2. insert every item into the ledger in **one call**, idempotently on
//!    `(run_id, sequence)` (the first write wins), shared with the batches of other shards
//!    inserting at the same moment (`inserts`);
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
//! A worker may also hand its items to a sink of its own process directly
//! ([`ResultSink::store`], the worker's result outlet in cluster mode): the same steps 2–4 for
//! the hand-overs pending at once, answered each instead of settled, and a hand-over made
//! again after a failure is applied as a redelivery is.
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
//! backend is back (see `ResultSink::process_batch`), so an outage never spends their
//! delivery limit. A delivery the bus refuses for good
//! (a non-retryable [`BusError`](sb_common::bus::BusError), e.g. an invalid routing key) is
//! dropped and counted, not requeued: the items are in the ledger, and requeueing would stall
//! the shard and keep the run from finishing.
//!
//! Failures of a *result's own content* (a state update outside the policy, an oversized or
//! mismatching artifact) never fail the message: they are logged and the item is still
//! stored and delivered, as the seed host does (host-behaviour §10, §14).
//!
//! # Layout
//! This module holds the sink, its per-run caches and their reads; each child adds the
//! methods of one part, and none of them is used here: `batch` (steps 1–5 of a batch),
//! `apply` (step 3's side effects), `deliver` (step 4's live delivery), `finalize`
//! (host-made run ends), `inserts` (step 2's shared call) and `consume` (the shard loop).

mod apply;
mod batch;
mod consume;
mod deliver;
mod finalize;
mod inserts;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sb_protocol::host::AuthorizationSnapshot;
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::messages::{ResultMessage, RunFacts};
use sb_protocol::result::AgentRunResult;
use sb_store::{ItemJson, RunRecord};

use crate::conversations::Conversations;
use crate::deps::{OrchestratorDeps, OrchestratorOptions};
use crate::error::{OrchestratorError, Result};
use crate::journal::{self, AppliedItems, ItemPlan, RunInfo};
use crate::lock;
use inserts::Inserts;

pub use consume::run_shard;

/// Runs whose facts are cached; the cache is cleared when it grows past this (a run's entry
/// is also dropped at its terminal item).
const RUN_CACHE_CAP: usize = 10_000;

/// Makes room for `key` in one of the sink's per-run maps: a map at [`RUN_CACHE_CAP`] that
/// lacks it is cleared (the entries are only savings; a run missing there is read back).
fn make_room<V>(map: &mut HashMap<RunId, V>, key: &RunId) {
    if map.len() >= RUN_CACHE_CAP && !map.contains_key(key) {
        map.clear();
    }
}

/// Persists and delivers results; shared by the shard loops and the reaper.
#[derive(Debug)]
pub struct ResultSink {
    deps: OrchestratorDeps,
    options: Arc<OrchestratorOptions>,
    /// Step 2's ledger inserts, shared by the shard loops.
    inserts: Inserts,
    /// Immutable facts of active runs (from the ledger row), so a streaming run costs one
    /// ledger insert per batch instead of an extra read per item.
    runs: Mutex<HashMap<RunId, Arc<RunInfo>>>,
    /// Frozen authorizations of active runs that updated state (see `authorization`);
    /// bounded and dropped like `runs`.
    authorizations: Mutex<HashMap<RunId, Option<Arc<AuthorizationSnapshot>>>>,
    /// What this sink applied of each active run: whether it applied a complete assistant
    /// message (then the terminal item need not read the run's items back, see `finish`)
    /// and the artifact references the assistant transcript needs (see `write_assistant`).
    /// Bounded like `runs`; a run missing here is just read back.
    applied: Mutex<HashMap<RunId, AppliedItems>>,
    /// The conversations' active-run index and parked queues: a terminal item takes its run
    /// out of the index and wakes the next parked event.
    conversations: Conversations,
}

/// What the ledger insert of an item wrote besides its row, so applying the item does not
/// write it again.
#[derive(Debug, Clone, Copy, Default)]
struct Written {
    /// The item is new and, if terminal, ended its run
    /// ([`NewRunEvent::ends_run`](sb_store::NewRunEvent::ends_run)).
    ended: bool,
    /// The item is new and wrote its assistant transcript row
    /// ([`NewRunEvent::transcript`](sb_store::NewRunEvent::transcript)).
    transcribed: bool,
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
    /// What applying it does ([`journal::plan_item`], made once per item).
    plan: ItemPlan,
    /// The result's JSON as the ledger stores it, serialized once: shared with the item's
    /// ledger row and embedded in its live delivery.
    stored: ItemJson,
}

impl Item {
    /// `message` as an item of delivery `delivery`, planned and serialized once.
    fn new(message: ResultMessage, delivery: usize, redelivered: bool) -> Self {
        Self {
            delivery,
            redelivered,
            plan: journal::plan_item(&message.result),
            stored: ItemJson::of(&message.result),
            message,
        }
    }

    /// The items of `groups` (each the messages of one delivery or hand-over, and whether
    /// they came before), in order; an item's `delivery` is its group's index. Sized once: a
    /// batch of streamed items is large, and growing it copies every item made so far.
    fn all(groups: Vec<(Vec<ResultMessage>, bool)>) -> Vec<Self> {
        let mut items = Vec::with_capacity(groups.iter().map(|(messages, _)| messages.len()).sum());
        for (delivery, (messages, redelivered)) in groups.into_iter().enumerate() {
            items.extend(
                messages
                    .into_iter()
                    .map(|message| Self::new(message, delivery, redelivered)),
            );
        }
        items
    }
}

impl ResultSink {
    /// A sink over `deps`, its shared inserts' task started on the current Tokio runtime.
    ///
    /// # Panics
    /// Outside a Tokio runtime.
    #[must_use]
    pub fn new(deps: OrchestratorDeps, options: Arc<OrchestratorOptions>) -> Self {
        let conversations = deps.conversations(&options);
        let inserts = Inserts::start(Arc::clone(&deps.stores.runs));
        Self {
            deps,
            inserts,
            options,
            runs: Mutex::new(HashMap::new()),
            authorizations: Mutex::new(HashMap::new()),
            applied: Mutex::new(HashMap::new()),
            conversations,
        }
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, HashMap<RunId, Arc<RunInfo>>> {
        lock(&self.runs)
    }

    /// The facts of a message's run: cached, else carried by the message (its worker copied
    /// them from the job), else read from the run's ledger row.
    async fn facts_of(&self, message: &ResultMessage) -> Result<Arc<RunInfo>> {
        let run_id = message.run_id;
        if let Some(info) = self.cache().get(&run_id) {
            return Ok(Arc::clone(info));
        }
        let info = match &message.run {
            Some(facts) => run_info(
                run_id,
                &message.workspace_id,
                message.conversation_id.as_ref(),
                facts,
            ),
            None => {
                let run = self
                    .deps
                    .stores
                    .runs
                    .get_run(run_id)
                    .await?
                    .ok_or(OrchestratorError::RunNotFound(run_id))?;
                run_info(
                    run.id,
                    &run.workspace_id,
                    run.conversation_id.as_ref(),
                    &facts_of_row(&run),
                )
            }
        };
        let info = Arc::new(info);
        self.remember(Arc::clone(&info));
        Ok(info)
    }

    fn remember(&self, info: Arc<RunInfo>) {
        let mut cache = self.cache();
        make_room(&mut cache, &info.run_id);
        cache.insert(info.run_id, info);
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
        make_room(&mut cache, &info.run_id);
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
}

/// The facts a result message of `run` carries.
fn facts_of_row(run: &RunRecord) -> RunFacts {
    RunFacts {
        event_id: run.event_id,
        runner_id: run.runner_id.clone(),
        thread_id: run.thread_id.clone(),
        bot_id: run.bot_id.clone(),
    }
}

/// The facts of run `run_id` the sink applies items with.
fn run_info(
    run_id: RunId,
    workspace_id: &WorkspaceId,
    conversation_id: Option<&String>,
    facts: &RunFacts,
) -> RunInfo {
    RunInfo {
        run_id,
        workspace_id: workspace_id.clone(),
        event_id: facts.event_id,
        runner_id: facts.runner_id.clone(),
        conversation_id: conversation_id.cloned(),
        thread_id: facts.thread_id.clone(),
        bot_id: facts.bot_id.clone(),
    }
}
