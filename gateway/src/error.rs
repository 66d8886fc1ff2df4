//! [`ApiError`]: the one place where an error becomes an HTTP response, and [`ApiJson`], the
//! JSON extractor whose rejections use the same shape.
//!
//! Every error body is `{"code": "...", "message": "...", "request_id": "..."}`, whichever
//! layer refused: [`finish_errors`] renders each [`ApiError`] again with the request's id
//! and turns any other `4xx`/`5xx` (a layer's bare status or plain text) into the error of
//! its status, so no route, extractor, fallback or middleware can answer another shape. The
//! remote Host API
//! (`/v1/host/{action}`) answers the runner-facing shape of PROTOCOL_V1 §9 instead,
//! `{"code", "message", "retryable", "details"}` ([`ApiError::from_agent`],
//! [`ApiError::for_runner`]). The status comes from
//! [`ErrorCode::http_status`] and nowhere else. Messages of 4xx errors say what was expected;
//! `internal` (and dependency outages, `unavailable`) go out with a generic message while the
//! real error travels in the response extensions ([`ErrorDetail`]) to
//! [`log_error_details`], which logs it with the request's method and path. This is axum's
//! error-handling example, with quickwit's "one code, one mapping" rule.
//!
//! Extractors: handlers take [`ApiJson`], [`ApiQuery`] and [`ApiPath`] instead of axum's
//! `Json`, `Query` and `Path`, whose rejections are plain text (`Invalid URL: …` for a
//! percent-encoded path id that is not UTF-8). All three also refuse NUL (U+0000) with
//! `400 invalid_argument`: PostgreSQL cannot store it, and refusing it here answers the same
//! in embedded and cluster mode instead of a `500` from the store.
//!
//! # Refusals below the router
//!
//! The head limits a client meets are the gateway's own ([`crate::server`]: 100 header
//! fields, 64 KiB of them, an 8 KiB request target), answered `431`/`414` in this shape.
//! Hyper's HTTP/1 parser still refuses a few requests before any request exists for axum (no
//! route, no middleware, no request id), and writes those answers itself: a status line,
//! `content-length: 0`, no body, then it closes the connection. It has no hook to change
//! them (`hyper::proto::h1::role::Server::on_error` builds a bare `MessageHead`, and the
//! connection future only reports the error after writing it). They are:
//!
//! | answer | cause |
//! | --- | --- |
//! | `431` | a head over hyper's ceilings, far above ours: 1 MiB, or more than 1,000 header fields |
//! | `414` | a request target over 64 KiB (hyper's fixed limit) |
//! | `400` | bytes that are not HTTP/1: an unparsable request line or header (a method, version or header name with forbidden bytes, a raw space, control or non-ASCII byte in the target) |
//!
//! None of them can come from a conforming HTTP client (one percent-encodes the target; a
//! percent-encoded id that is not UTF-8 or holds NUL reaches the router and is answered in
//! this shape). A client can recognise them by the empty body; none is retryable unchanged.

use std::fmt;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::{
    BytesRejection, JsonRejection, PathRejection, QueryRejection, RawPathParamsRejection,
};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, RawPathParams, Request};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Json, http};
use sb_common::bus::{BatchPublishError, BusError};
use sb_common::error::ShutdownError;
use sb_common::session::SessionError;
use sb_protocol::error::{AgentApiError, ErrorCode, HasErrorCode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

/// Result alias of the handlers.
pub type ApiResult<T> = Result<T, ApiError>;

/// An error answered to an API client.
#[derive(Debug, Clone)]
pub struct ApiError {
    code: ErrorCode,
    message: String,
    /// The real cause, logged by [`log_error_details`] and never sent to the client. Set when
    /// the public message was replaced by a generic one.
    detail: Option<String>,
    /// A more precise status inside the code's class (`422`, `405`, `431`, …), answered
    /// instead of [`ErrorCode::http_status`]. See [`ApiError::status`].
    refined_status: Option<StatusCode>,
    /// Set for answers to runners (the remote Host API): the body then also carries
    /// `retryable` and `details`, the PROTOCOL_V1 §9 error shape.
    runner_fields: Option<RunnerFields>,
    /// When a retryable refusal knows how long to wait (a token bucket does): sent as
    /// `Retry-After` in whole seconds, at least 1. `None`: `1` for retryable codes.
    retry_after: Option<Duration>,
}

/// The two fields the runner-facing error shape adds.
#[derive(Debug, Clone, Default)]
struct RunnerFields {
    retryable: bool,
    details: Map<String, Value>,
}

/// Body of every error response; `Error` in the OpenAPI document.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = Error)]
pub(crate) struct ErrorBody<'a> {
    /// What went wrong; decides the HTTP status.
    code: ErrorCode,
    /// What was expected, for a person (generic for `internal` and `unavailable`).
    message: &'a str,
    /// The `x-request-id` of the request (see [`crate::request_id`]): the same id is on the
    /// request's log lines, so a client's report finds them.
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<&'a str>,
    /// Remote Host API only: whether the same call may succeed later.
    #[serde(skip_serializing_if = "Option::is_none")]
    retryable: Option<bool>,
    /// Remote Host API only: structured details of the refusal.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    details: Option<&'a Map<String, Value>>,
}

/// The hidden cause of an error response, carried in the response extensions so the logging
/// middleware can report it next to the request it belongs to.
#[derive(Debug, Clone)]
pub struct ErrorDetail {
    /// The error code that was answered.
    pub code: ErrorCode,
    /// The full error text.
    pub detail: String,
}

impl ApiError {
    /// An error whose `message` is shown to the client as is. Messages are lowercase with no
    /// trailing period.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            detail: None,
            refined_status: None,
            runner_fields: None,
            retry_after: None,
        }
    }

    /// The answer to a runner for a Host API error: its code decides the status, and the body
    /// is the error as the runner would get it over the stdio wire (the action code already
    /// keeps host internals out of its messages).
    pub fn from_agent(error: AgentApiError) -> Self {
        let code = error.code();
        Self {
            code,
            message: error.message,
            detail: None,
            refined_status: None,
            runner_fields: Some(RunnerFields {
                retryable: error.retryable,
                details: error.details,
            }),
            retry_after: None,
        }
    }

    /// The same error in the runner-facing shape (`retryable` from the code, no details
    /// unless already set): for refusals the remote Host API makes before the pipeline runs
    /// (missing token, unreadable body, timeout).
    #[must_use]
    pub fn for_runner(mut self) -> Self {
        if self.runner_fields.is_none() {
            self.runner_fields = Some(RunnerFields {
                retryable: self.code.is_retryable(),
                details: Map::new(),
            });
        }
        self
    }

    /// `400 invalid_argument`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, message)
    }

    /// `404 not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }

    /// `401 unauthorized` for a missing or unknown API key.
    pub fn unauthorized() -> Self {
        Self::new(
            ErrorCode::Unauthorized,
            "missing or invalid api key (expected `Authorization: Bearer <key>`)",
        )
    }

    /// `403 permission_denied`: the key is valid, but its role does not allow `what`.
    pub fn permission_denied(what: &str) -> Self {
        Self::new(
            ErrorCode::PermissionDenied,
            format!("{what} needs an admin api key; this key has the client role"),
        )
    }

    /// `429 rate_limited` with `Retry-After: <retry_after, rounded up to whole seconds, at
    /// least 1>`.
    pub fn rate_limited(message: impl Into<String>, retry_after: Duration) -> Self {
        Self {
            retry_after: Some(retry_after),
            ..Self::new(ErrorCode::RateLimited, message)
        }
    }

    /// `500 internal` with a generic public message; `detail` is only logged.
    pub fn internal(detail: impl fmt::Display) -> Self {
        Self {
            code: ErrorCode::Internal,
            message: generic_message(ErrorCode::Internal).to_owned(),
            detail: Some(detail.to_string()),
            refined_status: None,
            runner_fields: None,
            retry_after: None,
        }
    }

    /// `422` with code `invalid_argument`: the body is well-formed but refers to something
    /// that cannot be used (e.g. a runner no worker registered).
    pub fn unprocessable(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, message).refined(StatusCode::UNPROCESSABLE_ENTITY)
    }

    /// `405` with code `invalid_argument`: the route exists but does not serve this method.
    /// The router adds `Allow` with the methods it does serve.
    pub fn method_not_allowed() -> Self {
        Self::new(
            ErrorCode::InvalidArgument,
            "this route does not serve this method (see the `allow` header)",
        )
        .refined(StatusCode::METHOD_NOT_ALLOWED)
    }

    /// `431` with code `payload_too_large`: the request head (header fields) is over a limit.
    pub fn header_too_large(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::PayloadTooLarge, message)
            .refined(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
    }

    /// `414` with code `payload_too_large`: the request target (path and query) is too long.
    pub fn uri_too_long(max: usize) -> Self {
        Self::new(
            ErrorCode::PayloadTooLarge,
            format!("the request target (path and query) is longer than {max} bytes"),
        )
        .refined(StatusCode::URI_TOO_LONG)
    }

    /// The structured error for a refusal some layer answered in its own format (a bare
    /// status, plain text): the code is the one of the status's meaning, the status is kept,
    /// and a short plain-text message of a 4xx is passed on (a 5xx's is only logged).
    fn from_foreign(status: StatusCode, text: &str) -> Self {
        let code = match status.as_u16() {
            401 => ErrorCode::Unauthorized,
            403 => ErrorCode::PermissionDenied,
            404 | 410 => ErrorCode::NotFound,
            408 | 504 => ErrorCode::DeadlineExceeded,
            409 | 412 => ErrorCode::Conflict,
            413 | 414 | 431 => ErrorCode::PayloadTooLarge,
            429 => ErrorCode::RateLimited,
            499 => ErrorCode::Cancelled,
            502 => ErrorCode::RuntimeError,
            503 => ErrorCode::Unavailable,
            400..=499 => ErrorCode::InvalidArgument,
            _ => ErrorCode::Internal,
        };
        let text = text.trim();
        let mut error = if hides_detail(code) || text.is_empty() {
            let reason = status.canonical_reason().unwrap_or("refused");
            Self {
                detail: (!text.is_empty()).then(|| text.to_owned()),
                ..Self::new(code, reason.to_ascii_lowercase())
            }
        } else {
            Self::new(code, text.to_owned())
        };
        if status != error.status() {
            error = error.refined(status);
        }
        error
    }

    /// The same error answered with `status`, a refinement of the code's own status.
    fn refined(mut self, status: StatusCode) -> Self {
        self.refined_status = Some(status);
        self
    }

    /// Builds the error of any domain error: its code decides the status; for codes whose
    /// text may reveal internals (`internal`, `unavailable`, …) the public message is generic
    /// and the error text is only logged.
    pub fn from_coded<E: HasErrorCode + fmt::Display + ?Sized>(err: &E) -> Self {
        let code = err.code();
        if hides_detail(code) {
            Self {
                code,
                message: generic_message(code).to_owned(),
                detail: Some(err.to_string()),
                refined_status: None,
                runner_fields: None,
                retry_after: None,
            }
        } else {
            Self::new(code, err.to_string())
        }
    }

    /// The code.
    pub fn code(&self) -> ErrorCode {
        self.code
    }

    /// The public message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The HTTP status: [`ErrorCode::http_status`], the only mapping, with refinements that
    /// HTTP clients act on while the body's code stays the same: inside `invalid_argument`,
    /// a semantically unusable request is `422` (RFC 9110 §15.5.21) and a method the route
    /// does not serve `405` (with `Allow`); inside `payload_too_large`, a head over its limit
    /// is `431` and a request target `414`.
    pub fn status(&self) -> StatusCode {
        if let Some(status) = self.refined_status {
            return status;
        }
        StatusCode::from_u16(self.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

/// `Retry-After` in whole seconds (RFC 9110 §10.2.3 has no fractions), rounded up so a client
/// that waits as told is not refused again, and never `0`, which some clients read as "now,
/// in a loop".
fn retry_after_header(wait: Option<Duration>) -> HeaderValue {
    let secs = wait.map_or(1, |w| w.as_secs() + u64::from(w.subsec_nanos() > 0));
    HeaderValue::from(secs.max(1))
}

/// Codes whose error text is about our dependencies or our bugs, not about the request.
fn hides_detail(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::Internal | ErrorCode::Unavailable | ErrorCode::ToolOutcomeUnknown
    )
}

fn generic_message(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::Unavailable => {
            "a dependency of the gateway is temporarily unavailable, retry later"
        }
        _ => "internal error",
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for ApiError {}

impl ApiError {
    /// The response, its body carrying `request_id` when known.
    fn render(self, request_id: Option<&str>) -> Response {
        let status = self.status();
        let body = ErrorBody {
            code: self.code,
            message: &self.message,
            request_id,
            retryable: self.runner_fields.as_ref().map(|f| f.retryable),
            details: self.runner_fields.as_ref().map(|f| &f.details),
        };
        let mut response = (status, Json(body)).into_response();
        if self.code == ErrorCode::Unauthorized {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if self.code.is_retryable() {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, retry_after_header(self.retry_after));
        }
        if let Some(detail) = self.detail.clone() {
            response.extensions_mut().insert(ErrorDetail {
                code: self.code,
                detail,
            });
        }
        // Kept so [`finish_errors`] can render it again with the request id.
        response.extensions_mut().insert(self);
        response
    }
}

impl IntoResponse for ApiError {
    /// The body without a request id: a handler does not know it; [`finish_errors`], which
    /// does, renders the error again on its way out.
    fn into_response(self) -> Response {
        self.render(None)
    }
}

macro_rules! from_coded {
    ($($ty:ty),* $(,)?) => {$(
        impl From<$ty> for ApiError {
            fn from(err: $ty) -> Self {
                Self::from_coded(&err)
            }
        }
    )*};
}

from_coded!(
    BusError,
    BatchPublishError,
    SessionError,
    ShutdownError,
    sb_store::StoreError
);

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        match rejection {
            // Syntactically valid JSON of the wrong shape: serde_path_to_error's text names
            // the field (`actor.actor_id: invalid type: integer `5`, expected a string …`).
            JsonRejection::JsonDataError(err) => {
                let inner = std::error::Error::source(&err)
                    .map_or_else(|| err.body_text(), ToString::to_string);
                Self::invalid(format!("invalid request body: {inner}"))
            }
            JsonRejection::JsonSyntaxError(err) => {
                let inner = std::error::Error::source(&err)
                    .map_or_else(|| err.body_text(), ToString::to_string);
                Self::invalid(format!("request body is not valid json: {inner}"))
            }
            JsonRejection::MissingJsonContentType(_) => missing_json_content_type(),
            JsonRejection::BytesRejection(err) => err.into(),
            other => Self::invalid(format!("cannot read request body: {}", other.body_text())),
        }
    }
}

fn missing_json_content_type() -> ApiError {
    ApiError::invalid("expected a request with `Content-Type: application/json`")
}

impl From<BytesRejection> for ApiError {
    fn from(rejection: BytesRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Self::new(
                ErrorCode::PayloadTooLarge,
                "request body is larger than the configured limit",
            )
        } else if body_timed_out(&rejection) {
            Self::new(
                ErrorCode::DeadlineExceeded,
                "the request body stopped arriving before it was complete",
            )
            .refined(StatusCode::REQUEST_TIMEOUT)
        } else {
            Self::invalid(format!(
                "cannot read request body: {}",
                rejection.body_text()
            ))
        }
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        use axum::extract::path::ErrorKind;
        match rejection {
            PathRejection::FailedToDeserializePathParams(err) => match err.kind() {
                ErrorKind::InvalidUtf8InPathParam { key } => invalid_utf8_in_path(key),
                // A route whose parameters do not fit its extractor: our bug.
                ErrorKind::UnsupportedType { .. } | ErrorKind::WrongNumberOfParameters { .. } => {
                    Self::internal(err.body_text())
                }
                kind => Self::invalid(format!("invalid path parameter: {kind}")),
            },
            // A handler extracting a path on a route without parameters: our bug.
            other => Self::internal(other.body_text()),
        }
    }
}

impl From<RawPathParamsRejection> for ApiError {
    fn from(rejection: RawPathParamsRejection) -> Self {
        match rejection {
            RawPathParamsRejection::InvalidUtf8InPathParam(err) => {
                // The rejection only shows its key through its text: "Invalid UTF-8 in `key`".
                let text = err.body_text();
                let key = text.split('`').nth(1).unwrap_or("path parameter");
                invalid_utf8_in_path(key)
            }
            other => Self::internal(other.body_text()),
        }
    }
}

/// Whether reading the body failed because the client stopped sending it (the body idle
/// timeout of [`crate::app`], tower-http's `TimeoutBody`): the client's fault, so `408`, not
/// the `504` of a handler that took too long.
fn body_timed_out(rejection: &BytesRejection) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(rejection);
    while let Some(error) = source {
        if error.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        source = error.source();
    }
    false
}

fn invalid_utf8_in_path(key: &str) -> ApiError {
    ApiError::invalid(format!(
        "path parameter `{key}` is not valid UTF-8 once percent-decoded"
    ))
}

/// Why NUL (U+0000) is refused in every request, whatever the backend: PostgreSQL cannot
/// store it in `text` or `jsonb` (the insert fails, which used to answer `500`), and no id,
/// name or text of ours has a use for it. Refusing it at the edge gives the same clear `400`
/// in embedded (SQLite) and cluster (Postgres) mode.
fn nul_refused(place: &str) -> ApiError {
    ApiError::invalid(format!("{place} must not contain NUL (U+0000) characters"))
}

/// Whether a JSON text holds a NUL character: as the escape `\u0000` inside a string (a raw
/// NUL byte is not valid JSON, and is reported as such). Escapes are skipped whole, so an
/// escaped backslash followed by `u0000` (the six characters, not NUL) is not taken for one.
fn json_has_nul(body: &[u8]) -> bool {
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            0 => return true,
            b'\\' => {
                if body.get(i + 1) == Some(&b'u') && body.get(i + 2..i + 6) == Some(b"0000") {
                    return true;
                }
                i += 2;
            }
            _ => i += 1,
        }
    }
    false
}

/// `Content-Type` is `application/json` or `application/<anything>+json` (parameters such as
/// `charset` allowed): the rule of axum's `Json`, which [`ApiJson`] reads the body without.
fn is_json_content_type(headers: &http::HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .strip_prefix("application/")
            .is_some_and(|subtype| subtype.ends_with("+json"))
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        let text = match &rejection {
            QueryRejection::FailedToDeserializeQueryString(err) => {
                std::error::Error::source(err).map_or_else(|| err.body_text(), ToString::to_string)
            }
            other => other.body_text(),
        };
        Self::invalid(format!("invalid query string: {text}"))
    }
}

/// `Json<T>` whose rejections are [`ApiError`]s, so bad input gets the `{code, message}`
/// shape and a 400 (axum's own `Json` answers 422 in plain text). A body with a NUL character
/// in any string is refused (`400 invalid_argument`, see `nul_refused`) before it is
/// deserialized, so no route can hand one to the store.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        if !is_json_content_type(req.headers()) {
            return Err(missing_json_content_type());
        }
        let body = Bytes::from_request(req, state).await?;
        if json_has_nul(&body) {
            return Err(nul_refused("the request body"));
        }
        let Json(value) = Json::<T>::from_bytes(&body)?;
        Ok(Self(value))
    }
}

/// `Path<T>` whose rejections are [`ApiError`]s (axum's own answers plain text, e.g.
/// `Invalid URL: …` for a percent-encoded id that is not UTF-8), and which refuses a NUL
/// character in any parameter with `400 invalid_argument` (see `nul_refused`).
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiPath<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        let raw = RawPathParams::from_request_parts(parts, state).await?;
        if let Some((key, _)) = raw.iter().find(|(_, value)| value.contains('\0')) {
            return Err(nul_refused(&format!("path parameter `{key}`")));
        }
        let Path(value) = Path::<T>::from_request_parts(parts, state).await?;
        Ok(Self(value))
    }
}

impl<T: Serialize> IntoResponse for ApiJson<T> {
    fn into_response(self) -> Response {
        Json(self.0).into_response()
    }
}

/// `Query<T>` whose rejections are [`ApiError`]s, refusing a NUL character (`%00`) in any
/// parameter with `400 invalid_argument` (see `nul_refused`).
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiQuery<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        // Decoded once as plain pairs to find a NUL (`%00`) in any name or value.
        let pairs: Query<Vec<(String, String)>> = Query::try_from_uri(&parts.uri)?;
        if let Some((name, _)) = pairs
            .0
            .iter()
            .find(|(name, value)| name.contains('\0') || value.contains('\0'))
        {
            return Err(nul_refused(&format!(
                "query parameter `{}`",
                name.escape_debug()
            )));
        }
        let Query(value) = Query::<T>::from_request_parts(parts, state).await?;
        Ok(Self(value))
    }
}

/// How much of a foreign refusal's body [`finish_errors`] reads for its message.
const FOREIGN_TEXT_MAX: usize = 1024;

/// Middleware giving every refusal, whatever layer made it, the one error shape with the
/// request's id: an [`ApiError`] is rendered again with `request_id`; any other `4xx`/`5xx`
/// (a layer's bare status or plain text) becomes the [`ApiError`] of its status
/// (`ApiError::from_foreign`). The first answer's headers (`Allow`, `Retry-After`, …) and
/// extensions are kept. Runs inside [`crate::request_id`]'s layers, which set the header.
pub async fn finish_errors(request: Request, next: Next) -> Response {
    let request_id = crate::request_id::of(request.headers()).map(str::to_owned);
    let response = next.run(request).await;
    let status = response.status();
    if !status.is_client_error() && !status.is_server_error() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let error = match parts.extensions.remove::<ApiError>() {
        Some(error) => error,
        None => {
            let is_text = parts
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_none_or(|v| v.starts_with("text/plain"));
            let bytes = axum::body::to_bytes(body, FOREIGN_TEXT_MAX)
                .await
                .unwrap_or_default();
            let text = if is_text {
                String::from_utf8_lossy(&bytes).into_owned()
            } else {
                String::new()
            };
            tracing::debug!(status = status.as_u16(), %text, "refusal of another layer put in the error shape");
            ApiError::from_foreign(status, &text)
        }
    };
    let (mut fresh, body) = error.render(request_id.as_deref()).into_parts();
    fresh.extensions.remove::<ApiError>();
    for name in parts.headers.keys() {
        if name != header::CONTENT_TYPE
            && name != header::CONTENT_LENGTH
            && !fresh.headers.contains_key(name)
        {
            for value in parts.headers.get_all(name) {
                fresh.headers.append(name.clone(), value.clone());
            }
        }
    }
    parts.extensions.extend(fresh.extensions);
    fresh.extensions = parts.extensions;
    Response::from_parts(fresh, body)
}

/// Middleware logging the hidden cause of every error response (see [`ErrorDetail`]), so a
/// 500 can be traced to its reason without showing that reason to the client.
pub async fn log_error_details(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    if let Some(ErrorDetail { code, detail }) = response.extensions().get::<ErrorDetail>() {
        let status = response.status().as_u16();
        if *code == ErrorCode::Internal {
            tracing::error!(%method, %path, status, code = %code, error = %detail, "request failed");
        } else {
            tracing::warn!(%method, %path, status, code = %code, error = %detail, "request failed");
        }
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_json(response: Response) -> serde_json::Value {
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test]
    async fn status_and_body_come_from_the_code() {
        let response = ApiError::not_found("run r1 not found").into_response();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_eq!(
            body_json(response).await,
            serde_json::json!({"code": "not_found", "message": "run r1 not found"})
        );
    }

    #[tokio::test]
    async fn internal_errors_hide_their_detail() {
        let response = ApiError::internal("connection to db at 10.0.0.3 refused").into_response();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let detail = response.extensions().get::<ErrorDetail>().cloned().unwrap();
        assert!(detail.detail.contains("10.0.0.3"));
        let body = body_json(response).await;
        assert_eq!(body["code"], "internal");
        assert!(!body["message"].as_str().unwrap().contains("10.0.0.3"));
    }

    #[tokio::test]
    async fn unavailable_dependencies_are_generic_and_retryable() {
        let response =
            ApiError::from(BusError::Unavailable("amqp://secret@host".into())).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        let body = body_json(response).await;
        assert_eq!(body["code"], "unavailable");
        assert!(!body["message"].as_str().unwrap().contains("secret"));
    }

    #[tokio::test]
    async fn runner_errors_carry_retryable_and_details() {
        let error = AgentApiError::new(ErrorCode::RateLimited, "slow down").with_detail("limit", 5);
        let response = ApiError::from_agent(error).into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            body_json(response).await,
            serde_json::json!({"code": "rate_limited", "message": "slow down", "retryable": true, "details": {"limit": 5}})
        );
        let response = ApiError::not_found("gone").for_runner().into_response();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_eq!(
            body_json(response).await,
            serde_json::json!({"code": "not_found", "message": "gone", "retryable": false, "details": {}})
        );
        // an unknown code from a provider counts as runtime_error (502)
        let error = AgentApiError {
            code: "flux_capacitor".into(),
            message: "x".into(),
            retryable: false,
            details: Map::new(),
        };
        assert_eq!(
            ApiError::from_agent(error).into_response().status(),
            StatusCode::BAD_GATEWAY
        );
    }

    #[tokio::test]
    async fn rate_limits_say_how_long_to_wait_in_whole_seconds() {
        for (wait, header) in [
            (Duration::ZERO, "1"),
            (Duration::from_millis(1), "1"),
            (Duration::from_millis(1000), "1"),
            (Duration::from_millis(1001), "2"),
            (Duration::from_secs(7), "7"),
        ] {
            let response = ApiError::rate_limited("slow down", wait).into_response();
            assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(response.headers()[header::RETRY_AFTER], header, "{wait:?}");
            assert_eq!(body_json(response).await["code"], "rate_limited");
        }
    }

    #[tokio::test]
    async fn a_client_key_on_an_admin_route_is_permission_denied() {
        let response = ApiError::permission_denied("creating agents").into_response();
        assert_eq!(response.status(), StatusCode::FORBIDDEN);
        assert!(response.headers().get(header::RETRY_AFTER).is_none());
        let body = body_json(response).await;
        assert_eq!(body["code"], "permission_denied");
        assert!(
            body["message"].as_str().unwrap().contains("admin"),
            "{body}"
        );
    }

    #[test]
    fn nul_is_found_in_json_escapes_only() {
        assert!(json_has_nul(br#"{"input": {"text": "a\u0000b"}}"#));
        assert!(json_has_nul(b"{\"a\": \"\0\"}"));
        assert!(
            json_has_nul(br#"["\\\u0000"]"#),
            "an escaped backslash, then NUL"
        );
        assert!(
            !json_has_nul(br#"["\\u0000"]"#),
            "a backslash, then the text u0000"
        );
        assert!(!json_has_nul(br#"{"a": "\u0001 \n \"u0000\""}"#));
        assert!(!json_has_nul(b"\\"), "a trailing backslash");
    }

    #[test]
    fn json_content_types() {
        let with = |value: &'static str| {
            let mut headers = http::HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(value));
            is_json_content_type(&headers)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(with("application/problem+json"));
        assert!(!with("text/plain"));
        assert!(!with("application/jsonx"));
        assert!(!is_json_content_type(&http::HeaderMap::new()));
    }

    /// A router with the gateway's error finishing and request-id layers around `routes`.
    fn finished(routes: axum::Router) -> axum::Router {
        use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
        routes
            .layer(axum::middleware::from_fn(finish_errors))
            .layer(PropagateRequestIdLayer::new(crate::request_id::HEADER))
            .layer(SetRequestIdLayer::new(
                crate::request_id::HEADER,
                MakeRequestUuid,
            ))
    }

    async fn call(router: axum::Router, request: Request) -> (Response, serde_json::Value) {
        use tower::ServiceExt as _;
        let response = router.oneshot(request).await.unwrap();
        let (parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        let body = serde_json::from_slice(&bytes).unwrap();
        (Response::from_parts(parts, axum::body::Body::empty()), body)
    }

    #[tokio::test]
    async fn every_refusal_carries_the_request_id_of_its_header() {
        use axum::routing::{get, post};
        let router = finished(
            axum::Router::new()
                .route(
                    "/limited",
                    get(|| async { ApiError::rate_limited("slow down", Duration::from_secs(3)) }),
                )
                // axum's own `Json` answers plain text: a foreign refusal
                .route(
                    "/foreign",
                    post(|Json(v): Json<Value>| async move { Json(v) }),
                ),
        );
        let request = Request::get("/limited")
            .header("x-request-id", "req-1")
            .body(axum::body::Body::empty())
            .unwrap();
        let (response, body) = call(router.clone(), request).await;
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "3", "headers kept");
        assert_eq!(response.headers()["x-request-id"], "req-1");
        assert_eq!(
            body,
            serde_json::json!({"code": "rate_limited", "message": "slow down", "request_id": "req-1"})
        );

        let request = Request::post("/foreign")
            .body(axum::body::Body::from("{}"))
            .unwrap();
        let (response, body) = call(router, request).await;
        assert_eq!(
            response.status(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "status kept"
        );
        assert_eq!(body["code"], "invalid_argument");
        assert!(
            body["message"].as_str().unwrap().contains("Content-Type"),
            "{body}"
        );
        assert_eq!(
            body["request_id"].as_str().unwrap(),
            response.headers()["x-request-id"].to_str().unwrap()
        );
    }

    #[test]
    fn foreign_statuses_keep_their_status_and_get_the_code_of_their_meaning() {
        for (status, code) in [
            (404, ErrorCode::NotFound),
            (405, ErrorCode::InvalidArgument),
            (408, ErrorCode::DeadlineExceeded),
            (414, ErrorCode::PayloadTooLarge),
            (415, ErrorCode::InvalidArgument),
            (431, ErrorCode::PayloadTooLarge),
            (500, ErrorCode::Internal),
            (503, ErrorCode::Unavailable),
        ] {
            let status = StatusCode::from_u16(status).unwrap();
            let error = ApiError::from_foreign(status, "db at 10.0.0.3 said no");
            assert_eq!(error.status(), status);
            assert_eq!(error.code(), code, "{status}");
            assert_eq!(
                error.message().contains("10.0.0.3"),
                !status.is_server_error(),
                "a 5xx's text is only logged: {status}"
            );
        }
        assert_eq!(
            ApiError::from_foreign(StatusCode::BAD_REQUEST, "").message(),
            "bad request"
        );
    }

    #[tokio::test]
    async fn unauthorized_asks_for_a_bearer_token() {
        let response = ApiError::unauthorized().into_response();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(response.headers()[header::WWW_AUTHENTICATE], "Bearer");
        assert_eq!(body_json(response).await["code"], "unauthorized");
    }
}
