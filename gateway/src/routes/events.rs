//! `POST /v1/events` (ingest) and `GET /v1/events/{id}`.

use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use sb_common::telemetry::{Registry, names};
use sb_orchestrator::scheduler::event_announcement;
use sb_protocol::ids::EventId;
use sb_store::events::{EventRecord, EventStatus, NewEvent};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{epoch, parse_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::normalize::{IngestRequest, NormalizeContext, Normalized, normalize};
use crate::state::AppState;
use crate::stream::event_stream;

/// The `Idempotency-Key` request header.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// Response header set when an ingest was answered from an earlier request with the same key.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// Response header naming the event of a `?stream=true` ingest (its body is the run stream).
pub const EVENT_ID_HEADER: HeaderName = HeaderName::from_static("x-event-id");

/// Query of `POST /v1/events`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngestQuery {
    /// Answer with the SSE stream of the run that handles the event.
    #[serde(default)]
    pub stream: bool,
}

/// `202` body of an ingest.
#[derive(Debug, Serialize)]
pub struct IngestResponse {
    /// The host event id.
    pub event_id: EventId,
    /// Routing status at the time of the answer (`received` for a new event).
    pub status: EventStatus,
}

/// `POST /v1/events`: validate, normalize, store with its outbox row, answer `202`.
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
    // A streamed answer needs one of the key's stream slots: taken before anything is
    // stored, so a refused request (`429`) ingests nothing.
    let slot = if query.stream {
        Some(state.key_limits().open_stream(caller.key_id)?)
    } else {
        None
    };
    let fingerprint = request_fingerprint(
        &body,
        caller.workspace_id.clone(),
        header_key,
        state.options().normalize,
    );
    let mut new_artifact_id = || uuid::Uuid::new_v4().to_string();
    let normalized = normalize(
        body,
        NormalizeContext {
            workspace_id: caller.workspace_id.clone(),
            event_id: EventId::new(),
            now: Utc::now().timestamp(),
            idempotency_header: header_key,
            limits: state.options().normalize,
            new_artifact_id: &mut new_artifact_id,
        },
    )
    .map_err(|e| ApiError::from_coded(&e))?;

    let outbox = event_announcement(state.topology(), &normalized.envelope);
    let mut new_event = to_new_event(&normalized)?;
    if new_event.idempotency_key.is_some() {
        new_event.request_hash = fingerprint;
    }

    let (record, created) = state
        .stores()
        .events
        .append(new_event, vec![outbox])
        .await?;
    let metrics = Registry::global();
    if created {
        state.relay().wake();
        metrics.inc(names::EVENTS_INGESTED_TOTAL, &[("outcome", "accepted")]);
        tracing::debug!(event_id = %record.id, event_type = %record.event_type, "event accepted");
    } else {
        metrics.inc(names::EVENTS_INGESTED_TOTAL, &[("outcome", "duplicate")]);
        tracing::debug!(event_id = %record.id, "duplicate ingest answered from the first event");
    }

    let mut response = if let Some(slot) = slot {
        let mut response = event_stream(
            state.stream_context(),
            record.id,
            record.workspace_id.clone(),
            record.conversation_id.clone(),
            slot,
        )
        .into_response();
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
/// attachment ids numbered from 0). Two requests that normalize alike (same fields, any key
/// order or whitespace, the same defaults) have the same fingerprint; any difference in what
/// would be stored gives another one. `None` when the body does not normalize (it is refused
/// anyway).
pub(crate) fn request_fingerprint(
    body: &IngestRequest,
    workspace_id: sb_protocol::ids::WorkspaceId,
    header_key: Option<&str>,
    limits: crate::normalize::NormalizeLimits,
) -> Option<String> {
    let mut counter = 0_u64;
    let mut fixed_artifact_id = || {
        counter += 1;
        format!("fingerprint-{counter}")
    };
    let normalized = normalize(
        body.clone(),
        NormalizeContext {
            workspace_id,
            event_id: EventId::from_uuid(uuid::Uuid::nil()),
            now: 0,
            idempotency_header: header_key,
            limits,
            new_artifact_id: &mut fixed_artifact_id,
        },
    )
    .ok()?;
    let bytes = serde_json::to_vec(&normalized.envelope).ok()?;
    Some(fingerprint_bytes(&bytes))
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
#[derive(Debug, Serialize)]
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
}

impl From<EventRecord> for EventView {
    fn from(r: EventRecord) -> Self {
        Self {
            event_id: r.id,
            status: r.status,
            reason: r.reason,
            run_id: r.run_id.map(|id| id.to_string()),
            claimed_by_run_id: r.claimed_by_run_id.map(|id| id.to_string()),
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
        }
    }
}

/// `GET /v1/events/{id}`.
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
