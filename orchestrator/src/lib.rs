//! Switchboard orchestrator: turns events into runs and run results into a persisted,
//! delivered stream (SPEC §2 steps 2 and 4, §5, §6, §11).
//!
//! ```text
//!  switchboard.events.<k> ──▶ events::EventRouter ──▶ runs row, session, switchboard.runs.<pool>
//!                                 (bindings → steering → concurrency → access → context → plan)
//!                                 or: steering claim / parked / rejected
//!  switchboard.results.<k> ─▶ sink::ResultSink ─────▶ ledger, transcript/state/artifacts,
//!                                 (journal)              switchboard.deliveries
//!  reaper (timer) ──────────▶ runs past deadline + grace → timeout, synthetic run.failed
//!  scheduler (timer) ───────▶ due schedules → event log + outbox (like an ingest)
//!  retention (timer, lease) ▶ bounded deletes past their retention window
//! ```
//!
//! The decisions are pure functions over data (STYLE §3.8) and unit-tested on their own;
//! the services only look things up, call them, and apply what they return.
//!
//! # Layout
//! - [`bindings`]: which single agent handles an event (scope specificity, event types,
//!   filters; ties are ambiguous, never fanned out). Pure; `sb_rules`' own, which the
//!   gateway's conflict check shares.
//! - [`access`]: effective access = manifest ∩ policy ∩ config ∩ what exists, and the
//!   `available_apis` table. Pure.
//! - [`context`]: the `AgentRunContext` builder, run timeout/deadline, state snapshot. Pure.
//! - [`plan`]: event + resolution + registry → unrouted or dispatch; the frozen snapshot and
//!   the job of a run. Pure.
//! - [`state_keys`]: deterministic state scope keys and state key/value rules, shared with
//!   the worker's Host API. Pure.
//! - [`journal`]: transcript rows, state writes, artifacts and run outcomes built from
//!   results, with deterministic ids for idempotency. Pure.
//! - [`steering`]: which active run absorbs a message, the steering item and the claim
//!   metadata (its audit rows are `sb_store::audit`'s). Pure.
//! - [`concurrency`]: the conversation concurrency policy (`parallel`, `enqueue`,
//!   `interrupt`, `reject`) and the key/queue naming it uses. Pure.
//! - [`conversations`]: the per-conversation state in the session store (active-run index,
//!   parked queue) shared by every orchestrator.
//! - [`catalog`]: the [`catalog::ResourceCatalog`] boundary (which models, tools, knowledge
//!   bases and skills exist).
//! - [`events`]: the event consumer (one loop per events shard).
//! - [`sink`]: the result sink (one loop per results shard, batched ledger writes).
//! - [`reaper`]: finalizes overdue runs as `timeout`.
//! - [`scheduler`]: fires due schedules as host events.
//! - [`recovery`]: at the start of a process whose bus does not outlive it (embedded mode),
//!   publishes again what the ledger says was lost and ends the runs it was executing as
//!   `interrupted`.
//! - [`retention`]: deletes, in bounded batches, what is kept no longer (result items,
//!   artifacts, outbox, event log, transcript, closed sessions' turn identities); one
//!   orchestrator at a time.
//! - [`shards`]: which orchestrator consumes which shard queue (rendezvous hashing over the
//!   live members, pure) and the member registry in the session store.
//! - [`service`]: [`Orchestrator::spawn`] and the shard reconciler: starts and supervises
//!   the loops above.
//! - [`deps`]: [`OrchestratorDeps`] and [`OrchestratorOptions`], what every loop runs on.
//! - [`error`]: [`OrchestratorError`] and its error codes.

pub mod access;
pub mod catalog;
pub mod concurrency;
pub mod context;
pub mod conversations;
pub mod deps;
pub mod error;
pub mod events;
pub mod journal;
pub mod plan;
pub mod reaper;
pub mod recovery;
pub mod retention;
pub mod route_cache;
pub mod scheduler;
pub mod service;
pub mod shards;
pub mod sink;
pub mod steering;
pub use sb_protocol::state_keys;
pub use sb_rules::bindings;

pub use deps::{OrchestratorDeps, OrchestratorOptions};
pub use error::{OrchestratorError, Result};
pub use service::{Orchestrator, OwnedShards};

/// Locks a mutex of in-process bookkeeping (caches, lease observations). Its holders only
/// insert, remove and read whole entries, so a lock poisoned by a panicking holder still
/// guards a consistent map and is taken anyway.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
