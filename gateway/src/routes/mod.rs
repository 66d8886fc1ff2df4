//! Handlers, one file per resource. Shared helpers for views live here.

pub mod agents;
pub mod artifacts;
pub mod conversations;
pub mod events;
pub mod health;
pub mod host;
pub mod keys;
pub mod resources;
pub mod runners;
pub mod runs;
pub mod schedules;
pub mod sessions;
pub mod turns;

use std::str::FromStr;

use chrono::{DateTime, Utc};
use sb_common::bus::topology::Topology;
use sb_protocol::host::AgentEventEnvelope;
use sb_store::NewOutboxMessage;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;

/// A page of a list endpoint: `{items, next_cursor, has_more}`. `next_cursor` is opaque and
/// set only when `has_more`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ListPage<T> {
    /// The items.
    pub items: Vec<T>,
    /// Pass as `cursor` to get the next page.
    pub next_cursor: Option<String>,
    /// More items exist past this page.
    pub has_more: bool,
}

/// The paging query every list endpoint takes: `?limit=&cursor=`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct PageQuery {
    /// Continue after this cursor (the `next_cursor` of the previous page).
    pub cursor: Option<String>,
    /// Page size (default `limits.page_size_default`), clamped to [1, `limits.page_size_max`].
    pub limit: Option<u64>,
}

/// The outbox row announcing an accepted event on the events exchange
/// ([`Topology::event_announcement`], the one rule ingest and the scheduler share), stored
/// with the event in one transaction for the relay to publish.
pub(crate) fn event_outbox(topology: &Topology, envelope: &AgentEventEnvelope) -> NewOutboxMessage {
    let announcement = topology.event_announcement(
        &envelope.workspace_id,
        envelope.event_id,
        envelope.conversation_id.as_deref(),
    );
    NewOutboxMessage::new(
        announcement.exchange,
        announcement.routing_key,
        announcement.body,
    )
}

/// Pages a list the store reads whole: a workspace's registry (agents, keys, models, tools,
/// knowledge bases, documents, runners), which an administrator configures and so stays
/// small. It pages exactly like the store-paged lists: ordered by a unique `key`, `cursor` is
/// the key of the last item of the previous page (JSON, opaque to clients), so an item that
/// exists on both reads is neither repeated nor skipped when others are added or removed in
/// between.
pub(crate) fn page_by_key<T, K>(
    mut items: Vec<T>,
    key: impl Fn(&T) -> K,
    cursor: Option<&str>,
    limit: u64,
) -> Result<ListPage<T>, ApiError>
where
    K: Ord + Serialize + DeserializeOwned,
{
    items.sort_by_key(&key);
    let start = match cursor {
        Some(cursor) => {
            let after: K = serde_json::from_str(cursor).map_err(|_| {
                ApiError::invalid("invalid `cursor`: pass a `next_cursor` back as is")
            })?;
            items.partition_point(|item| key(item) <= after)
        }
        None => 0,
    };
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    let mut items = items.split_off(start.min(items.len()));
    let has_more = items.len() > limit;
    items.truncate(limit);
    let next_cursor = match items.last() {
        Some(last) if has_more => {
            Some(serde_json::to_string(&key(last)).map_err(ApiError::internal)?)
        }
        _ => None,
    };
    Ok(ListPage {
        items,
        next_cursor,
        has_more,
    })
}

/// Timestamps on the wire are epoch seconds (DESIGN-NOTES, Time).
pub(crate) fn epoch(at: DateTime<Utc>) -> i64 {
    at.timestamp()
}

/// The `*_ms` companions of a run's and an event's times: epoch milliseconds, so the path of
/// a run (ingest → routed → started → ended) can be read from the API, where whole seconds
/// hide it.
pub(crate) fn epoch_ms(at: DateTime<Utc>) -> i64 {
    at.timestamp_millis()
}

/// Parses a path id. A malformed id cannot name anything: `404` with the usual message, so
/// probing ids reveals nothing about their format rules beyond "not found".
pub(crate) fn parse_id<T: FromStr>(what: &str, id: &str) -> Result<T, ApiError> {
    id.parse()
        .map_err(|_| ApiError::not_found(format!("{what} {id} not found")))
}

/// Longest long-poll (`GET /v1/events/{id}/wait`, `GET /v1/turns/{id}/wait`), whatever
/// `timeout_ms` asks.
pub const MAX_WAIT: std::time::Duration = std::time::Duration::from_secs(60);
/// A long-poll without `timeout_ms`.
pub const DEFAULT_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// The one long-poll loop of the wait endpoints: calls `probe(last)` every `poll` until it
/// answers `Some`; `last` is `true` once `timeout_ms` (default [`DEFAULT_WAIT`], at most
/// [`MAX_WAIT`]) has passed or the gateway is shutting down, and then `probe` must answer
/// with the current state. Only reads; the caller holds the stream slot.
pub(crate) async fn long_poll<T, F, Fut>(
    state: &crate::state::AppState,
    timeout_ms: Option<u64>,
    poll: std::time::Duration,
    mut probe: F,
) -> Result<T, ApiError>
where
    F: FnMut(bool) -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, ApiError>>,
{
    let timeout = timeout_ms
        .map_or(DEFAULT_WAIT, std::time::Duration::from_millis)
        .min(MAX_WAIT);
    let deadline = tokio::time::Instant::now() + timeout;
    let shutdown = state.shutdown().token();
    loop {
        let now = tokio::time::Instant::now();
        let last = now >= deadline || shutdown.is_cancelled();
        if let Some(answer) = probe(last).await? {
            return Ok(answer);
        }
        tokio::select! {
            () = tokio::time::sleep(poll.min(deadline - now)) => {}
            () = shutdown.cancelled() => {}
        }
    }
}
