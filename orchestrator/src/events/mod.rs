//! The event consumer: one loop per events shard turning `switchboard.event/1` pointers (one
//! per message, or an outbox round's `switchboard.events/1` batch) into runs, steering claims,
//! parked or rejected events (SPEC §2 step 2, §7). The steps below are one event's; the
//! settlement of a batch's message is `consume`'s.
//!
//! For one event, in this order (every step is idempotent, so a redelivered event redoes
//! them without effect beyond the first time):
//!
//! 0. take the event's route lock (a session-store lease `route:<event_id>`, read together
//!    with the routing epoch of the route cache in one round trip): a copy of the
//!    event that another orchestrator is routing right now is requeued, so one event is never
//!    both claimed and dispatched, claimed twice, or parked behind its own run;
//! 1. load the event from the event log (the message is only a pointer); an event already
//!    `unrouted`/`rejected`/`claimed`, or whose run has left `queued`, is done;
//! 2. resolve one binding among the workspace's enabled agents ([`crate::bindings`]) and
//!    look its runner up in the registry; no match / a tie / no runner → the event becomes
//!    `unrouted` with reason `binding.not_found` / `binding.ambiguous` / `runner.not_found`
//!    and no run is created. An event that names its agent (a turn of the turn API,
//!    `metadata.turn`, see [`sb_store::TurnTag`]: its session's agent; or `agent_id` on
//!    ingest, `metadata.target`, see [`sb_store::EventTarget`]) goes to that agent whatever
//!    the scopes say ([`sb_rules::bindings::resolve_target`]), or is unrouted with
//!    `binding.target_unavailable` when the agent can no longer take it;
//! 3. for an event of a conversation without a run yet: the conversation's active runs
//!    ([`crate::conversations`]); a `message.received` that an active run can absorb
//!    ([`crate::steering::target`]) is pushed to that run's steering list and becomes
//!    `claimed` (a full list or a vanished run falls through); otherwise the agent's
//!    concurrency policy ([`crate::concurrency::decide`]) starts it, parks it (`enqueue`),
//!    cancels the active runs first (`interrupt`) or rejects it (`reject`);
//! 4. effective access ([`crate::access`]) from the manifest, the policy, the config and the
//!    resource catalog;
//! 5. the frozen snapshot ([`crate::plan::authorization`]), with a freshly minted remote
//!    Host API token (the snapshot keeps its SHA-256 only; the runner gets the token in
//!    `ctx.runtime.metadata.host_api`);
//! 6. the keys of the state scopes the binding enables for this event;
//! 7. for an event without a run yet (the usual case), in **one commit**, shared with the
//!    runs other lanes and shards start at the same moment
//!    ([`RunLedger::start_runs`](sb_store::RunLedger::start_runs)): the run row (`queued`;
//!    a turn's run takes the turn id chosen at receipt), the user transcript row
//!    (deterministic id: written once) and the event → `dispatched` with the run id and the
//!    frozen snapshot under `metadata.authorization` (the result sink reads it after the
//!    session has ended; without the digest of the run's remote Host API token, which only
//!    the session keeps). The same statement reads, as the ledger was before its writes,
//!    the transcript's latest cursor (before this event's own row) and the values of step
//!    6's scopes, from which the state snapshot, the context and the job are built
//!    ([`crate::plan::prepare`]). A redelivered event whose run exists gets that run back
//!    (unique on the event), with its id and its deadline, which are never recomputed, and
//!    its reads and writes are done one by one (the event's update after step 8); a turn is
//!    never absorbed as steering input in step 3;
//! 8. the session (TTL = deadline + grace) in the session store, then the run in the
//!    conversation's active index, in one step of the store (and, for a formerly parked
//!    event, out of the queue);
//!    a crash before this leaves the event dispatched with a queued run and no session:
//!    its redelivery (the event is not acked yet) takes the long way of step 7 and
//!    writes them;
//! 9. the job to `switchboard.runs.<pool>`, awaited until the broker confirms;
//! 10. the event delivery is acked.
//!
//! If the job publish fails, the delivery is requeued (transient) and the next attempt
//! republishes the job of the same, still `queued`, run (the policy is not asked again: it
//! already said "start"). A job published twice for one run is harmless: only one worker can
//! claim a run (`queued → running`).
//!
//! # Steering claims and redelivery
//! The claim pushes first and records second, so a crash in between can at worst push the
//! item again on redelivery (at-least-once: items carry their `event.event_id` for runners
//! that deduplicate); a `steer-claim:<event_id>` marker written right after the push
//! narrows that window to the two session-store calls.
//!
//! # Layout
//! This module holds the router and its outcome; each child adds the methods of one part of
//! the pipeline, and none of them is used here: `route` (steps 0–2), `reads` (the event
//! reads of step 1, shared by the routes that wait at once), `lookup` (the
//! resolver's cached inputs), `decide` (step 3), `finish` (the ends without a run:
//! unrouted, parked, rejected), `dispatch` (steps 4–9) and `consume` (the shard loop: the
//! deliveries ready at once routed side by side by ordering lane, each lane in order;
//! step 10).

mod consume;
mod decide;
mod dispatch;
mod finish;
mod lookup;
mod reads;
mod route;

use std::sync::Arc;

use sb_common::group_commit::GroupCommit;
use sb_protocol::ids::RunId;
use sb_store::{RunStart, StartedRun};
use serde_json::Value;

use crate::concurrency::ConversationKey;
use crate::conversations::Conversations;
use crate::deps::{OrchestratorDeps, OrchestratorOptions};
use crate::plan::UnroutedReason;
use crate::route_cache::RouteCache;
use reads::RouteReads;

pub use consume::run_shard;

/// What routing one event did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteOutcome {
    /// A run exists for the event and its job was published (`created` = by this call).
    Dispatched {
        /// The run.
        run_id: RunId,
        /// Whether this call created the run.
        created: bool,
    },
    /// The event starts no run.
    Unrouted(UnroutedReason),
    /// An active run absorbed the message as steering input (event `claimed`).
    Claimed {
        /// The absorbing run.
        run_id: RunId,
    },
    /// `enqueue`: the event waits (status `received`) until the conversation is free.
    Parked {
        /// The active runs it waits for (empty when it waits behind parked events only).
        behind: Vec<RunId>,
    },
    /// `reject`: the conversation was busy (event `rejected`).
    Rejected {
        /// The active runs.
        active: Vec<RunId>,
    },
    /// The event had already been handled (terminal routing status, or its run has started).
    AlreadyHandled,
}

/// Routes events; shared by the shard loops.
#[derive(Debug)]
pub struct EventRouter {
    deps: OrchestratorDeps,
    options: Arc<OrchestratorOptions>,
    conversations: Conversations,
    /// The workspace's agents and the runners' descriptors, as last read.
    cache: RouteCache,
    /// Step 7's commit, shared by the runs started side by side (by every shard loop of this
    /// orchestrator, and by the conversations of one shard batch): one statement for all the
    /// starts pending at once ([`RunLedger::start_runs`](sb_store::RunLedger::start_runs)).
    starts: GroupCommit<RunStart, sb_store::Result<Option<StartedRun>>>,
    /// Step 1's event reads, shared the same way.
    reads: RouteReads,
}

/// Most run starts one commit carries: far above what one orchestrator routes in one
/// commit's time.
const MAX_STARTS_PER_COMMIT: usize = 64;

/// How a run is started for an event of a conversation.
#[derive(Debug, Default)]
struct StartContext {
    /// The conversation (its active index gets the run).
    key: Option<ConversationKey>,
    /// The event's parked-queue member, removed once the run is in the active index.
    parked_member: Option<String>,
    /// Merged into the event's metadata as `concurrency`.
    concurrency: Option<Value>,
}

impl EventRouter {
    /// A router over `deps`.
    ///
    /// # Panics
    /// Outside a Tokio runtime (the starts' group commit is a task).
    #[must_use]
    pub fn new(deps: OrchestratorDeps, options: Arc<OrchestratorOptions>) -> Self {
        let conversations = deps.conversations(&options);
        let cache = RouteCache::new(options.route_cache_max_age);
        let runs = Arc::clone(&deps.stores.runs);
        let starts = GroupCommit::spawn(MAX_STARTS_PER_COMMIT, move |batch: Vec<RunStart>| {
            let runs = Arc::clone(&runs);
            async move { runs.start_runs(batch).await }
        });
        let reads = RouteReads::start(&deps.stores);
        Self {
            deps,
            options,
            conversations,
            cache,
            starts,
            reads,
        }
    }
}
