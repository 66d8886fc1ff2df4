//! The ingest's group commit: `POST /v1/events` requests that arrive together are written
//! in one commit ([`EventLog::append_batch`]), and their outbox rows go straight to this
//! gateway's relay.
//!
//! ```text
//!  request ─┐                                   ┌─▶ 202 (each after the shared commit)
//!  request ─┼─▶ GroupCommit ─▶ append_batch ─────┤
//!  request ─┘   (one task)     (one statement)  └─▶ leased outbox rows ─▶ relay (no claim)
//! ```
//!
//! The guarantee of SPEC §2 step 1 is unchanged: a request is answered only after the
//! transaction holding its event and outbox row has committed. Batches form by themselves
//! ([`sb_common::group_commit`]): one request at a time costs one statement as before, and
//! under load each commit carries everything that arrived during the previous one.
//!
//! The rows are written leased to this gateway's relay only while the relay runs
//! ([`RelayHandle::is_attached`]); otherwise (a test driving the relay by hand) they are
//! written unleased and the relay is woken to claim them, as before the group commit.

use std::sync::Arc;
use std::time::Duration;

use sb_common::group_commit::GroupCommit;
use sb_store::StoreError;
use sb_store::events::{
    AppendRequest, Appended, EventLog, EventRecord, NewEvent, NewOutboxMessage,
};

use crate::error::ApiError;
use crate::relay::RelayHandle;

/// Most requests one commit carries: a bound on one statement's size, far above what two
/// cores ingest in one commit's time.
const MAX_BATCH: usize = 256;

/// The submitting side of the ingest's group commit. Cheap to clone.
#[derive(Clone)]
pub struct IngestWriter {
    group: GroupCommit<AppendRequest, Result<Appended, StoreError>>,
}

impl IngestWriter {
    /// Starts the committing task (on the current Tokio runtime). Rows are handed to
    /// `relay` leased for `handover_lease`.
    pub fn start(events: Arc<dyn EventLog>, relay: RelayHandle, handover_lease: Duration) -> Self {
        let group = GroupCommit::spawn(MAX_BATCH, move |batch: Vec<AppendRequest>| {
            let events = Arc::clone(&events);
            let relay = relay.clone();
            async move {
                let lease = relay.is_attached().then_some(handover_lease);
                let mut outcomes = events.append_batch(batch, lease).await;
                let mut leased = Vec::new();
                let mut claim = false;
                for appended in outcomes.iter_mut().flatten().filter(|a| a.created) {
                    // A created event without leased rows: no lease was asked for, or its
                    // row is due later; the relay claims those.
                    claim |= appended.leased.is_empty();
                    leased.append(&mut appended.leased);
                }
                relay.hand(leased);
                if claim {
                    relay.wake();
                }
                outcomes
            }
        });
        Self { group }
    }

    /// Appends `event` with its `outbox` messages, as [`EventLog::append`] does, in the next
    /// shared commit. Returns the stored event and whether this request created it.
    pub async fn append(
        &self,
        event: NewEvent,
        outbox: Vec<NewOutboxMessage>,
    ) -> Result<(EventRecord, bool), ApiError> {
        let appended = self
            .group
            .submit(AppendRequest { event, outbox })
            .await
            .map_err(ApiError::internal)??;
        Ok((appended.record, appended.created))
    }
}

#[cfg(test)]
mod tests {
    use sb_store::events::{NewEvent, NewOutboxMessage};
    use sb_store::testing::sqlite_memory_db;

    use super::*;
    use crate::relay::Attached;

    fn event(text: &str) -> NewEvent {
        let mut event = NewEvent::new(
            sb_protocol::ids::WorkspaceId::default_workspace(),
            "message.received",
            "api",
        );
        event.conversation_id = Some("c1".into());
        event.input_summary = Some(text.into());
        event
    }

    fn row(key: &str) -> Vec<NewOutboxMessage> {
        vec![NewOutboxMessage::new(
            "switchboard.events",
            key,
            b"{}".to_vec(),
        )]
    }

    #[tokio::test]
    async fn rows_go_to_a_running_relay_leased_and_are_claimed_otherwise() {
        let db = sqlite_memory_db().await;
        let relay = RelayHandle::new();
        let writer = IngestWriter::start(
            Arc::clone(&db.stores.events),
            relay.clone(),
            Duration::from_secs(60),
        );
        let claim = || db.stores.outbox.claim(100, Duration::from_secs(60));

        // No relay runs: written unleased, the relay is woken to claim.
        let (_, created) = writer.append(event("a"), row("a")).await.unwrap();
        assert!(created);
        assert!(relay.take_handed().is_empty());
        assert_eq!(claim().await.unwrap().len(), 1);

        // A relay runs: handed over leased, nothing to claim.
        let attached = Attached::new(&relay);
        let answers =
            futures::future::join_all(["b", "c", "d"].map(|k| writer.append(event(k), row(k))))
                .await;
        assert!(
            answers
                .iter()
                .all(|a| a.as_ref().is_ok_and(|(_, created)| *created))
        );
        let handed = relay.take_handed();
        let mut keys: Vec<_> = handed.iter().map(|r| r.routing_key.as_str()).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["b", "c", "d"]);
        assert!(claim().await.unwrap().is_empty());
        drop(attached);

        // A refused request is answered with its own error.
        let error = writer
            .append(event("e"), vec![NewOutboxMessage::new("", "e", Vec::new())])
            .await
            .map(|_| ())
            .unwrap_err();
        assert_eq!(error.code(), sb_protocol::error::ErrorCode::InvalidArgument);
    }
}
