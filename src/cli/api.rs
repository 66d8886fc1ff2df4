//! The gateway HTTP API as `send` and `bench` use it: [`GatewayClient`] (one `reqwest`
//! client, base URL, bearer key) and [`RunFollower`], which posts one event and yields the
//! results of the run it starts, surviving dropped connections.
//!
//! # How a run is followed
//!
//! ```text
//!            ┌─────────────────────── POST /v1/events?stream=true (Idempotency-Key) ─┐
//!  Post ─────┤ text/event-stream → read frames; every frame names the run            │
//!            │ JSON receipt {event_id, status, run_id?} → Poll / Stream              │
//!            └─ connection lost before any frame → POST again (same key: same event) ┘
//!  Poll ──── GET /v1/events/{id} until it has a run_id (unrouted/rejected/claimed end it)
//!  Stream ── GET /v1/runs/{run_id}/stream?after_sequence=N, Last-Event-ID: N
//! ```
//!
//! `?stream=true` is tried first because it saves the round trips (and the polling delay)
//! between ingest and the first result, which is what `bench` measures. It is not enough on
//! its own: if that connection drops, only the run's own stream can resume it, so the
//! follower learns the run id from the frames (or the event id from a receipt) and resumes
//! with `after_sequence` and `Last-Event-ID`. Re-posting is safe because the
//! `Idempotency-Key` makes the gateway answer with the same event.
//!
//! Items whose sequence is not above the last one seen are dropped, so a replay after a
//! resume never yields an item twice. The follower stops after the terminal item
//! (`run.completed` / `run.failed`).
//!
//! Failures are retried with exponential backoff; [`FollowOptions::max_attempts`] failures
//! in a row without a new item end the follow ([`FollowError::Lost`], or
//! [`FollowError::Api`] when the gateway's last answer was an error status).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use anyhow::Context as _;
use futures::Stream;
use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, RETRY_AFTER};
use sb_protocol::result::AgentRunResult;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::time::Instant;

use super::sse::{Backoff, LAST_EVENT_ID, SseError, SseEvent, SseParser, SseStream};

/// The request header that makes `POST /v1/events` idempotent.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";
/// Response header of `POST /v1/events?stream=true` naming the event.
pub const EVENT_ID_HEADER: &str = "x-event-id";

/// A connected client of one gateway.
#[derive(Debug, Clone)]
pub struct GatewayClient {
    http: reqwest::Client,
    /// Base URL without a trailing slash.
    base: String,
    /// `Bearer <key>`, when a key is configured.
    authorization: Option<String>,
}

impl GatewayClient {
    /// A client of the gateway at `base_url` (plain `http`; this build has no TLS).
    pub fn new(base_url: &str, api_key: Option<&str>) -> anyhow::Result<Self> {
        let url = reqwest::Url::parse(base_url)
            .with_context(|| format!("invalid gateway URL `{base_url}`"))?;
        anyhow::ensure!(
            url.scheme() == "http",
            "gateway URL `{base_url}` must use http:// (this build has no TLS support)"
        );
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true);
        // A proxy from the environment must not capture traffic to the local gateway.
        if matches!(
            url.host_str(),
            Some("localhost" | "127.0.0.1" | "[::1]" | "::1")
        ) {
            builder = builder.no_proxy();
        }
        Ok(Self {
            http: builder.build().context("cannot build the HTTP client")?,
            base: base_url.trim_end_matches('/').to_owned(),
            authorization: api_key.map(|k| format!("Bearer {k}")),
        })
    }

    /// Starts following the run that posting `event` (with `idempotency_key`) starts.
    /// Nothing is sent before the first [`RunFollower::next`].
    pub fn follow(
        &self,
        event: NewEvent,
        idempotency_key: String,
        options: FollowOptions,
    ) -> RunFollower<'_> {
        RunFollower {
            client: self,
            body: event,
            idempotency_key,
            options,
            event_id: None,
            run_id: None,
            parser: SseParser::default(),
            conn: None,
            last_sequence: 0,
            backoff: Backoff::new(options.initial_backoff, options.max_backoff),
            poll_backoff: Backoff::new(options.poll_initial, options.poll_max),
            finished: false,
            reconnects: 0,
        }
    }

    /// One JSON request to `path`; the answer's JSON on a `2xx`, else an error with the
    /// gateway's `{code, message}`.
    pub async fn json(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Value> {
        let mut req = self.request(method, path);
        if let Some(body) = body {
            req = req.json(body);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("cannot reach the gateway at {}", self.base))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .context("cannot read the gateway answer")?;
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if !status.is_success() {
            let code = value["code"].as_str().unwrap_or("error");
            let message = value["message"].as_str().unwrap_or("");
            anyhow::bail!("gateway answered {status}: {code}: {message}");
        }
        Ok(value)
    }

    pub(crate) fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(auth) = &self.authorization {
            req = req.header(AUTHORIZATION, auth);
        }
        req
    }
}

/// Body of `POST /v1/events` for a user message.
#[derive(Debug, Clone, Serialize)]
pub struct NewEvent {
    event_type: &'static str,
    source: &'static str,
    conversation_id: String,
    actor: Actor,
    input: Input,
    delivery: Delivery,
}

#[derive(Debug, Clone, Serialize)]
struct Actor {
    actor_type: &'static str,
    actor_id: String,
}

#[derive(Debug, Clone, Serialize)]
struct Input {
    text: String,
    contents: Vec<Value>,
    attachments: Vec<Value>,
}

#[derive(Debug, Clone, Serialize)]
struct Delivery {
    surface: &'static str,
    supports_streaming: bool,
}

impl NewEvent {
    /// A `message.received` from the API surface (which streams).
    pub fn message(conversation_id: &str, actor_id: &str, text: &str) -> Self {
        Self {
            event_type: "message.received",
            source: "api",
            conversation_id: conversation_id.to_owned(),
            actor: Actor {
                actor_type: "user",
                actor_id: actor_id.to_owned(),
            },
            input: Input {
                text: text.to_owned(),
                contents: Vec::new(),
                attachments: Vec::new(),
            },
            delivery: Delivery {
                surface: "api",
                supports_streaming: true,
            },
        }
    }
}

/// `202` answer of `POST /v1/events`, and the body of `GET /v1/events/{id}` (extra fields
/// ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct EventStatus {
    /// The event.
    pub event_id: String,
    /// `received`, `dispatched`, `claimed`, `unrouted`, `rejected` (or `scheduled`).
    pub status: String,
    /// The run the event started.
    #[serde(default)]
    pub run_id: Option<String>,
    /// When `claimed`: the active run the event was steered into.
    #[serde(default)]
    pub claimed_by_run_id: Option<String>,
    /// Why it was not routed or was rejected.
    #[serde(default)]
    pub reason: Option<String>,
}

/// `{code, message}` error body.
#[derive(Debug, Deserialize)]
struct ErrorBody {
    code: String,
    #[serde(default)]
    message: String,
}

/// Tuning of [`RunFollower`].
#[derive(Debug, Clone, Copy)]
pub struct FollowOptions {
    /// Give up (with [`FollowError::TimedOut`]) when the terminal item has not arrived by
    /// then. `None`: wait as long as the gateway keeps answering.
    pub deadline: Option<Instant>,
    /// A stream silent (not even a keep-alive comment) this long is treated as dropped.
    pub idle_timeout: Duration,
    /// Consecutive failures (connection errors, retryable statuses, dropped streams) without
    /// a new item before giving up.
    pub max_attempts: u32,
    /// First delay between attempts; it doubles up to `max_backoff`.
    pub initial_backoff: Duration,
    /// Longest delay between attempts.
    pub max_backoff: Duration,
    /// First delay between polls of `GET /v1/events/{id}` while it has no run yet.
    pub poll_initial: Duration,
    /// Longest delay between polls.
    pub poll_max: Duration,
}

impl Default for FollowOptions {
    fn default() -> Self {
        Self {
            deadline: None,
            // Gateways send keep-alive comments far more often than this.
            idle_timeout: Duration::from_secs(60),
            max_attempts: 6,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(3),
            poll_initial: Duration::from_millis(5),
            poll_max: Duration::from_millis(250),
        }
    }
}

/// Why following a run ended without its terminal item.
#[derive(Debug, thiserror::Error)]
pub enum FollowError {
    /// The gateway answered with an error that retrying does not fix (or kept answering a
    /// retryable one). `status` is `None` for an error frame inside a stream.
    #[error("{message} ({code}{})", status.map(|s| format!(", HTTP {s}")).unwrap_or_default())]
    Api {
        /// HTTP status.
        status: Option<u16>,
        /// The error code (`unauthorized`, …; `http_<status>` when the body had none).
        code: String,
        /// The gateway's message.
        message: String,
    },
    /// The event was accepted but started no run of its own.
    #[error("{}", not_run_message(.event_id, .status, .reason.as_deref(), .run_id.as_deref()))]
    NotRun {
        /// The event.
        event_id: String,
        /// `unrouted`, `rejected` or `claimed`.
        status: String,
        /// The gateway's reason.
        reason: Option<String>,
        /// For `claimed`: the active run the message was steered into.
        run_id: Option<String>,
    },
    /// The connection kept failing.
    #[error("gateway unreachable or connection lost ({attempts} attempts): {last_error}")]
    Lost {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        last_error: String,
    },
    /// The deadline passed before the terminal item.
    #[error("no terminal result before the deadline")]
    TimedOut,
    /// The gateway sent something that is not a run result.
    #[error("gateway sent an invalid stream frame: {0}")]
    Protocol(String),
}

fn not_run_message(
    event_id: &str,
    status: &str,
    reason: Option<&str>,
    run_id: Option<&str>,
) -> String {
    let reason = reason.map(|r| format!(": {r}")).unwrap_or_default();
    match status {
        "unrouted" => format!("event {event_id} was not routed to any agent{reason}"),
        "rejected" => format!("event {event_id} was rejected{reason}"),
        "claimed" => format!(
            "event {event_id} was steered into the active run {}{reason}",
            run_id.unwrap_or("(unknown)")
        ),
        other => format!("event {event_id} ended as `{other}` without a run{reason}"),
    }
}

impl FollowError {
    /// A short stable label: the error code, `event.<status>`, `lost`, `timeout` or
    /// `protocol_error` (what `bench` counts by).
    #[must_use]
    pub fn code(&self) -> String {
        match self {
            Self::Api { code, .. } => code.clone(),
            Self::NotRun { status, .. } => format!("event.{status}"),
            Self::Lost { .. } => "lost".to_owned(),
            Self::TimedOut => "timeout".to_owned(),
            Self::Protocol(_) => "protocol_error".to_owned(),
        }
    }
}

/// One failed attempt, before the retry decision.
#[derive(Debug)]
enum Attempt {
    /// A transport failure or a retryable status; `retry_after` from the response.
    Retry {
        error: String,
        api: Option<FollowError>,
        retry_after: Option<Duration>,
    },
    /// A final answer.
    Fatal(FollowError),
}

/// What a stream frame means to the follower.
#[derive(Debug)]
enum Frame {
    /// A new item of the run.
    Item(AgentRunResult),
    /// Nothing new (a duplicate, a receipt, an unknown frame).
    Skip,
    /// The gateway gave up waiting for the route: poll the event instead.
    Repoll,
}

type BodyStream = Pin<Box<dyn Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>;

/// Follows one posted event's run; see the module docs.
pub struct RunFollower<'c> {
    client: &'c GatewayClient,
    body: NewEvent,
    idempotency_key: String,
    options: FollowOptions,
    event_id: Option<String>,
    run_id: Option<String>,
    /// Carries the last event id from one connection to the next.
    parser: SseParser,
    conn: Option<SseStream<BodyStream>>,
    /// Highest sequence yielded (0: none).
    last_sequence: u64,
    /// Failed attempts since the last new item.
    backoff: Backoff,
    poll_backoff: Backoff,
    finished: bool,
    reconnects: u32,
}

impl RunFollower<'_> {
    /// The next new item of the run; `Ok(None)` after the terminal item.
    pub async fn next(&mut self) -> Result<Option<AgentRunResult>, FollowError> {
        loop {
            if self.finished {
                return Ok(None);
            }
            if let Some(conn) = self.conn.as_mut() {
                let read = within(self.options.deadline, conn.next_event()).await?;
                let error = match read {
                    Ok(Some(frame)) => match self.on_frame(frame)? {
                        Frame::Item(item) => return Ok(Some(item)),
                        Frame::Skip => continue,
                        Frame::Repoll => {
                            self.drop_connection();
                            continue;
                        }
                    },
                    Ok(None) => "stream ended before the terminal result".to_owned(),
                    Err(SseError::TooLarge { limit }) => {
                        return Err(FollowError::Protocol(format!(
                            "frame larger than {limit} bytes"
                        )));
                    }
                    Err(e) => e.to_string(),
                };
                self.drop_connection();
                self.retry_or_fail(error, None, None).await?;
                continue;
            }
            let attempt = if let Some(run_id) = self.run_id.clone() {
                self.open_run_stream(&run_id).await
            } else if let Some(event_id) = self.event_id.clone() {
                self.poll_event(&event_id).await
            } else {
                self.post_event().await
            };
            match attempt {
                Ok(()) => {}
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Retry {
                    error,
                    api,
                    retry_after,
                }) => self.retry_or_fail(error, api, retry_after).await?,
            }
        }
    }

    /// The run, once known.
    pub fn run_id(&self) -> Option<&str> {
        self.run_id.as_deref()
    }

    /// The event, once known.
    pub fn event_id(&self) -> Option<&str> {
        self.event_id.as_deref()
    }

    /// Connections opened after the first one failed or dropped.
    pub fn reconnects(&self) -> u32 {
        self.reconnects
    }

    fn drop_connection(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.parser = conn.into_parser();
        }
    }

    /// Counts a failure; waits the backoff delay or gives up.
    async fn retry_or_fail(
        &mut self,
        error: String,
        api: Option<FollowError>,
        retry_after: Option<Duration>,
    ) -> Result<(), FollowError> {
        if self.backoff.attempts() + 1 >= self.options.max_attempts {
            return Err(api.unwrap_or(FollowError::Lost {
                attempts: self.backoff.attempts() + 1,
                last_error: error,
            }));
        }
        let delay = self
            .backoff
            .next_delay(retry_after.or_else(|| self.parser.retry()));
        tracing::debug!(%error, ?delay, attempt = self.backoff.attempts(), "retrying");
        self.reconnects += 1;
        within(self.options.deadline, tokio::time::sleep(delay)).await
    }

    async fn post_event(&mut self) -> Result<(), Attempt> {
        let response = self
            .client
            .request(reqwest::Method::POST, "/v1/events?stream=true")
            .header(IDEMPOTENCY_KEY, &self.idempotency_key)
            .json(&self.body)
            .send();
        let response = send_request(self.options.deadline, response).await?;
        if is_event_stream(response.headers()) {
            // The stream's body is the run's; the header names the event, so a connection
            // lost before the first frame can be resumed by polling it instead of posting.
            if let Some(id) = response
                .headers()
                .get(EVENT_ID_HEADER)
                .and_then(|v| v.to_str().ok())
            {
                self.event_id = Some(id.to_owned());
            }
            self.open(response);
            return Ok(());
        }
        let receipt: EventStatus = read_json(response).await?;
        self.apply_status(receipt).map_err(Attempt::Fatal)
    }

    async fn poll_event(&mut self, event_id: &str) -> Result<(), Attempt> {
        let request = self
            .client
            .request(reqwest::Method::GET, &format!("/v1/events/{event_id}"))
            .send();
        let response = send_request(self.options.deadline, request).await?;
        let status: EventStatus = read_json(response).await?;
        self.apply_status(status).map_err(Attempt::Fatal)?;
        if self.run_id.is_none() {
            // Not routed yet: the next loop turn polls again.
            let delay = self.poll_backoff.next_delay(None);
            within(self.options.deadline, tokio::time::sleep(delay))
                .await
                .map_err(Attempt::Fatal)?;
        }
        Ok(())
    }

    async fn open_run_stream(&mut self, run_id: &str) -> Result<(), Attempt> {
        let mut request = self.client.request(
            reqwest::Method::GET,
            &format!(
                "/v1/runs/{run_id}/stream?after_sequence={}",
                self.last_sequence
            ),
        );
        let last_id = self
            .parser
            .last_event_id()
            .map(str::to_owned)
            .or_else(|| (self.last_sequence > 0).then(|| self.last_sequence.to_string()));
        if let Some(id) = last_id {
            request = request.header(LAST_EVENT_ID, id);
        }
        let response = send_request(self.options.deadline, request.send()).await?;
        if !is_event_stream(response.headers()) {
            return Err(Attempt::Fatal(FollowError::Protocol(format!(
                "GET /v1/runs/{run_id}/stream answered {:?} instead of an event stream",
                response.headers().get(CONTENT_TYPE)
            ))));
        }
        self.open(response);
        Ok(())
    }

    fn open(&mut self, response: reqwest::Response) {
        let body: BodyStream = Box::pin(response.bytes_stream());
        let parser = std::mem::take(&mut self.parser);
        self.conn = Some(SseStream::new(
            body,
            parser,
            Some(self.options.idle_timeout),
        ));
    }

    /// Applies an event status (a receipt, a poll answer, or a receipt frame).
    fn apply_status(&mut self, status: EventStatus) -> Result<(), FollowError> {
        self.event_id = Some(status.event_id.clone());
        match status.status.as_str() {
            "unrouted" | "rejected" | "claimed" => Err(FollowError::NotRun {
                event_id: status.event_id,
                status: status.status,
                reason: status.reason,
                run_id: status.claimed_by_run_id.or(status.run_id),
            }),
            _ => {
                if self.run_id.is_none() {
                    self.run_id = status.run_id.filter(|r| !r.is_empty());
                }
                Ok(())
            }
        }
    }

    /// Interprets one frame: a run result (yielded unless already seen), an error frame, or
    /// an event receipt.
    ///
    /// An error frame about the event (it carries `event_id` and `status`) ends the follow
    /// with [`FollowError::NotRun`] when the event will never start a run; while it is
    /// still `received` (the gateway stopped waiting for the route), the follower goes on
    /// by polling the event. Any other error frame is final.
    fn on_frame(&mut self, frame: SseEvent) -> Result<Frame, FollowError> {
        let value: Value = serde_json::from_str(&frame.data).map_err(|e| {
            FollowError::Protocol(format!("`{}` frame is not JSON: {e}", frame.event))
        })?;
        let Some(object) = value.as_object() else {
            return Err(FollowError::Protocol(format!(
                "`{}` frame is not a JSON object",
                frame.event
            )));
        };
        if object.contains_key("type") {
            let result: AgentRunResult = serde_json::from_value(value)
                .map_err(|e| FollowError::Protocol(format!("bad run result: {e}")))?;
            return Ok(self
                .on_result(result, frame.id.as_deref())
                .map_or(Frame::Skip, Frame::Item));
        }
        let about_event = object.contains_key("event_id") && object.contains_key("status");
        let event_status = || {
            serde_json::from_value::<EventStatus>(value.clone())
                .map_err(|e| FollowError::Protocol(format!("bad event frame: {e}")))
        };
        if frame.event == "error" || (object.contains_key("code") && object.contains_key("message"))
        {
            if about_event {
                let status = event_status()?;
                let still_waiting = status.status == "received";
                self.apply_status(status)?;
                if still_waiting && self.event_id.is_some() {
                    return Ok(Frame::Repoll);
                }
            }
            let body: ErrorBody = serde_json::from_value(value)
                .map_err(|e| FollowError::Protocol(format!("bad error frame: {e}")))?;
            return Err(FollowError::Api {
                status: None,
                code: body.code,
                message: body.message,
            });
        }
        if about_event {
            self.apply_status(event_status()?)?;
            return Ok(Frame::Skip);
        }
        tracing::debug!(event = %frame.event, "ignoring unknown stream frame");
        Ok(Frame::Skip)
    }

    fn on_result(
        &mut self,
        result: AgentRunResult,
        frame_id: Option<&str>,
    ) -> Option<AgentRunResult> {
        if self.run_id.is_none() && !result.run_id.is_empty() {
            self.run_id = Some(result.run_id.clone());
        }
        let sequence = result
            .sequence
            .or_else(|| frame_id.and_then(|id| id.parse().ok()));
        if let Some(sequence) = sequence {
            if sequence <= self.last_sequence {
                return None;
            }
            self.last_sequence = sequence;
        }
        self.backoff.reset();
        if result.is_terminal() {
            self.finished = true;
            // The gateway closes the stream after the terminal item; don't wait for it.
            self.conn = None;
        }
        Some(result)
    }
}

/// File holding the API key that `switchboard dev` keeps in its default data directory,
/// relative to the working directory. `send` and `bench` read it when no key is given.
pub const DEV_API_KEY_FILE: &str = ".switchboard/api-key";

/// `explicit` (from the flags or the environment), else the trimmed content of
/// `default_file` when that file exists, else no key.
pub fn api_key_or_default(
    explicit: Option<String>,
    default_file: &std::path::Path,
) -> anyhow::Result<Option<String>> {
    if explicit.is_some() {
        return Ok(explicit);
    }
    match std::fs::read_to_string(default_file) {
        Ok(text) => Ok(Some(text.trim().to_owned()).filter(|k| !k.is_empty())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => {
            Err(e).with_context(|| format!("cannot read API key file {}", default_file.display()))
        }
    }
}

/// The text of a `message.delta` chunk.
#[must_use]
pub fn delta_text(result: &AgentRunResult) -> Option<String> {
    result.data.get("chunk")?.get("content").map(content_text)
}

/// The text of the message of a `message.completed` or `run.completed` (`None` when there
/// is no message).
#[must_use]
pub fn message_text(result: &AgentRunResult) -> Option<String> {
    let message = result.data.get("message").filter(|m| !m.is_null())?;
    Some(message.get("content").map(content_text).unwrap_or_default())
}

/// A message `content`: a string, or the `text` blocks of a block list joined in order.
/// Read leniently: a client shows what it understands and skips the rest.
fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

/// Sends a request within `deadline`, classifying transport errors and error statuses.
async fn send_request(
    deadline: Option<Instant>,
    request: impl Future<Output = reqwest::Result<reqwest::Response>>,
) -> Result<reqwest::Response, Attempt> {
    let response = within(deadline, request)
        .await
        .map_err(Attempt::Fatal)?
        .map_err(|e| Attempt::Retry {
            error: error_chain(&e),
            api: None,
            retry_after: None,
        })?;
    if response.status().is_success() {
        return Ok(response);
    }
    let status = response.status();
    let retry_after = response
        .headers()
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let text = within(deadline, response.text())
        .await
        .map_err(Attempt::Fatal)?
        .unwrap_or_default();
    let error = api_error(status, &text);
    if is_retryable(status) {
        Err(Attempt::Retry {
            error: error.to_string(),
            api: Some(error),
            retry_after,
        })
    } else {
        Err(Attempt::Fatal(error))
    }
}

/// `fut`, bounded by `deadline`.
async fn within<T>(
    deadline: Option<Instant>,
    fut: impl Future<Output = T>,
) -> Result<T, FollowError> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, fut)
            .await
            .map_err(|_| FollowError::TimedOut),
        None => Ok(fut.await),
    }
}

async fn read_json<T: serde::de::DeserializeOwned>(
    response: reqwest::Response,
) -> Result<T, Attempt> {
    let bytes = response.bytes().await.map_err(|e| Attempt::Retry {
        error: error_chain(&e),
        api: None,
        retry_after: None,
    })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        Attempt::Fatal(FollowError::Protocol(format!(
            "unexpected answer `{}`: {e}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        )))
    })
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"))
}

/// Statuses worth retrying: the request may succeed later unchanged.
fn is_retryable(status: StatusCode) -> bool {
    matches!(status.as_u16(), 408 | 425 | 429 | 500 | 502 | 503 | 504)
}

/// The gateway's `{code, message}` body, or a stand-in for a body without one.
fn api_error(status: StatusCode, body: &str) -> FollowError {
    let (code, message) = match serde_json::from_str::<ErrorBody>(body) {
        Ok(b) => (b.code, b.message),
        Err(_) => {
            let text: String = body.trim().chars().take(200).collect();
            let text = if text.is_empty() {
                status.canonical_reason().unwrap_or("error").to_lowercase()
            } else {
                text
            };
            (format!("http_{}", status.as_u16()), text)
        }
    };
    FollowError::Api {
        status: Some(status.as_u16()),
        code,
        message,
    }
}

/// `e` with its sources ("error sending request: connection refused").
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod real_gateway;
#[cfg(test)]
pub(crate) mod test_gateway;

#[cfg(test)]
mod tests {
    use super::test_gateway::{Script, TestGateway};
    use super::*;

    fn options() -> FollowOptions {
        FollowOptions {
            deadline: Some(Instant::now() + Duration::from_secs(20)),
            idle_timeout: Duration::from_secs(5),
            max_attempts: 4,
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(20),
            poll_initial: Duration::from_millis(1),
            poll_max: Duration::from_millis(5),
        }
    }

    async fn collect(follower: &mut RunFollower<'_>) -> Result<Vec<AgentRunResult>, FollowError> {
        let mut items = Vec::new();
        while let Some(item) = follower.next().await? {
            items.push(item);
        }
        Ok(items)
    }

    fn types(items: &[AgentRunResult]) -> Vec<(u64, &str)> {
        items
            .iter()
            .map(|i| (i.sequence.unwrap_or(0), i.result_type.as_str()))
            .collect()
    }

    const ECHO_TWO_WORDS: [(u64, &str); 4] = [
        (1, "message.delta"),
        (2, "message.delta"),
        (3, "message.completed"),
        (4, "run.completed"),
    ];

    #[test]
    fn event_body_matches_the_api() {
        let body = serde_json::to_value(NewEvent::message("c1", "u1", "hello")).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "event_type": "message.received", "source": "api", "conversation_id": "c1",
                "actor": {"actor_type": "user", "actor_id": "u1"},
                "input": {"text": "hello", "contents": [], "attachments": []},
                "delivery": {"surface": "api", "supports_streaming": true}
            })
        );
    }

    #[test]
    fn error_bodies_are_decoded_or_stood_in_for() {
        let e = api_error(
            StatusCode::UNAUTHORIZED,
            r#"{"code":"unauthorized","message":"missing api key"}"#,
        );
        assert_eq!(e.code(), "unauthorized");
        assert_eq!(e.to_string(), "missing api key (unauthorized, HTTP 401)");
        let e = api_error(StatusCode::BAD_GATEWAY, "");
        assert_eq!(e.code(), "http_502");
        assert_eq!(e.to_string(), "bad gateway (http_502, HTTP 502)");
        assert!(is_retryable(StatusCode::SERVICE_UNAVAILABLE));
        assert!(!is_retryable(StatusCode::BAD_REQUEST));
    }

    #[test]
    fn api_key_falls_back_to_the_dev_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("api-key");
        assert_eq!(
            api_key_or_default(None, &file).unwrap(),
            None,
            "no file: no key"
        );
        std::fs::write(&file, "sbk_dev\n").unwrap();
        assert_eq!(
            api_key_or_default(None, &file).unwrap().as_deref(),
            Some("sbk_dev")
        );
        assert_eq!(
            api_key_or_default(Some("flag".into()), &file)
                .unwrap()
                .as_deref(),
            Some("flag")
        );
        std::fs::write(&file, " \n").unwrap();
        assert_eq!(api_key_or_default(None, &file).unwrap(), None);
        assert!(
            api_key_or_default(None, dir.path()).is_err(),
            "a directory is not a key"
        );
    }

    #[test]
    fn text_is_read_from_strings_and_text_blocks() {
        let r: AgentRunResult =
            serde_json::from_value(serde_json::json!({"type": "message.completed",
            "data": {"message": {"role": "assistant", "content": [{"type": "text", "text": "a"},
            {"type": "image", "url": "x"}, {"type": "text", "text": "b"}]}}}))
            .unwrap();
        assert_eq!(message_text(&r).as_deref(), Some("ab"));
        assert_eq!(delta_text(&r), None);
        let r: AgentRunResult = serde_json::from_value(serde_json::json!({"type": "message.delta",
            "data": {"chunk": {"role": "assistant", "content": "hel"}}}))
        .unwrap();
        assert_eq!(delta_text(&r).as_deref(), Some("hel"));
    }

    #[test]
    fn only_plain_http_urls_are_accepted() {
        assert!(GatewayClient::new("http://127.0.0.1:8080/", None).is_ok());
        assert!(GatewayClient::new("https://example.com", None).is_err());
        assert!(GatewayClient::new("not a url", None).is_err());
    }

    #[tokio::test]
    async fn streams_the_post_answer_with_auth_and_idempotency_key() {
        let gw = TestGateway::start(Script::default()).await;
        let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
        let mut f = client.follow(
            NewEvent::message("c1", "u1", "hello world"),
            "key-1".into(),
            options(),
        );
        let items = collect(&mut f).await.unwrap();
        assert_eq!(types(&items), ECHO_TWO_WORDS);
        assert!(f.run_id().is_some());
        let stats = gw.stats();
        assert_eq!(
            (stats.posts, stats.stream_posts, stats.run_streams),
            (1, 1, 0)
        );
        assert_eq!(stats.idempotency_keys, vec!["key-1".to_owned()]);
    }

    #[tokio::test]
    async fn missing_key_is_an_api_error() {
        let gw = TestGateway::start(Script::default()).await;
        let client = GatewayClient::new(&gw.url(), None).unwrap();
        let mut f = client.follow(NewEvent::message("c1", "u1", "hi"), "k".into(), options());
        let err = f.next().await.unwrap_err();
        assert_eq!(err.code(), "unauthorized");
        assert_eq!(gw.stats().posts, 1, "a 401 is not retried");
    }

    #[tokio::test]
    async fn resumes_a_dropped_post_stream_from_the_run_stream() {
        // Clean end of the body, aborted connection, and a server that replays from the
        // start despite `after_sequence` (the follower must drop what it already yielded).
        for (abort, ignore_resume) in [(false, false), (true, false), (false, true)] {
            let gw = TestGateway::start(Script {
                drop_after: vec![2],
                abort_connection: abort,
                ignore_resume,
                ..Script::default()
            })
            .await;
            let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
            let mut f = client.follow(
                NewEvent::message("c", "u", "hello world"),
                "k".into(),
                options(),
            );
            let items = collect(&mut f).await.unwrap();
            assert_eq!(types(&items), ECHO_TWO_WORDS, "abort={abort}");
            let stats = gw.stats();
            assert_eq!((stats.posts, stats.run_streams), (1, 1), "abort={abort}");
            assert_eq!(stats.last_event_ids, vec![Some("2".to_owned())]);
            assert_eq!(stats.after_sequences, vec![2]);
            assert_eq!(f.reconnects(), 1);
        }
    }

    #[tokio::test]
    async fn polls_the_event_when_the_stream_drops_before_any_frame() {
        let gw = TestGateway::start(Script {
            drop_after: vec![0],
            ..Script::default()
        })
        .await;
        let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
        let mut f = client.follow(
            NewEvent::message("c", "u", "hello world"),
            "k".into(),
            options(),
        );
        let items = collect(&mut f).await.unwrap();
        assert_eq!(types(&items), ECHO_TWO_WORDS);
        let stats = gw.stats();
        assert_eq!((stats.posts, stats.polls, stats.run_streams), (1, 1, 1));
        assert_eq!(stats.after_sequences, vec![0]);
    }

    #[tokio::test]
    async fn polls_the_event_when_the_gateway_stops_waiting_for_the_route() {
        let gw = TestGateway::start(Script {
            route_timeout: true,
            polls_before_run: 2,
            ..Script::default()
        })
        .await;
        let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
        let mut f = client.follow(
            NewEvent::message("c", "u", "hello world"),
            "k".into(),
            options(),
        );
        assert_eq!(types(&collect(&mut f).await.unwrap()), ECHO_TWO_WORDS);
        let stats = gw.stats();
        assert_eq!((stats.posts, stats.polls, stats.run_streams), (1, 3, 1));
        assert_eq!(f.reconnects(), 0, "not a failure");
    }

    #[tokio::test]
    async fn reposts_when_the_stream_drops_before_any_frame_without_event_id() {
        // First POST stream dies at once and does not name the event; the second (same
        // key) streams from the start, drops at 3 and is resumed from the run stream.
        let gw = TestGateway::start(Script {
            drop_after: vec![0, 3],
            event_id_header: false,
            ..Script::default()
        })
        .await;
        let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
        let mut f = client.follow(
            NewEvent::message("c", "u", "hello world"),
            "same".into(),
            options(),
        );
        let items = collect(&mut f).await.unwrap();
        assert_eq!(types(&items), ECHO_TWO_WORDS);
        let stats = gw.stats();
        assert_eq!(stats.posts, 2);
        assert_eq!(
            stats.events_created, 1,
            "the idempotency key dedupes the re-post"
        );
        assert_eq!(stats.after_sequences, vec![3]);
    }

    #[tokio::test]
    async fn falls_back_to_polling_when_the_post_is_not_streamed() {
        let gw = TestGateway::start(Script {
            stream_on_post: false,
            polls_before_run: 3,
            ..Script::default()
        })
        .await;
        let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
        let mut f = client.follow(
            NewEvent::message("c", "u", "hello world"),
            "k".into(),
            options(),
        );
        let items = collect(&mut f).await.unwrap();
        assert_eq!(types(&items), ECHO_TWO_WORDS);
        let stats = gw.stats();
        assert_eq!(stats.polls, 4);
        assert_eq!(
            (stats.run_streams, stats.after_sequences.clone()),
            (1, vec![0])
        );
        assert!(f.event_id().is_some());
    }

    #[tokio::test]
    async fn unrouted_and_rejected_events_end_with_the_reason() {
        for (status, stream_on_post) in
            [("unrouted", false), ("rejected", false), ("unrouted", true)]
        {
            let gw = TestGateway::start(Script {
                stream_on_post,
                event_status: status,
                ..Script::default()
            })
            .await;
            let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
            let mut f = client.follow(NewEvent::message("c", "u", "x"), "k".into(), options());
            let err = f.next().await.unwrap_err();
            assert_eq!(err.code(), format!("event.{status}"));
            assert!(err.to_string().contains("no binding matched"), "{err}");
        }
    }

    #[tokio::test]
    async fn retryable_statuses_are_retried_then_reported() {
        let gw = TestGateway::start(Script {
            post_failures: 2,
            ..Script::default()
        })
        .await;
        let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
        let mut f = client.follow(NewEvent::message("c", "u", "hi"), "k".into(), options());
        assert_eq!(collect(&mut f).await.unwrap().len(), 3);
        assert_eq!(gw.stats().posts, 3);

        let gw = TestGateway::start(Script {
            post_failures: 100,
            ..Script::default()
        })
        .await;
        let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
        let mut f = client.follow(NewEvent::message("c", "u", "hi"), "k".into(), options());
        let err = f.next().await.unwrap_err();
        assert_eq!(err.code(), "unavailable");
        assert_eq!(gw.stats().posts, 4, "max_attempts");
    }

    #[tokio::test]
    async fn a_dead_gateway_is_lost_and_a_silent_run_times_out() {
        let client = GatewayClient::new(&TestGateway::dead_url().await, Some("k1")).unwrap();
        let mut f = client.follow(NewEvent::message("c", "u", "hi"), "k".into(), options());
        let err = f.next().await.unwrap_err();
        assert!(
            matches!(err, FollowError::Lost { attempts: 4, .. }),
            "{err}"
        );

        let gw = TestGateway::start(Script {
            stall_after: Some(1),
            ..Script::default()
        })
        .await;
        let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
        let mut opts = options();
        opts.deadline = Some(Instant::now() + Duration::from_millis(300));
        let mut f = client.follow(NewEvent::message("c", "u", "hello world"), "k".into(), opts);
        assert!(f.next().await.unwrap().is_some());
        assert!(matches!(f.next().await, Err(FollowError::TimedOut)));
    }

    #[tokio::test]
    async fn error_frames_end_the_follow() {
        let gw = TestGateway::start(Script {
            error_frame: true,
            ..Script::default()
        })
        .await;
        let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
        let mut f = client.follow(NewEvent::message("c", "u", "x"), "k".into(), options());
        let err = f.next().await.unwrap_err();
        assert_eq!(err.code(), "internal");
    }
}
