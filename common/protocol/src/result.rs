//! The result stream: the `AgentRunResult` envelope, typed payloads, and [`classify`], the
//! one function that decides what the host does with a result a runner sent.
//!
//! The envelope stays a plain `{run_id, type, data, sequence?, timestamp?, usage?}` with
//! `type` as a string, so that a result of a type this host does not know still parses and
//! can be ignored (PROTOCOL_V1 §7.1). Typed payloads exist only after classification.
//!
//! # Classification rules
//!
//! [`classify`] applies these rules in order (PROTOCOL_V1 §7.1, host-behaviour §13, SPEC §4.3):
//!
//! 1. The result is not a JSON object → [`Classified::ProtocolError`].
//! 2. `type` is missing, not a string, or empty → `ProtocolError` ("missing result type"):
//!    the run is aborted, the stream cannot be trusted.
//! 3. `type` is not one of the nine [`ResultType`]s → [`Classified::Dropped`]: ignored with
//!    a warning; the run goes on (a newer runner may send types this host does not know).
//! 4. `artifact.created` with `content_base64`: content that is not strict base64, or that
//!    decodes to more than [`ResultLimits::max_inline_artifact_bytes`] (1 MiB) →
//!    `ProtocolError` (host-behaviour §1, §14).
//! 5. The JSON text of the whole result is longer than [`ResultLimits::max_result_bytes`]
//!    (1 MiB):
//!    - `tool.call.*` → `Dropped` (telemetry only);
//!    - `message.delta`, `message.completed`, `run.completed`: a string `content` of the
//!      chunk/message longer than [`ResultLimits::truncate_chars`] is cut to that many
//!      characters plus [`TRUNCATION_MARKER`]; if the result then fits, classification goes
//!      on with the truncated result (the seed host truncated the wrong field for
//!      `message.completed`; this truncates the message itself);
//!    - anything still too large → `ProtocolError`.
//! 6. `tool.call.started` / `tool.call.completed` → [`Classified::Telemetry`], never
//!    validated: any `data`, even junk, is accepted.
//! 7. `message.delta` whose `data.chunk` is missing or empty (`null`, `{}`, `""`, `[]`), or
//!    `message.completed` whose `data.message` is → `ProtocolError` ("… missing chunk data" /
//!    "… missing message data"). The same holds for a `run.completed` whose `data.message`
//!    is present but empty; `"message": null` there simply means no message.
//! 8. The seven strict types are decoded into their payload structs, which reject unknown
//!    fields and wrong types; failure → `Dropped` (the result is skipped with a warning, the
//!    run goes on). Semantic checks that serde cannot express (non-empty `state.updated.key`,
//!    `artifact.created.artifact_type`, `action.requested.action`) also drop.
//! 9. Otherwise → [`Classified::Valid`].
//!
//! `run_id` is not checked here: the caller knows the active run and compares.
//! `action.requested` is *valid* but is only recorded as telemetry by the host, never
//! executed (PROTOCOL_V1 §7.3).
//!
//! ```
//! use sb_protocol::result::{classify, AgentRunResult, Classified, ResultLimits, ResultPayload};
//! let raw = serde_json::json!({"type": "message.delta", "data": {"chunk": {"role": "assistant", "content": "hel"}}});
//! let Classified::Valid(typed) = classify(&raw, &ResultLimits::default()) else { panic!() };
//! let ResultPayload::MessageDelta(delta) = &typed.payload else { panic!() };
//! assert_eq!(delta.chunk.text(), "hel");
//! assert_eq!(typed.to_json(), raw);
//!
//! let unknown = serde_json::json!({"type": "telepathy.sent", "data": {}});
//! assert!(matches!(classify(&unknown, &ResultLimits::default()), Classified::Dropped { .. }));
//! ```
//!
//! This file is long (one struct per payload of the nine result types) but it is one thing:
//! the result vocabulary of PROTOCOL_V1 §7 and the single function that classifies it. It is
//! kept whole so that a reader checks the rules above against the payloads they refer to.

use std::fmt;
use std::io;
use std::str::FromStr;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::content::{Message, MessageChunk};
use crate::context::StateScope;
use crate::error::run_failure;

/// Default cap on the JSON text of one result (`MAX_RESULT_SIZE_BYTES`).
pub const MAX_RESULT_SIZE_BYTES: usize = 1_048_576;
/// Default cap on decoded inline artifact content (`MAX_ARTIFACT_INLINE_BYTES`).
pub const MAX_ARTIFACT_INLINE_BYTES: usize = 1_048_576;
/// Characters kept when an oversize message is truncated.
pub const TRUNCATE_CHARS: usize = 10_000;
/// Appended to truncated content.
pub const TRUNCATION_MARKER: &str = "...[truncated]";

/// The limits [`classify`] enforces. Defaults are the protocol's (SPEC §13).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResultLimits {
    /// Maximum length of the JSON text of one result.
    pub max_result_bytes: usize,
    /// Maximum decoded size of `artifact.created.content_base64`.
    pub max_inline_artifact_bytes: usize,
    /// Characters kept when truncating an oversize message.
    pub truncate_chars: usize,
}

impl Default for ResultLimits {
    fn default() -> Self {
        Self {
            max_result_bytes: MAX_RESULT_SIZE_BYTES,
            max_inline_artifact_bytes: MAX_ARTIFACT_INLINE_BYTES,
            truncate_chars: TRUNCATE_CHARS,
        }
    }
}

/// The nine stable result types (PROTOCOL_V1 §7.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ResultType {
    /// `message.delta`: a streamed piece of a message.
    #[serde(rename = "message.delta")]
    MessageDelta,
    /// `message.completed`: a complete message.
    #[serde(rename = "message.completed")]
    MessageCompleted,
    /// `tool.call.started`: telemetry.
    #[serde(rename = "tool.call.started")]
    ToolCallStarted,
    /// `tool.call.completed`: telemetry.
    #[serde(rename = "tool.call.completed")]
    ToolCallCompleted,
    /// `artifact.created`: the runner produced an artifact.
    #[serde(rename = "artifact.created")]
    ArtifactCreated,
    /// `state.updated`: the runner asks to update host-owned state.
    #[serde(rename = "state.updated")]
    StateUpdated,
    /// `action.requested`: reserved; recorded, never executed.
    #[serde(rename = "action.requested")]
    ActionRequested,
    /// `run.completed`: terminal, success.
    #[serde(rename = "run.completed")]
    RunCompleted,
    /// `run.failed`: terminal, failure.
    #[serde(rename = "run.failed")]
    RunFailed,
}

impl ResultType {
    /// Every type.
    pub const ALL: [ResultType; 9] = [
        Self::MessageDelta,
        Self::MessageCompleted,
        Self::ToolCallStarted,
        Self::ToolCallCompleted,
        Self::ArtifactCreated,
        Self::StateUpdated,
        Self::ActionRequested,
        Self::RunCompleted,
        Self::RunFailed,
    ];

    /// The wire text.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::MessageDelta => "message.delta",
            Self::MessageCompleted => "message.completed",
            Self::ToolCallStarted => "tool.call.started",
            Self::ToolCallCompleted => "tool.call.completed",
            Self::ArtifactCreated => "artifact.created",
            Self::StateUpdated => "state.updated",
            Self::ActionRequested => "action.requested",
            Self::RunCompleted => "run.completed",
            Self::RunFailed => "run.failed",
        }
    }

    /// `run.completed` and `run.failed`: exactly one of them ends every run.
    #[must_use]
    pub const fn is_terminal(self) -> bool {
        matches!(self, Self::RunCompleted | Self::RunFailed)
    }

    /// Whether the payload is validated strictly (everything except `tool.call.*`).
    #[must_use]
    pub const fn is_strict(self) -> bool {
        !matches!(self, Self::ToolCallStarted | Self::ToolCallCompleted)
    }

    /// Whether the result carries user-visible message output (`message.*`, or a
    /// `run.completed` with a message, which the caller checks on the payload).
    #[must_use]
    pub const fn is_message(self) -> bool {
        matches!(self, Self::MessageDelta | Self::MessageCompleted)
    }
}

impl fmt::Display for ResultType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The text is not one of the nine result types.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown result type `{0}`")]
pub struct UnknownResultType(pub String);

impl FromStr for ResultType {
    type Err = UnknownResultType;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| UnknownResultType(s.to_owned()))
    }
}

/// The raw result envelope, as sent by a runner and as stored in the ledger.
///
/// `run_id` may be omitted by a runner (the wire op already names the run); it is then
/// empty and not written back. Host-side constructors leave it empty too; set it with
/// [`with_run_id`](Self::with_run_id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AgentRunResult {
    /// The run.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub run_id: String,
    /// One of the [`ResultType`] texts, or an unknown type.
    #[serde(rename = "type", default)]
    pub result_type: String,
    /// The payload.
    #[serde(default)]
    pub data: Map<String, Value>,
    /// Sequence within the run (≥ 1). Runner-provided values are only checked for
    /// duplicates; the worker assigns the transport sequence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence: Option<u64>,
    /// Epoch seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<i64>,
    /// Model usage accounted to this result (later SDK versions), e.g. token counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Map<String, Value>>,
}

impl AgentRunResult {
    /// An envelope of `result_type` with `data`.
    pub fn new(result_type: ResultType, data: Map<String, Value>) -> Self {
        Self {
            run_id: String::new(),
            result_type: result_type.as_str().to_owned(),
            data,
            sequence: None,
            timestamp: None,
            usage: None,
        }
    }

    /// Builds the envelope of a typed payload.
    #[must_use]
    pub fn from_payload(payload: &ResultPayload) -> Self {
        Self::new(payload.result_type(), payload.to_data())
    }

    /// `message.delta` with an assistant text chunk.
    pub fn delta(text: impl Into<String>) -> Self {
        Self::from_payload(&ResultPayload::MessageDelta(MessageDelta {
            chunk: MessageChunk::assistant(text.into()),
        }))
    }

    /// `message.completed` with `message`.
    #[must_use]
    pub fn completed(message: Message) -> Self {
        Self::from_payload(&ResultPayload::MessageCompleted(MessageCompleted {
            message,
        }))
    }

    /// `run.completed` with `finish_reason: "stop"` and no message.
    #[must_use]
    pub fn run_completed() -> Self {
        Self::from_payload(&ResultPayload::RunCompleted(RunCompleted::default()))
    }

    /// `run.failed` with the given code (see [`run_failure`]), message and flag.
    pub fn run_failed(code: impl Into<String>, error: impl Into<String>, retryable: bool) -> Self {
        Self::from_payload(&ResultPayload::RunFailed(RunFailed {
            code: code.into(),
            error: error.into(),
            retryable,
        }))
    }

    /// Sets `run_id`.
    #[must_use]
    pub fn with_run_id(mut self, run_id: impl ToString) -> Self {
        self.run_id = run_id.to_string();
        self
    }

    /// Sets `sequence`.
    #[must_use]
    pub fn with_sequence(mut self, sequence: u64) -> Self {
        self.sequence = Some(sequence);
        self
    }

    /// Sets `timestamp`.
    #[must_use]
    pub fn with_timestamp(mut self, timestamp: i64) -> Self {
        self.timestamp = Some(timestamp);
        self
    }

    /// The known type, if any.
    #[must_use]
    pub fn known_type(&self) -> Option<ResultType> {
        self.result_type.parse().ok()
    }

    /// Whether this is `run.completed` or `run.failed`.
    #[must_use]
    pub fn is_terminal(&self) -> bool {
        self.known_type().is_some_and(ResultType::is_terminal)
    }

    /// Classifies this envelope (see [`classify`]).
    #[must_use]
    pub fn classify(&self, limits: &ResultLimits) -> Classified {
        classify(&serde_json::to_value(self).unwrap_or(Value::Null), limits)
    }
}

// ---------------------------------------------------------------------------------------
// Typed payloads (PROTOCOL_V1 §7.2)
// ---------------------------------------------------------------------------------------

/// `message.delta`: `{chunk}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessageDelta {
    /// The piece.
    pub chunk: MessageChunk,
}

/// `message.completed`: `{message}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessageCompleted {
    /// The message.
    pub message: Message,
}

/// `tool.call.started` (telemetry; read leniently with [`Telemetry`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallStarted {
    /// Call id.
    pub tool_call_id: String,
    /// Tool name.
    pub tool_name: String,
    /// Arguments.
    #[serde(default)]
    pub parameters: Map<String, Value>,
}

/// `tool.call.completed` (telemetry; read leniently with [`Telemetry`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallCompleted {
    /// Call id.
    pub tool_call_id: String,
    /// Tool name.
    pub tool_name: String,
    /// Result object.
    #[serde(default)]
    pub result: Option<Map<String, Value>>,
    /// Error text.
    #[serde(default)]
    pub error: Option<String>,
}

/// `artifact.created`. `content_base64` is the inline channel for small artifacts
/// (≤ 1 MiB decoded); larger ones must be stored elsewhere and referenced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArtifactCreated {
    /// Kind (`image`, `file`, …). Required, non-empty.
    pub artifact_type: String,
    /// Id; the host generates one if absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_id: Option<String>,
    /// MIME type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mime_type: Option<String>,
    /// File name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Declared size (not checked against the content).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// Declared hex SHA-256 (not checked against the content).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Free-form metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
    /// Inline content, standard base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_base64: Option<String>,
}

impl ArtifactCreated {
    /// Decodes `content_base64` strictly. `Ok(None)` when there is no inline content.
    /// Classification already checked it, so this only fails on payloads built by hand.
    pub fn decode_content(&self) -> Result<Option<Vec<u8>>, base64::DecodeError> {
        self.content_base64
            .as_deref()
            .map(|b| base64::engine::general_purpose::STANDARD.decode(b))
            .transpose()
    }
}

/// `state.updated`: `{scope, key, value}`. Scope policy, key length and the 256 KiB value
/// cap are checked by the state store when applying it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateUpdated {
    /// One of the four scopes.
    pub scope: StateScope,
    /// Key, non-empty.
    pub key: String,
    /// Any JSON value (`null` included).
    pub value: Value,
}

/// `action.requested`: reserved for platform actions; recorded, never executed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionRequested {
    /// Action name, e.g. `message.edit`. Non-empty.
    pub action: String,
    /// What to act on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<Map<String, Value>>,
    /// Arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Map<String, Value>>,
}

fn stop() -> String {
    "stop".to_owned()
}

/// `run.completed`: `{finish_reason = "stop", message?}`. A message here counts as the
/// run's final message (like `message.completed`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunCompleted {
    /// Why the run ended (`stop`, `length`, …).
    #[serde(default = "stop")]
    pub finish_reason: String,
    /// Optional final message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<Message>,
}

impl Default for RunCompleted {
    fn default() -> Self {
        Self {
            finish_reason: stop(),
            message: None,
        }
    }
}

fn runner_error() -> String {
    run_failure::RUNNER_ERROR.to_owned()
}

/// `run.failed`: `{code = "runner.error", error, retryable = false}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunFailed {
    /// Failure code (see [`run_failure`]); runners may use their own.
    #[serde(default = "runner_error")]
    pub code: String,
    /// Human-readable error.
    pub error: String,
    /// Whether a new run could succeed (informational; runs are never auto-retried).
    #[serde(default)]
    pub retryable: bool,
}

impl RunFailed {
    /// A failure with the host's default `retryable` for `code`.
    pub fn new(code: &str, error: impl Into<String>) -> Self {
        Self {
            code: code.to_owned(),
            error: error.into(),
            retryable: run_failure::default_retryable(code),
        }
    }
}

/// A validated strict payload.
#[derive(Debug, Clone, PartialEq)]
pub enum ResultPayload {
    /// `message.delta`.
    MessageDelta(MessageDelta),
    /// `message.completed`.
    MessageCompleted(MessageCompleted),
    /// `artifact.created`.
    ArtifactCreated(ArtifactCreated),
    /// `state.updated`.
    StateUpdated(StateUpdated),
    /// `action.requested`.
    ActionRequested(ActionRequested),
    /// `run.completed`.
    RunCompleted(RunCompleted),
    /// `run.failed`.
    RunFailed(RunFailed),
}

impl ResultPayload {
    /// The type of this payload.
    #[must_use]
    pub fn result_type(&self) -> ResultType {
        match self {
            Self::MessageDelta(_) => ResultType::MessageDelta,
            Self::MessageCompleted(_) => ResultType::MessageCompleted,
            Self::ArtifactCreated(_) => ResultType::ArtifactCreated,
            Self::StateUpdated(_) => ResultType::StateUpdated,
            Self::ActionRequested(_) => ResultType::ActionRequested,
            Self::RunCompleted(_) => ResultType::RunCompleted,
            Self::RunFailed(_) => ResultType::RunFailed,
        }
    }

    /// The payload as the envelope's `data` object.
    #[must_use]
    pub fn to_data(&self) -> Map<String, Value> {
        let value = match self {
            Self::MessageDelta(p) => serde_json::to_value(p),
            Self::MessageCompleted(p) => serde_json::to_value(p),
            Self::ArtifactCreated(p) => serde_json::to_value(p),
            Self::StateUpdated(p) => serde_json::to_value(p),
            Self::ActionRequested(p) => serde_json::to_value(p),
            Self::RunCompleted(p) => serde_json::to_value(p),
            Self::RunFailed(p) => serde_json::to_value(p),
        };
        // Every payload is a struct of JSON-representable fields, so this is an object.
        match value {
            Ok(Value::Object(map)) => map,
            _ => Map::new(),
        }
    }

    /// The message this result delivers, if it is a complete one (`message.completed`, or
    /// `run.completed` with a message).
    #[must_use]
    pub fn final_message(&self) -> Option<&Message> {
        match self {
            Self::MessageCompleted(p) => Some(&p.message),
            Self::RunCompleted(p) => p.message.as_ref(),
            _ => None,
        }
    }
}

/// A valid result: the envelope fields plus the typed payload.
#[derive(Debug, Clone, PartialEq)]
pub struct TypedResult {
    /// The envelope's `run_id` (possibly empty).
    pub run_id: String,
    /// The envelope's `sequence`.
    pub sequence: Option<u64>,
    /// The envelope's `timestamp`.
    pub timestamp: Option<i64>,
    /// The envelope's `usage`.
    pub usage: Option<Map<String, Value>>,
    /// The payload.
    pub payload: ResultPayload,
}

impl TypedResult {
    /// The type.
    #[must_use]
    pub fn result_type(&self) -> ResultType {
        self.payload.result_type()
    }

    /// Whether this ends the run.
    #[must_use]
    pub fn is_terminal(&self) -> bool {
        self.result_type().is_terminal()
    }

    /// Back to the envelope.
    #[must_use]
    pub fn to_result(&self) -> AgentRunResult {
        AgentRunResult {
            run_id: self.run_id.clone(),
            result_type: self.result_type().as_str().to_owned(),
            data: self.payload.to_data(),
            sequence: self.sequence,
            timestamp: self.timestamp,
            usage: self.usage.clone(),
        }
    }

    /// Back to JSON.
    #[must_use]
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self.to_result()).unwrap_or(Value::Null)
    }
}

/// A lenient `tool.call.*` telemetry result. `data` is kept exactly as sent, whatever it
/// is; the accessors read the documented fields when they are present and well-typed.
#[derive(Debug, Clone, PartialEq)]
pub struct Telemetry {
    /// `tool.call.started` or `tool.call.completed`.
    pub result_type: ResultType,
    /// The envelope's `run_id` (empty if absent or not a string).
    pub run_id: String,
    /// The envelope's `sequence`, if it is a non-negative integer.
    pub sequence: Option<u64>,
    /// The envelope's `timestamp`, if it is an integer.
    pub timestamp: Option<i64>,
    /// `data` as sent (`null` if absent).
    pub data: Value,
}

impl Telemetry {
    fn str_field(&self, key: &str) -> Option<&str> {
        self.data.get(key).and_then(Value::as_str)
    }

    /// `data.tool_call_id`, if it is a string.
    #[must_use]
    pub fn tool_call_id(&self) -> Option<&str> {
        self.str_field("tool_call_id")
    }

    /// `data.tool_name`, if it is a string.
    #[must_use]
    pub fn tool_name(&self) -> Option<&str> {
        self.str_field("tool_name")
    }

    /// `data.error`, if it is a string.
    #[must_use]
    pub fn error(&self) -> Option<&str> {
        self.str_field("error")
    }

    /// Back to the envelope; a non-object `data` is kept under `data.value`.
    #[must_use]
    pub fn to_result(&self) -> AgentRunResult {
        let data = match &self.data {
            Value::Object(m) => m.clone(),
            Value::Null => Map::new(),
            other => {
                let mut m = Map::new();
                m.insert("value".to_owned(), other.clone());
                m
            }
        };
        AgentRunResult {
            run_id: self.run_id.clone(),
            result_type: self.result_type.as_str().to_owned(),
            data,
            sequence: self.sequence,
            timestamp: self.timestamp,
            usage: None,
        }
    }
}

/// What the host does with one result. See the module docs for the rules.
#[derive(Debug, Clone, PartialEq)]
pub enum Classified {
    /// A valid strict result: apply and deliver it.
    Valid(TypedResult),
    /// Lenient `tool.call.*` telemetry: record it, deliver nothing.
    Telemetry(Telemetry),
    /// Skip this result with a warning; the run continues.
    Dropped {
        /// Why, for the warning.
        reason: String,
    },
    /// The runner broke the protocol: fail the run with `runner.protocol_error`.
    ProtocolError {
        /// Why, for the `run.failed` error text.
        reason: String,
    },
}

impl Classified {
    fn dropped(reason: impl Into<String>) -> Self {
        Self::Dropped {
            reason: reason.into(),
        }
    }

    fn protocol(reason: impl Into<String>) -> Self {
        Self::ProtocolError {
            reason: reason.into(),
        }
    }

    /// The typed result, if valid.
    #[must_use]
    pub fn valid(&self) -> Option<&TypedResult> {
        match self {
            Self::Valid(t) => Some(t),
            _ => None,
        }
    }
}

/// Length of the compact JSON text of `value`, without building the text.
#[must_use]
pub fn json_size(value: &Value) -> usize {
    struct Counter(usize);
    impl io::Write for Counter {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    // Writing a Value into an infallible writer cannot fail.
    let _ = serde_json::to_writer(&mut counter, value);
    counter.0
}

/// Whether a JSON value counts as "empty" the way the Python host's truthiness does.
fn is_empty_json(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => !b,
        Some(Value::String(s)) => s.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        Some(Value::Object(o)) => o.is_empty(),
        Some(Value::Number(n)) => n.as_f64() == Some(0.0),
    }
}

/// The character a NUL (U+0000) in runner output is replaced with: U+FFFD, REPLACEMENT
/// CHARACTER, which says "a character was here that could not be kept".
pub const NUL_REPLACEMENT: char = '\u{FFFD}';

/// Replaces every NUL (U+0000) in the result's strings (the `data` and `usage` payloads,
/// object keys included) with [`NUL_REPLACEMENT`]; returns how many were replaced.
///
/// Why replace rather than refuse: PostgreSQL cannot store NUL in `text` or `jsonb`, so an
/// item holding one fails its ledger insert and is dead-lettered, leaving a hole in the
/// run's dense sequence. Failing the whole run for one control character in generated text
/// would be harsher than the seed host, which stored what runners sent; the replacement keeps
/// every item (and so every sequence) and shows where the character was. The worker applies
/// this to every item before it assigns the transport sequence.
pub fn replace_nul(result: &mut AgentRunResult) -> usize {
    fn in_string(s: &mut String) -> usize {
        let n = s.matches('\0').count();
        if n > 0 {
            *s = s.replace('\0', "\u{FFFD}");
        }
        n
    }
    fn in_map(map: &mut Map<String, Value>) -> usize {
        let mut n = 0;
        if map.keys().any(|k| k.contains('\0')) {
            let entries = std::mem::take(map);
            for (mut key, value) in entries {
                n += in_string(&mut key);
                map.insert(key, value);
            }
        }
        n + map.values_mut().map(in_value).sum::<usize>()
    }
    fn in_value(value: &mut Value) -> usize {
        match value {
            Value::String(s) => in_string(s),
            Value::Array(items) => items.iter_mut().map(in_value).sum(),
            Value::Object(map) => in_map(map),
            Value::Null | Value::Bool(_) | Value::Number(_) => 0,
        }
    }
    in_map(&mut result.data) + result.usage.as_mut().map_or(0, in_map)
}

/// Classifies one raw result. See the module docs for the rules, in order.
#[must_use]
pub fn classify(raw: &Value, limits: &ResultLimits) -> Classified {
    // 1. envelope shape
    let Some(obj) = raw.as_object() else {
        return Classified::protocol("result is not a JSON object");
    };

    // 2. type present
    let type_text = match obj.get("type") {
        Some(Value::String(s)) if !s.is_empty() => s.as_str(),
        _ => return Classified::protocol("missing result type"),
    };

    // 3. known type
    let Ok(result_type) = type_text.parse::<ResultType>() else {
        return Classified::dropped(format!("unknown result type `{type_text}`"));
    };

    // 4. inline artifact
    if result_type == ResultType::ArtifactCreated {
        if let Some(reason) = check_inline_artifact(obj, limits) {
            return Classified::protocol(reason);
        }
    }

    // 5. size
    let size = json_size(raw);
    let truncated;
    let obj = if size > limits.max_result_bytes {
        if !result_type.is_strict() {
            return Classified::dropped(format!(
                "{result_type} result size {size} bytes exceeds limit {} bytes",
                limits.max_result_bytes
            ));
        }
        match truncate_oversize(obj, result_type, limits) {
            Some(t) => {
                truncated = t;
                &truncated
            }
            None => {
                return Classified::protocol(format!(
                    "result size {size} bytes exceeds limit {} bytes",
                    limits.max_result_bytes
                ));
            }
        }
    } else {
        obj
    };

    let run_id = obj
        .get("run_id")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let sequence = obj.get("sequence").and_then(Value::as_u64);
    let timestamp = obj.get("timestamp").and_then(Value::as_i64);

    // 6. lenient telemetry
    if !result_type.is_strict() {
        return Classified::Telemetry(Telemetry {
            result_type,
            run_id,
            sequence,
            timestamp,
            data: obj.get("data").cloned().unwrap_or(Value::Null),
        });
    }

    // Envelope fields of strict results must be well-typed too.
    if let Some(reason) = check_envelope(obj) {
        return Classified::dropped(format!("invalid {result_type} envelope: {reason}"));
    }
    let empty = Value::Object(Map::new());
    let data = match obj.get("data") {
        None | Some(Value::Null) => &empty,
        Some(d @ Value::Object(_)) => d,
        Some(_) => {
            return Classified::dropped(format!(
                "invalid {result_type} payload: data is not an object"
            ));
        }
    };

    // 7. empty message data
    match result_type {
        ResultType::MessageDelta if is_empty_json(data.get("chunk")) => {
            return Classified::protocol("message.delta missing chunk data");
        }
        ResultType::MessageCompleted if is_empty_json(data.get("message")) => {
            return Classified::protocol("message.completed missing message data");
        }
        ResultType::RunCompleted => {
            if let Some(m) = data.get("message") {
                if !m.is_null() && is_empty_json(Some(m)) {
                    return Classified::protocol("run.completed has an empty message");
                }
            }
        }
        _ => {}
    }

    // 8. strict decode + semantic checks
    let payload = match decode_strict(result_type, data) {
        Ok(p) => p,
        Err(reason) => {
            return Classified::dropped(format!("invalid {result_type} payload: {reason}"));
        }
    };

    let usage = obj.get("usage").and_then(Value::as_object).cloned();
    Classified::Valid(TypedResult {
        run_id,
        sequence,
        timestamp,
        usage,
        payload,
    })
}

fn check_envelope(obj: &Map<String, Value>) -> Option<&'static str> {
    match obj.get("run_id") {
        None | Some(Value::String(_)) => {}
        Some(_) => return Some("run_id is not a string"),
    }
    match obj.get("sequence") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_u64().is_some() => {}
        Some(_) => return Some("sequence is not a non-negative integer"),
    }
    match obj.get("timestamp") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_i64().is_some() => {}
        Some(_) => return Some("timestamp is not an integer"),
    }
    match obj.get("usage") {
        None | Some(Value::Null) | Some(Value::Object(_)) => {}
        Some(_) => return Some("usage is not an object"),
    }
    None
}

fn check_inline_artifact(obj: &Map<String, Value>, limits: &ResultLimits) -> Option<String> {
    let b64 = obj.get("data")?.get("content_base64")?.as_str()?;
    let limit = limits.max_inline_artifact_bytes;
    // Refuse before decoding when the (exact, for well-formed input) decoded size is
    // already too large.
    if b64.len() % 4 == 0 {
        let padding = b64.bytes().rev().take(2).take_while(|&b| b == b'=').count();
        let decoded = b64.len() / 4 * 3 - padding;
        if decoded > limit {
            return Some(format!(
                "artifact.created content size {decoded} bytes exceeds limit {limit} bytes"
            ));
        }
    }
    match base64::engine::general_purpose::STANDARD.decode(b64) {
        Err(e) => Some(format!("artifact.created invalid base64 content: {e}")),
        Ok(bytes) if bytes.len() > limit => Some(format!(
            "artifact.created content size {} bytes exceeds limit {limit} bytes",
            bytes.len()
        )),
        Ok(_) => None,
    }
}

/// Truncates the string content of an oversize message-carrying result. `None` when
/// nothing can be truncated or the result is still too large afterwards.
fn truncate_oversize(
    obj: &Map<String, Value>,
    result_type: ResultType,
    limits: &ResultLimits,
) -> Option<Map<String, Value>> {
    let field = match result_type {
        ResultType::MessageDelta => "chunk",
        ResultType::MessageCompleted | ResultType::RunCompleted => "message",
        _ => return None,
    };
    let mut out = obj.clone();
    let content = out.get_mut("data")?.get_mut(field)?.get_mut("content")?;
    let text = content.as_str()?;
    if text.chars().count() <= limits.truncate_chars {
        return None;
    }
    let mut cut: String = text.chars().take(limits.truncate_chars).collect();
    cut.push_str(TRUNCATION_MARKER);
    *content = Value::String(cut);
    let fits = json_size(&Value::Object(out.clone())) <= limits.max_result_bytes;
    fits.then_some(out)
}

fn decode_strict(result_type: ResultType, data: &Value) -> Result<ResultPayload, String> {
    fn de<T: serde::de::DeserializeOwned>(data: &Value) -> Result<T, String> {
        T::deserialize(data).map_err(|e| e.to_string())
    }
    let payload = match result_type {
        ResultType::MessageDelta => ResultPayload::MessageDelta(de(data)?),
        ResultType::MessageCompleted => ResultPayload::MessageCompleted(de(data)?),
        ResultType::ArtifactCreated => {
            let p: ArtifactCreated = de(data)?;
            if p.artifact_type.is_empty() {
                return Err("artifact_type must not be empty".into());
            }
            ResultPayload::ArtifactCreated(p)
        }
        ResultType::StateUpdated => {
            let p: StateUpdated = de(data)?;
            if p.key.is_empty() {
                return Err("key must not be empty".into());
            }
            ResultPayload::StateUpdated(p)
        }
        ResultType::ActionRequested => {
            let p: ActionRequested = de(data)?;
            if p.action.is_empty() {
                return Err("action must not be empty".into());
            }
            ResultPayload::ActionRequested(p)
        }
        ResultType::RunCompleted => ResultPayload::RunCompleted(de(data)?),
        ResultType::RunFailed => ResultPayload::RunFailed(de(data)?),
        ResultType::ToolCallStarted | ResultType::ToolCallCompleted => {
            return Err("tool.call results are not strict".into());
        }
    };
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn limits() -> ResultLimits {
        ResultLimits::default()
    }

    #[test]
    fn constructors_produce_valid_results() {
        for (r, t) in [
            (AgentRunResult::delta("hel"), ResultType::MessageDelta),
            (
                AgentRunResult::completed(Message::assistant("hello")),
                ResultType::MessageCompleted,
            ),
            (AgentRunResult::run_completed(), ResultType::RunCompleted),
            (
                AgentRunResult::run_failed("runner.error", "boom", false),
                ResultType::RunFailed,
            ),
        ] {
            let c = r.classify(&limits());
            let typed = c.valid().unwrap_or_else(|| panic!("{c:?}"));
            assert_eq!(typed.result_type(), t);
            assert_eq!(typed.to_result(), r);
        }
        let r = AgentRunResult::run_completed()
            .with_run_id("r1")
            .with_sequence(3)
            .with_timestamp(9);
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            json!({"run_id": "r1", "type": "run.completed", "data": {"finish_reason": "stop"},
                   "sequence": 3, "timestamp": 9})
        );
        assert!(r.is_terminal());
    }

    #[test]
    fn result_type_text() {
        for t in ResultType::ALL {
            assert_eq!(t.as_str().parse::<ResultType>().unwrap(), t);
            assert_eq!(serde_json::to_value(t).unwrap(), json!(t.as_str()));
        }
        let terminal: Vec<_> = ResultType::ALL
            .into_iter()
            .filter(|t| t.is_terminal())
            .collect();
        assert_eq!(terminal, [ResultType::RunCompleted, ResultType::RunFailed]);
    }

    #[test]
    fn defaults_of_run_payloads() {
        let c = classify(
            &json!({"type": "run.failed", "data": {"error": "x"}}),
            &limits(),
        );
        let Classified::Valid(TypedResult {
            payload: ResultPayload::RunFailed(f),
            ..
        }) = c
        else {
            panic!("{c:?}")
        };
        assert_eq!(f.code, "runner.error");
        assert!(!f.retryable);
        let c = classify(&json!({"type": "run.completed"}), &limits());
        let Classified::Valid(TypedResult {
            payload: ResultPayload::RunCompleted(r),
            ..
        }) = c
        else {
            panic!("{c:?}")
        };
        assert_eq!(r.finish_reason, "stop");
        assert!(r.message.is_none());
        assert!(RunFailed::new(run_failure::TIMEOUT, "late").retryable);
    }

    #[test]
    fn json_size_matches_serialization() {
        let v = json!({"a": "ü", "b": [1, 2, {"c": null}]});
        assert_eq!(json_size(&v), serde_json::to_string(&v).unwrap().len());
    }

    #[test]
    fn decode_content_roundtrip() {
        let a = ArtifactCreated {
            artifact_type: "file".into(),
            artifact_id: None,
            mime_type: None,
            name: None,
            size_bytes: None,
            sha256: None,
            metadata: None,
            content_base64: Some("aGVsbG8=".into()),
        };
        assert_eq!(a.decode_content().unwrap().unwrap(), b"hello");
    }

    #[test]
    fn replace_nul_reaches_every_string_and_key() {
        let mut result: AgentRunResult = serde_json::from_value(json!({
            "type": "x.custom",
            "data": {"a\0": ["\0b", {"c": "\0\0"}], "n": 1},
            "usage": {"u": "\0"}
        }))
        .unwrap();
        assert_eq!(replace_nul(&mut result), 5);
        assert_eq!(
            serde_json::to_value(&result.data).unwrap(),
            json!({"a\u{FFFD}": ["\u{FFFD}b", {"c": "\u{FFFD}\u{FFFD}"}], "n": 1})
        );
        assert_eq!(result.usage.unwrap()["u"], "\u{FFFD}");
        assert_eq!(replace_nul(&mut AgentRunResult::run_completed()), 0);
    }
}
