//! The contract tests, one function per test, each taking a fresh [`TestDb`]. They are
//! grouped by store trait, one file per area; every test is re-exported here, so the
//! [`store_suite!`](crate::store_suite) macro and other crates call them as
//! `sb_store::testing::suite::<name>`. The helpers every area uses (fixtures of events and
//! runs, error-code assertions) live in this file.

use std::time::Duration;

use sb_protocol::error::{ErrorCode, HasErrorCode};
use sb_protocol::ids::{AgentId, EventId, RunId, WorkspaceId};
use serde_json::json;

use super::TestDb;
use crate::*;

mod agents;
mod artifacts;
mod events;
mod knowledge;
mod outbox;
mod run_items;
mod runs;
mod schedules;
mod state;
mod transcript;
mod turns;

pub use agents::*;
pub use artifacts::*;
pub use events::*;
pub use knowledge::*;
pub use outbox::*;
pub use run_items::*;
pub use runs::*;
pub use schedules::*;
pub use state::*;
pub use transcript::*;
pub use turns::*;

fn ws() -> WorkspaceId {
    WorkspaceId::new("ws-test").unwrap()
}

fn other_ws() -> WorkspaceId {
    WorkspaceId::new("ws-other").unwrap()
}

#[track_caller]
fn assert_code<T: std::fmt::Debug>(result: Result<T>, code: ErrorCode) {
    match result {
        Ok(v) => panic!("expected {code:?}, got Ok({v:?})"),
        Err(e) => assert_eq!(e.code(), code, "unexpected error: {e}"),
    }
}

fn message(conv: &str, text: &str) -> NewEvent {
    let mut e = NewEvent::new(ws(), "message.received", "host_adapter");
    e.conversation_id = Some(conv.to_owned());
    e.input_summary = Some(text.to_owned());
    e
}

fn outbox_msg(key: &str) -> NewOutboxMessage {
    NewOutboxMessage::new(
        "switchboard.events",
        key,
        format!("body-{key}").into_bytes(),
    )
}

async fn drain_outbox(db: &TestDb) -> Vec<OutboxMessage> {
    db.stores
        .outbox
        .claim(1000, Duration::from_secs(60))
        .await
        .unwrap()
}

fn new_run(conv: Option<&str>) -> NewRun {
    NewRun {
        id: None,
        workspace_id: ws(),
        event_id: EventId::new(),
        agent_id: Some(AgentId::new()),
        runner_id: "plugin:acme/echo/echo".into(),
        pool: "default".into(),
        conversation_id: conv.map(str::to_owned),
        thread_id: None,
        bot_id: Some("bot-1".into()),
        deadline_at: None,
        attempt: 1,
    }
}

/// The first ten stored items of run `run_id`.
async fn stored_items(db: &TestDb, run_id: RunId) -> Vec<RunEventRecord> {
    db.stores.runs.events_after(run_id, 0, 10).await.unwrap()
}

/// The transcript rows of conversation `conv` of [`ws`], oldest first.
async fn transcript_rows(db: &TestDb, conv: &str) -> Vec<TranscriptRecord> {
    db.stores
        .transcript
        .page(TranscriptQuery::new(ws(), conv))
        .await
        .unwrap()
        .items
}

/// A queued run of conversation `conv` (of no stored event), for tests of what follows a
/// run's creation (claims, items, ends).
pub async fn create_run(db: &TestDb, conv: Option<&str>) -> RunRecord {
    db.stores.runs.create_run(new_run(conv)).await.unwrap().0
}

fn run_event(run_id: RunId, sequence: i64, text: &str) -> NewRunEvent {
    NewRunEvent {
        run_id,
        sequence,
        result_type: "message.delta".into(),
        data: json!({"type": "message.delta", "data": {"chunk": text}}).into(),
        ends_run: None,
        transcript: None,
    }
}

// ---------------------------------------------------------------- general

/// Migrating an up-to-date database is a no-op, not an error.
pub async fn migrations_are_idempotent(db: &TestDb) {
    db.store.migrate().await.unwrap();
    db.store.migrate().await.unwrap();
}

/// The health probe answers.
pub async fn health_ping(db: &TestDb) {
    db.stores.health.ping().await.unwrap();
}
