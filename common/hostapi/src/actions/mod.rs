//! The Host API actions served to runner processes (SPEC §8, PROTOCOL_V1 §8,
//! host-behaviour §22 and Appendix A): [`ActionDispatcher`], the [`Dispatcher`] behind the
//! [`ApiGate`](crate::api_gate::ApiGate).
//!
//! The gate has already done steps 1–3 of SPEC §8 (session exists, caller identity, deadline).
//! Every action here then runs the remaining steps **in this order**, and only then acts:
//!
//! ```text
//!  4. grant    API flag in snapshot.available_apis, or resource id + operation in
//!              snapshot.resources (storage: resources.storage)          → unauthorized
//!  5. scope    conversation / bot / workspace / thread of the run        → unauthorized
//!  6. args     required keys, types, cursors, limits clamped to [1, 100],
//!              offsets ≥ 0                                                → invalid_argument
//!  7. budget   request size, value caps (state 256 KiB, storage 10 MiB)   → payload_too_large
//!              per-run rate limit, counted atomically in the session store → rate_limited
//!     action   the store call; its own refusals (missing row, CAS lost,
//!              bad cursor) keep their codes (not_found, conflict, invalid_argument)
//! ```
//!
//! Two refinements of that order, both forced by where the information lives:
//! - For `event_get`, `artifact_metadata` and `artifact_read` the scope belongs to the row
//!   (its conversation, bot, thread, creating run), so step 5 runs after the row is loaded;
//!   the rate limit has already counted the call by then, which is what keeps a runner from
//!   probing ids at database speed.
//! - Cursors are opaque, tagged store positions (`sb_store::page`), so only the store can
//!   tell a bad one; it answers `invalid_argument` after the call was admitted.
//!
//! Every answer is a structured [`AgentApiError`] on failure. Every call is logged with its
//! `run_id` (the dispatch span), and every refusal is an audit event on the tracing target
//! [`AUDIT_TARGET`] with the run, runner, action, resource and code (PROTOCOL_V1 §11).
//!
//! Model, tool and knowledge actions are served from the workspace resource registry
//! through [`crate::providers`], under the run's budgets (`budgets`); prompt and config-file
//! actions have no provider yet and answer a granted call with `not_found`.
//!
//! # Layout
//! - this file: [`ActionDispatcher`], [`ActionLimits`], the dispatch over the protocol's
//!   [`Action`] vocabulary, and the shared step-7 admission and audit logging.
//! - `params`: typed access to the `params` object with `invalid_argument` errors.
//! - `history`: `history_page`, `history_search`, and the conversation rule shared with
//!   event pages.
//! - `events`: `event_get`, `event_page`.
//! - `artifacts`: `artifact_metadata`, `artifact_read` and the access matrix.
//! - `state`: `state_get/set/delete/list` on the deterministic scope keys of
//!   `sb_protocol::state_keys`.
//! - `storage`: plugin / workspace binary storage (`storage_*`, seed aliases `*_binary_storage*`).
//! - `steering`: `steering_pull` and its `steering.injected` audit rows.
//! - `resources`: model, tool, knowledge, prompt and config-file actions.
//! - `budgets`: per-run budgets and `call_tool` idempotency in the session store.

mod artifacts;
mod budgets;
mod events;
mod history;
mod params;
mod resources;
mod state;
mod steering;
mod storage;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sb_common::config::LimitsConfig;
use sb_common::session::SessionStore;
use sb_protocol::action::Action;
use sb_protocol::error::{AgentApiError, ErrorCode, HasErrorCode};
use sb_store::{StoreError, Stores};
use serde_json::{Value, json};

use crate::api::{ApiStream, Dispatcher, GatedCall, host_version};
use crate::providers::{ProviderClient, ProviderOptions};
use params::Params;

/// Tracing target of the Host API audit events (refusals and host failures): the one audit
/// target of every role.
pub const AUDIT_TARGET: &str = sb_store::audit::LOG_TARGET;

/// A per-run call rate: at most `max_calls` admitted calls in any fixed window of `window`
/// that starts with the first call (the session store's `rate_limit_hit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Calls admitted per window.
    pub max_calls: u32,
    /// Window length.
    pub window: Duration,
}

impl RateLimit {
    /// The fixed window equivalent to a token bucket of `burst` tokens refilled at
    /// `per_second`: a window of `burst / per_second` seconds admitting `burst` calls keeps
    /// the long-run rate at `per_second` and one burst at `burst` (two adjacent windows can
    /// admit up to `2 × burst` around their boundary — the price of one atomic counter).
    #[must_use]
    pub fn from_bucket(per_second: u32, burst: u32) -> Self {
        let per_second = per_second.max(1);
        let burst = burst.max(1);
        Self {
            max_calls: burst,
            window: Duration::from_secs_f64(f64::from(burst) / f64::from(per_second)),
        }
    }
}

/// The limits the actions enforce. Build from the deployment's `[limits]` with
/// [`ActionLimits::from_config`]; tests tighten fields directly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionLimits {
    /// Largest `params` object of a call, as compact JSON bytes (storage writes are allowed
    /// their value cap on top). Default 1 MiB: four times the largest state value, far above
    /// any paging or search request.
    pub max_request_bytes: usize,
    /// Largest state value, as UTF-8 JSON (default 256 KiB).
    pub state_value_bytes: usize,
    /// Largest plugin/workspace storage value, decoded bytes (default 10 MiB).
    pub storage_value_bytes: usize,
    /// Bytes an artifact read returns without a `limit` (default 1 MiB).
    pub artifact_read_default_bytes: u64,
    /// Largest artifact read (default 10 MiB).
    pub artifact_read_max_bytes: u64,
    /// Page size of history and event pages without a `limit` (default 50).
    pub page_size_default: u64,
    /// Page size of state listings without a `limit` (default 100).
    pub state_page_size_default: u64,
    /// Largest page, also the cap of `history_search.top_k` (default 100).
    pub page_size_max: u64,
    /// `history_search.top_k` without one (default 10).
    pub search_top_k_default: u64,
    /// Most steering items one pull returns (default 100).
    pub steering_pull_max: u64,
    /// Most documents one `invoke_rerank` call may send (default 64, host-behaviour §22.2);
    /// `limits.rerank_documents_max`.
    pub rerank_documents_max: usize,
    /// Per-run call rate; `None` disables the limit.
    pub rate_limit: Option<RateLimit>,
    /// Most one HTTP tool call waits, whatever the tool was registered with (default
    /// 120 s); `limits.tool_timeout_max`.
    pub tool_timeout_max: Duration,
    /// Most of an HTTP tool's answer that is read, whatever the tool was registered with
    /// (default 16 MiB); `limits.tool_response_bytes_max`.
    pub tool_response_bytes_max: usize,
}

/// Default largest request: see [`ActionLimits::max_request_bytes`].
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 1024 * 1024;

impl Default for ActionLimits {
    fn default() -> Self {
        Self::from_config(&LimitsConfig::default())
    }
}

impl ActionLimits {
    /// The limits of the deployment's `[limits]` section (SPEC §13).
    #[must_use]
    pub fn from_config(limits: &LimitsConfig) -> Self {
        Self {
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            state_value_bytes: limits.state_value_bytes.get(),
            storage_value_bytes: limits.storage_value_bytes.get(),
            artifact_read_default_bytes: limits.artifact_read_default_bytes.get() as u64,
            artifact_read_max_bytes: limits.artifact_read_max_bytes.get() as u64,
            page_size_default: u64::from(limits.page_size_default.get()),
            state_page_size_default: u64::from(limits.state_page_size_default.get()),
            page_size_max: u64::from(limits.page_size_max.get()),
            search_top_k_default: sb_store::transcript::DEFAULT_SEARCH_TOP_K,
            steering_pull_max: u64::from(limits.steering_pull_max.get()),
            rerank_documents_max: usize::try_from(limits.rerank_documents_max.get())
                .unwrap_or(usize::MAX),
            rate_limit: limits
                .proxy_calls_per_second
                .map(|rate| RateLimit::from_bucket(rate.get(), limits.proxy_calls_burst.get())),
            tool_timeout_max: limits.tool_timeout_max,
            tool_response_bytes_max: limits.tool_response_bytes_max.get(),
        }
    }
}

/// Serves the Host API actions against the stores and the session store, behind the gate.
#[derive(Clone)]
pub struct ActionDispatcher {
    stores: Stores,
    sessions: Arc<dyn SessionStore>,
    limits: ActionLimits,
    providers: Providers,
}

/// The HTTP client and options of the model and tool providers.
#[derive(Clone, Debug)]
pub(crate) struct Providers {
    pub(crate) client: ProviderClient,
    pub(crate) options: ProviderOptions,
}

impl std::fmt::Debug for ActionDispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActionDispatcher")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl ActionDispatcher {
    /// A dispatcher over `stores` (history, events, artifacts, state, storage) and
    /// `sessions` (steering lists, rate counters), with the default provider options.
    ///
    /// # Panics
    ///
    /// When the TLS backend of the provider client cannot be initialized (see
    /// [`ProviderClient::new`]).
    #[must_use]
    pub fn new(stores: Stores, sessions: Arc<dyn SessionStore>, limits: ActionLimits) -> Self {
        let options = ProviderOptions::default();
        Self {
            stores,
            sessions,
            limits,
            providers: Providers {
                client: ProviderClient::new(&options),
                options,
            },
        }
    }

    /// The same dispatcher with other provider timeouts, retries and policies. The provider
    /// client is rebuilt when the connect timeout or a policy changes (they are properties
    /// of the client).
    ///
    /// # Panics
    ///
    /// As [`ActionDispatcher::new`].
    #[must_use]
    pub fn with_provider_options(mut self, options: ProviderOptions) -> Self {
        if options.connect_timeout != self.providers.options.connect_timeout
            || options.egress != self.providers.options.egress
            || options.secrets != self.providers.options.secrets
        {
            self.providers.client = ProviderClient::new(&options);
        }
        self.providers.options = options;
        self
    }

    /// The limits in force.
    #[must_use]
    pub fn limits(&self) -> &ActionLimits {
        &self.limits
    }

    /// Steps 4–7 and the action.
    async fn serve(
        &self,
        action: Action,
        call: GatedCall<'_>,
        params: &Value,
        stream: &ApiStream,
    ) -> Result<Value, AgentApiError> {
        let p = Params::new(params)?;
        let cx = Cx {
            call,
            p: &p,
            request_bytes: json_len(params),
            stream: Some(stream),
        };
        match action {
            Action::HistoryPage => self.history_page(&cx).await,
            Action::HistorySearch => self.history_search(&cx).await,
            Action::EventGet => self.event_get(&cx).await,
            Action::EventPage => self.event_page(&cx).await,
            Action::ArtifactMetadata => self.artifact_metadata(&cx).await,
            Action::ArtifactRead => self.artifact_read(&cx).await,
            Action::StateGet | Action::StateSet | Action::StateDelete | Action::StateList => {
                self.state(action, &cx).await
            }
            Action::StorageGet
            | Action::StorageSet
            | Action::StorageDelete
            | Action::StorageKeys => self.storage(action, &cx).await,
            Action::SteeringPull => self.steering_pull(&cx).await,
            Action::GetHostVersion => {
                self.admit(&cx).await?;
                Ok(host_version())
            }
            Action::Ping => {
                self.admit(&cx).await?;
                Ok(json!({}))
            }
            Action::InvokeLlm => self.invoke_llm(&cx, false).await,
            Action::InvokeLlmStream => self.invoke_llm(&cx, true).await,
            Action::InvokeRerank => self.invoke_rerank(&cx).await,
            Action::GetToolDetail => self.get_tool_detail(&cx).await,
            Action::CallTool => self.call_tool(&cx).await,
            Action::RetrieveKnowledge => self.retrieve_knowledge(&cx).await,
            Action::GetPrompt | Action::GetConfigFile => self.unprovided(action, &cx).await,
        }
    }

    /// Step 7 with the general request cap.
    async fn admit(&self, cx: &Cx<'_, '_>) -> Result<(), AgentApiError> {
        self.admit_with_cap(cx, self.limits.max_request_bytes).await
    }

    /// Step 7: the request size against `cap`, then the per-run rate limit. The rate counter
    /// lives in the session store, so all workers (and the gateway's remote Host API) share
    /// it and concurrent calls are counted atomically.
    async fn admit_with_cap(&self, cx: &Cx<'_, '_>, cap: usize) -> Result<(), AgentApiError> {
        if cx.request_bytes > cap {
            return Err(too_large(
                format!(
                    "request of {} bytes exceeds the limit of {cap} bytes",
                    cx.request_bytes
                ),
                cx.request_bytes,
                cap,
            ));
        }
        let Some(rate) = self.limits.rate_limit else {
            return Ok(());
        };
        match self
            .sessions
            .rate_limit_hit(&rate_key(cx.call.run_id), rate.max_calls, rate.window)
            .await
        {
            Ok(true) => Ok(()),
            Ok(false) => Err(AgentApiError::new(
                ErrorCode::RateLimited,
                format!(
                    "host api rate limit exceeded: at most {} calls per {} ms for this run",
                    rate.max_calls,
                    rate.window.as_millis()
                ),
            )
            .with_detail("limit", rate.max_calls)
            .with_detail(
                "window_ms",
                u64::try_from(rate.window.as_millis()).unwrap_or(u64::MAX),
            )),
            Err(error) => {
                tracing::warn!(%error, "rate limit counter unavailable");
                Err(AgentApiError::from_error(&error))
            }
        }
    }
}

/// One call being served: the gated call, its parsed params and its size.
pub(crate) struct Cx<'c, 'p> {
    call: GatedCall<'c>,
    p: &'p Params<'p>,
    request_bytes: usize,
    /// Where streamed parts of the answer go (`invoke_llm_stream`).
    stream: Option<&'p ApiStream>,
}

/// The session-store rate key of a run (the store adds its `rate:` family prefix).
fn rate_key(run_id: sb_protocol::ids::RunId) -> String {
    format!("host_api:{run_id}")
}

/// Size of `value` as compact JSON, without building the text.
fn json_len(value: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    match serde_json::to_writer(&mut count, value) {
        Ok(()) => count.0,
        Err(_) => usize::MAX,
    }
}

pub(crate) fn unauthorized(message: impl Into<String>) -> AgentApiError {
    AgentApiError::new(ErrorCode::Unauthorized, message)
}

pub(crate) fn not_found(message: impl Into<String>) -> AgentApiError {
    AgentApiError::new(ErrorCode::NotFound, message)
}

pub(crate) fn invalid(message: impl Into<String>) -> AgentApiError {
    AgentApiError::new(ErrorCode::InvalidArgument, message)
}

pub(crate) fn too_large(message: impl Into<String>, size: usize, limit: usize) -> AgentApiError {
    AgentApiError::new(ErrorCode::PayloadTooLarge, message)
        .with_detail("size", size)
        .with_detail("limit", limit)
}

/// A pull API whose `available_apis` flag is off (the seed's wording, lowercased).
pub(crate) fn api_not_granted(api_name: &str) -> AgentApiError {
    unauthorized(format!("{api_name} access not authorized"))
}

/// The one conversion of store failures into runner-visible errors. Expected outcomes keep
/// their messages; database failures are logged here and reach the runner as a generic
/// `internal` (or `unavailable`, retryable) error.
pub(crate) fn store_error(error: &StoreError) -> AgentApiError {
    if matches!(error.code(), ErrorCode::Internal | ErrorCode::Unavailable) {
        tracing::warn!(%error, "store failed during a host api call");
    }
    AgentApiError::from_error(error)
}

/// Serializes an answer. The proxy shapes always serialize; a failure would be a host bug.
pub(crate) fn answer<T: serde::Serialize>(data: &T) -> Result<Value, AgentApiError> {
    serde_json::to_value(data).map_err(|error| {
        tracing::error!(%error, "host api answer does not serialize");
        AgentApiError::new(ErrorCode::Internal, "internal host error")
    })
}

/// The main resource a call addresses, for the audit record.
fn resource_of(params: &Value) -> Option<String> {
    const KEYS: [&str; 11] = [
        "artifact_id",
        "event_id",
        "tool_name",
        "llm_model_uuid",
        "rerank_model_uuid",
        "model_id",
        "kb_id",
        "file_key",
        "owner_type",
        "scope",
        "conversation_id",
    ];
    KEYS.iter().find_map(|k| {
        params
            .get(*k)
            .and_then(Value::as_str)
            .map(|v| format!("{k}={v}"))
    })
}

fn audit(call: &GatedCall<'_>, params: &Value, outcome: &Result<Value, AgentApiError>) {
    let run_id = call.run_id;
    let runner_id = &call.caller.runner_id;
    let action = call.action;
    match outcome {
        Ok(_) => tracing::debug!(%run_id, %runner_id, action, "host api call served"),
        Err(error) => {
            let resource = resource_of(params);
            let resource = resource.as_deref().unwrap_or("");
            let code = error.code.as_str();
            if matches!(
                error.error_code(),
                Some(ErrorCode::Internal | ErrorCode::Unavailable)
            ) {
                tracing::warn!(
                    target: AUDIT_TARGET, audit = "host_api.failed", %run_id, %runner_id, action, resource, code,
                    message = %error.message, "host api call failed"
                );
            } else {
                tracing::info!(
                    target: AUDIT_TARGET, audit = "host_api.refused", %run_id, %runner_id, action, resource, code,
                    message = %error.message, "host api call refused"
                );
            }
        }
    }
}

#[async_trait]
impl Dispatcher for ActionDispatcher {
    #[tracing::instrument(name = "host_api", skip_all, fields(run_id = %call.run_id, action = call.action))]
    async fn dispatch(
        &self,
        call: GatedCall<'_>,
        params: Value,
        stream: &ApiStream,
    ) -> Result<Value, AgentApiError> {
        let outcome = match Action::parse(call.action) {
            Some(action) => self.serve(action, call, &params, stream).await,
            None => Err(not_found(format!(
                "unknown host api action `{}`",
                call.action
            ))),
        };
        audit(&call, &params, &outcome);
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_action_is_served() {
        for name in Action::WIRE_NAMES {
            assert!(Action::parse(name).is_some(), "{name}");
        }
        // canonical storage names and their seed aliases are the same actions, all known
        for (canonical, alias, action) in [
            ("storage_get", "get_binary_storage", Action::StorageGet),
            ("storage_set", "set_binary_storage", Action::StorageSet),
            (
                "storage_delete",
                "delete_binary_storage",
                Action::StorageDelete,
            ),
            (
                "storage_keys",
                "get_binary_storage_keys",
                Action::StorageKeys,
            ),
        ] {
            assert_eq!(Action::parse(canonical), Some(action), "{canonical}");
            assert_eq!(Action::parse(alias), Some(action), "{alias}");
            assert!(Action::WIRE_NAMES.contains(&canonical), "{canonical}");
            assert!(Action::WIRE_NAMES.contains(&alias), "{alias}");
        }
        assert_eq!(Action::parse("drop_tables"), None);
    }

    #[test]
    fn bucket_becomes_a_window() {
        let r = RateLimit::from_bucket(100, 200);
        assert_eq!((r.max_calls, r.window), (200, Duration::from_secs(2)));
        let r = RateLimit::from_bucket(0, 0);
        assert_eq!((r.max_calls, r.window), (1, Duration::from_secs(1)));
    }

    #[test]
    fn json_len_is_the_compact_length() {
        let v = json!({"a": [1, 2, "é"], "b": null});
        assert_eq!(json_len(&v), serde_json::to_vec(&v).unwrap().len());
    }

    #[test]
    fn default_limits_follow_the_spec() {
        let l = ActionLimits::default();
        assert_eq!(l.state_value_bytes, 256 * 1024);
        assert_eq!(l.storage_value_bytes, 10 * 1024 * 1024);
        assert_eq!(
            (
                l.page_size_default,
                l.page_size_max,
                l.state_page_size_default
            ),
            (50, 100, 100)
        );
        assert_eq!(l.search_top_k_default, 10);
        assert_eq!(l.rerank_documents_max, 64);
        assert!(l.rate_limit.is_some());
    }
}
