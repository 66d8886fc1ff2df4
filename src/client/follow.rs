//! Following the run a posted event starts: [`GatewayClient::follow`] returns a
//! [`RunFollower`], which posts one event and yields the results of the run it starts,
//! surviving dropped connections (what `send` and `bench` print and measure).
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

use futures::Stream;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_TYPE, HeaderMap, RETRY_AFTER};
use sb_protocol::result::AgentRunResult;
use serde_json::Value;
use tokio::time::Instant;

use super::GatewayClient;
use super::event::{ErrorBody, EventStatus, NewEvent};
use super::sse::{Backoff, LAST_EVENT_ID, SseError, SseEvent, SseParser, SseStream};

/// The request header that makes `POST /v1/events` idempotent.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";
/// Response header of `POST /v1/events?stream=true` naming the event.
pub const EVENT_ID_HEADER: &str = "x-event-id";

impl GatewayClient {
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
mod tests {
    use super::*;

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
}
