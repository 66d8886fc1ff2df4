//! Turn store contract tests: turn sessions, and turn identities committed with the event
//! that starts the turn.

use sb_protocol::error::ErrorCode;
use sb_protocol::ids::{AgentId, EventId, RunId, WorkspaceId};
use serde_json::json;

use super::{assert_code, drain_outbox, message, other_ws, outbox_msg, ws};
use crate::testing::TestDb;
use crate::*;

/// Sessions are per workspace and paged; a turn identity commits with its event; the
/// same key replays or conflicts; a closed session takes no new turn.
pub async fn turn_sessions_and_turn_identities(db: &TestDb) {
    let turns = &db.stores.turns;
    let new_session = |workspace_id: WorkspaceId| NewTurnSession {
        workspace_id,
        agent_id: AgentId::new(),
        runner_id: "plugin:acme/echo/default".into(),
        metadata: Some(json!({"app": "x"})),
    };
    let a = turns.create_session(new_session(ws())).await.unwrap();
    let b = turns.create_session(new_session(ws())).await.unwrap();
    let theirs = turns.create_session(new_session(other_ws())).await.unwrap();
    assert_eq!(a.conversation_id, session_conversation_id(a.id));
    assert_eq!(a.runner_id.as_deref(), Some("plugin:acme/echo/default"));
    assert!(turns.get_session(&ws(), theirs.id).await.unwrap().is_none());
    let page = turns.list_sessions(&ws(), None, Some(1)).await.unwrap();
    assert_eq!(page.items, vec![a.clone()]);
    assert!(page.has_more);
    let page = turns
        .list_sessions(&ws(), page.next_cursor, Some(10))
        .await
        .unwrap();
    assert_eq!(page.items, vec![b.clone()]);
    assert!(!page.has_more);

    let turn = |key: &str, hash: char| {
        let mut event = message(&a.conversation_id, "hi");
        event.id = Some(EventId::new());
        NewTurn {
            session_id: a.id,
            idempotency_key: key.into(),
            request_hash: hash.to_string().repeat(64),
            run_id: RunId::new(),
            event,
            outbox: vec![outbox_msg("turn")],
        }
    };
    let first = turn("k1", 'a');
    let (record, created) = turns.start_turn(first.clone()).await.unwrap();
    assert!(created);
    assert_eq!(record.run_id, first.run_id);
    assert_eq!(record.event_id, first.event.id);
    assert!(
        db.stores
            .events
            .get(first.event.id.unwrap())
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(
        turns.get_turn(first.run_id).await.unwrap(),
        Some(record.clone())
    );
    let (replayed, created) = turns.start_turn(turn("k1", 'a')).await.unwrap();
    assert!(!created);
    assert_eq!(replayed, record);
    assert_code(turns.start_turn(turn("k1", 'b')).await, ErrorCode::Conflict);
    assert_code(
        turns.start_turn(turn("bad key", 'a')).await,
        ErrorCode::InvalidArgument,
    );
    assert_eq!(drain_outbox(db).await.len(), 1, "one event announced");

    // Another workspace's session is not found.
    let mut foreign = turn("k2", 'a');
    foreign.session_id = theirs.id;
    assert_code(turns.start_turn(foreign).await, ErrorCode::NotFound);

    // Closed: idempotent; replays still answer, new turns conflict.
    let closed = turns.close_session(&ws(), a.id).await.unwrap().unwrap();
    assert!(closed.closed_at.is_some());
    let again = turns.close_session(&ws(), a.id).await.unwrap().unwrap();
    assert_eq!(again.closed_at, closed.closed_at);
    assert_eq!(turns.start_turn(turn("k1", 'a')).await.unwrap().0, record);
    assert_code(turns.start_turn(turn("k3", 'a')).await, ErrorCode::Conflict);
    assert!(
        turns
            .close_session(&other_ws(), a.id)
            .await
            .unwrap()
            .is_none()
    );
}
