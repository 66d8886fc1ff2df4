//! `event_get` and `event_page`: the event log as the stable `AgentEventRecord` projection
//! (no envelope, no run or runner ids).
//!
//! `event_get` access (host-behaviour §22.2): an event of another workspace does not exist
//! for the run; an event of this run is always visible; otherwise the run must have a
//! conversation and the event must be in it, with the same bot (when the run has one) and
//! exactly the same thread.

use sb_protocol::error::AgentApiError;
use sb_protocol::host::AuthorizationSnapshot;
use sb_protocol::ids::EventId;
use sb_protocol::proxy::{AgentEventRecord, EventPage};
use sb_store::{EventQuery, EventRecord};
use serde_json::Value;

use super::history::{resolve_conversation, thread_of};
use super::params::page_limit;
use super::{ActionDispatcher, Cx, answer, api_not_granted, not_found, store_error, unauthorized};

/// Whether a run may see a stored row (events and artifacts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Visible.
    Allowed,
    /// Exists for the run's tenant but lies outside its scope: `unauthorized`.
    Denied,
    /// Belongs to another workspace: answered as `not_found`, so tenants cannot probe
    /// each other's ids.
    Hidden,
}

/// The `event_get` access rule (see the module docs).
pub(crate) fn event_access(event: &EventRecord, snapshot: &AuthorizationSnapshot) -> Access {
    if event.workspace_id != snapshot.workspace_id {
        return Access::Hidden;
    }
    if event.run_id == Some(snapshot.run_id) {
        return Access::Allowed;
    }
    let Some(conversation) = snapshot.conversation_id.as_deref() else {
        return Access::Denied;
    };
    let same_conversation = event.conversation_id.as_deref() == Some(conversation);
    let same_bot = snapshot.bot_id.is_none() || event.bot_id == snapshot.bot_id;
    let same_thread = event.thread_id == snapshot.thread_id;
    if same_conversation && same_bot && same_thread {
        Access::Allowed
    } else {
        Access::Denied
    }
}

/// The runner-visible projection of an event row.
pub(crate) fn event_record(event: EventRecord) -> AgentEventRecord {
    AgentEventRecord {
        event_id: event.id.to_string(),
        event_type: event.event_type,
        event_time: event.event_time.map(|t| t.timestamp()),
        source: event.source,
        bot_id: event.bot_id,
        workspace_id: Some(event.workspace_id.to_string()),
        conversation_id: event.conversation_id,
        thread_id: event.thread_id,
        actor_type: event.actor_type,
        actor_id: event.actor_id,
        actor_name: event.actor_name,
        subject_type: event.subject_type,
        subject_id: event.subject_id,
        input_summary: event.input_summary,
        input_ref: None,
        raw_ref: event.raw_ref,
        seq: Some(event.seq),
        cursor: Some(event.cursor),
        created_at: Some(event.created_at.timestamp()),
        metadata: match event.metadata {
            Value::Object(map) => map,
            _ => serde_json::Map::new(),
        },
    }
}

impl ActionDispatcher {
    pub(super) async fn event_get(&self, cx: &Cx<'_, '_>) -> Result<Value, AgentApiError> {
        let snap = cx.call.snapshot;
        // 4
        if !snap.available_apis.event_get {
            return Err(api_not_granted("event get"));
        }
        // 6 (the scope, step 5, lives on the row)
        let event_id = cx.p.req_str("event_id")?;
        // 7
        self.admit(cx).await?;

        let missing = || not_found(format!("event {event_id} not found"));
        // Ids are opaque to runners: one this host could never have issued does not exist.
        let Ok(id) = event_id.parse::<EventId>() else {
            return Err(missing());
        };
        let event = self
            .stores
            .events
            .get(id)
            .await
            .map_err(|e| store_error(&e))?
            .ok_or_else(missing)?;
        // 5
        match event_access(&event, snap) {
            Access::Allowed => answer(&event_record(event)),
            Access::Denied => Err(unauthorized(format!(
                "event {event_id} is not accessible by this run"
            ))),
            Access::Hidden => Err(missing()),
        }
    }

    pub(super) async fn event_page(&self, cx: &Cx<'_, '_>) -> Result<Value, AgentApiError> {
        let snap = cx.call.snapshot;
        let p = cx.p;
        // 4
        if !snap.available_apis.event_page {
            return Err(api_not_granted("event page"));
        }
        // 5
        let conversation = resolve_conversation(snap, p.opt_str("conversation_id")?, "event page")?;
        // 6
        let event_types = p.opt_str_list("event_types")?;
        let before_cursor = p.opt_str("before_cursor")?.map(str::to_owned);
        let limit = page_limit(
            p,
            "limit",
            self.limits.page_size_default,
            self.limits.page_size_max,
        )?;
        // 7
        self.admit(cx).await?;

        let Some(conversation_id) = conversation else {
            return answer(&EventPage::default());
        };
        let query = EventQuery {
            workspace_id: snap.workspace_id.clone(),
            conversation_id: Some(conversation_id),
            thread: thread_of(snap),
            bot_id: snap.bot_id.clone(),
            event_types,
            before_cursor,
            after_cursor: None,
            limit: Some(limit),
        };
        let page = self
            .stores
            .events
            .page(query)
            .await
            .map_err(|e| store_error(&e))?;
        // Pages only go backwards (newest first), so there is no previous cursor to offer.
        answer(&EventPage {
            items: page.items.into_iter().map(event_record).collect(),
            next_cursor: page.next_cursor,
            prev_cursor: None,
            has_more: page.has_more,
            total_count: None,
        })
    }
}
