//! The turn API's sessions and turn identities (SPEC §10.2, seed 004).
//!
//! A **session** is a conversation with one agent, fixed at creation (its conversation id
//! is [`session_conversation_id`]). A **turn** is one request of the session: its identity
//! `(session, idempotency key) → (request fingerprint, run id)` is stored in the same
//! transaction as the `message.received` event (and its outbox row) that starts it, so a
//! receipt is answered only once the request is durable, and a retry finds the same turn.
//! The turn id *is* the run id, chosen at receipt: the orchestrator creates the run under
//! the id the event carries (`metadata.turn.turn_id`).

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::{AgentId, EventId, RunId, WorkspaceId};
use serde_json::Value;
use uuid::Uuid;

use crate::error::Result;
use crate::events::{NewEvent, NewOutboxMessage};
use crate::page::Page;

/// The conversation id of session `session_id`: every turn of the session runs in it.
#[must_use]
pub fn session_conversation_id(session_id: Uuid) -> String {
    format!("session:{session_id}")
}

/// Key of [`TurnTag`] in the metadata of a turn's event envelope.
pub const TURN_METADATA_KEY: &str = "turn";

/// What a turn's `message.received` event carries in `metadata.turn`, set by the gateway
/// (ingest never lets a client set envelope metadata): the orchestrator routes the event to
/// `agent_id` whatever the scopes say, never lets it be absorbed as steering input, and
/// creates its run under `turn_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TurnTag {
    /// The session.
    pub session_id: Uuid,
    /// The turn id, which becomes the run id.
    pub turn_id: RunId,
    /// The session's agent.
    pub agent_id: AgentId,
}

impl TurnTag {
    /// The tag in an envelope's metadata, if any (a malformed one counts as none).
    #[must_use]
    pub fn from_metadata(metadata: &serde_json::Map<String, Value>) -> Option<Self> {
        metadata
            .get(TURN_METADATA_KEY)
            .and_then(|v| serde_json::from_value(v.clone()).ok())
    }
}

/// A session to create.
#[derive(Debug, Clone, PartialEq)]
pub struct NewTurnSession {
    /// Owning workspace.
    pub workspace_id: WorkspaceId,
    /// The agent every turn goes to.
    pub agent_id: AgentId,
    /// That agent's runner at creation.
    pub runner_id: String,
    /// Caller metadata (a JSON object), returned as given.
    pub metadata: Option<Value>,
}

/// A stored session.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnSessionRecord {
    /// Session id (UUID v7: creation order).
    pub id: Uuid,
    /// Owning workspace.
    pub workspace_id: WorkspaceId,
    /// The agent fixed at creation.
    pub agent_id: AgentId,
    /// Its runner at creation (`None` only for rows written before the column existed).
    pub runner_id: Option<String>,
    /// The conversation the turns run in.
    pub conversation_id: String,
    /// Caller metadata.
    pub metadata: Option<Value>,
    /// Set once closed: later turns are refused, history stays readable.
    pub closed_at: Option<DateTime<Utc>>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
}

/// A turn to start: its identity, and the event (with its outbox rows) that starts it.
#[derive(Debug, Clone, PartialEq)]
pub struct NewTurn {
    /// The session (of `event.workspace_id`).
    pub session_id: Uuid,
    /// The caller's idempotency key (1–128 chars of `[A-Za-z0-9-_.:]`).
    pub idempotency_key: String,
    /// sha256 hex of the normalized request.
    pub request_hash: String,
    /// The turn id (= run id) for a new turn.
    pub run_id: RunId,
    /// The `message.received` event, with no idempotency key of its own.
    pub event: NewEvent,
    /// Its announcement.
    pub outbox: Vec<NewOutboxMessage>,
}

/// A stored turn identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnRecord {
    /// The session.
    pub session_id: Uuid,
    /// The idempotency key.
    pub idempotency_key: String,
    /// The request fingerprint.
    pub request_hash: String,
    /// The turn id, which is the run id.
    pub run_id: RunId,
    /// The event that started the turn.
    pub event_id: Option<EventId>,
    /// Receipt time.
    pub created_at: DateTime<Utc>,
}

/// Sessions and turn identities.
///
/// # Contract
///
/// - Reads and writes are scoped by workspace: a session of another workspace is absent.
/// - [`start_turn`](Self::start_turn) is atomic: the identity, the event and its outbox rows
///   commit together or not at all. With the same `(session, key)`: the same fingerprint
///   returns the first turn with `created = false` and writes nothing; another fingerprint
///   fails with `conflict`. A closed session refuses new turns with `conflict` (a replay of
///   a turn accepted before the close still answers the first turn). No such session in the
///   workspace → `not_found`.
#[async_trait]
pub trait TurnStore: Send + Sync + 'static {
    /// Creates a session.
    async fn create_session(&self, session: NewTurnSession) -> Result<TurnSessionRecord>;

    /// The session `id` of `workspace_id`, closed or not.
    async fn get_session(
        &self,
        workspace_id: &WorkspaceId,
        id: Uuid,
    ) -> Result<Option<TurnSessionRecord>>;

    /// The workspace's sessions, oldest first; `limit` clamped to [1, 100].
    async fn list_sessions(
        &self,
        workspace_id: &WorkspaceId,
        cursor: Option<String>,
        limit: Option<i64>,
    ) -> Result<Page<TurnSessionRecord>>;

    /// Closes the session (idempotent: the first close time stays). `None` if absent.
    async fn close_session(
        &self,
        workspace_id: &WorkspaceId,
        id: Uuid,
    ) -> Result<Option<TurnSessionRecord>>;

    /// Starts a turn (see the contract). Returns the turn and whether it is new.
    async fn start_turn(&self, turn: NewTurn) -> Result<(TurnRecord, bool)>;

    /// The turn with this id (= run id), if any.
    async fn get_turn(&self, run_id: RunId) -> Result<Option<TurnRecord>>;

    /// Retention: deletes up to `batch` turn identities of sessions closed before
    /// `closed_before` and returns how many. Sessions that are not closed keep theirs; the
    /// session rows stay (their history is the transcript's, with its own retention). After
    /// it, the turn id no longer answers and the key may start a new turn.
    async fn delete_closed_identities(
        &self,
        closed_before: DateTime<Utc>,
        batch: u64,
    ) -> Result<u64>;
}
