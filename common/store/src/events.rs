//! The event log and the transactional outbox.
//!
//! The event log is the source of truth for every host event (SPEC §2): bus messages only
//! carry an `event_id` pointer. An event row and the outbox rows that announce it are
//! written in one transaction, so an accepted event is announced exactly when it exists.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::host::AgentEventEnvelope;
use sb_protocol::ids::{AgentId, EventId, RunId, WorkspaceId};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, StoreError};
use crate::page::{Page, ThreadFilter};

/// Longest stored `input_summary`, in characters; longer text is cut to 997 + `...`.
pub const MAX_INPUT_SUMMARY_CHARS: usize = 1000;
/// Longest idempotency key, in characters.
pub const MAX_IDEMPOTENCY_KEY_CHARS: usize = 128;

/// Key of [`EventTarget`] in the metadata of an event envelope.
pub const TARGET_METADATA_KEY: &str = "target";
/// Key of the requested delivery time (RFC 3339, UTC) in the metadata of a delayed event's
/// envelope and row.
pub const DELIVER_AT_METADATA_KEY: &str = "deliver_at";

/// What an event addressed to one agent (`agent_id` on `POST /v1/events`) carries in
/// `metadata.target`, set by the gateway after checking the agent (ingest never lets a
/// client set envelope metadata): the orchestrator routes the event to `agent_id` whatever
/// the scopes say (`sb_rules::bindings::resolve_target`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventTarget {
    /// The agent named by the request.
    pub agent_id: AgentId,
}

impl EventTarget {
    /// The target in an envelope's metadata, if any (a malformed one counts as none).
    #[must_use]
    pub fn from_metadata(metadata: &serde_json::Map<String, Value>) -> Option<Self> {
        metadata
            .get(TARGET_METADATA_KEY)
            .and_then(|v| serde_json::from_value(v.clone()).ok())
    }
}

/// Where an event stands in routing (SPEC §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum EventStatus {
    /// Written by ingest; not yet routed.
    Received,
    /// A run was created for it.
    Dispatched,
    /// Absorbed by an active run as steering input (`claimed_by_run_id` is set).
    Claimed,
    /// No binding matched (or several did: reason `binding.ambiguous`).
    Unrouted,
    /// Refused, e.g. by the `reject` concurrency policy.
    Rejected,
    /// Accepted for later delivery (`deliver_at`, schedules).
    Scheduled,
}

impl EventStatus {
    /// The stored / wire form.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Received => "received",
            Self::Dispatched => "dispatched",
            Self::Claimed => "claimed",
            Self::Unrouted => "unrouted",
            Self::Rejected => "rejected",
            Self::Scheduled => "scheduled",
        }
    }
}

impl FromStr for EventStatus {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "received" => Self::Received,
            "dispatched" => Self::Dispatched,
            "claimed" => Self::Claimed,
            "unrouted" => Self::Unrouted,
            "rejected" => Self::Rejected,
            "scheduled" => Self::Scheduled,
            other => {
                return Err(StoreError::invalid(format!(
                    "unknown event status: {other}"
                )));
            }
        })
    }
}

impl std::fmt::Display for EventStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An event to append. Build it with [`NewEvent::new`] and set the fields that apply.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    /// The primary key; `None` → a fresh UUID v7. Never a client-supplied value (a client
    /// `event_id` is an idempotency key).
    pub id: Option<EventId>,
    /// Owning workspace.
    pub workspace_id: WorkspaceId,
    /// Makes the append idempotent per workspace (1–128 chars of `[A-Za-z0-9-_.:]`).
    pub idempotency_key: Option<String>,
    /// Fingerprint of the normalized request (sha256 hex) stored with the idempotency key:
    /// a second append with the same key and another fingerprint is refused (`conflict`).
    /// `None` (internal events, rows older than fingerprints) → the key alone decides.
    pub request_hash: Option<String>,
    /// e.g. `message.received`, `artifact.created`, `steering.injected` (≤ 100 chars).
    pub event_type: String,
    /// e.g. `host_adapter`, `runner`, `agent_runner`, `host`, `api` (≤ 50 chars).
    pub source: String,
    /// When the event happened at its origin.
    pub event_time: Option<DateTime<Utc>>,
    /// Bot the event arrived through.
    pub bot_id: Option<String>,
    /// Conversation the event belongs to.
    pub conversation_id: Option<String>,
    /// Thread within the conversation.
    pub thread_id: Option<String>,
    /// Actor fields (who caused the event).
    pub actor_type: Option<String>,
    /// Actor id.
    pub actor_id: Option<String>,
    /// Actor display name.
    pub actor_name: Option<String>,
    /// Subject fields (what the event is about).
    pub subject_type: Option<String>,
    /// Subject id.
    pub subject_id: Option<String>,
    /// Human-readable summary; cut to [`MAX_INPUT_SUMMARY_CHARS`].
    pub input_summary: Option<String>,
    /// The normalised envelope (sanitised: no inline base64 payloads).
    pub envelope: Option<Value>,
    /// Reference to the raw payload stored as an artifact.
    pub raw_ref: Option<String>,
    /// Initial status, normally [`EventStatus::Received`].
    pub status: EventStatus,
    /// Why the event has its status.
    pub reason: Option<String>,
    /// Run this event belongs to (e.g. for `artifact.created`).
    pub run_id: Option<RunId>,
    /// Runner of that run.
    pub runner_id: Option<String>,
    /// Run that absorbed this event as steering input.
    pub claimed_by_run_id: Option<RunId>,
    /// Free-form metadata object (`{}` when empty).
    pub metadata: Value,
}

impl NewEvent {
    /// A `received` event with only the required fields set.
    #[must_use]
    pub fn new(
        workspace_id: WorkspaceId,
        event_type: impl Into<String>,
        source: impl Into<String>,
    ) -> Self {
        Self {
            id: None,
            workspace_id,
            idempotency_key: None,
            request_hash: None,
            event_type: event_type.into(),
            source: source.into(),
            event_time: None,
            bot_id: None,
            conversation_id: None,
            thread_id: None,
            actor_type: None,
            actor_id: None,
            actor_name: None,
            subject_type: None,
            subject_id: None,
            input_summary: None,
            envelope: None,
            raw_ref: None,
            status: EventStatus::Received,
            reason: None,
            run_id: None,
            runner_id: None,
            claimed_by_run_id: None,
            metadata: Value::Object(serde_json::Map::new()),
        }
    }
}

impl NewEvent {
    /// The event-log row of a normalized envelope (the gateway's ingest and a schedule's
    /// firing both write this): the envelope's id, type, source, scope, actor, subject and
    /// metadata become columns, the envelope itself is kept whole.
    pub fn from_envelope(
        envelope: &AgentEventEnvelope,
        idempotency_key: Option<String>,
        input_summary: String,
    ) -> Result<Self> {
        let e = envelope;
        let mut event = Self::new(
            e.workspace_id.clone(),
            e.event_type.clone(),
            e.source.clone(),
        );
        event.id = Some(e.event_id);
        event.idempotency_key = idempotency_key;
        event.event_time = e
            .event_time
            .and_then(|t| DateTime::<Utc>::from_timestamp(t, 0));
        event.bot_id.clone_from(&e.bot_id);
        event.conversation_id.clone_from(&e.conversation_id);
        event.thread_id.clone_from(&e.thread_id);
        if let Some(actor) = &e.actor {
            event.actor_type = Some(actor.actor_type.clone());
            event.actor_id.clone_from(&actor.actor_id);
            event.actor_name.clone_from(&actor.actor_name);
        }
        if let Some(subject) = &e.subject {
            event.subject_type = Some(subject.subject_type.clone());
            event.subject_id.clone_from(&subject.subject_id);
        }
        event.input_summary = Some(input_summary);
        event.envelope =
            Some(serde_json::to_value(e).map_err(|e| StoreError::Corrupt(e.to_string()))?);
        event.raw_ref = e.raw_ref.as_ref().map(|r| r.ref_id.clone());
        event.metadata = Value::Object(e.metadata.clone());
        Ok(event)
    }
}

/// Where an event stands in routing: the few columns of an [`EventRecord`] that change
/// while it is routed, without the envelope and metadata documents (read by
/// [`EventLog::routing`] when waiting for the route of an event).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventRouting {
    /// Owning workspace.
    pub workspace_id: WorkspaceId,
    /// Current status.
    pub status: EventStatus,
    /// Reason for the status.
    pub reason: Option<String>,
    /// The run it started (`dispatched`).
    pub run_id: Option<RunId>,
    /// The run that absorbed it as steering input (`claimed`).
    pub claimed_by_run_id: Option<RunId>,
}

impl From<&EventRecord> for EventRouting {
    fn from(record: &EventRecord) -> Self {
        Self {
            workspace_id: record.workspace_id.clone(),
            status: record.status,
            reason: record.reason.clone(),
            run_id: record.run_id,
            claimed_by_run_id: record.claimed_by_run_id,
        }
    }
}

/// A stored event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventRecord {
    /// Host-generated id.
    pub id: EventId,
    /// Position in the log: strictly increasing in insertion order, not dense.
    pub seq: i64,
    /// Opaque cursor of this event's position (for [`EventQuery`]).
    pub cursor: String,
    /// Owning workspace.
    pub workspace_id: WorkspaceId,
    /// The idempotency key it was appended with.
    pub idempotency_key: Option<String>,
    /// Event type.
    pub event_type: String,
    /// Source.
    pub source: String,
    /// Origin time.
    pub event_time: Option<DateTime<Utc>>,
    /// Bot.
    pub bot_id: Option<String>,
    /// Conversation.
    pub conversation_id: Option<String>,
    /// Thread.
    pub thread_id: Option<String>,
    /// Actor type.
    pub actor_type: Option<String>,
    /// Actor id.
    pub actor_id: Option<String>,
    /// Actor name.
    pub actor_name: Option<String>,
    /// Subject type.
    pub subject_type: Option<String>,
    /// Subject id.
    pub subject_id: Option<String>,
    /// Summary (≤ 1000 chars).
    pub input_summary: Option<String>,
    /// The normalised envelope.
    pub envelope: Option<Value>,
    /// Raw payload reference.
    pub raw_ref: Option<String>,
    /// Current status.
    pub status: EventStatus,
    /// Reason for the status.
    pub reason: Option<String>,
    /// Associated run.
    pub run_id: Option<RunId>,
    /// Runner of the associated run.
    pub runner_id: Option<String>,
    /// Run that absorbed the event as steering input.
    pub claimed_by_run_id: Option<RunId>,
    /// Metadata object (`{}` when none).
    pub metadata: Value,
    /// Insert time.
    pub created_at: DateTime<Utc>,
    /// Last status change.
    pub updated_at: DateTime<Utc>,
}

/// A status change. Fields left `None` keep their stored value.
#[derive(Debug, Clone, PartialEq)]
pub struct EventStatusUpdate {
    /// New status (any status may follow any other; the caller owns the lifecycle).
    pub status: EventStatus,
    /// New reason.
    pub reason: Option<String>,
    /// Run created for the event.
    pub run_id: Option<RunId>,
    /// Run that claimed the event.
    pub claimed_by_run_id: Option<RunId>,
    /// Object whose top-level keys are written over the stored metadata's keys (a key with
    /// a `null` value removes it). Must be a JSON object.
    pub metadata_merge: Option<Value>,
}

impl EventStatusUpdate {
    /// Only a status change.
    #[must_use]
    pub fn status(status: EventStatus) -> Self {
        Self {
            status,
            reason: None,
            run_id: None,
            claimed_by_run_id: None,
            metadata_merge: None,
        }
    }
}

/// A paged read of the event log.
#[derive(Debug, Clone, PartialEq)]
pub struct EventQuery {
    /// Workspace to read (reads never cross workspaces).
    pub workspace_id: WorkspaceId,
    /// Only this conversation.
    pub conversation_id: Option<String>,
    /// Thread filter.
    pub thread: ThreadFilter,
    /// Only this bot.
    pub bot_id: Option<String>,
    /// Only these event types (empty = all).
    pub event_types: Vec<String>,
    /// Only events strictly older than this cursor.
    pub before_cursor: Option<String>,
    /// Only events strictly newer than this cursor; switches the order to oldest first.
    pub after_cursor: Option<String>,
    /// Page size, clamped to [1, 100]; default 50.
    pub limit: Option<i64>,
}

impl EventQuery {
    /// The newest events of a workspace, default page size.
    #[must_use]
    pub fn new(workspace_id: WorkspaceId) -> Self {
        Self {
            workspace_id,
            conversation_id: None,
            thread: ThreadFilter::Any,
            bot_id: None,
            event_types: Vec::new(),
            before_cursor: None,
            after_cursor: None,
            limit: None,
        }
    }
}

/// A message to publish after the surrounding transaction commits.
#[derive(Debug, Clone, PartialEq)]
pub struct NewOutboxMessage {
    /// Exchange to publish to.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Message body (JSON bytes for our messages).
    pub body: Vec<u8>,
    /// Message properties / headers for the publisher, if any.
    pub headers: Option<Value>,
    /// Not before this time (delayed delivery); `None` = immediately.
    pub available_at: Option<DateTime<Utc>>,
}

impl NewOutboxMessage {
    /// An immediately available message without headers.
    #[must_use]
    pub fn new(exchange: impl Into<String>, routing_key: impl Into<String>, body: Vec<u8>) -> Self {
        Self {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            body,
            headers: None,
            available_at: None,
        }
    }
}

/// One request of [`EventLog::append_batch`]: an event and the outbox messages announcing it.
#[derive(Debug, Clone, PartialEq)]
pub struct AppendRequest {
    /// The event.
    pub event: NewEvent,
    /// Its outbox messages, written in the event's transaction.
    pub outbox: Vec<NewOutboxMessage>,
}

/// What [`EventLog::append_batch`] did for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Appended {
    /// The stored event (the first one, for a repeated idempotency key).
    pub record: EventRecord,
    /// Whether this request created it.
    pub created: bool,
    /// The request's outbox rows that were written already leased (see
    /// [`EventLog::append_batch`]), in order: the caller publishes them and then marks them
    /// published or releases them, as after an [`Outbox::claim`]. Empty without a lease, for
    /// a replay, and for rows available only later.
    pub leased: Vec<OutboxMessage>,
}

/// A claimed outbox row.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxMessage {
    /// Row id: increasing in enqueue order.
    pub id: i64,
    /// Exchange.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Body.
    pub body: Vec<u8>,
    /// Headers.
    pub headers: Option<Value>,
    /// Enqueue time.
    pub created_at: DateTime<Utc>,
    /// Earliest publish time.
    pub available_at: DateTime<Utc>,
    /// The lease of this claim ends here.
    pub locked_until: Option<DateTime<Utc>>,
    /// How many times the row was claimed, this claim included.
    pub attempts: i64,
}

/// The append-only log of host events.
///
/// # Contract
///
/// - **Positions.** The store assigns every appended event a `seq` that is strictly greater
///   than that of every event appended before it (globally, not per conversation, and not
///   dense: gaps appear when a transaction rolls back). Concurrent appends may *commit* out
///   of `seq` order, so a reader polling "after my last seq" can in rare races skip an
///   event committed late; paged reads are for history, the bus is for delivery.
/// - **Cursors.** `EventRecord::cursor` and `Page` cursors are opaque, tagged positions:
///
///   ```text
///   seq:        1    2    3    5    8    9
///                         ^ cursor c (seq 3)
///   before c:   [2, 1]               newest first
///   after c:    [5, 8, 9]            oldest first
///   ```
///
///   A cursor from another sequence (history, state) or a malformed one is
///   `invalid_argument`.
/// - **Durability.** `append` returns only after the transaction holding the event *and* its
///   outbox rows has committed: either both exist or neither does.
#[async_trait]
pub trait EventLog: Send + Sync + 'static {
    /// Appends `event` and enqueues `outbox` in one transaction.
    ///
    /// With an idempotency key, a second append with the same `(workspace, key)` writes
    /// nothing (no event, no outbox rows) and returns the first event with
    /// `created = false` — also when both appends race. When both appends carry a
    /// `request_hash` and the hashes differ, the second fails with `conflict` instead
    /// (same key, different request: seed 004). `input_summary` is cut to 997
    /// characters + `...` when longer than 1000.
    async fn append(
        &self,
        event: NewEvent,
        outbox: Vec<NewOutboxMessage>,
    ) -> Result<(EventRecord, bool)>;

    /// Appends every request of `batch` as [`append`](Self::append) would, in **one** commit
    /// where the backend allows (group commit: concurrent ingests share a transaction and, on
    /// Postgres, one statement). Returns one outcome per request, in order.
    ///
    /// - **Isolation of failures.** A request that fails (validation, a reused idempotency
    ///   key with another request) fails alone: the others are written as if it had not been
    ///   in the batch.
    /// - **Idempotency** as for `append`, also between requests of one batch: the first
    ///   request with a key creates the event, a later one gets it back (`created = false`).
    /// - **Leased outbox rows.** With `lease`, the outbox rows that are available now are
    ///   written as [`Outbox::claim`] would leave them after claiming them for `lease`
    ///   (`locked_until` set, `attempts = 1`) and are returned in [`Appended::leased`], so
    ///   the caller publishes them without a claim. If it never does, the lease runs out and
    ///   any relay claims them: nothing committed is lost. Without `lease` the rows are
    ///   written unleased, as by `append`.
    /// - **Durability.** Returns only after the writes of every created event have
    ///   committed.
    async fn append_batch(
        &self,
        batch: Vec<AppendRequest>,
        lease: Option<Duration>,
    ) -> Vec<Result<Appended>>;

    /// The event with this id, if any.
    async fn get(&self, id: EventId) -> Result<Option<EventRecord>>;

    /// [`get`](Self::get) of each of `ids` in one read, answered by position (`None` where
    /// there is no such event): the router loads the events it routes side by side so.
    async fn get_many(&self, ids: &[EventId]) -> Result<Vec<Option<EventRecord>>>;

    /// The routing state of the event with this id, if any: what [`get`](Self::get) says
    /// about it, read without the large documents (a stream waiting for the route reads it
    /// repeatedly).
    async fn routing(&self, id: EventId) -> Result<Option<EventRouting>> {
        Ok(self.get(id).await?.as_ref().map(EventRouting::from))
    }

    /// Changes an event's status (and optionally reason, run ids, metadata) atomically:
    /// concurrent metadata merges do not lose each other's keys. `not_found` if there is no
    /// such event. Returns the updated event.
    async fn update_status(&self, id: EventId, update: EventStatusUpdate) -> Result<EventRecord>;

    /// One page of events: newest first, or oldest first when `after_cursor` is set (both
    /// cursors together bound the range). `invalid_argument` when a cursor is bad.
    async fn page(&self, query: EventQuery) -> Result<Page<EventRecord>>;

    /// One page of the events in `status`, across every workspace, oldest first (ascending
    /// `seq`). Pass a page's `next_cursor` back as `cursor` to read on from its last event;
    /// `limit` is clamped to [1, 100] (default 50). `invalid_argument` when the cursor is
    /// bad (event cursors of [`page`](Self::page) are positions in the same order and are
    /// accepted).
    ///
    /// For passes over the whole log rather than a workspace's history: the embedded
    /// mode's start-up recovery republishes every event still `received`, however many a
    /// long outage left.
    ///
    /// - **Stable under change.** The cursor is a position, not an offset: events that
    ///   leave or enter `status` while a caller pages never make a later page skip or
    ///   repeat an event that kept its status. An event appended meanwhile in `status`
    ///   appears on a later page (its `seq` is higher), subject to the commit-order caveat
    ///   of the contract above.
    /// - **Cost.** `status` has no index: a page walks the log in `seq` order from its
    ///   cursor until it has found `limit` events, so reading every page costs about one
    ///   scan of the log, not one per page. Not for hot paths.
    async fn with_status(
        &self,
        status: EventStatus,
        cursor: Option<String>,
        limit: Option<i64>,
    ) -> Result<Page<EventRecord>>;

    /// Deletes up to `batch` events created before `before` (retention). Returns how many.
    async fn delete_older_than(&self, before: DateTime<Utc>, batch: u64) -> Result<u64>;
}

/// The transactional outbox: messages that must be published because a transaction
/// committed (SPEC §2: "an accepted event is never lost even if the broker is down").
///
/// # Contract
///
/// - Rows are enqueued by [`EventLog::append`] (in the event's transaction) or by
///   [`Outbox::enqueue`]. Ids increase in enqueue order.
/// - [`Outbox::claim`] leases rows: a row is handed to one relay at a time, until
///   `mark_published`, `release`, or the lease expiring. Two relays claiming concurrently
///   never receive the same row while its lease runs (Postgres: `FOR UPDATE SKIP LOCKED` and
///   a conditional update; SQLite: a single atomic `UPDATE … RETURNING`).
/// - Delivery is at-least-once: a relay that publishes and dies before `mark_published` (or
///   whose lease expired mid-publish) lets the row be published again. Consumers dedupe.
/// - Within one claim, rows are ordered by id; across relays there is no global order.
#[async_trait]
pub trait Outbox: Send + Sync + 'static {
    /// Enqueues messages outside any event append (e.g. a job publish that must follow a
    /// run insert). Returns the new row ids, in order.
    async fn enqueue(&self, messages: Vec<NewOutboxMessage>) -> Result<Vec<i64>>;

    /// Leases up to `limit` (clamped to [1, 1000]) unpublished rows that are available now
    /// and not leased by anyone else, for `lease`. Increments each row's `attempts`.
    async fn claim(&self, limit: u64, lease: Duration) -> Result<Vec<OutboxMessage>>;

    /// Marks rows published (after the broker confirmed them). Idempotent.
    async fn mark_published(&self, ids: &[i64]) -> Result<()>;

    /// Gives leased rows back so any relay can claim them again at once (publish failed).
    async fn release(&self, ids: &[i64]) -> Result<()>;

    /// How many rows are not yet published (leased or not): the `sb_outbox_pending` gauge.
    async fn pending(&self) -> Result<u64>;

    /// Deletes up to `batch` rows published before `before`. Returns how many.
    async fn delete_published_before(&self, before: DateTime<Utc>, batch: u64) -> Result<u64>;
}

/// Cuts `text` to at most `max` characters, ending a cut text with `...`.
#[must_use]
pub fn truncate_chars(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let keep = max.saturating_sub(3);
    let mut out: String = text.chars().take(keep).collect();
    out.push_str("...");
    out
}

/// Whether `key` is a valid idempotency key: 1–128 chars of `[A-Za-z0-9-_.:]`.
#[must_use]
pub fn is_valid_idempotency_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= MAX_IDEMPOTENCY_KEY_CHARS
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_short_text_and_marks_cuts() {
        assert_eq!(truncate_chars("hello", 1000), "hello");
        let exact = "x".repeat(1000);
        assert_eq!(truncate_chars(&exact, 1000), exact);
        let cut = truncate_chars(&"é".repeat(1001), 1000);
        assert_eq!(cut.chars().count(), 1000);
        assert!(cut.ends_with("..."));
        assert!(cut.starts_with(&"é".repeat(997)));
    }

    #[test]
    fn idempotency_keys() {
        assert!(is_valid_idempotency_key("a-b_c.d:e"));
        assert!(is_valid_idempotency_key(&"k".repeat(128)));
        assert!(!is_valid_idempotency_key(""));
        assert!(!is_valid_idempotency_key(&"k".repeat(129)));
        assert!(!is_valid_idempotency_key("has space"));
        assert!(!is_valid_idempotency_key("ünïcode"));
    }

    #[test]
    fn statuses_roundtrip() {
        for s in [
            EventStatus::Received,
            EventStatus::Dispatched,
            EventStatus::Claimed,
            EventStatus::Unrouted,
            EventStatus::Rejected,
            EventStatus::Scheduled,
        ] {
            assert_eq!(s.as_str().parse::<EventStatus>().unwrap(), s);
        }
        assert!("nope".parse::<EventStatus>().is_err());
    }
}
