//! `POST/GET /v1/schedules`, `GET/PATCH/DELETE /v1/schedules/{id}` (SPEC §10.1).
//!
//! `PATCH` edits a schedule: its body holds the fields to change (`name`, `kind`, `spec`,
//! `event`, `enabled`), merged over the current ones and validated as a create body.
//! `{"enabled": false}` pauses (no firing while paused, `next_fire_at` is `null`);
//! `{"enabled": true}` resumes, with the next fire time computed from now, so the periods
//! missed while paused are not caught up ([`sb_store::schedules::next_fire_after_edit`]).
//! A `once` schedule that has fired resumes only with a new `spec`.
//!
//! A schedule's `event` is validated and normalized exactly as a `POST /v1/events` body
//! ([`crate::normalize`]) when the schedule is created; the orchestrator's scheduler
//! ingests a copy of the normalized event at every fire time
//! ([`sb_store::ScheduledEvent`]). The one difference: `event.event_id` and
//! `event.event_time` are refused, because every firing gets its own idempotency key
//! (`schedule:<schedule_id>:<fire time>`) and its own time.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use chrono::Utc;
use sb_protocol::ids::EventId;
use sb_store::{NewSchedule, ScheduleEdit, ScheduleKind, ScheduleRecord, ScheduledEvent};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

use super::{ListPage, epoch, parse_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::normalize::{IngestRequest, NormalizeContext, normalize};
use crate::state::AppState;

/// Body of `POST /v1/schedules`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSchedule {
    /// Optional label.
    #[serde(default)]
    pub name: Option<String>,
    /// `interval`, `cron` or `once`.
    pub kind: String,
    /// `"15m"` (interval), `"0 9 * * 1-5"` (cron, UTC, 5 or 6 fields) or an RFC 3339 time
    /// (once).
    pub spec: String,
    /// The event to ingest at every fire time: a `POST /v1/events` body.
    pub event: Value,
    /// Default `true`.
    #[serde(default = "enabled_by_default")]
    pub enabled: bool,
}

fn enabled_by_default() -> bool {
    true
}

/// A schedule on the wire.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ScheduleView {
    /// Host-generated id.
    pub schedule_id: Uuid,
    /// Label.
    pub name: Option<String>,
    /// `interval`, `cron` or `once`.
    pub kind: ScheduleKind,
    /// The spec.
    pub spec: String,
    /// The event body as posted.
    pub event: Value,
    /// Whether it fires (a `once` schedule is disabled after its firing).
    pub enabled: bool,
    /// Next fire time, epoch seconds; `null` once a `once` schedule has fired.
    pub next_fire_at: Option<i64>,
    /// Scheduled time of the last firing, epoch seconds.
    pub last_fired_at: Option<i64>,
    /// Creation time, epoch seconds.
    pub created_at: i64,
    /// Last change (creation or firing), epoch seconds.
    pub updated_at: i64,
}

impl From<ScheduleRecord> for ScheduleView {
    fn from(r: ScheduleRecord) -> Self {
        // The stored template keeps the posted body under `request`.
        let event = match r.event {
            Value::Object(mut map) => map.remove("request").unwrap_or(Value::Null),
            _ => Value::Null,
        };
        Self {
            schedule_id: r.id,
            name: r.name,
            kind: r.kind,
            spec: r.spec,
            event,
            enabled: r.enabled,
            next_fire_at: r.next_fire_at.map(epoch),
            last_fired_at: r.last_fired_at.map(epoch),
            created_at: epoch(r.created_at),
            updated_at: epoch(r.updated_at),
        }
    }
}

/// Validates a schedule's `event` as `POST /v1/events` validates a body, naming the field
/// as `event.<field>`, and returns the template every firing copies.
async fn scheduled_event(
    state: &AppState,
    caller: &Caller,
    event: Value,
) -> ApiResult<ScheduledEvent> {
    if !event.is_object() {
        return Err(ApiError::invalid("invalid `event`: expected an object"));
    }
    let request: IngestRequest = serde_json::from_value(event.clone())
        .map_err(|e| ApiError::invalid(format!("invalid `event`: {e}")))?;
    if request.event_id.is_some() {
        return Err(ApiError::invalid(
            "invalid `event.event_id`: every firing gets its own idempotency key",
        ));
    }
    if request.event_time.is_some() {
        return Err(ApiError::invalid(
            "invalid `event.event_time`: every firing is stamped with its own time",
        ));
    }
    if request.deliver_at.is_some() {
        return Err(ApiError::invalid(
            "invalid `event.deliver_at`: the schedule says when its events are delivered",
        ));
    }
    // A schedule may address an agent like an ingest does (checked now, applied to every
    // firing).
    let addressing = super::events::Addressing::parse(&request)
        .map_err(|e| ApiError::invalid(e.message().replacen("invalid `", "invalid `event.", 1)))?;
    if let Some(agent_id) = addressing.target {
        super::events::check_target(state, caller, agent_id, &request.event_type).await?;
    }
    let mut new_artifact_id = || Uuid::new_v4().to_string();
    let mut normalized = normalize(
        request,
        NormalizeContext {
            workspace_id: caller.workspace_id.clone(),
            // Replaced at every firing.
            event_id: EventId::new(),
            now: Utc::now().timestamp(),
            idempotency_header: None,
            limits: state.options().normalize,
            new_artifact_id: &mut new_artifact_id,
        },
    )
    .map_err(|e| ApiError::invalid(format!("invalid `event.{}`: {}", e.field, e.reason)))?;
    addressing.apply(&mut normalized.envelope.metadata);
    Ok(ScheduledEvent {
        request: event,
        envelope: normalized.envelope,
        input_summary: normalized.input_summary,
    })
}

fn parse_kind(kind: &str) -> ApiResult<ScheduleKind> {
    kind.parse().map_err(|_| {
        ApiError::invalid(format!(
            "invalid `kind` {kind:?}: expected interval, cron or once"
        ))
    })
}

/// `POST /v1/schedules`: `201` with the schedule and its first fire time.
#[utoipa::path(
    post,
    path = "/v1/schedules",
    tag = "schedules",
    request_body = CreateSchedule,
    responses(
        (status = 201, description = "The new schedule", body = ScheduleView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn create_schedule(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CreateSchedule>,
) -> ApiResult<impl IntoResponse> {
    let kind = parse_kind(&body.kind)?;
    let template = scheduled_event(&state, &caller, body.event).await?;
    let new = NewSchedule {
        workspace_id: caller.workspace_id,
        name: body.name,
        kind,
        spec: body.spec,
        event: serde_json::to_value(template).map_err(ApiError::internal)?,
        enabled: body.enabled,
    };
    let record = state.stores().schedules.create(new).await?;
    tracing::info!(schedule_id = %record.id, kind = %record.kind, "schedule created");
    Ok((StatusCode::CREATED, ApiJson(ScheduleView::from(record))))
}

/// Query of `GET /v1/schedules`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListSchedulesQuery {
    /// Continue after this cursor.
    pub cursor: Option<String>,
    /// Page size, clamped to [1, 100].
    pub limit: Option<u64>,
}

/// `GET /v1/schedules`: the workspace's schedules, oldest first.
#[utoipa::path(
    get,
    path = "/v1/schedules",
    tag = "schedules",
    params(ListSchedulesQuery),
    responses(
        (status = 200, description = "The workspace's schedules, oldest first", body = ListPage<ScheduleView>),
    )
)]
pub async fn list_schedules(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<ListSchedulesQuery>,
) -> ApiResult<ApiJson<ListPage<ScheduleView>>> {
    let limit = i64::try_from(state.page_limit(q.limit)).unwrap_or(i64::MAX);
    let page = state
        .stores()
        .schedules
        .list(&caller.workspace_id, q.cursor, Some(limit))
        .await?;
    Ok(ApiJson(ListPage {
        items: page.items.into_iter().map(ScheduleView::from).collect(),
        next_cursor: page.next_cursor,
        has_more: page.has_more,
    }))
}

/// `GET /v1/schedules/{id}`.
#[utoipa::path(
    get,
    path = "/v1/schedules/{id}",
    tag = "schedules",
    params(("id" = String, Path, description = "Schedule id")),
    responses(
        (status = 200, description = "The schedule", body = ScheduleView),
        (status = 404, description = "no such schedule in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn get_schedule(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<ApiJson<ScheduleView>> {
    let schedule_id: Uuid = parse_id("schedule", &id)?;
    match state
        .stores()
        .schedules
        .get(&caller.workspace_id, schedule_id)
        .await?
    {
        Some(record) => Ok(ApiJson(record.into())),
        None => Err(ApiError::not_found(format!("schedule {id} not found"))),
    }
}

/// `PATCH /v1/schedules/{id}`: edit, pause or resume (see the module docs); the updated
/// schedule.
#[utoipa::path(
    patch,
    path = "/v1/schedules/{id}",
    tag = "schedules",
    params(("id" = String, Path, description = "Schedule id")),
    request_body(content = Object, description = "Fields of `CreateSchedule` to change"),
    responses(
        (status = 200, description = "The changed schedule", body = ScheduleView),
        (status = 400, description = "`invalid_argument`: a malformed body, path or query", body = crate::error::ErrorBody<'static>),
        (status = 404, description = "no such schedule in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn update_schedule(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiJson(patch): ApiJson<Map<String, Value>>,
) -> ApiResult<ApiJson<ScheduleView>> {
    let schedule_id: Uuid = parse_id("schedule", &id)?;
    let schedules = &state.stores().schedules;
    let missing = || ApiError::not_found(format!("schedule {id} not found"));
    let current = schedules
        .get(&caller.workspace_id, schedule_id)
        .await?
        .ok_or_else(missing)?;
    let view = ScheduleView::from(current);
    let mut body = Map::new();
    body.insert("name".into(), view.name.into());
    body.insert("kind".into(), view.kind.as_str().into());
    body.insert("spec".into(), view.spec.into());
    body.insert("event".into(), view.event);
    body.insert("enabled".into(), view.enabled.into());
    body.extend(patch);
    let body: CreateSchedule = super::resources::from_body(&Value::Object(body))?;
    let kind = parse_kind(&body.kind)?;
    let template = scheduled_event(&state, &caller, body.event).await?;
    let edit = ScheduleEdit {
        name: body.name,
        kind,
        spec: body.spec,
        event: serde_json::to_value(template).map_err(ApiError::internal)?,
        enabled: body.enabled,
    };
    let record = schedules
        .update(&caller.workspace_id, schedule_id, edit)
        .await?
        .ok_or_else(missing)?;
    tracing::info!(%schedule_id, enabled = record.enabled, "schedule updated");
    Ok(ApiJson(record.into()))
}

/// `DELETE /v1/schedules/{id}`: `204`; the schedule fires no more.
#[utoipa::path(
    delete,
    path = "/v1/schedules/{id}",
    tag = "schedules",
    params(("id" = String, Path, description = "Schedule id")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "no such schedule in the caller's workspace", body = crate::error::ErrorBody<'static>),
    )
)]
pub async fn delete_schedule(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    let schedule_id: Uuid = parse_id("schedule", &id)?;
    if state
        .stores()
        .schedules
        .delete(&caller.workspace_id, schedule_id)
        .await?
    {
        tracing::info!(%schedule_id, "schedule deleted");
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("schedule {id} not found")))
    }
}
