//! Bus message bodies (JSON). Every body carries a `schema` field naming its kind and
//! version, e.g. `"schema": "switchboard.job/1"`.
//!
//! The `schema` field is a zero-sized marker type per message: it always serializes as the
//! right constant, and deserializing a body with any other value fails. So a message that
//! lands on the wrong queue, or a future incompatible version, is rejected at decode instead
//! of being half-understood. [`decode`] gives the clearest error: it checks `schema` before
//! looking at the rest of the body.
//!
//! | schema | body | published by → consumed by |
//! | --- | --- | --- |
//! | `switchboard.event/1` | [`EventMessage`] | gateway outbox → orchestrator |
//! | `switchboard.job/1` | [`RunJob`] | orchestrator → worker pool |
//! | `switchboard.result/1` | [`ResultMessage`] | worker → orchestrator result sink |
//! | `switchboard.delivery/1` | [`DeliveryMessage`] | result sink (after persistence) → gateway |
//! | `switchboard.results/1` | [`ResultBatch`] | worker → orchestrator result sink (several items of one run) |
//! | `switchboard.deliveries/1` | [`DeliveryBatch`] | result sink → gateway (several items of one run) |
//! | `switchboard.events/1` | [`EventBatch`] | gateway outbox → orchestrator (several events of one shard) |
//!
//! The batch forms carry consecutive items of **one** run in sequence order (SPEC §15): a
//! worker sends what its runner produced while the previous publish was in flight as one
//! message, so a streaming run costs the broker, the sink and the gateway one message per
//! batch instead of one per token. Consumers accept both forms ([`decode_results`],
//! [`decode_deliveries`], [`decode_events`]), so producers of either age interoperate during
//! a rolling upgrade. An [`EventBatch`] is the other way round: the pointers of events of
//! *different* conversations that the outbox relay publishes in one round to one shard, each
//! still routed in its own lane (orchestrators must be upgraded before the gateways that
//! send it).
//! A delivery's results are the ledger's JSON text of each item ([`encode_delivery`]), and a
//! gateway forwards that text as it is ([`decode_live`]): a streamed item is serialized once,
//! by the sink, between the runner's line and the client's SSE frame.
//! | `switchboard.control/1` | [`ControlMessage`] | gateway/orchestrator → worker |
//!
//! ```
//! use sb_protocol::ids::{EventId, WorkspaceId};
//! use sb_protocol::messages::{decode, encode, DecodeError, EventMessage, RunJob};
//! let msg = EventMessage::new(WorkspaceId::default_workspace(), EventId::new());
//! let bytes = encode(&msg);
//! assert!(std::str::from_utf8(&bytes).unwrap().contains(r#""schema":"switchboard.event/1""#));
//! assert_eq!(decode::<EventMessage>(&bytes).unwrap(), msg);
//! assert!(matches!(decode::<RunJob>(&bytes), Err(DecodeError::WrongSchema { .. })));
//! ```

use std::fmt;

use serde::de::{self, DeserializeOwned, Deserializer};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;

use crate::context::AgentRunContext;
use crate::ids::{EventId, RunId, WorkspaceId};
use crate::manifest::RunnerId;
use crate::result::AgentRunResult;

/// A bus message body with a fixed schema name.
pub trait BusMessage: Serialize + DeserializeOwned {
    /// The `schema` value, `switchboard.<kind>/<version>`.
    const SCHEMA: &'static str;
}

macro_rules! schema_marker {
    ($(#[$meta:meta])* $name:ident = $text:literal) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
        pub struct $name;

        impl $name {
            /// The schema text.
            pub const TEXT: &'static str = $text;
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str($text)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
                if s == $text {
                    Ok(Self)
                } else {
                    Err(de::Error::custom(format_args!(
                        "expected schema `{}`, found `{}`",
                        $text, s
                    )))
                }
            }
        }
    };
}

schema_marker!(
    /// `switchboard.event/1`.
    EventSchema = "switchboard.event/1"
);
schema_marker!(
    /// `switchboard.job/1`.
    JobSchema = "switchboard.job/1"
);
schema_marker!(
    /// `switchboard.result/1`.
    ResultSchema = "switchboard.result/1"
);
schema_marker!(
    /// `switchboard.delivery/1`.
    DeliverySchema = "switchboard.delivery/1"
);
schema_marker!(
    /// `switchboard.control/1`.
    ControlSchema = "switchboard.control/1"
);
schema_marker!(
    /// `switchboard.results/1`: the `schema` of a [`ResultBatch`].
    ResultBatchSchema = "switchboard.results/1"
);
schema_marker!(
    /// `switchboard.deliveries/1`: the `schema` of a [`DeliveryBatch`].
    DeliveryBatchSchema = "switchboard.deliveries/1"
);
schema_marker!(
    /// `switchboard.events/1`: the `schema` of an [`EventBatch`].
    EventBatchSchema = "switchboard.events/1"
);

/// An event was accepted. A pointer only: the orchestrator loads the envelope from the event
/// log, which is the source of truth.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventMessage {
    /// Always `switchboard.event/1`.
    pub schema: EventSchema,
    /// Tenant.
    pub workspace_id: WorkspaceId,
    /// The event-log id.
    pub event_id: EventId,
    /// The event's ordering lane: a consumer routes the events of one lane in the order they
    /// were published and may route those of different lanes side by side. Events of one
    /// conversation share a lane; an event without a conversation has one of its own (see
    /// `sb_common::bus::topology::event_lane`). Absent (a message from a publisher that
    /// predates lanes): the event is routed alone, after every message before it and before
    /// every message after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane: Option<u64>,
}

impl EventMessage {
    /// A pointer to an accepted event, without a lane (routed alone).
    #[must_use]
    pub fn new(workspace_id: WorkspaceId, event_id: EventId) -> Self {
        Self {
            schema: EventSchema,
            workspace_id,
            event_id,
            lane: None,
        }
    }

    /// The same pointer in ordering lane `lane`.
    #[must_use]
    pub fn in_lane(self, lane: u64) -> Self {
        Self {
            lane: Some(lane),
            ..self
        }
    }
}

impl BusMessage for EventMessage {
    const SCHEMA: &'static str = EventSchema::TEXT;
}

/// Event pointers published as one message to one events shard: what the outbox relay
/// publishes in one round to that shard, in the order of their rows. A queued message costs
/// the broker (a replicated write, a delivery, a settlement) much more than its bytes, so a
/// busy gateway pays that once per round rather than once per event.
///
/// Each event keeps its own lane: the consumer routes the events of a batch as it routes
/// separate messages (one lane in order, different lanes side by side) and settles the
/// message once, after all of them; when only some were routed, it acks the message and
/// publishes the others again on their own, so no routed event is routed again.
///
/// Consumers that predate this form reject it (as a wrong schema, dead-lettered): upgrade
/// the orchestrators before the gateways.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventBatch {
    /// Always `switchboard.events/1`.
    pub schema: EventBatchSchema,
    /// The events, in publication order; never empty.
    pub events: Vec<EventMessage>,
}

impl EventBatch {
    /// Most events one batch carries: a bound on a message's routing time, and on what a
    /// lost acknowledgement (a consumer that died mid-batch) has routed again.
    pub const MAX_EVENTS: usize = 64;

    /// A batch of `events` (in order).
    #[must_use]
    pub fn new(events: Vec<EventMessage>) -> Self {
        Self {
            schema: EventBatchSchema,
            events,
        }
    }
}

impl BusMessage for EventBatch {
    const SCHEMA: &'static str = EventBatchSchema::TEXT;
}

/// Decodes an events-queue body: an [`EventBatch`] or a single [`EventMessage`], as the
/// events it points to (in order).
///
/// # Errors
///
/// The [`DecodeError`] of the single form when the body is neither; an empty batch is
/// [`DecodeError::Malformed`].
pub fn decode_events(bytes: &[u8]) -> Result<Vec<EventMessage>, DecodeError> {
    // The single form first: every publisher sends it for a round of one event.
    let single = match decode::<EventMessage>(bytes) {
        Ok(message) => return Ok(vec![message]),
        Err(error @ DecodeError::WrongSchema { .. }) => error,
        Err(error) => return Err(error),
    };
    match decode::<EventBatch>(bytes) {
        Ok(batch) if batch.events.is_empty() => Err(DecodeError::Malformed {
            expected: EventBatchSchema::TEXT,
            reason: "a batch without events".to_owned(),
        }),
        Ok(batch) => Ok(batch.events),
        Err(DecodeError::WrongSchema { .. }) => Err(single),
        Err(error) => Err(error),
    }
}

/// A run to execute, published to `switchboard.runs.<pool>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunJob {
    /// Always `switchboard.job/1`.
    pub schema: JobSchema,
    /// The run (equal to `context.run_id`).
    pub run_id: RunId,
    /// Tenant.
    pub workspace_id: WorkspaceId,
    /// The runner to use.
    pub runner_id: RunnerId,
    /// The worker pool.
    pub pool: String,
    /// The full context sent to the runner.
    pub context: AgentRunContext,
    /// Absolute deadline, epoch milliseconds; `None` = no deadline.
    #[serde(default)]
    pub deadline_at_ms: Option<i64>,
    /// When the triggering event was accepted, epoch milliseconds (for the
    /// ingest-to-first-result histogram); absent in jobs of older orchestrators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_at_ms: Option<i64>,
    /// The run's facts, for the worker to copy into its result messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunFacts>,
}

impl RunJob {
    /// A job for `context`; `run_id` and the deadline are taken from the context.
    #[must_use]
    pub fn new(
        workspace_id: WorkspaceId,
        runner_id: RunnerId,
        pool: impl Into<String>,
        context: AgentRunContext,
    ) -> Self {
        #[allow(clippy::cast_possible_truncation)]
        let deadline_at_ms = context
            .runtime
            .deadline_at
            .map(|s| (s * 1000.0).round() as i64);
        Self {
            schema: JobSchema,
            run_id: context.run_id,
            workspace_id,
            runner_id,
            pool: pool.into(),
            context,
            deadline_at_ms,
            accepted_at_ms: None,
            run: None,
        }
    }
}

impl BusMessage for RunJob {
    const SCHEMA: &'static str = JobSchema::TEXT;
}

/// The facts of a run that never change once its row exists, carried from the job to every
/// result message so the result sink applies an item without reading the run row back (one
/// ledger read per run less on the hot path). Equal to what the run row holds: the
/// orchestrator writes both from the same values. Absent in messages of older hosts; the
/// sink then reads the row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunFacts {
    /// The triggering event.
    pub event_id: EventId,
    /// The runner, as text.
    pub runner_id: String,
    /// Thread within the conversation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_id: Option<String>,
    /// Bot handling the event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bot_id: Option<String>,
}

/// One sequenced result of a run, from the worker (see [`DeliveryMessage`] for `R`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultMessage<R = AgentRunResult> {
    /// Always `switchboard.result/1`.
    pub schema: ResultSchema,
    /// The run.
    pub run_id: RunId,
    /// Tenant.
    pub workspace_id: WorkspaceId,
    /// Conversation, for routing deliveries.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Transport sequence assigned by the worker: 1, 2, 3, … per run.
    pub sequence: u64,
    /// The result (its own `sequence` equals the one above).
    pub result: R,
    /// The run's facts (from its job), so the sink need not read the run row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunFacts>,
}

impl ResultMessage {
    /// A result message; sets `result.run_id` and `result.sequence` to match.
    #[must_use]
    pub fn new(
        run_id: RunId,
        workspace_id: WorkspaceId,
        conversation_id: Option<String>,
        sequence: u64,
        result: AgentRunResult,
    ) -> Self {
        let result = result.with_run_id(run_id).with_sequence(sequence);
        Self {
            schema: ResultSchema,
            run_id,
            workspace_id,
            conversation_id,
            sequence,
            result,
            run: None,
        }
    }

    /// The same message carrying the run's facts.
    #[must_use]
    pub fn with_run(mut self, run: Option<RunFacts>) -> Self {
        self.run = run;
        self
    }
}

impl<R: Serialize + DeserializeOwned> BusMessage for ResultMessage<R> {
    const SCHEMA: &'static str = ResultSchema::TEXT;
}

/// A persisted result, published for live delivery. Same shape as [`ResultMessage`]. `R` is
/// how the result is held: parsed (the default), or as its JSON text where it is only passed
/// on ([`decode_live`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeliveryMessage<R = AgentRunResult> {
    /// Always `switchboard.delivery/1`.
    pub schema: DeliverySchema,
    /// The run.
    pub run_id: RunId,
    /// Tenant.
    pub workspace_id: WorkspaceId,
    /// Conversation.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Transport sequence.
    pub sequence: u64,
    /// The result.
    pub result: R,
    /// The run's triggering event, when the sink knew it: `POST /v1/events?stream=true`
    /// recognizes its own run's first item by it, without reading the event's route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<EventId>,
}

impl<R> From<ResultMessage<R>> for DeliveryMessage<R> {
    fn from(m: ResultMessage<R>) -> Self {
        Self {
            schema: DeliverySchema,
            run_id: m.run_id,
            workspace_id: m.workspace_id,
            conversation_id: m.conversation_id,
            sequence: m.sequence,
            result: m.result,
            event_id: m.run.map(|facts| facts.event_id),
        }
    }
}

impl<R: Serialize + DeserializeOwned> BusMessage for DeliveryMessage<R> {
    const SCHEMA: &'static str = DeliverySchema::TEXT;
}

/// One item of a batch: its transport sequence and the result (whose own `sequence` and
/// `run_id` match the batch's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequencedResult<R = AgentRunResult> {
    /// Transport sequence assigned by the worker.
    pub sequence: u64,
    /// The result (see [`DeliveryMessage`] for `R`).
    pub result: R,
}

/// Consecutive result items of one run, published by a worker as one message (see the
/// module docs). The sink treats it exactly as the [`ResultMessage`]s it contains, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultBatch {
    /// Always `switchboard.results/1`.
    pub schema: ResultBatchSchema,
    /// The run.
    pub run_id: RunId,
    /// Tenant.
    pub workspace_id: WorkspaceId,
    /// Conversation, for routing deliveries.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// The items, ascending by sequence; never empty.
    pub items: Vec<SequencedResult>,
    /// The run's facts (from its job), so the sink need not read the run row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunFacts>,
}

impl ResultBatch {
    /// A batch of `items` (`(sequence, result)`, ascending) of one run; sets each result's
    /// `run_id` and `sequence` to match.
    #[must_use]
    pub fn new(
        run_id: RunId,
        workspace_id: WorkspaceId,
        conversation_id: Option<String>,
        items: impl IntoIterator<Item = (u64, AgentRunResult)>,
    ) -> Self {
        Self {
            schema: ResultBatchSchema,
            run_id,
            workspace_id,
            conversation_id,
            items: items
                .into_iter()
                .map(|(sequence, result)| SequencedResult {
                    sequence,
                    result: result.with_run_id(run_id).with_sequence(sequence),
                })
                .collect(),
            run: None,
        }
    }

    /// The same batch carrying the run's facts.
    #[must_use]
    pub fn with_run(mut self, run: Option<RunFacts>) -> Self {
        self.run = run;
        self
    }

    /// The single messages, in order.
    #[must_use]
    pub fn into_messages(self) -> Vec<ResultMessage> {
        let Self {
            run_id,
            workspace_id,
            conversation_id,
            items,
            run,
            ..
        } = self;
        items
            .into_iter()
            .map(|item| ResultMessage {
                schema: ResultSchema,
                run_id,
                workspace_id: workspace_id.clone(),
                conversation_id: conversation_id.clone(),
                sequence: item.sequence,
                result: item.result,
                run: run.clone(),
            })
            .collect()
    }
}

impl BusMessage for ResultBatch {
    const SCHEMA: &'static str = ResultBatchSchema::TEXT;
}

/// Consecutive persisted items of one run, published by the result sink for live delivery
/// as one message (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeliveryBatch<R = AgentRunResult> {
    /// Always `switchboard.deliveries/1`.
    pub schema: DeliveryBatchSchema,
    /// The run.
    pub run_id: RunId,
    /// Tenant.
    pub workspace_id: WorkspaceId,
    /// Conversation.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// The items, ascending by sequence; never empty.
    pub items: Vec<SequencedResult<R>>,
    /// The run's triggering event, when the sink knew it (see [`DeliveryMessage`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<EventId>,
}

impl DeliveryBatch {
    /// The batch of `messages`, which must all be of one run (ascending); `None` when empty.
    #[must_use]
    pub fn of(messages: &[&ResultMessage]) -> Option<Self> {
        let first = messages.first()?;
        Some(Self {
            schema: DeliveryBatchSchema,
            run_id: first.run_id,
            workspace_id: first.workspace_id.clone(),
            conversation_id: first.conversation_id.clone(),
            items: messages
                .iter()
                .map(|m| SequencedResult {
                    sequence: m.sequence,
                    result: m.result.clone(),
                })
                .collect(),
            event_id: first.run.as_ref().map(|facts| facts.event_id),
        })
    }
}

impl<R> DeliveryBatch<R> {
    /// The single messages, in order.
    #[must_use]
    pub fn into_messages(self) -> Vec<DeliveryMessage<R>> {
        let Self {
            run_id,
            workspace_id,
            conversation_id,
            items,
            event_id,
            ..
        } = self;
        items
            .into_iter()
            .map(|item| DeliveryMessage {
                schema: DeliverySchema,
                run_id,
                workspace_id: workspace_id.clone(),
                conversation_id: conversation_id.clone(),
                sequence: item.sequence,
                result: item.result,
                event_id,
            })
            .collect()
    }
}

/// A single delivery as a batch of one.
impl<R> From<DeliveryMessage<R>> for DeliveryBatch<R> {
    fn from(m: DeliveryMessage<R>) -> Self {
        Self {
            schema: DeliveryBatchSchema,
            run_id: m.run_id,
            workspace_id: m.workspace_id,
            conversation_id: m.conversation_id,
            items: vec![SequencedResult {
                sequence: m.sequence,
                result: m.result,
            }],
            event_id: m.event_id,
        }
    }
}

impl<R: Serialize + DeserializeOwned> BusMessage for DeliveryBatch<R> {
    const SCHEMA: &'static str = DeliveryBatchSchema::TEXT;
}

/// Decodes a body sent to the result sink: a [`ResultBatch`] or a single [`ResultMessage`],
/// as the messages it holds (in order).
///
/// # Errors
///
/// The [`DecodeError`] of the single form when the body is neither.
pub fn decode_results(bytes: &[u8]) -> Result<Vec<ResultMessage>, DecodeError> {
    match decode::<ResultBatch>(bytes) {
        Ok(batch) if batch.items.is_empty() => Err(DecodeError::Malformed {
            expected: ResultBatchSchema::TEXT,
            reason: "a batch without items".to_owned(),
        }),
        Ok(batch) => Ok(batch.into_messages()),
        Err(DecodeError::WrongSchema { .. }) => decode::<ResultMessage>(bytes).map(|m| vec![m]),
        Err(e) => Err(e),
    }
}

/// Decodes a live delivery: a [`DeliveryBatch`], a single [`DeliveryMessage`], or a single
/// [`ResultMessage`] (same shape), as the delivery messages it holds (in order).
///
/// # Errors
///
/// The [`DecodeError`] of the single form when the body is none of them.
pub fn decode_deliveries(bytes: &[u8]) -> Result<Vec<DeliveryMessage>, DecodeError> {
    match decode::<DeliveryBatch>(bytes) {
        Ok(batch) => Ok(batch.into_messages()),
        Err(DecodeError::WrongSchema { .. }) => match decode::<DeliveryMessage>(bytes) {
            Err(DecodeError::WrongSchema { .. }) => {
                decode::<ResultMessage>(bytes).map(|m| vec![DeliveryMessage::from(m)])
            }
            other => other.map(|m| vec![m]),
        },
        Err(e) => Err(e),
    }
}

/// A control command, routed by `cancel.<run_id>`.
///
/// On the wire: `{"schema": "switchboard.control/1", "type": "cancel", "run_id": …, "reason": …}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "ControlWire", from = "ControlWire")]
pub enum ControlMessage {
    /// Cancel a run cooperatively, then forcefully after the grace period.
    Cancel {
        /// The run.
        run_id: RunId,
        /// Why (shown in `run.failed` and the audit log).
        reason: String,
    },
}

impl ControlMessage {
    /// The run the command is about.
    #[must_use]
    pub fn run_id(&self) -> RunId {
        match self {
            Self::Cancel { run_id, .. } => *run_id,
        }
    }
}

#[derive(Clone, Serialize, Deserialize)]
struct ControlWire {
    schema: ControlSchema,
    #[serde(flatten)]
    body: ControlBody,
}

#[derive(Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ControlBody {
    Cancel { run_id: RunId, reason: String },
}

impl From<ControlMessage> for ControlWire {
    fn from(m: ControlMessage) -> Self {
        let body = match m {
            ControlMessage::Cancel { run_id, reason } => ControlBody::Cancel { run_id, reason },
        };
        Self {
            schema: ControlSchema,
            body,
        }
    }
}

impl From<ControlWire> for ControlMessage {
    fn from(w: ControlWire) -> Self {
        match w.body {
            ControlBody::Cancel { run_id, reason } => Self::Cancel { run_id, reason },
        }
    }
}

impl BusMessage for ControlMessage {
    const SCHEMA: &'static str = ControlSchema::TEXT;
}

/// Why a bus body could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Not JSON, or not an object with a string `schema`.
    #[error("malformed {expected} message: {reason}")]
    Malformed {
        /// The expected schema.
        expected: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// The `schema` names another message kind or version.
    #[error("wrong message schema: expected `{expected}`, found `{found}`")]
    WrongSchema {
        /// The expected schema.
        expected: &'static str,
        /// The schema found.
        found: String,
    },
    /// The schema matched but the body is invalid.
    #[error("invalid {expected} message: {source}")]
    Invalid {
        /// The schema.
        expected: &'static str,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
}

impl crate::error::HasErrorCode for DecodeError {
    /// A body that cannot be decoded will never decode: dead-letter it.
    fn code(&self) -> crate::error::ErrorCode {
        crate::error::ErrorCode::InvalidArgument
    }
}

/// Serializes a bus body to JSON bytes.
#[must_use]
pub fn encode<M: BusMessage>(message: &M) -> Vec<u8> {
    // Bodies contain only strings, numbers, maps and ids: serialization cannot fail.
    serde_json::to_vec(message).unwrap_or_default()
}

/// One persisted item for [`encode_delivery`]: its message, and its result's JSON as the
/// ledger stored it (`serde_json`'s text of `message.result`, which names its run and
/// sequence), embedded as is.
pub type StoredItem<'a> = (&'a ResultMessage, &'a RawValue);

/// The live-delivery body of persisted `items` (consecutive items of one run, ascending):
/// a [`DeliveryMessage`] for one, a [`DeliveryBatch`] for several, byte for byte as
/// [`encode`] writes those, but with each result's JSON taken from the ledger's copy — the
/// sink serialized every result once to store it, and serializing it again for the delivery
/// was the second of three passes over every streamed item (the gateway's parse and
/// re-serialization being the third, see [`decode_live`]). Empty for no items.
#[must_use]
pub fn encode_delivery(items: &[StoredItem<'_>]) -> Vec<u8> {
    /// [`DeliveryMessage`], borrowed (same fields, same order, same attributes).
    #[derive(Serialize)]
    struct Single<'a> {
        schema: DeliverySchema,
        run_id: RunId,
        workspace_id: &'a WorkspaceId,
        conversation_id: &'a Option<String>,
        sequence: u64,
        result: &'a RawValue,
        #[serde(skip_serializing_if = "Option::is_none")]
        event_id: Option<EventId>,
    }
    /// [`SequencedResult`], borrowed.
    #[derive(Serialize)]
    struct Item<'a> {
        sequence: u64,
        result: &'a RawValue,
    }
    /// [`DeliveryBatch`], borrowed.
    #[derive(Serialize)]
    struct Batch<'a> {
        schema: DeliveryBatchSchema,
        run_id: RunId,
        workspace_id: &'a WorkspaceId,
        conversation_id: &'a Option<String>,
        items: Vec<Item<'a>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        event_id: Option<EventId>,
    }
    let Some((first, _)) = items.first() else {
        return Vec::new();
    };
    let event_id = first.run.as_ref().map(|facts| facts.event_id);
    // Bodies contain only strings, numbers, maps and ids: serialization cannot fail.
    if let [(single, result)] = items {
        serde_json::to_vec(&Single {
            schema: DeliverySchema,
            run_id: single.run_id,
            workspace_id: &single.workspace_id,
            conversation_id: &single.conversation_id,
            sequence: single.sequence,
            result,
            event_id,
        })
    } else {
        serde_json::to_vec(&Batch {
            schema: DeliveryBatchSchema,
            run_id: first.run_id,
            workspace_id: &first.workspace_id,
            conversation_id: &first.conversation_id,
            items: items
                .iter()
                .map(|(message, result)| Item {
                    sequence: message.sequence,
                    result,
                })
                .collect(),
            event_id,
        })
    }
    .unwrap_or_default()
}

/// A live delivery as a gateway forwards it: the run's routing facts once, and each item's
/// result as the JSON text it arrived as. Streams send that text as the SSE `data` of the
/// item without parsing it into an [`AgentRunResult`] and serializing it again (which cost
/// a tree of maps per streamed token); see [`decode_live`].
#[derive(Debug, Clone)]
pub struct LiveDelivery {
    /// Tenant.
    pub workspace_id: WorkspaceId,
    /// Conversation.
    pub conversation_id: Option<String>,
    /// The items, in the order delivered (ascending by sequence); never empty.
    pub items: Vec<LiveItem>,
}

/// One item of a [`LiveDelivery`].
#[derive(Debug, Clone)]
pub struct LiveItem {
    /// The run.
    pub run_id: RunId,
    /// The run's triggering event, when the sink knew it (see [`DeliveryMessage`]).
    pub event_id: Option<EventId>,
    /// Transport sequence.
    pub sequence: u64,
    /// The result's `type`.
    pub result_type: String,
    /// The result (an [`AgentRunResult`]), as delivered.
    pub result: Box<RawValue>,
    /// The result names its run and sequence as the delivery does (every item a worker
    /// numbered does), so its text can be sent as it is.
    pub names_itself: bool,
}

impl LiveItem {
    /// The item of `run_id` at `sequence` whose result is `result`.
    ///
    /// # Errors
    ///
    /// `result` is not a JSON object with a string `type` (or has a `run_id` or `sequence`
    /// of the wrong type).
    pub fn new(
        run_id: RunId,
        event_id: Option<EventId>,
        sequence: u64,
        result: Box<RawValue>,
    ) -> Result<Self, serde_json::Error> {
        /// The fields of an [`AgentRunResult`] a stream needs, read without building the
        /// rest (serde skips the other fields without allocating).
        #[derive(Deserialize)]
        struct Peek<'a> {
            #[serde(rename = "type", default)]
            result_type: String,
            #[serde(default, borrow)]
            run_id: Option<std::borrow::Cow<'a, str>>,
            #[serde(default)]
            sequence: Option<u64>,
        }
        let peek: Peek<'_> = serde_json::from_str(result.get())?;
        let names_itself = peek.sequence == Some(sequence)
            && peek
                .run_id
                .is_some_and(|id| id.parse::<RunId>().ok() == Some(run_id));
        Ok(Self {
            run_id,
            event_id,
            sequence,
            result_type: peek.result_type,
            result,
            names_itself,
        })
    }

    /// The result, parsed (for an item that does not name itself, which must be framed
    /// from a copy naming its run and sequence). A result that fails to parse as an
    /// [`AgentRunResult`] after [`LiveItem::new`] accepted it is framed as an empty one of
    /// its type.
    #[must_use]
    pub fn to_result(&self) -> AgentRunResult {
        serde_json::from_str::<AgentRunResult>(self.result.get()).unwrap_or_else(|_| {
            AgentRunResult {
                run_id: String::new(),
                result_type: self.result_type.clone(),
                data: serde_json::Map::new(),
                sequence: None,
                timestamp: None,
                usage: None,
            }
        })
    }

    /// Whether this is `run.completed` or `run.failed`.
    #[must_use]
    pub fn is_terminal(&self) -> bool {
        self.result_type
            .parse::<crate::result::ResultType>()
            .is_ok_and(crate::result::ResultType::is_terminal)
    }
}

/// Decodes a live delivery (a [`DeliveryBatch`], a single [`DeliveryMessage`], or a single
/// [`ResultMessage`]) as the gateway forwards it: the same items as [`decode_deliveries`]
/// gives, each result kept as its JSON text.
///
/// # Errors
///
/// The [`DecodeError`] of the single form when the body is none of them; a batch without
/// items, or an item whose result is not an object with a string `type`, is malformed.
pub fn decode_live(bytes: &[u8]) -> Result<LiveDelivery, DecodeError> {
    type Raw = Box<RawValue>;
    let batch = match decode::<DeliveryBatch<Raw>>(bytes) {
        Ok(batch) => batch,
        Err(DecodeError::WrongSchema { .. }) => match decode::<DeliveryMessage<Raw>>(bytes) {
            Ok(single) => single.into(),
            Err(DecodeError::WrongSchema { .. }) => {
                DeliveryMessage::from(decode::<ResultMessage<Raw>>(bytes)?).into()
            }
            Err(e) => return Err(e),
        },
        Err(e) => return Err(e),
    };
    let malformed = |reason: String| DecodeError::Malformed {
        expected: DeliveryBatchSchema::TEXT,
        reason,
    };
    if batch.items.is_empty() {
        return Err(malformed("a batch without items".to_owned()));
    }
    let (run_id, event_id) = (batch.run_id, batch.event_id);
    let items = batch
        .items
        .into_iter()
        .map(|item| {
            LiveItem::new(run_id, event_id, item.sequence, item.result)
                .map_err(|e| malformed(format!("item {}: {e}", item.sequence)))
        })
        .collect::<Result<_, _>>()?;
    Ok(LiveDelivery {
        workspace_id: batch.workspace_id,
        conversation_id: batch.conversation_id,
        items,
    })
}

/// Decodes a bus body, checking `schema` first so that a message of the wrong kind or
/// version gets a [`DecodeError::WrongSchema`] rather than a confusing field error.
pub fn decode<M: BusMessage>(bytes: &[u8]) -> Result<M, DecodeError> {
    // The body is parsed once when it is what it should be (every `schema` field is a
    // required marker that only takes `M::SCHEMA`); only a body that fails is looked at
    // again, to say why.
    let source = match serde_json::from_slice(bytes) {
        Ok(message) => return Ok(message),
        Err(source) => source,
    };
    #[derive(Deserialize)]
    struct Peek<'a> {
        #[serde(borrow)]
        schema: Option<std::borrow::Cow<'a, str>>,
    }
    let peek: Peek<'_> = serde_json::from_slice(bytes).map_err(|e| DecodeError::Malformed {
        expected: M::SCHEMA,
        reason: e.to_string(),
    })?;
    match peek.schema {
        None => {
            return Err(DecodeError::Malformed {
                expected: M::SCHEMA,
                reason: "missing `schema` field".to_owned(),
            });
        }
        Some(s) if s != M::SCHEMA => {
            return Err(DecodeError::WrongSchema {
                expected: M::SCHEMA,
                found: s.into_owned(),
            });
        }
        Some(_) => {}
    }
    Err(DecodeError::Invalid {
        expected: M::SCHEMA,
        source,
    })
}

impl fmt::Display for ControlMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cancel { run_id, reason } => write!(f, "cancel {run_id}: {reason}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn control_message_wire_shape() {
        let id = RunId::new();
        let m = ControlMessage::Cancel {
            run_id: id,
            reason: "user".into(),
        };
        let v = serde_json::to_value(&m).unwrap();
        assert_eq!(
            v,
            json!({"schema": "switchboard.control/1", "type": "cancel", "run_id": id.to_string(), "reason": "user"})
        );
        assert_eq!(decode::<ControlMessage>(&encode(&m)).unwrap(), m);
        assert_eq!(m.run_id(), id);
        let bad =
            json!({"schema": "switchboard.control/1", "type": "pause", "run_id": id.to_string()});
        assert!(matches!(
            decode::<ControlMessage>(bad.to_string().as_bytes()),
            Err(DecodeError::Invalid { .. })
        ));
    }

    fn item(text: &str) -> AgentRunResult {
        serde_json::from_value(json!({"type": "message.delta", "data": {"chunk": {"role": "assistant", "content": text}}})).unwrap()
    }

    /// The results' JSON as the ledger stores it.
    fn stored_json(messages: &[&ResultMessage]) -> Vec<Box<RawValue>> {
        messages
            .iter()
            .map(|m| serde_json::value::to_raw_value(&m.result).unwrap())
            .collect()
    }

    fn stored_items<'a>(
        messages: &[&'a ResultMessage],
        stored: &'a [Box<RawValue>],
    ) -> Vec<StoredItem<'a>> {
        messages
            .iter()
            .zip(stored)
            .map(|(m, json)| (*m, json.as_ref()))
            .collect()
    }

    /// What a stream sends for `item`: its text when it names itself, else a copy naming
    /// its run and sequence (as the gateway frames it).
    fn framed(item: &LiveItem) -> String {
        if item.names_itself {
            item.result.get().to_owned()
        } else {
            let result = item
                .to_result()
                .with_run_id(item.run_id)
                .with_sequence(item.sequence);
            serde_json::to_string(&result).unwrap()
        }
    }

    #[test]
    fn live_deliveries_keep_each_result_as_sent_and_frame_what_decoding_it_would() {
        let run = RunId::new();
        let ws = WorkspaceId::default_workspace();
        let facts = RunFacts {
            event_id: EventId::new(),
            runner_id: "echo".into(),
            thread_id: None,
            bot_id: None,
        };
        let batch = ResultBatch::new(
            run,
            ws.clone(),
            Some("c".into()),
            [(1, item("a \"quoted\" é")), (2, item("b"))],
        )
        .with_run(Some(facts.clone()));
        let singles = batch.into_messages();
        let refs: Vec<&ResultMessage> = singles.iter().collect();
        let stored = stored_json(&refs);
        // Each form a gateway may receive: the sink's batch and single delivery, the
        // owned batch and single forms, and a forwarded result.
        let bodies = [
            encode_delivery(&stored_items(&refs, &stored)),
            encode_delivery(&stored_items(&refs[..1], &stored)),
            encode(&DeliveryBatch::of(&refs).unwrap()),
            encode(&DeliveryMessage::from(singles[0].clone())),
            encode(&singles[0]),
        ];
        for body in &bodies {
            let live = decode_live(body).unwrap();
            let owned = decode_deliveries(body).unwrap();
            assert_eq!(live.workspace_id, ws);
            assert_eq!(live.conversation_id.as_deref(), Some("c"));
            assert_eq!(live.items.len(), owned.len());
            for (item, message) in live.items.iter().zip(&owned) {
                assert_eq!(item.run_id, message.run_id);
                assert_eq!(item.sequence, message.sequence);
                assert_eq!(item.event_id, Some(facts.event_id));
                assert_eq!(item.result_type, message.result.result_type);
                assert!(item.names_itself);
                assert!(!item.is_terminal());
                // Byte for byte what serializing the decoded result gives.
                assert_eq!(
                    framed(item),
                    serde_json::to_string(&message.result).unwrap()
                );
                assert_eq!(item.to_result(), message.result);
            }
        }
        // A result that does not name its run and sequence is framed from a copy that does.
        let anonymous: DeliveryMessage = DeliveryMessage {
            schema: DeliverySchema,
            run_id: run,
            workspace_id: ws.clone(),
            conversation_id: None,
            sequence: 7,
            result: serde_json::from_value(json!({"type": "run.completed", "data": {}})).unwrap(),
            event_id: None,
        };
        let live = decode_live(&encode(&anonymous)).unwrap();
        let item = &live.items[0];
        assert!(!item.names_itself && item.is_terminal());
        assert_eq!(item.event_id, None);
        let expected = anonymous.result.clone().with_run_id(run).with_sequence(7);
        assert_eq!(framed(item), serde_json::to_string(&expected).unwrap());
        // A result that names another sequence does not name itself either.
        let mut other = anonymous.clone();
        other.result = other.result.with_run_id(run).with_sequence(6);
        assert!(!decode_live(&encode(&other)).unwrap().items[0].names_itself);
    }

    #[test]
    fn live_deliveries_refuse_what_is_no_delivery_or_holds_no_result() {
        let run = RunId::new();
        let ws = WorkspaceId::default_workspace();
        let event = EventMessage::new(ws.clone(), EventId::new());
        assert!(matches!(
            decode_live(&encode(&event)),
            Err(DecodeError::WrongSchema { .. })
        ));
        let empty = json!({"schema": "switchboard.deliveries/1", "run_id": run,
            "workspace_id": ws, "items": []});
        assert!(matches!(
            decode_live(empty.to_string().as_bytes()),
            Err(DecodeError::Malformed { .. })
        ));
        let not_a_result = json!({"schema": "switchboard.delivery/1", "run_id": run,
            "workspace_id": ws, "sequence": 1, "result": [1, 2]});
        assert!(matches!(
            decode_live(not_a_result.to_string().as_bytes()),
            Err(DecodeError::Malformed { .. })
        ));
        assert!(matches!(
            decode_live(b"not json"),
            Err(DecodeError::Malformed { .. })
        ));
    }

    #[test]
    fn event_batches_decode_as_the_events_they_hold() {
        let ws = WorkspaceId::default_workspace();
        let a = EventMessage::new(ws.clone(), EventId::new()).in_lane(7);
        let b = EventMessage::new(ws.clone(), EventId::new());
        let batch = EventBatch::new(vec![a.clone(), b.clone()]);
        let text = String::from_utf8(encode(&batch)).unwrap();
        assert!(
            text.starts_with(
                r#"{"schema":"switchboard.events/1","events":[{"schema":"switchboard.event/1""#
            ),
            "{text}"
        );
        assert_eq!(decode_events(text.as_bytes()).unwrap(), vec![a.clone(), b]);
        assert_eq!(decode_events(&encode(&a)).unwrap(), vec![a]);
        assert!(matches!(
            decode_events(&encode(&EventBatch::new(Vec::new()))),
            Err(DecodeError::Malformed { .. })
        ));
        // Neither form: the single form's error.
        let job = json!({"schema": "switchboard.job/1"}).to_string();
        assert!(matches!(
            decode_events(job.as_bytes()),
            Err(DecodeError::WrongSchema {
                expected: "switchboard.event/1",
                ..
            })
        ));
        // A batch with a bad event is the batch's error, not a wrong schema.
        let bad = json!({"schema": "switchboard.events/1", "events": [{"schema": "switchboard.event/1"}]});
        assert!(matches!(
            decode_events(bad.to_string().as_bytes()),
            Err(DecodeError::Invalid {
                expected: "switchboard.events/1",
                ..
            })
        ));
    }

    #[test]
    fn batches_decode_as_the_single_messages_they_hold() {
        let run = RunId::new();
        let ws = WorkspaceId::default_workspace();
        let batch = ResultBatch::new(
            run,
            ws.clone(),
            Some("c".into()),
            [(1, item("a")), (2, item("b"))],
        );
        let singles = decode_results(&encode(&batch)).unwrap();
        assert_eq!(
            singles,
            vec![
                ResultMessage::new(run, ws.clone(), Some("c".into()), 1, item("a")),
                ResultMessage::new(run, ws.clone(), Some("c".into()), 2, item("b")),
            ]
        );
        assert_eq!(singles[1].result.sequence, Some(2));
        // The single form is still accepted.
        let one = ResultMessage::new(run, ws.clone(), None, 3, item("c"));
        assert_eq!(decode_results(&encode(&one)).unwrap(), vec![one.clone()]);
        // Deliveries: the batch, the single delivery and a forwarded result.
        let refs: Vec<&ResultMessage> = singles.iter().collect();
        let deliveries = DeliveryBatch::of(&refs).unwrap();
        let decoded = decode_deliveries(&encode(&deliveries)).unwrap();
        assert_eq!(
            decoded,
            singles
                .iter()
                .cloned()
                .map(DeliveryMessage::from)
                .collect::<Vec<_>>()
        );
        let single = DeliveryMessage::from(one.clone());
        assert_eq!(
            decode_deliveries(&encode(&single)).unwrap(),
            vec![single.clone()]
        );
        assert_eq!(decode_deliveries(&encode(&one)).unwrap(), vec![single]);
        assert!(DeliveryBatch::of(&[]).is_none());
        // The sink's in-place encoding, from the results' stored JSON, writes the same bytes.
        let stored = stored_json(&refs);
        assert_eq!(
            encode_delivery(&stored_items(&refs, &stored)),
            encode(&deliveries)
        );
        let one_stored = stored_json(&[&one]);
        assert_eq!(
            encode_delivery(&stored_items(&[&one], &one_stored)),
            encode(&DeliveryMessage::from(one.clone()))
        );
        assert!(encode_delivery(&[]).is_empty());
        // An empty batch and another schema are refused.
        let empty = ResultBatch::new(run, ws.clone(), None, []);
        assert!(matches!(
            decode_results(&encode(&empty)),
            Err(DecodeError::Malformed { .. })
        ));
        let event = EventMessage::new(ws, EventId::new());
        assert!(matches!(
            decode_results(&encode(&event)),
            Err(DecodeError::WrongSchema { .. })
        ));
    }

    #[test]
    fn run_facts_travel_from_the_batch_to_each_item_and_the_event_id_on_to_deliveries() {
        let run = RunId::new();
        let ws = WorkspaceId::default_workspace();
        let facts = RunFacts {
            event_id: EventId::new(),
            runner_id: "echo".into(),
            thread_id: Some("t".into()),
            bot_id: None,
        };
        let batch = ResultBatch::new(run, ws.clone(), None, [(1, item("a")), (2, item("b"))])
            .with_run(Some(facts.clone()));
        let singles = decode_results(&encode(&batch)).unwrap();
        assert!(singles.iter().all(|m| m.run.as_ref() == Some(&facts)));
        let refs: Vec<&ResultMessage> = singles.iter().collect();
        let stored = stored_json(&refs);
        let items = stored_items(&refs, &stored);
        assert_eq!(
            encode_delivery(&items),
            encode(&DeliveryBatch::of(&refs).unwrap())
        );
        assert_eq!(
            encode_delivery(&items[..1]),
            encode(&DeliveryMessage::from(singles[0].clone()))
        );
        let deliveries = decode_deliveries(&encode(&DeliveryBatch::of(&refs).unwrap())).unwrap();
        assert!(
            deliveries
                .iter()
                .all(|d| d.event_id == Some(facts.event_id))
        );
        let single =
            decode_deliveries(&encode(&DeliveryMessage::from(singles[0].clone()))).unwrap();
        assert_eq!(single[0].event_id, Some(facts.event_id));
        // Absent facts stay off the wire (bodies of older hosts decode the same).
        let bare = ResultMessage::new(run, ws, None, 1, item("a"));
        let text = String::from_utf8(encode(&bare)).unwrap();
        assert!(!text.contains("\"run\""), "{text}");
        assert_eq!(decode_results(text.as_bytes()).unwrap()[0].run, None);
    }

    #[test]
    fn schema_is_validated() {
        let m = EventMessage::new(WorkspaceId::default_workspace(), EventId::new());
        let mut v = serde_json::to_value(&m).unwrap();
        v["schema"] = json!("switchboard.event/2");
        let bytes = v.to_string();
        let err = decode::<EventMessage>(bytes.as_bytes()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "wrong message schema: expected `switchboard.event/1`, found `switchboard.event/2`"
        );
        // plain serde also refuses
        assert!(serde_json::from_value::<EventMessage>(v.clone()).is_err());
        v.as_object_mut().unwrap().remove("schema");
        assert!(matches!(
            decode::<EventMessage>(v.to_string().as_bytes()),
            Err(DecodeError::Malformed { .. })
        ));
        assert!(matches!(
            decode::<EventMessage>(b"not json"),
            Err(DecodeError::Malformed { .. })
        ));
        assert!(matches!(
            decode::<EventMessage>(b"[1]"),
            Err(DecodeError::Malformed { .. })
        ));
        let missing_field = json!({"schema": "switchboard.event/1", "workspace_id": "default"});
        assert!(matches!(
            decode::<EventMessage>(missing_field.to_string().as_bytes()),
            Err(DecodeError::Invalid { .. })
        ));
    }

    #[test]
    fn result_and_delivery_share_shape() {
        let run = RunId::new();
        let r = ResultMessage::new(
            run,
            WorkspaceId::default_workspace(),
            Some("c1".into()),
            2,
            AgentRunResult::delta("hi"),
        );
        assert_eq!(r.result.sequence, Some(2));
        assert_eq!(r.result.run_id, run.to_string());
        assert_eq!(decode::<ResultMessage>(&encode(&r)).unwrap(), r);
        let d = DeliveryMessage::from(r.clone());
        let dv = serde_json::to_value(&d).unwrap();
        let mut rv = serde_json::to_value(&r).unwrap();
        rv["schema"] = json!("switchboard.delivery/1");
        assert_eq!(dv, rv);
        assert!(decode::<ResultMessage>(&encode(&d)).is_err());
        assert_eq!(decode::<DeliveryMessage>(&encode(&d)).unwrap(), d);
    }
}
