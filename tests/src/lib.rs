//! End-to-end harness: the whole system in the test process, driven over real HTTP, with real
//! runner processes.
//!
//! [`TestCluster::embedded`] starts gateway, orchestrator and worker exactly as
//! `switchboard dev` does, on the library's in-memory host ([`switchboard::testing`]): SQLite
//! in a temporary data directory, the in-process bus and session store, the gateway on
//! `127.0.0.1:0`, and the runner plugins
//! of `runners/` (the official echo runner) and `tests/runners/` (the misbehaving
//! `sb-test-runner`, in shared and per-run mode). The bootstrap gives workspace `default`, an
//! API key and a workspace-wide echo agent for `message.received`; tests route an event to a
//! misbehaving runner with an agent scoped to its conversation, which is more specific.
//!
//! [`Client`] speaks the HTTP API with reqwest: agents, events, runs, run events, transcript,
//! and result streams ([`SseStream`], parsed by [`SseParser`]).
//!
//! # Runner binaries
//! The runners are separate executables (`echo`, `sb-test-runner`). The harness does not build
//! them: `scripts/test` runs `cargo build --workspace --bins` first. The worker finds them next
//! to the test executable's directory (`target/<profile>/`), and [`TestCluster`] fails with
//! the build command when they are missing.
//!
//! # Layout
//! - [`TestCluster`], [`ClusterBuilder`]: start, stop, restart on the same data directory.
//! - [`Client`], [`ApiResponse`]: the HTTP API.
//! - [`SseStream`], [`SseFrame`], [`SseParser`]: server-sent events.
//! - [`message`]: the body of a `message.received` event.
//! - [`cluster`]: cluster mode — every role its own `switchboard` process on RabbitMQ, Redis
//!   and Postgres — driven with the same [`Client`].
//! - [`script`]: scripted Host API runs (`sb-api-runner`) and their outcomes, with either
//!   harness.
//! - [`addressing`]: direct agents, `agent_id` and `deliver_at` on ingest, the event wait and
//!   the conversation stream (issue 14 items 6-7), with either harness.
//! - [`retention`]: result expiry and artifacts over HTTP (issue 14 items 4-5), with
//!   either harness.
//! - [`stand_in_gateway`]: a scriptable stand-in for the gateway's event and stream
//!   endpoints, for the gateway client's fault tests (`tests/client/`).

pub mod addressing;
pub mod cluster;
pub mod retention;
pub mod script;
pub mod stand_in_gateway;
pub mod turns;

use std::path::{Path, PathBuf};
use std::sync::Once;
use std::time::Duration;

use futures::StreamExt as _;
use reqwest::header::HeaderMap;
use sb_common::config::SwitchboardConfig;
use sb_protocol::ids::{EventId, RunId};
use sb_protocol::result::AgentRunResult;
use sb_store::Stores;
use serde_json::{Value, json};
use switchboard::embedded::{Embedded, StopReport};
use switchboard::testing::{InMemoryHost, InMemoryHostBuilder};
use tokio::time::Instant;

/// The official echo runner.
pub const ECHO: &str = "plugin:switchboard/echo/default";
/// `sb-test-runner` in shared mode (one process for every run).
pub const TEST_SHARED: &str = "plugin:switchboard-tests/test-shared/default";
/// `sb-test-runner` with one process per run.
pub const TEST_PER_RUN: &str = "plugin:switchboard-tests/test-per-run/default";
/// How long a test waits for something that should happen promptly.
pub const WAIT: Duration = Duration::from_secs(30);
/// Poll interval of the `wait_*` helpers.
const POLL: Duration = Duration::from_millis(20);

/// The repository root (the parent of the `tests` crate).
#[must_use]
pub fn repo_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// `target/<profile>` of the running test executable (`target/<profile>/deps/<test>`).
#[must_use]
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("the test executable lives in target/<profile>/deps")
        .to_path_buf()
}

/// A runner executable built by cargo, next to the test executable's directory. Panics with
/// the build command when it is missing.
#[must_use]
pub fn runner_binary(name: &str) -> PathBuf {
    let path = target_dir().join(name);
    assert!(
        path.is_file(),
        "runner binary {} is missing: build it first with `cargo build --workspace --bins` \
         (scripts/test does this before running the tests)",
        path.display()
    );
    path
}

/// Installs logging once per test process when `RUST_LOG` is set.
fn init_logging() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("RUST_LOG").is_some() {
            let config = sb_common::config::TelemetryConfig::default();
            let _ = sb_common::telemetry::init(&config);
        }
    });
}

/// Options of a [`TestCluster`]: an [`InMemoryHostBuilder`] with the runner plugins of
/// `runners/` and `tests/runners/`.
#[derive(Debug, Clone)]
pub struct ClusterBuilder {
    host: InMemoryHostBuilder,
}

impl Default for ClusterBuilder {
    fn default() -> Self {
        Self {
            host: InMemoryHost::builder()
                .runners_dir(repo_dir().join("runners"))
                .runners_dir(repo_dir().join("tests").join("runners")),
        }
    }
}

impl ClusterBuilder {
    /// Without the workspace-wide echo agent (the workspace starts with no agent).
    #[must_use]
    pub fn without_default_agent(mut self) -> Self {
        self.host = self.host.without_default_agent();
        self
    }

    /// Sets a configuration key (dotted, as in `switchboard.toml`), e.g.
    /// `("worker.slots", "2")`.
    #[must_use]
    pub fn config(mut self, key: &str, value: impl ToString) -> Self {
        self.host = self.host.config(key, value);
        self
    }

    /// Starts the cluster.
    pub async fn start(self) -> TestCluster {
        init_logging();
        let _ = runner_binary("echo");
        let _ = runner_binary("sb-test-runner");
        TestCluster::on(self.host.start().await)
    }
}

/// Gateway, orchestrator and worker in this process (see the crate docs): the library's
/// [`InMemoryHost`] and a [`Client`] of it.
pub struct TestCluster {
    host: InMemoryHost,
    client: Client,
}

impl std::fmt::Debug for TestCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCluster")
            .field("data_dir", &self.host.data_dir())
            .field("url", &self.client.base)
            .finish_non_exhaustive()
    }
}

impl TestCluster {
    /// A cluster with the default options.
    pub async fn embedded() -> Self {
        Self::builder().start().await
    }

    /// Options before starting.
    #[must_use]
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::default()
    }

    fn on(host: InMemoryHost) -> Self {
        let client = Client::new(&host.base_url(), host.api_key());
        Self { host, client }
    }

    /// The HTTP client (authenticated for workspace `default`).
    #[must_use]
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The running process.
    #[must_use]
    pub fn process(&self) -> &Embedded {
        self.host.process()
    }

    /// The stores of the cluster's database.
    #[must_use]
    pub fn stores(&self) -> &Stores {
        self.host.stores()
    }

    /// The data directory (SQLite file, API key).
    #[must_use]
    pub fn data_dir(&self) -> &Path {
        self.host.data_dir()
    }

    /// The configuration in use.
    #[must_use]
    pub fn config(&self) -> &SwitchboardConfig {
        self.host.config()
    }

    /// Stops the cluster (the same ordered drain as ctrl-c on `switchboard dev`).
    pub async fn shutdown(self) -> StopReport {
        self.host.shutdown().await
    }

    /// Stops the cluster, then starts a new one on the same data directory with the same
    /// options (what a user restarting `switchboard dev` gets).
    pub async fn restart(self) -> (StopReport, TestCluster) {
        let (report, host) = self.host.restart().await;
        (report, TestCluster::on(host))
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP client
// ---------------------------------------------------------------------------------------------

/// A completed run's path from the API's millisecond times: the event committed, the run
/// created (the event routed), claimed and ended, in order. Panics when a `*_ms` time is
/// missing, disagrees with its seconds field, or the order is broken.
#[track_caller]
pub fn assert_run_path_in_order(event: &Value, run: &Value) {
    let at = |view: &Value, field: &str| {
        let ms = view[format!("{field}_ms")]
            .as_i64()
            .unwrap_or_else(|| panic!("{field}_ms missing: {view}"));
        assert_eq!(
            ms.div_euclid(1000),
            view[field].as_i64().unwrap_or_default(),
            "{field}"
        );
        ms
    };
    let path = [
        at(event, "created_at"),
        at(run, "created_at"),
        at(run, "started_at"),
        at(run, "ended_at"),
    ];
    assert!(path.windows(2).all(|w| w[0] <= w[1]), "{path:?}");
}

/// The body of a `message.received` event from user `u1` in `conversation`.
#[must_use]
pub fn message(conversation: &str, text: &str) -> Value {
    json!({
        "event_type": "message.received",
        "source": "api",
        "conversation_id": conversation,
        "actor": {"actor_type": "user", "actor_id": "u1", "actor_name": "Tester"},
        "input": {"text": text},
    })
}

/// A response: status, headers and the JSON body (`Value::Null` for an empty body, a JSON
/// string for a body that is not JSON).
#[derive(Debug, Clone)]
pub struct ApiResponse {
    /// HTTP status.
    pub status: u16,
    /// Headers.
    pub headers: HeaderMap,
    /// Body.
    pub body: Value,
}

impl ApiResponse {
    /// `body[key]` as a string; panics with the whole response when absent.
    #[must_use]
    pub fn str(&self, key: &str) -> &str {
        self.body[key]
            .as_str()
            .unwrap_or_else(|| panic!("no string `{key}` in {} {}", self.status, self.body))
    }

    /// Panics unless the status is `status`.
    #[track_caller]
    pub fn expect(self, status: u16) -> Self {
        assert_eq!(self.status, status, "unexpected response: {}", self.body);
        self
    }
}

/// Where a result stream starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StreamFrom {
    /// From the first item.
    #[default]
    Start,
    /// `?after_sequence=N`.
    AfterSequence(u64),
    /// The `Last-Event-ID: N` header (how a reconnecting `EventSource` resumes).
    LastEventId(u64),
}

/// A client of the gateway's HTTP API.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    key: Option<String>,
}

impl Client {
    /// A client of `base` (`http://host:port`) authenticating with `key`.
    #[must_use]
    pub fn new(base: &str, key: &str) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: base.trim_end_matches('/').to_owned(),
            key: Some(key.to_owned()),
        }
    }

    /// The same client with another key, or none.
    #[must_use]
    pub fn with_key(&self, key: Option<&str>) -> Self {
        Self {
            key: key.map(str::to_owned),
            ..self.clone()
        }
    }

    /// The base URL.
    #[must_use]
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// The API key, if any (what a command-line client of the same workspace would use).
    #[must_use]
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let builder = self.http.request(method, format!("{}{path}", self.base));
        match &self.key {
            Some(key) => builder.bearer_auth(key),
            None => builder,
        }
    }

    async fn send(builder: reqwest::RequestBuilder) -> ApiResponse {
        let response = tokio::time::timeout(WAIT, builder.send())
            .await
            .expect("the request timed out")
            .expect("the request failed");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let bytes = response.bytes().await.expect("response body");
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        ApiResponse {
            status,
            headers,
            body,
        }
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> ApiResponse {
        Self::send(self.request(reqwest::Method::GET, path)).await
    }

    /// `POST path` with a JSON body.
    pub async fn post(&self, path: &str, body: &Value) -> ApiResponse {
        Self::send(self.request(reqwest::Method::POST, path).json(body)).await
    }

    /// `DELETE path`.
    pub async fn delete(&self, path: &str) -> ApiResponse {
        Self::send(self.request(reqwest::Method::DELETE, path)).await
    }

    /// `PATCH path` with a JSON body.
    pub async fn patch(&self, path: &str, body: &Value) -> ApiResponse {
        Self::send(self.request(reqwest::Method::PATCH, path).json(body)).await
    }

    /// `POST /v1/agents`.
    pub async fn create_agent(&self, body: &Value) -> ApiResponse {
        self.post("/v1/agents", body).await
    }

    /// Creates an enabled agent for `message.received` in `conversation` only, bound to
    /// `runner_id`; returns its id. Panics unless the API answers `201`.
    pub async fn conversation_agent(&self, conversation: &str, runner_id: &str) -> String {
        let response = self
            .create_agent(&json!({
                "name": format!("agent-{conversation}"),
                "runner_id": runner_id,
                "scope": {"conversation_id": conversation},
            }))
            .await
            .expect(201);
        response.str("agent_id").to_owned()
    }

    /// `POST /v1/events`, with an `Idempotency-Key` header when given.
    pub async fn post_event(&self, body: &Value, idempotency_key: Option<&str>) -> ApiResponse {
        let mut builder = self.request(reqwest::Method::POST, "/v1/events").json(body);
        if let Some(key) = idempotency_key {
            builder = builder.header("idempotency-key", key);
        }
        Self::send(builder).await
    }

    /// Posts a `message.received` into `conversation`; returns the event id. Panics unless
    /// the gateway accepts it (`202`).
    pub async fn send_message(&self, conversation: &str, text: &str) -> EventId {
        let response = self
            .post_event(&message(conversation, text), None)
            .await
            .expect(202);
        response.str("event_id").parse().expect("an event id")
    }

    /// `GET /v1/events/{id}` (must exist).
    pub async fn get_event(&self, event_id: EventId) -> Value {
        self.get(&format!("/v1/events/{event_id}"))
            .await
            .expect(200)
            .body
    }

    /// Polls the event until it has left `received` (routed), and returns it.
    pub async fn wait_routed(&self, event_id: EventId) -> Value {
        wait_for(&format!("event {event_id} to be routed"), || async {
            let event = self.get_event(event_id).await;
            // `scheduled`: a delayed event not due yet.
            (!matches!(event["status"].as_str(), Some("received" | "scheduled"))).then_some(event)
        })
        .await
    }

    /// Waits until the event is routed to a run, and returns the run id. Panics when the
    /// event ends in another status.
    pub async fn run_of(&self, event_id: EventId) -> RunId {
        let event = self.wait_routed(event_id).await;
        assert_eq!(
            event["status"], "dispatched",
            "event not dispatched: {event}"
        );
        event["run_id"]
            .as_str()
            .expect("a dispatched event has a run")
            .parse()
            .expect("a run id")
    }

    /// `GET /v1/runs/{id}` (must exist).
    pub async fn get_run(&self, run_id: RunId) -> Value {
        self.get(&format!("/v1/runs/{run_id}"))
            .await
            .expect(200)
            .body
    }

    /// Polls the run until its status is terminal, and returns it.
    pub async fn wait_run_terminal(&self, run_id: RunId) -> Value {
        wait_for(&format!("run {run_id} to end"), || async {
            let run = self.get_run(run_id).await;
            let status = run["status"].as_str().unwrap_or_default();
            (!matches!(status, "queued" | "running")).then_some(run)
        })
        .await
    }

    /// Every result item of the run after `after_sequence`, following the pages of
    /// `GET /v1/runs/{id}/events`.
    pub async fn run_events(&self, run_id: RunId, after_sequence: u64) -> Vec<AgentRunResult> {
        let mut items = Vec::new();
        let mut after = after_sequence;
        loop {
            let page = self
                .get(&format!(
                    "/v1/runs/{run_id}/events?after_sequence={after}&limit=100"
                ))
                .await
                .expect(200)
                .body;
            let batch: Vec<AgentRunResult> =
                serde_json::from_value(page["items"].clone()).expect("result items");
            items.extend(batch);
            match page["next_cursor"].as_str() {
                Some(next) if page["has_more"] == true => {
                    after = next
                        .parse()
                        .expect("the cursor of run events is a sequence");
                }
                _ => return items,
            }
        }
    }

    /// Opens `GET /v1/runs/{id}/stream`.
    pub async fn stream_run(&self, run_id: RunId, from: StreamFrom) -> SseStream {
        let mut path = format!("/v1/runs/{run_id}/stream");
        let mut builder = match from {
            StreamFrom::AfterSequence(n) => {
                path.push_str(&format!("?after_sequence={n}"));
                self.request(reqwest::Method::GET, &path)
            }
            StreamFrom::LastEventId(n) => self
                .request(reqwest::Method::GET, &path)
                .header("last-event-id", n.to_string()),
            StreamFrom::Start => self.request(reqwest::Method::GET, &path),
        };
        builder = builder.header("accept", "text/event-stream");
        SseStream::open(builder).await
    }

    /// Opens an SSE `GET path` (e.g. `/v1/conversations/{id}/stream`), with `Last-Event-ID`
    /// when given.
    pub async fn open_stream(&self, path: &str, last_event_id: Option<&str>) -> SseStream {
        let mut builder = self
            .request(reqwest::Method::GET, path)
            .header("accept", "text/event-stream");
        if let Some(id) = last_event_id {
            builder = builder.header("last-event-id", id);
        }
        SseStream::open(builder).await
    }

    /// The conversation's transcript, oldest first (every page).
    pub async fn transcript(&self, conversation: &str) -> Vec<Value> {
        let mut items = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let mut path =
                format!("/v1/conversations/{conversation}/transcript?direction=forward&limit=100");
            if let Some(c) = &cursor {
                path.push_str(&format!("&cursor={c}"));
            }
            let page = self.get(&path).await.expect(200).body;
            items.extend(page["items"].as_array().cloned().unwrap_or_default());
            match page["next_cursor"].as_str() {
                Some(next) if page["has_more"] == true => cursor = Some(next.to_owned()),
                _ => return items,
            }
        }
    }
}

/// Calls `probe` every few milliseconds until it returns `Some`, at most [`WAIT`]; panics
/// naming `what` on timeout.
pub async fn wait_for<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(POLL).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Server-sent events
// ---------------------------------------------------------------------------------------------

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseFrame {
    /// `id:` (the result sequence for result frames).
    pub id: Option<String>,
    /// `event:` (`message` when absent).
    pub event: String,
    /// `data:` lines joined with `\n`.
    pub data: String,
}

impl SseFrame {
    /// The data as JSON.
    #[must_use]
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.data)
            .unwrap_or_else(|e| panic!("frame data is not JSON ({e}): {}", self.data))
    }

    /// The data as a result item.
    #[must_use]
    pub fn result(&self) -> AgentRunResult {
        serde_json::from_str(&self.data)
            .unwrap_or_else(|e| panic!("frame data is not a result ({e}): {}", self.data))
    }

    /// The `id:` as a sequence number.
    #[must_use]
    pub fn sequence(&self) -> u64 {
        self.id
            .as_deref()
            .and_then(|id| id.parse().ok())
            .unwrap_or_else(|| panic!("frame without a numeric id: {self:?}"))
    }

    /// `run.completed` or `run.failed`.
    #[must_use]
    pub fn is_terminal(&self) -> bool {
        matches!(self.event.as_str(), "run.completed" | "run.failed")
    }
}

/// Incremental parser of a `text/event-stream` body: the workspace's one event-stream reader
/// ([`sb_common::sse::SseParser`], the WHATWG rules: `LF`, `CRLF` or `CR` line ends,
/// comments, multi-line data, a last event id that persists, frames without data dropped),
/// handing out [`SseFrame`]s. A line or event over its cap fails the test.
#[derive(Debug, Default)]
pub struct SseParser {
    inner: sb_common::sse::SseParser,
    scratch: Vec<sb_common::sse::SseEvent>,
}

impl SseParser {
    /// Feeds bytes; returns the frames they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseFrame> {
        if let Err(error) = self.inner.push(bytes, &mut self.scratch) {
            panic!("the event stream broke the parser: {error}");
        }
        self.scratch.drain(..).map(SseFrame::from).collect()
    }
}

impl From<sb_common::sse::SseEvent> for SseFrame {
    fn from(event: sb_common::sse::SseEvent) -> Self {
        Self {
            id: event.id,
            event: event.event,
            data: event.data,
        }
    }
}

/// An open result stream.
pub struct SseStream {
    /// Status and headers of the response.
    pub status: u16,
    /// Headers.
    pub headers: HeaderMap,
    body: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    parser: SseParser,
    pending: std::collections::VecDeque<SseFrame>,
    ended: bool,
}

impl std::fmt::Debug for SseStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SseStream")
            .field("status", &self.status)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl SseStream {
    async fn open(builder: reqwest::RequestBuilder) -> Self {
        let response = tokio::time::timeout(WAIT, builder.send())
            .await
            .expect("the stream request timed out")
            .expect("the stream request failed");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        Self {
            status,
            headers,
            body: response.bytes_stream().boxed(),
            parser: SseParser::default(),
            pending: std::collections::VecDeque::new(),
            ended: false,
        }
    }

    /// The next frame; `None` when the server ended the stream. Panics after [`WAIT`]
    /// without a frame.
    pub async fn next_frame(&mut self) -> Option<SseFrame> {
        loop {
            if let Some(frame) = self.pending.pop_front() {
                return Some(frame);
            }
            if self.ended {
                return None;
            }
            match tokio::time::timeout(WAIT, self.body.next())
                .await
                .expect("no stream frame arrived in time")
            {
                Some(Ok(bytes)) => self.pending.extend(self.parser.push(&bytes)),
                Some(Err(error)) => panic!("the stream broke: {error}"),
                None => {
                    // A final frame not followed by a blank line is incomplete: dropped, as
                    // a browser would.
                    self.ended = true;
                }
            }
        }
    }

    /// Frames until (and including) a terminal result or an `error` frame, then checks that
    /// the server ends the stream.
    pub async fn until_terminal(mut self) -> Vec<SseFrame> {
        let mut frames = Vec::new();
        while let Some(frame) = self.next_frame().await {
            let last = frame.is_terminal() || frame.event == "error";
            frames.push(frame);
            if last {
                let after = self.next_frame().await;
                assert!(after.is_none(), "a frame after the terminal one: {after:?}");
                return frames;
            }
        }
        panic!("the stream ended without a terminal frame: {frames:?}");
    }

    /// The first `n` frames; the connection is then dropped (a client going away).
    pub async fn take(mut self, n: usize) -> Vec<SseFrame> {
        let mut frames = Vec::with_capacity(n);
        while frames.len() < n {
            match self.next_frame().await {
                Some(frame) => frames.push(frame),
                None => panic!(
                    "the stream ended after {} of {n} frames: {frames:?}",
                    frames.len()
                ),
            }
        }
        frames
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_frames_split_anywhere() {
        let text = ": keep-alive\n\nid: 1\nevent: message.delta\ndata: {\"a\":1}\n\nid: 2\r\nevent: run.completed\r\ndata: x\r\ndata:y\r\n\r\n";
        for split in 0..text.len() {
            let mut parser = SseParser::default();
            let mut frames = parser.push(&text.as_bytes()[..split]);
            frames.extend(parser.push(&text.as_bytes()[split..]));
            assert_eq!(
                frames,
                vec![
                    SseFrame {
                        id: Some("1".into()),
                        event: "message.delta".into(),
                        data: "{\"a\":1}".into()
                    },
                    SseFrame {
                        id: Some("2".into()),
                        event: "run.completed".into(),
                        data: "x\ny".into()
                    },
                ],
                "split at {split}"
            );
        }
    }

    #[test]
    fn frames_without_data_and_default_event_names() {
        let mut parser = SseParser::default();
        assert!(parser.push(b"event: nothing\n\n").is_empty());
        let frames = parser.push(b"data: hi\n\n");
        assert_eq!(frames[0].event, "message");
        assert_eq!(frames[0].id, None);
        assert!(!frames[0].is_terminal());
        // The last event id persists (WHATWG), also across a block without data.
        assert!(parser.push(b"id: 7\n\n").is_empty());
        assert_eq!(parser.push(b"data: again\n\n")[0].id.as_deref(), Some("7"));
    }

    #[test]
    fn cr_only_streams_end_their_last_frame() {
        let text = "id: 1\revent: run.completed\rdata: {}\r\r";
        for split in 0..=text.len() {
            let mut parser = SseParser::default();
            let mut frames = parser.push(&text.as_bytes()[..split]);
            frames.extend(parser.push(&text.as_bytes()[split..]));
            assert_eq!(frames.len(), 1, "split at {split}");
            assert!(frames[0].is_terminal());
        }
    }
}
