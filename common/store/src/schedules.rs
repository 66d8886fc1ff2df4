//! Schedules: triggers that turn into host events at their fire times (SPEC §1, §9).
//!
//! A schedule holds an event template (the body of a `POST /v1/events`, validated and
//! normalized when the schedule is created) and a spec saying when to ingest it:
//!
//! | kind | spec | fires |
//! | --- | --- | --- |
//! | `interval` | a humantime duration ≥ 1 s (`"15m"`, `"1h 30m"`) | every period, anchored at the first fire time |
//! | `cron` | a 5-field (minute) or 6-field (second first) cron expression, UTC | at every match |
//! | `once` | an RFC 3339 instant | once, then the schedule is disabled |
//!
//! Missed periods (every orchestrator down) collapse: a schedule whose fire time passed
//! fires once on catch-up, and its next fire time is the first one after *now*.
//!
//! The computation of fire times ([`ScheduleSpec`]) is pure and lives here, next to the
//! store, because both the gateway (first fire time, validation) and the orchestrator's
//! scheduler (the fire time after a firing) need the same answer.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use sb_protocol::host::AgentEventEnvelope;
use sb_protocol::ids::{EventId, WorkspaceId};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::error::{Result, StoreError};
use crate::events::{EventRecord, NewEvent, NewOutboxMessage};
use crate::page::Page;

/// Shortest `interval` period: a scheduler scans about once a second, so a shorter period
/// could not be honoured anyway.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// How a schedule's spec is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// A fixed period (humantime).
    Interval,
    /// A cron expression (UTC).
    Cron,
    /// One RFC 3339 instant.
    Once,
}

impl ScheduleKind {
    /// The stored / wire form.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Interval => "interval",
            Self::Cron => "cron",
            Self::Once => "once",
        }
    }
}

impl FromStr for ScheduleKind {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "interval" => Ok(Self::Interval),
            "cron" => Ok(Self::Cron),
            "once" => Ok(Self::Once),
            other => Err(StoreError::invalid(format!(
                "unknown schedule kind `{other}`: expected interval, cron or once"
            ))),
        }
    }
}

impl std::fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A parsed spec: when a schedule fires.
#[derive(Debug, Clone)]
pub enum ScheduleSpec {
    /// Every `period`, anchored at the first fire time.
    Interval(TimeDelta),
    /// At every match of the expression, UTC.
    Cron(Box<Cron>),
    /// Once, at this instant.
    Once(DateTime<Utc>),
}

impl ScheduleSpec {
    /// Parses `spec` as `kind` says. `invalid_argument` naming `spec` when it does not parse.
    pub fn parse(kind: ScheduleKind, spec: &str) -> Result<Self> {
        let bad = |why: String| StoreError::invalid(format!("invalid `spec` for {kind}: {why}"));
        match kind {
            ScheduleKind::Interval => {
                let period =
                    humantime::parse_duration(spec.trim()).map_err(|e| bad(e.to_string()))?;
                if period < MIN_INTERVAL {
                    return Err(bad("the period must be at least 1s".into()));
                }
                let period = TimeDelta::from_std(period)
                    .ok()
                    .filter(|p| p.num_days() <= 366 * 100)
                    .ok_or_else(|| bad("the period is too long".into()))?;
                Ok(Self::Interval(period))
            }
            ScheduleKind::Cron => {
                let fields = spec.split_whitespace().count();
                if !(fields == 5 || fields == 6) {
                    return Err(bad(format!(
                        "expected 5 fields (minute first) or 6 (second first), got {fields}"
                    )));
                }
                let cron = CronParser::builder()
                    .seconds(Seconds::Optional)
                    .year(Year::Disallowed)
                    .build()
                    .parse(spec)
                    .map_err(|e| bad(e.to_string()))?;
                Ok(Self::Cron(Box::new(cron)))
            }
            ScheduleKind::Once => DateTime::parse_from_rfc3339(spec.trim())
                .map(|t| Self::Once(t.with_timezone(&Utc)))
                .map_err(|e| bad(format!("expected an RFC 3339 time: {e}"))),
        }
    }

    /// The first fire time of a schedule created at `now`: one period from now, the first
    /// cron match after now, or the `once` instant itself (also when it has passed: a
    /// one-shot event for a past time is delivered at once rather than never).
    #[must_use]
    pub fn first_fire(&self, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self {
            Self::Interval(period) => now.checked_add_signed(*period),
            Self::Cron(cron) => cron.find_next_occurrence(&now, false).ok(),
            Self::Once(at) => Some(*at),
        }
    }

    /// The fire time that follows a firing due at `fired_at` and made at `now`
    /// (`fired_at <= now`): always strictly after `now`, so however many periods were
    /// missed while no scheduler ran, the schedule fires once on catch-up, not once per
    /// missed period. `interval` stays on its grid (`fired_at + k·period`); `once` has no
    /// next firing (`None`).
    #[must_use]
    pub fn next_fire(&self, fired_at: DateTime<Utc>, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self {
            Self::Interval(period) => {
                let period_us = period.num_microseconds()?.max(1);
                let behind_us = (now - fired_at).num_microseconds()?.max(0);
                let periods = behind_us / period_us + 1;
                fired_at
                    .checked_add_signed(TimeDelta::microseconds(period_us.checked_mul(periods)?))
            }
            Self::Cron(cron) => cron.find_next_occurrence(&now.max(fired_at), false).ok(),
            Self::Once(_) => None,
        }
    }
}

/// The event a schedule ingests, as stored in `schedules.event`: what was posted and the
/// normalized envelope every firing copies. The gateway normalizes once, at creation (the
/// orchestrator, which fires, does not link the gateway's normalization); each firing only
/// gives the copy its own id, time and idempotency key ([`ScheduledEvent::fire`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScheduledEvent {
    /// The `event` body as posted (what reads of the schedule show).
    pub request: Value,
    /// The envelope normalized from it.
    pub envelope: AgentEventEnvelope,
    /// Its event-log input summary.
    pub input_summary: String,
}

impl ScheduledEvent {
    /// The event of the firing of `schedule_id` due at `fire_at`, ingested as event
    /// `event_id` at `now`, with the idempotency key [`firing_key`], and its envelope (for
    /// the bus announcement). The envelope's metadata gains `schedule_id` and
    /// `scheduled_for` so a run can tell which firing started it.
    pub fn fire(
        &self,
        schedule_id: Uuid,
        fire_at: DateTime<Utc>,
        event_id: EventId,
        now: DateTime<Utc>,
    ) -> Result<(NewEvent, AgentEventEnvelope)> {
        let mut envelope = self.envelope.clone();
        envelope.event_id = event_id;
        envelope.event_time = Some(now.timestamp());
        envelope
            .metadata
            .insert("schedule_id".into(), Value::String(schedule_id.to_string()));
        envelope
            .metadata
            .insert("scheduled_for".into(), Value::String(rfc3339(fire_at)));
        let event = NewEvent::from_envelope(
            &envelope,
            Some(firing_key(schedule_id, fire_at)),
            self.input_summary.clone(),
        )?;
        Ok((event, envelope))
    }
}

/// The idempotency key of one firing: `schedule:<schedule_id>:<fire time, RFC 3339 µs>`
/// (83 characters of `[A-Za-z0-9-_.:]`). The fire time is the scheduled one, not the
/// clock at firing, so every attempt at the same firing carries the same key.
#[must_use]
pub fn firing_key(schedule_id: Uuid, fire_at: DateTime<Utc>) -> String {
    format!("schedule:{schedule_id}:{}", rfc3339(fire_at))
}

fn rfc3339(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// A schedule to create. The store parses `spec` and computes the first fire time.
#[derive(Debug, Clone, PartialEq)]
pub struct NewSchedule {
    /// Owning workspace.
    pub workspace_id: WorkspaceId,
    /// Optional label (≤ 255 chars; not unique).
    pub name: Option<String>,
    /// How `spec` is read.
    pub kind: ScheduleKind,
    /// The spec (see the module docs).
    pub spec: String,
    /// The event to ingest: a [`ScheduledEvent`] as JSON (the store does not read it).
    pub event: Value,
    /// A disabled schedule never fires.
    pub enabled: bool,
}

/// The new state of an edited schedule ([`ScheduleStore::update`]): every editable field,
/// as the caller merged it. `enabled: false` pauses, `true` resumes.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleEdit {
    /// Label.
    pub name: Option<String>,
    /// Kind.
    pub kind: ScheduleKind,
    /// Spec.
    pub spec: String,
    /// The event to ingest ([`ScheduledEvent`] as JSON).
    pub event: Value,
    /// Whether it fires.
    pub enabled: bool,
}

/// The `next_fire_at` of `current` after `edit` at `now` (the rule of
/// [`ScheduleStore::update`]):
///
/// | edit | next fire time |
/// | --- | --- |
/// | paused (`enabled: false`) | `None`: a paused schedule has no next firing |
/// | resumed, or its kind or spec changed | [`ScheduleSpec::first_fire`] of *now*: the periods missed while paused are not caught up |
/// | otherwise (name or event only) | unchanged |
///
/// A `once` schedule that has fired cannot be resumed with the same instant
/// (`invalid_argument`): it would fire a second time for the same moment.
pub fn next_fire_after_edit(
    current: &ScheduleRecord,
    edit: &ScheduleEdit,
    now: DateTime<Utc>,
) -> Result<Option<DateTime<Utc>>> {
    let spec = ScheduleSpec::parse(edit.kind, &edit.spec)?;
    if !edit.enabled {
        return Ok(None);
    }
    let timing_changed = edit.kind != current.kind || edit.spec != current.spec;
    if current.enabled && !timing_changed {
        return Ok(current.next_fire_at);
    }
    if edit.kind == ScheduleKind::Once && !timing_changed && current.last_fired_at.is_some() {
        return Err(StoreError::invalid(
            "invalid `enabled`: this once schedule has fired; give it a new `spec` to fire again",
        ));
    }
    spec.first_fire(now)
        .map(Some)
        .ok_or_else(|| StoreError::invalid("invalid `spec`: it never fires"))
}

/// A stored schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleRecord {
    /// Host-generated id (UUID v7: ids sort by creation).
    pub id: Uuid,
    /// Owning workspace.
    pub workspace_id: WorkspaceId,
    /// Label.
    pub name: Option<String>,
    /// Kind.
    pub kind: ScheduleKind,
    /// Spec.
    pub spec: String,
    /// The event to ingest.
    pub event: Value,
    /// The next firing; `None` once a `once` schedule has fired.
    pub next_fire_at: Option<DateTime<Utc>>,
    /// The scheduled time of the last firing.
    pub last_fired_at: Option<DateTime<Utc>>,
    /// Whether it fires.
    pub enabled: bool,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Last change (creation or firing).
    pub updated_at: DateTime<Utc>,
}

/// One firing, claimed and ingested together by [`ScheduleStore::fire`].
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleFiring {
    /// The schedule.
    pub schedule_id: Uuid,
    /// The `next_fire_at` the caller read: the firing it claims (compare-and-set).
    pub fire_at: DateTime<Utc>,
    /// The fire time after this one ([`ScheduleSpec::next_fire`]); `None` disables the
    /// schedule.
    pub next_fire_at: Option<DateTime<Utc>>,
    /// The event to ingest ([`ScheduledEvent::fire`]).
    pub event: NewEvent,
    /// Its announcement on the bus, enqueued in the same transaction.
    pub outbox: Vec<NewOutboxMessage>,
}

/// Schedules and their firings.
///
/// # Contract
///
/// - **Scope.** `get`, `list` and `delete` see only the given workspace's schedules: an id
///   of another workspace is reported as missing.
/// - **Exactly one firing per fire time.** [`fire`](Self::fire) advances `next_fire_at`
///   from `fire_at` with a compare-and-set on `(id, next_fire_at, enabled)` *and*, in the
///   same transaction, appends the event and its outbox rows exactly as
///   [`EventLog::append`](crate::EventLog::append) does. So among any number of
///   schedulers racing on one due schedule one wins and the others get `None`, and a
///   crash at any point leaves either both (the firing happened and is announced) or
///   neither (the schedule is still due and fires on the next scan) — never a fired
///   schedule without its event, nor an event whose schedule fires it again.
///
///   Why not "claim (advance) first, ingest after": a scheduler dying between the two
///   would lose the firing. Why not "ingest first, advance after" as two writes: a
///   scheduler dying between the two would leave the schedule due, and only the
///   idempotency key would keep the next scan from firing twice. One transaction needs
///   neither repair; the event still carries the key [`firing_key`] so the firing is
///   identifiable, and a replay of the same firing can never create a second event.
/// - **Due reads** ([`due`](Self::due)) are not claims: several schedulers may read the
///   same due schedule; `fire` decides. On Postgres `fire` locks the row with
///   `FOR UPDATE SKIP LOCKED`, so a loser returns at once instead of waiting; on SQLite the
///   write transaction serialises firings.
#[async_trait]
pub trait ScheduleStore: Send + Sync + 'static {
    /// Creates a schedule: parses `spec` (`invalid_argument` naming `spec` when it does not
    /// parse, or `name` when too long) and sets `next_fire_at` to
    /// [`ScheduleSpec::first_fire`] of now.
    async fn create(&self, schedule: NewSchedule) -> Result<ScheduleRecord>;

    /// The schedule, if it exists in this workspace.
    async fn get(&self, workspace_id: &WorkspaceId, id: Uuid) -> Result<Option<ScheduleRecord>>;

    /// One page of the workspace's schedules, oldest first. Pass a page's `next_cursor`
    /// back as `cursor` to read on; `limit` is clamped to [1, 100] (default 50);
    /// `invalid_argument` when the cursor is bad.
    async fn list(
        &self,
        workspace_id: &WorkspaceId,
        cursor: Option<String>,
        limit: Option<i64>,
    ) -> Result<Page<ScheduleRecord>>;

    /// Replaces the editable fields of a schedule ([`ScheduleEdit`]) and sets its next fire
    /// time by [`next_fire_after_edit`]; `None` if it does not exist in this workspace. The
    /// write is a compare-and-set on the row read, so a firing that commits meanwhile is
    /// never undone: the edit is computed again from the fired row. A pending firing of the
    /// old fire time loses its own compare-and-set, so a paused schedule does not fire.
    async fn update(
        &self,
        workspace_id: &WorkspaceId,
        id: Uuid,
        edit: ScheduleEdit,
    ) -> Result<Option<ScheduleRecord>>;

    /// Deletes a schedule; `true` if it existed. A firing that already committed stays
    /// (its event is ingested); none follows.
    async fn delete(&self, workspace_id: &WorkspaceId, id: Uuid) -> Result<bool>;

    /// Up to `limit` (clamped to [1, 1000]) enabled schedules whose `next_fire_at` is at or
    /// before `now`, across every workspace, the most overdue first.
    async fn due(&self, now: DateTime<Utc>, limit: u64) -> Result<Vec<ScheduleRecord>>;

    /// Fires one schedule (see the contract): if it is still enabled with
    /// `next_fire_at = firing.fire_at`, sets `next_fire_at` to `firing.next_fire_at`,
    /// `last_fired_at` to `firing.fire_at` (and `enabled = false` when there is no next
    /// time), appends the event with its outbox rows, and returns what
    /// `EventLog::append` returns. `None` when the compare-and-set failed (another
    /// scheduler fired it, or it was deleted or disabled): nothing is written. The event is
    /// validated as `append` validates it (`invalid_argument`, nothing written).
    async fn fire(&self, firing: ScheduleFiring) -> Result<Option<(EventRecord, bool)>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn spec(kind: ScheduleKind, s: &str) -> ScheduleSpec {
        ScheduleSpec::parse(kind, s).unwrap()
    }

    #[test]
    fn kinds_roundtrip() {
        for kind in [
            ScheduleKind::Interval,
            ScheduleKind::Cron,
            ScheduleKind::Once,
        ] {
            assert_eq!(kind.as_str().parse::<ScheduleKind>().unwrap(), kind);
        }
        assert!("weekly".parse::<ScheduleKind>().is_err());
    }

    #[test]
    fn interval_fires_a_period_after_creation_and_stays_on_its_grid() {
        let s = spec(ScheduleKind::Interval, "15m");
        let now = at("2026-01-01T10:00:00Z");
        assert_eq!(s.first_fire(now), Some(at("2026-01-01T10:15:00Z")));
        // Fired a little late: the next time keeps the grid, not the lateness.
        assert_eq!(
            s.next_fire(at("2026-01-01T10:15:00Z"), at("2026-01-01T10:15:02Z")),
            Some(at("2026-01-01T10:30:00Z"))
        );
        // Fired exactly on time: the next period, strictly after now.
        assert_eq!(
            s.next_fire(at("2026-01-01T10:15:00Z"), at("2026-01-01T10:15:00Z")),
            Some(at("2026-01-01T10:30:00Z"))
        );
    }

    #[test]
    fn interval_catch_up_fires_once_then_resumes_after_now() {
        let s = spec(ScheduleKind::Interval, "1h");
        // Due at 10:00, host down until 15:20: one firing, next at 16:00 (not 11:00).
        assert_eq!(
            s.next_fire(at("2026-01-01T10:00:00Z"), at("2026-01-01T15:20:00Z")),
            Some(at("2026-01-01T16:00:00Z"))
        );
    }

    #[test]
    fn cron_five_and_six_fields() {
        let five = spec(ScheduleKind::Cron, "*/5 * * * *");
        let now = at("2026-01-01T10:02:30Z");
        assert_eq!(five.first_fire(now), Some(at("2026-01-01T10:05:00Z")));
        let six = spec(ScheduleKind::Cron, "30 0 9 * * *");
        assert_eq!(six.first_fire(now), Some(at("2026-01-02T09:00:30Z")));
        // The next match is strictly after the firing.
        assert_eq!(
            five.next_fire(at("2026-01-01T10:05:00Z"), at("2026-01-01T10:05:00Z")),
            Some(at("2026-01-01T10:10:00Z"))
        );
    }

    #[test]
    fn cron_catch_up_fires_once_then_resumes_after_now() {
        let s = spec(ScheduleKind::Cron, "0 * * * *");
        assert_eq!(
            s.next_fire(at("2026-01-01T10:00:00Z"), at("2026-01-01T15:20:00Z")),
            Some(at("2026-01-01T16:00:00Z"))
        );
    }

    #[test]
    fn once_fires_at_its_instant_and_never_again() {
        let s = spec(ScheduleKind::Once, "2026-03-01T08:00:00+01:00");
        assert_eq!(
            s.first_fire(at("2026-01-01T00:00:00Z")),
            Some(at("2026-03-01T07:00:00Z"))
        );
        // A past instant still fires (at once), rather than never.
        assert_eq!(
            s.first_fire(at("2027-01-01T00:00:00Z")),
            Some(at("2026-03-01T07:00:00Z"))
        );
        assert_eq!(
            s.next_fire(at("2026-03-01T07:00:00Z"), at("2026-03-01T07:00:01Z")),
            None
        );
    }

    #[test]
    fn bad_specs_are_invalid_arguments_naming_spec() {
        for (kind, s) in [
            (ScheduleKind::Interval, "soon"),
            (ScheduleKind::Interval, "500ms"),
            (ScheduleKind::Interval, "0s"),
            (ScheduleKind::Cron, "* * * *"),
            (ScheduleKind::Cron, "0 0 0 * * * 2030"),
            (ScheduleKind::Cron, "61 * * * *"),
            (ScheduleKind::Once, "tomorrow"),
        ] {
            let error = ScheduleSpec::parse(kind, s).unwrap_err();
            assert!(
                matches!(&error, StoreError::InvalidArgument(m) if m.contains("`spec`")),
                "{kind} {s}: {error:?}"
            );
        }
    }

    fn record(kind: ScheduleKind, spec: &str) -> ScheduleRecord {
        let t = at("2026-01-01T10:00:00Z");
        ScheduleRecord {
            id: Uuid::now_v7(),
            workspace_id: WorkspaceId::default_workspace(),
            name: None,
            kind,
            spec: spec.into(),
            event: Value::Null,
            next_fire_at: Some(at("2026-01-01T10:15:00Z")),
            last_fired_at: None,
            enabled: true,
            created_at: t,
            updated_at: t,
        }
    }

    fn edit_of(r: &ScheduleRecord) -> ScheduleEdit {
        ScheduleEdit {
            name: r.name.clone(),
            kind: r.kind,
            spec: r.spec.clone(),
            event: r.event.clone(),
            enabled: r.enabled,
        }
    }

    #[test]
    fn pausing_clears_and_resuming_recomputes_from_now() {
        let now = at("2026-01-01T12:07:00Z");
        let running = record(ScheduleKind::Interval, "15m");
        let mut pause = edit_of(&running);
        pause.enabled = false;
        assert_eq!(next_fire_after_edit(&running, &pause, now).unwrap(), None);

        let paused = ScheduleRecord {
            enabled: false,
            next_fire_at: None,
            ..running.clone()
        };
        let mut resume = edit_of(&paused);
        resume.enabled = true;
        // Not the missed 10:15 grid: one period after now.
        assert_eq!(
            next_fire_after_edit(&paused, &resume, now).unwrap(),
            Some(at("2026-01-01T12:22:00Z"))
        );
        // A rename keeps the next fire time; a new spec recomputes it.
        let mut rename = edit_of(&running);
        rename.name = Some("renamed".into());
        assert_eq!(
            next_fire_after_edit(&running, &rename, now).unwrap(),
            running.next_fire_at
        );
        let mut respec = edit_of(&running);
        respec.spec = "1h".into();
        assert_eq!(
            next_fire_after_edit(&running, &respec, now).unwrap(),
            Some(at("2026-01-01T13:07:00Z"))
        );
        respec.spec = "soon".into();
        assert!(next_fire_after_edit(&running, &respec, now).is_err());
    }

    #[test]
    fn a_fired_once_schedule_resumes_only_with_a_new_instant() {
        let now = at("2026-01-01T12:00:00Z");
        let fired = ScheduleRecord {
            enabled: false,
            next_fire_at: None,
            last_fired_at: Some(at("2026-01-01T11:00:00Z")),
            ..record(ScheduleKind::Once, "2026-01-01T11:00:00Z")
        };
        let mut resume = edit_of(&fired);
        resume.enabled = true;
        assert!(next_fire_after_edit(&fired, &resume, now).is_err());
        resume.spec = "2026-01-02T08:00:00Z".into();
        assert_eq!(
            next_fire_after_edit(&fired, &resume, now).unwrap(),
            Some(at("2026-01-02T08:00:00Z"))
        );
    }

    #[test]
    fn firing_keys_are_valid_idempotency_keys() {
        let key = firing_key(Uuid::now_v7(), at("2026-01-01T10:00:00.123456Z"));
        assert!(crate::events::is_valid_idempotency_key(&key), "{key}");
        assert!(key.ends_with(":2026-01-01T10:00:00.123456Z"));
    }
}
