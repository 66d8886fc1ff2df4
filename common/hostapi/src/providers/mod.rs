//! Clients of the providers behind the model and tool actions: OpenAI-compatible chat
//! completions (plain and SSE streaming), a Cohere/Jina-style `/rerank`, and HTTP tools.
//!
//! Secrets: API keys and tool header values are read from the environment variables the
//! registry names, at call time, only when the deployment's `secrets.allow` lists the name
//! ([`SecretPolicy`]), and only ever placed in request headers. No error message,
//! log line or answer contains a header value or a provider response body (a provider or
//! tool could echo a request header back), only status codes and our own wording.
//!
//! Egress: every call goes through [`ProviderClient`], which checks the URL against the
//! deployment's [`EgressPolicy`] before sending, and whose resolver drops every resolved
//! address the policy refuses (so a name that rebinds to loopback after registration reaches
//! nothing). Redirects are not followed (a `3xx` is an error status), and no proxy from the
//! environment is used, so the address checked is the address connected to.
//!
//! Retries: model calls are retried with exponential backoff on `429`, `5xx` and connection
//! failures, at most [`ProviderOptions::max_attempts`] times (`providers.max_attempts`), and
//! a stream only before its first chunk was forwarded. Tool calls are never retried: a tool
//! may have side effects, and `call_tool` promises at-most-once execution.
//!
//! Time: nothing here waits without a bound. Connecting is bounded by
//! [`ProviderOptions::connect_timeout`] (the client [`ProviderClient::new`] builds); every
//! attempt of a model call, the opening of a stream included, gets its response headers within
//! [`ProviderOptions::model_timeout`] and before the run's deadline; a retry whose backoff
//! would end after the deadline is not attempted ([`ProviderError::OutOfTime`]).
//!
//! # Layout
//! - this file: [`ProviderOptions`], [`ProviderClient`] (egress and secrets), [`ProviderError`]
//!   and its code mapping, the shared request sending with retries.
//! - `openai`: chat completions (plain and streaming) and rerank.
//! - `http_tool`: HTTP tools (POST JSON, timeout, response cap, headers from env vars).

pub mod http_tool;
pub mod openai;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use sb_common::config::{ProvidersConfig, SwitchboardConfig};
use sb_common::egress::{EgressError, EgressPolicy};
use sb_common::retry::RetryPolicy;
use sb_common::secrets::{SecretError, SecretPolicy};
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
    /// Where calls may go (`egress.allow`); default: public addresses only.
    pub egress: EgressPolicy,
    /// Which secrets models and tools may reference (`secrets.allow`); default: none.
    pub secrets: SecretPolicy,
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
    ///
    /// The egress and secret policies stay the strictest ones; [`ProviderOptions::of`]
    /// takes them from the deployment.
    #[must_use]
    pub fn from_config(providers: &ProvidersConfig) -> Self {
        Self {
            model_timeout: providers.model_timeout,
            stream_idle_timeout: providers.stream_idle_timeout,
            max_attempts: providers.max_attempts.get(),
            backoff_base: providers.retry_backoff,
            max_model_response_bytes: providers.max_response_bytes.get(),
            connect_timeout: providers.connect_timeout,
            egress: EgressPolicy::public_only(),
            secrets: SecretPolicy::default(),
        }
    }

    /// The options of a deployment: its `[providers]` section, `egress.allow` and
    /// `secrets.allow`.
    #[must_use]
    pub fn of(config: &SwitchboardConfig) -> Self {
        Self {
            egress: EgressPolicy::from_config(&config.egress),
            secrets: SecretPolicy::from_config(&config.secrets),
            ..Self::from_config(&config.providers)
        }
    }
}

/// The HTTP client of the model and tool providers, bound to the egress and secret
/// policies of the deployment.
///
/// # Contract
///
/// - `ProviderClient::post` is the only way to build a request: it refuses a URL the
///   egress policy refuses (scheme, credentials, an IP literal in a denied range), and the
///   client's resolver keeps only the resolved addresses the policy allows.
/// - Redirects are never followed and environment proxies never used.
/// - `ProviderClient::secret` returns a value only for a name in `secrets.allow`.
#[derive(Clone, Debug)]
pub struct ProviderClient {
    http: reqwest::Client,
    egress: Arc<EgressPolicy>,
    secrets: Arc<SecretPolicy>,
}

impl ProviderClient {
    /// A client with `options.connect_timeout` and the options' policies (rustls, as the
    /// workspace builds reqwest).
    ///
    /// # Panics
    ///
    /// When the TLS backend cannot be initialized, as `reqwest::Client::new` does: nothing
    /// the configuration can cause, and no provider call could be made without it.
    #[must_use]
    pub fn new(options: &ProviderOptions) -> Self {
        let egress = Arc::new(options.egress.clone());
        let http = reqwest::Client::builder()
            .connect_timeout(options.connect_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .dns_resolver(Arc::new(EgressResolver {
                policy: egress.clone(),
            }))
            .build()
            .expect("the TLS backend of the provider client initializes");
        Self {
            http,
            egress,
            secrets: Arc::new(options.secrets.clone()),
        }
    }

    /// Refuses `url` when the egress policy does, on behalf of `what` (`model provider`,
    /// `tool <name>`).
    pub(crate) fn check(&self, what: &str, url: &str) -> Result<(), ProviderError> {
        // At call time the field is "the registered url" of `what`.
        self.egress
            .check_url("the registered url", url)
            .map(drop)
            .map_err(|e| ProviderError::Egress {
                what: what.to_owned(),
                error: e,
            })
    }

    /// A `POST` to `url` on behalf of `what`, if the egress policy allows the URL.
    pub(crate) fn post(
        &self,
        what: &str,
        url: &str,
    ) -> Result<reqwest::RequestBuilder, ProviderError> {
        self.check(what, url)?;
        Ok(self.http.post(url))
    }

    /// A `POST` to a URL already passed by [`ProviderClient::check`] (a retried request
    /// rebuilt per attempt).
    pub(crate) fn post_checked(&self, url: &str) -> reqwest::RequestBuilder {
        self.http.post(url)
    }

    /// The value of the secret `name`, if the deployment makes it available.
    pub(crate) fn secret(&self, name: &str) -> Result<String, ProviderError> {
        self.secrets.read(name).map_err(ProviderError::Secret)
    }
}

/// The resolver of [`ProviderClient`]: the system resolver, then only the addresses the
/// egress policy allows for that host. A host whose every address is refused fails to
/// connect with the [`EgressError`] as the cause (see [`ProviderError::from_reqwest`]).
struct EgressResolver {
    policy: Arc<EgressPolicy>,
}

impl reqwest::dns::Resolve for EgressResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let addrs: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let allowed = policy
                .check_resolved(
                    "the registered url",
                    &host,
                    addrs.iter().map(SocketAddr::ip),
                )
                .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)?;
            let allowed: Vec<SocketAddr> = addrs
                .into_iter()
                .filter(|a| allowed.contains(&a.ip()))
                .collect();
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// A provider call failed.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The secret named by the registry is not available (not allowed, or not set).
    #[error("{0}")]
    Secret(SecretError),
    /// The egress policy refuses the registered URL or every address it resolves to.
    #[error("{what} cannot be called: {error}")]
    Egress {
        /// `model provider` / `tool <name>`.
        what: String,
        /// The refusal.
        error: EgressError,
    },
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
            // An allowed secret that is not set is the operator's to fix (a deployment
            // error, retryable once fixed); a refused one is the registration's.
            Self::Secret(SecretError::Unset(_)) | Self::Transport(_) | Self::Config(_) => {
                ErrorCode::Unavailable
            }
            Self::Secret(_) | Self::Egress { .. } => ErrorCode::InvalidArgument,
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
        // The resolver's refusal arrives as a connect error; it is permanent, not a
        // provider that is down.
        let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
        while let Some(c) = cause {
            if let Some(refusal) = c.downcast_ref::<EgressError>() {
                return Self::Egress {
                    what: what.to_owned(),
                    error: refusal.clone(),
                };
            }
            cause = c.source();
        }
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
    // Doubling without a cap: `max_attempts` (and the deadline) bound the wait instead.
    let mut retry = RetryPolicy::new(options.backoff_base, Duration::MAX).start();
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
        let delay = retry.next_delay();
        if deadline.is_some_and(|at| Instant::now() + delay >= at) {
            return Err(ProviderError::OutOfTime {
                last: Box::new(err),
            });
        }
        tracing::debug!(attempt, error = %err, "provider call failed, retrying");
        tokio::time::sleep(delay).await;
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
                egress: EgressPolicy::public_only(),
                secrets: SecretPolicy::default(),
            }
        );
    }
}

#[cfg(test)]
mod egress_tests {
    use super::*;

    /// A one-route HTTP server on loopback: `/ok` answers 200, `/redirect` a 302 to `/ok`.
    async fn server() -> SocketAddr {
        use axum::Router;
        use axum::http::{StatusCode, header};
        use axum::routing::post;
        let app = Router::new().route("/ok", post(|| async { "fine" })).route(
            "/redirect",
            post(|| async { (StatusCode::FOUND, [(header::LOCATION, "/ok")]) }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    fn client(allow: &[&str]) -> ProviderClient {
        ProviderClient::new(&ProviderOptions {
            egress: EgressPolicy::from_config(&sb_common::config::EgressConfig {
                allow: allow.iter().map(|s| (*s).to_owned()).collect(),
            }),
            ..ProviderOptions::default()
        })
    }

    async fn send(client: &ProviderClient, url: &str) -> Result<u16, ProviderError> {
        let rb = client.post("tool t", url)?;
        let resp = rb
            .send()
            .await
            .map_err(|e| ProviderError::from_reqwest("tool t", &e))?;
        Ok(resp.status().as_u16())
    }

    #[tokio::test]
    async fn loopback_is_refused_by_literal_and_by_name_unless_allowed() {
        let addr = server().await;
        let strict = client(&[]);
        for url in [
            format!("http://127.0.0.1:{}/ok", addr.port()),
            format!("http://localhost:{}/ok", addr.port()),
            format!("http://[::ffff:127.0.0.1]:{}/ok", addr.port()),
        ] {
            let err = send(&strict, &url).await.unwrap_err();
            assert!(
                matches!(err, ProviderError::Egress { .. }),
                "{url}: {err:?}"
            );
            assert_eq!(err.code(), ErrorCode::InvalidArgument);
            assert!(!err.retryable());
        }
        let open = client(&["127.0.0.0/8"]);
        assert_eq!(
            send(&open, &format!("http://localhost:{}/ok", addr.port()))
                .await
                .unwrap(),
            200
        );
        assert_eq!(
            send(&open, &format!("http://127.0.0.1:{}/ok", addr.port()))
                .await
                .unwrap(),
            200
        );
    }

    #[tokio::test]
    async fn redirects_are_not_followed() {
        let addr = server().await;
        let open = client(&["127.0.0.0/8"]);
        assert_eq!(
            send(&open, &format!("http://127.0.0.1:{}/redirect", addr.port()))
                .await
                .unwrap(),
            302
        );
    }

    #[tokio::test]
    async fn metadata_and_credentials_are_refused_before_any_connection() {
        let any = client(&["0.0.0.0/0", "::/0"]);
        for url in [
            "http://169.254.169.254/latest/meta-data/iam/",
            "http://metadata.google.internal/computeMetadata/v1/",
            "http://user:pw@127.0.0.1:9/",
        ] {
            let err = send(&any, url).await.unwrap_err();
            assert!(
                matches!(err, ProviderError::Egress { .. }),
                "{url}: {err:?}"
            );
        }
    }

    #[test]
    fn secrets_come_only_from_the_allow_list() {
        let client = ProviderClient::new(&ProviderOptions {
            secrets: SecretPolicy::from_config(&sb_common::config::SecretsConfig {
                allow: vec!["PATH".into()],
            }),
            ..ProviderOptions::default()
        });
        assert!(client.secret("PATH").is_ok());
        for refused in ["HOME", "SWITCHBOARD__DATABASE__URL"] {
            let err = client.secret(refused).unwrap_err();
            assert_eq!(err.code(), ErrorCode::InvalidArgument, "{refused}");
        }
    }
}
