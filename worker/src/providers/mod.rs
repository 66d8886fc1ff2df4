//! Clients of the providers behind the model and tool actions: OpenAI-compatible chat
//! completions (plain and SSE streaming), a Cohere/Jina-style `/rerank`, and HTTP tools.
//!
//! Secrets: API keys and tool header values are read from the environment variables the
//! registry names, at call time, and only ever placed in request headers. No error message,
//! log line or answer contains a header value or a provider response body (a provider or
//! tool could echo a request header back), only status codes and our own wording.
//!
//! Retries: model calls are retried with exponential backoff on `429`, `5xx` and connection
//! failures, at most [`ProviderOptions::max_attempts`] times (`providers.max_attempts`), and
//! a stream only before its first chunk was forwarded. Tool calls are never retried: a tool
//! may have side effects, and `call_tool` promises at-most-once execution.
//!
//! Time: nothing here waits without a bound. Connecting is bounded by
//! [`ProviderOptions::connect_timeout`] (the client [`http_client`] builds); every attempt of
//! a model call, the opening of a stream included, gets its response headers within
//! [`ProviderOptions::model_timeout`] and before the run's deadline; a retry whose backoff
//! would end after the deadline is not attempted ([`ProviderError::OutOfTime`]).
//!
//! # Layout
//! - this file: [`ProviderOptions`], [`ProviderError`] and its code mapping, the shared
//!   request sending with retries.
//! - `openai`: chat completions (plain and streaming) and rerank.
//! - `http_tool`: HTTP tools (POST JSON, timeout, response cap, headers from env vars).

pub mod http_tool;
pub mod openai;

use std::time::Duration;

use sb_common::config::ProvidersConfig;
use sb_protocol::error::{ErrorCode, HasErrorCode};
use tokio::time::Instant;

/// Timeouts and retries of model provider calls, from the deployment's `[providers]`
/// section ([`ProviderOptions::from_config`]); the defaults and their reasons are
/// [`ProvidersConfig`]'s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderOptions {
    /// Whole-request timeout of one attempt of a non-streaming model call, and the time
    /// one attempt to open a stream may wait for the response headers (both also bounded
    /// by the run deadline); `providers.model_timeout`.
    pub model_timeout: Duration,
    /// Longest silence between two chunks of a stream; `providers.stream_idle_timeout`.
    pub stream_idle_timeout: Duration,
    /// Attempts of a model call (1 = no retry); `providers.max_attempts`.
    pub max_attempts: u32,
    /// First retry delay, doubled per attempt; `providers.retry_backoff`.
    pub backoff_base: Duration,
    /// Largest model response body read (non-streaming), in bytes;
    /// `providers.max_response_bytes`.
    pub max_model_response_bytes: usize,
    /// Connect timeout of the provider HTTP client, models and tools alike;
    /// `providers.connect_timeout`.
    pub connect_timeout: Duration,
}

impl Default for ProviderOptions {
    fn default() -> Self {
        Self::from_config(&ProvidersConfig::default())
    }
}

impl ProviderOptions {
    /// The options of the deployment's `[providers]` section. Every place that builds an
    /// [`ActionDispatcher`](crate::actions::ActionDispatcher) from the configuration (the
    /// worker, the gateway's remote Host API) passes them on, so both serve model calls alike.
    #[must_use]
    pub fn from_config(providers: &ProvidersConfig) -> Self {
        Self {
            model_timeout: providers.model_timeout,
            stream_idle_timeout: providers.stream_idle_timeout,
            max_attempts: providers.max_attempts.get(),
            backoff_base: providers.retry_backoff,
            max_model_response_bytes: providers.max_response_bytes.get(),
            connect_timeout: providers.connect_timeout,
        }
    }
}

/// The HTTP client of the model and tool providers (rustls, as the workspace builds
/// reqwest), with `connect_timeout`.
///
/// # Panics
///
/// When the TLS backend cannot be initialized, as `reqwest::Client::new` does: nothing the
/// configuration can cause, and no provider call could be made without it.
#[must_use]
pub fn http_client(connect_timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(connect_timeout)
        .build()
        .expect("the TLS backend of the provider client initializes")
}

/// A provider call failed.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The environment variable named by the registry is not set (a deployment error).
    #[error("environment variable {0} is not set on this worker")]
    MissingEnv(String),
    /// The provider answered an error status.
    #[error("{what} answered http {status}")]
    Status {
        /// `model provider` / `tool <name>`.
        what: String,
        /// The HTTP status.
        status: u16,
    },
    /// No answer in time.
    #[error("{0} timed out")]
    Timeout(String),
    /// Could not connect or the connection broke.
    #[error("{0} is unreachable")]
    Transport(String),
    /// The answer is not what the protocol promises.
    #[error("{0}")]
    Malformed(String),
    /// The answer is over its size cap.
    #[error("{what} response is larger than {limit} bytes")]
    TooLarge {
        /// Who answered.
        what: String,
        /// The cap.
        limit: usize,
    },
    /// The registered configuration cannot be used.
    #[error("{0}")]
    Config(String),
    /// An attempt failed with a retryable error, but the backoff before the next one would
    /// end after the run's deadline: the call has run out of run time.
    #[error("{last}; no time is left before the run deadline to retry")]
    OutOfTime {
        /// The failure of the last attempt.
        last: Box<ProviderError>,
    },
}

impl HasErrorCode for ProviderError {
    fn code(&self) -> ErrorCode {
        match self {
            Self::MissingEnv(_) | Self::Transport(_) | Self::Config(_) => ErrorCode::Unavailable,
            Self::Status { status: 429, .. } => ErrorCode::RateLimited,
            Self::Status { status, .. } if *status >= 500 => ErrorCode::Unavailable,
            Self::Status { status: 408, .. } | Self::Timeout(_) | Self::OutOfTime { .. } => {
                ErrorCode::DeadlineExceeded
            }
            Self::Status { status: 413, .. } | Self::TooLarge { .. } => ErrorCode::PayloadTooLarge,
            Self::Status {
                status: 400 | 422, ..
            } => ErrorCode::InvalidArgument,
            Self::Status { .. } | Self::Malformed(_) => ErrorCode::RuntimeError,
        }
    }
}

impl ProviderError {
    /// Whether a model call may be retried.
    fn retryable(&self) -> bool {
        matches!(self, Self::Transport(_))
            || matches!(self, Self::Status { status, .. } if *status == 429 || *status >= 500)
    }

    fn from_reqwest(what: &str, e: &reqwest::Error) -> Self {
        // A connect timeout is also a timeout to reqwest; it is a provider we cannot reach
        // (retryable), not a call that took too long.
        if e.is_connect() {
            Self::Transport(what.to_owned())
        } else if e.is_timeout() {
            Self::Timeout(what.to_owned())
        } else if e.is_decode() || e.is_body() {
            Self::Malformed(format!("{what} sent an unreadable body"))
        } else {
            // `reqwest::Error`'s Display can include the URL; the URL is registry data, not
            // a secret, but keep messages uniform and short.
            Self::Transport(what.to_owned())
        }
    }
}

/// Refuses URLs that are not `http` or `https` (rustls with the webpki roots), so a typo in
/// the registry fails with a clear configuration error instead of a vague transport one.
pub(crate) fn check_url(what: &str, url: &str) -> Result<(), ProviderError> {
    if url.starts_with("http://") || url.starts_with("https://") {
        Ok(())
    } else {
        Err(ProviderError::Config(format!("{what} has an invalid url")))
    }
}

/// Reads the value of the environment variable `name`.
pub(crate) fn env_value(name: &str) -> Result<String, ProviderError> {
    std::env::var(name).map_err(|_| ProviderError::MissingEnv(name.to_owned()))
}

/// `limit`, cut to the time left before `deadline` (the run's), if any. At least 1 ms: a
/// zero timer would not fire before the request is first polled, and a call whose
/// deadline has passed must fail at once, not wait.
pub(crate) fn attempt_limit(limit: Duration, deadline: Option<Instant>) -> Duration {
    deadline.map_or(limit, |at| {
        limit
            .min(at.saturating_duration_since(Instant::now()))
            .max(Duration::from_millis(1))
    })
}

/// Sends the request `build` makes, retrying per [`ProviderOptions`] on retryable
/// failures. Returns the first successful (`2xx`) response.
///
/// Each attempt waits for the response headers at most [`ProviderOptions::model_timeout`]
/// and never past `deadline` (the run's), then fails with [`ProviderError::Timeout`]; this
/// is what bounds the opening of a stream, whose request has no whole-request timeout. A
/// retry whose backoff would end at or after `deadline` is not attempted: the call fails
/// with [`ProviderError::OutOfTime`], carrying the last failure.
pub(crate) async fn send_with_retries(
    options: &ProviderOptions,
    what: &str,
    deadline: Option<Instant>,
    build: impl Fn() -> reqwest::RequestBuilder,
) -> Result<reqwest::Response, ProviderError> {
    let attempts = options.max_attempts.max(1);
    let mut delay = options.backoff_base;
    let mut attempt = 1;
    loop {
        let limit = attempt_limit(options.model_timeout, deadline);
        let err = match tokio::time::timeout(limit, build().send()).await {
            Err(_) => ProviderError::Timeout(what.to_owned()),
            Ok(Ok(resp)) if resp.status().is_success() => return Ok(resp),
            Ok(Ok(resp)) => ProviderError::Status {
                what: what.to_owned(),
                status: resp.status().as_u16(),
            },
            Ok(Err(e)) => ProviderError::from_reqwest(what, &e),
        };
        if attempt >= attempts || !err.retryable() {
            return Err(err);
        }
        if deadline.is_some_and(|at| Instant::now() + delay >= at) {
            return Err(ProviderError::OutOfTime {
                last: Box::new(err),
            });
        }
        tracing::debug!(attempt, error = %err, "provider call failed, retrying");
        tokio::time::sleep(delay).await;
        delay = delay.saturating_mul(2);
        attempt += 1;
    }
}

/// Reads a response body up to `limit` bytes.
pub(crate) async fn read_capped(
    mut resp: reqwest::Response,
    what: &str,
    limit: usize,
) -> Result<Vec<u8>, ProviderError> {
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| ProviderError::from_reqwest(what, &e))?
    {
        if body.len() + chunk.len() > limit {
            return Err(ProviderError::TooLarge {
                what: what.to_owned(),
                limit,
            });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_codes() {
        let s = |status| ProviderError::Status {
            what: "m".into(),
            status,
        };
        assert_eq!(s(429).code(), ErrorCode::RateLimited);
        assert_eq!(s(503).code(), ErrorCode::Unavailable);
        assert_eq!(s(400).code(), ErrorCode::InvalidArgument);
        assert_eq!(s(401).code(), ErrorCode::RuntimeError);
        assert_eq!(
            ProviderError::Timeout("m".into()).code(),
            ErrorCode::DeadlineExceeded
        );
        assert!(s(500).retryable() && s(429).retryable() && !s(400).retryable());
        let out_of_time = ProviderError::OutOfTime {
            last: Box::new(s(503)),
        };
        assert_eq!(out_of_time.code(), ErrorCode::DeadlineExceeded);
        assert!(!out_of_time.retryable());
        assert_eq!(
            out_of_time.to_string(),
            "m answered http 503; no time is left before the run deadline to retry"
        );
    }

    #[test]
    fn options_come_from_the_providers_section() {
        let config = sb_common::config::ConfigLoader::new()
            .without_file()
            .set("providers.model_timeout", "7s")
            .set("providers.stream_idle_timeout", "3s")
            .set("providers.max_attempts", "6")
            .set("providers.retry_backoff", "20ms")
            .set("providers.max_response_bytes", "4096")
            .set("providers.connect_timeout", "2s")
            .load()
            .unwrap();
        assert_eq!(
            ProviderOptions::from_config(&config.providers),
            ProviderOptions {
                model_timeout: Duration::from_secs(7),
                stream_idle_timeout: Duration::from_secs(3),
                max_attempts: 6,
                backoff_base: Duration::from_millis(20),
                max_model_response_bytes: 4096,
                connect_timeout: Duration::from_secs(2),
            }
        );
    }
}

#[cfg(test)]
mod url_tests {
    use super::check_url;

    #[test]
    fn http_and_https_are_reachable_other_schemes_are_not() {
        assert!(check_url("model", "http://127.0.0.1:9/v1").is_ok());
        assert!(check_url("model", "https://api.example.com/v1").is_ok());
        assert!(check_url("model", "ftp://example.com").is_err());
        assert!(check_url("model", "api.example.com").is_err());
    }
}
