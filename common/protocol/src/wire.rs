//! The runner stdio wire: newline-delimited JSON between a worker and a runner process
//! (SPEC §4.2).
//!
//! Every line is one JSON object with an `op` field. The worker writes [`HostToRunner`] lines
//! to the runner's stdin and reads [`RunnerToHost`] lines from its stdout; stderr is free-form
//! text that the worker only logs.
//!
//! ```text
//! worker ── {"op":"run","run_id":"…","runner":"plugin:a/b/c","context":{…}} ──▶ runner
//! worker ◀── {"op":"result","run_id":"…","result":{"type":"message.delta",…}} ── runner
//! worker ◀── {"op":"api","id":"7","run_id":"…","action":"history_page","params":{…}} ── runner
//! worker ── {"op":"api_result","id":"7","ok":true,"data":{…}} ──▶ runner
//! worker ◀── {"op":"done","run_id":"…"} ── runner
//! ```
//!
//! # Trust
//! Lines from the runner are untrusted input. That is why the `run_id` fields of
//! [`RunnerToHost`] are plain strings and the result is kept as raw JSON (`serde_json::Value`,
//! the input of [`crate::result::classify`]) rather than a typed
//! [`AgentRunResult`](crate::result::AgentRunResult): a line whose run id is not a UUID, or
//! whose result envelope is malformed (a non-object `data`, a negative `sequence`), must still
//! decode, so the worker can attribute it to a run (or to none) and apply the validation rules
//! of SPEC §4.3 instead of treating every mistake as a framing error. Lines written by the host
//! are typed strictly.
//!
//! The `caller_plugin_identity` of a Host API call is deliberately absent from
//! [`RunnerToHost::Api`]: the worker derives the caller from the process connection, never from
//! the message (SPEC §8).
//!
//! # Call ids
//! A Host API call's `id` is chosen by the runner: a JSON string or an integer, as JSON-RPC
//! clients are used to ([`ApiCallId`]). The host echoes it back exactly as written — `7` is
//! answered as `7` and `"7"` as `"7"`, which are two different ids — so a runner can route
//! answers with whatever key type it used. An answer to a call whose id could not be read
//! at all carries `id: null` (JSON-RPC's rule for the same case).

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Number, Value};

use crate::context::AgentRunContext;
use crate::error::AgentApiError;
use crate::ids::RunId;

/// Default cap on one wire line, in bytes (SPEC §13: "runner line 4 MiB").
pub const DEFAULT_MAX_LINE_BYTES: usize = 4 * 1024 * 1024;

/// A message the worker writes to a runner's stdin.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum HostToRunner {
    /// Start a run. In `shared` mode many runs are in flight at once, told apart by `run_id`.
    Run {
        run_id: RunId,
        /// The runner id (`plugin:<author>/<name>/<runner>`), so one process can serve several
        /// runners of the same plugin.
        runner: String,
        context: Box<AgentRunContext>,
    },
    /// Cooperative cancel: the runner should stop the run and end it (ideally with
    /// `run.failed {code: "cancelled"}`). The worker enforces the end after a grace period
    /// whatever the runner does.
    Cancel { run_id: RunId, reason: String },
    /// The final answer to a Host API call.
    ApiResult(ApiResult),
    /// One streamed part of a Host API answer (e.g. `invoke_llm_stream`); zero or more chunks
    /// precede the [`HostToRunner::ApiResult`] with the same `id`.
    ApiChunk { id: ApiCallId, data: Value },
    /// The process should finish its in-flight work and exit.
    Shutdown {},
}

/// The id of one Host API call: the runner's choice of a JSON string or integer, kept
/// exactly (see the module docs). Integers are those JSON can carry exactly as 64-bit
/// integers (`-2^63 ..= 2^64 - 1`); a fraction, a boolean, `null`, an array or an object is
/// not an id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ApiCallId {
    /// A string id, e.g. `"7"` or `"call-3"`.
    Text(String),
    /// An integer id, e.g. `7`; always an integer (never a fraction).
    Int(Number),
}

impl ApiCallId {
    /// The id in `value`, if it is a string or an integer.
    #[must_use]
    pub fn from_json(value: &Value) -> Option<Self> {
        match value {
            Value::String(s) => Some(Self::Text(s.clone())),
            Value::Number(n) if n.is_i64() || n.is_u64() => Some(Self::Int(n.clone())),
            _ => None,
        }
    }

    /// The string, for a [`ApiCallId::Text`] id.
    #[must_use]
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::Text(s) => Some(s),
            Self::Int(_) => None,
        }
    }
}

impl From<String> for ApiCallId {
    fn from(s: String) -> Self {
        Self::Text(s)
    }
}

impl From<&str> for ApiCallId {
    fn from(s: &str) -> Self {
        Self::Text(s.to_owned())
    }
}

impl From<u64> for ApiCallId {
    fn from(n: u64) -> Self {
        Self::Int(n.into())
    }
}

impl From<i64> for ApiCallId {
    fn from(n: i64) -> Self {
        Self::Int(n.into())
    }
}

/// The id as JSON (`"7"` or `7`), so a log line shows which of the two a runner sent.
impl fmt::Display for ApiCallId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Text(s) => write!(f, "{}", Value::String(s.clone())),
            Self::Int(n) => write!(f, "{n}"),
        }
    }
}

impl Serialize for ApiCallId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Text(s) => serializer.serialize_str(s),
            Self::Int(n) => n.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for ApiCallId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct IdVisitor;

        impl Visitor<'_> for IdVisitor {
            type Value = ApiCallId;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an integer")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<ApiCallId, E> {
                Ok(ApiCallId::Text(v.to_owned()))
            }

            fn visit_string<E: de::Error>(self, v: String) -> Result<ApiCallId, E> {
                Ok(ApiCallId::Text(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ApiCallId, E> {
                Ok(ApiCallId::Int(v.into()))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ApiCallId, E> {
                Ok(ApiCallId::Int(v.into()))
            }
        }

        deserializer.deserialize_any(IdVisitor)
    }
}

/// The answer to one Host API call: `{id, ok: true, data}` or `{id, ok: false, error}`.
///
/// Kept as a flat struct rather than an enum because that is the wire shape; use
/// [`ApiResult::success`], [`ApiResult::failure`] and [`ApiResult::into_result`] instead of
/// touching the fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApiResult {
    /// The `id` of the [`RunnerToHost::Api`] call this answers, exactly as the runner wrote
    /// it. `None` (written as `null`) only for the refusal of a call whose id was missing or
    /// not a string or an integer ([`ApiResult::unaddressed`]).
    #[serde(default)]
    pub id: Option<ApiCallId>,
    pub ok: bool,
    /// The answer when `ok` is true (absent reads as `null`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// The structured error when `ok` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<AgentApiError>,
}

impl ApiResult {
    /// A successful answer.
    #[must_use]
    pub fn success(id: impl Into<ApiCallId>, data: Value) -> Self {
        Self {
            id: Some(id.into()),
            ok: true,
            data: Some(data),
            error: None,
        }
    }

    /// A failed answer.
    #[must_use]
    pub fn failure(id: impl Into<ApiCallId>, error: AgentApiError) -> Self {
        Self {
            id: Some(id.into()),
            ok: false,
            data: None,
            error: Some(error),
        }
    }

    /// The refusal of a call that cannot be addressed: its `id` was missing or neither a
    /// string nor an integer. Written with `id: null`, which no runner call can be waiting on.
    #[must_use]
    pub fn unaddressed(error: AgentApiError) -> Self {
        Self {
            id: None,
            ok: false,
            data: None,
            error: Some(error),
        }
    }

    /// Builds the answer from a call outcome.
    #[must_use]
    pub fn from_result(id: impl Into<ApiCallId>, outcome: Result<Value, AgentApiError>) -> Self {
        match outcome {
            Ok(data) => Self::success(id, data),
            Err(error) => Self::failure(id, error),
        }
    }

    /// The call outcome. An `ok: false` answer without an `error` object (a host bug, never
    /// written by Switchboard) becomes a `runtime_error` rather than a panic.
    pub fn into_result(self) -> Result<Value, AgentApiError> {
        if self.ok {
            Ok(self.data.unwrap_or(Value::Null))
        } else {
            Err(self.error.unwrap_or_else(|| {
                AgentApiError::new(
                    crate::error::ErrorCode::RuntimeError,
                    "host answered ok=false without an error",
                )
            }))
        }
    }
}

/// A message a runner writes to its stdout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum RunnerToHost {
    /// One result item of a run. `result` is an `AgentRunResult` envelope
    /// (`{type, data, sequence?, run_id?, timestamp?}`) kept as raw JSON: the worker validates
    /// it (SPEC §4.3) with [`crate::result`], and must see malformed payloads to do so.
    Result { run_id: String, result: Value },
    /// The runner's result stream for `run_id` ended.
    Done { run_id: String },
    /// A Host API call on behalf of `run_id`. `id` is chosen by the runner (a string or an
    /// integer) and must be unique among the process's calls in flight; the answer carries the
    /// same `id`, of the same JSON type.
    ///
    /// This is the shape of a well-formed call. A line with `op: "api"` that does not fit it
    /// (no `run_id`, an `id` of another type, …) is still a call the host answers, with an
    /// error: the worker's decoder reads such lines leniently instead of failing them.
    Api {
        id: ApiCallId,
        run_id: String,
        action: String,
        #[serde(default)]
        params: Value,
    },
    /// A log line for the worker's logs.
    Log {
        level: LogLevel,
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        run_id: Option<String>,
    },
}

impl RunnerToHost {
    /// The run this message is about, if any.
    #[must_use]
    pub fn run_id(&self) -> Option<&str> {
        match self {
            Self::Result { run_id, .. } | Self::Done { run_id } | Self::Api { run_id, .. } => {
                Some(run_id)
            }
            Self::Log { run_id, .. } => run_id.as_deref(),
        }
    }
}

/// Severity of a [`RunnerToHost::Log`] line.
///
/// Parsing is forgiving (case-insensitive, `warning`/`fatal`/`critical` accepted, anything
/// unknown reads as [`LogLevel::Info`]) because a runner's choice of level word must never turn
/// a log line into a protocol error. It always serializes as the lowercase canonical name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

impl LogLevel {
    /// The canonical wire name.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Trace => "trace",
            Self::Debug => "debug",
            Self::Info => "info",
            Self::Warn => "warn",
            Self::Error => "error",
        }
    }

    /// Forgiving parse, see the type docs.
    #[must_use]
    pub fn parse_lenient(s: &str) -> Self {
        match s.trim().to_ascii_lowercase().as_str() {
            "trace" => Self::Trace,
            "debug" => Self::Debug,
            "warn" | "warning" => Self::Warn,
            "error" | "err" | "fatal" | "critical" => Self::Error,
            _ => Self::Info,
        }
    }
}

impl fmt::Display for LogLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for LogLevel {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for LogLevel {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(deserializer)?;
        Ok(Self::parse_lenient(&s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn runner_messages_round_trip_with_op_tags() {
        let cases = [
            (
                json!({"op": "result", "run_id": "r1", "result": {"type": "message.delta", "data": {}}}),
                RunnerToHost::Result {
                    run_id: "r1".into(),
                    result: json!({"type": "message.delta", "data": {}}),
                },
            ),
            (
                json!({"op": "done", "run_id": "r1"}),
                RunnerToHost::Done {
                    run_id: "r1".into(),
                },
            ),
            (
                json!({"op": "api", "id": "1", "run_id": "r1", "action": "get_host_version", "params": {}}),
                RunnerToHost::Api {
                    id: "1".into(),
                    run_id: "r1".into(),
                    action: "get_host_version".into(),
                    params: json!({}),
                },
            ),
            (
                json!({"op": "log", "level": "warn", "message": "hi"}),
                RunnerToHost::Log {
                    level: LogLevel::Warn,
                    message: "hi".into(),
                    run_id: None,
                },
            ),
        ];
        for (value, expected) in cases {
            let parsed: RunnerToHost = serde_json::from_value(value.clone()).unwrap();
            assert_eq!(parsed, expected);
            assert_eq!(serde_json::to_value(&parsed).unwrap(), value);
        }
    }

    #[test]
    fn api_params_default_to_null_and_unknown_op_is_rejected() {
        let parsed: RunnerToHost =
            serde_json::from_str(r#"{"op":"api","id":"9","run_id":"r","action":"x"}"#).unwrap();
        assert!(matches!(
            parsed,
            RunnerToHost::Api {
                params: Value::Null,
                ..
            }
        ));
        assert!(serde_json::from_str::<RunnerToHost>(r#"{"op":"nope"}"#).is_err());
        assert!(serde_json::from_str::<RunnerToHost>(r#"{"run_id":"r"}"#).is_err());
    }

    #[test]
    fn log_levels_parse_leniently() {
        for (word, level) in [
            ("WARNING", LogLevel::Warn),
            ("fatal", LogLevel::Error),
            ("Debug", LogLevel::Debug),
            ("verbose", LogLevel::Info),
        ] {
            let msg: RunnerToHost = serde_json::from_value(
                json!({"op": "log", "level": word, "message": "m", "run_id": "r"}),
            )
            .unwrap();
            assert_eq!(
                msg,
                RunnerToHost::Log {
                    level,
                    message: "m".into(),
                    run_id: Some("r".into())
                }
            );
        }
    }

    #[test]
    fn host_messages_have_the_documented_shapes() {
        let cancel = HostToRunner::Cancel {
            run_id: RunId::from_uuid(uuid::Uuid::nil()),
            reason: "user".into(),
        };
        assert_eq!(
            serde_json::to_value(&cancel).unwrap(),
            json!({"op": "cancel", "run_id": "00000000-0000-0000-0000-000000000000", "reason": "user"})
        );
        assert_eq!(
            serde_json::to_value(HostToRunner::Shutdown {}).unwrap(),
            json!({"op": "shutdown"})
        );
        let ok = HostToRunner::ApiResult(ApiResult::success("3", json!({"v": 1})));
        assert_eq!(
            serde_json::to_value(&ok).unwrap(),
            json!({"op": "api_result", "id": "3", "ok": true, "data": {"v": 1}})
        );
        let chunk = HostToRunner::ApiChunk {
            id: "3".into(),
            data: json!("x"),
        };
        assert_eq!(
            serde_json::to_value(&chunk).unwrap(),
            json!({"op": "api_chunk", "id": "3", "data": "x"})
        );
        let back: HostToRunner = serde_json::from_value(json!({"op": "shutdown"})).unwrap();
        assert_eq!(back, HostToRunner::Shutdown {});
    }

    #[test]
    fn call_ids_are_strings_or_integers_and_round_trip_exactly() {
        for (wire, id) in [
            (json!("7"), ApiCallId::from("7")),
            (json!(7), ApiCallId::from(7u64)),
            (json!(-3), ApiCallId::from(-3i64)),
            (json!(u64::MAX), ApiCallId::from(u64::MAX)),
        ] {
            let line =
                json!({"op": "api", "id": wire, "run_id": "r", "action": "ping", "params": {}});
            let parsed: RunnerToHost = serde_json::from_value(line.clone()).unwrap();
            assert!(matches!(&parsed, RunnerToHost::Api { id: got, .. } if *got == id));
            assert_eq!(serde_json::to_value(&parsed).unwrap(), line);
            // The answer echoes the id with its JSON type.
            let answer = HostToRunner::ApiResult(ApiResult::success(id.clone(), json!({})));
            assert_eq!(serde_json::to_value(&answer).unwrap()["id"], wire);
            assert_eq!(ApiCallId::from_json(&wire), Some(id));
        }
        assert_ne!(ApiCallId::from("7"), ApiCallId::from(7u64));
        assert_eq!(ApiCallId::from("7").to_string(), "\"7\"");
        assert_eq!(ApiCallId::from(7u64).to_string(), "7");
        for bad in [
            json!(1.5),
            json!(true),
            json!(null),
            json!([1]),
            json!({"a": 1}),
        ] {
            let line = json!({"op": "api", "id": bad, "run_id": "r", "action": "ping"});
            assert!(
                serde_json::from_value::<RunnerToHost>(line).is_err(),
                "{bad}"
            );
            assert_eq!(ApiCallId::from_json(&bad), None);
        }
    }

    #[test]
    fn an_unaddressed_answer_has_a_null_id() {
        let answer = HostToRunner::ApiResult(ApiResult::unaddressed(AgentApiError::new(
            crate::error::ErrorCode::InvalidArgument,
            "no id",
        )));
        let value = serde_json::to_value(&answer).unwrap();
        assert_eq!(value["id"], Value::Null);
        assert!(value.as_object().unwrap().contains_key("id"));
        let back: HostToRunner = serde_json::from_value(value).unwrap();
        assert_eq!(back, answer);
    }

    #[test]
    fn api_result_into_result() {
        let ok: ApiResult = serde_json::from_value(json!({"id": "1", "ok": true})).unwrap();
        assert_eq!(ok.into_result().unwrap(), Value::Null);
        let bare: ApiResult = serde_json::from_value(json!({"id": "1", "ok": false})).unwrap();
        assert!(bare.into_result().is_err());
    }
}
