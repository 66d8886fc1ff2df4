//! The run ledger and the result items of every run.

use std::collections::{BTreeMap, HashSet};
use std::str::FromStr;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::{AgentId, EventId, RunId, WorkspaceId};
use sb_protocol::result::AgentRunResult;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, StoreError};
use crate::page::Page;

/// Largest batch [`RunLedger::events_after`] returns.
pub const MAX_RUN_EVENTS_BATCH: u64 = 1000;

/// Lifecycle of a run. `queued` and `running` are *active*; the rest are terminal and
/// never change once reached.
///
/// ```text
/// queued ──claim──▶ running ──finish──▶ completed | failed | cancelled | timeout | interrupted
///    └────────────────finish (reaper, cancel before start)──────────▲
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// Created, job published, no worker has claimed it yet.
    Queued,
    /// Claimed by a worker.
    Running,
    /// Ended with `run.completed`.
    Completed,
    /// Ended with `run.failed`.
    Failed,
    /// Cancelled by a user, by `interrupt` concurrency or by shutdown.
    Cancelled,
    /// Finalised by the deadline reaper.
    Timeout,
    /// Its worker died after it started; never re-executed.
    Interrupted,
}

impl RunStatus {
    /// Statuses a run can still leave.
    pub const ACTIVE: [RunStatus; 2] = [RunStatus::Queued, RunStatus::Running];

    /// The stored / wire form.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Timeout => "timeout",
            Self::Interrupted => "interrupted",
        }
    }

    /// Whether the status is final.
    #[must_use]
    pub fn is_terminal(self) -> bool {
        !matches!(self, Self::Queued | Self::Running)
    }
}

impl FromStr for RunStatus {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "queued" => Self::Queued,
            "running" => Self::Running,
            "completed" => Self::Completed,
            "failed" => Self::Failed,
            "cancelled" => Self::Cancelled,
            "timeout" => Self::Timeout,
            "interrupted" => Self::Interrupted,
            other => return Err(StoreError::invalid(format!("unknown run status: {other}"))),
        })
    }
}

impl std::fmt::Display for RunStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A run to create (status `queued`).
#[derive(Debug, Clone, PartialEq)]
pub struct NewRun {
    /// The run id; `None` → a fresh UUID v7.
    pub id: Option<RunId>,
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// The event that caused the run. Unique: one event has at most one run.
    pub event_id: EventId,
    /// Agent whose binding matched.
    pub agent_id: Option<AgentId>,
    /// Runner executing it.
    pub runner_id: String,
    /// Worker pool the job goes to.
    pub pool: String,
    /// Conversation.
    pub conversation_id: Option<String>,
    /// Thread.
    pub thread_id: Option<String>,
    /// Bot.
    pub bot_id: Option<String>,
    /// Hard deadline (`None` = no deadline).
    pub deadline_at: Option<DateTime<Utc>>,
    /// Attempt number, starting at 1.
    pub attempt: i64,
}

/// A run in the ledger.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// Run id.
    pub id: RunId,
    /// Workspace.
    pub workspace_id: WorkspaceId,
    /// Causing event.
    pub event_id: EventId,
    /// Agent.
    pub agent_id: Option<AgentId>,
    /// Runner.
    pub runner_id: String,
    /// Pool.
    pub pool: String,
    /// Conversation.
    pub conversation_id: Option<String>,
    /// Thread.
    pub thread_id: Option<String>,
    /// Bot.
    pub bot_id: Option<String>,
    /// Current status.
    pub status: RunStatus,
    /// Error code / reason of a non-successful end (e.g. `runtime_error`, `cancelled`).
    pub error_code: Option<String>,
    /// Human-readable error.
    pub error_message: Option<String>,
    /// Attempt number.
    pub attempt: i64,
    /// Worker that claimed it.
    pub worker_id: Option<String>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Claim time.
    pub started_at: Option<DateTime<Utc>>,
    /// Terminal time.
    pub ended_at: Option<DateTime<Utc>>,
    /// Deadline.
    pub deadline_at: Option<DateTime<Utc>>,
    /// When cancellation was first requested.
    pub cancel_requested_at: Option<DateTime<Utc>>,
    /// Why.
    pub cancel_reason: Option<String>,
    /// Highest result sequence stored so far (0 = none).
    pub last_sequence: i64,
    /// Usage reported at the end.
    pub usage: Option<Value>,
    /// Set when retention deleted the run's result items (reads answer `expired`).
    pub events_expired_at: Option<DateTime<Utc>>,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOutcome {
    /// A terminal status.
    pub status: RunStatus,
    /// Error code / reason.
    pub error_code: Option<String>,
    /// Error message.
    pub error_message: Option<String>,
    /// Usage (kept as is when `None`).
    pub usage: Option<Value>,
}

impl RunOutcome {
    /// A successful end.
    #[must_use]
    pub fn completed() -> Self {
        Self {
            status: RunStatus::Completed,
            error_code: None,
            error_message: None,
            usage: None,
        }
    }

    /// A non-successful end with a code and message.
    #[must_use]
    pub fn with_error(
        status: RunStatus,
        code: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            error_code: Some(code.into()),
            error_message: Some(message.into()),
            usage: None,
        }
    }
}

/// What [`RunLedger::request_cancel`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// This call recorded the request.
    Requested,
    /// An earlier call had already recorded it; nothing changed.
    AlreadyRequested,
    /// The run had already ended with this status; nothing changed.
    AlreadyFinished(RunStatus),
}

/// What [`RunLedger::finalize_run`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finalized {
    /// This call stored the terminal item at `sequence` and ended the run, in one commit.
    Ended {
        /// The sequence the terminal item got.
        sequence: u64,
    },
    /// The run's ledger already holds a terminal item (at `sequence`); nothing was written.
    /// The run may still look active: its terminal item was stored but not yet applied (the
    /// caller applies it, so the run ends with the item it already has).
    TerminalStored {
        /// The sequence of the stored terminal item.
        sequence: u64,
    },
    /// The run already ended with this status; nothing was written.
    AlreadyEnded(RunStatus),
}

/// Filters of [`RunLedger::list_runs`].
#[derive(Debug, Clone, PartialEq)]
pub struct RunFilter {
    /// Workspace (lists never cross workspaces).
    pub workspace_id: WorkspaceId,
    /// Only this conversation.
    pub conversation_id: Option<String>,
    /// Only these statuses (empty = all).
    pub statuses: Vec<RunStatus>,
    /// Only this agent.
    pub agent_id: Option<AgentId>,
    /// Only this runner.
    pub runner_id: Option<String>,
}

impl RunFilter {
    /// All runs of a workspace.
    #[must_use]
    pub fn workspace(workspace_id: WorkspaceId) -> Self {
        Self {
            workspace_id,
            conversation_id: None,
            statuses: Vec::new(),
            agent_id: None,
            runner_id: None,
        }
    }
}

/// What starting a run writes, in one commit ([`RunLedger::start_run`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RunStart {
    /// The run; `id` must be set (the caller prepared the run's job with it).
    pub run: NewRun,
    /// The event's user transcript row, if its conversation keeps one.
    pub user_transcript: Option<crate::NewTranscriptItem>,
    /// The event's new routing state (`dispatched`, with this run's id).
    pub event: crate::EventStatusUpdate,
    /// What the run's context needs from the ledger, read with the writes (Postgres: in the
    /// same statement; SQLite: on the readers just before the write transaction, so the one
    /// writer holds only writes), so routing a run reads nothing on its own.
    pub reads: StartReads,
}

/// The reads of a run start ([`RunStart::reads`]), answered in [`StartedRun`]. They see the
/// ledger as it was before the start's own writes: the latest transcript cursor is the one
/// before the event's user row, so a runner paging backwards from it sees strictly earlier
/// history.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StartReads {
    /// Read the run's conversation's latest transcript cursor
    /// ([`Transcript::latest_cursor`](crate::Transcript::latest_cursor)).
    pub latest_cursor: bool,
    /// Read every value of these state scopes
    /// ([`StateStore::snapshots`](crate::StateStore::snapshots)).
    pub state_scopes: Vec<String>,
}

/// A run a start created ([`RunLedger::start_run`]), with what its reads found.
#[derive(Debug, Clone, PartialEq)]
pub struct StartedRun {
    /// The queued run.
    pub run: RunRecord,
    /// The conversation's latest transcript cursor before the start, when it was asked for
    /// and the conversation has rows.
    pub latest_cursor: Option<String>,
    /// The values of each scope asked for, by scope key then key (a scope without values is
    /// present and empty).
    pub state: BTreeMap<String, BTreeMap<String, Value>>,
}

/// A result item's JSON as the ledger stores it (`run_events.data`): serialized once by
/// whoever makes the row and written as this text, so storing a streamed item builds no JSON
/// tree and serializes nothing again (on Postgres the text is embedded as is in the batch's
/// JSON parameter, on SQLite it is bound as is). Shared, not copied, when cloned: the result
/// sink hands one copy to the item's ledger row and embeds another in its live delivery.
#[derive(Debug, Clone)]
pub struct ItemJson(std::sync::Arc<Box<serde_json::value::RawValue>>);

impl Serialize for ItemJson {
    /// The JSON text as is.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.as_raw().serialize(serializer)
    }
}

impl ItemJson {
    /// The JSON of `item`. A value that has no JSON text (a map with non-string keys: none
    /// of the result types) is stored as `null`, as a JSON value of it would have been.
    pub fn of<T: Serialize + ?Sized>(item: &T) -> Self {
        Self(std::sync::Arc::new(
            serde_json::value::to_raw_value(item)
                .unwrap_or_else(|_| serde_json::value::RawValue::NULL.to_owned()),
        ))
    }

    /// The JSON text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        self.0.get()
    }

    /// The JSON, as a raw value to embed in another document.
    #[must_use]
    pub fn as_raw(&self) -> &serde_json::value::RawValue {
        &self.0
    }

    /// The JSON as a value (parsed: for the paths that store one row at a time).
    #[must_use]
    pub fn to_value(&self) -> Value {
        serde_json::from_str(self.0.get()).unwrap_or(Value::Null)
    }
}

impl From<Value> for ItemJson {
    fn from(value: Value) -> Self {
        Self::of(&value)
    }
}

/// Two items' JSON are equal when their texts are: both are serialized by `serde_json`, in
/// the order of their fields.
impl PartialEq for ItemJson {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

/// A result item to store.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRunEvent {
    /// Run.
    pub run_id: RunId,
    /// Worker-assigned sequence, ≥ 1.
    pub sequence: i64,
    /// `AgentRunResult.type`, e.g. `message.delta`, `run.completed` (≤ 100 chars).
    pub result_type: String,
    /// The whole result item.
    pub data: ItemJson,
    /// The run's end that this item makes (a terminal item): applied with the insert, in the
    /// same commit, when the item is new and the run still active (as
    /// [`RunLedger::finish_run`] would), so the result sink ends a run without a statement
    /// of its own. `None` for every other item, and for a terminal item whose run is ended
    /// some other way.
    pub ends_run: Option<RunOutcome>,
    /// The transcript row this item makes (the assistant's message of a complete message
    /// item): written with the insert, in the same commit, when the item is new, unless a
    /// row with its id exists (as [`Transcript::append`](crate::Transcript::append), whose
    /// validation it passes), so the result sink writes it without a statement of its own.
    pub transcript: Option<crate::NewTranscriptItem>,
}

/// A stored result item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunEventRecord {
    /// Run.
    pub run_id: RunId,
    /// Sequence.
    pub sequence: i64,
    /// Result type.
    pub result_type: String,
    /// The result item.
    pub data: Value,
    /// Insert time.
    pub created_at: DateTime<Utc>,
}

/// The ledger of runs and their result items.
///
/// # Contract
///
/// - **One run per event.** `create_run` is idempotent on `event_id`, so a redelivered event
///   reuses its run instead of starting a second one.
/// - **Exactly one claimer.** `claim_run` is a conditional `queued → running` update: among
///   any number of concurrent callers exactly one gets `true`.
/// - **Terminal states are final.** `finish_run` only moves a `queued` or `running` run; the
///   first finisher wins and later calls return `false` without changing anything.
/// - **Result sequences** are assigned by the worker: 1, 2, 3, … per run. The ledger stores
///   each `(run_id, sequence)` once (the first write wins; a duplicate is reported as not
///   new so side effects are applied once) and keeps `last_sequence` = the highest stored.
/// - **One terminal item per run.** A second terminal item (`run.completed` / `run.failed`)
///   of a run, at whatever sequence, is not stored and is reported as not new, like a
///   duplicate.
/// - **Terminal item before terminal status.** A run whose status is terminal because of a
///   result item has that item in the ledger (`insert_event(s)` first, then `finish_run`;
///   or [`finalize_run`](Self::finalize_run), both in one commit). Host-made ends (the
///   reaper, a lost worker, recovery, an unrouted event's queued run) use `finalize_run`.
/// - **Reading after a sequence** returns items with `sequence > after`, ascending:
///
///   ```text
///   stored:                1  2  3  4  5
///   events_after(run, 2) →       3  4  5
///   events_after(run, 0) → 1  2  3  4  5
///   ```
#[async_trait]
pub trait RunLedger: Send + Sync + 'static {
    /// Creates a queued run, or returns the run already created for the same event with
    /// `created = false`. A different event reusing an existing run id is `conflict`.
    async fn create_run(&self, run: NewRun) -> Result<(RunRecord, bool)>;

    /// Starts a run in **one commit**: creates the queued run ([`RunStart::run`], its id
    /// chosen by the caller), appends the event's user transcript row unless a row with its
    /// id exists, and applies the event's routing update ([`RunStart::event`], as
    /// [`EventLog::update_status`](crate::EventLog::update_status)). Returns the run, or
    /// `None` when the event already has a run: then nothing is written (the transcript row
    /// aside, which is the event's own either way) and the caller goes on with that run
    /// ([`create_run`](Self::create_run) returns it). The start's [reads](RunStart::reads)
    /// are answered with the run ([`StartedRun`]), as the ledger was before the writes. One
    /// statement on Postgres, one transaction on SQLite: routing writes this for every run.
    /// `not_found` if the event does not exist (nothing is written); the validation errors
    /// of the three writes and the reads.
    async fn start_run(&self, start: RunStart) -> Result<Option<StartedRun>>;

    /// [`start_run`](Self::start_run) for the runs of several events at once, in **one
    /// commit**: one statement on Postgres, one transaction on SQLite. Each start gets the
    /// answer `start_run` would have given it, in order; one that fails (a run id taken by
    /// another event, a missing event, a bad row) fails alone, because when the shared
    /// commit fails each start is made again on its own. The starts must be of different
    /// events (the router holds each event's route lock while it starts its run).
    ///
    /// The router's group commit calls this with whatever starts are pending at once, so
    /// the runs routed side by side share a commit.
    async fn start_runs(&self, starts: Vec<RunStart>) -> Vec<Result<Option<StartedRun>>>;

    /// The run, if any.
    async fn get_run(&self, id: RunId) -> Result<Option<RunRecord>>;

    /// Runs matching `filter`, newest first, paged by an opaque cursor (limit clamped to
    /// [1, 100], default 50).
    async fn list_runs(
        &self,
        filter: RunFilter,
        cursor: Option<String>,
        limit: Option<i64>,
    ) -> Result<Page<RunRecord>>;

    /// One page of the runs in `status`, across every workspace, oldest first (`created_at`,
    /// then id). Pass a page's `next_cursor` back as `cursor` to read on from its last run;
    /// `limit` is clamped to [1, 100] (default 50). `invalid_argument` when the cursor is
    /// bad.
    ///
    /// For passes over the whole ledger rather than a workspace's listing: the embedded
    /// mode's start-up recovery finalizes the runs left `running` and re-routes those left
    /// `queued` by the previous process, however many a long outage left.
    ///
    /// The cursor is a position, not an offset, so a caller may change the runs it reads
    /// while it pages (finish them, claim them): a run leaving `status` never makes a later
    /// page skip or repeat a run that kept its status. A run created meanwhile in `status`
    /// appears on a later page unless its `created_at` is before the cursor's position.
    async fn runs_with_status(
        &self,
        status: RunStatus,
        cursor: Option<String>,
        limit: Option<i64>,
    ) -> Result<Page<RunRecord>>;

    /// `queued → running` for `worker_id`. `true` iff this call made the transition.
    async fn claim_run(&self, id: RunId, worker_id: &str) -> Result<bool>;

    /// [`claim_run`](Self::claim_run) for several runs at once, in one statement: returns the
    /// runs this call moved `queued → running` for `worker_id` (the others were not queued
    /// or do not exist). A worker's group commit calls this with the claims of the jobs it
    /// received together.
    async fn claim_runs(&self, ids: &[RunId], worker_id: &str) -> Result<HashSet<RunId>>;

    /// Ends an active run with a terminal status. `true` iff this call ended it;
    /// `invalid_argument` if `outcome.status` is not terminal.
    async fn finish_run(&self, id: RunId, outcome: RunOutcome) -> Result<bool>;

    /// Ends an active run with a host-made terminal item (the reaper's `timeout`, a lost
    /// worker's `interrupted`, …) in **one transaction**: `terminal` is stored at the first
    /// free sequence after the run's last (with that `run_id` and `sequence`) and the run
    /// moves to `outcome.status`. A reader that sees the terminal status therefore always
    /// finds the terminal item in the ledger.
    ///
    /// Nothing is written when the run already has a terminal item
    /// ([`Finalized::TerminalStored`]) or already ended ([`Finalized::AlreadyEnded`]), so
    /// among concurrent finalizers (and the run's own terminal item arriving meanwhile)
    /// exactly one terminal item is stored. `not_found` if there is no such run;
    /// `invalid_argument` if `outcome.status` or `terminal` is not terminal.
    async fn finalize_run(
        &self,
        id: RunId,
        outcome: RunOutcome,
        terminal: AgentRunResult,
    ) -> Result<Finalized>;

    /// Records the intent to cancel (first request wins, its reason is kept). `not_found` if
    /// there is no such run.
    async fn request_cancel(&self, id: RunId, reason: Option<String>) -> Result<CancelOutcome>;

    /// Stores one result item. `true` if it was new. An item after the run's stored terminal
    /// item is not stored (`false`): nothing follows a run's end. A new item with
    /// [`ends_run`](NewRunEvent::ends_run) ends its still active run, and one with a
    /// [`transcript`](NewRunEvent::transcript) row writes it, in the same commit.
    /// `not_found` if the run does not exist; `invalid_argument` if `sequence < 1` or the
    /// outcome's status is not terminal.
    async fn insert_event(&self, event: NewRunEvent) -> Result<bool>;

    /// Stores many result items (of any runs) in one transaction. Returns, per input item
    /// and in input order, whether it was new (a duplicate within the batch is new once;
    /// an item after its run's stored terminal item is not stored, as in `insert_event`).
    /// Each new item with [`ends_run`](NewRunEvent::ends_run) ends its still active run, and
    /// each with a [`transcript`](NewRunEvent::transcript) row writes it, in the same commit.
    async fn insert_events(&self, events: Vec<NewRunEvent>) -> Result<Vec<bool>>;

    /// Result items with `sequence > after_sequence`, ascending, at most `limit` (clamped to
    /// [1, 1000]).
    async fn events_after(
        &self,
        run_id: RunId,
        after_sequence: i64,
        limit: u64,
    ) -> Result<Vec<RunEventRecord>>;

    /// Active runs whose deadline is before `now`, earliest deadline first.
    async fn runs_past_deadline(&self, now: DateTime<Utc>, limit: u64) -> Result<Vec<RunRecord>>;

    /// Active runs without a deadline created before `created_before`, oldest first: the
    /// reaper bounds them by the deployment's `limits.run_max_duration`.
    async fn runs_without_deadline_created_before(
        &self,
        created_before: DateTime<Utc>,
        limit: u64,
    ) -> Result<Vec<RunRecord>>;

    /// Active runs of a conversation, oldest first (steering and concurrency policies).
    async fn active_runs_for_conversation(
        &self,
        workspace_id: &WorkspaceId,
        conversation_id: &str,
    ) -> Result<Vec<RunRecord>>;

    /// Retention: deletes the result items of up to `batch` runs that ended before
    /// `ended_before` and marks those runs `events_expired_at`. Returns how many runs.
    async fn expire_events(&self, ended_before: DateTime<Utc>, batch: u64) -> Result<u64>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_roundtrip_and_classify() {
        for s in [
            RunStatus::Queued,
            RunStatus::Running,
            RunStatus::Completed,
            RunStatus::Failed,
            RunStatus::Cancelled,
            RunStatus::Timeout,
            RunStatus::Interrupted,
        ] {
            assert_eq!(s.as_str().parse::<RunStatus>().unwrap(), s);
            assert_eq!(s.is_terminal(), !RunStatus::ACTIVE.contains(&s));
        }
    }
}
