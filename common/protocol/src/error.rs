//! The one closed set of error codes, and the only two mappings from it.
//!
//! Every domain error in the project (`BusError`, `StoreError`, `RunnerError`, …) implements
//! [`HasErrorCode`]. Two decisions are then made from the code alone, each in exactly one
//! place:
//!
//! - [`ErrorCode::http_status`]: the status the gateway answers with;
//! - [`ErrorCode::disposition`]: what a bus consumer does with the message it was handling.
//!
//! Runners see errors as [`AgentApiError`], the PROTOCOL_V1 §9 shape
//! `{code, message, retryable, details}`. A failed *run* is reported differently, as a
//! `run.failed` result whose `code` comes from [`run_failure`].
//!
//! # Table
//!
//! | code | HTTP | disposition | retryable |
//! | --- | --- | --- | --- |
//! | `invalid_argument` | 400 | dead-letter | no |
//! | `unauthorized` | 401 | ack | no |
//! | `not_found` | 404 | ack | no |
//! | `conflict` | 409 | ack | no |
//! | `payload_too_large` | 413 | dead-letter | no |
//! | `rate_limited` | 429 | retry | yes |
//! | `budget_exceeded` | 429 | ack | no |
//! | `deadline_exceeded` | 504 | ack | no |
//! | `unavailable` | 503 | retry | yes |
//! | `runtime_error` | 502 | ack | no |
//! | `internal` | 500 | dead-letter | no |
//! | `cancelled` | 499 | ack | no |
//! | `tool_outcome_unknown` | 500 | ack | no |
//! | `permission_denied` | 403 | ack | no |

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The closed set of error codes. `snake_case` on the wire.
///
/// The first seven are the PROTOCOL_V1 §9 codes runners already know; the rest are the
/// additions the distributed host needs (SPEC §8, §11).
///
/// ```
/// use sb_protocol::error::{Disposition, ErrorCode};
/// assert_eq!(ErrorCode::NotFound.http_status(), 404);
/// assert_eq!(ErrorCode::Unavailable.disposition(), Disposition::Retry);
/// assert_eq!("rate_limited".parse::<ErrorCode>().unwrap(), ErrorCode::RateLimited);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request or message is malformed: bad parameters, bad cursor, schema violation.
    InvalidArgument,
    /// Missing or bad credentials, or access to a resource/scope that the caller (API key,
    /// run authorization snapshot, plugin identity) does not hold.
    Unauthorized,
    /// The resource does not exist, or is not visible to this caller (we do not reveal which).
    NotFound,
    /// The request collides with existing state: ambiguous agent scope, same idempotency
    /// key / tool `call_id` with a different payload, run already in a terminal state.
    Conflict,
    /// A request, response, result or value is over its size cap.
    PayloadTooLarge,
    /// A per-key or per-run rate limit was hit; trying later can succeed.
    RateLimited,
    /// The run deadline (or another hard deadline) has passed.
    DeadlineExceeded,
    /// A per-run budget (model calls, tool calls, output/result characters) is exhausted.
    /// Budgets never refill within a run, so unlike `rate_limited` this is not retryable.
    BudgetExceeded,
    /// A dependency (broker, database, Redis, a worker pool) is temporarily unreachable.
    Unavailable,
    /// A host capability or downstream provider failed (model endpoint, tool, knowledge base).
    RuntimeError,
    /// A bug or broken invariant inside the host.
    Internal,
    /// The operation was cancelled (run cancelled by a user, by `interrupt` concurrency, or
    /// by shutdown).
    Cancelled,
    /// A tool call was interrupted and we cannot know whether it took effect. It is never
    /// re-executed automatically.
    ToolOutcomeUnknown,
    /// Valid credentials whose role does not allow the operation: a `client` API key calling
    /// an admin route (SPEC §14). Unlike `unauthorized`, presenting the same key again never
    /// helps; another key is needed.
    PermissionDenied,
}

/// What a bus consumer does with the message whose handling failed with a given code.
///
/// The rule (as in quickwit's `convert_metastore_error`): only errors whose cause may go
/// away on its own are retried; an error that *certainly* failed for good is never retried.
/// Among the permanent ones, an expected outcome of normal operation is acknowledged
/// (the failure is already recorded elsewhere, e.g. as the run's status or the event's
/// `unrouted` reason), while a message that is itself broken, or that hit a host bug, is
/// dead-lettered so an operator can inspect and replay it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Disposition {
    /// Done with the message: remove it from the queue.
    Ack,
    /// Transient failure: requeue the message (the consumer applies its backoff).
    Retry,
    /// Permanent failure that needs a human: route the message to the dead-letter queue.
    DeadLetter,
}

impl ErrorCode {
    /// Every code, in declaration order (for tables, docs and exhaustive tests).
    pub const ALL: [ErrorCode; 14] = [
        Self::InvalidArgument,
        Self::Unauthorized,
        Self::NotFound,
        Self::Conflict,
        Self::PayloadTooLarge,
        Self::RateLimited,
        Self::DeadlineExceeded,
        Self::BudgetExceeded,
        Self::Unavailable,
        Self::RuntimeError,
        Self::Internal,
        Self::Cancelled,
        Self::ToolOutcomeUnknown,
        Self::PermissionDenied,
    ];

    /// The wire text, e.g. `"not_found"`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::InvalidArgument => "invalid_argument",
            Self::Unauthorized => "unauthorized",
            Self::PermissionDenied => "permission_denied",
            Self::NotFound => "not_found",
            Self::Conflict => "conflict",
            Self::PayloadTooLarge => "payload_too_large",
            Self::RateLimited => "rate_limited",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::BudgetExceeded => "budget_exceeded",
            Self::Unavailable => "unavailable",
            Self::RuntimeError => "runtime_error",
            Self::Internal => "internal",
            Self::Cancelled => "cancelled",
            Self::ToolOutcomeUnknown => "tool_outcome_unknown",
        }
    }

    /// The HTTP status for this code. This is the only HTTP mapping in the project.
    ///
    /// Choices that are not obvious:
    /// - `budget_exceeded` → 429, the usual status for an exhausted quota (gRPC
    ///   `RESOURCE_EXHAUSTED` maps there too). 402 would suggest billing. The body's
    ///   `retryable: false` tells clients that, unlike `rate_limited`, waiting does not help.
    /// - `runtime_error` → 502: the host itself worked, a downstream capability failed.
    /// - `cancelled` → 499, the conventional "client closed request" status gRPC gateways
    ///   use for `CANCELLED`.
    /// - `tool_outcome_unknown` → 500: the server cannot state the result; it is not a
    ///   gateway timeout (504), since retrying the same call is exactly what must not happen.
    #[must_use]
    pub const fn http_status(self) -> u16 {
        match self {
            Self::InvalidArgument => 400,
            Self::Unauthorized => 401,
            Self::PermissionDenied => 403,
            Self::NotFound => 404,
            Self::Conflict => 409,
            Self::PayloadTooLarge => 413,
            Self::RateLimited | Self::BudgetExceeded => 429,
            Self::Cancelled => 499,
            Self::Internal | Self::ToolOutcomeUnknown => 500,
            Self::RuntimeError => 502,
            Self::Unavailable => 503,
            Self::DeadlineExceeded => 504,
        }
    }

    /// What a bus consumer does with a message whose handling failed with this code.
    /// This is the only disposition mapping in the project; see [`Disposition`] for the rule.
    ///
    /// - Retry: `unavailable`, `rate_limited` (the cause can go away).
    /// - Dead-letter: `invalid_argument`, `payload_too_large` (the message itself is broken)
    ///   and `internal` (a host bug; keep the message to replay after the fix).
    /// - Ack: everything else. These are final, expected outcomes that the handler records
    ///   (run failed/cancelled/timed out, event unrouted, duplicate already applied);
    ///   redelivering would only repeat them. `deadline_exceeded` means the *run* deadline
    ///   passed and is final; an I/O timeout talking to a dependency must be reported as
    ///   `unavailable` instead.
    #[must_use]
    pub const fn disposition(self) -> Disposition {
        match self {
            Self::Unavailable | Self::RateLimited => Disposition::Retry,
            Self::InvalidArgument | Self::PayloadTooLarge | Self::Internal => {
                Disposition::DeadLetter
            }
            Self::Unauthorized
            | Self::PermissionDenied
            | Self::NotFound
            | Self::Conflict
            | Self::DeadlineExceeded
            | Self::BudgetExceeded
            | Self::RuntimeError
            | Self::Cancelled
            | Self::ToolOutcomeUnknown => Disposition::Ack,
        }
    }

    /// Whether the same request can succeed if repeated later unchanged. This is the default
    /// of [`AgentApiError::retryable`], and holds exactly when
    /// [`disposition`](Self::disposition) is [`Disposition::Retry`].
    #[must_use]
    pub const fn is_retryable(self) -> bool {
        matches!(self, Self::Unavailable | Self::RateLimited)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The text was not one of the [`ErrorCode`] values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown error code `{0}`")]
pub struct UnknownErrorCode(pub String);

impl FromStr for ErrorCode {
    type Err = UnknownErrorCode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| UnknownErrorCode(s.to_owned()))
    }
}

/// Implemented by every domain error type, so the HTTP status and message disposition are
/// decided from the code in one place each.
pub trait HasErrorCode {
    /// The code this error maps to.
    fn code(&self) -> ErrorCode;
}

impl HasErrorCode for ErrorCode {
    fn code(&self) -> ErrorCode {
        *self
    }
}

/// A Host API error as the runner sees it (PROTOCOL_V1 §9):
/// `{ "code": str, "message": str, "retryable": bool = false, "details": {} }`.
///
/// `code` is kept as a string so that a client built against this crate can still read an
/// error carrying a code added later; hosts only produce [`ErrorCode`] values (use
/// [`AgentApiError::new`]).
///
/// ```
/// use sb_protocol::error::{AgentApiError, ErrorCode};
/// let e = AgentApiError::new(ErrorCode::RateLimited, "too many calls")
///     .with_detail("limit", 10);
/// assert!(e.retryable);
/// assert_eq!(e.error_code(), Some(ErrorCode::RateLimited));
/// let json = serde_json::to_value(&e).unwrap();
/// assert_eq!(json["code"], "rate_limited");
/// assert_eq!(json["details"]["limit"], 10);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct AgentApiError {
    /// One of the [`ErrorCode`] texts.
    pub code: String,
    /// Human-readable explanation, lowercase, no trailing period.
    pub message: String,
    /// Whether repeating the same call later can succeed.
    #[serde(default)]
    pub retryable: bool,
    /// Structured extra information (limits, offending ids, …).
    #[serde(default)]
    pub details: Map<String, Value>,
}

impl AgentApiError {
    /// An error with `retryable` defaulted from [`ErrorCode::is_retryable`] and no details.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code: code.as_str().to_owned(),
            message: message.into(),
            retryable: code.is_retryable(),
            details: Map::new(),
        }
    }

    /// Replaces the details map.
    #[must_use]
    pub fn with_details(mut self, details: Map<String, Value>) -> Self {
        self.details = details;
        self
    }

    /// Adds one detail entry.
    #[must_use]
    pub fn with_detail(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.details.insert(key.into(), value.into());
        self
    }

    /// Overrides the retryable flag.
    #[must_use]
    pub fn with_retryable(mut self, retryable: bool) -> Self {
        self.retryable = retryable;
        self
    }

    /// The typed code, or `None` for a code this version does not know.
    #[must_use]
    pub fn error_code(&self) -> Option<ErrorCode> {
        self.code.parse().ok()
    }

    /// Builds the runner-visible error from any domain error. The message is the error's
    /// `Display` text, except for `internal`, which gets a generic message so host
    /// internals do not leak to plugins (the caller logs the real error).
    pub fn from_error<E: HasErrorCode + fmt::Display + ?Sized>(err: &E) -> Self {
        let code = err.code();
        let message = if code == ErrorCode::Internal {
            "internal host error".to_owned()
        } else {
            err.to_string()
        };
        Self::new(code, message)
    }
}

impl HasErrorCode for AgentApiError {
    /// An unknown code counts as `runtime_error`: the failure came from somewhere we call.
    fn code(&self) -> ErrorCode {
        self.error_code().unwrap_or(ErrorCode::RuntimeError)
    }
}

/// The `code` values of `run.failed` results (`data.code`), and their default `retryable`.
///
/// These are a separate, open vocabulary from [`ErrorCode`]: PROTOCOL_V1 lets a runner
/// report its own codes (default `runner.error`); the ones below are those the host itself
/// emits.
///
/// ```
/// use sb_protocol::error::run_failure;
/// assert!(run_failure::default_retryable(run_failure::INTERRUPTED));
/// assert!(!run_failure::default_retryable(run_failure::RUNNER_CRASHED));
/// ```
pub mod run_failure {
    /// Generic runner failure; the default when a runner gives no code.
    pub const RUNNER_ERROR: &str = "runner.error";
    /// The runner process died while the run was in flight.
    pub const RUNNER_CRASHED: &str = "runner.crashed";
    /// The runner broke the wire or result protocol (bad line, missing result type,
    /// empty message, oversize result or inline artifact, …).
    pub const RUNNER_PROTOCOL_ERROR: &str = "runner.protocol_error";
    /// The run ended with neither a `message.*` output nor a terminal result.
    pub const RUNNER_EMPTY_OUTPUT: &str = "runner.empty_output";
    /// The run was cancelled (API cancel, `interrupt` concurrency, shutdown).
    pub const CANCELLED: &str = "cancelled";
    /// The run passed its deadline.
    pub const TIMEOUT: &str = "timeout";
    /// The worker hosting the run was lost after the run started; it is finalized and never
    /// re-executed (SPEC §11).
    pub const INTERRUPTED: &str = "interrupted";
    /// The run produced more result items than the deployment allows per run
    /// (`limits.run_items_max`); the host ended it.
    pub const RUNNER_TOO_MANY_ITEMS: &str = "runner.too_many_items";

    /// Every host-emitted code.
    pub const ALL: [&str; 8] = [
        RUNNER_ERROR,
        RUNNER_CRASHED,
        RUNNER_PROTOCOL_ERROR,
        RUNNER_EMPTY_OUTPUT,
        CANCELLED,
        TIMEOUT,
        INTERRUPTED,
        RUNNER_TOO_MANY_ITEMS,
    ];

    /// The `retryable` flag the host sets when it emits `code`: only a run that failed
    /// because of the environment (deadline, lost worker) could succeed if retried as a new
    /// run. Protocol v1 never retries runs automatically; the flag informs the caller.
    #[must_use]
    pub fn default_retryable(code: &str) -> bool {
        matches!(code, TIMEOUT | INTERRUPTED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_of_http_and_disposition() {
        use Disposition::*;
        let expected: [(ErrorCode, u16, Disposition); 14] = [
            (ErrorCode::InvalidArgument, 400, DeadLetter),
            (ErrorCode::Unauthorized, 401, Ack),
            (ErrorCode::NotFound, 404, Ack),
            (ErrorCode::Conflict, 409, Ack),
            (ErrorCode::PayloadTooLarge, 413, DeadLetter),
            (ErrorCode::RateLimited, 429, Retry),
            (ErrorCode::DeadlineExceeded, 504, Ack),
            (ErrorCode::BudgetExceeded, 429, Ack),
            (ErrorCode::Unavailable, 503, Retry),
            (ErrorCode::RuntimeError, 502, Ack),
            (ErrorCode::Internal, 500, DeadLetter),
            (ErrorCode::Cancelled, 499, Ack),
            (ErrorCode::ToolOutcomeUnknown, 500, Ack),
            (ErrorCode::PermissionDenied, 403, Ack),
        ];
        for (code, status, disposition) in expected {
            assert_eq!(code.http_status(), status, "{code}");
            assert_eq!(code.disposition(), disposition, "{code}");
            assert_eq!(code.is_retryable(), disposition == Retry, "{code}");
        }
    }

    #[test]
    fn codes_roundtrip_as_snake_case() {
        for code in ErrorCode::ALL {
            let json = serde_json::to_value(code).unwrap();
            assert_eq!(json, Value::String(code.as_str().to_owned()));
            assert_eq!(serde_json::from_value::<ErrorCode>(json).unwrap(), code);
            assert_eq!(code.as_str().parse::<ErrorCode>().unwrap(), code);
            assert_eq!(code.to_string(), code.as_str());
        }
        assert!("NotFound".parse::<ErrorCode>().is_err());
        assert!(serde_json::from_str::<ErrorCode>("\"teapot\"").is_err());
    }

    #[test]
    fn api_error_shape_and_defaults() {
        let e = AgentApiError::new(ErrorCode::NotFound, "run session x not found or expired");
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "code": "not_found",
                "message": "run session x not found or expired",
                "retryable": false,
                "details": {}
            })
        );
        // retryable and details default when absent
        let back: AgentApiError =
            serde_json::from_value(serde_json::json!({"code": "weird", "message": "m"})).unwrap();
        assert!(!back.retryable);
        assert!(back.details.is_empty());
        assert_eq!(back.error_code(), None);
        assert_eq!(back.code(), ErrorCode::RuntimeError);
    }

    #[test]
    fn api_error_hides_internal_messages() {
        struct Boom;
        impl fmt::Display for Boom {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("db password is hunter2")
            }
        }
        impl HasErrorCode for Boom {
            fn code(&self) -> ErrorCode {
                ErrorCode::Internal
            }
        }
        let e = AgentApiError::from_error(&Boom);
        assert_eq!(e.code, "internal");
        assert!(!e.message.contains("hunter2"));
        let e = AgentApiError::from_error(&ErrorCode::Conflict);
        assert_eq!(e.message, "conflict");
    }

    #[test]
    fn run_failure_defaults() {
        for code in run_failure::ALL {
            let expected = code == run_failure::TIMEOUT || code == run_failure::INTERRUPTED;
            assert_eq!(run_failure::default_retryable(code), expected, "{code}");
        }
    }
}
