//! Switchboard persistence: the store traits every role talks to, each with a written
//! contract, and [`SqlStore`], the one sea-orm implementation of all of them for PostgreSQL
//! (cluster mode) and SQLite (embedded mode).
//!
//! Roles hold a [`Stores`] bundle of `Arc<dyn Trait>`s and never see SQL, so tests and
//! future backends can swap implementations per trait. The schema itself lives in
//! `sb-migrations`; [`SqlStore::connect`] can apply it.
//!
//! Conventions shared by every trait:
//! - **Errors:** one [`StoreError`]; expected outcomes (`not_found`, `conflict`,
//!   `invalid_argument`, `payload_too_large`) are variants callers branch on, and
//!   [`sb_protocol::error::HasErrorCode`] maps every variant to the protocol code.
//! - **Pages:** [`Page`] with opaque, tagged cursors; limits are clamped to `[1, 100]`.
//! - **Time:** `chrono::DateTime<Utc>` with microsecond precision (what both databases
//!   store), so values read back compare equal to what was written.
//! - **Positions** (`seq`, result `sequence`, state `revision`) are assigned by the store,
//!   except result sequences, which the worker assigns; each trait says which.
//!
//! # Layout
//! - [`events`]: [`EventLog`] (append-only host events) and [`Outbox`] (transactional outbox).
//! - [`runs`]: [`RunLedger`] (runs, result items, claims, cancellation, deadlines).
//! - [`transcript`]: [`Transcript`] (conversation history, paging, full-text search).
//! - [`artifacts`]: [`ArtifactStore`] (verified content, ranged reads, expiry).
//! - [`state`]: [`StateStore`] (scoped JSON with compare-and-set) and [`BlobStorage`].
//! - [`agents`]: [`AgentStore`], [`RunnerRegistry`], [`Tenancy`] (workspaces, API keys).
//! - [`resources`]: [`ResourceRegistry`] (models, tools, knowledge bases, documents,
//!   chunking and knowledge search).
//! - [`schedules`]: [`ScheduleStore`] (interval / cron / one-shot triggers, fired
//!   exactly once per fire time together with the event they ingest) and the pure
//!   fire-time computation [`ScheduleSpec`].
//! - [`turns`]: [`TurnStore`] (the turn API's sessions, and turn identities committed with
//!   the event that starts the turn) and [`TurnTag`], what a turn's event carries.
//! - [`page`]: [`Page`], cursors, limit clamping, [`ThreadFilter`].
//! - [`audit`]: builders of the event-log audit rows of steering input
//!   (`steering.injected`, `steering.dropped`), shared by the worker and the orchestrator.
//! - [`redact`]: redaction of inline payloads in persisted copies of inputs.
//! - [`error`]: [`StoreError`] and its code mapping.
//! - `sql/`: [`SqlStore`] — connection setup, entities, one file per trait group, the
//!   transcript's FTS5 query builder and the knowledge base search (stemmed, any-term,
//!   ranked the same way on both backends).
//! - `testing` (feature `test-util`): the `store_suite!` conformance suite and per-test
//!   database constructors (SQLite file / in-memory, fresh Postgres schema).

pub mod agents;
pub mod artifacts;
pub mod audit;
pub mod error;
pub mod events;
pub mod page;
pub mod redact;
pub mod resources;
pub mod runs;
pub mod schedules;
mod sql;
pub mod state;
mod stores;
pub mod transcript;
pub mod turns;

#[cfg(any(test, feature = "test-util"))]
pub mod testing;

pub use agents::{
    AgentRouting, AgentRow, AgentStore, ApiKeyRecord, ApiKeyRole, AuthenticatedKey, NewAgent,
    NewApiKey, RunnerRegistry, RunnerRow, Tenancy, UnknownApiKeyRole,
};
pub use artifacts::{
    ArtifactContent, ArtifactRead, ArtifactRecord, ArtifactScope, ArtifactStore, NewArtifact,
};
pub use error::{Result, StoreError};
pub use events::{
    AppendRequest, Appended, DELIVER_AT_METADATA_KEY, EventLog, EventQuery, EventRecord,
    EventRouting, EventStatus, EventStatusUpdate, EventTarget, NewEvent, NewOutboxMessage, Outbox,
    OutboxMessage, TARGET_METADATA_KEY,
};
pub use page::{Page, ThreadFilter};
pub use resources::{
    DocumentEdit, KbDocumentRecord, KbHit, KbSearch, KnowledgeBaseRecord, ModelKind, ModelRecord,
    NewKbDocument, NewModel, NewTool, ResourceRegistry, ToolRecord,
};
pub use runs::{
    CancelOutcome, Finalized, ItemJson, NewRun, NewRunEvent, RunEventRecord, RunFilter, RunLedger,
    RunOutcome, RunRecord, RunStart, RunStatus, StartReads, StartedRun,
};
pub use schedules::{
    NewSchedule, ScheduleEdit, ScheduleFiring, ScheduleKind, ScheduleRecord, ScheduleSpec,
    ScheduleStore, ScheduledEvent,
};
pub use sql::{DEFAULT_MAX_ARTIFACT_BYTES, SqlStore, SqlStoreOptions, StoreLimits};
pub use state::{BlobStorage, StateEntry, StateStore, StateWrite};
pub use stores::{Health, Stores};
pub use transcript::{
    Direction, NewTranscriptItem, Transcript, TranscriptQuery, TranscriptRecord, TranscriptSearch,
};
pub use turns::{
    NewTurn, NewTurnSession, TURN_METADATA_KEY, TurnRecord, TurnSessionRecord, TurnStore, TurnTag,
    session_conversation_id,
};
