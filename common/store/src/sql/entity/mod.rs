//! sea-orm entities, one per table the store reads or writes. They mirror the migrations in
//! `sb-migrations` (which remain the schema's source of truth) and never leave the crate:
//! the public API speaks in the record types of the trait modules.

pub mod agent;
pub mod agent_state;
pub mod api_key;
pub mod artifact;
pub mod artifact_blob;
pub mod event_log;
pub mod kb_chunk;
pub mod kb_document;
pub mod knowledge_base;
pub mod model;
pub mod outbox;
pub mod run;
pub mod run_event;
pub mod runner;
pub mod schedule;
pub mod storage;
pub mod tool;
pub mod transcript;
pub mod turn_idempotency;
pub mod turn_session;
pub mod workspace;
