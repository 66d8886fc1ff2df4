//! `POST /v1/events` (ingest), `GET /v1/events/{id}` and `GET /v1/events/{id}/wait`.
//!
//! # Addressing an agent
//!
//! `agent_id` names the agent that handles the event, whatever the scopes say (issue 14
//! item 6): it must be an agent of the caller's workspace, enabled and subscribed to the
//! event type, else the ingest is refused with `400 invalid_argument` before anything is
//! stored. The envelope then carries `metadata.target {agent_id}` ([`EventTarget`]) and the
//! orchestrator routes it to that agent (`binding.target_unavailable` if the agent was
//! disabled or deleted before the event was routed). A `direct` agent (see
//! `routes::agents`) is reachable only this way or through a session.
//!
//! # Delayed delivery
//!
//! `deliver_at` (SPEC §10.1) is an RFC 3339 time or epoch seconds ([`parse_deliver_at`]).
//! In the future, the event is stored now (durably, with its idempotency key) as
//! `scheduled`, and its outbox row is available only from that time: the outbox relay
//! announces it then (within one `gateway.outbox_poll_interval`) and it is routed like any
//! other. Absent, or not in the future, means now. More than
//! `limits.deliver_at_max_delay` ahead is refused ([`delivery_time`]). The requested time
//! is kept as `metadata.deliver_at` (RFC 3339, UTC), so it is part of the request's
//! fingerprint, and a delayed ingest cannot be `?stream=true` (nothing would stream yet).
//!
//! # Routing is asynchronous; `run_id` and the wait
//!
//! Routing happens in an orchestrator (cluster mode) or in the embedded process's own
//! orchestrator loop, after the outbox relay has announced the event: in **both** modes
//! the `202` is answered once the event is durable, before it is routed. The answer
//! carries `run_id` only when the run is already known at that moment (a replay of an
//! event routed since); `GET /v1/events/{id}/wait?timeout_ms=` long-polls until the event
//! is routed (`dispatched`, `claimed`, `unrouted` or `rejected`) and answers the event
//! with its `run_id` / `claimed_by_run_id` and `reason`, or its current state at the
//! timeout (`scheduled` and parked events are still unrouted then).

use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use sb_common::telemetry::{Metrics, names};
use sb_protocol::host::AgentEventEnvelope;
use sb_protocol::ids::{AgentId, EventId, RunId};
use sb_store::events::{
    DELIVER_AT_METADATA_KEY, EventRecord, EventStatus, EventTarget, NewEvent, TARGET_METADATA_KEY,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{epoch, epoch_ms, parse_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::normalize::{IngestRequest, NormalizeContext, Normalized, normalize};
use crate::state::AppState;
use crate::stream::{PendingRoute, event_stream};

/// The `Idempotency-Key` request header.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// Response header set when an ingest was answered from an earlier request with the same key.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// Response header naming the event of a `?stream=true` ingest (its body is the run stream).
pub const EVENT_ID_HEADER: HeaderName = HeaderName::from_static("x-event-id");

/// Query of `POST /v1/events`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct IngestQuery {
    /// Answer with the SSE stream of the run that handles the event.
    #[serde(default)]
    pub stream: bool,
}

/// `202` body of an ingest.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct IngestResponse {
    /// The host event id.
    pub event_id: EventId,
    /// Routing status at the time of the answer (`received` for a new event, `scheduled`
    /// for a delayed one).
    pub status: EventStatus,
    /// The run handling the event, when it is already known (a replay of a routed event):
    /// routing is asynchronous, `GET /v1/events/{id}/wait` gives it otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// When a delayed event is routed, epoch seconds (absent: now).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deliver_at: Option<i64>,
}

/// What an ingest request asks besides the event itself: the agent it names and when it is
/// to be delivered, as parsed from the body ([`Addressing::parse`], pure).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Addressing {
    /// The named agent.
    pub target: Option<AgentId>,
    /// The requested delivery time (possibly in the past: then it means now).
    pub deliver_at: Option<DateTime<Utc>>,
}

impl Addressing {
    /// Parses `agent_id` and `deliver_at` of a body (`400` messages name the field).
    pub fn parse(body: &IngestRequest) -> ApiResult<Self> {
        let target = match &body.agent_id {
            Some(id) => Some(
                id.parse::<AgentId>()
                    .map_err(|_| ApiError::invalid(format!("invalid `agent_id`: no agent {id}")))?,
            ),
            None => None,
        };
        let deliver_at = match &body.deliver_at {
            None | Some(Value::Null) => None,
            Some(value) => Some(
                parse_deliver_at(value)
                    .map_err(|e| ApiError::invalid(format!("invalid `deliver_at`: {e}")))?,
            ),
        };
        Ok(Self { target, deliver_at })
    }

    /// Records the addressing in an envelope's metadata (`target`, `deliver_at`), where the
    /// orchestrator reads the target and the request fingerprint covers both.
    pub fn apply(&self, metadata: &mut Map<String, Value>) {
        if let Some(agent_id) = self.target {
            if let Ok(value) = serde_json::to_value(EventTarget { agent_id }) {
                metadata.insert(TARGET_METADATA_KEY.to_owned(), value);
            }
        }
        if let Some(at) = self.deliver_at {
            metadata.insert(
                DELIVER_AT_METADATA_KEY.to_owned(),
                Value::String(at.to_rfc3339_opts(SecondsFormat::Millis, true)),
            );
        }
    }
}

/// Parses a `deliver_at`: an RFC 3339 string (any offset; `2026-01-01T09:00:00Z`) or epoch
/// seconds (a non-negative number, fractions kept to the millisecond). Anything else is
/// refused with what was expected.
pub fn parse_deliver_at(value: &Value) -> Result<DateTime<Utc>, String> {
    const EXPECTED: &str = "expected an RFC 3339 time (e.g. 2026-01-01T09:00:00Z) or epoch seconds";
    match value {
        Value::String(text) => DateTime::parse_from_rfc3339(text)
            .map(|t| t.with_timezone(&Utc))
            .map_err(|e| format!("{text:?} is not an RFC 3339 time ({e}); {EXPECTED}")),
        Value::Number(n) => {
            let secs = n
                .as_f64()
                .filter(|s| s.is_finite() && *s >= 0.0)
                .ok_or_else(|| format!("{n} is not a non-negative number; {EXPECTED}"))?;
            // Whole milliseconds; any representable time is far below i64::MAX ms.
            #[allow(clippy::cast_possible_truncation)]
            let millis = (secs * 1000.0).round() as i64;
            DateTime::<Utc>::from_timestamp_millis(millis)
                .ok_or_else(|| format!("{n} is out of range; {EXPECTED}"))
        }
        other => Err(format!("got {other}; {EXPECTED}")),
    }
}

/// When a requested delivery happens: `Ok(None)` for now (absent, or not after `now`),
/// `Ok(Some(at))` for a future time at most `max_delay` ahead, `400` beyond.
pub fn delivery_time(
    requested: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
    max_delay: Duration,
) -> ApiResult<Option<DateTime<Utc>>> {
    let Some(at) = requested.filter(|at| *at > now) else {
        return Ok(None);
    };
    let limit = chrono::TimeDelta::from_std(max_delay).unwrap_or(chrono::TimeDelta::MAX);
    if at - now > limit {
        return Err(ApiError::invalid(format!(
            "invalid `deliver_at`: {} is more than {} in the future (limits.deliver_at_max_delay)",
            at.to_rfc3339_opts(SecondsFormat::Secs, true),
            format_args!("{}s", max_delay.as_secs())
        )));
    }
    Ok(Some(at))
}

/// Checks the agent an ingest names: of the caller's workspace (another workspace's agent
/// looks like none), enabled, and subscribed to `event_type`.
pub(crate) async fn check_target(
    state: &AppState,
    caller: &Caller,
    agent_id: AgentId,
    event_type: &str,
) -> ApiResult<()> {
    let agent = state
        .stores()
        .agents
        .get(&caller.workspace_id, agent_id)
        .await?
        .ok_or_else(|| ApiError::invalid(format!("invalid `agent_id`: no agent {agent_id}")))?;
    if !agent.enabled {
        return Err(ApiError::invalid(format!(
            "invalid `agent_id`: agent {agent_id} is disabled"
        )));
    }
    let handles = match &agent.event_types {
        Value::Null => event_type == sb_protocol::host::event_types::MESSAGE_RECEIVED,
        Value::Array(types) => types.iter().any(|t| t.as_str() == Some(event_type)),
        _ => false,
    };
    if !handles {
        return Err(ApiError::invalid(format!(
            "invalid `agent_id`: agent {agent_id} does not handle event type {event_type:?} \
             (its event_types: {})",
            agent.event_types
        )));
    }
    Ok(())
}

/// `POST /v1/events`: validate, normalize, store with its outbox row, answer `202`.
#[utoipa::path(
    post,
    path = "/v1/events",
    tag = "events",
    params(IngestQuery, ("Idempotency-Key" = Option<String>, Header, description = "1-128 characters of `[A-Za-z0-9-_.:]`; the same key with the same body answers the first event, with another body `409`")),
    request_body = IngestRequest,
    responses(
        (status = 202, description = "Accepted: the event is durable and will be routed", body = IngestResponse),
        (status = 200, description = "With `stream=true`: the run's result stream (SSE, `x-event-id` header)", body = String, content_type = "text/event-stream"),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 409, description = "`conflict`: the idempotency key was used with another body", body = crate::error::ErrorBody<'static>),
        (status = 413, description = "`payload_too_large`: the body is over the limit", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn ingest(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(query): ApiQuery<IngestQuery>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<IngestRequest>,
) -> ApiResult<Response> {
    let header_key = match headers.get(&IDEMPOTENCY_KEY) {
        Some(value) => Some(value.to_str().map_err(|_| {
            ApiError::invalid(
                "invalid `Idempotency-Key`: must be 1-128 characters of [A-Za-z0-9-_.:]",
            )
        })?),
        None => None,
    };
    let addressing = Addressing::parse(&body)?;
    let now = Utc::now();
    let delayed = delivery_time(
        addressing.deliver_at,
        now,
        state.options().deliver_at_max_delay,
    )?;
    if delayed.is_some() && query.stream {
        return Err(ApiError::invalid(
            "invalid `deliver_at`: a delayed event cannot be answered with `?stream=true`; \
             stream its run once it is routed (GET /v1/events/{id}/wait gives the run id)",
        ));
    }
    if let Some(agent_id) = addressing.target {
        check_target(&state, &caller, agent_id, &body.event_type).await?;
    }
    // A streamed answer needs one of the key's stream slots: taken before anything is
    // stored, so a refused request (`429`) ingests nothing.
    let slot = if query.stream {
        Some(state.key_limits().open_stream(caller.key_id)?)
    } else {
        None
    };
    let event_time = body.event_time;
    let mut generated = Vec::new();
    let mut new_artifact_id = || {
        let id = uuid::Uuid::new_v4().to_string();
        generated.push(id.clone());
        id
    };
    let mut normalized = normalize(
        body,
        NormalizeContext {
            workspace_id: caller.workspace_id.clone(),
            event_id: EventId::new(),
            now: now.timestamp(),
            idempotency_header: header_key,
            limits: state.options().normalize,
            new_artifact_id: &mut new_artifact_id,
        },
    )
    .map_err(|e| ApiError::from_coded(&e))?;
    addressing.apply(&mut normalized.envelope.metadata);

    let mut outbox = super::event_outbox(state.topology(), &normalized.envelope);
    let mut new_event = to_new_event(&normalized)?;
    if new_event.idempotency_key.is_some() {
        new_event.request_hash =
            request_fingerprint(&mut normalized.envelope, event_time, &generated);
    }
    if let Some(at) = delayed {
        new_event.status = EventStatus::Scheduled;
        outbox.available_at = Some(at);
    }

    // A streamed answer watches the conversation before the event is committed, so nothing
    // of its run can be published unseen and the route need not be read at once. A bus that
    // cannot bind now does not refuse the event (accepted events never wait on the broker):
    // the stream task tries again.
    let watch = if query.stream {
        match state
            .live()
            .watch_conversation(
                new_event.workspace_id.as_str(),
                new_event.conversation_id.as_deref(),
            )
            .await
        {
            Ok(watch) => Some(watch),
            Err(error) => {
                tracing::debug!(%error, "could not watch the conversation before the ingest");
                None
            }
        }
    } else {
        None
    };
    let (record, created) = state.ingest().append(new_event, vec![outbox]).await?;
    let metrics = Metrics::global();
    if created {
        metrics.inc(names::EVENTS_INGESTED_TOTAL, &[("outcome", "accepted")]);
        tracing::debug!(event_id = %record.id, event_type = %record.event_type, "event accepted");
    } else {
        metrics.inc(names::EVENTS_INGESTED_TOTAL, &[("outcome", "duplicate")]);
        tracing::debug!(event_id = %record.id, "duplicate ingest answered from the first event");
    }

    let mut response = if let Some(slot) = slot {
        // A repeated key answers with the first event: its route may be known already (so it
        // is read at once), and its conversation is the one to watch.
        let pending = PendingRoute {
            event_id: record.id,
            workspace: record.workspace_id.clone(),
            conversation: record.conversation_id.clone(),
            watch,
            created,
        };
        let mut response = event_stream(state.stream_context(), pending, slot).into_response();
        if let Ok(value) = HeaderValue::from_str(&record.id.to_string()) {
            response.headers_mut().insert(EVENT_ID_HEADER, value);
        }
        response
    } else {
        (
            StatusCode::ACCEPTED,
            ApiJson(IngestResponse {
                event_id: record.id,
                status: record.status,
                run_id: record.run_id,
                deliver_at: deliver_at_of(&record.metadata).map(|t| t.timestamp()),
            }),
        )
            .into_response()
    };
    if !created {
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    Ok(response)
}

/// The fingerprint of an ingest request, stored with its idempotency key: sha256 hex of the
/// envelope [`normalize`] makes of it with the impure inputs fixed (a nil event id, time 0,
/// attachment ids numbered from 1). Two requests that normalize alike (same fields, any key
/// order or whitespace, the same defaults) have the same fingerprint; any difference in what
/// would be stored gives another one.
///
/// Computed from the envelope the request was normalized into (`envelope`, with its
/// addressing applied and nothing else added), by putting the fixed inputs in place of the
/// impure ones for the time of the hash: the event id; `event_time` unless the request set
/// it (`request_event_time`); the attachment ids normalization generated (`generated`, in
/// order), which become `fingerprint-1`, `fingerprint-2`, …. That is the envelope a second
/// normalization with those inputs would make (what earlier versions did), so stored
/// fingerprints keep matching. `envelope` is left as it was. `None` if it cannot be
/// serialized.
pub(crate) fn request_fingerprint(
    envelope: &mut AgentEventEnvelope,
    request_event_time: Option<i64>,
    generated: &[String],
) -> Option<String> {
    let event_id = std::mem::replace(
        &mut envelope.event_id,
        EventId::from_uuid(uuid::Uuid::nil()),
    );
    let event_time = envelope.event_time.replace(request_event_time.unwrap_or(0));
    let mut swapped = Vec::new();
    for (index, attachment) in envelope.input.attachments.iter_mut().enumerate() {
        if let Some(number) = generated
            .iter()
            .position(|id| *id == attachment.artifact_id)
        {
            let fixed = format!("fingerprint-{}", number + 1);
            swapped.push((index, std::mem::replace(&mut attachment.artifact_id, fixed)));
        }
    }
    let bytes = serde_json::to_vec(&*envelope);
    envelope.event_id = event_id;
    envelope.event_time = event_time;
    for (index, id) in swapped {
        envelope.input.attachments[index].artifact_id = id;
    }
    bytes.ok().map(|bytes| fingerprint_bytes(&bytes))
}

/// sha256 hex of `bytes`: the form of every stored request fingerprint.
pub(crate) fn fingerprint_bytes(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// The event-log row of a normalized event.
fn to_new_event(n: &Normalized) -> ApiResult<NewEvent> {
    Ok(NewEvent::from_envelope(
        &n.envelope,
        n.idempotency_key.clone(),
        n.input_summary.clone(),
    )?)
}

/// `GET /v1/events/{id}` body.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct EventView {
    /// Host event id.
    pub event_id: EventId,
    /// `received`, `dispatched`, `claimed`, `unrouted`, `rejected` or `scheduled`.
    pub status: EventStatus,
    /// Why the event has its status (set for `unrouted` and `rejected`).
    pub reason: Option<String>,
    /// The run created for the event, once routed.
    pub run_id: Option<String>,
    /// The active run that absorbed the event as steering input (`claimed`).
    pub claimed_by_run_id: Option<String>,
    /// The agent the ingest named (`agent_id`), if any.
    pub agent_id: Option<AgentId>,
    /// The requested delivery time of a delayed event, epoch seconds.
    pub deliver_at: Option<i64>,
    /// Event type.
    pub event_type: String,
    /// Source.
    pub source: String,
    /// Origin time, epoch seconds.
    pub event_time: Option<i64>,
    /// Conversation.
    pub conversation_id: Option<String>,
    /// Thread.
    pub thread_id: Option<String>,
    /// Bot.
    pub bot_id: Option<String>,
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
    /// Input text, cut to 1000 characters.
    pub input_summary: Option<String>,
    /// The idempotency key the event was ingested with.
    pub idempotency_key: Option<String>,
    /// Host metadata.
    pub metadata: Value,
    /// Ingest time, epoch seconds.
    pub created_at: i64,
    /// Last status change, epoch seconds.
    pub updated_at: i64,
    /// `created_at` in epoch milliseconds: when the event was committed.
    pub created_at_ms: i64,
    /// `updated_at` in epoch milliseconds: for a routed event, when it was routed.
    pub updated_at_ms: i64,
}

impl From<EventRecord> for EventView {
    fn from(r: EventRecord) -> Self {
        Self {
            event_id: r.id,
            status: r.status,
            reason: r.reason,
            run_id: r.run_id.map(|id| id.to_string()),
            claimed_by_run_id: r.claimed_by_run_id.map(|id| id.to_string()),
            agent_id: r
                .metadata
                .as_object()
                .and_then(EventTarget::from_metadata)
                .map(|t| t.agent_id),
            deliver_at: deliver_at_of(&r.metadata).map(|t| t.timestamp()),
            event_type: r.event_type,
            source: r.source,
            event_time: r.event_time.map(epoch),
            conversation_id: r.conversation_id,
            thread_id: r.thread_id,
            bot_id: r.bot_id,
            actor_type: r.actor_type,
            actor_id: r.actor_id,
            actor_name: r.actor_name,
            subject_type: r.subject_type,
            subject_id: r.subject_id,
            input_summary: r.input_summary,
            idempotency_key: r.idempotency_key,
            metadata: r.metadata,
            created_at: epoch(r.created_at),
            updated_at: epoch(r.updated_at),
            created_at_ms: epoch_ms(r.created_at),
            updated_at_ms: epoch_ms(r.updated_at),
        }
    }
}

/// `GET /v1/events/{id}`.
#[utoipa::path(
    get,
    path = "/v1/events/{id}",
    tag = "events",
    params(("id" = String, Path, description = "Event id")),
    responses(
        (status = 200, description = "The event with its routing status", body = EventView),
        (status = 404, description = "no such event in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn get_event(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<ApiJson<EventView>> {
    let event_id: EventId = parse_id("event", &id)?;
    match state.stores().events.get(event_id).await? {
        Some(record) if record.workspace_id == caller.workspace_id => Ok(ApiJson(record.into())),
        _ => Err(ApiError::not_found(format!("event {id} not found"))),
    }
}

/// The requested delivery time kept in an event's metadata, if any.
fn deliver_at_of(metadata: &Value) -> Option<DateTime<Utc>> {
    metadata
        .get(DELIVER_AT_METADATA_KEY)
        .and_then(Value::as_str)
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc))
}

/// How often a waiting request reads the event's routing state again.
const WAIT_POLL: Duration = Duration::from_millis(20);

/// Query of `GET /v1/events/{id}/wait`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct WaitQuery {
    /// How long to wait for the event to be routed, in milliseconds (default 30 000, at
    /// most 60 000).
    pub timeout_ms: Option<u64>,
}

/// Whether routing is done with an event in `status`: it started a run, was absorbed by one,
/// or will start none. `received` (not routed yet, or parked by an `enqueue` policy) and
/// `scheduled` (not due yet) are still waiting.
#[must_use]
pub fn is_routed(status: EventStatus) -> bool {
    !matches!(status, EventStatus::Received | EventStatus::Scheduled)
}

/// `GET /v1/events/{id}/wait`: the event once routed (see [`is_routed`]), or as it stands
/// at the timeout. Only reads. Holds one of the key's stream slots while it waits, as a
/// long-lived request.
#[utoipa::path(
    get,
    path = "/v1/events/{id}/wait",
    tag = "events",
    params(("id" = String, Path, description = "Event id"), WaitQuery),
    responses(
        (status = 200, description = "The event once routed, or as it is at the timeout", body = EventView),
        (status = 404, description = "no such event in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn wait_event(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<WaitQuery>,
) -> ApiResult<ApiJson<EventView>> {
    let event_id: EventId = parse_id("event", &id)?;
    let not_found = || ApiError::not_found(format!("event {id} not found"));
    let events = &state.stores().events;
    let routing = events.routing(event_id).await?.ok_or_else(not_found)?;
    if routing.workspace_id != caller.workspace_id {
        return Err(not_found());
    }
    let _slot = state.key_limits().open_stream(caller.key_id)?;
    let mut status = Some(routing.status);
    let record = super::long_poll(&state, q.timeout_ms, WAIT_POLL, |last| {
        let known = status.take();
        async move {
            let status = match known {
                Some(status) => status,
                None => {
                    events
                        .routing(event_id)
                        .await?
                        .ok_or_else(not_found)?
                        .status
                }
            };
            if !is_routed(status) && !last {
                return Ok(None);
            }
            Ok(Some(events.get(event_id).await?.ok_or_else(not_found)?))
        }
    })
    .await?;
    Ok(ApiJson(record.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone as _;
    use serde_json::json;

    #[test]
    fn deliver_at_reads_rfc3339_and_epoch_seconds() {
        let at = Utc.with_ymd_and_hms(2026, 1, 1, 9, 0, 0).unwrap();
        assert_eq!(parse_deliver_at(&json!("2026-01-01T09:00:00Z")), Ok(at));
        assert_eq!(
            parse_deliver_at(&json!("2026-01-01T10:00:00+01:00")),
            Ok(at)
        );
        assert_eq!(parse_deliver_at(&json!(at.timestamp())), Ok(at));
        assert_eq!(
            parse_deliver_at(&json!(1.5)).unwrap().timestamp_millis(),
            1500
        );
        for bad in [
            json!("tomorrow"),
            json!("2026-01-01 09:00"),
            json!(-1),
            json!(true),
            json!({"at": 1}),
            json!(1e300),
        ] {
            let err = parse_deliver_at(&bad).unwrap_err();
            assert!(err.contains("RFC 3339"), "{bad}: {err}");
        }
    }

    #[test]
    fn delivery_is_now_unless_in_the_future_and_bounded() {
        let now = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
        let max = Duration::from_secs(3600);
        assert_eq!(delivery_time(None, now, max).unwrap(), None);
        let past = now - chrono::TimeDelta::seconds(5);
        assert_eq!(delivery_time(Some(past), now, max).unwrap(), None);
        assert_eq!(
            delivery_time(Some(now), now, max).unwrap(),
            None,
            "now is not later"
        );
        let soon = now + chrono::TimeDelta::seconds(2);
        assert_eq!(delivery_time(Some(soon), now, max).unwrap(), Some(soon));
        let edge = now + chrono::TimeDelta::seconds(3600);
        assert_eq!(delivery_time(Some(edge), now, max).unwrap(), Some(edge));
        let err = delivery_time(Some(edge + chrono::TimeDelta::seconds(1)), now, max).unwrap_err();
        assert_eq!(err.code(), sb_protocol::error::ErrorCode::InvalidArgument);
        assert!(
            err.message().contains("deliver_at_max_delay"),
            "{}",
            err.message()
        );
    }

    fn body(extra: Value) -> IngestRequest {
        let mut v =
            json!({"event_type": "message.received", "source": "api", "input": {"text": "hi"}});
        for (k, val) in extra.as_object().unwrap() {
            v[k] = val.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    /// The fingerprint as ingest computes it: normalized with a fresh event id, the clock at
    /// `now` and random attachment ids, addressing applied, then [`request_fingerprint`].
    fn ingest_fingerprint(body: &IngestRequest, header: Option<&str>, now: i64) -> String {
        let mut generated = Vec::new();
        let mut new_artifact_id = || {
            let id = uuid::Uuid::new_v4().to_string();
            generated.push(id.clone());
            id
        };
        let mut normalized = normalize(
            body.clone(),
            NormalizeContext {
                workspace_id: sb_protocol::ids::WorkspaceId::default_workspace(),
                event_id: EventId::new(),
                now,
                idempotency_header: header,
                limits: crate::normalize::NormalizeLimits::default(),
                new_artifact_id: &mut new_artifact_id,
            },
        )
        .unwrap();
        Addressing::parse(body)
            .unwrap()
            .apply(&mut normalized.envelope.metadata);
        let before = normalized.envelope.clone();
        let fingerprint =
            request_fingerprint(&mut normalized.envelope, body.event_time, &generated).unwrap();
        assert_eq!(
            normalized.envelope, before,
            "the envelope is left as it was"
        );
        fingerprint
    }

    /// The definition stored fingerprints were made with (earlier versions normalized the
    /// request a second time with the impure inputs fixed).
    fn stored_fingerprint(body: &IngestRequest, header: Option<&str>) -> String {
        let mut counter = 0_u64;
        let mut fixed_artifact_id = || {
            counter += 1;
            format!("fingerprint-{counter}")
        };
        let mut envelope = normalize(
            body.clone(),
            NormalizeContext {
                workspace_id: sb_protocol::ids::WorkspaceId::default_workspace(),
                event_id: EventId::from_uuid(uuid::Uuid::nil()),
                now: 0,
                idempotency_header: header,
                limits: crate::normalize::NormalizeLimits::default(),
                new_artifact_id: &mut fixed_artifact_id,
            },
        )
        .unwrap()
        .envelope;
        Addressing::parse(body)
            .unwrap()
            .apply(&mut envelope.metadata);
        fingerprint_bytes(&serde_json::to_vec(&envelope).unwrap())
    }

    #[test]
    fn fingerprints_from_the_normalized_envelope_match_the_stored_ones() {
        let agent = AgentId::new();
        let attachment = |id: Option<&str>| {
            let mut a = json!({"artifact_type": "image", "mime_type": "image/png"});
            if let Some(id) = id {
                a["artifact_id"] = json!(id);
            }
            a
        };
        for (extra, header) in [
            (json!({}), Some("k")),
            (json!({"event_id": "client-1"}), None),
            (json!({"event_time": 1_650_000_000}), Some("k")),
            (json!({"event_time": 0, "conversation_id": "c1"}), Some("k")),
            (
                json!({"agent_id": agent.to_string(), "deliver_at": 100, "data": {"a": 1}}),
                Some("k"),
            ),
            (
                json!({"input": {"text": "see", "attachments": [
                    attachment(None), attachment(Some("mine")), attachment(None),
                ]}}),
                Some("k"),
            ),
        ] {
            let request = body(extra.clone());
            let expected = stored_fingerprint(&request, header);
            for now in [0, 1_700_000_000] {
                assert_eq!(
                    ingest_fingerprint(&request, header, now),
                    expected,
                    "{extra} at {now}"
                );
            }
        }
        // A client time equal to the clock is still the client's.
        assert_ne!(
            ingest_fingerprint(&body(json!({"event_time": 5})), Some("k"), 5),
            ingest_fingerprint(&body(json!({})), Some("k"), 5)
        );
    }

    #[test]
    fn addressing_is_parsed_recorded_and_fingerprinted() {
        let agent = AgentId::new();
        let a = Addressing::parse(&body(json!({
            "agent_id": agent.to_string(),
            "deliver_at": "2026-01-01T09:00:00.250Z",
        })))
        .unwrap();
        assert_eq!(a.target, Some(agent));
        let mut metadata = Map::new();
        a.apply(&mut metadata);
        assert_eq!(metadata["target"], json!({"agent_id": agent.to_string()}));
        assert_eq!(metadata["deliver_at"], "2026-01-01T09:00:00.250Z");
        assert_eq!(
            EventTarget::from_metadata(&metadata).map(|t| t.agent_id),
            Some(agent)
        );
        assert_eq!(
            deliver_at_of(&Value::Object(metadata))
                .unwrap()
                .timestamp_millis()
                % 1000,
            250
        );
        assert_eq!(
            Addressing::parse(&body(json!({}))).unwrap(),
            Addressing::default()
        );
        assert_eq!(
            Addressing::parse(&body(json!({"deliver_at": null}))).unwrap(),
            Addressing::default()
        );
        let err = Addressing::parse(&body(json!({"agent_id": "nope"}))).unwrap_err();
        assert!(err.message().contains("`agent_id`"), "{}", err.message());
        let err = Addressing::parse(&body(json!({"deliver_at": "soon"}))).unwrap_err();
        assert!(err.message().contains("`deliver_at`"), "{}", err.message());

        // The same event to another agent, or at another time, is another request.
        let fp = |extra: Value| ingest_fingerprint(&body(extra), Some("k"), 1_700_000_000);
        let plain = fp(json!({}));
        let to_agent = fp(json!({"agent_id": agent.to_string()}));
        assert_ne!(plain, to_agent);
        assert_eq!(to_agent, fp(json!({"agent_id": agent.to_string()})));
        assert_ne!(
            fp(json!({"deliver_at": 100})),
            fp(json!({"deliver_at": 200}))
        );
        assert_eq!(
            fp(json!({"deliver_at": 100})),
            fp(json!({"deliver_at": "1970-01-01T00:01:40Z"})),
            "one time, two spellings"
        );
    }

    #[test]
    fn routed_statuses() {
        assert!(!is_routed(EventStatus::Received));
        assert!(!is_routed(EventStatus::Scheduled));
        for s in [
            EventStatus::Dispatched,
            EventStatus::Claimed,
            EventStatus::Unrouted,
            EventStatus::Rejected,
        ] {
            assert!(is_routed(s), "{s}");
        }
    }
}
